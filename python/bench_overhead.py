"""Call overhead of flashattn.torch (and flashattn.jax) on a tiny input, against
torch.nn.functional.scaled_dot_product_attention on the same tensors.

    python python/bench_overhead.py [--device cpu|cuda] [--iterations N] [--compare OTHER_TORCH_PY]

Prints microseconds per call (median of 7 repetitions of N calls). The tiny problem (B = Sq = Sk
= Hq = 1, D = 64; the decode rows: 16 cached keys) makes the attention itself negligible: what is
measured is the Python wrapper, the torch.library dispatch, the DLPack hand-over of each tensor
and the C ABI's validation (and on CUDA the launches).
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.dlpack import to_dlpack

import flashattn
import flashattn.torch as fat


def per_call_us(fn, iterations, samples=7):
    for _ in range(max(10, iterations // 10)):
        fn()
    times = []
    for _ in range(samples):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iterations):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / iterations * 1e6)
    return statistics.median(times)


def load_other_wrapper(path):
    """Another version of flashattn/torch.py, as a module of its own beside flashattn.torch: its torch.library ops
    renamed (flashattn:: -> flashattn_other::) so that both register, over the same extension."""
    import importlib.util

    source = open(path).read().replace('"flashattn::', '"flashattn_other::')
    spec = importlib.util.spec_from_loader("flashattn_other_torch", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = path
    exec(compile(source, path, "exec"), module.__dict__)
    return module


def compare_wrappers(other, rows, iterations, rounds=7):
    """The wrapper rows with flashattn.torch (this tree) and with `other`, alternating sample by sample in one process
    (a process's host state can move a call's time by 2x between processes): medians and the median of the ratios."""
    print(f"== this tree's flashattn.torch against {other.__file__}, {rounds} alternating samples of {iterations} calls")
    for name, make in rows:
        mine, theirs = make(fat), make(other)
        per_call_us(mine, iterations // 10)  # warm both
        per_call_us(theirs, iterations // 10)
        a, b = [], []
        for _ in range(rounds):
            a.append(per_call_us(mine, iterations, samples=1))
            b.append(per_call_us(theirs, iterations, samples=1))
        ratios = sorted(y / x for x, y in zip(a, b))
        print(f"{name:64s} this {statistics.median(a):7.1f} us, other {statistics.median(b):7.1f} us, "
              f"other / this {ratios[len(ratios) // 2]:.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 on the CPU, bfloat16 on CUDA by default")
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--compare", metavar="TORCH_PY", help="another flashattn/torch.py: its wrapper calls beside "
                        "this tree's, alternating in this process (an A/B of the wrapper alone)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    q, k, v = (torch.randn(1, 1, 1, 64, device=args.device, dtype=dtype) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # SDPA's (B, H, S, D) views of the same memory
    out = torch.empty_like(q)
    lse = torch.empty(1, 1, 1, device=args.device, dtype=torch.float32)
    stream = fat._stream(q)
    # A decode step: one query row against a cache of 16 keys (contiguous), or of 16 paged rows in blocks of 16 of
    # which the call appends the 16th (cache_seqlens 15: the rows before the append).
    k_cache, v_cache = (torch.randn(1, 16, 1, 64, device=args.device, dtype=dtype) for _ in range(2))
    k_paged, v_paged = (torch.randn(4, 16, 1, 64, device=args.device, dtype=dtype) for _ in range(2))
    cache_seqlens = torch.full((1,), 16, dtype=torch.int32, device=args.device)
    cache_lengths_before = torch.full((1,), 15, dtype=torch.int32, device=args.device)
    block_table = torch.tensor([[2]], dtype=torch.int32, device=args.device)
    backend = flashattn.backend_id("auto")
    rows = [
        ("torch SDPA (F.scaled_dot_product_attention)", lambda: F.scaled_dot_product_attention(qt, kt, vt)),
        ("flashattn.torch.flash_attn_func", lambda: fat.flash_attn_func(q, k, v)),
        ("  torch.ops.flashattn.fwd (custom op, no wrapper)",
         lambda: fat._fwd(q, k, v, None, None, 0.0, False, -1, -1, 0.0, 0.0, False, backend)),
        ("  flashattn._ext.forward (tensors: nanobind calls __dlpack__)",
         lambda: flashattn._ext.forward(q, k, v, out, lse, None, None, 0, 0, None, None, None, 0.0, False, -1, -1, 0.0,
                                        0.0, 0, 0, backend, 0, stream)),
        ("  flashattn._ext.forward (to_dlpack capsules, as flashattn.torch)",
         lambda: flashattn._ext.forward(to_dlpack(q), to_dlpack(k), to_dlpack(v), to_dlpack(out), to_dlpack(lse), None,
                                        None, 0, 0, None, None, None, 0.0, False, -1, -1, 0.0, 0.0, 0, 0, backend, 0,
                                        stream)),
        ("  flashattn._ext.forward, float64 oracle, 1 thread",
         lambda: flashattn._ext.forward(q, k, v, out, lse, None, None, 0, 0, None, None, None, 0.0, False, -1, -1, 0.0,
                                        0.0, 0, 0, flashattn.backend_id("reference"), 1, stream)),
        ("  DLPack of 3 tensors (q.__dlpack__())", lambda: (q.__dlpack__(), k.__dlpack__(), v.__dlpack__())),
        ("  DLPack of 3 tensors (torch.utils.dlpack.to_dlpack)", lambda: (to_dlpack(q), to_dlpack(k), to_dlpack(v))),
        ("  current stream (torch.cuda.current_stream)",
         lambda: torch.cuda.current_stream(q.device).cuda_stream if q.is_cuda else 0),
        ("  current stream (flashattn.torch._stream)", lambda: fat._stream(q)),
        ("flashattn.torch.flash_attn_with_kvcache (decode, 16 keys)",
         lambda: fat.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens)),
        ("  the same, paged (block_table), appending k / v",
         lambda: fat.flash_attn_with_kvcache(q, k_paged, v_paged, k=k, v=v, cache_seqlens=cache_lengths_before,
                                             block_table=block_table)),
    ]
    print(f"flashattn {flashattn.__version__}, torch {torch.__version__}, device {args.device}, {dtype}, "
          f"q/k/v (1, 1, 1, 64), {torch.get_num_threads()} torch threads")
    if args.compare:
        wrapper_rows = [
            ("flash_attn_func", lambda m: lambda: m.flash_attn_func(q, k, v)),
            ("flash_attn_with_kvcache (decode, 16 keys)",
             lambda m: lambda: m.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens)),
            ("  the same, paged (block_table), appending k / v",
             lambda m: lambda: m.flash_attn_with_kvcache(q, k_paged, v_paged, k=k, v=v, cache_seqlens=cache_lengths_before,
                                                         block_table=block_table)),
        ]
        compare_wrappers(load_other_wrapper(args.compare), wrapper_rows, args.iterations)
        return
    for name, fn in rows:
        try:
            print(f"{name:64s} {per_call_us(fn, args.iterations):8.1f} us/call")
        except flashattn.FlashAttnError as e:
            print(f"{name:64s} unavailable: {e}")
    try:
        import jax
        import jax.numpy as jnp

        import flashattn.jax as fj

        platform = "gpu" if args.device == "cuda" else "cpu"
        dev = jax.devices(platform)[0]
        jq = jax.device_put(jnp.asarray(q.float().cpu().numpy(), jnp.float32 if args.device == "cpu" else jnp.bfloat16), dev)
        f_ours = jax.jit(lambda q: fj.dot_product_attention(q, q, q))
        f_nn = jax.jit(lambda q: jax.nn.dot_product_attention(q, q, q))
        for name, f in (("jax.nn.dot_product_attention (jit)", f_nn), ("flashattn.jax.dot_product_attention (jit)", f_ours)):
            try:
                print(f"{name:64s} {per_call_us(lambda: f(jq).block_until_ready(), args.iterations):8.1f} us/call")
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{name:64s} unavailable: {str(e).splitlines()[0]}")
    except ImportError as e:
        print(f"jax: skipped ({e})")


if __name__ == "__main__":
    main()
