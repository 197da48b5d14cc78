#!/usr/bin/env python3
"""The CPU backend beside torch's CPU scaled_dot_product_attention (its fused flash kernel, on the
BLAS torch ships with: MKL on x86 wheels), on the same machine, in alternating rounds.

  python3 bench/cpu_peers.py --flashattn build-cpu/tools/flashattn --json cpu_peers.json
                             [--threads 2] [--rounds 3] [--points forward,backward,decode]

Ours runs through the `flashattn` command-line tool (the C++ API: `run` and `decode`, medians of
their timed calls); torch runs in this process with torch.set_num_threads(--threads), medians of
timed calls after warm-up. Each round runs every point, ours then torch's, so that both see the
machine of that minute (a shared machine's memory and clock move from round to round: compare
within a round). Layouts: ours (B, S, H, D); torch (B, H, S, D), each contiguous in its own layout.
GQA decode uses torch's enable_gqa. FLOPs: forward 4 B H Sq Sk D (half when causal), backward
2.5x forward (torch's backward is timed as forward + backward minus the forward of the same round).
Decode: K/V bytes read per second (B x S x Hk x 2D x element size).
"""
import argparse
import datetime
import json
import platform
import statistics
import subprocess
import tempfile
import time

import torch
import torch.nn.functional as F

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def forward_points():
    for dtype in ("f32", "bf16"):
        for causal in (False, True):
            for s in (1024, 4096):
                yield {"kind": "forward", "dtype": dtype, "causal": causal, "B": 1, "H": 16, "Hk": 16, "S": s, "D": 128}


def backward_points():
    for causal in (False, True):
        yield {"kind": "backward", "dtype": "f32", "causal": causal, "B": 1, "H": 16, "Hk": 16, "S": 2048, "D": 128}


def decode_points():
    yield {"kind": "decode", "dtype": "bf16", "B": 1, "H": 32, "Hk": 8, "S": 8192, "D": 128}
    yield {"kind": "decode", "dtype": "bf16", "B": 1, "H": 16, "Hk": 16, "S": 4096, "D": 128}
    yield {"kind": "decode", "dtype": "f32", "B": 1, "H": 32, "Hk": 8, "S": 8192, "D": 128}
    yield {"kind": "decode", "dtype": "bf16", "B": 16, "H": 32, "Hk": 8, "S": 4096, "D": 128}


def flops(pt, backward=False):
    f = 4.0 * pt["B"] * pt["H"] * pt["S"] * pt["S"] * pt["D"] * (0.5 if pt.get("causal") else 1.0)
    return 2.5 * f if backward else f


def kv_bytes(pt):
    return pt["B"] * pt["S"] * pt["Hk"] * 2 * pt["D"] * torch.finfo(DTYPES[pt["dtype"]]).bits // 8


def ours(tool, pt, threads, iters):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        common = ["--backend", "cpu", "--threads", str(threads), "--dtype", pt["dtype"], "--batch", str(pt["B"]),
                  "--heads", str(pt["H"]), "--heads-k", str(pt["Hk"]), "--head-dim", str(pt["D"]), "--seed", "1",
                  "--iters", str(iters), "--json", f.name]
        if pt["kind"] == "decode":
            cmd = [tool, "decode", "--cache", str(pt["S"])] + common
        else:
            cmd = [tool, "run", "--seqlen", str(pt["S"])] + common + (["--causal"] if pt["causal"] else [])
            if pt["kind"] == "backward":
                cmd.append("--backward")
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        r = json.load(open(f.name))
    if pt["kind"] == "decode":
        return r["us"] * 1e-3
    return r["backward_ms"] if pt["kind"] == "backward" else r["forward_ms"]


def median_ms(fn, iters, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def torch_sdpa(pt, iters):
    dt = DTYPES[pt["dtype"]]
    gen = torch.Generator().manual_seed(1)
    sq = 1 if pt["kind"] == "decode" else pt["S"]
    q = torch.randn(pt["B"], pt["H"], sq, pt["D"], generator=gen).to(dt)
    k = torch.randn(pt["B"], pt["Hk"], pt["S"], pt["D"], generator=gen).to(dt)
    v = torch.randn(pt["B"], pt["Hk"], pt["S"], pt["D"], generator=gen).to(dt)
    gqa = pt["Hk"] != pt["H"]
    causal = bool(pt.get("causal", False))
    if pt["kind"] != "backward":
        with torch.no_grad():
            return median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa), iters)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    dout = torch.randn(q.shape, generator=gen).to(dt)

    def both():
        q.grad = k.grad = v.grad = None
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(dout)

    total = median_ms(both, iters)
    with torch.no_grad():
        fwd = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), iters)
    return total - fwd


def rate(pt, ms):
    if pt["kind"] == "decode":
        return kv_bytes(pt) / (ms * 1e-3) / 1e9  # GB/s
    return flops(pt, pt["kind"] == "backward") / (ms * 1e-3) / 1e9  # GFLOP/s


def label(pt):
    if pt["kind"] == "decode":
        return f"decode {pt['dtype']} B={pt['B']} {pt['H']}/{pt['Hk']} S={pt['S']}"
    return f"{pt['kind']} {pt['dtype']} S={pt['S']}{' causal' if pt['causal'] else ''}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flashattn", required=True, help="path of the flashattn command-line tool")
    ap.add_argument("--json", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5, help="timed calls per point and round (decode: 4x)")
    ap.add_argument("--points", default="forward,backward,decode")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    makers = {"forward": forward_points, "backward": backward_points, "decode": decode_points}
    points = [pt for name in args.points.split(",") for pt in makers[name]()]
    rows = []
    for rnd in range(args.rounds):
        for pt in points:
            iters = args.iters * (4 if pt["kind"] == "decode" else 1)
            ms_ours = ours(args.flashattn, pt, args.threads, iters)
            ms_torch = torch_sdpa(pt, iters)
            row = dict(pt, round=rnd, ours_ms=ms_ours, torch_ms=ms_torch, speedup=ms_torch / ms_ours)
            rows.append(row)
            unit = "GB/s" if pt["kind"] == "decode" else "GFLOP/s"
            print(f"round {rnd} {label(pt):40s} ours {ms_ours:9.3f} ms ({rate(pt, ms_ours):6.1f} {unit})  "
                  f"torch {ms_torch:9.3f} ms ({rate(pt, ms_torch):6.1f})  ours / torch speed {ms_torch / ms_ours:.2f}x",
                  flush=True)
    meta = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.processor() or platform.machine(), "threads": args.threads,
            "torch": torch.__version__, "torch_blas": "mkl" if torch.backends.mkl.is_available() else "other"}
    json.dump({"meta": meta, "rows": rows}, open(args.json, "w"), indent=1)
    print(f"\n{'point':40s} | ours / torch speed per round (torch {torch.__version__}, {args.threads} threads)")
    for pt in points:
        ratios = [r["speedup"] for r in rows if all(r[k] == v for k, v in pt.items())]
        print(f"{label(pt):40s} | " + ", ".join(f"{x:.2f}" for x in ratios))


if __name__ == "__main__":
    main()
