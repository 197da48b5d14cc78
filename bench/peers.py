#!/usr/bin/env python3
"""Times the peers on the GPU machine, on the same standard sweep as flashattn_cuda_bench:
torch SDPA backends (flash = FlashAttention-2, cuDNN, memory-efficient), forward and forward+backward,
and a bf16 GEMM 8192^3 (the matrix ceiling of the same run). Writes JSON.

  python3 bench/peers.py --json peers.json [--dtypes bf16] [--dims 64,128,256] [--seqlens 512,...]
                        [--causal 0,1] [--backends flash,cudnn,efficient] [--no-backward] [--warmup-ms T]
  python3 bench/peers.py --memory --json memory.json
    peak device memory (torch.cuda.max_memory_allocated, inputs and gradients included) of forward +
    backward against S = 1k..128k (B = 1, H = 16, D = 128, bf16) for the math path (materialised scores)
    and the fused backends; a point that runs out of memory says so.

FLOPs as in DESIGN.md: forward 4 B H S^2 D (half when causal); backward 2.5x that. Times are medians
of CUDA-event timings after warm-up; inputs are random normal (never zeros).
"""
import argparse
import datetime
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

TOKENS = 16384
HIDDEN = 2048
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


WARMUP_MS = 0.0  # --warmup-ms: more warm-up calls until this many ms have passed (as flashattn_cuda_bench's)


def median_ms(fn, warmup=3, reps=10):
    start_wall = time.perf_counter()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    while (time.perf_counter() - start_wall) * 1e3 < WARMUP_MS:
        fn()
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def gemm_tflops(dtype):
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = median_ms(lambda: a @ b, warmup=3, reps=10)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def memory_sweep(json_path):
    h, d = 16, 128
    points = []
    for s in [1024 * 2 ** n for n in range(8)]:
        point = {"S": s}
        for name, backend in [("math", SDPBackend.MATH), ("flash", SDPBackend.FLASH_ATTENTION),
                              ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            try:
                q, k, v = (torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                dout = torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16)
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(q, k, v)
                    torch.autograd.grad(out, (q, k, v), dout)
                torch.cuda.synchronize()
                point[f"{name}_peak_bytes"] = torch.cuda.max_memory_allocated()
            except torch.OutOfMemoryError:
                point[f"{name}_peak_bytes"] = None
                point[f"{name}_error"] = "out of memory"
            except Exception as e:
                point[f"{name}_peak_bytes"] = None
                point[f"{name}_error"] = str(e).split("\n")[0][:120]
            finally:
                q = k = v = dout = out = None
        print(json.dumps(point), flush=True)
        points.append(point)
    with open(json_path, "w") as f:
        json.dump({"config": {"B": 1, "H": h, "D": d, "dtype": "bf16"}, "torch": torch.__version__, "memory": points},
                  f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="peers.json")
    parser.add_argument("--dtypes", default="bf16")
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--causal", default="0,1")
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="SDPA backends to time (flash, cudnn, efficient)")
    parser.add_argument("--memory", action="store_true", help="the peak-memory sweep instead of timing")
    parser.add_argument("--warmup-ms", type=float, default=0.0,
                        help="after the 3 warm-up calls, more calls until this many ms have passed (as "
                             "flashattn_cuda_bench --warmup-ms)")
    args = parser.parse_args()
    global WARMUP_MS
    WARMUP_MS = args.warmup_ms
    if args.memory:
        memory_sweep(args.json)
        return
    torch.manual_seed(0)
    env = {"gpu": torch.cuda.get_device_name(0), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
           "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "cuda": torch.version.cuda,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "gemm_bf16_tflops": gemm_tflops(torch.bfloat16), "warmup_ms": WARMUP_MS}
    print(f"peers: {env}", flush=True)
    points = []
    for dtype_name in args.dtypes.split(","):
        dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float16
        for d in map(int, args.dims.split(",")):
            for s in map(int, args.seqlens.split(",")):
                for causal in map(int, args.causal.split(",")):
                    b, h = TOKENS // s, HIDDEN // d
                    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
                    dout = torch.randn(b, h, s, d, device="cuda", dtype=dtype)
                    flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
                    point = {"dtype": dtype_name, "D": d, "S": s, "B": b, "H": h, "causal": bool(causal)}
                    for name in args.backends.split(","):
                        backend = BACKENDS[name]
                        try:
                            with sdpa_kernel(backend):
                                fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
                                point[f"{name}_fwd"] = round(flops / (median_ms(fwd) * 1e-3) / 1e12, 1)
                                if not args.no_backward:
                                    out = fwd()
                                    bwd = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                                    point[f"{name}_bwd"] = round(2.5 * flops / (median_ms(bwd) * 1e-3) / 1e12, 1)
                                    del out
                        except Exception as e:  # a backend that refuses a shape says so in the JSON
                            point[f"{name}_error"] = str(e).split("\n")[0][:160]
                    print(json.dumps(point), flush=True)
                    points.append(point)
                    del q, k, v, dout
    with open(args.json, "w") as f:
        json.dump({"env": env, "sdpa": points}, f, indent=1)


if __name__ == "__main__":
    main()
