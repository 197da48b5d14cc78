#!/usr/bin/env python3
"""Medians of bench/ab_decode.sh's runs: per point (set, dtype, D, heads, layout, B, cache) the median us per call of
each build, and the first build's over each other's (> 1: the other is faster), with the other's per-run values.

    bench/ab_summary.py AB_DIR [--json MERGED.json]
AB_DIR holds NAME-sSET-rROUND.json files of flashattn_decode_bench; --json writes them merged (file name -> JSON).
"""
import argparse
import json
import pathlib
import re
import statistics
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--json")
    args = ap.parse_args()
    files = {}
    times = {}  # point -> build -> [us per run]
    builds = []
    for path in sorted(pathlib.Path(args.dir).glob("*.json")):
        m = re.fullmatch(r"(.+)-s(\d+)-r(\d+)\.json", path.name)
        if not m:
            continue
        build, s = m.group(1), int(m.group(2))
        data = json.loads(path.read_text())
        files[path.name] = data
        if build not in builds:
            builds.append(build)
        c = data["config"]
        kv = "fp8" if c["kv_cache"] == "fp8" else c["dtype"]
        for p in data["points"]:
            if p.get("error"):
                print(f"{path.name}: {p['layout']} B={p['batch']} S={p['cache']}: {p['error']}", file=sys.stderr)
                continue
            key = (s, kv, c["dim"], f"{c['heads_q']}/{c['heads_k']}", p["layout"], p["batch"], p["cache"], p["runner"])
            times.setdefault(key, {}).setdefault(build, []).append(p["us_per_call"])
    if not builds:
        sys.exit(f"no NAME-sSET-rROUND.json in {args.dir}")
    base = builds[0]
    for key in sorted(times, key=lambda k: (k[0], k[4] != "contiguous", k[4], k[5], k[6], k[7])):
        s, kv, dim, heads, layout, b, cache, runner = key
        t = times[key]
        line = f"s{s} {kv:4} D{dim:<3} {heads:5} {layout:10} B={b:<4} S={cache:<6}"
        if runner != "lib":
            line += f" {runner}"
        med = {n: statistics.median(v) for n, v in t.items()}
        for n in builds:
            if n in med:
                line += f"  {n} {med[n]:8.2f}"
        for n in builds[1:]:
            if n in med and base in med:
                line += f"  {base}/{n} {med[base] / med[n]:.3f}  [{' '.join(f'{v:.2f}' for v in t[n])}]"
        print(line)
    ratios = {n: [] for n in builds[1:]}
    for t in times.values():
        for n in builds[1:]:
            if n in t and base in t:
                ratios[n].append(statistics.median(t[base]) / statistics.median(t[n]))
    for n, r in ratios.items():
        if r:
            geo = statistics.geometric_mean(r)
            print(f"{base}/{n}: {len(r)} points, geometric mean {geo:.4f}, range {min(r):.3f}-{max(r):.3f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(files))


if __name__ == "__main__":
    main()
