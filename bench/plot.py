#!/usr/bin/env python3
"""Plots a GPU run's results (needs matplotlib; run on any machine):
  python3 bench/plot.py OURS.json PEERS.json MEMORY_OURS.json MEMORY_PEERS.json OUT_PREFIX
writes OUT_PREFIX-tflops.png (TFLOP/s against S, one panel per (D, causal), forward and backward,
ours beside the torch SDPA backends of the same run) and OUT_PREFIX-memory.png (peak device memory of
forward + backward against S: flashattn against the materialised math path).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ours, peers, mem_ours, mem_peers, prefix = sys.argv[1:6]
    ours, peers = json.load(open(ours)), json.load(open(peers))
    mem_ours, mem_peers = json.load(open(mem_ours)), json.load(open(mem_peers))
    by_key = {(p["dtype"], p["D"], p["S"], p["causal"]): p for p in peers["sdpa"]}
    dims = sorted({p["D"] for p in ours["points"]})
    fig, axes = plt.subplots(2, 2 * len(dims), figsize=(5 * len(dims) * 2, 8), sharex=True)
    for col, (d, causal) in enumerate([(d, c) for d in dims for c in (False, True)]):
        pts = sorted((p for p in ours["points"] if p["dtype"] == "bf16" and p["D"] == d and p["causal"] == causal),
                     key=lambda p: p["S"])
        s = [p["S"] for p in pts]
        for row, kind in enumerate(("fwd", "bwd")):
            ax = axes[row][col]
            ax.plot(s, [p[f"{kind}_tflops"] for p in pts], "o-", label="flashattn", linewidth=2)
            for name, style in (("flash", "s--"), ("cudnn", "^--"), ("efficient", "v:")):
                ys = [by_key.get(("bf16", d, x, causal), {}).get(f"{name}_{kind}") for x in s]
                if any(y is not None for y in ys):
                    ax.plot(s, ys, style, label={"flash": "torch flash (FA2)", "cudnn": "torch cuDNN",
                                                 "efficient": "torch efficient"}[name])
            ax.set_xscale("log", base=2)
            ax.set_title(f"bf16 {kind} D={d}{' causal' if causal else ''}")
            ax.set_ylabel("TFLOP/s")
            ax.set_xlabel("S (B = 16384 / S, H = 2048 / D)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"{ours['env']['gpu']}, {ours['env']['date']}, torch {peers['env']['torch']} (same run)")
    fig.tight_layout()
    fig.savefig(f"{prefix}-tflops.png", dpi=80)

    fig, ax = plt.subplots(figsize=(7, 5))
    s = [p["S"] for p in mem_ours["points"]]
    ax.plot(s, [p["peak_bytes"] / 2 ** 30 for p in mem_ours["points"]], "o-", label="flashattn (fwd + bwd)")
    for name, style in (("math", "s--"), ("flash", "^:")):
        pts = [(p["S"], p[f"{name}_peak_bytes"]) for p in mem_peers["memory"] if p.get(f"{name}_peak_bytes")]
        ax.plot([x for x, _ in pts], [y / 2 ** 30 for _, y in pts], style,
                label={"math": "torch math (materialised scores)", "flash": "torch flash"}[name])
    oom = [p["S"] for p in mem_peers["memory"] if p.get("math_error")]
    if oom:
        ax.axvline(oom[0], color="gray", linestyle=":", label=f"math: out of memory from S={oom[0]}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("S (B = 1, H = 16, D = 128, bf16)")
    ax.set_ylabel("peak device memory (GiB)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("forward + backward peak memory: O(S) against O(S^2)")
    fig.tight_layout()
    fig.savefig(f"{prefix}-memory.png", dpi=80)


if __name__ == "__main__":
    main()
