#!/usr/bin/env python3
"""Prints flashattn's TFLOP/s beside the peers' for each point of the sweep (same run, same GPU).

  python3 bench/compare.py ours.json peers.json
"""
import json
import sys


def main():
    ours = json.load(open(sys.argv[1]))
    peers = json.load(open(sys.argv[2])) if len(sys.argv) > 2 else {"env": {}, "sdpa": []}
    by_key = {(p["dtype"], p["D"], p["S"], p["causal"]): p for p in peers.get("sdpa", [])}
    print(f"ours: {ours['env']}")
    print(f"peers: {peers.get('env')}")
    print(f"{'dtype':5s} {'D':>4s} {'S':>6s} {'causal':>6s} | {'fwd':>6s} {'FA2':>6s} {'cuDNN':>6s} {'ratio':>6s} | "
          f"{'bwd':>6s} {'FA2':>6s} {'cuDNN':>6s} {'ratio':>6s}")
    for p in ours["points"]:
        peer = by_key.get((p["dtype"], p["D"], p["S"], p["causal"]), {})
        fa2_f, cud_f = peer.get("flash_fwd", 0), peer.get("cudnn_fwd", 0)
        fa2_b, cud_b = peer.get("flash_bwd", 0), peer.get("cudnn_bwd", 0)
        rf = p["fwd_tflops"] / fa2_f if fa2_f else 0
        rb = p["bwd_tflops"] / fa2_b if fa2_b else 0
        print(f"{p['dtype']:5s} {p['D']:4d} {p['S']:6d} {str(p['causal']):>6s} | {p['fwd_tflops']:6.1f} {fa2_f:6.1f} "
              f"{cud_f:6.1f} {rf:6.2f} | {p['bwd_tflops']:6.1f} {fa2_b:6.1f} {cud_b:6.1f} {rb:6.2f}")
    print("ratio = ours / torch SDPA flash (FlashAttention-2), same run")


if __name__ == "__main__":
    main()
