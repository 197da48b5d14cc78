"""flashattn for JAX: dot_product_attention as XLA FFI custom calls (CPU and CUDA).

Same layout and argument names as jax.nn.dot_product_attention, for the subset it supports::

    from flashattn.jax import dot_product_attention
    out = dot_product_attention(query, key, value, is_causal=True)   # (B, T, N, H) arrays

- query (B, T, N, H) or (T, N, H); key/value (B, S, K, H) with N % K == 0 (GQA: query head n
  reads key head n // (N // K), as in jax.nn); value may have its own head size.
- scale (default 1/sqrt(H)), is_causal, local_window_size (int w = (w, w), or (left, right)),
  return_residual (also returns the log-sum-exp, (B, T, N) float32, without gradient).
- Masks follow jax.nn: query i sees key j when j <= i (is_causal) and i - left <= j <= i + right
  (local_window_size), counted from the top-left corner. flashattn's kernels align masks to the
  bottom-right corner (as flash_attn does); the two agree when T == S and this module translates
  when T != S. A combination that the kernels cannot express (is_causal with T < S) raises an
  error rather than computing something else. One documented difference: a query row with no
  visible key at all (possible with windows when T > S) gives 0, where jax.nn gives the mean of
  the value rows.
- Extra keyword arguments: alibi_slopes (N) or (B, N) float32 (bias -slope * |i + S - T - j|,
  flash_attn's convention, so -slope * |i - j| when T == S; no gradient flows to the slopes), softcap (> 0: scores become
  softcap * tanh(scores / softcap)), dropout_rate with dropout_rng (a jax.random key; the keep
  mask is flashattn's Philox mask, regenerated in backward), deterministic (backward), backend
  ("auto", or "reference" for the float64 oracle on the CPU).
- Not supported (an error names them): bias, mask, query_seq_lengths, key_value_seq_lengths,
  implementation other than None.

jax.grad works through a custom VJP (the backward kernel recomputes from the saved log-sum-exp),
jax.jit traces the custom calls, and jax.vmap maps over any leading axes (the handlers loop over
the mapped entries; unmapped operands are read in place, not copied).

flash_attn_with_kvcache: attention against a KV cache for decoding (contiguous or paged, with an append of new
rows, rotary, an FP8 cache), flash_attn's arguments; JAX arrays are immutable, so the updated caches are returned
(see its docstring). Forward only, no vmap.

kvcache_append: every sequence's new K/V rows (different counts per sequence) written into a KV cache without
attending (fa_kvcache_append); returns the updated caches, aliased to the operands as above.

flash_attn_varlen_func: variable-length sequences packed one after the other (cu_seqlens), K/V contiguous or paged
through a block table (a continuous-batching step after kvcache_append), seqused_k; flashattn.torch's function
with a custom VJP for contiguous K/V, no vmap.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flashattn import InvalidArgumentError, UnsupportedError, _ext, backend_id, check_fp8_scales, window_pair

__all__ = ["dot_product_attention", "flash_attn_varlen_func", "flash_attn_with_kvcache", "kvcache_append"]

if not _ext.has_xla_ffi:
    raise ImportError(
        "flashattn.jax: this build of flashattn has no XLA FFI handlers (jaxlib was not importable when the "
        "extension was built). Rebuild in an environment with jax installed: pip install --no-build-isolation ."
    )

for _name, _by_platform in _ext.xla_ffi_targets.items():
    for _platform, _capsule in _by_platform.items():
        jax.ffi.register_ffi_target(_name, _capsule, platform=_platform)

_RNG_WORDS = 4  # uint32: seed lo, seed hi, offset lo, offset hi


def _score_attributes(cfg):
    """The attributes every attention target takes (scale, masks, softcap, dropout), typed as the handlers bind them
    (float -> f32, int / bool -> i32 attributes)."""
    return dict(
        softmax_scale=np.float32(cfg.softmax_scale),
        causal=np.int32(cfg.causal),
        window_left=np.int32(cfg.window_left),
        window_right=np.int32(cfg.window_right),
        softcap=np.float32(cfg.softcap),
        dropout_p=np.float32(cfg.dropout_p),
    )


class _Config(NamedTuple):
    """Static (hashable) attributes of one attention call, in the C ABI's terms."""

    softmax_scale: float  # 0: 1/sqrt(D)
    causal: bool  # window_right = 0 came from causal with T == S
    window_left: int  # -1: unbounded (bottom-right aligned, as in flashattn.h)
    window_right: int
    softcap: float
    dropout_p: float
    has_alibi: bool
    deterministic: bool
    backend: int

    def attributes(self):
        return dict(_score_attributes(self), has_alibi=np.int32(self.has_alibi), backend=np.int32(self.backend))


def _forward_call(q, k, v, slopes, rng, cfg):
    b, t, n, _ = q.shape
    out_type = jax.ShapeDtypeStruct(q.shape[:-1] + (v.shape[-1],), q.dtype)
    lse_type = jax.ShapeDtypeStruct((b, n, t), jnp.float32)
    call = jax.ffi.ffi_call("flashattn_forward", (out_type, lse_type), vmap_method="expand_dims")
    return call(q, k, v, slopes, rng, **cfg.attributes())


def _backward_call(q, k, v, out, lse, dout, slopes, rng, cfg):
    types = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    call = jax.ffi.ffi_call("flashattn_backward", types, vmap_method="expand_dims")
    return call(q, k, v, out, lse, dout, slopes, rng, deterministic=np.int32(cfg.deterministic), **cfg.attributes())


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, slopes, rng, cfg):
    return _forward_call(q, k, v, slopes, rng, cfg)


def _attention_fwd(q, k, v, slopes, rng, cfg):
    out, lse = _forward_call(q, k, v, slopes, rng, cfg)
    return (out, lse), (q, k, v, out, lse, slopes, rng)


def _attention_bwd(cfg, residuals, cotangents):
    q, k, v, out, lse, slopes, rng = residuals
    dout, _ = cotangents  # the lse output is wrapped in stop_gradient by the caller: its cotangent is 0
    dq, dk, dv = _backward_call(q, k, v, out, lse, dout.astype(out.dtype), slopes, rng, cfg)
    # Slopes are wrapped in stop_gradient by the caller (no gradient, as in flash_attn); the rng
    # words are integers, whose cotangent type is float0.
    return dq, dk, dv, jnp.zeros_like(slopes), np.zeros(rng.shape, dtype=jax.dtypes.float0)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _bottom_right_window(t, s, is_causal, local_window_size):
    """jax.nn's top-left mask (i - left <= j <= i + right, and j <= i when causal) as flashattn's
    bottom-right window: j >= i + (s - t) - window_left, j <= i + (s - t) + window_right."""
    if local_window_size is None:
        left = right = None  # unbounded
    elif isinstance(local_window_size, (int, np.integer)):
        left = right = int(local_window_size)
    else:
        try:
            left, right = (int(x) for x in local_window_size)
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"local_window_size: must be an int or a pair (left, right), got {local_window_size!r}"
            ) from None
    if (left is not None and left < 0) or (right is not None and right < 0):
        raise InvalidArgumentError(f"local_window_size: must be >= 0, got {local_window_size!r}")
    if is_causal:
        right = 0 if right is None else min(right, 0)
    shift = s - t  # the diagonal of the bottom-right alignment, measured from the top-left one
    window_left = -1 if left is None else left + shift
    window_right = -1 if right is None else right - shift
    if window_right < -1 or (right is not None and window_right < 0):
        raise UnsupportedError(
            f"is_causal/local_window_size: jax.nn aligns masks to the top-left corner (query i sees keys j <= i"
            f"{' + ' + str(right) if right else ''}); with T = {t} < S = {s} that mask is not expressible by "
            f"flashattn's kernels, which align to the bottom-right (as flash_attn does)")
    if left is not None and window_left < 0:
        raise UnsupportedError(
            f"local_window_size: a left window of {left} with T = {t} > S = {s} is not expressible by flashattn's "
            f"bottom-right aligned windows (it needs a left window of {window_left})")
    causal = bool(is_causal) and shift == 0 and window_right == 0
    return causal, window_left, window_right


def _not_supported(name, value):
    if value is not None:
        raise UnsupportedError(f"{name}: not supported by flashattn.jax.dot_product_attention (pass None)")


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    implementation=None,
    return_residual=False,
    alibi_slopes=None,
    softcap=0.0,
    dropout_rate=0.0,
    dropout_rng=None,
    deterministic=False,
    backend=None,
):
    """Scaled dot-product attention (see the module docstring), softmax(scale * q k^T + masks) v."""
    _not_supported("bias", bias)
    _not_supported("mask", mask)
    _not_supported("query_seq_lengths", query_seq_lengths)
    _not_supported("key_value_seq_lengths", key_value_seq_lengths)
    _not_supported("implementation", implementation)
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    unbatched = query.ndim == 3
    if unbatched:  # (T, N, H), as jax.nn accepts
        query, key, value = query[None], key[None], value[None]
    dropout_rate = float(dropout_rate)
    if dropout_rate > 0.0 and dropout_rng is None:
        raise InvalidArgumentError("dropout_rng: a jax.random key is required when dropout_rate > 0")
    t = query.shape[1] if query.ndim == 4 else 0
    s = key.shape[1] if key.ndim == 4 else 0
    causal, window_left, window_right = _bottom_right_window(t, s, is_causal, local_window_size)

    slopes_shape = None
    if alibi_slopes is not None:
        alibi_slopes = jax.lax.stop_gradient(jnp.asarray(alibi_slopes))
        slopes_shape = list(alibi_slopes.shape)
        if alibi_slopes.dtype != jnp.float32:
            raise InvalidArgumentError(f"alibi_slopes: dtype must be float32, got {alibi_slopes.dtype}")
    cfg = _Config(
        softmax_scale=0.0 if scale is None else float(scale),
        causal=causal,
        window_left=window_left,
        window_right=window_right,
        softcap=float(softcap),
        dropout_p=dropout_rate,
        has_alibi=alibi_slopes is not None,
        deterministic=bool(deterministic),
        backend=backend_id(backend),
    )
    # Every rule of the library, checked on shapes and dtypes while tracing: a bad call raises
    # InvalidArgumentError (a ValueError) here, with the library's message, before any data exists.
    _ext.check_dense(list(query.shape), list(key.shape), list(value.shape), str(query.dtype), str(key.dtype),
                     str(value.dtype), slopes_shape, cfg.softmax_scale, cfg.causal, cfg.window_left,
                     cfg.window_right, cfg.softcap, cfg.dropout_p)

    if alibi_slopes is not None:
        # The handlers read slopes as (B, N) (one layout, so that vmap can map either form).
        alibi_slopes = jnp.broadcast_to(alibi_slopes, (query.shape[0], query.shape[2]))
    else:
        alibi_slopes = jnp.zeros((0,), jnp.float32)  # placeholder, not read
    if dropout_rate > 0.0:
        rng = jax.random.bits(dropout_rng, (_RNG_WORDS,), jnp.uint32)
    else:
        rng = jnp.zeros((_RNG_WORDS,), jnp.uint32)  # placeholder, not read
    out, lse = _attention(query, key, value, alibi_slopes, rng, cfg)
    if unbatched:
        out, lse = out[0], lse[0]
    if return_residual:
        # (B, N, T) -> jax.nn's (B, T, N); no gradient flows through it (see _attention_bwd).
        return out, jax.lax.stop_gradient(jnp.swapaxes(lse, -1, -2))
    return out


def _int32_array(name, x, shape_hint):
    x = jnp.asarray(x)
    if x.dtype != jnp.int32:
        raise InvalidArgumentError(f"{name}: dtype must be int32, got {x.dtype}")
    if shape_hint is not None and x.ndim != shape_hint:
        raise InvalidArgumentError(f"{name}: expected {shape_hint} dimensions, got shape {tuple(x.shape)}")
    return x


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
    """Attention of q (B, Sq, Hq, D) against a KV cache, appending k/v (B, S_new, Hk, D) first (decode, forward only).

    flash_attn.flash_attn_with_kvcache's arguments and semantics (flashattn.torch has the same function):
    k_cache/v_cache are (B, S_cache, Hk, D) or, with block_table (B, max_blocks) int32, paged (num_blocks,
    block_size, Hk, D); cache_seqlens is an int or (B,) int32: rows already in sequence b's cache. When k and v are
    given they are written at rows cache_seqlens[b].. (rotated by rotary_cos / rotary_sin (S_rotary, rotary_dim / 2)
    when given; q is rotated at cache_seqlens + i when causal or windowed, else at cache_seqlens; on CUDA S_rotary >=
    capacity - S_new + max(S_new, Sq), capacity = S_cache or max_blocks * block_size), and attention
    covers cache_seqlens[b] + S_new keys. causal and window_size (left, right; -1 unbounded) are aligned to the
    bottom-right corner; softcap, alibi_slopes (Hq) or (B, Hq) float32, num_splits (0: the library's choice),
    cache_batch_idx (B,) int32 (contiguous caches: sequence b uses cache entry cache_batch_idx[b]), cache_leftpad
    (B,) int32 (left padding: sequence b's keys are cache rows [cache_leftpad[b], cache_seqlens[b] + S_new), positions
    stay the rows' own; entries in [0, cache_seqlens[b]]; on CUDA contiguous caches only), an FP8 cache
    (dtype float8_e4m3fn with the float scales k_scale, v_scale; real value = fp8 value * scale), backend ("auto",
    "cpu", "cuda" or "reference").

    Returns out (B, Sq, Hq, Dv), then softmax_lse (B, Hq, Sq) float32 with return_softmax_lse. JAX arrays are
    immutable: with k and v the updated caches follow, (out, k_cache, v_cache) or (out, softmax_lse, k_cache,
    v_cache). They alias the cache operands, so a jitted decode step that donates its caches
    (jax.jit(step, donate_argnums=...)) appends in place; without donation XLA first copies the caches. The call
    runs in XLA as one custom call (CPU or CUDA, where the arrays live); jax.vmap is not supported.
    """
    q, k_cache, v_cache = jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache)
    if q.ndim != 4 or k_cache.ndim != 4 or v_cache.ndim != 4:
        raise InvalidArgumentError(
            f"q, k_cache, v_cache: expected 4 dimensions each, got shapes {tuple(q.shape)}, {tuple(k_cache.shape)}, "
            f"{tuple(v_cache.shape)}")
    if (k is None) != (v is None):
        raise InvalidArgumentError("k, v: give both (rows to append) or neither")
    append = k is not None
    if append:
        k, v = jnp.asarray(k), jnp.asarray(v)
    batch = q.shape[0]
    if block_table is not None:
        block_table = _int32_array("block_table", block_table, 2)
    if cache_batch_idx is not None:
        cache_batch_idx = _int32_array("cache_batch_idx", cache_batch_idx, 1)
    if cache_leftpad is not None:
        cache_leftpad = _int32_array("cache_leftpad", cache_leftpad, 1)
    if cache_seqlens is None:
        if append:
            raise InvalidArgumentError("cache_seqlens: required when k and v are appended (where would they go?)")
        cache_seqlens = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    if isinstance(cache_seqlens, (int, np.integer)):
        cache_seqlens = jnp.full((batch,), int(cache_seqlens), jnp.int32)
    cache_seqlens = _int32_array("cache_seqlens", cache_seqlens, 1)
    if (rotary_cos is None) != (rotary_sin is None):
        raise InvalidArgumentError("rotary_cos, rotary_sin: give both or neither")
    check_fp8_scales(k_cache.dtype == jnp.float8_e4m3fn, k_scale, v_scale)
    if alibi_slopes is not None:
        alibi_slopes = jnp.asarray(alibi_slopes)
        if alibi_slopes.dtype != jnp.float32:
            raise InvalidArgumentError(f"alibi_slopes: dtype must be float32, got {alibi_slopes.dtype}")
    left, right = window_pair(window_size)

    def present_or(x, dtype):  # absent operands are (0,) placeholders that the handler never reads
        return x if x is not None else jnp.zeros((0,), dtype)

    attributes = dict(
        softmax_scale=np.float32(0.0 if softmax_scale is None else softmax_scale),
        causal=np.int32(bool(causal)),
        window_left=np.int32(left),
        window_right=np.int32(right),
        softcap=np.float32(softcap),
        rotary_interleaved=np.int32(bool(rotary_interleaved)),
        num_splits=np.int32(num_splits),
        k_scale=np.float32(k_scale or 0.0),
        v_scale=np.float32(v_scale or 0.0),
        has_block_table=np.int32(block_table is not None),
        has_rotary=np.int32(rotary_cos is not None),
        has_batch_idx=np.int32(cache_batch_idx is not None),
        has_leftpad=np.int32(cache_leftpad is not None),
        has_alibi=np.int32(alibi_slopes is not None),
        backend=np.int32(backend_id(backend)),
    )
    tail = (cache_seqlens, present_or(block_table, jnp.int32), present_or(rotary_cos, q.dtype),
            present_or(rotary_sin, q.dtype), present_or(cache_batch_idx, jnp.int32),
            present_or(cache_leftpad, jnp.int32), present_or(alibi_slopes, jnp.float32))
    results = [jax.ShapeDtypeStruct(q.shape[:3] + (v_cache.shape[3],), q.dtype),
               jax.ShapeDtypeStruct((batch, q.shape[2], q.shape[1]), jnp.float32)]
    if append:
        results += [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
        call = jax.ffi.ffi_call("flashattn_kvcache_append", results, input_output_aliases={1: 2, 2: 3})
        out, lse, k_cache, v_cache = call(q, k_cache, v_cache, k, v, *tail, **attributes)
        return (out, lse, k_cache, v_cache) if return_softmax_lse else (out, k_cache, v_cache)
    out, lse = jax.ffi.ffi_call("flashattn_kvcache", results)(q, k_cache, v_cache, *tail, **attributes)
    return (out, lse) if return_softmax_lse else out


def _max_length(name, value, cu_seqlens):
    """max_seqlen_q / max_seqlen_k: a Python int (an attribute of the custom call), or None to read it from a concrete
    cu_seqlens."""
    if value is not None:
        return int(value)
    if isinstance(cu_seqlens, jax.core.Tracer):
        raise InvalidArgumentError(f"{name}: pass it as a Python int under jax.jit (an attribute of the custom call: "
                                   "the largest cu_seqlens[b + 1] - cu_seqlens[b])")
    counts = np.diff(np.asarray(cu_seqlens))
    return int(counts.max()) if counts.size else 0


class _VarlenConfig(NamedTuple):
    """Static (hashable) attributes of one varlen call, in the C ABI's terms."""

    softmax_scale: float  # 0: 1/sqrt(D)
    causal: bool
    window_left: int
    window_right: int
    softcap: float
    dropout_p: float
    max_seqlen_q: int
    max_seqlen_k: int
    has_seqused_k: bool
    has_block_table: bool
    has_alibi: bool
    deterministic: bool
    backend: int

    def forward_attributes(self):
        return dict(
            _score_attributes(self),
            max_seqlen_q=np.int32(self.max_seqlen_q),
            max_seqlen_k=np.int32(self.max_seqlen_k),
            has_seqused_k=np.int32(self.has_seqused_k),
            has_block_table=np.int32(self.has_block_table),
            has_alibi=np.int32(self.has_alibi),
            backend=np.int32(self.backend),
        )

    def backward_attributes(self):
        attributes = self.forward_attributes()
        del attributes["has_seqused_k"], attributes["has_block_table"]
        attributes["deterministic"] = np.int32(self.deterministic)
        return attributes


def _varlen_forward_call(q, k, v, cu_q, cu_k, seqused_k, block_table, slopes, rng, cfg):
    out_type = jax.ShapeDtypeStruct(q.shape[:2] + (v.shape[-1],), q.dtype)
    lse_type = jax.ShapeDtypeStruct((q.shape[1], q.shape[0]), jnp.float32)
    call = jax.ffi.ffi_call("flashattn_varlen_forward", (out_type, lse_type))
    return call(q, k, v, cu_q, cu_k, seqused_k, block_table, slopes, rng, **cfg.forward_attributes())


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _varlen_attention(q, k, v, cu_q, cu_k, seqused_k, block_table, slopes, rng, cfg):
    return _varlen_forward_call(q, k, v, cu_q, cu_k, seqused_k, block_table, slopes, rng, cfg)


def _varlen_attention_fwd(q, k, v, cu_q, cu_k, seqused_k, block_table, slopes, rng, cfg):
    out, lse = _varlen_forward_call(q, k, v, cu_q, cu_k, seqused_k, block_table, slopes, rng, cfg)
    return (out, lse), (q, k, v, out, lse, cu_q, cu_k, seqused_k, block_table, slopes, rng)


def _varlen_attention_bwd(cfg, residuals, cotangents):
    q, k, v, out, lse, cu_q, cu_k, seqused_k, block_table, slopes, rng = residuals
    if cfg.has_block_table:
        raise UnsupportedError("block_table: paged K/V has no backward pass (as in flash_attn)")
    if cfg.has_seqused_k:
        raise UnsupportedError("seqused_k: the backward pass takes every key of cu_seqlens_k (forward only)")
    dout, _ = cotangents  # the lse output is wrapped in stop_gradient by the caller: its cotangent is 0
    types = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    call = jax.ffi.ffi_call("flashattn_varlen_backward", types)
    dq, dk, dv = call(q, k, v, out, lse, dout.astype(out.dtype), cu_q, cu_k, slopes, rng, **cfg.backward_attributes())
    # Integer operands' cotangents are float0; the slopes get none (stop_gradient by the caller, as in flash_attn).
    float0 = lambda x: np.zeros(x.shape, dtype=jax.dtypes.float0)  # noqa: E731
    return (dq, dk, dv, float0(cu_q), float0(cu_k), float0(seqused_k), float0(block_table), jnp.zeros_like(slopes),
            float0(rng))


_varlen_attention.defvjp(_varlen_attention_fwd, _varlen_attention_bwd)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
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
    dropout_rng=None,
    backend=None,
):
    """Attention of variable-length sequences packed one after the other.

    flashattn.torch.flash_attn_varlen_func's arguments (in its order) and semantics: q (total_q, Hq, D), k / v
    (total_k, Hk, D / Dv), cu_seqlens_q / cu_seqlens_k (B + 1,) int32 prefix sums (sequence b's rows are
    cu_seqlens[b] .. cu_seqlens[b + 1] - 1); masks (causal, window_size, ALiBi) are aligned to each sequence's
    bottom-right corner. With block_table (B, max_blocks) int32, k / v are paged caches (num_blocks, block_size, Hk,
    D / Dv) and sequence b's keys are its first cu_seqlens_k[b + 1] - cu_seqlens_k[b] cache rows: after
    kvcache_append, one causal call with cu_seqlens_q = cu_seqlens_new serves a continuous-batching step whose
    requests bring different numbers of tokens (on CUDA the decode tokens run in the decode kernels). seqused_k (B,)
    int32: sequence b attends to its first seqused_k[b] keys only. max_seqlen_q / max_seqlen_k are attributes of the
    custom call: Python ints under jax.jit (None reads them from concrete cu_seqlens). dropout_p > 0 takes dropout_rng,
    a jax.random key (flashattn's Philox keep mask, regenerated in backward). Returns out (total_q, Hq, Dv),
    and with return_attn_probs (out, softmax_lse (Hq, total_q) float32, None). jax.grad gives dq, dk, dv for
    contiguous K/V without seqused_k (deterministic: a reproducible dq accumulation; the slopes get no gradient);
    with block_table or seqused_k it raises UnsupportedError (forward only, as flashattn.torch). No jax.vmap.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if q.ndim != 3:
        raise InvalidArgumentError(f"q: expected 3 dimensions (total_q, Hq, D), got shape {tuple(q.shape)}")
    cu_seqlens_q = _int32_array("cu_seqlens_q", cu_seqlens_q, 1)
    cu_seqlens_k = _int32_array("cu_seqlens_k", cu_seqlens_k, 1)
    max_seqlen_q = _max_length("max_seqlen_q", max_seqlen_q, cu_seqlens_q)
    max_seqlen_k = _max_length("max_seqlen_k", max_seqlen_k, cu_seqlens_k)
    if seqused_k is not None:
        seqused_k = _int32_array("seqused_k", seqused_k, 1)
    if block_table is not None:
        block_table = _int32_array("block_table", block_table, 2)
    if alibi_slopes is not None:
        alibi_slopes = jnp.asarray(alibi_slopes)
        if alibi_slopes.dtype != jnp.float32:
            raise InvalidArgumentError(f"alibi_slopes: dtype must be float32, got {alibi_slopes.dtype}")
    dropout_p = float(dropout_p)
    if dropout_p > 0.0 and dropout_rng is None:
        raise InvalidArgumentError("dropout_rng: a jax.random key is required when dropout_p > 0")
    left, right = window_pair(window_size)
    cfg = _VarlenConfig(0.0 if softmax_scale is None else float(softmax_scale), bool(causal), left, right,
                        float(softcap), dropout_p, max_seqlen_q, max_seqlen_k, seqused_k is not None,
                        block_table is not None, alibi_slopes is not None, bool(deterministic), backend_id(backend))

    def present_or(x, dtype):  # absent operands are (0,) placeholders that the handler never reads
        return x if x is not None else jnp.zeros((0,), dtype)

    slopes = jax.lax.stop_gradient(present_or(alibi_slopes, jnp.float32))
    if dropout_p > 0.0:
        rng = jax.random.bits(dropout_rng, (_RNG_WORDS,), jnp.uint32)
    else:
        rng = jnp.zeros((_RNG_WORDS,), jnp.uint32)  # placeholder, not read
    out, lse = _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, present_or(seqused_k, jnp.int32),
                                 present_or(block_table, jnp.int32), slopes, rng, cfg)
    return (out, jax.lax.stop_gradient(lse), None) if return_attn_probs else out


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
    """Writes new key/value rows into a KV cache without attending (fa_kvcache_append); returns (k_cache, v_cache).

    flashattn.torch.kvcache_append's arguments: k, v (total_new, Hk, D) hold every sequence's new rows one after the
    other, sequence b's being rows cu_seqlens_new[b] .. cu_seqlens_new[b + 1] - 1 ((B + 1,) int32, from 0), written at
    cache rows cache_seqlens[b], cache_seqlens[b] + 1, ... ((B,) int32; not updated). k_cache / v_cache are (B,
    S_cache, Hk, D) or, with block_table (B, max_blocks) int32, paged (num_blocks, block_size, Hk, D); an FP8 cache
    (float8_e4m3fn) takes k_scale, v_scale (rows stored as e4m3(x / scale)). max_seqlen_new is the largest count: an
    attribute of the custom call, so under jax.jit pass it as a Python int (None reads it from a concrete
    cu_seqlens_new; a traced one raises). check_indices (CUDA): the device checks the index arrays first and the call
    fails on a bad entry; without it a sequence whose entries are out of range writes nothing.

    JAX arrays are immutable: the updated caches are returned. They alias the cache operands, so a jitted step that
    donates its caches (jax.jit(step, donate_argnums=...)) writes in place; without donation XLA copies the caches
    first. Followed by one causal flash_attn_with_kvcache (no k, v) over the caches, it serves a step whose requests
    bring different numbers of tokens (docs/PYTHON.md). No jax.vmap.
    """
    k_cache, v_cache, k, v = jnp.asarray(k_cache), jnp.asarray(v_cache), jnp.asarray(k), jnp.asarray(v)
    cu_seqlens_new = _int32_array("cu_seqlens_new", cu_seqlens_new, 1)
    cache_seqlens = _int32_array("cache_seqlens", cache_seqlens, 1)
    if block_table is not None:
        block_table = _int32_array("block_table", block_table, 2)
    if max_seqlen_new is None:
        if isinstance(cu_seqlens_new, jax.core.Tracer):
            raise InvalidArgumentError(
                "max_seqlen_new: required under jax.jit (it is an attribute of the custom call: pass a Python int, "
                "the largest cu_seqlens_new[b + 1] - cu_seqlens_new[b])")
        counts = np.diff(np.asarray(cu_seqlens_new))
        max_seqlen_new = int(counts.max()) if counts.size > 0 else 0
    check_fp8_scales(k_cache.dtype == jnp.float8_e4m3fn, k_scale, v_scale)
    attributes = dict(
        max_seqlen_new=np.int32(max_seqlen_new),
        check_indices=np.int32(bool(check_indices)),
        k_scale=np.float32(k_scale or 0.0),
        v_scale=np.float32(v_scale or 0.0),
        has_block_table=np.int32(block_table is not None),
        backend=np.int32(backend_id(backend)),
    )
    table = block_table if block_table is not None else jnp.zeros((0,), jnp.int32)  # a placeholder, never read
    results = [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
    call = jax.ffi.ffi_call("flashattn_kvcache_append_only", results, input_output_aliases={0: 0, 1: 1})
    k_cache, v_cache = call(k_cache, v_cache, k, v, cache_seqlens, table, cu_seqlens_new, **attributes)
    return k_cache, v_cache
