"""A float64 attention oracle in numpy for the Python tests, written from the semantics in
include/flashattn/flashattn.h (not from the library's code): naive, materialised scores, an
analytic backward, and the Philox4x32-10 dropout keep-mask of src/core/philox.hpp re-derived here
so that the tests check the library's mask bit for bit instead of trusting it.

Layouts are flash_attn's: q (B, Sq, Hq, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv).
"""

import numpy as np

# Philox4x32 round multipliers and Weyl key increments (Salmon et al., SC'11).
PHILOX_M0, PHILOX_M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10
U32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(c0, c1, c2, c3, key0, key1):
    """Vectorised Philox4x32-10 on uint64 arrays holding 32-bit values."""
    c = [np.asarray(x, dtype=np.uint64) & U32 for x in (c0, c1, c2, c3)]
    k0, k1 = int(key0) & 0xFFFFFFFF, int(key1) & 0xFFFFFFFF
    for _ in range(PHILOX_ROUNDS):
        p0 = PHILOX_M0 * c[0]  # < 2^64: exact in uint64
        p1 = PHILOX_M1 * c[2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & U32
        hi1, lo1 = p1 >> np.uint64(32), p1 & U32
        c = [hi1 ^ c[1] ^ np.uint64(k0), lo1, hi0 ^ c[3] ^ np.uint64(k1), lo0]
        k0 = (k0 + PHILOX_W0) & 0xFFFFFFFF
        k1 = (k1 + PHILOX_W1) & 0xFFFFFFFF
    return c


def dropout_keep(seed, offset, bh, sq, sk, p):
    """Keep mask (sq, sk) of head bh = b * Hq + h (the definition in src/core/philox.hpp)."""
    i = np.arange(sq, dtype=np.uint64)[:, None]
    j = np.arange(sk, dtype=np.uint64)[None, :]
    key0 = seed & 0xFFFFFFFF
    key1 = ((seed >> 32) ^ (offset >> 32)) & 0xFFFFFFFF
    counter1 = np.uint64(4) * (j >> np.uint64(5)) + ((j >> np.uint64(1)) & np.uint64(3))
    r = philox4x32_10(i + 0 * j, counter1 + 0 * i, np.full_like(i + j, bh), np.full_like(i + j, offset & 0xFFFFFFFF),
                      key0, key1)
    kk = np.uint64(2) * ((j >> np.uint64(3)) & np.uint64(3)) + (j & np.uint64(1))
    word = np.where(kk // 2 == 0, r[0], np.where(kk // 2 == 1, r[1], np.where(kk // 2 == 2, r[2], r[3])))
    u16 = (word >> (np.uint64(16) * (kk & np.uint64(1)))) & np.uint64(0xFFFF)
    threshold = int(np.float32(p) * np.float32(65536.0) + np.float32(0.5))
    return u16 >= np.uint64(threshold)


def visible(sq, sk, window_left=-1, window_right=-1):
    """Mask (sq, sk): key j visible to query i, aligned to the bottom-right corner."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    diag = i + sk - sq
    ok = np.ones((sq, sk), dtype=bool)
    if window_left >= 0:
        ok &= j >= diag - window_left
    if window_right >= 0:
        ok &= j <= diag + window_right
    return ok


class Head:
    """One (b, h) problem in float64, forward and backward."""

    def __init__(self, q, k, v, scale, window_left, window_right, softcap, slope, keep_scale):
        self.q, self.k, self.v = q, k, v
        sq, sk = q.shape[0], k.shape[0]
        self.scale, self.softcap = scale, softcap
        raw = scale * (q @ k.T)
        if softcap > 0:
            self.t = np.tanh(raw / softcap)
            s = softcap * self.t
        else:
            self.t = None
            s = raw
        i = np.arange(sq)[:, None]
        j = np.arange(sk)[None, :]
        s = s - slope * np.abs(i + sk - sq - j)
        mask = visible(sq, sk, window_left, window_right)
        s = np.where(mask, s, -np.inf)
        row_max = s.max(axis=1, keepdims=True) if sk > 0 else np.full((sq, 1), -np.inf)
        empty = ~np.isfinite(row_max)
        e = np.where(mask, np.exp(s - np.where(empty, 0.0, row_max)), 0.0)
        total = e.sum(axis=1, keepdims=True)
        self.p = np.where(empty, 0.0, e / np.where(empty, 1.0, total))
        self.lse = np.where(empty[:, 0], -np.inf, (row_max + np.log(np.where(empty, 1.0, total)))[:, 0])
        self.z = keep_scale  # (sq, sk) dropout multipliers (ones without dropout)
        self.out = (self.p * self.z) @ v

    def backward(self, dout):
        dv = (self.p * self.z).T @ dout
        dp = (dout @ self.v.T) * self.z
        d = (self.p * dp).sum(axis=1, keepdims=True)
        ds = self.p * (dp - d)
        if self.t is not None:
            ds = ds * (1 - self.t**2)
        dq = self.scale * ds @ self.k
        dk = self.scale * ds.T @ self.q
        return dq, dk, dv


def attention(q, k, v, *, softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None,
              dropout_p=0.0, seed=0, offset=0, dout=None, head_index_base=None):
    """Dense attention in float64. Returns out (B, Sq, Hq, Dv), lse (B, Hq, Sq) and, with dout,
    (dq, dk, dv). head_index_base(b) gives the b of the Philox counter (default: b)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b_, sq, hq, d = q.shape
    sk, hk, dv_ = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
    wl, wr = window
    if causal:
        wr = 0
    out = np.zeros((b_, sq, hq, dv_))
    lse = np.zeros((b_, hq, sq))
    grads = None
    if dout is not None:
        dout = np.asarray(dout, dtype=np.float64)
        grads = (np.zeros_like(q), np.zeros_like(k), np.zeros_like(v))
    slopes = None if alibi_slopes is None else np.broadcast_to(np.asarray(alibi_slopes, np.float64), (b_, hq))
    group = hq // hk
    for b in range(b_):
        for h in range(hq):
            hk_ = h // group
            if dropout_p > 0:
                bh = (b if head_index_base is None else head_index_base(b)) * hq + h
                z = dropout_keep(seed, offset, bh, sq, sk, dropout_p) / (1.0 - dropout_p)
            else:
                z = np.ones((sq, sk))
            head = Head(q[b, :, h], k[b, :, hk_], v[b, :, hk_], scale, wl, wr, softcap,
                        0.0 if slopes is None else slopes[b, h], z)
            out[b, :, h] = head.out
            lse[b, h] = head.lse
            if grads is not None:
                dq, dk, dv = head.backward(dout[b, :, h])
                grads[0][b, :, h] += dq
                grads[1][b, :, hk_] += dk
                grads[2][b, :, hk_] += dv
    return (out, lse, grads) if grads is not None else (out, lse)


def rotary(x, cos, sin, positions, interleaved):
    """Rotary embedding of x (S, H, D) at positions (S,), cos/sin (S_rotary, rotary_dim / 2)."""
    x = np.array(x, dtype=np.float64)
    half = cos.shape[1]
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    if interleaved:
        a, b = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2] = a * c - b * s
        x[..., 1:2 * half:2] = a * s + b * c
    else:
        a, b = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half] = a * c - b * s
        x[..., half:2 * half] = a * s + b * c
    return x


def rel_l2(actual, expected):
    """||actual - expected|| / ||expected|| in float64 (finite parts must match exactly in position)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    denom = np.linalg.norm(expected.ravel())
    return np.linalg.norm((actual - expected).ravel()) / (denom if denom > 0 else 1.0)
