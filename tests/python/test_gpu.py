"""The CUDA paths of flashattn.torch and flashattn.jax on a GPU (skipped without one).

Oracle: torch math SDPA in float64 on the same inputs (outputs and gradients); tolerance: at most
3x the error of the same math done naively in the kernel's precision (bf16/fp16) plus a tiny
absolute term. Also torch.compile(fullgraph=True) and jax.jit(jax.grad(...)) on the GPU, and the
CPU backend's dropout mask reproduced bit for bit by the GPU.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

import flashattn  # noqa: E402
import flashattn.torch as fat  # noqa: E402
from oracle import rel_l2  # noqa: E402

if not flashattn._ext.has_cuda:
    pytest.skip("this build of flashattn has no CUDA backend", allow_module_level=True)

DTYPES = [torch.bfloat16, torch.float16]
FACTOR, ABS = 3.0, 1e-6


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(fat, "_poison_outputs", True)


def sdpa(q, k, v, causal, dtype=None):
    """torch math SDPA in (B, S, H, D) layout, GQA by repetition, causal bottom-right aligned."""
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    hq, hk = q.shape[2], k.shape[2]
    k = k.repeat_interleave(hq // hk, dim=2)
    v = v.repeat_interleave(hq // hk, dim=2)
    sq, sk = q.shape[1], k.shape[1]
    mask = None
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        mask = j <= i + sk - sq
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


# When every query sees exactly one key, dq and dk are identically zero (the softmax is constant);
# a relative error is then undefined, and the kernels' fp32 rounding leaves ~1e-6. Such gradients must
# stay at that absolute level, far below the O(1) error of a real bug.
ZERO_GRADIENT_ABS = 1e-4


def check(actual, exact, naive, what):
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    exact_np = exact.detach().cpu().numpy()
    if not np.any(exact_np):
        worst = (actual.detach().double() - exact.detach().to(actual.device)).abs().max().item()
        assert worst <= ZERO_GRADIENT_ABS, f"{what}: exact value is 0, got max |error| {worst:.3g}"
        return
    err = rel_l2(actual.detach().double().cpu().numpy(), exact_np)
    base = rel_l2(naive.detach().double().cpu().numpy(), exact_np)
    assert err <= FACTOR * base + ABS, f"{what}: error {err:.3g} > {FACTOR} x naive {base:.3g} + {ABS}"


SHAPES = [(2, 1, 1, 4, 4, 64), (2, 17, 127, 8, 2, 128), (1, 1000, 1000, 4, 4, 64), (1, 127, 4097, 2, 1, 128)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_forward_backward_against_sdpa_float64(dtype, shape, causal):
    b, sq, sk, hq, hk, d = shape
    gen = torch.Generator(device="cuda").manual_seed(hash(shape) % 2**31)
    q = torch.randn(b, sq, hq, d, device="cuda", generator=gen).to(dtype).requires_grad_()
    k = torch.randn(b, sk, hk, d, device="cuda", generator=gen).to(dtype).requires_grad_()
    v = torch.randn(b, sk, hk, d, device="cuda", generator=gen).to(dtype).requires_grad_()
    dout = torch.randn(b, sq, hq, d, device="cuda", generator=gen).to(dtype)
    out = fat.flash_attn_func(q, k, v, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    exact = sdpa(q64, k64, v64, causal)
    exact_grads = torch.autograd.grad(exact, (q64, k64, v64), dout.double())
    qn, kn, vn = (x.detach().requires_grad_() for x in (q, k, v))
    naive = sdpa(qn, kn, vn, causal)
    naive_grads = torch.autograd.grad(naive, (qn, kn, vn), dout)
    check(out, exact, naive, "out")
    for name, a, e, n in zip(("dq", "dk", "dv"), grads, exact_grads, naive_grads):
        check(a, e, n, name)


def test_dropout_mask_matches_cpu_bit_for_bit():
    # q = 0 makes every visible key equally likely and v = identity rows turn out[i, j] into
    # keep(i, j) / ((1 - p) * Sk): the keep bits themselves, read back from the GPU and the CPU.
    b, sq, sk, h, p = 2, 96, 64, 4, 0.2
    q = torch.zeros(b, sq, h, 64, dtype=torch.float16)
    k = torch.randn(b, sk, h, 64).half()
    v = torch.eye(sk).reshape(1, sk, 1, sk).expand(b, sk, h, sk).contiguous().half()
    torch.manual_seed(3)
    cpu = fat.flash_attn_func(q, k, v, dropout_p=p, backend="reference")
    torch.manual_seed(3)
    gpu = fat.flash_attn_func(q.cuda(), k.cuda(), v.cuda(), dropout_p=p).cpu()
    keep_cpu = (cpu.float() * (1 - p) * sk).round()
    keep_gpu = (gpu.float() * (1 - p) * sk).round()
    assert set(keep_cpu.unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(keep_cpu, keep_gpu)


def test_kernels_run_on_the_callers_current_stream():
    # flashattn.torch launches on torch's current stream. Here that is a side stream held back by a sleep; the inputs
    # are written on it after the sleep. A kernel on any other stream would run first and read the zeros the inputs
    # held before (torch's side streams do not wait for the legacy default stream), and its outputs would be zeros.
    # That holds only if no call waits for the device on the host (a cudaMalloc may): a first pass, not checked, fills
    # torch's allocator cache, and the checked pass must return while the sleep still runs.
    side = torch.cuda.Stream()
    gen = torch.Generator(device="cuda").manual_seed(11)
    src_q, src_k, src_v, dout = (torch.randn(2, 64, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
                                 for _ in range(4))
    src_new = torch.randn(2, 1, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k, v = (torch.zeros_like(x).requires_grad_() for x in (src_q, src_k, src_v))
    k_new, v_new = torch.zeros_like(src_new), torch.zeros_like(src_new)
    k_paged, v_paged = (torch.zeros(8, 16, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    block_table = torch.tensor([[5, 1, 6, 2], [0, 7, 3, 4]], dtype=torch.int32, device="cuda")
    cache_seqlens = torch.tensor([40, 63], dtype=torch.int32, device="cuda")
    inputs = (q, k, v, k_new, v_new, k_paged, v_paged)

    def write_inputs_then_call():
        with torch.no_grad():
            for dst, src in ((q, src_q), (k, src_k), (v, src_v), (k_new, src_new), (v_new, -src_new)):
                dst.copy_(src)
            for cache, rows in ((k_paged, src_k), (v_paged, src_v)):  # the first 64 rows of each sequence
                cache[block_table.flatten().long()] = rows.reshape(8, 16, 4, 64)
        out = fat.flash_attn_func(q, k, v, causal=True, deterministic=True)  # dq: same bits in both runs
        grads = torch.autograd.grad(out, (q, k, v), dout)
        decoded = fat.flash_attn_with_kvcache(src_q[:, :1], k_paged, v_paged, k=k_new, v=v_new,
                                              cache_seqlens=cache_seqlens, block_table=block_table, causal=True)
        return out, grads, decoded

    with torch.cuda.stream(side):
        write_inputs_then_call()  # the allocator's warm-up
    torch.cuda.synchronize()
    with torch.no_grad():
        for x in inputs:
            x.zero_()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        assert fat._stream(q) == side.cuda_stream
        torch.cuda._sleep(200_000_000)  # clock cycles: ~100 ms
        out, grads, decoded = write_inputs_then_call()
        assert not side.query(), "a call waited for the device: this test could not see a kernel on another stream"
    side.synchronize()
    # The same calls on the default stream, after everything is in place.
    q2, k2, v2 = (x.clone().requires_grad_() for x in (src_q, src_k, src_v))
    out2 = fat.flash_attn_func(q2, k2, v2, causal=True, deterministic=True)
    assert torch.equal(out, out2)
    for a, b in zip(grads, torch.autograd.grad(out2, (q2, k2, v2), dout)):
        assert torch.equal(a, b)
    for b, n in enumerate((40, 63)):  # sequence b: its first n cached rows, then the appended one
        k_seq = torch.cat([src_k[b:b + 1, :n], src_new[b:b + 1]], dim=1)
        v_seq = torch.cat([src_v[b:b + 1, :n], -src_new[b:b + 1]], dim=1)
        expected = fat.flash_attn_func(src_q[b:b + 1, :1], k_seq, v_seq)
        assert rel_l2(decoded[b:b + 1].float().cpu().numpy(), expected.float().cpu().numpy()) < 1e-2


def test_torch_compile_fullgraph_on_gpu():
    q, k, v = (torch.randn(2, 128, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    f = torch.compile(lambda q, k, v: fat.flash_attn_func(q, k, v, causal=True), fullgraph=True)
    out = f(q, k, v)
    out.float().sum().backward()
    eager = fat.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, eager)


def jax_on_gpu():
    """(jax, jax.numpy, flashattn.jax, jax's GPU devices), or the test skips where jax or its GPU backend is absent."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("jax has no GPU backend here")
    return jax, jnp, pytest.importorskip("flashattn.jax"), gpus


def test_jax_jit_grad_on_gpu():
    jax, jnp, fj, _ = jax_on_gpu()
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 128, 4, 64)), jnp.bfloat16) for _ in range(3))

    def loss(q, k, v):
        return fj.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32).sum()

    def loss_nn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    q64, k64, v64 = (torch.from_numpy(np.asarray(x.astype(jnp.float32))).double().requires_grad_() for x in (q, k, v))
    exact = torch.autograd.grad(sdpa(q64, k64, v64, True).sum(), (q64, k64, v64))
    naive = jax.grad(loss_nn, argnums=(0, 1, 2))(q, k, v)
    for name, a, e, n in zip(("dq", "dk", "dv"), grads, exact, naive):
        err = rel_l2(np.asarray(a.astype(jnp.float32)), e.numpy())
        base = rel_l2(np.asarray(n.astype(jnp.float32)), e.numpy())
        assert err <= FACTOR * base + ABS, f"{name}: {err:.3g} vs naive {base:.3g}"


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("leftpad", [False, True], ids=["", "leftpad"])
def test_jax_kvcache_on_gpu(cache, leftpad):
    """flashattn.jax.flash_attn_with_kvcache on the GPU: a jitted decode step over a paged cache (shuffled blocks of
    16) with the caches donated, bf16 or FP8 (e4m3, power-of-two scales). The updated caches equal the CPU backend's
    bit for bit (the appended rows, quantised for FP8; every other row untouched), and out matches float64 SDPA over
    the (dequantised) cache after the append within 3x the error of SDPA in bf16. With cache_leftpad (a paged cache):
    the CPU backend's result over the rows from the padding on, and CUDA's refusal by name."""
    jax, jnp, fj, gpus = jax_on_gpu()
    rng = np.random.default_rng(5)
    b, s_cache, hq, hk, d, block = 3, 2048, 32, 8, 128, 16
    scales = (2.0 ** -4, 2.0 ** -5) if cache == "fp8" else (None, None)
    cache_dtype = jnp.float8_e4m3fn if cache == "fp8" else jnp.bfloat16
    cached = np.array([2000, 1, 700], dtype=np.int32)
    pad = np.array([1357, 0, 700] if leftpad else [0, 0, 0], dtype=np.int32)  # 700: only the new key
    per_seq = s_cache // block
    table = rng.permutation(b * per_seq).reshape(b, per_seq).astype(np.int32)
    pool_shape = (b * per_seq, block, hk, d)
    k_pool = np.asarray(jnp.asarray(rng.standard_normal(pool_shape) / (scales[0] or 1.0), cache_dtype))
    v_pool = np.asarray(jnp.asarray(rng.standard_normal(pool_shape) / (scales[1] or 1.0), cache_dtype))
    q = np.asarray(jnp.asarray(rng.standard_normal((b, 1, hq, d)), jnp.bfloat16))
    k_new = np.asarray(jnp.asarray(rng.standard_normal((b, 1, hk, d)), jnp.bfloat16))
    v_new = np.asarray(jnp.asarray(rng.standard_normal((b, 1, hk, d)), jnp.bfloat16))

    def step(q, k_cache, v_cache, k, v, seqlens, table):
        return fj.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                                          cache_leftpad=pad if leftpad else None, k_scale=scales[0], v_scale=scales[1])

    def run_on(device):
        put = lambda x: jax.device_put(x, device)  # noqa: E731
        out, kc, vc = jax.jit(step, donate_argnums=(1, 2))(put(q), put(k_pool), put(v_pool), put(k_new), put(v_new),
                                                           put(cached), put(table))
        return np.asarray(out.astype(jnp.float32)), np.asarray(kc), np.asarray(vc)

    if leftpad:  # CUDA takes cache_leftpad with a contiguous cache only (as flash_attn)
        with pytest.raises(Exception, match="cache_leftpad: on the cuda backend with a contiguous cache only"):
            run_on(gpus[0])
        out, kc, vc = run_on(jax.devices("cpu")[0])
        kc_cpu, vc_cpu = kc, vc
    else:
        out, kc, vc = run_on(gpus[0])
        _, kc_cpu, vc_cpu = run_on(jax.devices("cpu")[0])
    assert np.array_equal(kc.view(np.uint8), kc_cpu.view(np.uint8)), "updated k cache"
    assert np.array_equal(vc.view(np.uint8), vc_cpu.view(np.uint8)), "updated v cache"
    for s in range(b):
        n = int(cached[s]) + 1
        keys = np.concatenate([kc[c] for c in table[s]])[pad[s]:n].astype(np.float32) * (scales[0] or 1.0)
        values = np.concatenate([vc[c] for c in table[s]])[pad[s]:n].astype(np.float32) * (scales[1] or 1.0)
        as_torch = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))[None]  # noqa: E731
        q_s, k_s, v_s = as_torch(q[s].astype(np.float32)), as_torch(keys), as_torch(values)
        exact = sdpa(q_s.double(), k_s.double(), v_s.double(), causal=False)
        naive = sdpa(q_s.bfloat16(), k_s.bfloat16(), v_s.bfloat16(), causal=False)
        check(torch.from_numpy(out[s:s + 1]), exact, naive, f"jax kvcache ({cache}) out of sequence {s}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_leftpad_on_gpu(dtype, paged):
    """cache_leftpad on the GPU, 4 new tokens (causal) appended with rotary: sequence b's keys are cache rows
    [pad[b], cached[b] + 4), the padding rows hold NaN. The caches after the call equal the CPU backend's bit for bit,
    and out matches float64 SDPA (bottom-right causal) over those keys and the rotated q within 3x the error of SDPA
    in the 16-bit dtype. A paged cache: the CPU backend computes it, CUDA refuses it by name (as flash_attn)."""
    b, s_cache, s_new, hq, hk, d, block, rot = 3, 2048, 4, 32, 8, 128, 16, 64
    cached = torch.tensor([2000, 64, 700], dtype=torch.int32)
    pad = torch.tensor([1357, 64, 0], dtype=torch.int32)  # inside a tile; = the length (only the new keys); none
    q = torch.randn(b, s_new, hq, d).to(dtype)
    k_new, v_new = torch.randn(b, s_new, hk, d).to(dtype), torch.randn(b, s_new, hk, d).to(dtype)
    angle = torch.rand(s_cache + s_new, rot // 2, dtype=torch.float64) * 6.3
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    k_dense, v_dense = torch.randn(b, s_cache, hk, d).to(dtype), torch.randn(b, s_cache, hk, d).to(dtype)
    for s in range(b):
        k_dense[s, :pad[s]] = float("nan")
        v_dense[s, :pad[s]] = float("nan")
    table = None
    k_cache, v_cache = k_dense.clone(), v_dense.clone()
    if paged:
        per_seq = s_cache // block
        perm = torch.randperm(b * per_seq)
        table = perm.reshape(b, per_seq).to(torch.int32)
        k_cache = torch.empty(b * per_seq, block, hk, d, dtype=dtype)
        v_cache = torch.empty_like(k_cache)
        k_cache[perm], v_cache[perm] = k_dense.reshape(-1, block, hk, d), v_dense.reshape(-1, block, hk, d)
    kw = dict(cache_seqlens=cached, cache_leftpad=pad, block_table=table, rotary_cos=cos, rotary_sin=sin, causal=True)
    kc_cpu, vc_cpu = k_cache.clone(), v_cache.clone()
    fat.flash_attn_with_kvcache(q, kc_cpu, vc_cpu, k_new, v_new, **kw)
    kc, vc = k_cache.cuda(), v_cache.cuda()
    gpu_kw = dict(kw, cache_seqlens=cached.cuda(), cache_leftpad=pad.cuda(), rotary_cos=cos.cuda(), rotary_sin=sin.cuda(),
                  block_table=None if table is None else table.cuda())
    if paged:
        with pytest.raises(NotImplementedError, match="cache_leftpad: on the cuda backend with a contiguous cache only"):
            fat.flash_attn_with_kvcache(q.cuda(), kc, vc, k_new.cuda(), v_new.cuda(), **gpu_kw)
        kc, vc = kc_cpu, vc_cpu  # judge the CPU backend's result below
        out = fat.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k_new, v_new, **kw)
    else:
        out = fat.flash_attn_with_kvcache(q.cuda(), kc, vc, k_new.cuda(), v_new.cuda(), **gpu_kw).cpu()
    assert torch.equal(kc.cpu().view(torch.int16), kc_cpu.view(torch.int16)), "k cache after the append"
    assert torch.equal(vc.cpu().view(torch.int16), vc_cpu.view(torch.int16)), "v cache after the append"
    for s in range(b):
        n = int(cached[s]) + s_new
        rows = kc_cpu[s] if table is None else torch.cat([kc_cpu[c] for c in table[s].long()])
        vrows = vc_cpu[s] if table is None else torch.cat([vc_cpu[c] for c in table[s].long()])
        keys, values = rows[int(pad[s]):n][None], vrows[int(pad[s]):n][None]
        # q rotated in float64 at positions cached + i (causal), interleaved pairs (rotary_interleaved's default)
        qs = q[s].double().clone()
        pos = torch.arange(int(cached[s]), n)
        c_, s_ = cos.double()[pos][:, None, :], sin.double()[pos][:, None, :]
        x0, x1 = qs[..., 0:rot:2].clone(), qs[..., 1:rot:2].clone()
        qs[..., 0:rot:2], qs[..., 1:rot:2] = x0 * c_ - x1 * s_, x0 * s_ + x1 * c_
        exact = sdpa(qs[None], keys.double(), values.double(), causal=True)
        naive = sdpa(qs[None].to(dtype), keys, values, causal=True)
        check(out[s:s + 1], exact, naive, f"leftpad out of sequence {s}")


def test_kvcache_plan_is_memoised_per_key_on_gpu():
    """flashattn.torch asks the CUDA split plan once per key (the tensors' shapes, strides and dtypes, the options, the
    device): a second call reuses it and gives the bits of the first; the same pool viewed with blocks that are not
    runs of whole rows gets an entry of its own (the plan reads strides: the lean paged copies need row runs); and
    every entry equals the plan made afresh for its call."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    b, hq, hk, d, block, per_seq = 2, 32, 8, 128, 16, 512  # 8k keys a sequence: split-KV
    k_pool, v_pool = (torch.randn(b * per_seq, block, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                      for _ in range(2))
    # the same keys, each block stored [head, row, D]: the (block, row, head, D) view's blocks are not row runs
    k_heads, v_heads = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k_pool, v_pool))
    assert torch.equal(k_heads, k_pool) and k_heads.stride() != k_pool.stride()
    table = torch.randperm(b * per_seq, device="cuda", generator=gen).reshape(b, per_seq).to(torch.int32)
    seqlens = torch.tensor([8000, 5000], dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)

    def call(k_cache, v_cache):
        return fat.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                           return_softmax_lse=True)

    fat._kvcache_plans.clear()
    out, lse = call(k_pool, v_pool)
    assert len(fat._kvcache_plans) == 1
    out_again, lse_again = call(k_pool, v_pool)  # planned from the memo
    assert len(fat._kvcache_plans) == 1
    assert torch.equal(out_again, out) and torch.equal(lse_again, lse)
    out_heads, lse_heads = call(k_heads, v_heads)
    assert len(fat._kvcache_plans) == 2, "a cache of other strides must not reuse the plan"
    memo = dict(fat._kvcache_plans)
    fat._kvcache_plans.clear()
    call(k_heads, v_heads)
    call(k_pool, v_pool)
    assert fat._kvcache_plans == memo
    assert rel_l2(out_heads.float().cpu().numpy(), out.float().cpu().numpy()) < 1e-2
    assert rel_l2(lse_heads.cpu().numpy(), lse.cpu().numpy()) < 1e-4


def test_backward_workspace_size_is_memoised_per_key_on_gpu():
    """flashattn.torch asks the backward's workspace size once per key, as the kvcache plan: a second backward of the
    same problem reuses it and gives the bits of the first (deterministic); another mask or length gets an entry of
    its own; and every entry equals the size asked afresh."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    q, k, v, dout = (torch.randn(2, 300, 8, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))

    def grads(causal, length):
        qkv = [x[:, :length].detach().requires_grad_() for x in (q, k, v)]
        out = fat.flash_attn_func(*qkv, causal=causal, deterministic=True)
        return torch.autograd.grad(out, qkv, dout[:, :length])

    fat._backward_workspace_sizes.clear()
    first = grads(True, 300)
    assert len(fat._backward_workspace_sizes) == 1
    again = grads(True, 300)  # sized from the memo
    assert len(fat._backward_workspace_sizes) == 1
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    grads(False, 300)
    grads(True, 200)
    assert len(fat._backward_workspace_sizes) == 3
    memo = dict(fat._backward_workspace_sizes)
    fat._backward_workspace_sizes.clear()
    for causal, length in ((True, 200), (False, 300), (True, 300)):
        grads(causal, length)
    assert fat._backward_workspace_sizes == memo


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kvcache_cache_batch_idx_on_gpu(dtype):
    """cache_batch_idx on the GPU: out against float64 SDPA over the gathered cache (slot cache_batch_idx[b] as entry b)
    within 3x the error of SDPA in the 16-bit dtype, lse as the gathered call's, the appended rows in the sequences'
    slots bit for bit, the other slots untouched."""
    b, slots, s_cache, hq, hk, d = 3, 6, 2048, 32, 8, 128
    idx = torch.tensor([5, 0, 3], dtype=torch.int32, device="cuda")
    cached = torch.tensor([2000, 1, 700], dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, hq, d, device="cuda").to(dtype)
    k_new, v_new = torch.randn(b, 1, hk, d, device="cuda").to(dtype), torch.randn(b, 1, hk, d, device="cuda").to(dtype)
    k_slots = torch.randn(slots, s_cache, hk, d, device="cuda").to(dtype)
    v_slots = torch.randn(slots, s_cache, hk, d, device="cuda").to(dtype)
    k_before, v_before = k_slots.clone(), v_slots.clone()
    k_gathered, v_gathered = k_slots[idx.long()].clone(), v_slots[idx.long()].clone()
    kw = dict(cache_seqlens=cached, return_softmax_lse=True)
    out, lse = fat.flash_attn_with_kvcache(q, k_slots, v_slots, k_new, v_new, cache_batch_idx=idx, **kw)
    _, expected_lse = fat.flash_attn_with_kvcache(q, k_gathered, v_gathered, k_new, v_new, **kw)
    assert rel_l2(lse.cpu().numpy(), expected_lse.cpu().numpy()) <= 1e-4
    assert torch.equal(k_slots[idx.long()], k_gathered) and torch.equal(v_slots[idx.long()], v_gathered)
    for slot in (1, 2, 4):
        assert torch.equal(k_slots[slot], k_before[slot]) and torch.equal(v_slots[slot], v_before[slot])
    for s in range(b):
        n = int(cached[s]) + 1
        keys, values = k_gathered[s:s + 1, :n], v_gathered[s:s + 1, :n]
        exact = sdpa(q[s:s + 1].double(), keys.double(), values.double(), causal=False)
        naive = sdpa(q[s:s + 1], keys, values, causal=False)
        check(out[s:s + 1], exact, naive, f"cache_batch_idx out of sequence {s}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_many_query_rows_on_gpu(dtype, paged):
    """flash_attn_with_kvcache of 128 new tokens (a chunk of a prompt; causal, appended): calls of >= 64 query rows run
    the forward kernel over the cache (split-KV), planned and memoised as any other. The caches after the call equal
    the CPU backend's bit for bit, and out matches float64 SDPA (bottom-right causal) over each sequence's keys within
    3x the error of SDPA in the 16-bit dtype; lse is finite."""
    b, s_cache, s_new, hq, hk, d, block = 3, 4096, 128, 32, 8, 128, 16
    cached = torch.tensor([3900, 0, 1000], dtype=torch.int32)
    q = torch.randn(b, s_new, hq, d).to(dtype)
    k_new, v_new = torch.randn(b, s_new, hk, d).to(dtype), torch.randn(b, s_new, hk, d).to(dtype)
    k_dense, v_dense = torch.randn(b, s_cache, hk, d).to(dtype), torch.randn(b, s_cache, hk, d).to(dtype)
    if paged:
        per_seq = s_cache // block
        table = torch.randperm(b * per_seq).to(torch.int32).reshape(b, per_seq)
        k_cache = torch.empty(b * per_seq, block, hk, d, dtype=dtype)
        v_cache = torch.empty(b * per_seq, block, hk, d, dtype=dtype)
        k_cache[table.long()] = k_dense.reshape(b, per_seq, block, hk, d)
        v_cache[table.long()] = v_dense.reshape(b, per_seq, block, hk, d)
    else:
        table, k_cache, v_cache = None, k_dense.clone(), v_dense.clone()
    kc_cpu, vc_cpu = k_cache.clone(), v_cache.clone()
    fat.flash_attn_with_kvcache(q, kc_cpu, vc_cpu, k_new, v_new, cache_seqlens=cached, block_table=table, causal=True)
    kc, vc = k_cache.cuda(), v_cache.cuda()
    out, lse = fat.flash_attn_with_kvcache(q.cuda(), kc, vc, k_new.cuda(), v_new.cuda(), cache_seqlens=cached.cuda(),
                                           block_table=None if table is None else table.cuda(), causal=True,
                                           return_softmax_lse=True)
    torch.cuda.synchronize()
    assert torch.equal(kc.cpu(), kc_cpu) and torch.equal(vc.cpu(), vc_cpu), "appended caches"
    assert torch.isfinite(lse).all()
    for s in range(b):
        n = int(cached[s])
        keys = torch.cat([k_dense[s:s + 1, :n], k_new[s:s + 1]], dim=1)
        values = torch.cat([v_dense[s:s + 1, :n], v_new[s:s + 1]], dim=1)
        exact = sdpa(q[s:s + 1].double(), keys.double(), values.double(), causal=True)
        naive = sdpa(q[s:s + 1], keys, values, causal=True)
        check(out[s:s + 1].cpu(), exact, naive, f"{s_new} query rows, sequence {s}")


@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_kvcache_without_lse_on_gpu(num_splits):
    """Without return_softmax_lse the eager call passes no lse (and plans under its own memo key): the out and
    appended paged caches of the call with lse, bit for bit, with the split plan's count or a forced one."""
    b, hq, hk, d, block, blocks_per_seq = 3, 32, 8, 128, 16, 64
    cached = torch.tensor([1000, 17, 0], dtype=torch.int32, device="cuda")
    table = torch.randperm(b * blocks_per_seq, device="cuda").to(torch.int32).reshape(b, blocks_per_seq)
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(b, 1, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k_cache, v_cache = (torch.randn(b * blocks_per_seq, block, hk, d, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    k2, v2 = k_cache.clone(), v_cache.clone()
    kw = dict(cache_seqlens=cached, block_table=table, num_splits=num_splits)
    out, lse = fat.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, return_softmax_lse=True, **kw)
    out_alone = fat.flash_attn_with_kvcache(q, k2, v2, k_new, v_new, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(lse).all()
    assert torch.equal(out_alone, out)
    assert torch.equal(k2, k_cache) and torch.equal(v2, v_cache)


@pytest.mark.skipif(getattr(torch, "float8_e4m3fn", None) is None, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_fp8_cache_on_gpu(dtype, paged):
    """An FP8 (e4m3) cache on the GPU: the appended codes equal the CPU backend's bit for bit, and out matches
    float64 SDPA over the dequantised cache within 3x the error of SDPA in the 16-bit dtype over the same values
    (power-of-two scales: the dequantised values are exact in the 16-bit dtype)."""
    fp8 = torch.float8_e4m3fn
    b, s_cache, s_new, hq, hk, d, block = 2, 1024, 1, 16, 4, 128, 16
    k_scale, v_scale = 2.0 ** -4, 2.0 ** -5
    cached = torch.tensor([1000, 333], dtype=torch.int32)
    q = torch.randn(b, 1, hq, d).to(dtype)
    k_new, v_new = torch.randn(b, s_new, hk, d).to(dtype), torch.randn(b, s_new, hk, d).to(dtype)
    k_cache = (torch.randn(b, s_cache, hk, d) / k_scale).to(fp8)
    v_cache = (torch.randn(b, s_cache, hk, d) / v_scale).to(fp8)
    table = None
    if paged:
        per_seq = s_cache // block
        perm = torch.randperm(b * per_seq)
        table = perm.reshape(b, per_seq).to(torch.int32)
        flat_k = k_cache.view(torch.uint8).reshape(b * per_seq, block, hk, d)
        flat_v = v_cache.view(torch.uint8).reshape(b * per_seq, block, hk, d)
        pk, pv = torch.empty_like(flat_k), torch.empty_like(flat_v)
        pk[perm], pv[perm] = flat_k, flat_v  # block n of the dense cache goes to id perm[n]
        k_cache, v_cache = pk.view(fp8), pv.view(fp8)
    kw = dict(cache_seqlens=cached, block_table=table, causal=True, k_scale=k_scale, v_scale=v_scale)
    kc_cpu, vc_cpu = k_cache.clone(), v_cache.clone()
    fat.flash_attn_with_kvcache(q, kc_cpu, vc_cpu, k_new, v_new, **kw)
    kc, vc = k_cache.cuda(), v_cache.cuda()
    gpu_kw = dict(kw, cache_seqlens=cached.cuda(), block_table=None if table is None else table.cuda())
    out = fat.flash_attn_with_kvcache(q.cuda(), kc, vc, k_new.cuda(), v_new.cuda(), **gpu_kw)
    assert torch.equal(kc.cpu().view(torch.uint8), kc_cpu.view(torch.uint8)), "appended k codes"
    assert torch.equal(vc.cpu().view(torch.uint8), vc_cpu.view(torch.uint8)), "appended v codes"
    for s in range(b):
        n = int(cached[s]) + s_new
        if table is None:
            keys, values = kc_cpu[s, :n], vc_cpu[s, :n]
        else:
            keys = torch.cat([kc_cpu[table[s, c]] for c in range(table.shape[1])])[:n]
            values = torch.cat([vc_cpu[table[s, c]] for c in range(table.shape[1])])[:n]
        keys, values = keys.double()[None] * k_scale, values.double()[None] * v_scale
        exact = sdpa(q[s:s + 1].double(), keys, values, causal=True)
        naive = sdpa(q[s:s + 1], keys.to(dtype), values.to(dtype), causal=True)
        check(out[s:s + 1], exact, naive, f"fp8 cache out of sequence {s}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_append_on_gpu(dtype, paged):
    """kvcache_append on the GPU writes the CPU backend's bytes (16-bit and FP8 caches), and its checked mode names a
    bad device entry."""
    b, capacity, hk, d, block = 4, 256, 2, 128, 16
    counts, cached = [3, 0, 100, 1], [0, 5, 17, 200]
    cu = torch.tensor([0] + list(np.cumsum(counts)), dtype=torch.int32)
    seqlens = torch.tensor(cached, dtype=torch.int32)
    k, v = torch.randn(sum(counts), hk, d).to(dtype), torch.randn(sum(counts), hk, d).to(dtype)
    if paged:
        blocks = b * (capacity // block) + 3
        k_cache, v_cache = torch.randn(blocks, block, hk, d).to(dtype), torch.randn(blocks, block, hk, d).to(dtype)
        table = torch.randperm(blocks)[: b * (capacity // block)].reshape(b, -1).to(torch.int32)
    else:
        k_cache, v_cache = torch.randn(b, capacity, hk, d).to(dtype), torch.randn(b, capacity, hk, d).to(dtype)
        table = None
    fp8 = getattr(torch, "float8_e4m3fn", None)
    caches = [(k_cache, v_cache, {})]
    if fp8 is not None:
        caches.append(((k_cache.float() * 16).to(fp8), (v_cache.float() * 32).to(fp8), dict(k_scale=2.0 ** -4, v_scale=2.0 ** -5)))
    for kc0, vc0, scales in caches:
        kc_cpu, vc_cpu = kc0.clone(), vc0.clone()
        fat.kvcache_append(kc_cpu, vc_cpu, k, v, cu, seqlens, max(counts), table, **scales)
        for checked in (False, True):
            kc, vc = kc0.cuda(), vc0.cuda()
            fat.kvcache_append(kc, vc, k.cuda(), v.cuda(), cu.cuda(), seqlens.cuda(), max(counts),
                               None if table is None else table.cuda(), check_indices=checked, **scales)
            torch.cuda.synchronize()
            view = torch.uint8 if scales else kc.dtype
            assert torch.equal(kc.cpu().view(view), kc_cpu.view(view)), f"k_cache {scales} checked={checked}"
            assert torch.equal(vc.cpu().view(view), vc_cpu.view(view)), f"v_cache {scales} checked={checked}"
    bad = seqlens.clone()
    bad[3] = capacity  # 256 + 1 new row > the capacity
    with pytest.raises(flashattn.InvalidArgumentError, match="cache_seqlens: entry 3 = 256 plus its 1 new rows"):
        fat.kvcache_append(k_cache.cuda(), v_cache.cuda(), k.cuda(), v.cuda(), cu.cuda(), bad.cuda(), max(counts),
                           None if table is None else table.cuda(), check_indices=True)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_jax_kvcache_append_on_gpu(paged):
    """flashattn.jax.kvcache_append on the GPU, jitted with the caches donated: the CPU backend's bytes (bf16 and FP8
    caches), and the checked mode's error for a device entry past the capacity."""
    jax, jnp, fj, gpus = jax_on_gpu()
    rng = np.random.default_rng(11)
    b, capacity, hk, d, block = 4, 256, 2, 128, 16
    counts, cached = [3, 0, 100, 1], [0, 5, 17, 200]
    cu = np.array([0] + list(np.cumsum(counts)), dtype=np.int32)
    seqlens = np.array(cached, dtype=np.int32)
    k = np.asarray(jnp.asarray(rng.standard_normal((sum(counts), hk, d)), jnp.bfloat16))
    v = np.asarray(jnp.asarray(rng.standard_normal((sum(counts), hk, d)), jnp.bfloat16))
    shape, table = (b, capacity, hk, d), None
    if paged:
        blocks = b * (capacity // block) + 3
        shape = (blocks, block, hk, d)
        table = rng.permutation(blocks)[: b * (capacity // block)].reshape(b, -1).astype(np.int32)
    for cache_dtype, scales in ((jnp.bfloat16, (None, None)), (jnp.float8_e4m3fn, (2.0 ** -4, 2.0 ** -5))):
        k_cache = np.asarray(jnp.asarray(rng.standard_normal(shape) / (scales[0] or 1.0), cache_dtype))
        v_cache = np.asarray(jnp.asarray(rng.standard_normal(shape) / (scales[1] or 1.0), cache_dtype))

        def run_on(device, lengths=seqlens, checked=False):
            put = lambda x: None if x is None else jax.device_put(x, device)  # noqa: E731
            step = jax.jit(lambda kc, vc, kn, vn, c, s, t: fj.kvcache_append(
                kc, vc, kn, vn, c, s, max(counts), t, k_scale=scales[0], v_scale=scales[1], check_indices=checked),
                donate_argnums=(0, 1))
            kc, vc = step(put(k_cache), put(v_cache), put(k), put(v), put(cu), put(lengths), put(table))
            return np.asarray(kc), np.asarray(vc)

        kc_cpu, vc_cpu = run_on(jax.devices("cpu")[0])
        for checked in (False, True):
            kc, vc = run_on(gpus[0], checked=checked)
            assert np.array_equal(kc.view(np.uint8), kc_cpu.view(np.uint8)), f"k_cache {cache_dtype} checked={checked}"
            assert np.array_equal(vc.view(np.uint8), vc_cpu.view(np.uint8)), f"v_cache {cache_dtype} checked={checked}"
        bad = seqlens.copy()
        bad[3] = capacity  # 256 + 1 new row > the capacity
        with pytest.raises(Exception, match="cache_seqlens: entry 3 = 256 plus its 1 new rows"):
            run_on(gpus[0], bad, checked=True)


@pytest.mark.parametrize("step", ["mixed", "decode", "decode_seqused"])
@pytest.mark.parametrize("heads", [(32, 8), (8, 8)], ids=["gqa4", "mha"])
def test_varlen_paged_forward_with_decode_rows_on_gpu(heads, step):
    """A serving step through flash_attn_varlen_func with block_table: decode tokens (routed to the decode kernels on
    CUDA) beside prefill chunks (the forward kernel), or decode tokens only (one decode call in place; with seqused_k
    below cu_seqlens_k's counts, as vLLM passes them), against the CPU backend's result on the same inputs, and the
    float64 oracle per sequence."""
    torch.manual_seed(5)
    hq, hk = heads
    d, block = 128, 16
    lengths_q, lengths_k = [1, 1, 40, 3, 1, 17, 4, 1], [3000, 700, 300, 3, 1, 900, 1200, 2]
    if step != "mixed":
        lengths_q = [1] * len(lengths_q)
    used = [n - n // 3 if s % 2 == 0 else n for s, n in enumerate(lengths_k)] if step == "decode_seqused" else lengths_k
    seqused = torch.tensor(used, dtype=torch.int32) if step == "decode_seqused" else None
    b = len(lengths_q)
    max_blocks = max(lengths_k) // block + 1
    blocks = b * max_blocks + 2
    k_cache = torch.randn(blocks, block, hk, d).to(torch.bfloat16)
    v_cache = torch.randn(blocks, block, hk, d).to(torch.bfloat16)
    table = torch.randperm(blocks)[: b * max_blocks].reshape(b, max_blocks).to(torch.int32)
    q = torch.randn(sum(lengths_q), hq, d).to(torch.bfloat16)
    cu_q = torch.tensor([0] + list(np.cumsum(lengths_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(np.cumsum(lengths_k)), dtype=torch.int32)
    args = (max(lengths_q), max(lengths_k))
    out_cpu, lse_cpu, _ = fat.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, *args, causal=True,
                                                     return_attn_probs=True, block_table=table, seqused_k=seqused)
    out, lse, _ = fat.flash_attn_varlen_func(q.cuda(), k_cache.cuda(), v_cache.cuda(), cu_q.cuda(), cu_k.cuda(), *args,
                                             causal=True, return_attn_probs=True, block_table=table.cuda(),
                                             seqused_k=seqused.cuda() if seqused is not None else None)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert rel_l2(out.cpu().double().numpy(), out_cpu.double().numpy()) < 2e-2
    assert (lse.cpu() - lse_cpu).abs().max().item() < 2e-2
    for s in range(b):  # each sequence against the float64 oracle over its own keys
        rows = slice(int(cu_q[s]), int(cu_q[s + 1]))
        ids = table[s, : (used[s] + block - 1) // block].long()
        keys = k_cache[ids].reshape(-1, hk, d)[: used[s]]
        values = v_cache[ids].reshape(-1, hk, d)[: used[s]]
        exact = sdpa(q[rows].unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), causal=True, dtype=torch.float64)
        naive = sdpa(q[rows].unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), causal=True)
        check(out[rows].cpu().unsqueeze(0), exact, naive, f"sequence {s} ({lengths_q[s]} rows, {used[s]} keys)")


@pytest.mark.parametrize("step", ["mixed", "decode_seqused"])
def test_jax_varlen_paged_forward_on_gpu(step):
    """flashattn.jax.flash_attn_varlen_func over a paged bf16 cache on the GPU (jitted): decode tokens beside prefill
    chunks (the gather route and the forward kernel), or decode tokens only with seqused_k (one decode call in place),
    against the same call on the CPU."""
    jax, jnp, fj, gpus = jax_on_gpu()
    rng = np.random.default_rng(13)
    hq, hk, d, block = 32, 8, 128, 16
    lengths_q, lengths_k = [1, 1, 40, 3, 1, 17, 4, 1], [3000, 700, 300, 3, 1, 900, 1200, 2]
    used = lengths_k
    if step == "decode_seqused":
        lengths_q = [1] * len(lengths_q)
        used = [n - n // 3 for n in lengths_k]
    b = len(lengths_q)
    max_blocks = max(lengths_k) // block + 1
    blocks = b * max_blocks + 2
    pool_k = np.asarray(jnp.asarray(rng.standard_normal((blocks, block, hk, d)), jnp.bfloat16))
    pool_v = np.asarray(jnp.asarray(rng.standard_normal((blocks, block, hk, d)), jnp.bfloat16))
    table = rng.permutation(blocks)[: b * max_blocks].reshape(b, max_blocks).astype(np.int32)
    q = np.asarray(jnp.asarray(rng.standard_normal((sum(lengths_q), hq, d)), jnp.bfloat16))
    cu_q = np.array([0] + list(np.cumsum(lengths_q)), dtype=np.int32)
    cu_k = np.array([0] + list(np.cumsum(lengths_k)), dtype=np.int32)
    seqused = np.array(used, dtype=np.int32) if step == "decode_seqused" else None
    call = jax.jit(lambda q, k, v, cq, ck, t, s: fj.flash_attn_varlen_func(
        q, k, v, cq, ck, max(lengths_q), max(lengths_k), causal=True, return_attn_probs=True, block_table=t,
        seqused_k=s)[:2])

    def run_on(device):
        put = lambda x: None if x is None else jax.device_put(x, device)  # noqa: E731
        out, lse = call(put(q), put(pool_k), put(pool_v), put(cu_q), put(cu_k), put(table), put(seqused))
        return np.asarray(out.astype(jnp.float32), np.float64), np.asarray(lse, np.float64)

    out_cpu, lse_cpu = run_on(jax.devices("cpu")[0])
    out, lse = run_on(gpus[0])
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert rel_l2(out, out_cpu) < 2e-2
    assert np.abs(lse - lse_cpu).max() < 2e-2


def test_jax_varlen_grad_on_gpu():
    """jax.jit(jax.grad) of flashattn.jax.flash_attn_varlen_func on the GPU (bf16, GQA, causal, packed sequences of
    different lengths) against the same gradient on the CPU."""
    jax, jnp, fj, gpus = jax_on_gpu()
    rng = np.random.default_rng(17)
    lengths_q, lengths_k = [100, 1, 0, 257, 64], [100, 300, 5, 257, 30]
    hq, hk, d = 8, 2, 128
    cu_q = np.array([0] + list(np.cumsum(lengths_q)), dtype=np.int32)
    cu_k = np.array([0] + list(np.cumsum(lengths_k)), dtype=np.int32)
    bf16 = lambda shape: np.asarray(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16))  # noqa: E731
    q, k, v = bf16((sum(lengths_q), hq, d)), bf16((sum(lengths_k), hk, d)), bf16((sum(lengths_k), hk, d))
    dout = bf16((sum(lengths_q), hq, d))

    def grads_on(device):
        put = lambda x: jax.device_put(x, device)  # noqa: E731

        def loss(q, k, v, cq, ck, w):
            out = fj.flash_attn_varlen_func(q, k, v, cq, ck, max(lengths_q), max(lengths_k), causal=True)
            return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32))

        g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(put(q), put(k), put(v), put(cu_q), put(cu_k), put(dout))
        return [np.asarray(x.astype(jnp.float32), np.float64) for x in g]

    for name, gpu, cpu in zip(("dq", "dk", "dv"), grads_on(gpus[0]), grads_on(jax.devices("cpu")[0])):
        assert np.isfinite(gpu).all(), name
        assert rel_l2(gpu, cpu) < 2e-2, name
