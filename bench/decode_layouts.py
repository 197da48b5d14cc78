"""Per point (B, S) of a flashattn_decode_bench JSON file, each layout's median us per call over its rounds and the
ratio contiguous / layout (> 1: the layout is faster), with the same ratio of the read-only layout floors in brackets.

    python3 bench/decode_layouts.py RESULT.json
"""
import json
import statistics as st
import sys
from collections import defaultdict

points = json.load(open(sys.argv[1]))["points"]
us, floor = defaultdict(list), defaultdict(list)
layouts = []
for r in points:
    if r.get("error"):
        continue
    key = (r["batch"], r["cache"], r["layout"])
    us[key].append(r["us_per_call"])
    floor[key].append(r["us_layout_floor"])
    if r["layout"] not in layouts:
        layouts.append(r["layout"])
print("B/S".ljust(10) + "".join(name.rjust(22) for name in layouts) + "   (us, contiguous / layout [layout floors])")
for b, s in sorted({k[:2] for k in us}):
    base, base_floor = st.median(us[(b, s, "contiguous")]), st.median(floor[(b, s, "contiguous")])
    line = f"{b}/{s}".ljust(10)
    for name in layouts:
        u, f = st.median(us[(b, s, name)]), st.median(floor[(b, s, name)])
        line += f"{u:8.2f} {base / u:.3f}[{base_floor / f:.3f}]".rjust(22)
    print(line)
