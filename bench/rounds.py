#!/usr/bin/env python3
"""Ours against FlashAttention-2 (torch SDPA "flash") in alternating rounds, for points where one run's ratio
is inside the run-to-run spread.

One run of flashattn_cuda_bench and one of peers.py measure the same points minutes apart; on the lent H200 a
point moves by up to 10% between runs at S = 512-1k and about 2% from S = 4k (docs/PERFORMANCE.md), for us and
for FA2. Here the two processes alternate, ours then FA2, `--rounds` times on the same points, and the table
gives per point and direction the median of the rounds' ratios ours / FA2 with their range: a ratio is a
result only when its whole range stays on one side of 1.00.

  python3 bench/rounds.py --bench build-gpu/bench/flashattn_cuda_bench --out DIR [--rounds 3]
                          [--dtypes bf16,f16] [--dims 128,256] [--seqlens 512,...,16384] [--causal 0,1]
                          [--warmup-ms 300]
  python3 bench/rounds.py --table DIR/rounds.json     (the table again, from a run's JSON)

Each point warms up for --warmup-ms (both processes alike) before it is timed: the H200 runs these shapes at its
700 W power cap, and a point timed right after seconds of heavier points runs at a clock those points lowered
(fp16 D = 128 causal 16k backward: 287-298 TFLOP/s after the D = 64 / 128 points, 304-309 alone; H200,
2026-12-01 04:47 UTC), so with 3 warm-up calls only a point's ratio depended on the points swept before it.
--warmup-ms 0 gives the earlier method.

Writes DIR/round-N-ours.json, DIR/round-N-peers.json and DIR/rounds.json (per point: every round's TFLOP/s
and ratios, their medians); prints the table last.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def key(dtype, d, s, causal):
    return (dtype, int(d), int(s), bool(causal))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench", help="flashattn_cuda_bench binary")
    ap.add_argument("--out")
    ap.add_argument("--table", help="print the table of a saved rounds.json and exit")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", default="bf16,f16")
    ap.add_argument("--dims", default="128,256")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--warmup-ms", default="300", help="warm-up per point and direction, both processes (ms)")
    args = ap.parse_args()
    if args.table:
        return reprint(args.table)
    if not args.bench or not args.out:
        ap.error("--bench and --out are needed to measure")
    os.makedirs(args.out, exist_ok=True)
    sweep = ["--dtypes", args.dtypes, "--dims", args.dims, "--seqlens", args.seqlens, "--causal", args.causal,
             "--warmup-ms", args.warmup_ms]
    table = {}  # key -> {"ours_fwd": [...], "fa2_fwd": [...], ...}
    dates = []
    for r in range(args.rounds):
        ours_json = os.path.join(args.out, f"round-{r}-ours.json")
        peers_json = os.path.join(args.out, f"round-{r}-peers.json")
        subprocess.run([args.bench, "--json", ours_json] + sweep, check=True, stdout=subprocess.DEVNULL)
        subprocess.run([sys.executable, os.path.join(HERE, "peers.py"), "--json", peers_json, "--backends", "flash"] + sweep,
                       check=True, stdout=subprocess.DEVNULL)
        ours, peers = json.load(open(ours_json)), json.load(open(peers_json))
        dates.append(peers["env"].get("date"))
        fa2 = {key(p["dtype"], p["D"], p["S"], p["causal"]): p for p in peers["sdpa"]}
        for p in ours["points"]:
            k = key(p["dtype"], p["D"], p["S"], p["causal"])
            row = table.setdefault(k, {})
            peer = fa2.get(k, {})
            for direction in ("fwd", "bwd"):
                mine, theirs = p.get(f"{direction}_tflops", 0) or 0, peer.get(f"flash_{direction}", 0) or 0
                row.setdefault(f"ours_{direction}", []).append(mine)
                row.setdefault(f"fa2_{direction}", []).append(theirs)
                row.setdefault(f"ratio_{direction}", []).append(mine / theirs if mine > 0 and theirs > 0 else 0)
        print(f"round {r + 1} of {args.rounds} done ({dates[-1]})", file=sys.stderr, flush=True)

    points = print_table(table, args.rounds, dates)
    with open(os.path.join(args.out, "rounds.json"), "w") as f:
        json.dump({"rounds": args.rounds, "warmup_ms": float(args.warmup_ms), "dates": dates, "points": points}, f,
                  indent=1)


def print_table(table, rounds, dates):
    points, below = [], {"fwd": 0, "bwd": 0}
    print(f"ours / FA2 over {rounds} alternating rounds (median [min, max]); GPU rounds {dates[0]} .. {dates[-1]}")
    print(f"{'dtype':5s} {'D':>4s} {'S':>6s} {'causal':>6s} | {'fwd':>6s} {'FA2':>6s} {'ratio':>22s} | "
          f"{'bwd':>6s} {'FA2':>6s} {'ratio':>22s}")
    for k in sorted(table):
        row = table[k]
        point = {"dtype": k[0], "D": k[1], "S": k[2], "causal": k[3]}
        cells = []
        for direction in ("fwd", "bwd"):
            ratios = [x for x in row[f"ratio_{direction}"] if x > 0]
            med = statistics.median(ratios) if ratios else 0
            point.update({f"ours_{direction}": row[f"ours_{direction}"], f"fa2_{direction}": row[f"fa2_{direction}"],
                          f"ratio_{direction}": row[f"ratio_{direction}"], f"ratio_{direction}_median": med})
            below[direction] += 0 < med < 1.0
            mark = "" if not ratios else (" <1" if max(ratios) < 1.0 else (" ~" if min(ratios) < 1.0 else ""))
            cells.append(f"{statistics.median(row[f'ours_{direction}']):6.1f} {statistics.median(row[f'fa2_{direction}']):6.1f} "
                         + (f"{med:5.3f} [{min(ratios):5.3f}, {max(ratios):5.3f}]{mark:3s}" if ratios else f"{'-':>22s}"))
        points.append(point)
        print(f"{k[0]:5s} {k[1]:4d} {k[2]:6d} {str(k[3]):>6s} | {cells[0]} | {cells[1]}")
    print(f"median ratio below 1.00: forward {below['fwd']} of {len(table)}, backward {below['bwd']} of {len(table)}; "
          "'<1': every round below, '~': the rounds straddle 1.00")
    return points


def reprint(path):
    saved = json.load(open(path))
    table = {key(p["dtype"], p["D"], p["S"], p["causal"]): {k: v for k, v in p.items() if isinstance(v, list)}
             for p in saved["points"]}
    print_table(table, saved["rounds"], saved["dates"])


if __name__ == "__main__":
    main()
