#!/usr/bin/env python3
"""Times the peers of flashattn_decode_bench on the GPU machine: torch SDPA decode (one query per sequence
against a full contiguous KV cache) with the cuDNN backend, and the flash backend (FlashAttention-2) for
reference, on the decode sweep's shapes. Writes JSON beside flashattn_decode_bench's.

  python3 bench/peers_decode.py --json peers_decode.json [--batches 1,4,16,64,256]
                                [--caches 1024,4096,16384,65536,131072] [--heads 32:8,32:32] [--dim 128]

Bytes of K/V read per second = B * S * Hk * 2 * D * 2 / time, the same count as ours. Layout: the cache is
stored (B, S, Hk, D), the flashattn layout, and handed to SDPA as the (B, Hk, S, D) transposed view (cuDNN
takes strides); q is (B, Hq, 1, D). GQA (Hq != Hk) uses enable_gqa=True; where a backend refuses it, the
error is recorded (and the MHA shape, --heads 32:32, is the like-for-like comparison the issue quotes:
cuDNN at ~4.4 TB/s). Timing as in ours: a CUDA graph of one call per copy of the inputs, copies until they
exceed 2x the L2 (and at least 4 where they fit in 4 GiB), median over repetitions; eager timing when a
backend cannot be captured (recorded).
"""
import argparse
import datetime
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from peers import median_ms  # bench/peers.py (this script's folder is on sys.path)

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
MAX_COPIES = 64
MIN_COPIES = 4              # the graph's own launch is shared by at least 4 calls where they fit in COPY_BUDGET
COPY_BUDGET = 4 << 30


def sum_read_tbs():
    """The issue's yardstick for the read target: "a sum over 2 GiB" (about 4.25 TB/s on the H200 of
    ../shared/anchors, h200-jax-pallas-and-bandwidth.json). torch.sum over 2 GiB of fp32 and over 2 GiB of bf16
    (fp32 accumulation), each the median of 10 calls, 3 times; the yardstick is the faster of the two dtypes'
    medians (the more demanding one; fp32 on the H200, 4.26-4.28 TB/s on 2026-12-03, bf16 4.13-4.16)."""
    rates = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        data = torch.empty((2 << 30) // torch.tensor([], dtype=dtype).element_size(), dtype=dtype, device="cuda")
        data.uniform_(-1, 1)
        runs = [(2 << 30) / (median_ms(lambda: data.sum(dtype=torch.float32), warmup=1, reps=10) * 1e-3) / 1e12
                for _ in range(3)]
        rates[name] = sorted(runs)[1]
        del data
    torch.cuda.empty_cache()
    return max(rates.values()), rates


def time_point(backend, batch, cache, heads_q, heads_k, dim, reps, l2_bytes):
    kv_bytes = batch * cache * heads_k * 2 * dim * 2
    # as flashattn_decode_bench: copies past 2x the L2, and at least MIN_COPIES where they fit in COPY_BUDGET
    copies = min(MAX_COPIES, max(1, (2 * l2_bytes) // kv_bytes + 1, min(MIN_COPIES, COPY_BUDGET // kv_bytes)))
    inputs = []
    for _ in range(copies):
        q = torch.randn(batch, heads_q, 1, dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, cache, heads_k, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(batch, cache, heads_k, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        inputs.append((q, k, v))
    gqa = heads_q != heads_k

    def call(q, k, v):
        with sdpa_kernel(BACKENDS[backend]):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)

    result = {"backend": backend, "batch": batch, "cache": cache, "heads_q": heads_q, "heads_k": heads_k, "dim": dim,
              "kv_bytes": kv_bytes, "copies": copies}
    try:
        call(*inputs[0])
        torch.cuda.synchronize()
    except Exception as e:  # the backend refuses this shape
        result["error"] = str(e).splitlines()[0][:300]
        return result
    eager_ms = median_ms(lambda: call(*inputs[0]), warmup=1, reps=reps)
    result["us_eager"] = eager_ms * 1e3
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for x in inputs:  # warm-up on the side stream, as torch asks before capture
                call(*x)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            for x in inputs:
                call(*x)
        ms = median_ms(graph.replay, warmup=1, reps=reps) / copies
        result["timing"] = "cuda graph"
    except Exception as e:
        result["graph_error"] = str(e).splitlines()[0][:300]
        ms = eager_ms
        result["timing"] = "eager"
    result["us_per_call"] = ms * 1e3
    result["kv_tbs"] = kv_bytes / (ms * 1e-3) / 1e12
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="peers_decode.json")
    parser.add_argument("--batches", default="1,4,16,64,256")
    parser.add_argument("--caches", default="1024,4096,16384,65536,131072")
    parser.add_argument("--heads", default="32:8,32:32")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--backends", default="cudnn,flash")
    parser.add_argument("--budget-gib", type=float, default=32.0, help="skip points whose K/V copy exceeds this")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20)
    env = {"gpu": torch.cuda.get_device_name(0), "sms": props.multi_processor_count, "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "cuda": torch.version.cuda,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    env["sum_read_tbs"], env["sum_read_by_dtype"] = sum_read_tbs()
    print(json.dumps(env), flush=True)
    points = []
    for heads in args.heads.split(","):
        heads_q, heads_k = (int(x) for x in heads.split(":"))
        for backend in args.backends.split(","):
            for batch in (int(x) for x in args.batches.split(",")):
                for cache in (int(x) for x in args.caches.split(",")):
                    kv_bytes = batch * cache * heads_k * 2 * args.dim * 2
                    # q, out and torch's context need a few GiB beside the K/V (a copy of 128 GiB fits an H200)
                    over = ("skipped: over --budget-gib" if kv_bytes > args.budget_gib * (1 << 30) else
                            "skipped: over this device's memory" if kv_bytes > props.total_memory - (4 << 30) else None)
                    if over is not None:
                        points.append({"backend": backend, "batch": batch, "cache": cache, "heads_q": heads_q,
                                       "heads_k": heads_k, "error": over})
                        continue
                    r = time_point(backend, batch, cache, heads_q, heads_k, args.dim, args.reps, l2_bytes)
                    points.append(r)
                    print(f"{backend:6s} Hq={heads_q:3d} Hk={heads_k:3d} B={batch:4d} S={cache:7d} "
                          f"{r.get('us_per_call', -1):10.2f} us {r.get('kv_tbs', -1):7.3f} TB/s "
                          f"{r.get('timing', '')} {r.get('error', '')}{r.get('graph_error', '')}", flush=True)
                    torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump({"env": env, "points": points}, f, indent=1)


if __name__ == "__main__":
    main()
