"""flashattn.jax against the float64 numpy oracle (tests/python/oracle.py) and jax.nn, on the CPU.

Checks the XLA FFI custom calls under jax.jit, jax.grad (custom VJP) and jax.vmap, the
top-left mask translation of jax.nn's is_causal / local_window_size, dropout bit for bit, and
errors raised while tracing; and flash_attn_with_kvcache (contiguous and paged caches, the append
returned as updated caches, in place under donation).
"""

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import flashattn  # noqa: E402
from oracle import attention, rel_l2, rotary  # noqa: E402

fj = pytest.importorskip("flashattn.jax")

BACKENDS = ["reference", "auto"]
FP32_TOLERANCE = 1e-5
DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


@pytest.fixture(autouse=True)
def on_the_cpu():
    """These are the CPU tests (test_gpu.py has the GPU's): keep arrays on the CPU even where JAX's
    default device is a GPU."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def normal(rng, shape, dtype=jnp.float32, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype=dtype)


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), dtype=np.float64)


def top_left_to_bottom_right(t, s, is_causal, window):
    """The oracle's (bottom-right) window equal to jax.nn's top-left mask, for the oracle call."""
    left, right = (None, None) if window is None else ((window, window) if isinstance(window, int) else window)
    if is_causal:
        right = 0 if right is None else min(right, 0)
    return (-1 if left is None else left + s - t, -1 if right is None else right - (s - t))


# (B, T, S, N, K, H, Hv) with T >= S (where jax.nn's top-left masks are expressible)
SHAPES = [
    (1, 1, 1, 1, 1, 32, 32),
    (2, 17, 17, 4, 2, 64, 64),
    (1, 127, 65, 4, 4, 64, 64),
    (2, 33, 33, 6, 1, 96, 96),
]
MASKS = {
    "none": dict(is_causal=False, local_window_size=None),
    "causal": dict(is_causal=True, local_window_size=None),
    "window": dict(is_causal=False, local_window_size=(7, 3)),
    "causal_window_int": dict(is_causal=True, local_window_size=5),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", list(MASKS))
def test_forward_matches_oracle_and_jax_nn(rng, backend, dtype, shape, mask):
    b, t, s, n, k_heads, h, hv = shape
    dt = DTYPES[dtype]
    q, k, v = normal(rng, (b, t, n, h), dt), normal(rng, (b, s, k_heads, h), dt), normal(rng, (b, s, k_heads, hv), dt)
    opts = MASKS[mask]
    call = jax.jit(lambda q, k, v: fj.dot_product_attention(q, k, v, backend=backend, return_residual=True, **opts))
    window = top_left_to_bottom_right(t, s, opts["is_causal"], opts["local_window_size"])
    if opts["local_window_size"] is not None and window[0] < 0:
        # jax.nn's left window reaches past key 0 for the last T - S rows: not expressible (and
        # those rows would see no key); refused, never computed differently.
        with pytest.raises(flashattn.UnsupportedError, match="not expressible"):
            call(q, k, v)
        return
    out, lse = call(q, k, v)
    assert out.shape == (b, t, n, hv) and out.dtype == dt and lse.shape == (b, t, n)
    expected, expected_lse = attention(f64(q), f64(k), f64(v), window=window)
    err = rel_l2(f64(out), expected)
    limit, base = FP32_TOLERANCE, None
    if dt != jnp.float32:  # baseline: jax.nn (XLA, naive) in the same precision
        base = rel_l2(f64(jax.nn.dot_product_attention(q, k, v, **opts)), expected)
        limit = 3 * base + 1e-6
    assert err <= limit, f"relative L2 error {err:.3g} > {limit:.3g} (jax.nn: {base})"
    finite = np.isfinite(expected_lse)
    # lse judged absolutely, relative to max(1, max |lse|) (see test_torch.assert_lse)
    lse_error = np.abs(np.asarray(lse).transpose(0, 2, 1)[finite] - expected_lse[finite])
    assert lse_error.max(initial=0.0) <= 1e-5 * max(1.0, float(np.abs(expected_lse[finite]).max(initial=0.0)))


def test_unbatched_inputs_softcap_alibi_scale(rng):
    t, n, h = 19, 4, 32
    q, k, v = normal(rng, (t, n, h), scale=3.0), normal(rng, (t, 2, h), scale=3.0), normal(rng, (t, 2, 48))
    slopes = jnp.asarray(rng.uniform(0.05, 0.5, (n,)), jnp.float32)
    out = fj.dot_product_attention(q, k, v, scale=0.3, softcap=6.0, alibi_slopes=slopes, is_causal=True,
                                   backend="reference")
    assert out.shape == (t, n, 48)  # value head size differs from the query's
    expected, _ = attention(f64(q)[None], f64(k)[None], f64(v)[None], softmax_scale=0.3, causal=True, softcap=6.0,
                            alibi_slopes=np.asarray(slopes, np.float64))
    assert rel_l2(f64(out)[None], expected) <= FP32_TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask", list(MASKS))
def test_jit_grad_matches_oracle(rng, backend, mask):
    b, t, s, n, k_heads, h = 2, 21, 17, 4, 2, 32
    q, k, v = normal(rng, (b, t, n, h)), normal(rng, (b, s, k_heads, h)), normal(rng, (b, s, k_heads, h))
    dout = normal(rng, (b, t, n, h))
    opts = MASKS[mask]
    slopes = jnp.asarray(rng.uniform(0.05, 0.5, (b, n)), jnp.float32)

    def loss(q, k, v):
        out = fj.dot_product_attention(q, k, v, softcap=4.0, alibi_slopes=slopes, backend=backend, **opts)
        return jnp.sum(out * dout)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    dq, dk, dv = grad(q, k, v)
    window = top_left_to_bottom_right(t, s, opts["is_causal"], opts["local_window_size"])
    _, _, grads = attention(f64(q), f64(k), f64(v), window=window, softcap=4.0, alibi_slopes=np.asarray(slopes),
                            dout=f64(dout))
    for name, actual, expected in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
        err = rel_l2(f64(actual), expected)
        assert err <= FP32_TOLERANCE, f"{name}: relative L2 error {err:.3g}"


def test_vmap_forward_and_grad_match_loop(rng):
    b, t, n, h = 2, 13, 4, 32
    qs = normal(rng, (3, b, t, n, h))
    k, v = normal(rng, (b, t, 2, h)), normal(rng, (b, t, 2, h))
    slopes = jnp.asarray(rng.uniform(0.05, 0.5, (3, n)), jnp.float32)

    def f(q, k, v, slopes):
        return fj.dot_product_attention(q, k, v, is_causal=True, alibi_slopes=slopes, backend="reference")

    batched = jax.jit(jax.vmap(f, in_axes=(0, None, None, 0)))(qs, k, v, slopes)
    for i in range(3):
        expected, _ = attention(f64(qs[i]), f64(k), f64(v), causal=True, alibi_slopes=np.asarray(slopes[i]))
        assert rel_l2(f64(batched[i]), expected) <= FP32_TOLERANCE

    def loss(q, k, v):
        return jnp.sum(fj.dot_product_attention(q, k, v, is_causal=True, backend="reference") ** 2)

    # nested vmap: over queries and over keys, both mapped
    ks = jnp.stack([k, 2 * k])
    grads = jax.vmap(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, None, None)), in_axes=(None, 0, None))(
        qs, ks, v)
    for j in range(2):
        for i in range(3):
            single = jax.grad(loss, argnums=(0, 1, 2))(qs[i], ks[j], v)
            for a, e in zip(grads, single):
                np.testing.assert_allclose(np.asarray(a[j, i]), np.asarray(e), rtol=1e-6, atol=1e-6)


def test_dropout_bit_exact_and_vmapped_keys(rng):
    b, t, n, h, p = 2, 21, 4, 32, 0.35
    q, k, v = normal(rng, (b, t, n, h)), normal(rng, (b, t, 2, h)), normal(rng, (b, t, 2, h))
    dout = normal(rng, (b, t, n, h))
    key = jax.random.PRNGKey(11)

    def loss(q, key):
        out = fj.dot_product_attention(q, k, v, is_causal=True, dropout_rate=p, dropout_rng=key, backend="reference")
        return jnp.sum(out * dout), out

    (_, out), dq = jax.jit(jax.value_and_grad(loss, has_aux=True))(q, key)
    words = [int(w) for w in np.asarray(jax.random.bits(key, (4,), jnp.uint32))]
    seed, offset = words[0] | (words[1] << 32), words[2] | (words[3] << 32)
    expected, _, grads = attention(f64(q), f64(k), f64(v), causal=True, dropout_p=p, seed=seed, offset=offset,
                                   dout=f64(dout))
    assert rel_l2(f64(out), expected) <= FP32_TOLERANCE
    assert rel_l2(f64(dq), grads[0]) <= FP32_TOLERANCE
    # vmap over keys: each entry uses its own mask
    keys = jax.random.split(key, 2)
    outs = jax.vmap(lambda kk: loss(q, kk)[1])(keys)
    assert not np.array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
    np.testing.assert_array_equal(np.asarray(outs[1]), np.asarray(loss(q, keys[1])[1]))


def test_errors_raise_while_tracing(rng):
    q = normal(rng, (2, 5, 4, 32))
    k = normal(rng, (2, 5, 3, 32))
    with pytest.raises(ValueError, match=r"k: dimension 2 \(Hk\) must divide q's Hq = 4, got 3"):
        jax.jit(lambda q, k: fj.dot_product_attention(q, k, k)).lower(q, k)
    with pytest.raises(flashattn.InvalidArgumentError, match=r"dtype must match q"):
        fj.dot_product_attention(q, q.astype(jnp.float16), q)
    with pytest.raises(NotImplementedError, match="bias: not supported"):
        fj.dot_product_attention(q, q, q, bias=jnp.zeros((2, 4, 5, 5)))
    with pytest.raises(NotImplementedError, match="key_value_seq_lengths"):
        fj.dot_product_attention(q, q, q, key_value_seq_lengths=jnp.array([3, 5]))
    longer = normal(rng, (2, 9, 4, 32))
    with pytest.raises(flashattn.UnsupportedError, match="top-left"):
        fj.dot_product_attention(q, longer, longer, is_causal=True)  # T < S: not expressible
    with pytest.raises(ValueError, match="dropout_rng: a jax.random key is required"):
        fj.dot_product_attention(q, q, q, dropout_rate=0.1)
    with pytest.raises(ValueError, match=r"dropout_p: must be in \[0, 1\)"):
        fj.dot_product_attention(q, q, q, dropout_rate=1.0, dropout_rng=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"alibi_slopes: dimension 0 \(Hq\) must be 4"):
        fj.dot_product_attention(q, q, q, alibi_slopes=jnp.ones((3,), jnp.float32))


def test_import_flashattn_before_jax_in_a_fresh_process():
    """flashattn first, then jax (numpy, ml_dtypes) in a new interpreter. With ~5000 symbols of a statically linked
    libstdc++ exported from the extension, this order crashed (segfault in ml_dtypes' import) on the H200 machine
    (2026-12-04); python/CMakeLists.txt keeps them inside now."""
    import subprocess
    import sys

    code = "import flashattn; import jax; import flashattn.jax; print(jax.numpy.ones(2).sum())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert r.stdout.strip() == "2.0"


# ---- flash_attn_with_kvcache ----


def paged_layout(dense, table):
    """dense (B, S, Hk, D) as a paged cache: the pool whose blocks table[b] hold sequence b's rows in order."""
    block = dense.shape[1] // table.shape[1]
    pool = np.empty((table.size, block) + dense.shape[2:], dense.dtype)
    for seq in range(table.shape[0]):
        for c in range(table.shape[1]):
            pool[table[seq, c]] = dense[seq, c * block:(c + 1) * block]
    return pool


def gather(cache, table, seq):
    """Sequence seq's rows of a contiguous (table None) or paged cache."""
    cache = np.asarray(cache)
    return cache[seq] if table is None else np.concatenate([cache[c] for c in table[seq]])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kvcache_append_rotary_matches_oracle(rng, backend, paged, causal):
    b, s_cache, s_new, sq, hq, hk, d, rot, block = 3, 64, 3, 3, 4, 2, 32, 16, 16
    cached = np.array([0, 17, 40], dtype=np.int32)
    q = rng.standard_normal((b, sq, hq, d)).astype(np.float32)
    k_new = rng.standard_normal((b, s_new, hk, d)).astype(np.float32)
    v_new = rng.standard_normal((b, s_new, hk, d)).astype(np.float32)
    cos = np.cos(rng.uniform(0, 6.3, (s_cache, rot // 2))).astype(np.float32)
    sin = np.sin(rng.uniform(0, 6.3, (s_cache, rot // 2))).astype(np.float32)
    dense_k = rng.standard_normal((b, s_cache, hk, d)).astype(np.float32)
    dense_v = rng.standard_normal((b, s_cache, hk, d)).astype(np.float32)
    if paged:  # shuffled blocks
        table = rng.permutation(b * s_cache // block).reshape(b, s_cache // block).astype(np.int32)
        k_before, v_before = paged_layout(dense_k, table), paged_layout(dense_v, table)
    else:
        k_before, v_before, table = dense_k, dense_v, None

    def step(k_cache, v_cache):
        return fj.flash_attn_with_kvcache(jnp.asarray(q), k_cache, v_cache, jnp.asarray(k_new), jnp.asarray(v_new),
                                          rotary_cos=jnp.asarray(cos), rotary_sin=jnp.asarray(sin),
                                          cache_seqlens=jnp.asarray(cached),
                                          block_table=None if table is None else jnp.asarray(table), causal=causal,
                                          rotary_interleaved=False, return_softmax_lse=True, backend=backend)

    # Donated caches: the append happens in the caches' own buffers.
    out, lse, k_cache, v_cache = jax.jit(step, donate_argnums=(0, 1))(jnp.asarray(k_before), jnp.asarray(v_before))
    assert out.shape == (b, sq, hq, d) and lse.shape == (b, hq, sq) and lse.dtype == jnp.float32
    assert k_cache.shape == k_before.shape and v_cache.shape == v_before.shape
    for seq in range(b):
        n = cached[seq]
        k_rot = rotary(k_new[seq], cos.astype(np.float64), sin.astype(np.float64), np.arange(n, n + s_new), False)
        assert rel_l2(gather(k_cache, table, seq)[n:n + s_new], k_rot) <= 1e-6, "rotated new keys in the cache"
        np.testing.assert_array_equal(gather(v_cache, table, seq)[n:n + s_new], v_new[seq])
        np.testing.assert_array_equal(gather(k_cache, table, seq)[:n], gather(k_before, table, seq)[:n])
        q_positions = np.arange(n, n + sq) if causal else np.full(sq, n)
        q_rot = rotary(q[seq], cos.astype(np.float64), sin.astype(np.float64), q_positions, False)
        keys = np.concatenate([gather(k_before, table, seq)[:n].astype(np.float64), k_rot])
        values = np.concatenate([gather(v_before, table, seq)[:n].astype(np.float64), v_new[seq].astype(np.float64)])
        expected, expected_lse = attention(q_rot[None], keys[None], values[None], causal=causal)
        assert rel_l2(f64(out[seq][None]), expected) <= FP32_TOLERANCE, f"out of sequence {seq}"
        assert rel_l2(f64(lse[seq]), expected_lse[0]) <= FP32_TOLERANCE, f"lse of sequence {seq}"

    # Without donation the operands stay as they were (XLA copies them for the in-place append).
    k_keep, v_keep = jnp.asarray(k_before), jnp.asarray(v_before)
    again = jax.jit(step)(k_keep, v_keep)
    np.testing.assert_array_equal(np.asarray(k_keep), k_before)
    np.testing.assert_array_equal(np.asarray(again[2]), np.asarray(k_cache))
    np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(out))


@pytest.mark.parametrize("backend", BACKENDS)
def test_kvcache_read_only_batch_idx_softcap_alibi(rng, backend):
    b, slots, s_cache, hq, hk, d = 2, 5, 48, 6, 3, 64
    k_slots = normal(rng, (slots, s_cache, hk, d))
    v_slots = normal(rng, (slots, s_cache, hk, d))
    q = normal(rng, (b, 1, hq, d))
    idx = np.array([4, 1], dtype=np.int32)
    lengths = np.array([48, 9], dtype=np.int32)
    slopes = rng.uniform(0.05, 0.5, (hq,)).astype(np.float32)
    out = jax.jit(lambda q, kc, vc: fj.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=jnp.asarray(lengths), cache_batch_idx=jnp.asarray(idx), softcap=5.0,
        alibi_slopes=jnp.asarray(slopes), backend=backend))(q, k_slots, v_slots)
    assert not isinstance(out, tuple) and out.shape == (b, 1, hq, d)
    for seq in range(b):
        n = lengths[seq]
        expected, _ = attention(f64(q[seq][None]), f64(k_slots[idx[seq]][None, :n]), f64(v_slots[idx[seq]][None, :n]),
                                softcap=5.0, alibi_slopes=slopes)
        assert rel_l2(f64(out[seq][None]), expected) <= FP32_TOLERANCE, f"sequence {seq}"
    # cache_leftpad: sequence b's keys are rows [pad[b], lengths[b]) (positions unchanged: ALiBi as without padding)
    pad = np.array([40, 0], dtype=np.int32)
    padded = fj.flash_attn_with_kvcache(q, k_slots, v_slots, cache_seqlens=jnp.asarray(lengths),
                                        cache_batch_idx=jnp.asarray(idx), cache_leftpad=jnp.asarray(pad), softcap=5.0,
                                        alibi_slopes=jnp.asarray(slopes), backend=backend)
    for seq in range(b):
        n, p0 = lengths[seq], pad[seq]
        keys, values = f64(k_slots[idx[seq]][None, p0:n]), f64(v_slots[idx[seq]][None, p0:n])
        expected, _ = attention(f64(q[seq][None]), keys, values, softcap=5.0, alibi_slopes=slopes)
        assert rel_l2(f64(padded[seq][None]), expected) <= FP32_TOLERANCE, f"leftpad, sequence {seq}"
    # An int cache_seqlens: every sequence holds that many rows.
    whole = fj.flash_attn_with_kvcache(q, k_slots[:b], v_slots[:b], cache_seqlens=s_cache, backend=backend)
    expected, _ = attention(f64(q), f64(k_slots[:b]), f64(v_slots[:b]))
    assert rel_l2(f64(whole), expected) <= FP32_TOLERANCE
    # No cache_seqlens over a paged cache: the whole capacity, max_blocks x block_size rows per sequence.
    table = rng.permutation(b * s_cache // 16).reshape(b, s_cache // 16).astype(np.int32)
    paged = fj.flash_attn_with_kvcache(q, paged_layout(np.asarray(k_slots[:b]), table),
                                       paged_layout(np.asarray(v_slots[:b]), table), block_table=jnp.asarray(table),
                                       backend=backend)
    assert rel_l2(f64(paged), expected) <= FP32_TOLERANCE, "paged, whole capacity"


def test_kvcache_errors(rng):
    q = normal(rng, (1, 1, 2, 32))
    cache = normal(rng, (1, 16, 2, 32))
    new = normal(rng, (1, 1, 2, 32))
    with pytest.raises(flashattn.InvalidArgumentError, match="k, v: give both"):
        fj.flash_attn_with_kvcache(q, cache, cache, new, None, cache_seqlens=3)
    with pytest.raises(flashattn.InvalidArgumentError, match="cache_seqlens: required"):
        fj.flash_attn_with_kvcache(q, cache, cache, new, new)
    cos = normal(rng, (16, 8))
    with pytest.raises(flashattn.InvalidArgumentError, match="rotary_cos, rotary_sin: give both"):
        fj.flash_attn_with_kvcache(q, cache, cache, new, new, rotary_cos=cos, cache_seqlens=3)
    with pytest.raises(flashattn.InvalidArgumentError, match="cache_seqlens: dtype must be int32"):
        fj.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=jnp.asarray([3], jnp.int64 if jax.config.jax_enable_x64 else jnp.int16))
    with pytest.raises(flashattn.InvalidArgumentError, match="cache_leftpad: dtype must be int32"):
        fj.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=3, cache_leftpad=jnp.asarray([1], jnp.float32))
    # The library's own rules, raised when the call runs: the message names the argument.
    with pytest.raises(Exception, match="cache_seqlens"):
        jax.block_until_ready(fj.flash_attn_with_kvcache(q, cache, cache, new, new, cache_seqlens=jnp.asarray([16], jnp.int32)))
    with pytest.raises(Exception, match=r"cache_leftpad: entry 0 = 4 must be in \[0, cache_seqlens\[0\] = 3\]"):
        jax.block_until_ready(fj.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=3,
                                                         cache_leftpad=jnp.asarray([4], jnp.int32)))
    with pytest.raises(Exception, match="k_cache"):
        jax.block_until_ready(fj.flash_attn_with_kvcache(q, normal(rng, (1, 16, 2, 64)), cache, cache_seqlens=3))
    with pytest.raises(Exception, match=r"num_splits: must be in \[0, 1024\]"):
        jax.block_until_ready(fj.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=3, num_splits=2000))


# ---- kvcache_append (fa_kvcache_append: the rows written without attending) ----


def append_inputs(rng, dtype, paged, counts, cached, s_cache=48, block=16, hk=2, d=32):
    """Caches of B sequences, every sequence's new rows packed (total_new, Hk, D) with cu_seqlens_new."""
    b = len(counts)
    table = None
    k_cache = np.asarray(normal(rng, (b, s_cache, hk, d), dtype))
    v_cache = np.asarray(normal(rng, (b, s_cache, hk, d), dtype))
    if paged:  # shuffled blocks, two spare ones that no sequence owns
        table = rng.permutation(b * s_cache // block + 2)[:b * s_cache // block].reshape(b, -1).astype(np.int32)
        pool_k = np.asarray(normal(rng, (b * s_cache // block + 2, block, hk, d), dtype))
        pool_v = np.asarray(normal(rng, (b * s_cache // block + 2, block, hk, d), dtype))
        k_cache, v_cache = pool_k, pool_v
    k = np.asarray(normal(rng, (sum(counts), hk, d), dtype))
    v = np.asarray(normal(rng, (sum(counts), hk, d), dtype))
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return k_cache, v_cache, k, v, cu, np.asarray(cached, np.int32), table


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_append_equals_per_sequence_kvcache(rng, dtype, paged):
    """kvcache_append writes every sequence's rows (different counts, one of them none) exactly where and as
    flash_attn_with_kvcache's append writes them, one call per sequence; every other row stays as it was. Under
    jax.jit with the caches donated (in place) and without (the operands unchanged)."""
    counts, cached = [3, 0, 16, 1], [0, 5, 17, 40]
    k_cache, v_cache, k, v, cu, seqlens, table = append_inputs(rng, DTYPES[dtype], paged, counts, cached)
    want_k, want_v = jnp.asarray(k_cache), jnp.asarray(v_cache)
    for b, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(cu[b], cu[b + 1])
        q = jnp.zeros((1, 1, 2, 32), DTYPES[dtype])
        if paged:
            _, want_k, want_v = fj.flash_attn_with_kvcache(q, want_k, want_v, k[rows][None], v[rows][None],
                                                           cache_seqlens=seqlens[b:b + 1], block_table=table[b:b + 1],
                                                           backend="reference")
        else:
            _, kb, vb = fj.flash_attn_with_kvcache(q, want_k[b:b + 1], want_v[b:b + 1], k[rows][None], v[rows][None],
                                                   cache_seqlens=seqlens[b:b + 1], backend="reference")
            want_k, want_v = want_k.at[b].set(kb[0]), want_v.at[b].set(vb[0])

    def step(kc, vc, kn, vn, c, s, t):
        return fj.kvcache_append(kc, vc, kn, vn, c, s, max(counts), t, backend="auto")

    table_arg = None if table is None else jnp.asarray(table)
    k_keep, v_keep = jnp.asarray(k_cache), jnp.asarray(v_cache)
    kc, vc = jax.jit(step)(k_keep, v_keep, k, v, jnp.asarray(cu), jnp.asarray(seqlens), table_arg)
    np.testing.assert_array_equal(np.asarray(kc), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(vc), np.asarray(want_v))
    np.testing.assert_array_equal(np.asarray(k_keep), k_cache)  # not donated: XLA copied the caches first
    kd, vd = jax.jit(step, donate_argnums=(0, 1))(jnp.asarray(k_cache), jnp.asarray(v_cache), k, v, jnp.asarray(cu),
                                                  jnp.asarray(seqlens), table_arg)
    np.testing.assert_array_equal(np.asarray(kd), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(vd), np.asarray(want_v))
    # Eager, max_seqlen_new read from the concrete cu_seqlens_new.
    ke, _ = fj.kvcache_append(k_cache, v_cache, k, v, cu, seqlens, block_table=table, backend="auto")
    np.testing.assert_array_equal(np.asarray(ke), np.asarray(want_k))


def test_kvcache_append_mixed_step_then_kvcache_read(rng):
    """A serving step in JAX: one kvcache_append of two prompt chunks and two decode tokens, then one causal
    flash_attn_with_kvcache (no k, v) whose q holds each sequence's new queries in its last rows (bottom-right
    aligned), equals flash_attn_with_kvcache's own append per sequence."""
    counts, cached = [9, 1, 20, 1], [4, 30, 0, 7]
    k_cache, v_cache, k, v, cu, seqlens, table = append_inputs(rng, jnp.float32, True, counts, cached)
    hq, sq = 4, max(counts)
    q_packed = np.asarray(normal(rng, (sum(counts), hq, 32)))
    q = np.zeros((len(counts), sq, hq, 32), np.float32)
    for b, n in enumerate(counts):
        q[b, sq - n:] = q_packed[cu[b]:cu[b + 1]]

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def mixed_step(kc, vc, kn, vn, c, s, t, q):
        kc, vc = fj.kvcache_append(kc, vc, kn, vn, c, s, sq, t)
        out = fj.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=s + (c[1:] - c[:-1]), block_table=t, causal=True)
        return out, kc, vc

    out, _, _ = mixed_step(jnp.asarray(k_cache), jnp.asarray(v_cache), k, v, jnp.asarray(cu), jnp.asarray(seqlens),
                           jnp.asarray(table), jnp.asarray(q))
    for b, n in enumerate(counts):
        rows = slice(cu[b], cu[b + 1])
        want = fj.flash_attn_with_kvcache(q_packed[rows][None], k_cache, v_cache, k[rows][None], v[rows][None],
                                          cache_seqlens=seqlens[b:b + 1], block_table=table[b:b + 1], causal=True,
                                          backend="reference")[0]
        assert rel_l2(f64(out[b, sq - n:][None]), f64(want)) <= FP32_TOLERANCE, f"sequence {b}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("variant", ["causal", "window alibi softcap", "seqused_k"])
def test_varlen_forward_matches_oracle(rng, backend, paged, variant):
    """flash_attn_varlen_func: sequences of 0, 1, 7 and 20 queries over 5, 1, 30 and 20 keys (contiguous, or paged with
    shuffled blocks), each against the float64 oracle over its own keys; out and lse."""
    lengths_q, lengths_k = [1, 0, 7, 20, 1], [5, 3, 30, 20, 1]
    used = [4, 3, 12, 20, 0] if variant == "seqused_k" else lengths_k
    hq, hk, d, block = 4, 2, 32, 16
    b = len(lengths_q)
    q = np.asarray(normal(rng, (sum(lengths_q), hq, d)))
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    keys = [np.asarray(normal(rng, (n, hk, d))) for n in lengths_k]
    values = [np.asarray(normal(rng, (n, hk, d))) for n in lengths_k]
    table = None
    if paged:
        max_blocks = 2
        table = rng.permutation(b * max_blocks + 1)[:b * max_blocks].reshape(b, max_blocks).astype(np.int32)
        k = np.array(normal(rng, (b * max_blocks + 1, block, hk, d)))
        v = np.array(normal(rng, (b * max_blocks + 1, block, hk, d)))
        for s, n in enumerate(lengths_k):
            for j in range(n):
                k[table[s, j // block], j % block] = keys[s][j]
                v[table[s, j // block], j % block] = values[s][j]
    else:
        k, v = np.concatenate(keys), np.concatenate(values)
    options = dict(causal=True)
    slopes = None
    if variant == "window alibi softcap":
        slopes = np.asarray([0.1, 0.2, 0.05, 0.3], np.float32)
        options = dict(window_size=(6, 0), softcap=5.0)
    out, lse, _ = fj.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), alibi_slopes=slopes,
                                            return_attn_probs=True, block_table=table,
                                            seqused_k=np.asarray(used, np.int32) if variant == "seqused_k" else None,
                                            backend=backend, **options)
    assert out.shape == (sum(lengths_q), hq, d) and lse.shape == (hq, sum(lengths_q))
    for s in range(b):
        rows = slice(cu_q[s], cu_q[s + 1])
        if lengths_q[s] == 0:
            continue
        want, want_lse = attention(q[rows][None], keys[s][:used[s]][None], values[s][:used[s]][None],
                                   causal=options.get("causal", False), window=options.get("window_size", (-1, -1)),
                                   softcap=options.get("softcap", 0.0), alibi_slopes=slopes)
        got, got_lse = f64(out[rows][None]), f64(lse[:, rows])
        if used[s] == 0:  # no key: out 0, lse -inf
            assert np.all(got == 0) and np.all(np.isneginf(got_lse)), f"sequence {s}"
            continue
        assert rel_l2(got, want) <= FP32_TOLERANCE, f"sequence {s}"
        np.testing.assert_allclose(got_lse, want_lse[0], rtol=1e-5, atol=1e-5, err_msg=f"sequence {s}")


def packed_inputs(rng, lengths_q, lengths_k, hq, hk, d):
    """q, dout (total_q, Hq, D), k, v (total_k, Hk, D) of packed sequences, and their cu_seqlens."""
    q = normal(rng, (sum(lengths_q), hq, d))
    k, v = normal(rng, (sum(lengths_k), hk, d)), normal(rng, (sum(lengths_k), hk, d))
    dout = normal(rng, (sum(lengths_q), hq, d))
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    return q, k, v, dout, cu_q, cu_k


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_jit_grad_matches_oracle(rng, backend, deterministic):
    """jax.jit(jax.grad) of flash_attn_varlen_func (contiguous K/V, GQA, causal with softcap and ALiBi): dq, dk, dv of
    every sequence against the float64 oracle's analytic backward; a sequence with more queries than keys (rows with
    no key: zero gradients) and an empty one among them."""
    lengths_q, lengths_k = [3, 0, 9, 4, 1], [5, 2, 9, 2, 1]
    hq, hk, d = 4, 2, 32
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, lengths_q, lengths_k, hq, hk, d)
    slopes = np.asarray([0.1, 0.2, 0.05, 0.3], np.float32)

    def loss(q, k, v):
        out = fj.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True, softcap=4.0,
                                        alibi_slopes=slopes, deterministic=deterministic, backend=backend)
        return jnp.sum(out * dout)

    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for s in range(len(lengths_q)):
        rq, rk = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if lengths_q[s] == 0:
            assert np.all(f64(dk[rk]) == 0) and np.all(f64(dv[rk]) == 0), f"sequence {s}: keys no query sees"
            continue
        _, _, grads = attention(f64(q[rq])[None], f64(k[rk])[None], f64(v[rk])[None], causal=True, softcap=4.0,
                                alibi_slopes=slopes, dout=f64(dout[rq])[None])
        for name, actual, expected in zip(("dq", "dk", "dv"), (dq[rq], dk[rk], dv[rk]), grads):
            err = rel_l2(f64(actual)[None], expected)
            assert err <= FP32_TOLERANCE, f"sequence {s} {name}: relative L2 error {err:.3g}"


def test_varlen_dropout_bit_exact_with_grad(rng):
    """flash_attn_varlen_func with dropout: out and dq, dk, dv of every sequence equal the float64 oracle's with the
    Philox keep mask of (seed, offset) from the key's words and the sequence's index as the mask's batch index."""
    lengths_q, lengths_k, p = [5, 12, 1], [7, 12, 3], 0.3
    hq, hk, d = 4, 2, 32
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, lengths_q, lengths_k, hq, hk, d)
    key = jax.random.PRNGKey(5)

    def loss(q, k, v):
        out = fj.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), p, causal=True,
                                        dropout_rng=key, backend="reference")
        return jnp.sum(out * dout), out

    (_, out), (dq, dk, dv) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    words = [int(w) for w in np.asarray(jax.random.bits(key, (4,), jnp.uint32))]
    seed, offset = words[0] | (words[1] << 32), words[2] | (words[3] << 32)
    for s in range(len(lengths_q)):
        rq, rk = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        want, _, grads = attention(f64(q[rq])[None], f64(k[rk])[None], f64(v[rk])[None], causal=True, dropout_p=p,
                                   seed=seed, offset=offset, dout=f64(dout[rq])[None], head_index_base=lambda _: s)
        assert rel_l2(f64(out[rq])[None], want) <= FP32_TOLERANCE, f"sequence {s} out"
        for name, actual, expected in zip(("dq", "dk", "dv"), (dq[rq], dk[rk], dv[rk]), grads):
            assert rel_l2(f64(actual)[None], expected) <= FP32_TOLERANCE, f"sequence {s} {name}"
    with pytest.raises(flashattn.InvalidArgumentError, match="dropout_rng: a jax.random key is required"):
        fj.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 12, 0.1)


def test_kvcache_append_then_varlen_forward_step(rng):
    """A serving step in JAX in two calls: kvcache_append of two prompt chunks and two decode tokens, then one causal
    flash_attn_varlen_func over the paged caches (cu_seqlens_q = cu_seqlens_new), under jax.jit with the caches
    donated; equals flash_attn_with_kvcache's own append and attention per sequence."""
    counts, cached = [9, 1, 20, 1], [4, 30, 0, 7]
    k_cache, v_cache, k, v, cu, seqlens, table = append_inputs(rng, jnp.float32, True, counts, cached)
    q = np.asarray(normal(rng, (sum(counts), 4, 32)))
    cu_k = np.concatenate([[0], np.cumsum(np.asarray(counts) + np.asarray(cached))]).astype(np.int32)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(kc, vc, kn, vn, c, s, t, q, ck):
        kc, vc = fj.kvcache_append(kc, vc, kn, vn, c, s, max(counts), t)
        out = fj.flash_attn_varlen_func(q, kc, vc, c, ck, max(counts), int(np.diff(cu_k).max()), causal=True,
                                        block_table=t)
        return out, kc, vc

    out, _, _ = step(jnp.asarray(k_cache), jnp.asarray(v_cache), k, v, jnp.asarray(cu), jnp.asarray(seqlens),
                     jnp.asarray(table), jnp.asarray(q), jnp.asarray(cu_k))
    for b in range(len(counts)):
        rows = slice(cu[b], cu[b + 1])
        want = fj.flash_attn_with_kvcache(q[rows][None], k_cache, v_cache, k[rows][None], v[rows][None],
                                          cache_seqlens=seqlens[b:b + 1], block_table=table[b:b + 1], causal=True,
                                          backend="reference")[0]
        assert rel_l2(f64(out[rows][None]), f64(want)) <= FP32_TOLERANCE, f"sequence {b}"


def test_varlen_forward_errors(rng):
    q = normal(rng, (6, 2, 32))
    k = normal(rng, (9, 1, 32))
    cu_q, cu_k = np.asarray([0, 2, 6], np.int32), np.asarray([0, 4, 9], np.int32)
    with pytest.raises(flashattn.InvalidArgumentError, match="max_seqlen_q: pass it as a Python int under jax.jit"):
        jax.jit(lambda c: fj.flash_attn_varlen_func(q, k, k, c, cu_k))(jnp.asarray(cu_q))
    with pytest.raises(flashattn.InvalidArgumentError, match="cu_seqlens_k: dtype must be int32"):
        fj.flash_attn_varlen_func(q, k, k, cu_q, cu_k.astype(np.float32))
    table = np.asarray([[0], [1]], np.int32)
    pool = normal(rng, (2, 8, 1, 32))
    with pytest.raises(flashattn.UnsupportedError, match="block_table: paged K/V has no backward pass"):
        jax.grad(lambda x: fj.flash_attn_varlen_func(x, pool, pool, cu_q, cu_k, 4, 5, block_table=table).sum())(q)
    with pytest.raises(flashattn.UnsupportedError, match="seqused_k: the backward pass takes every key"):
        jax.grad(lambda x: fj.flash_attn_varlen_func(x, k, k, cu_q, cu_k, 4, 5,
                                                     seqused_k=np.asarray([1, 1], np.int32)).sum())(q)
    # The library's own rules, raised when the call runs: the message names the argument and the rule.
    with pytest.raises(Exception, match="cu_seqlens_q: sequence 1 has length 4 > max_seqlen_q = 3"):
        jax.block_until_ready(fj.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 3, 5))
    with pytest.raises(Exception, match="seqused_k: entry 0 = 5 must be in"):
        jax.block_until_ready(fj.flash_attn_varlen_func(q, k, k, cu_q, cu_k, seqused_k=np.asarray([5, 1], np.int32)))


def test_kvcache_append_errors(rng):
    k_cache, v_cache, k, v, cu, seqlens, table = append_inputs(rng, jnp.float32, True, [3, 2], [0, 47])
    with pytest.raises(flashattn.InvalidArgumentError, match="max_seqlen_new: required under jax.jit"):
        jax.jit(lambda c: fj.kvcache_append(k_cache, v_cache, k, v, c, seqlens, block_table=table))(jnp.asarray(cu))
    with pytest.raises(flashattn.InvalidArgumentError, match="cu_seqlens_new: dtype must be int32"):
        fj.kvcache_append(k_cache, v_cache, k, v, cu.astype(np.float32), seqlens, 3, table)
    # The library's own rules, raised when the call runs: the message names the argument and the rule.
    with pytest.raises(Exception, match="cache_seqlens: entry 1 = 47 plus its 2 new rows"):
        jax.block_until_ready(fj.kvcache_append(k_cache, v_cache, k, v, cu, seqlens, block_table=table))
    with pytest.raises(Exception, match="cu_seqlens_new: sequence 0 has length 3 > max_seqlen_new = 2"):
        jax.block_until_ready(fj.kvcache_append(k_cache, v_cache, k, v, cu, np.minimum(seqlens, 40), 2, table))
    with pytest.raises(Exception, match="k_new: dtype must match k_cache"):
        jax.block_until_ready(fj.kvcache_append(k_cache, v_cache, k.astype(jnp.float16), v.astype(jnp.float16), cu,
                                                np.minimum(seqlens, 40), 3, table))
