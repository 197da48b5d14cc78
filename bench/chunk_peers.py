#!/usr/bin/env python3
"""Few query rows over many keys, ours beside torch SDPA in one run: a chunk of a prompt after a long cached prefix,
speculative tokens, a short query over a long context. These are the calls whose unsplit forward grid leaves SMs idle
(src/cuda/sm80/forward_split.hpp).

    bench/chunk_peers.py --flashattn build-gpu/tools/flashattn [--json OUT.json]
                         [--seqlens-q 16,64,128,256,512,1024] [--seqlens-k 8192,32768] [--heads 32 --heads-k 8]

B = 1, D = 128, bf16, no mask (torch's is_causal aligns top-left, ours bottom-right; with Sq << Sk the causal mask
changes a few keys only, so both run unmasked). Ours: `flashattn run --backend cuda` (median of its timed calls; the
kernel and split count from its JSON). torch: F.scaled_dot_product_attention under one backend each, flash (FA2) and
cuDNN, with enable_gqa (K/V of Hk heads; where a backend refuses that, K/V repeated to Hq heads, marked "x"), median of
CUDA-event timings of single calls. Prints a table, ours / best peer as a speed ratio (> 1: ours faster).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def ours(tool, sq, sk, hq, hk, iters):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.json")
        cmd = [tool, "run", "--backend", "cuda", "--dtype", "bf16", "--seqlen-q", str(sq), "--seqlen-k", str(sk),
               "--heads", str(hq), "--heads-k", str(hk), "--head-dim", "128", "--iters", str(iters), "--warmup", "3",
               "--seed", "1", "--json", path]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            r = json.load(f)
    return r["forward_ms"] * 1e3, r.get("forward_kernel", ""), r.get("forward_splits", 1)


def peers(sq, sk, hq, hk, iters):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, hq, sq, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, hk, sk, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, hk, sk, 128, device="cuda", dtype=torch.bfloat16)

    def median_us(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(iters):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        times.sort()
        return times[len(times) // 2]

    out = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        out[name] = None
        for gqa in (True, False):
            kk, vv = (k, v) if gqa else (k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1))
            try:
                with sdpa_kernel(backend):
                    t = median_us(lambda: F.scaled_dot_product_attention(q, kk, vv, enable_gqa=gqa))
                out[name] = (t, "" if gqa else "x")
                break
            except RuntimeError:
                continue
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flashattn", required=True, help="the flashattn command-line tool (a CUDA build)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--seqlens-q", default="16,64,128,256,512,1024")
    parser.add_argument("--seqlens-k", default="8192,32768")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--heads-k", type=int, default=8)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    import torch
    import warnings

    warnings.filterwarnings("ignore")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; "
          f"B = 1, Hq {args.heads} / Hk {args.heads_k}, D = 128, bf16, no mask; us per call")
    print(f"{'Sq':>5} {'Sk':>6} {'ours':>8} {'splits':>6} {'flash':>8} {'cudnn':>8} {'ours/best':>9}  kernel")
    rows = []
    for sk in [int(x) for x in args.seqlens_k.split(",")]:
        for sq in [int(x) for x in args.seqlens_q.split(",")]:
            t, kernel, splits = ours(args.flashattn, sq, sk, args.heads, args.heads_k, args.iters)
            p = peers(sq, sk, args.heads, args.heads_k, args.iters)
            best = min(v[0] for v in p.values() if v is not None) if any(p.values()) else None
            ratio = best / t if best else float("nan")
            cell = lambda v: f"{v[0]:7.1f}{v[1] or ' '}" if v else "    n/a "
            print(f"{sq:>5} {sk:>6} {t:8.1f} {splits:>6} {cell(p['flash'])} {cell(p['cudnn'])} {ratio:9.3f}  {kernel}",
                  flush=True)
            rows.append({"Sq": sq, "Sk": sk, "Hq": args.heads, "Hk": args.heads_k, "ours_us": t, "kernel": kernel,
                         "splits": splits, "flash_us": p["flash"][0] if p["flash"] else None,
                         "cudnn_us": p["cudnn"][0] if p["cudnn"] else None, "ours_over_best": ratio})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
