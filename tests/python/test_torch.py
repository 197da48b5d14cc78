"""flashattn.torch against the float64 numpy oracle (tests/python/oracle.py), on the CPU.

Backends: "reference" (the library's float64 oracle: checks the Python plumbing exactly) and
"auto" (the CPU flash backend: checks the fast path through Python). Outputs are poisoned with NaN before
every call (flashattn.torch._poison_outputs), inputs are fresh random normals, some scaled up so
that softmax is peaky.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
import flashattn.torch as fat  # noqa: E402
from oracle import attention, rel_l2, rotary  # noqa: E402

BACKENDS = ["reference", "auto"]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FP32_TOLERANCE = 1e-5  # relative L2, fp32 paths (DESIGN.md)
LOW_PRECISION_FACTOR = 3.0  # fp16/bf16: at most 3x the error of a naive same-precision computation
LOW_PRECISION_ABS = 1e-6  # plus a tiny absolute term (relative L2 units)


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(fat, "_poison_outputs", True)



def randn(rng, shape, dtype, scale=1.0):
    return torch.from_numpy(rng.standard_normal(shape) * scale).to(dtype)


def naive_same_precision(q, k, v, *, scale, causal=False, window=(-1, -1), softcap=0.0, alibi=None):
    """Textbook attention computed in q's dtype (the baseline of the fp16/bf16 tolerance rule)."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt = kt.repeat_interleave(hq // hk, dim=1)
    vt = vt.repeat_interleave(hq // hk, dim=1)
    s = (qt @ kt.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    if alibi is not None:
        s = s - (alibi.reshape(-1, hq, 1, 1) * (i + sk - sq - j).abs()).to(s.dtype)
    wl, wr = window
    if causal:
        wr = 0
    mask = torch.ones(sq, sk, dtype=torch.bool)
    if wl >= 0:
        mask &= j >= i + sk - sq - wl
    if wr >= 0:
        mask &= j <= i + sk - sq + wr
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ vt).transpose(1, 2)


def assert_close(actual, expected, dtype, baseline=None, what="out"):
    actual = actual.detach().double().numpy() if isinstance(actual, torch.Tensor) else actual
    assert not np.isnan(actual).any(), f"{what}: NaN (an element was not written)"
    err = rel_l2(actual, expected)
    if dtype == torch.float32:
        assert err <= FP32_TOLERANCE, f"{what}: relative L2 error {err:.3g} > {FP32_TOLERANCE}"
    else:
        base = rel_l2(baseline.detach().double().numpy(), expected)
        limit = LOW_PRECISION_FACTOR * base + LOW_PRECISION_ABS
        assert err <= limit, f"{what}: relative L2 error {err:.3g} > {limit:.3g} (naive {dtype}: {base:.3g})"


def assert_lse(actual, expected):
    actual = actual.detach().numpy()
    finite = np.isfinite(expected)
    assert np.array_equal(np.isfinite(actual), finite), "lse: -inf exactly on rows without visible keys"
    assert (actual[~finite] == -np.inf).all()
    # lse shifts every probability of its row by the factor exp(error): judge it absolutely, relative
    # to the tensor's magnitude max(1, max |lse|) (its float32 rounding follows the scores' magnitude;
    # a per-row relative error is ill-conditioned where lse is near 0).
    error = np.abs(actual[finite] - expected[finite])
    scale = max(1.0, float(np.abs(expected[finite]).max(initial=0.0)))
    assert error.max(initial=0.0) <= 1e-5 * scale, f"lse: max error {error.max():.3g} (scale {scale:.3g})"


# (B, Sq, Sk, Hq, Hk, D, Dv): odd sizes, Sq != Sk both ways, GQA/MQA, partial tiles, Dv != D.
SHAPES = [
    (1, 1, 1, 1, 1, 32, 32),
    (2, 17, 17, 4, 4, 64, 64),
    (2, 17, 127, 6, 2, 64, 64),
    (1, 127, 17, 4, 1, 96, 96),
    (1, 128, 1000, 2, 2, 128, 128),
    (3, 33, 65, 8, 2, 64, 32),
]
VARIANTS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (13, 5)},
    "causal_window": {"causal": True, "window_size": (9, -1)},
    "softcap": {"softcap": 7.5},
    "alibi": {"alibi": True},
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("peaky", [False, True], ids=["normal", "peaky"])
def test_forward_matches_oracle(rng, backend, dtype, shape, variant, peaky):
    b, sq, sk, hq, hk, d, dv = shape
    dt = DTYPES[dtype]
    amplitude = 4.0 if peaky else 1.0  # scores scaled by ~16: softmax concentrates on few keys
    q, k, v = randn(rng, (b, sq, hq, d), dt, amplitude), randn(rng, (b, sk, hk, d), dt, amplitude), randn(rng, (b, sk, hk, dv), dt)
    opts = dict(VARIANTS[variant])
    alibi = None
    if opts.pop("alibi", False):
        alibi = torch.from_numpy(rng.uniform(0.01, 0.5, (b, hq))).float()
    call = lambda: fat.flash_attn_func(q, k, v, alibi_slopes=alibi, return_attn_probs=True, backend=backend, **opts)
    out, lse, probs = call()
    assert probs is None
    assert out.shape == (b, sq, hq, dv) and out.dtype == dt
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    expected, expected_lse = attention(q.double().numpy(), k.double().numpy(), v.double().numpy(),
                                       causal=opts.get("causal", False), window=opts.get("window_size", (-1, -1)),
                                       softcap=opts.get("softcap", 0.0),
                                       alibi_slopes=None if alibi is None else alibi.numpy())
    baseline = None
    if dt != torch.float32:
        baseline = naive_same_precision(q, k, v, scale=d**-0.5, causal=opts.get("causal", False),
                                        window=opts.get("window_size", (-1, -1)), softcap=opts.get("softcap", 0.0),
                                        alibi=alibi)
    assert_close(out, expected, dt, baseline)
    assert_lse(lse, expected_lse)


BACKWARD_SHAPES = [
    (1, 1, 1, 1, 1, 32, 32),
    (2, 17, 17, 4, 2, 64, 64),
    (1, 17, 127, 6, 2, 64, 64),
    (1, 127, 33, 4, 4, 96, 64),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", BACKWARD_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_backward_matches_oracle(rng, backend, shape, variant):
    b, sq, sk, hq, hk, d, dv = shape
    q = randn(rng, (b, sq, hq, d), torch.float32).requires_grad_()
    k = randn(rng, (b, sk, hk, d), torch.float32).requires_grad_()
    v = randn(rng, (b, sk, hk, dv), torch.float32).requires_grad_()
    dout = randn(rng, (b, sq, hq, dv), torch.float32)
    opts = dict(VARIANTS[variant])
    alibi = None
    if opts.pop("alibi", False):
        alibi = torch.from_numpy(rng.uniform(0.01, 0.5, (hq,))).float()

    def run():
        out = fat.flash_attn_func(q, k, v, alibi_slopes=alibi, backend=backend, **opts)
        return (out,) + torch.autograd.grad(out, (q, k, v), dout)

    out, dq, dk, dv_ = run()
    _, _, grads = attention(q.detach().double().numpy(), k.detach().double().numpy(), v.detach().double().numpy(),
                            causal=opts.get("causal", False), window=opts.get("window_size", (-1, -1)),
                            softcap=opts.get("softcap", 0.0), alibi_slopes=None if alibi is None else alibi.numpy(),
                            dout=dout.double().numpy())
    for name, actual, expected in zip(("dq", "dk", "dv"), (dq, dk, dv_), grads):
        assert_close(actual, expected, torch.float32, what=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_mask_bit_exact_and_reproducible(rng, backend):
    b, sq, sk, hq, hk, d = 2, 33, 70, 4, 2, 32
    p = 0.3
    q, k, v = randn(rng, (b, sq, hq, d), torch.float32), randn(rng, (b, sk, hk, d), torch.float32), randn(rng, (b, sk, hk, d), torch.float32)
    q.requires_grad_()
    dout = randn(rng, (b, sq, hq, d), torch.float32)

    def run():
        torch.manual_seed(1234)
        out = fat.flash_attn_func(q, k, v, dropout_p=p, causal=True, backend=backend)
        return out, torch.autograd.grad(out, q, dout)[0]

    out, dq = run()
    again, dq_again = run()
    assert torch.equal(out, again) and torch.equal(dq, dq_again), "same torch.manual_seed, same result"
    torch.manual_seed(1234)
    seed, offset = fat._seed_offset(fat._new_rng_state(p))  # the draw the call above made
    expected, _, grads = attention(q.detach().double().numpy(), k.double().numpy(), v.double().numpy(), causal=True,
                                   dropout_p=p, seed=seed, offset=offset, dout=dout.double().numpy())
    assert_close(out, expected, torch.float32)
    assert_close(dq, grads[0], torch.float32, what="dq")
    torch.manual_seed(4321)
    other = fat.flash_attn_func(q, k, v, dropout_p=p, causal=True, backend=backend)
    assert not torch.equal(other, out), "another seed, another mask"


def test_dropout_keep_rate_within_4_sigma(rng):
    # Keep rate measured through the library: with v = one-hot columns and uniform probabilities
    # (q = 0 rows score every key equally), out[i, j] = keep(i, j) / ((1 - p) * Sk).
    b, sq, sk, h, p = 1, 64, 256, 2, 0.17
    q = torch.zeros(b, sq, h, sk)
    k = randn(rng, (b, sk, h, sk), torch.float32)
    v = torch.eye(sk).reshape(1, sk, 1, sk).expand(b, sk, h, sk).contiguous()
    torch.manual_seed(7)
    out = fat.flash_attn_func(q, k, v, dropout_p=p, backend="reference")
    kept = (out * (1 - p) * sk).round()
    assert set(kept.unique().tolist()) <= {0.0, 1.0}
    n = kept.numel()
    rate = kept.mean().item()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(rate - (1 - p)) <= 4 * sigma, f"keep rate {rate:.4f}, expected {1 - p} +- {4 * sigma:.4f}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_matches_dense_per_sequence(rng, backend):
    lengths_q = [1, 17, 40, 5]
    lengths_k = [3, 17, 33, 64]
    hq, hk, d = 4, 2, 64
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lengths_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lengths_k)]), dtype=torch.int32)
    q = randn(rng, (sum(lengths_q), hq, d), torch.float32).requires_grad_()
    k = randn(rng, (sum(lengths_k), hk, d), torch.float32).requires_grad_()
    v = randn(rng, (sum(lengths_k), hk, d), torch.float32).requires_grad_()
    dout = randn(rng, (sum(lengths_q), hq, d), torch.float32)

    def run():
        out, lse, _ = fat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                                 window_size=(20, -1), return_attn_probs=True, backend=backend)
        return (out, lse) + torch.autograd.grad(out, (q, k, v), dout)

    out, lse, dq, dk, dv = run()
    assert lse.shape == (hq, sum(lengths_q))
    for s in range(len(lengths_q)):
        qs, ks = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        exp_out, exp_lse, grads = attention(q[qs][None].detach().double().numpy(), k[ks][None].detach().double().numpy(),
                                            v[ks][None].detach().double().numpy(), causal=True, window=(20, -1),
                                            dout=dout[qs][None].double().numpy())
        assert_close(out[qs][None], exp_out, torch.float32, what=f"out of sequence {s}")
        assert_lse(lse[:, qs], exp_lse[0])
        for name, actual, expected in zip(("dq", "dk", "dv"), (dq[qs], dk[ks], dv[ks]), grads):
            assert_close(actual[None], expected, torch.float32, what=f"{name} of sequence {s}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_loose_max_seqlen(rng, backend):
    """max_seqlen_q / max_seqlen_k are upper bounds: up to 2**31 - 1 they give the tight bound's results (a bound
    near INT32_MAX once overflowed the CPU tile count, and the call returned with out never written)."""
    lengths_q, lengths_k = [3, 0, 21], [5, 2, 30]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lengths_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lengths_k)]), dtype=torch.int32)
    q = randn(rng, (sum(lengths_q), 4, 32), torch.float32).requires_grad_()
    k = randn(rng, (sum(lengths_k), 2, 32), torch.float32).requires_grad_()
    v = randn(rng, (sum(lengths_k), 2, 32), torch.float32).requires_grad_()
    dout = randn(rng, (sum(lengths_q), 4, 32), torch.float32)

    def run(max_q, max_k):
        out = fat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, backend=backend)
        return (out,) + torch.autograd.grad(out, (q, k, v), dout)

    tight = run(max(lengths_q), max(lengths_k))
    for loose in (64, 2**31 - 1):
        for name, a, b in zip(("out", "dq", "dk", "dv"), run(loose, loose), tight):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{name} with max_seqlen {loose}")


def test_kvcache_num_splits_bounds(rng):
    q = randn(rng, (1, 1, 2, 32), torch.float32)
    cache = randn(rng, (1, 40, 1, 32), torch.float32)
    with pytest.raises(flashattn.InvalidArgumentError, match=r"num_splits: must be in \[0, 1024\]"):
        fat.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=30, num_splits=1025)
    most = fat.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=30, num_splits=1024)
    torch.testing.assert_close(most, fat.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=30), rtol=1e-5, atol=1e-6)


def test_varlen_paged_forward(rng):
    lengths = [5, 37, 16]
    hq, hk, d, block = 4, 2, 32, 16
    num_blocks = 12
    k_cache = randn(rng, (num_blocks, block, hk, d), torch.float32)
    v_cache = randn(rng, (num_blocks, block, hk, d), torch.float32)
    max_blocks = 3
    table = torch.tensor(rng.permutation(num_blocks)[: len(lengths) * max_blocks].reshape(len(lengths), max_blocks),
                         dtype=torch.int32)
    q = randn(rng, (sum(lengths), hq, d), torch.float32)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    out = fat.flash_attn_varlen_func(q, k_cache, v_cache, cu, cu, max(lengths), max(lengths), causal=True,
                                     block_table=table, backend="reference")
    for s, n in enumerate(lengths):
        rows = torch.cat([k_cache[table[s, c]] for c in range(max_blocks)])[:n]
        vrows = torch.cat([v_cache[table[s, c]] for c in range(max_blocks)])[:n]
        expected, _ = attention(q[cu[s]:cu[s + 1]][None].double().numpy(), rows[None].double().numpy(),
                                vrows[None].double().numpy(), causal=True)
        assert_close(out[cu[s]:cu[s + 1]][None], expected, torch.float32, what=f"sequence {s}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_paged_decode_step_with_seqused_k(rng, backend):
    """vLLM's decode step: one query per sequence, a block table, seqused_k below cu_seqlens_k's counts (keys 0 and 1
    among them); each sequence against the float64 oracle over its first seqused_k[b] keys. The gradient is refused."""
    used, lengths_k = [5, 37, 0, 1, 30], [9, 40, 3, 1, 30]
    hq, hk, d, block, max_blocks = 4, 2, 32, 16, 3
    b = len(used)
    num_blocks = b * max_blocks + 1
    k_cache = randn(rng, (num_blocks, block, hk, d), torch.float32)
    v_cache = randn(rng, (num_blocks, block, hk, d), torch.float32)
    table = torch.tensor(rng.permutation(num_blocks)[: b * max_blocks].reshape(b, max_blocks), dtype=torch.int32)
    q = randn(rng, (b, hq, d), torch.float32)
    cu_q = torch.arange(b + 1, dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lengths_k)]), dtype=torch.int32)
    seqused = torch.tensor(used, dtype=torch.int32)
    out, lse, _ = fat.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 1, max(lengths_k), causal=True,
                                             return_attn_probs=True, block_table=table, seqused_k=seqused,
                                             backend=backend)
    for s, n in enumerate(used):
        rows = torch.cat([k_cache[table[s, c]] for c in range(max_blocks)])[:n]
        vrows = torch.cat([v_cache[table[s, c]] for c in range(max_blocks)])[:n]
        if n == 0:  # no key: out 0, lse -inf
            assert torch.all(out[s] == 0) and torch.all(lse[:, s] == -np.inf), f"sequence {s}"
            continue
        expected, _ = attention(q[s:s + 1][None].double().numpy(), rows[None].double().numpy(),
                                vrows[None].double().numpy(), causal=True)
        assert_close(out[s:s + 1][None], expected, torch.float32, what=f"sequence {s} ({n} keys)")
    q.requires_grad_()
    grad_out = fat.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 1, max(lengths_k), block_table=table,
                                          seqused_k=seqused, backend=backend)
    with pytest.raises(flashattn.UnsupportedError, match="block_table: paged K/V has no backward pass"):
        grad_out.sum().backward()
    k = randn(rng, (sum(lengths_k), hk, d), torch.float32).requires_grad_()
    dense_out = fat.flash_attn_varlen_func(q, k, k.detach().clone(), cu_q, cu_k, 1, max(lengths_k), seqused_k=seqused,
                                           backend=backend)
    with pytest.raises(flashattn.UnsupportedError, match="seqused_k: the backward pass takes every key"):
        dense_out.sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("rotary_interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("leftpad", [False, True], ids=["", "leftpad"])
def test_kvcache_append_rotary(rng, backend, paged, rotary_interleaved, causal, leftpad):
    b, s_cache, s_new, sq, hq, hk, d, rot = 3, 64, 3, 3, 4, 2, 32, 16
    block = 16
    cached = np.array([0, 17, 40], dtype=np.int32)
    # cache_leftpad: sequence s's keys are rows [pad[s], cached[s] + s_new); the padding rows hold NaN (never read).
    # Positions are the rows' own, so the oracle is the same with the padding rows left out of the keys.
    pad = np.array([0, 5, 40] if leftpad else [0, 0, 0], dtype=np.int32)
    q = randn(rng, (b, sq, hq, d), torch.float32)
    k_new = randn(rng, (b, s_new, hk, d), torch.float32)
    v_new = randn(rng, (b, s_new, hk, d), torch.float32)
    cos = torch.from_numpy(np.cos(rng.uniform(0, 6.3, (s_cache, rot // 2)))).float()
    sin = torch.from_numpy(np.sin(rng.uniform(0, 6.3, (s_cache, rot // 2)))).float()
    dense_k = randn(rng, (b, s_cache, hk, d), torch.float32)
    dense_v = randn(rng, (b, s_cache, hk, d), torch.float32)
    for s in range(b):
        dense_k[s, :pad[s]] = float("nan")
        dense_v[s, :pad[s]] = float("nan")
    if paged:
        per_seq = s_cache // block
        table = torch.tensor(rng.permutation(b * per_seq).reshape(b, per_seq), dtype=torch.int32)
        k_cache = torch.empty(b * per_seq, block, hk, d)
        v_cache = torch.empty(b * per_seq, block, hk, d)
        for s in range(b):
            for c in range(per_seq):
                k_cache[table[s, c]] = dense_k[s, c * block:(c + 1) * block]
                v_cache[table[s, c]] = dense_v[s, c * block:(c + 1) * block]
    else:
        table = None
        k_cache, v_cache = dense_k.clone(), dense_v.clone()

    def gather(cache, s):
        if table is None:
            return cache[s]
        return torch.cat([cache[table[s, c]] for c in range(table.shape[1])])

    cache_seqlens = torch.tensor(cached)
    k_before, v_before = k_cache.clone(), v_cache.clone()

    def run():
        k_cache.copy_(k_before)
        v_cache.copy_(v_before)
        return fat.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                           cache_seqlens=cache_seqlens, block_table=table, causal=causal,
                                           rotary_interleaved=rotary_interleaved, return_softmax_lse=True,
                                           cache_leftpad=torch.tensor(pad) if leftpad else None, backend=backend)

    out, lse = run()
    assert out.shape == (b, sq, hq, d) and lse.shape == (b, hq, sq)
    for s in range(b):
        n = cached[s]
        positions = np.arange(n, n + s_new)
        k_rot = rotary(k_new[s].numpy(), cos.double().numpy(), sin.double().numpy(), positions, rotary_interleaved)
        # The cache now holds the rotated new keys and the new values at rows n .. n + s_new.
        assert rel_l2(gather(k_cache, s)[n:n + s_new].numpy(), k_rot) <= 1e-6
        assert torch.equal(gather(v_cache, s)[n:n + s_new], v_new[s])
        assert torch.equal(gather(k_cache, s)[pad[s]:n], gather(k_before, s)[pad[s]:n]), "rows before the append"
        assert torch.isnan(gather(k_cache, s)[:pad[s]]).all(), "the padding rows are untouched"
        q_positions = np.arange(n, n + sq) if causal else np.full(sq, n)
        q_rot = rotary(q[s].numpy(), cos.double().numpy(), sin.double().numpy(), q_positions, rotary_interleaved)
        keys = np.concatenate([gather(k_before, s)[pad[s]:n].double().numpy(), k_rot])
        values = np.concatenate([gather(v_before, s)[pad[s]:n].double().numpy(), v_new[s].double().numpy()])
        expected, expected_lse = attention(q_rot[None], keys[None], values[None], causal=causal)
        assert_close(out[s][None], expected, torch.float32, what=f"out of sequence {s}")
        assert_lse(lse[s], expected_lse[0])


FP8 = getattr(torch, "float8_e4m3fn", None)


def quantise_e4m3(x, scale):
    """The library's rule for appended rows: e4m3(x / scale), x / scale in float32, nearest even, saturating."""
    q = torch.from_numpy(np.asarray(x, dtype=np.float32) / np.float32(scale))
    return q.clamp(-448.0, 448.0).to(FP8)


@pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("scales", [(0.0625, 0.03125), (2.0 ** -8, 2.0 ** -9)], ids=["scaled", "saturating"])
def test_kvcache_fp8_cache(rng, backend, dtype, paged, scales):
    """An FP8 (e4m3) cache: the appended codes are the quantised (rotated) new rows, bit for bit, and out / lse
    match the float64 oracle over the dequantised cache under the 16-bit rule (power-of-two scales keep the
    dequantised values exact in the 16-bit dtype, so the naive baseline sees what the oracle sees)."""
    torch_dtype = DTYPES[dtype]
    k_scale, v_scale = scales
    b, s_cache, s_new, sq, hq, hk, d, rot, block = 3, 64, 3, 3, 4, 2, 32, 16, 16
    cached = np.array([0, 1, 40], dtype=np.int32)
    causal = True
    q = randn(rng, (b, sq, hq, d), torch_dtype)
    k_new = randn(rng, (b, s_new, hk, d), torch_dtype)
    v_new = randn(rng, (b, s_new, hk, d), torch_dtype)
    cos = torch.from_numpy(np.cos(rng.uniform(0, 6.3, (s_cache, rot // 2)))).to(torch_dtype)
    sin = torch.from_numpy(np.sin(rng.uniform(0, 6.3, (s_cache, rot // 2)))).to(torch_dtype)
    dense_k = quantise_e4m3(rng.standard_normal((b, s_cache, hk, d)), 0.0625)  # codes of std 16
    dense_v = quantise_e4m3(rng.standard_normal((b, s_cache, hk, d)), 0.0625)
    if paged:
        per_seq = s_cache // block
        table = torch.tensor(rng.permutation(b * per_seq).reshape(b, per_seq), dtype=torch.int32)
        k_cache = torch.empty(b * per_seq, block, hk, d, dtype=FP8)
        v_cache = torch.empty(b * per_seq, block, hk, d, dtype=FP8)
        for s in range(b):
            for c in range(per_seq):
                k_cache[table[s, c]] = dense_k[s, c * block:(c + 1) * block]
                v_cache[table[s, c]] = dense_v[s, c * block:(c + 1) * block]
    else:
        table = None
        k_cache, v_cache = dense_k.clone(), dense_v.clone()

    def gather(cache, s):
        if table is None:
            return cache[s]
        return torch.cat([cache[table[s, c]] for c in range(table.shape[1])])

    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = fat.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                           cache_seqlens=torch.tensor(cached), block_table=table, causal=causal,
                                           return_softmax_lse=True, backend=backend, k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == torch_dtype and k_cache.dtype == FP8
    cos64, sin64 = cos.double().numpy(), sin.double().numpy()
    saturated = 0
    for s in range(b):
        n = cached[s]
        k_rot = rotary(k_new[s].double().numpy(), cos64, sin64, np.arange(n, n + s_new), True)
        k_codes, v_codes = quantise_e4m3(k_rot, k_scale), quantise_e4m3(v_new[s].float().numpy(), v_scale)
        got_k, got_v = gather(k_cache, s)[n:n + s_new], gather(v_cache, s)[n:n + s_new]
        assert torch.equal(got_k.view(torch.uint8), k_codes.view(torch.uint8)), f"appended k codes of sequence {s}"
        assert torch.equal(got_v.view(torch.uint8), v_codes.view(torch.uint8)), f"appended v codes of sequence {s}"
        saturated += int((got_k.view(torch.uint8) & 0x7F == 0x7E).sum())
        assert torch.equal(gather(k_cache, s)[:n].view(torch.uint8), gather(k_before, s)[:n].view(torch.uint8))
        q_rot = rotary(q[s].double().numpy(), cos64, sin64, np.arange(n, n + sq), True)
        keys = gather(k_cache, s)[:n + s_new].double().numpy() * k_scale  # the cache as stored, dequantised
        values = gather(v_cache, s)[:n + s_new].double().numpy() * v_scale
        expected, expected_lse = attention(q_rot[None], keys[None], values[None], causal=causal)
        baseline = naive_same_precision(torch.from_numpy(q_rot[None]).to(torch_dtype),
                                        torch.from_numpy(keys[None]).to(torch_dtype),
                                        torch.from_numpy(values[None]).to(torch_dtype), scale=d ** -0.5, causal=causal)
        assert_close(out[s][None], expected, torch_dtype, baseline, what=f"out of sequence {s}")
        lse_error = np.abs(lse[s].numpy() - expected_lse[0])
        assert np.isfinite(lse[s].numpy()).all() and lse_error.max() <= 1e-3 * max(1.0, np.abs(expected_lse).max())
    if k_scale < 0.01:
        assert saturated > 0, "the small scale should saturate some appended keys to +-448"


@pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
def test_kvcache_fp8_bad_arguments(rng):
    q = randn(rng, (1, 1, 2, 32), torch.bfloat16)
    cache = torch.zeros(1, 8, 1, 32, dtype=FP8)
    with pytest.raises(flashattn.InvalidArgumentError, match="k_scale: required"):
        fat.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=3, v_scale=1.0)
    with pytest.raises(flashattn.InvalidArgumentError, match="v_scale: must be finite and > 0"):
        fat.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=3, k_scale=1.0, v_scale=0.0)
    with pytest.raises(flashattn.InvalidArgumentError, match="both torch.float8_e4m3fn"):
        fat.flash_attn_with_kvcache(q, cache, torch.zeros(1, 8, 1, 32, dtype=torch.bfloat16), cache_seqlens=3,
                                    k_scale=1.0, v_scale=1.0)
    with pytest.raises(flashattn.InvalidArgumentError, match="q: dtype must be float16 or bfloat16"):
        fat.flash_attn_with_kvcache(q.float(), cache, cache.clone(), cache_seqlens=3, k_scale=1.0, v_scale=1.0)
    cache16 = torch.zeros(1, 8, 1, 32, dtype=torch.bfloat16)
    with pytest.raises(flashattn.InvalidArgumentError, match="k_scale: applies to a float8_e4m3 cache only"):
        fat.flash_attn_with_kvcache(q, cache16, cache16.clone(), cache_seqlens=3, k_scale=0.5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kvcache_cache_batch_idx(rng, backend):
    """Sequence b reads and appends to slot cache_batch_idx[b] of a cache of more slots: the same out as the call
    on the gathered cache, the appended rows in those slots, the other slots untouched; and the rules."""
    b, slots, s_cache, s_new, hq, hk, d = 3, 5, 24, 2, 4, 2, 32
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    cached = torch.tensor([5, 20, 0], dtype=torch.int32)
    q = randn(rng, (b, s_new, hq, d), torch.float32)
    k_new, v_new = randn(rng, (b, s_new, hk, d), torch.float32), randn(rng, (b, s_new, hk, d), torch.float32)
    k_slots, v_slots = randn(rng, (slots, s_cache, hk, d), torch.float32), randn(rng, (slots, s_cache, hk, d), torch.float32)
    k_before, v_before = k_slots.clone(), v_slots.clone()
    k_gathered, v_gathered = k_slots[idx.long()].clone(), v_slots[idx.long()].clone()
    kw = dict(cache_seqlens=cached, causal=True, return_softmax_lse=True, backend=backend)
    out, lse = fat.flash_attn_with_kvcache(q, k_slots, v_slots, k_new, v_new, cache_batch_idx=idx, **kw)
    expected_out, expected_lse = fat.flash_attn_with_kvcache(q, k_gathered, v_gathered, k_new, v_new, **kw)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    assert torch.equal(k_slots[idx.long()], k_gathered) and torch.equal(v_slots[idx.long()], v_gathered)
    for slot in (1, 3):
        assert torch.equal(k_slots[slot], k_before[slot]) and torch.equal(v_slots[slot], v_before[slot])
    with pytest.raises(ValueError, match=r"cache_batch_idx: entry 1 = 5 is not a batch entry of k_cache in \[0, 5\)"):
        fat.flash_attn_with_kvcache(q, k_slots, v_slots, cache_batch_idx=torch.tensor([0, 5, 1], dtype=torch.int32), **kw)
    with pytest.raises(ValueError, match="cache_batch_idx: entries 0 and 2 are both 1"):
        fat.flash_attn_with_kvcache(q, k_slots, v_slots, k_new, v_new, cache_batch_idx=torch.tensor([1, 0, 1], dtype=torch.int32),
                                    **kw)
    table = torch.arange(b, dtype=torch.int32)[:, None]
    with pytest.raises(ValueError, match="cache_batch_idx: applies to a contiguous cache only"):
        fat.flash_attn_with_kvcache(q, k_slots, v_slots, cache_batch_idx=idx, block_table=table, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kvcache_without_lse_passes_none(rng, backend, monkeypatch):
    """An eager call without return_softmax_lse hands the library no lse (one allocation fewer per decode step) and
    gets the out and appended caches of the call with it, bit for bit."""
    b, s_cache, s_new, hq, hk, d = 2, 16, 3, 4, 2, 32
    cached = torch.tensor([7, 0], dtype=torch.int32)
    q = randn(rng, (b, s_new, hq, d), torch.float32)
    k_new, v_new = randn(rng, (b, s_new, hk, d), torch.float32), randn(rng, (b, s_new, hk, d), torch.float32)
    k_cache, v_cache = randn(rng, (b, s_cache, hk, d), torch.float32), randn(rng, (b, s_cache, hk, d), torch.float32)
    k2, v2 = k_cache.clone(), v_cache.clone()
    lse_passed = []
    real_kvcache = fat._ext.kvcache

    def spy(*args, **kwargs):
        lse_passed.append(args[11] is not None)  # kvcache(q, k_cache, v_cache, block_table, cache_seqlens, k_new,
        return real_kvcache(*args, **kwargs)     # v_new, rotary_cos, rotary_sin, rotary_interleaved, out, lse, ...)

    monkeypatch.setattr(fat._ext, "kvcache", spy)
    kw = dict(cache_seqlens=cached, causal=True, backend=backend)
    out, lse = fat.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, return_softmax_lse=True, **kw)
    out_alone = fat.flash_attn_with_kvcache(q, k2, v2, k_new, v_new, **kw)
    assert lse_passed == [True, False]
    assert isinstance(out_alone, torch.Tensor) and torch.equal(out_alone, out)
    assert torch.equal(k2, k_cache) and torch.equal(v2, v_cache)


def test_kvcache_int_seqlens_and_no_append(rng):
    b, s_cache, hq, hk, d = 2, 20, 2, 1, 32
    q = randn(rng, (b, 1, hq, d), torch.float32)
    k_cache = randn(rng, (b, s_cache, hk, d), torch.float32)
    v_cache = randn(rng, (b, s_cache, hk, d), torch.float32)
    out = fat.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=11, backend="reference")
    expected, _ = attention(q.double().numpy(), k_cache[:, :11].double().numpy(), v_cache[:, :11].double().numpy())
    assert_close(out, expected, torch.float32)
    full = fat.flash_attn_with_kvcache(q, k_cache, v_cache, backend="reference")  # no lengths: whole cache
    expected, _ = attention(q.double().numpy(), k_cache.double().numpy(), v_cache.double().numpy())
    assert_close(full, expected, torch.float32)
    # Paged, no lengths: the whole capacity, max_blocks x block_size rows (here 4 blocks of 5 = s_cache) per sequence.
    block = 5
    order = torch.randperm(b * s_cache // block, generator=torch.Generator().manual_seed(3))
    table = order.reshape(b, s_cache // block).to(torch.int32)
    k_pool = torch.empty(b * s_cache // block, block, hk, d)
    v_pool = torch.empty_like(k_pool)
    for seq in range(b):
        for n in range(s_cache // block):
            k_pool[table[seq, n]] = k_cache[seq, n * block:(n + 1) * block]
            v_pool[table[seq, n]] = v_cache[seq, n * block:(n + 1) * block]
    paged = fat.flash_attn_with_kvcache(q, k_pool, v_pool, block_table=table, backend="reference")
    assert_close(paged, expected, torch.float32, what="paged, whole capacity")


def test_packed_forms_match_unpacked(rng):
    b, s, h, d = 2, 19, 4, 32
    qkv = randn(rng, (b, s, 3, h, d), torch.float32).requires_grad_()
    dout = randn(rng, (b, s, h, d), torch.float32)
    out = fat.flash_attn_qkvpacked_func(qkv, causal=True, backend="reference")
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    q, k, v = (x.detach().double().numpy() for x in qkv.unbind(2))
    expected, _, grads = attention(q, k, v, causal=True, dout=dout.double().numpy())
    assert_close(out, expected, torch.float32)
    for i, name in enumerate(("dq", "dk", "dv")):
        assert_close(dqkv[:, :, i], grads[i], torch.float32, what=name)
    q2 = randn(rng, (b, 7, h, d), torch.float32)
    kv = qkv[:, :, 1:].detach()
    out = fat.flash_attn_kvpacked_func(q2, kv, causal=True, backend="reference")
    expected, _ = attention(q2.double().numpy(), k, v, causal=True)
    assert_close(out, expected, torch.float32)
    # varlen packed forms
    cu = torch.tensor([0, 7, 19], dtype=torch.int32)
    flat = qkv.detach()[0]  # (19, 3, h, d): two sequences of 7 and 12 tokens
    out = fat.flash_attn_varlen_qkvpacked_func(flat, cu, 12, causal=True, backend="reference")
    for s in range(2):
        sl = slice(cu[s], cu[s + 1])
        seq = [flat[sl, i][None].double().numpy() for i in range(3)]
        expected, _ = attention(*seq, causal=True)
        assert_close(out[sl][None], expected, torch.float32, what=f"varlen qkvpacked sequence {s}")
    out = fat.flash_attn_varlen_kvpacked_func(flat[:, 0], flat[:, 1:], cu, cu, 12, 12, backend="reference")
    for s in range(2):
        sl = slice(cu[s], cu[s + 1])
        seq = [flat[sl, i][None].double().numpy() for i in range(3)]
        expected, _ = attention(*seq)
        assert_close(out[sl][None], expected, torch.float32, what=f"varlen kvpacked sequence {s}")


def test_strided_inputs_need_no_copy(rng):
    # q, k, v as views with gaps between heads/rows (last dim contiguous): read in place.
    base = randn(rng, (2, 23, 6, 80), torch.float32)
    q = base[:, :, :4, :32]
    k = base[:, 3:, 4:, 16:48]
    v = base[:, 3:, 4:, 40:72]
    out = fat.flash_attn_func(q, k, v, backend="reference")
    expected, _ = attention(q.double().numpy(), k.double().numpy(), v.double().numpy())
    assert_close(out, expected, torch.float32)
    # a transposed last dimension is made contiguous (as flash_attn does), not refused
    qt = randn(rng, (2, 23, 4, 32), torch.float32).transpose(-1, -2).contiguous().transpose(-1, -2)
    assert qt.stride(-1) != 1
    out = fat.flash_attn_func(qt, k, v, backend="reference")
    expected, _ = attention(qt.double().numpy(), k.double().numpy(), v.double().numpy())
    assert_close(out, expected, torch.float32)


def test_deterministic_backward_is_bit_identical(rng):
    q, k, v = (randn(rng, (2, 31, 4, 32), torch.float32).requires_grad_() for _ in range(3))
    dout = randn(rng, (2, 31, 4, 32), torch.float32)

    def grads():
        out = fat.flash_attn_func(q, k, v, causal=True, deterministic=True, backend="reference")
        return torch.autograd.grad(out, (q, k, v), dout)

    first, second = grads(), grads()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


def test_bad_arguments_raise_value_error_with_the_library_message(rng):
    q = randn(rng, (2, 5, 4, 32), torch.float32)
    k = randn(rng, (2, 7, 3, 32), torch.float32)  # 3 does not divide 4
    with pytest.raises(ValueError, match=r"k: dimension 2 \(Hk\) must divide q's Hq = 4, got 3"):
        fat.flash_attn_func(q, k, k, backend="reference")
    with pytest.raises(flashattn.InvalidArgumentError, match=r"q: expected 4 dimensions"):
        fat.flash_attn_func(q[0], k[0], k[0], backend="reference")
    k = randn(rng, (2, 7, 2, 16), torch.float32)
    with pytest.raises(ValueError, match=r"k: dimension 3 \(D\) must be 32 like q, got 16"):
        fat.flash_attn_func(q, k, k, backend="reference")
    k = randn(rng, (2, 7, 2, 32), torch.float16)
    with pytest.raises(ValueError, match=r"k: dtype must match q \(float32\), got float16"):
        fat.flash_attn_func(q, k, k, backend="reference")
    with pytest.raises(ValueError, match=r"dropout_p: must be in \[0, 1\)"):
        fat.flash_attn_func(q, q, q, dropout_p=1.5, backend="reference")
    with pytest.raises(ValueError, match=r"window_right: must be -1 or 0 when causal"):
        fat.flash_attn_func(q, q, q, causal=True, window_size=(4, 4), backend="reference")
    with pytest.raises(ValueError, match=r"alibi_slopes: dtype must be float32"):
        fat.flash_attn_func(q, q, q, alibi_slopes=torch.ones(4, dtype=torch.float16), backend="reference")
    with pytest.raises(ValueError, match=r"q: dtype must be float32, float16 or bfloat16"):
        fat.flash_attn_func(q.double(), q.double(), q.double(), backend="reference")
    with pytest.raises(ValueError, match=r"backend: must be one of"):
        fat.flash_attn_func(q, q, q, backend="gpu")
    with pytest.raises(ValueError, match=r"window_size: must be a pair"):
        fat.flash_attn_func(q, q, q, window_size=3)
    with pytest.raises(ValueError, match=r"cu_seqlens_q: must be non-decreasing"):
        cu = torch.tensor([0, 3, 2], dtype=torch.int32)
        fat.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 5, 5, backend="reference")


def test_unsupported_arguments_raise_not_implemented(rng):
    q = randn(rng, (2, 1, 4, 32), torch.float32)
    cache = randn(rng, (2, 8, 4, 32), torch.float32)
    with pytest.raises(ValueError, match=r"cache_leftpad: entry 0 = 4 must be in \[0, cache_seqlens\[0\] = 3\]"):
        fat.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=3, cache_leftpad=torch.tensor([4, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_leftpad: dtype must be .*int32"):
        fat.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=3, cache_leftpad=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="cache_seqlens: required when k and v are appended"):
        fat.flash_attn_with_kvcache(q, cache, cache, q, q)
    out, lse = fat._fwd(q, cache, cache, None, None, 0.0, False, -1, -1, 0.0, 0.0, False, fat.backend_id("reference"))
    with pytest.raises(flashattn.UnsupportedError, match="cpu_standard implements the forward pass only"):
        fat._bwd(out, q, cache, cache, out, lse, None, None, 0.0, False, -1, -1, 0.0, 0.0, False,
                 fat.backend_id("standard"))


# ---------------------------------------------------------------------------------------------
# torch.library registration, torch.compile
# ---------------------------------------------------------------------------------------------


def test_custom_ops_pass_opcheck(rng):
    q = randn(rng, (2, 9, 4, 32), torch.float32).requires_grad_()
    k = randn(rng, (2, 11, 2, 32), torch.float32).requires_grad_()
    v = randn(rng, (2, 11, 2, 32), torch.float32).requires_grad_()
    ref = fat.backend_id("reference")
    torch.library.opcheck(fat._fwd, (q, k, v, None, None, 0.0, True, -1, 0, 0.0, 0.0, False, ref))
    rng_state = torch.tensor([123, 456], dtype=torch.int64)
    torch.library.opcheck(fat._fwd, (q, k, v, torch.rand(4), rng_state, 0.3, False, 5, 2, 3.0, 0.2, False, ref))
    out, lse = fat._fwd(q.detach(), k.detach(), v.detach(), None, None, 0.0, True, -1, 0, 0.0, 0.0, False, ref)
    torch.library.opcheck(fat._bwd, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, None, None,
                                     0.0, True, -1, 0, 0.0, 0.0, False, ref))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    torch.library.opcheck(fat._varlen_fwd, (q[0], k[0], v[0], cu, torch.tensor([0, 5, 11], dtype=torch.int32), 5, 6,
                                            None, None, None, None, 0.0, True, -1, 0, 0.0, 0.0, False, ref))
    seqused = torch.tensor([3, 6], dtype=torch.int32)  # a forward-only argument: no gradient check
    torch.library.opcheck(fat._varlen_fwd, (q[0].detach(), k[0].detach(), v[0].detach(), cu,
                                            torch.tensor([0, 5, 11], dtype=torch.int32), 5, 6, None, seqused, None, None,
                                            0.0, True, -1, 0, 0.0, 0.0, False, ref))


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_forward_and_backward(rng, compiler):
    q, k, v = (randn(rng, (2, 17, 4, 32), torch.float32).requires_grad_() for _ in range(3))
    dout = randn(rng, (2, 17, 4, 32), torch.float32)

    def layer(q, k, v):
        return fat.flash_attn_func(q * 2.0, k, v, causal=True, dropout_p=0.25, softcap=5.0, backend="reference") + 1.0

    torch.manual_seed(5)
    eager = layer(q, k, v)
    eager_grads = torch.autograd.grad(eager, (q, k, v), dout)
    compiled = torch.compile(layer, fullgraph=True, backend=compiler)
    # Same seed, same draw of (seed, offset), same mask: the compiled graph reproduces eager.
    # (Inductor draws random numbers with its own generator unless fallback_random is set: then
    # a compiled run is reproducible under torch.manual_seed but differs from eager.)
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fallback_random=True):
        torch.manual_seed(5)
        out = compiled(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.allclose(out, eager, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, eager_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_torch_compile_kvcache_mutation(rng):
    q = randn(rng, (2, 1, 4, 32), torch.float32)
    k_cache = randn(rng, (2, 16, 2, 32), torch.float32)
    v_cache = randn(rng, (2, 16, 2, 32), torch.float32)
    k_new, v_new = randn(rng, (2, 1, 2, 32), torch.float32), randn(rng, (2, 1, 2, 32), torch.float32)
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    k_eager, v_eager = k_cache.clone(), v_cache.clone()
    eager = fat.flash_attn_with_kvcache(q, k_eager, v_eager, k_new, v_new, cache_seqlens=seqlens, backend="reference")
    step = torch.compile(lambda q, kc, vc, kn, vn, s: fat.flash_attn_with_kvcache(
        q, kc, vc, kn, vn, cache_seqlens=s, backend="reference"), fullgraph=True, backend="aot_eager")
    out = step(q, k_cache, v_cache, k_new, v_new, seqlens)
    assert torch.equal(out, eager)
    assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager), "the caches were appended in place"


def test_eager_fast_path_equals_the_custom_op(rng):
    # Outside torch.compile the functions skip the torch.library dispatch layer (call overhead);
    # the registered op must give the same bits, forward and backward.
    q, k, v = (randn(rng, (2, 13, 4, 32), torch.float32).requires_grad_() for _ in range(3))
    dout = randn(rng, (2, 13, 4, 32), torch.float32)
    ref = fat.backend_id("reference")
    out = fat.flash_attn_func(q, k, v, causal=True, softcap=3.0, backend="reference")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    op_out, _ = fat._fwd(q, k, v, None, None, 0.0, True, -1, -1, 3.0, 0.0, False, ref)
    op_grads = torch.autograd.grad(op_out, (q, k, v), dout)
    assert torch.equal(out, op_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, op_grads))


def test_plan_memo_keys_and_bound(monkeypatch):
    """The CUDA host plans' memo (kvcache split plan, backward workspace size): a tensor keys by its shape, strides and
    dtype, never its data; a key's plan is made once; past the bound the memo starts again."""
    a = torch.zeros(4, 6)
    assert fat._plan_key((a, 1, None)) == fat._plan_key((torch.ones(4, 6), 1, None))
    assert fat._plan_key((a, 1, None)) != fat._plan_key((torch.zeros(6, 4).t(), 1, None))  # same shape, other strides
    assert fat._plan_key((a,)) != fat._plan_key((a.double(),))
    assert fat._plan_key((a, None)) != fat._plan_key((None, a))
    made = []

    def make():
        made.append(len(made))
        return len(made)

    memo = {}
    assert fat._memoised(memo, ("k",), make) == 1
    assert fat._memoised(memo, ("k",), make) == 1 and len(made) == 1
    monkeypatch.setattr(fat, "_PLANS_MAX", 2)
    assert fat._memoised(memo, ("k2",), make) == 2
    assert fat._memoised(memo, ("k3",), make) == 3
    assert memo == {("k3",): 3}


def _append_inputs(rng, dtype, paged, counts, cached, hk=2, d=32, capacity=48, block=16):
    """A cache (contiguous, or paged with shuffled block ids and spare blocks) and varlen new rows."""
    b = len(counts)
    total = sum(counts)
    cu = torch.tensor([0] + list(np.cumsum(counts)), dtype=torch.int32)
    seqlens = torch.tensor(cached, dtype=torch.int32)
    k, v = randn(rng, (total, hk, d), dtype), randn(rng, (total, hk, d), dtype)
    table = None
    if paged:
        per_seq = capacity // block
        blocks = b * per_seq + 2
        k_cache, v_cache = randn(rng, (blocks, block, hk, d), dtype), randn(rng, (blocks, block, hk, d), dtype)
        table = torch.from_numpy(rng.permutation(blocks)[: b * per_seq].reshape(b, per_seq).astype(np.int32))
    else:
        k_cache, v_cache = randn(rng, (b, capacity, hk, d), dtype), randn(rng, (b, capacity, hk, d), dtype)
    return k_cache, v_cache, k, v, cu, seqlens, table


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_append_equals_per_sequence_kvcache(rng, dtype, paged):
    """kvcache_append writes every sequence's rows (different counts, one of them none) exactly where and as
    flash_attn_with_kvcache's append writes them, one call per sequence; every other row stays as it was."""
    counts, cached = [3, 0, 16, 1], [0, 5, 17, 40]
    k_cache, v_cache, k, v, cu, seqlens, table = _append_inputs(rng, DTYPES[dtype], paged, counts, cached)
    kc, vc = k_cache.clone(), v_cache.clone()
    fat.kvcache_append(kc, vc, k, v, cu, seqlens, block_table=table, backend="auto")
    for b, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(int(cu[b]), int(cu[b + 1]))
        q = torch.zeros((1, 1, 2, 32), dtype=DTYPES[dtype])
        if paged:
            fat.flash_attn_with_kvcache(q, k_cache, v_cache, k[rows][None], v[rows][None], cache_seqlens=seqlens[b:b + 1],
                                        block_table=table[b:b + 1], backend="reference")
        else:
            fat.flash_attn_with_kvcache(q, k_cache[b:b + 1], v_cache[b:b + 1], k[rows][None], v[rows][None],
                                        cache_seqlens=seqlens[b:b + 1], backend="reference")
    assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)


def test_kvcache_append_mixed_step_with_varlen_forward(rng):
    """The serving step: one kvcache_append of two prompt chunks and two decode tokens, then one causal
    flash_attn_varlen_func over the paged cache, equals flash_attn_with_kvcache per sequence."""
    counts, cached = [9, 1, 20, 1], [4, 30, 0, 7]
    k_cache, v_cache, k, v, cu, seqlens, table = _append_inputs(rng, torch.float32, True, counts, cached)
    hq = 4
    q = randn(rng, (sum(counts), hq, 32), torch.float32)
    kc, vc = k_cache.clone(), v_cache.clone()
    fat.kvcache_append(kc, vc, k, v, cu, seqlens, max(counts), table)
    keys = [c + n for c, n in zip(cached, counts)]
    cu_k = torch.tensor([0] + list(np.cumsum(keys)), dtype=torch.int32)
    out = fat.flash_attn_varlen_func(q, kc, vc, cu, cu_k, max(counts), max(keys), causal=True, block_table=table,
                                     backend="auto")
    for b, n in enumerate(counts):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        want = fat.flash_attn_with_kvcache(q[rows][None], k_cache, v_cache, k[rows][None], v[rows][None],
                                           cache_seqlens=seqlens[b:b + 1], block_table=table[b:b + 1], causal=True,
                                           backend="reference")
        assert rel_l2(out[rows][None].double().numpy(), want.double().numpy()) <= FP32_TOLERANCE, f"sequence {b}"
    assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)


def test_kvcache_append_errors(rng):
    k_cache, v_cache, k, v, cu, seqlens, table = _append_inputs(rng, torch.float32, True, [3, 2], [0, 47])
    with pytest.raises(flashattn.InvalidArgumentError, match="cache_seqlens: entry 1 = 47 plus its 2 new rows"):
        fat.kvcache_append(k_cache, v_cache, k, v, cu, seqlens, block_table=table)
    with pytest.raises(flashattn.InvalidArgumentError, match="k_new: dtype must match k_cache"):
        fat.kvcache_append(k_cache, v_cache, k.half(), v.half(), cu, seqlens.clamp(max=40), block_table=table)
    with pytest.raises(flashattn.InvalidArgumentError, match="cu_seqlens_new: sequence 0 has length 3 > max_seqlen_new = 2"):
        fat.kvcache_append(k_cache, v_cache, k, v, cu, seqlens.clamp(max=40), 2, table)


def test_torch_compile_kvcache_append_mutation(rng):
    k_cache, v_cache, k, v, cu, seqlens, table = _append_inputs(rng, torch.float32, True, [2, 1], [5, 9])
    k_eager, v_eager = k_cache.clone(), v_cache.clone()
    fat.kvcache_append(k_eager, v_eager, k, v, cu, seqlens, 2, table)
    step = torch.compile(lambda kc, vc, kn, vn, c, s, t: fat.kvcache_append(kc, vc, kn, vn, c, s, 2, t),
                         fullgraph=True, backend="aot_eager")
    step(k_cache, v_cache, k, v, cu, seqlens, table)
    assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager), "the caches were written in place"
