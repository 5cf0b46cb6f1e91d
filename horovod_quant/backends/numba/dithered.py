"""Numba kernels of DQSG / NDQSG (formats and arithmetic: docs/dev/formats.md, "Dithered codes";
mirrored in ``kernels/dithered.cu``).
"""
from __future__ import annotations

import numba
import numpy as np

from ..protocol import PACK_BLOCK
from .levels import NORM_MAX, _bucket_scale
from .packing import pack_block, unpack_block
from .rng import block_key, hash32_at, u24_float

_HALF = np.float32(0.5)


@numba.njit(inline="always")
def _fine_index(v, kap, am, rho):
    """``ceil((v / kap) am - rho)`` as int32: the dithered fine index of v (|result| <= M when
    am <= M). ``ceil(t - rho) = floor(t) + (rho < frac(t))``, in 32-bit lanes."""
    t = (v / kap) * am
    lvl = np.floor(t)
    return np.int32(np.int32(lvl) + np.int32(rho < t - lvl))


@numba.njit(inline="always")
def _nested_index(c, rho, yv, kap, am, kf, invk, cmf, h):
    """Fine index recovered from a nested code c (= m + h) and the side information yv.

    Returns ``(q_hat, resid)``: ``q_hat = m - k f`` with ``f = round((m - 1/2 + rho - alpha Y)
    / k)`` clamped to [-cmf, cmf], ``cmf = round(M / k)`` (the shifts real indices use; a NaN
    side information lands on a bound instead of an undefined integer), and
    ``resid = (r - Q2(r)) / Delta1`` in fine steps (|resid| <= k/2 unless clamped).
    """
    m = np.int32(np.int32(c) - h)
    a = ((np.float32(m) - _HALF) + rho) - (yv / kap) * am
    f = np.floor(a * invk + _HALF)
    f = f if f > -cmf else -cmf
    f = f if f < cmf else cmf
    return np.int32(m - np.int32(kf) * np.int32(f)), a - kf * f


@numba.njit(cache=True, nogil=True)
def encode_dithered(x, bucket, M, am, k, bits, k0, k1, out, o):
    """Encode float32 ``x`` into ``out[o:]`` = [float32 kappa per bucket][packed codes].

    ``k == 0``: DQSG codes ``q + M``; ``k >= 3``: nested codes ``(q + h) mod k`` (= m + h,
    h = (k-1)/2). ``q = ceil((x / kappa) am - rho)``; ``am = alpha M`` (M for DQSG). Zero and
    non-finite buckets get the neutral code (q = 0); their kappa alone defines the decode.
    Returns the end offset.
    """
    n = x.size
    nb = (n + bucket - 1) // bucket
    scales = out[o : o + 4 * nb].view(np.float32)
    codes = np.empty(PACK_BLOCK + 8, np.uint8)
    h = np.int32((k - 1) // 2) if k > 0 else np.int32(0)
    ki = np.int32(k)
    invk = np.float32(1.0 / k) if k > 0 else np.float32(0.0)
    neutral = np.uint8(M) if k == 0 else np.uint8(h)
    o += 4 * nb
    next_bucket = 0
    for b0 in range(0, n, PACK_BLOCK):
        b1 = min(b0 + PACK_BLOCK, n)
        while next_bucket < nb and next_bucket * bucket < b1:
            lo = next_bucket * bucket
            scales[next_bucket] = _bucket_scale(x, lo, min(lo + bucket, n), NORM_MAX, 0.0)
            next_bucket += 1
        kb = block_key(b0, k0)
        i = b0
        while i < b1:
            kk = i // bucket
            hi = min((kk + 1) * bucket, b1)
            kap = scales[kk]
            xs = x[i:hi]
            cs = codes[i - b0 : hi - b0]
            base = np.uint32(i & 0xFFFFFFFF)
            if not (kap > 0 and np.isfinite(kap)):
                cs[:] = neutral
            elif k == 0:
                for j in range(xs.size):
                    q = _fine_index(xs[j], kap, am, u24_float(hash32_at(base, j, kb, k1)))
                    cs[j] = np.uint8(q + M)
            else:
                for j in range(xs.size):
                    q = _fine_index(xs[j], kap, am, u24_float(hash32_at(base, j, kb, k1)))
                    a = np.int32(q + h)
                    # floor(a / k) exactly: a + 1/2 sits >= 1/(2k) away from a multiple of k
                    f = np.floor((np.float32(a) + _HALF) * invk)
                    cs[j] = np.uint8(a - ki * np.int32(f))
            i = hi
        o = pack_block(codes, b1 - b0, bits, out, o)
    return o


@numba.njit(cache=True, nogil=True)
def decode_dithered(data, o, n, bucket, M, bits, k0, k1, out, accumulate):
    """Decode DQSG codes at ``data[o:]`` into ``out`` (``+=`` if accumulate):
    ``x_hat = (kappa / M) ((code - M) - 1/2 + rho)``; zero buckets decode to zeros, non-finite
    kappa to non-finite values."""
    nb = (n + bucket - 1) // bucket
    scales = data[o : o + 4 * nb].view(np.float32)
    codes = np.empty(PACK_BLOCK + 8, np.uint8)
    fm = np.float32(M)
    o += 4 * nb
    for b0 in range(0, n, PACK_BLOCK):
        b1 = min(b0 + PACK_BLOCK, n)
        o = unpack_block(data, o, b1 - b0, bits, codes)
        kb = block_key(b0, k0)
        i = b0
        while i < b1:
            kk = i // bucket
            hi = min((kk + 1) * bucket, b1)
            step = scales[kk] / fm
            ob = out[i:hi]
            cb = codes[i - b0 : hi - b0]
            base = np.uint32(i & 0xFFFFFFFF)
            for j in range(ob.size):
                rho = u24_float(hash32_at(base, j, kb, k1))
                v = ((np.float32(np.int32(cb[j]) - M) - _HALF) + rho) * step
                ob[j] = ob[j] + v if accumulate else v
            i = hi
    return out


@numba.njit(cache=True, nogil=True)
def decode_nested(data, o, n, bucket, M, k, bits, am, alpha, y, k0, k1, out):
    """``out += x_hat`` of a P2 payload (codes at ``data[o:]``) with side information y.

    ``x_hat = alpha (kappa / M) (q_hat - 1/2 + rho) + (1 - alpha^2) y`` (docs/dev/formats.md); zero
    buckets add nothing, non-finite kappa adds NaN. Returns ``(sum resid^2, count)`` over the
    finite nonzero buckets, in fine steps (float64, 8 interleaved lanes in a fixed order, so
    every rank computes the same value).
    """
    nb = (n + bucket - 1) // bucket
    scales = data[o : o + 4 * nb].view(np.float32)
    codes = np.empty(PACK_BLOCK + 8, np.uint8)
    resid = np.empty(PACK_BLOCK, np.float32)
    lanes = np.zeros(8, np.float64)
    h = np.int32((k - 1) // 2)
    kf = np.float32(k)
    invk = np.float32(1.0 / k)
    # |round(q / k)| <= round(M / k) = (M + h) // k for |q| <= M (k odd)
    cmf = np.float32((M + h) // k)
    fm = np.float32(M)
    beta = np.float32(1.0) - alpha * alpha
    count = 0
    o += 4 * nb
    for b0 in range(0, n, PACK_BLOCK):
        b1 = min(b0 + PACK_BLOCK, n)
        o = unpack_block(data, o, b1 - b0, bits, codes)
        kb = block_key(b0, k0)
        i = b0
        while i < b1:
            kk = i // bucket
            hi = min((kk + 1) * bucket, b1)
            kap = scales[kk]
            ob = out[i:hi]
            if kap > 0 and np.isfinite(kap):
                step = kap / fm
                ys = y[i:hi]
                cb = codes[i - b0 : hi - b0]
                rs = resid[: hi - i]
                base = np.uint32(i & 0xFFFFFFFF)
                for j in range(ob.size):
                    rho = u24_float(hash32_at(base, j, kb, k1))
                    q, r = _nested_index(cb[j], rho, ys[j], kap, am, kf, invk, cmf, h)
                    rs[j] = r
                    ob[j] += (((np.float32(q) - _HALF) + rho) * step) * alpha + beta * ys[j]
                m8 = rs.size // 8 * 8
                for t in range(0, m8, 8):
                    for lane in range(8):
                        v = np.float64(rs[t + lane])
                        lanes[lane] += v * v
                for t in range(m8, rs.size):
                    v = np.float64(rs[t])
                    lanes[t - m8] += v * v
                count += rs.size
            elif kap != 0:
                for j in range(ob.size):
                    ob[j] += kap * np.float32(0.0)
            i = hi
    total = 0.0
    for lane in range(8):
        total += lanes[lane]
    return total, count


@numba.njit(cache=True, nogil=True)
def nested_outside(data, o, n, bucket, M, k, bits, am, y, k0, k1, fine):
    """Number of P2 elements (finite nonzero buckets) whose recovered fine index differs from
    the sender's ``fine`` (from :func:`fine_indices`): the exact outage count, for simulations
    that know the inputs."""
    nb = (n + bucket - 1) // bucket
    scales = data[o : o + 4 * nb].view(np.float32)
    codes = np.empty(PACK_BLOCK + 8, np.uint8)
    h = np.int32((k - 1) // 2)
    kf = np.float32(k)
    invk = np.float32(1.0 / k)
    cmf = np.float32((M + h) // k)
    wrong = 0
    o += 4 * nb
    for b0 in range(0, n, PACK_BLOCK):
        b1 = min(b0 + PACK_BLOCK, n)
        o = unpack_block(data, o, b1 - b0, bits, codes)
        kb = block_key(b0, k0)
        for i in range(b0, b1):
            kap = scales[i // bucket]
            if kap > 0 and np.isfinite(kap):
                rho = u24_float(hash32_at(np.uint32(b0 & 0xFFFFFFFF), i - b0, kb, k1))
                q, _ = _nested_index(codes[i - b0], rho, y[i], kap, am, kf, invk, cmf, h)
                wrong += q != fine[i]
    return wrong


@numba.njit(cache=True, nogil=True)
def fine_indices(x, bucket, am, k0, k1):
    """The sender's fine indices ``ceil((x / kappa) am - rho)`` (0 in zero/non-finite buckets):
    what a P2 receiver should recover. For statistics only (the encoder fuses this)."""
    n = x.size
    out = np.zeros(n, np.int32)
    for lo in range(0, n, bucket):
        hi = min(lo + bucket, n)
        kap = _bucket_scale(x, lo, hi, NORM_MAX, 0.0)
        if kap > 0 and np.isfinite(kap):
            for i in range(lo, hi):
                kb = block_key(i, k0)
                rho = u24_float(hash32_at(np.uint32(i & 0xFFFFFFFF), 0, kb, k1))
                out[i] = _fine_index(x[i], kap, am, rho)
    return out
