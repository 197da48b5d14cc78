"""flashattn for PyTorch: drop-in replacements for the flash_attn 2.x functions.

Swap one line::

    from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from flashattn.torch import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

The functions take the same arguments, defaults and layouts and return the same things as
flash_attn 2.x (flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func,
flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func,
flash_attn_with_kvcache), with these differences:

- CPU tensors work too (the CPU flash backend); CUDA tensors run the CUDA kernels on the
  current stream. fp16/bf16 everywhere, and float32 on the CPU.
- return_attn_probs=True returns (out, softmax_lse, None): the probabilities are never
  materialised (flash_attn returns a debugging tensor S_dmask there).
- Dropout uses flashattn's Philox keep-mask (src/core/philox.hpp), seeded from torch's default CPU
  generator: results are reproducible under torch.manual_seed, but the mask differs from
  flash_attn's. Each call with dropout draws a fresh (seed, offset) pair; backward reuses it.
- flash_attn_with_kvcache: cache_batch_idx works with contiguous caches (as in flash_attn; with
  block_table it is refused); cache_leftpad as in flash_attn (on CUDA contiguous caches only;
  the CPU backends take paged ones too);
  cache_seqlens=None means "the whole cache is filled" and is refused when k/v are given.
- Extra keyword-only argument ``backend`` ("auto", "reference", "flash", "standard", "cuda"):
  "reference" runs the float64 oracle (slow; for tests).

The kernels are registered as torch.library custom ops (namespace ``flashattn``) with fake
implementations and autograd, so torch.compile(fullgraph=True) traces them as single nodes and
backward works. Bad arguments raise flashattn.InvalidArgumentError (a ValueError) with the
library's message; valid but unsupported ones flashattn.UnsupportedError (NotImplementedError).
"""

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.utils.dlpack import to_dlpack as _to_dlpack

from flashattn import InvalidArgumentError, UnsupportedError, _ext, backend_id, check_fp8_scales, window_pair

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "kvcache_append",
]

#: Tests set this: every output is filled with NaN before the library writes it, so that an
#: element the library fails to write shows up instead of passing with stale memory.
_poison_outputs = False

_U64_MASK = (1 << 64) - 1
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _dl(x):
    """x as _ext takes it fastest: a torch tensor as a DLPack capsule, anything else (None, a number) as it is.

    Given a tensor, nanobind calls Tensor.__dlpack__, a Python method: 3 us per tensor on the CPU (torch 2.15,
    python/bench_overhead.py), more on CUDA, where torch 2.11's also orders the current stream after the legacy
    default one (the library needs no such order: it runs on the stream it is passed). torch.utils.dlpack.to_dlpack
    exports the same tensor (no copy, the same strides) from C in 0.4 us. A capsule is consumed by the one call it is
    passed to, so every call gets its own.
    """
    return _to_dlpack(x) if isinstance(x, Tensor) else x


# torch.cuda.current_stream(device).cuda_stream builds a torch.cuda.Stream object per call; this is the C function
# behind it that torch's compiler (inductor) calls for the raw handle. The public path stays as the fallback.
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(t: Tensor) -> int:
    """The caller's current CUDA stream for t's device (0 = none, on the CPU)."""
    if not t.is_cuda:
        return 0
    if _current_raw_stream is not None:
        return _current_raw_stream(t.get_device())
    return torch.cuda.current_stream(t.device).cuda_stream


def _last_dim_contiguous(t: Optional[Tensor]) -> Optional[Tensor]:
    # The library takes any strides except in the last dimension (as flash_attn does).
    return t.contiguous() if t is not None and t.stride(-1) != 1 else t


def _new_rng_state(dropout_p: float) -> Optional[Tensor]:
    """(seed, offset) for one dropout call, drawn from torch's default CPU generator.

    A CPU int64 tensor (not Python ints) so that torch.compile traces the draw into the graph
    instead of specialising on its value; the op reads it on the host, no device sync needed.
    """
    if dropout_p <= 0.0:
        return None
    return torch.randint(_INT64_MIN, _INT64_MAX, (2,), dtype=torch.int64, device="cpu")


def _seed_offset(rng_state: Optional[Tensor]) -> Tuple[int, int]:
    if rng_state is None:
        return 0, 0
    seed, offset = rng_state.tolist()
    return seed & _U64_MASK, offset & _U64_MASK  # the C ABI takes them as uint64


def _empty(shape, like: Tensor, dtype=None) -> Tensor:
    """A new contiguous tensor of `shape` on like's device, of like's dtype unless `dtype` is given.

    Allocation is a good part of a small call's host time: on the CPU (torch 2.15) torch.empty(shape, dtype=,
    device=) takes 2.7 us, like.new_empty(shape) 2.0-2.2 us and, when the shape is like's (out when Dv = D, the
    gradients), torch.empty_like 1.2-1.4 us.
    """
    if dtype is None and shape == like.shape:
        t = torch.empty_like(like, memory_format=torch.contiguous_format)
    else:
        t = like.new_empty(shape, dtype=dtype or like.dtype)
    if _poison_outputs:
        t.fill_(float("nan"))
    return t


def _window(window_size) -> Tuple[int, int]:
    return window_pair(window_size)


def _scale(softmax_scale) -> float:
    # 0 asks the library for its default 1/sqrt(D), the same as flash_attn's None.
    return 0.0 if softmax_scale is None else float(softmax_scale)


def _dense_out_shapes(q: Tensor, v: Tensor):
    """Shapes of out (B, Sq, Hq, Dv) and lse (B, Hq, Sq); for malformed inputs, shapes that let
    the library's validation report the real problem (it checks q, k, v before out and lse)."""
    if q.dim() == 4 and v.dim() >= 1:
        b, sq, h, _ = q.shape
        return (b, sq, h, v.shape[-1]), (b, h, sq)
    return tuple(q.shape), (1,)


def _varlen_out_shapes(q: Tensor, v: Tensor):
    """out (total_q, Hq, Dv) and lse (Hq, total_q)."""
    if q.dim() == 3 and v.dim() >= 1:
        total, h, _ = q.shape
        return (total, h, v.shape[-1]), (h, total)
    return tuple(q.shape), (1,)


def _check_no_grad_for(what: str, *tensors):
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise UnsupportedError(f"{what}: has no backward pass (flash_attn's has none either)")


# ---------------------------------------------------------------------------------------------
# custom ops: dense
# ---------------------------------------------------------------------------------------------


def _fwd_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alibi_slopes: Optional[Tensor],
    rng_state: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
    backend: int,
) -> Tuple[Tensor, Tensor]:
    out_shape, lse_shape = _dense_out_shapes(q, v)
    out = _empty(out_shape, q)
    lse = _empty(lse_shape, q, torch.float32)
    seed, offset = _seed_offset(rng_state)
    _ext.forward(_dl(q), _dl(k), _dl(v), _dl(out), _dl(lse), None, None, 0, 0, None, None, _dl(alibi_slopes),
                 softmax_scale, causal, window_left, window_right, softcap, dropout_p, seed, offset, backend, 0,
                 _stream(q))
    return out, lse


_fwd = torch.library.custom_op("flashattn::fwd", _fwd_impl, mutates_args=())


@_fwd.register_fake
def _(q, k, v, alibi_slopes, rng_state, softmax_scale, causal, window_left, window_right, softcap,
      dropout_p, deterministic, backend):
    out_shape, lse_shape = _dense_out_shapes(q, v)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=torch.float32)


def _bwd_impl(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    alibi_slopes: Optional[Tensor],
    rng_state: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
    backend: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = _empty(q.shape, q), _empty(k.shape, k), _empty(v.shape, v)
    seed, offset = _seed_offset(rng_state)
    workspace = _backward_workspace(dout, q, k, v, out, lse, dq, dk, dv, None, None, 0, 0, alibi_slopes,
                                    softmax_scale, causal, window_left, window_right, softcap, dropout_p,
                                    deterministic, backend)
    _ext.backward(_dl(dout), _dl(q), _dl(k), _dl(v), _dl(out), _dl(lse), _dl(dq), _dl(dk), _dl(dv), None, None, 0, 0,
                  _dl(alibi_slopes), _dl(workspace), softmax_scale, causal, window_left, window_right, softcap,
                  dropout_p, seed, offset, deterministic, backend, 0, _stream(q))
    return dq, dk, dv


_bwd = torch.library.custom_op("flashattn::bwd", _bwd_impl, mutates_args=())


@_bwd.register_fake
def _(dout, q, k, v, out, lse, alibi_slopes, rng_state, softmax_scale, causal, window_left, window_right,
      softcap, dropout_p, deterministic, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _backward_workspace(*args) -> Optional[Tensor]:
    """On CUDA, the backward's scratch comes from torch's caching allocator (on the CPU the
    backend manages its own): sized by the library for exactly this problem (memoised per key, as
    the kvcache plan: the size reads no tensor data)."""
    q = args[1]
    if not q.is_cuda:
        return None
    nbytes = _memoised(_backward_workspace_sizes, _plan_key(args + (q.device,)),
                       lambda: _ext.backward_workspace_size(*map(_dl, args)))
    return torch.empty((nbytes,), dtype=torch.uint8, device=q.device) if nbytes > 0 else None


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, alibi_slopes, rng_state, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, rng_state)
    ctx.options = options  # softmax_scale, causal, window_left/right, softcap, dropout_p, deterministic, backend
    ctx.mark_non_differentiable(lse)  # as in flash_attn: no gradient flows through softmax_lse


def _fwd_backward(ctx, dout, dlse, bwd=None):
    q, k, v, out, lse, alibi_slopes, rng_state = ctx.saved_tensors
    dq, dk, dv = (bwd or _bwd)(_last_dim_contiguous(dout), q, k, v, out, lse, alibi_slopes, rng_state, *ctx.options)
    return (dq, dk, dv) + (None,) * (2 + len(ctx.options))


_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# ---------------------------------------------------------------------------------------------
# eager fast path
#
# A torch.library custom op costs tens of microseconds per call in eager mode (Python-level
# dispatch through the autograd and backend kernels), several times a small attention call. Outside
# torch.compile the functions below therefore run the ops' own implementations directly (through
# a plain autograd.Function when a gradient is needed): the same code, the same numerics, one
# layer less. Under torch.compile (and torch.export) the custom ops are what gets traced.
# ---------------------------------------------------------------------------------------------


def _eager() -> bool:
    return not torch.compiler.is_compiling()


class _EagerAttention(torch.autograd.Function):
    """Autograd of the eager path; mirrors _fwd_setup_context / _fwd_backward."""

    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, rng_state, *options):
        out, lse = _fwd_impl(q, k, v, alibi_slopes, rng_state, *options)
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, rng_state)
        ctx.options = options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _fwd_backward(ctx, dout, dlse, bwd=_bwd_impl)


class _EagerVarlenAttention(torch.autograd.Function):
    """Autograd of the eager varlen path; mirrors _varlen_setup_context / _varlen_backward."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, seqused_k,
                alibi_slopes, rng_state, *options):
        inputs = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, seqused_k, alibi_slopes,
                  rng_state) + options
        output = _varlen_fwd_impl(*inputs)
        _varlen_setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _varlen_backward(ctx, dout, dlse, bwd=_varlen_bwd_impl)


def _needs_grad(*tensors) -> bool:
    if not torch.is_grad_enabled():
        return False
    for t in tensors:  # a loop, not any() over a generator: a third of the cost on every call
        if t is not None and t.requires_grad:
            return True
    return False


def _run_fwd(q, k, v, alibi_slopes, rng_state, *options):
    if not _eager():
        return _fwd(q, k, v, alibi_slopes, rng_state, *options)
    if _needs_grad(q, k, v):
        return _EagerAttention.apply(q, k, v, alibi_slopes, rng_state, *options)
    return _fwd_impl(q, k, v, alibi_slopes, rng_state, *options)


# ---------------------------------------------------------------------------------------------
# custom ops: variable length (and paged K/V in the forward)
# ---------------------------------------------------------------------------------------------


def _varlen_fwd_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    block_table: Optional[Tensor],
    seqused_k: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    rng_state: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
    backend: int,
) -> Tuple[Tensor, Tensor]:
    out_shape, lse_shape = _varlen_out_shapes(q, v)
    out = _empty(out_shape, q)
    lse = _empty(lse_shape, q, torch.float32)
    seed, offset = _seed_offset(rng_state)
    _ext.forward(_dl(q), _dl(k), _dl(v), _dl(out), _dl(lse), _dl(cu_seqlens_q), _dl(cu_seqlens_k), max_seqlen_q,
                 max_seqlen_k, _dl(seqused_k), _dl(block_table), _dl(alibi_slopes), softmax_scale, causal, window_left,
                 window_right, softcap, dropout_p, seed, offset, backend, 0, _stream(q))
    return out, lse


_varlen_fwd = torch.library.custom_op("flashattn::varlen_fwd", _varlen_fwd_impl, mutates_args=())


@_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, seqused_k, alibi_slopes, rng_state,
      softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic, backend):
    out_shape, lse_shape = _varlen_out_shapes(q, v)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=torch.float32)


def _varlen_bwd_impl(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    alibi_slopes: Optional[Tensor],
    rng_state: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
    backend: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = _empty(q.shape, q), _empty(k.shape, k), _empty(v.shape, v)
    seed, offset = _seed_offset(rng_state)
    workspace = _backward_workspace(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, alibi_slopes, softmax_scale, causal, window_left, window_right,
                                    softcap, dropout_p, deterministic, backend)
    _ext.backward(_dl(dout), _dl(q), _dl(k), _dl(v), _dl(out), _dl(lse), _dl(dq), _dl(dk), _dl(dv),
                  _dl(cu_seqlens_q), _dl(cu_seqlens_k), max_seqlen_q, max_seqlen_k, _dl(alibi_slopes), _dl(workspace),
                  softmax_scale, causal, window_left, window_right, softcap, dropout_p, seed, offset, deterministic,
                  backend, 0, _stream(q))
    return dq, dk, dv


_varlen_bwd = torch.library.custom_op("flashattn::varlen_bwd", _varlen_bwd_impl, mutates_args=())


@_varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, rng_state,
      softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, seqused_k, alibi_slopes, rng_state,
     *options) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state)
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
    ctx.paged = block_table is not None
    ctx.seqused = seqused_k is not None
    ctx.options = options
    ctx.mark_non_differentiable(lse)


def _varlen_backward(ctx, dout, dlse, bwd=None):
    if ctx.paged:
        raise UnsupportedError("block_table: paged K/V has no backward pass (as in flash_attn)")
    if ctx.seqused:
        raise UnsupportedError("seqused_k: the backward pass takes every key of cu_seqlens_k (forward only)")
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state = ctx.saved_tensors
    dq, dk, dv = (bwd or _varlen_bwd)(_last_dim_contiguous(dout), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                             *ctx.max_seqlens, alibi_slopes, rng_state, *ctx.options)
    return (dq, dk, dv) + (None,) * (8 + len(ctx.options))


_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


def _run_varlen_fwd(q, k, v, *rest):
    if not _eager():
        return _varlen_fwd(q, k, v, *rest)
    if _needs_grad(q, k, v):
        return _EagerVarlenAttention.apply(q, k, v, *rest)
    return _varlen_fwd_impl(q, k, v, *rest)


# ---------------------------------------------------------------------------------------------
# custom op: KV cache (appends k/v into the caches in place)
# ---------------------------------------------------------------------------------------------


def _kvcache_impl(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor],
    v: Optional[Tensor],
    rotary_cos: Optional[Tensor],
    rotary_sin: Optional[Tensor],
    cache_seqlens: Tensor,
    block_table: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    rotary_interleaved: bool,
    num_splits: int,
    backend: int,
    k_scale: float = 0.0,
    v_scale: float = 0.0,
    cache_batch_idx: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    return _kvcache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, block_table, alibi_slopes,
                         softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved, num_splits,
                         backend, k_scale, v_scale, cache_batch_idx, cache_leftpad, want_lse=True)


def _kvcache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, block_table, alibi_slopes,
                  softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved, num_splits, backend,
                  k_scale, v_scale, cache_batch_idx, cache_leftpad, want_lse: bool):
    """_kvcache_impl's body. want_lse False (eager calls without return_softmax_lse only: the custom op's schema
    returns lse): the library gets no lse tensor and writes none, one allocation fewer per decode step; lse is None."""
    out_shape, lse_shape = _dense_out_shapes(q, v_cache)
    out = _empty(out_shape, q)
    lse = _empty(lse_shape, q, torch.float32) if want_lse else None
    # An FP8 (e4m3) cache crosses to the library as the uint8 view of its codes (the same storage: the append
    # writes into the caller's cache), with its dequantisation scales.
    fp8 = _is_fp8(k_cache) or _is_fp8(v_cache)
    if fp8:
        if not (_is_fp8(k_cache) and _is_fp8(v_cache)):
            raise InvalidArgumentError("v_cache: an FP8 cache needs k_cache and v_cache both torch.float8_e4m3fn")
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    tensors = (q, k_cache, v_cache, block_table, cache_seqlens, k, v, rotary_cos, rotary_sin)
    options = (softmax_scale, causal, window_left, window_right, softcap, backend)

    def call_args(splits):  # new capsules for each _ext call (a call consumes those it is passed)
        return (*map(_dl, tensors), rotary_interleaved, _dl(out), _dl(lse), splits)

    def cache_options():
        return {"fp8_cache": fp8, "k_scale": float(k_scale), "v_scale": float(v_scale),
                "cache_batch_idx": _dl(cache_batch_idx), "cache_leftpad": _dl(cache_leftpad)}

    workspace = None
    if q.is_cuda:
        # Plan on the host once per batch shape (memoised), then run allocation-free with torch's memory.
        key = _plan_key(tensors + (alibi_slopes, cache_batch_idx, cache_leftpad, q.device, num_splits, rotary_interleaved,
                                   fp8, k_scale, v_scale, want_lse) + options)
        num_splits, nbytes = _memoised(_kvcache_plans, key, lambda: _ext.plan_kvcache(
            *call_args(num_splits), _dl(alibi_slopes), *options, **cache_options()))
        workspace = torch.empty((nbytes,), dtype=torch.uint8, device=q.device) if nbytes > 0 else None
    _ext.kvcache(*call_args(num_splits), _dl(workspace), _dl(alibi_slopes), *options, 0, _stream(q), **cache_options())
    return out, lse


# Host plans of the CUDA backend already made: the kvcache split plan (fa_plan_kvcache) and the backward's workspace
# size (fa_backward_workspace_size). Neither reads tensor data (no device access; the data pointers only for their
# alignment rule, which the run checks again), so each is a function of the tensors' shapes, strides and dtypes, the
# other arguments and the device. A server or a training loop meets a few keys (a continuous-batching server one per
# batch size and cache capacity), so the bound is a safety net: past it a memo starts again. (A varlen backward whose
# total length changes every step misses every time: it pays the key, ~3 us, on top of the call it made before.)
_PLANS_MAX = 4096
_kvcache_plans: dict = {}  # key -> (num_splits, workspace bytes)
_backward_workspace_sizes: dict = {}  # key -> bytes


def _plan_key(values) -> tuple:
    """A tensor stands for its shape, strides and dtype; anything else for itself."""
    parts = []
    for x in values:  # (a loop: a generator expression costs more here)
        parts.append((x.shape, x.stride(), x.dtype) if isinstance(x, Tensor) else x)
    return tuple(parts)


def _memoised(memo: dict, key: tuple, make):
    value = memo.get(key)
    if value is None:
        value = make()
        if len(memo) >= _PLANS_MAX:
            memo.clear()
        memo[key] = value
    return value


def _is_fp8(t: Tensor) -> bool:
    fp8 = getattr(torch, "float8_e4m3fn", None)
    return fp8 is not None and t.dtype == fp8


_kvcache = torch.library.custom_op("flashattn::kvcache", _kvcache_impl, mutates_args=("k_cache", "v_cache"))


@_kvcache.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, block_table, alibi_slopes, softmax_scale,
      causal, window_left, window_right, softcap, rotary_interleaved, num_splits, backend, k_scale=0.0, v_scale=0.0,
      cache_batch_idx=None, cache_leftpad=None):
    out_shape, lse_shape = _dense_out_shapes(q, v_cache)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=torch.float32)


def _kvcache_append_impl(
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_new: Tensor,
    cache_seqlens: Tensor,
    block_table: Optional[Tensor],
    max_seqlen_new: int,
    check_indices: bool,
    backend: int,
    k_scale: float,
    v_scale: float,
) -> None:
    fp8 = _is_fp8(k_cache) or _is_fp8(v_cache)
    if fp8:
        if not (_is_fp8(k_cache) and _is_fp8(v_cache)):
            raise InvalidArgumentError("v_cache: an FP8 cache needs k_cache and v_cache both torch.float8_e4m3fn")
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)  # the same storage
    _ext.kvcache_append(_dl(k_cache), _dl(v_cache), _dl(block_table), _dl(cache_seqlens), _dl(k), _dl(v),
                        _dl(cu_seqlens_new), max_seqlen_new, check_indices, backend, 0, _stream(k), fp8_cache=fp8,
                        k_scale=float(k_scale), v_scale=float(v_scale))


_kvcache_append = torch.library.custom_op("flashattn::kvcache_append", _kvcache_append_impl,
                                          mutates_args=("k_cache", "v_cache"))


@_kvcache_append.register_fake
def _(k_cache, v_cache, k, v, cu_seqlens_new, cache_seqlens, block_table, max_seqlen_new, check_indices, backend,
      k_scale, v_scale):
    return None


# ---------------------------------------------------------------------------------------------
# the flash_attn 2.x functions
# ---------------------------------------------------------------------------------------------


def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
               return_attn_probs, backend):
    left, right = _window(window_size)
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    out, lse = _run_fwd(q, k, v, alibi_slopes, _new_rng_state(dropout_p), _scale(softmax_scale), bool(causal), left,
                    right, float(softcap), float(dropout_p), bool(deterministic), backend_id(backend))
    return (out, lse, None) if return_attn_probs else out


def _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                      causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table,
                      backend, seqused_k=None):
    left, right = _window(window_size)
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    out, lse = _run_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), block_table,
                           seqused_k, alibi_slopes, _new_rng_state(dropout_p), _scale(softmax_scale), bool(causal), left, right,
                           float(softcap), float(dropout_p), bool(deterministic), backend_id(backend))
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    backend=None,
):
    """Attention of q (B, Sq, Hq, D) over k (B, Sk, Hk, D), v (B, Sk, Hk, Dv) -> (B, Sq, Hq, Dv).

    As flash_attn.flash_attn_func: Hq % Hk == 0 (MQA/GQA; query head h reads key head
    h // (Hq // Hk)); causal and window_size=(left, right) are aligned to the bottom-right corner
    (query i sees keys j with i + Sk - Sq - left <= j <= i + Sk - Sq + right); softcap > 0 caps
    scores as softcap * tanh(s / softcap); alibi_slopes (Hq) or (B, Hq) float32 add
    -slope * |i + Sk - Sq - j|. A query with no visible key gives 0. With return_attn_probs,
    returns (out, softmax_lse (B, Hq, Sq) float32, None).
    """
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs, backend)


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    backend=None,
):
    """flash_attn_func on qkv (B, S, 3, H, D). The views of q, k, v are passed with their strides
    (no copies); their gradients land in one (B, S, 3, H, D) gradient of qkv."""
    q, k, v = qkv.unbind(dim=2)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs, backend)


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    backend=None,
):
    """flash_attn_func on q (B, Sq, Hq, D) and kv (B, Sk, 2, Hk, D)."""
    k, v = kv.unbind(dim=2)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs, backend)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    seqused_k=None,
    backend=None,
):
    """Variable-length attention: q (total_q, Hq, D), k/v (total_k, Hk, D) with cu_seqlens_q/k
    (B+1) int32 prefix sums; masks are aligned per sequence. With block_table (B, max_blocks)
    int32, k/v are paged caches (num_blocks, block_size, Hk, D) (forward only). seqused_k (B)
    int32 (keyword, forward only, as vLLM's flash_attn_varlen_func): sequence b attends to its
    first seqused_k[b] keys only (the mask aligns to that count); on CUDA a paged decode step
    with it reads the counts in place. With return_attn_probs, returns (out, softmax_lse
    (Hq, total_q) float32, None)."""
    return _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                             softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                             return_attn_probs, block_table, backend, seqused_k)


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    backend=None,
):
    """flash_attn_varlen_func on qkv (total, 3, H, D) with one cu_seqlens for queries and keys."""
    q, k, v = qkv.unbind(dim=1)
    return _varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                             causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, None,
                             backend)


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    backend=None,
):
    """flash_attn_varlen_func on q (total_q, Hq, D) and kv (total_k, 2, Hk, D)."""
    k, v = kv.unbind(dim=1)
    return _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                             softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                             return_attn_probs, None, backend)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    backend=None,
    k_scale=None,
    v_scale=None,
):
    """Attention of q (B, Sq, Hq, D) against a KV cache, appending k/v (B, S_new, Hk, D) first.

    As flash_attn.flash_attn_with_kvcache: k_cache/v_cache are (B, S_cache, Hk, D) or, with
    block_table (B, max_blocks) int32, paged (num_blocks, block_size, Hk, D) (any block size);
    k/v, when given, are written into the caches in place at rows cache_seqlens[b] onwards (rotated
    by rotary_cos/rotary_sin (S_rotary, rotary_dim / 2) when given; q is rotated at cache_seqlens
    + i when causal or windowed, else at cache_seqlens; on CUDA S_rotary >= capacity - S_new + max(S_new, Sq),
    capacity = S_cache or max_blocks * block_size); attention then covers the first
    cache_seqlens[b] + S_new keys. cache_seqlens is an int or (B,) int32. No backward pass.
    Returns out, or (out, softmax_lse (B, Hq, Sq) float32) with return_softmax_lse.

    FP8 cache (as vLLM's kv_cache_dtype="fp8_e4m3"): k_cache and v_cache of dtype torch.float8_e4m3fn with
    q, k, v in float16 / bfloat16, and the per-tensor scales k_scale, v_scale (floats > 0; real value =
    fp8 value * scale). Appended rows are quantised into the cache as e4m3(x / scale): x / scale in
    float32, rounded to nearest even, saturating to +-448 (NaN stays NaN); attention reads the cache as
    stored. With a 16-bit cache the scales are unused (None, 0 or 1).

    cache_batch_idx (B,) int32, contiguous caches only: sequence b reads and appends to entry
    cache_batch_idx[b] of k_cache / v_cache, whose dimension 0 is then the cache's own batch (a server's
    slots). Entries in [0, k_cache.shape[0]) and, when k/v are appended, distinct; on CUDA, S_cache a power of two
    >= 16.

    cache_leftpad (B,) int32: left padding, as in flash_attn. Sequence b's keys are cache rows
    [cache_leftpad[b], cache_seqlens[b] + S_new); the rows before are never read. Positions are the rows' own:
    rotary, causal / window alignment and ALiBi are as without padding. Entries in [0, cache_seqlens[b]].
    On CUDA contiguous caches only (as flash_attn); the CPU backends take paged ones and cache_batch_idx too.
    """
    _check_no_grad_for("flash_attn_with_kvcache", q, k, v)
    if cache_seqlens is None:
        if k is not None or v is not None:
            raise InvalidArgumentError("cache_seqlens: required when k and v are appended (where would they go?)")
        capacity = (block_table.shape[1] * k_cache.shape[1]) if block_table is not None else k_cache.shape[1]
        cache_seqlens = capacity  # no lengths: the whole cache is in use
    if isinstance(cache_seqlens, int):
        batch = q.shape[0] if q.dim() > 0 else 1
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=k_cache.device)
    left, right = _window(window_size)
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    rotary_cos, rotary_sin = _last_dim_contiguous(rotary_cos), _last_dim_contiguous(rotary_sin)
    check_fp8_scales(_is_fp8(k_cache), k_scale, v_scale)
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, block_table, alibi_slopes,
            _scale(softmax_scale), bool(causal), left, right, float(softcap), bool(rotary_interleaved),
            int(num_splits), backend_id(backend), float(k_scale or 0.0), float(v_scale or 0.0),
            cache_batch_idx, cache_leftpad)
    if _eager():
        out, lse = _kvcache_call(*args, want_lse=bool(return_softmax_lse))
    else:
        out, lse = _kvcache(*args)
    return (out, lse) if return_softmax_lse else out


def kvcache_append(
    k_cache,
    v_cache,
    k,
    v,
    cu_seqlens_new,
    cache_seqlens,
    max_seqlen_new=None,
    block_table=None,
    *,
    k_scale=None,
    v_scale=None,
    check_indices=False,
    backend=None,
):
    """Writes new key/value rows into a KV cache (in place) without attending: fa_kvcache_append.

    k, v (total_new, Hk, D) hold every sequence's new rows one after the other: sequence b's are rows
    cu_seqlens_new[b] .. cu_seqlens_new[b + 1] - 1 ((B + 1,) int32, from 0), written at cache rows
    cache_seqlens[b], cache_seqlens[b] + 1, ... ((B,) int32; read, not updated). k_cache / v_cache are
    (B, S_cache, Hk, D) or, with block_table (B, max_blocks) int32, paged (num_blocks, block_size, Hk, D).
    The rows land exactly as flash_attn_with_kvcache's append writes them (an FP8 float8_e4m3fn cache: quantised
    as e4m3(x / scale) with k_scale, v_scale). max_seqlen_new: the largest count; None computes it from
    cu_seqlens_new (a device-to-host copy for CUDA tensors: pass it in a serving loop).

    With it a continuous-batching step whose requests bring different numbers of tokens is two calls:
    kvcache_append of every request's rows, then flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_new,
    cu_seqlens_k, max_seqlen_new, max_seqlen_k, causal=True, block_table=block_table), where cu_seqlens_k is the
    running sum of cache_seqlens + new counts. check_indices (CUDA): check the index tensors on the device first and
    raise on a bad entry (one synchronisation); without it a sequence whose entries are out of range writes nothing.
    """
    if max_seqlen_new is None:
        counts = cu_seqlens_new[1:] - cu_seqlens_new[:-1]
        max_seqlen_new = int(counts.max().item()) if counts.numel() > 0 else 0
    check_fp8_scales(_is_fp8(k_cache), k_scale, v_scale)
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    args = (k_cache, v_cache, k, v, cu_seqlens_new, cache_seqlens, block_table, int(max_seqlen_new), bool(check_indices),
            backend_id(backend), float(k_scale or 0.0), float(v_scale or 0.0))
    if _eager():
        _kvcache_append_impl(*args)
    else:
        _kvcache_append(*args)
