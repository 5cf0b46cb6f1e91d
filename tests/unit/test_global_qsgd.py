"""Global-QSGD (``global_qsgd``): levels, global norm, exact linear sums, the stochastic exponent
reduction and its schedules.

References here are written from the paper (Definition 3.1, Appendix B Algorithm 2) and from
the documented wire formats (docs/dev/formats.md, "Global-QSGD" and "The exponent reduction"),
not from the kernels. Statistical tolerances are 5 sigma from exact or empirical variances with
fixed seeds.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from horovod_quant import get_codec, mean_estimate, worker_seed
from horovod_quant.backends.numba.global_qsgd import WORD_BLOCK, exp_combine
from horovod_quant.backends.numba.packing import PACK_BLOCK, pack, packed_nbytes, unpack
from horovod_quant.backends.numba.rng import uniforms
from horovod_quant.core.exponent_reduction import (
    chunk_bounds,
    packed_range,
    reduction_rounds,
    round_key,
    schedule,
)
from horovod_quant.core.global_qsgd import GlobalQSGD
from horovod_quant.core.payload import Payload
from horovod_quant.core.rng import derive_key, split_key

M32 = 0xFFFFFFFF
Z = 5.0  # z-score tolerance


# --------------------------------------------------------------------------------------------
# independent references
# --------------------------------------------------------------------------------------------
def np_mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x21F0AAAD)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0xD35A2D97)
    return x ^ (x >> np.uint32(15))


def np_hash32(index, k0, k1) -> np.ndarray:
    """rng.py's element hash in NumPy: mix(mix(lo * 0x9E3779B9 + (k0 ^ hi * 0x85EBCA6B)) ^ k1)."""
    index = np.asarray(index, np.uint64)
    lo = (index & np.uint64(M32)).astype(np.uint32)
    hi = ((index >> np.uint64(32)) * np.uint64(0x85EBCA6B) & np.uint64(M32)).astype(np.uint32)
    x = np_mix(lo * np.uint32(0x9E3779B9) + (np.uint32(k0) ^ hi))
    return np_mix(x ^ np.uint32(k1))


def inv_mix(y: int) -> int:
    y ^= (y >> 15) ^ (y >> 30)
    y = y * pow(0xD35A2D97, -1, 1 << 32) & M32
    y ^= (y >> 15) ^ (y >> 30)
    y = y * pow(0x21F0AAAD, -1, 1 << 32) & M32
    return (y ^ (y >> 16)) & M32


def paper_reduce(ca: np.ndarray, cb: np.ndarray, h: np.ndarray, bits: int) -> np.ndarray:
    """Algorithm 2 as written: k = -floor(log2(2^-m + [p - 2^-m]_+)), p = h / 2^32, with m = 32
    (p has 32 digits here); sign12, leq, diff, non_zero as in Appendix B; zero is code 0."""
    smask, emask = 1 << (bits - 1), (1 << (bits - 1)) - 1
    ca, cb = ca.astype(np.int64), cb.astype(np.int64)
    e1, e2 = ca & emask, cb & emask
    sg1 = np.where(ca & smask, -1, 1)
    sg2 = np.where(cb & smask, -1, 1)
    p = h.astype(np.float64) / 2.0 ** 32
    m = 32
    k = -np.floor(np.log2(2.0 ** -m + np.maximum(p - 2.0 ** -m, 0.0)))
    nz1, nz2 = (e1 > 0).astype(np.int64), (e2 > 0).astype(np.int64)
    sign12 = sg1 * sg2 * nz1 * nz2
    leq = ((e1 <= e2).astype(np.int64) + (1 - nz2)) * nz1
    diff = np.abs(e1 - e2) - (1 - sign12) // 2
    non_zero = 1 - ((e1 == e2) & (sign12 == -1)).astype(np.int64)
    sign = sg1 * leq + sg2 * (1 - leq)
    e = (e1 * leq + e2 * (1 - leq) - sign12 * (k > diff)) * non_zero
    return (e | np.where((sign < 0) & (e != 0), smask, 0)).astype(np.uint8)


def unpack_words(words: np.ndarray, d: int, bits: int) -> np.ndarray:
    """Fields of the linear layout: blocks of WORD_BLOCK words, word j of a block of m elements
    holds elements j + f L (L = ceil(m / F)) in field f at bit f * bits."""
    words = np.asarray(words).view(np.uint64)
    per = 64 // bits
    out = np.zeros(d, np.int64)
    for w0 in range(0, words.size, WORD_BLOCK):
        e0 = w0 * per
        m = min(WORD_BLOCK * per, d - e0)
        L = -(-m // per)
        for f in range(per):
            for j in range(L):
                i = j + f * L
                if i < m:
                    out[e0 + i] = int(words[w0 + j]) >> (f * bits) & ((1 << bits) - 1)
    return out


def codes_of(codec: GlobalQSGD, payload: Payload) -> np.ndarray:
    return unpack(payload.data, payload.size, codec.bits).astype(np.int64)


def linear_moments(x: np.ndarray, norm: float, s: int) -> tuple[np.ndarray, np.ndarray]:
    """(p of rounding up, variance) per element of linear levels j/s scaled by norm."""
    t = np.abs(x.astype(np.float64)) / norm * s
    frac = t - np.floor(t)
    return frac, frac * (1 - frac) * (norm / s) ** 2


def exp_moments(x: np.ndarray, norm: float, s: int) -> tuple[np.ndarray, np.ndarray]:
    """(p of rounding up, variance) per element of levels {0} U {2^-j, j < s} scaled by norm."""
    r = np.minimum(np.abs(x.astype(np.float64)) / norm, 1.0)
    low = 2.0 ** (1 - s)
    with np.errstate(divide="ignore"):
        lo = np.where(r >= low, 2.0 ** np.floor(np.log2(np.where(r > 0, r, 1.0))), 0.0)
    hi = np.where(r >= low, 2 * lo, low)
    p = np.where(hi > lo, (r - lo) / (hi - lo), 0.0)
    return p, (r - lo) * (hi - r) * norm * norm


def z_scores(samples: np.ndarray, target: np.ndarray, var: np.ndarray | None = None) -> dict:
    """z of the projections on target and sign(target) and the per-coordinate max |z| for the
    mean of the T rows of ``samples`` (variances exact when given, else empirical)."""
    T = samples.shape[0]
    dev = samples.mean(axis=0) - target
    if var is None:
        var = samples.var(axis=0, ddof=1)
    rnd = var > 0
    out = {"max_fixed_dev": float(np.max(np.abs(dev[~rnd]), initial=0.0))}
    w = target[rnd]
    out["z_proj"] = float(np.sum(w * dev[rnd]) / math.sqrt(np.sum(w * w * var[rnd]) / T))
    out["z_sign"] = float(np.sum(np.sign(w) * dev[rnd]) / math.sqrt(np.sum(var[rnd]) / T))
    out["z_max"] = float(np.max(np.abs(dev[rnd]) / np.sqrt(var[rnd] / T)))
    return out


def test_numpy_hash_matches_rng():
    """The NumPy hash used below agrees with rng.uniforms (so it pins the documented hash)."""
    key = derive_key(7, 1, 2)
    k0, k1 = split_key(key)
    idx = np.arange(100, dtype=np.uint64) + np.uint64((1 << 32) - 50)
    want = (np_hash32(idx, k0, k1) >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24)
    assert np.array_equal(uniforms(100, key, start=(1 << 32) - 50), want)


# --------------------------------------------------------------------------------------------
# exponent combination kernel (Algorithm 2 on packed bytes)
# --------------------------------------------------------------------------------------------
def random_valid_pairs(rng, n: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Code pairs whose combination stays in range (no exponent 0 or above the field)."""
    smask, emax = 1 << (bits - 1), (1 << (bits - 1)) - 1
    if bits == 2:  # exponent 1 only: a zero operand or a cancellation
        a = rng.integers(0, 2, n) * (1 | smask * rng.integers(0, 2, n))
        partner = np.where(rng.random(n) < 0.5, 0, a ^ smask)
        b = np.where(a == 0, 1 | smask * rng.integers(0, 2, n), partner)
        return a.astype(np.uint8), b.astype(np.uint8)

    def draw():
        e = rng.integers(2, emax, n) if emax > 2 else np.full(n, 2)
        e = np.where(rng.random(n) < 0.2, 0, e)
        return (e | np.where((e > 0) & (rng.random(n) < 0.5), smask, 0)).astype(np.uint8)

    a, b = draw(), draw()
    near = rng.random(n) < 0.3  # many small differences, equal exponents, cancellations
    b = np.where(near & (a != 0), a ^ (smask * rng.integers(0, 2, n)).astype(np.uint8), b)
    return a, b


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("size,first", [(1, 0), (7, 0), (PACK_BLOCK + 1, 0),
                                        (2 * PACK_BLOCK + 13, 3 * PACK_BLOCK)])
def test_exp_combine_matches_algorithm_2(bits, size, first):
    rng = np.random.default_rng(bits * 1000 + size)
    ca, cb = random_valid_pairs(rng, size, bits)
    a, b = pack(ca, bits), pack(cb, bits)
    k0, k1 = round_key(11, 2, 3)
    h = np_hash32(np.arange(first, first + size), k0, k1)
    want = paper_reduce(ca, cb, h, bits)
    out = np.empty_like(a)
    assert exp_combine(a, b, out, size, first, bits, k0, k1) == a.size
    assert np.array_equal(unpack(out, size, bits), want)
    exp_combine(a, b, a, size, first, bits, k0, k1)  # in place
    assert np.array_equal(a, out)


def test_exp_combine_rejects_unaligned_ranges():
    a = pack(np.zeros(10, np.uint8), 8)
    with pytest.raises(ValueError, match="multiple of PACK_BLOCK"):
        exp_combine(a, a, a.copy(), 10, 5, 8, np.uint32(1), np.uint32(2))
    with pytest.raises(ValueError, match="split the packed bytes"):
        packed_range(0, 100, 200, 8)
    with pytest.raises(ValueError, match="split the packed bytes"):
        packed_range(5, 200, 200, 8)


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_exp_combine_chunking_is_invisible(bits):
    """Block-aligned chunks combined separately (as the schedules do) give the same bytes."""
    size = 3 * PACK_BLOCK + 5
    rng = np.random.default_rng(bits)
    ca, cb = random_valid_pairs(rng, size, bits)
    a, b = pack(ca, bits), pack(cb, bits)
    k0, k1 = round_key(3, 1, 0)
    whole = np.empty_like(a)
    exp_combine(a, b, whole, size, 0, bits, k0, k1)
    parts = np.empty_like(a)
    for i0, i1 in [(0, PACK_BLOCK), (PACK_BLOCK, 3 * PACK_BLOCK), (3 * PACK_BLOCK, size)]:
        lo, hi = packed_range(i0, i1, size, bits)
        exp_combine(a[lo:hi], b[lo:hi], parts[lo:hi], i1 - i0, i0, bits, k0, k1)
    assert np.array_equal(parts, whole)


# (e1, e2 as signed exponents, first digit word beyond h) cases where p's first 32 digits are 0
RARE_CASES = [
    (5, 38, "up"),      # diff 33: up iff p's digit 33 is 0
    (5, -39, "up"),     # opposite signs, |e1 - e2| = 34: diff 33
    (5, 39, "up"),      # diff 34
    (20, 90, "up"),     # diff 70: needs digit words 1 and 2
    (5, 0, "never"),    # a zero operand never rounds
    (5, 5, "always"),   # equal exponents add exactly
]


@pytest.mark.parametrize("e1,e2,kind", RARE_CASES)
def test_exp_combine_beyond_32_digits(e1, e2, kind):
    """Elements whose first 32 digits of p are zero (constructed by inverting the hash) follow
    the documented digit words t = 1, 2: hash32(i, k0 ^ t*0x632BE5AB, k1 ^ t*0x85157AF5)."""
    bits, smask = 8, 128

    def code(e):
        return 0 if e == 0 else (abs(e) | (smask if e < 0 else 0))

    ups = 0
    trials = 300
    for seed in range(trials):
        k0, k1 = round_key(seed, 0, 0)
        lo = (inv_mix(int(k1)) - int(k0)) * pow(0x9E3779B9, -1, 1 << 32) & M32
        assert np_hash32([lo], k0, k1)[0] == 0
        start, off = lo - lo % PACK_BLOCK, lo % PACK_BLOCK
        ca, cb = np.zeros(PACK_BLOCK, np.uint8), np.zeros(PACK_BLOCK, np.uint8)
        ca[off], cb[off] = code(e1), code(e2)
        out = np.empty(PACK_BLOCK, np.uint8)
        exp_combine(ca, cb, out, PACK_BLOCK, start, bits, k0, k1)
        assert not np.any(np.delete(out, off))
        diff = abs(abs(e1) - abs(e2)) - (1 if e1 * e2 < 0 else 0)
        up = kind == "always"
        if kind == "up":
            left, t = diff - 32, 1
            up = True
            while left > 0:
                g = int(np_hash32([lo], int(k0) ^ (t * 0x632BE5AB & M32),
                                  int(k1) ^ (t * 0x85157AF5 & M32))[0])
                if left < 32:
                    up = g >> (32 - left) == 0
                    break
                if g:
                    up = False
                    break
                left, t = left - 32, t + 1
        step = (1 if e1 * e2 < 0 else -1) if up and e2 else 0
        assert out[off] == code(e1 + step), (seed, out[off])
        ups += up
    if kind == "up" and diff < 40:
        p = 2.0 ** -(diff - 32)
        assert abs(ups - trials * p) <= Z * math.sqrt(trials * p * (1 - p))


# --------------------------------------------------------------------------------------------
# schedules and keys
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["tree", "ring"])
@pytest.mark.parametrize("n", range(1, 10))
def test_schedule_structure(n, reduction):
    """Every block ends fully reduced at exactly one owner after R roundings at most (R for some
    element); combinations of a round write data no other combination of it reads or writes."""
    nb = 11
    rounds, owners = schedule(n, nb, reduction)
    workers = [[{r} for _ in range(nb)] for r in range(n)]
    depth = [[0] * nb for _ in range(n)]
    for step in rounds:
        assert len({c.rank for c in step}) == len(step)  # one key group per rank and round
        written = {(c.rank, b) for c in step for b in range(c.b0, c.b1)}
        read = {(c.partner, b) for c in step for b in range(c.b0, c.b1)}
        assert not written & read
        for c in step:
            for b in range(c.b0, c.b1):
                assert not workers[c.rank][b] & workers[c.partner][b]
                workers[c.rank][b] = workers[c.rank][b] | workers[c.partner][b]
                depth[c.rank][b] = max(depth[c.rank][b], depth[c.partner][b]) + 1
    covered = sorted(b for g, b0, b1 in owners for b in range(b0, b1))
    assert covered == list(range(nb))
    final_depth = [depth[g][b] for g, b0, b1 in owners for b in range(b0, b1)]
    for g, b0, b1 in owners:
        assert all(workers[g][b] == set(range(n)) for b in range(b0, b1))
    rounds_per_element = math.ceil(math.log2(n)) if reduction == "tree" else n - 1
    assert max(final_depth) == reduction_rounds(n, reduction) == rounds_per_element


def message_passing_reduce(bufs: list[np.ndarray], size: int, bits: int, seed: int,
                           reduction: str) -> list[np.ndarray]:
    """The reduction as n ranks run it, written from docs/dev/formats.md ("The exponent reduction"):
    every message is a snapshot taken before the round's combinations; allgathers copy bytes."""
    n = len(bufs)
    bufs = [b.copy() for b in bufs]
    nb = -(-size // PACK_BLOCK)

    def rng_bytes(b0, b1):
        i0, i1 = min(b0 * PACK_BLOCK, size), min(b1 * PACK_BLOCK, size)
        lo, hi = packed_range(i0, i1, size, bits)
        return i0, i1, lo, hi

    def combine(g, data, b0, b1, rnd):
        i0, i1, lo, hi = rng_bytes(b0, b1)
        if i1 > i0:
            k0, k1 = split_key(derive_key(seed, rnd, g))
            exp_combine(bufs[g][lo:hi], data, bufs[g][lo:hi], i1 - i0, i0, bits, k0, k1)

    if reduction == "ring":
        base, extra = divmod(nb, n)
        chunks, lo_b = [], 0
        for c in range(n):
            chunks.append((lo_b, lo_b + base + (c < extra)))
            lo_b = chunks[-1][1]
        for t in range(n - 1):
            msgs = {}
            for g in range(n):
                b0, b1 = chunks[(g - t - 1) % n]
                _, _, lo, hi = rng_bytes(b0, b1)
                msgs[g] = bufs[(g - 1) % n][lo:hi].copy()
            for g in range(n):
                combine(g, msgs[g], *chunks[(g - t - 1) % n], t)
        for t in range(n - 1):  # ring allgather: g forwards chunk (g + 1 - t) to g + 1
            msgs = {}
            for g in range(n):
                _, _, lo, hi = rng_bytes(*chunks[(g + 1 - t) % n])
                msgs[(g + 1) % n] = (lo, hi, bufs[g][lo:hi].copy())
            for g, (lo, hi, data) in msgs.items():
                bufs[g][lo:hi] = data
        return bufs
    P = 1 << (n.bit_length() - 1)
    for r in range(P, n):  # round 0: fold
        combine(r - P, bufs[r].copy(), 0, nb, 0)
    ranges = [(0, nb)] * P
    t, mask = 1, P >> 1
    while mask:
        keep = []
        for g in range(P):
            b0, b1 = ranges[g]
            mid = b0 + (b1 - b0 + 1) // 2
            keep.append((b0, mid) if g & mask == 0 else (mid, b1))
        msgs = [bufs[g ^ mask][slice(*rng_bytes(*keep[g])[2:])].copy() for g in range(P)]
        for g in range(P):
            combine(g, msgs[g], *keep[g], t)
        ranges = keep
        t, mask = t + 1, mask >> 1
    owned = [[ranges[g]] for g in range(P)]
    mask = 1
    while mask < P:  # recursive doubling allgather
        msgs = [[(rng_bytes(*r)[2:], bufs[g ^ mask][slice(*rng_bytes(*r)[2:])].copy())
                 for r in owned[g ^ mask]] for g in range(P)]
        for g in range(P):
            for (lo, hi), data in msgs[g]:
                bufs[g][lo:hi] = data
        owned = [owned[g] + owned[g ^ mask] for g in range(P)]
        mask <<= 1
    for r in range(P, n):
        bufs[r] = bufs[r - P].copy()
    return bufs


@pytest.mark.parametrize("reduction", ["tree", "ring"])
@pytest.mark.parametrize("n,bits", [(2, 8), (3, 8), (5, 8), (6, 8), (8, 8), (3, 5), (4, 4)])
def test_reduce_matches_documented_message_passing(n, bits, reduction):
    """codec.reduce (used by mean_estimate) equals what n ranks computing the documented
    schedule with keys derive_key(seed, round, rank) end with, on every rank."""
    if reduction == "ring" and 2 * n - 1 > (1 << (bits - 1)) - 1:  # c + R with s = 1
        pytest.skip("world too large for a ring at this width")
    codec = GlobalQSGD(world_size=n, bits=bits, reduction=reduction)
    size = 5 * PACK_BLOCK + 77
    rng = np.random.default_rng(n)
    xs = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    norm = codec.global_norm(xs)
    payloads = [codec.encode(x, worker_seed(9, r), norm=norm) for r, x in enumerate(xs)]
    final = message_passing_reduce([p.data for p in payloads], size, bits, 9, reduction)
    reduced = codec.reduce(payloads, 9).data
    for buf in final:
        assert np.array_equal(buf, reduced)
    est, _ = mean_estimate(codec, xs, seed=9)
    assert np.array_equal(est, codec.decode_sum(Payload(reduced, size, {"norm": norm}), n))


def test_chunk_bounds_balanced():
    assert chunk_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert chunk_bounds(1, 3) == [(0, 1), (1, 1), (1, 1)]


# --------------------------------------------------------------------------------------------
# encoders against NumPy references
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,n", [(2, 1), (5, 3), (8, 2), (12, 7), (16, 5)])
def test_linear_encoder_matches_reference(bits, n):
    codec = GlobalQSGD(world_size=n, bits=bits, levels="linear")
    per = 64 // bits
    d = WORD_BLOCK * per + 3 * per + 1
    x = np.random.default_rng(bits).standard_normal(d).astype(np.float32) * 3
    norm = np.float32(np.max(np.abs(x)) * 1.5)  # a global norm above this worker's max
    p = codec.encode(x, seed=4, norm=norm)
    s = codec.s
    u = uniforms(d, derive_key(4))
    mult = np.float32(s) / norm
    t = np.minimum(np.abs(x) * mult, np.float32(s))
    lvl = np.floor(t)
    mag = (lvl + (u < (t - lvl))).astype(np.int64)
    want = np.where(x < 0, -mag, mag) + s
    assert p.data.dtype == np.uint64 and p.nbytes == 8 * -(-d // per)
    assert np.array_equal(unpack_words(p.data, d, bits), want)
    scale = np.float32(np.float64(norm) / s)
    assert np.array_equal(codec.decode(p), (want - s).astype(np.float32) * scale)


@pytest.mark.parametrize("bits,n,reduction", [(3, 1, "tree"), (4, 2, "tree"), (8, 4, "tree"),
                                              (8, 5, "ring")])
def test_exponential_encoder_matches_reference(bits, n, reduction):
    codec = GlobalQSGD(world_size=n, bits=bits, reduction=reduction)
    s, c = codec.s, codec.c
    assert c == (n if reduction == "ring" else math.ceil(math.log2(2 * n)))
    d = PACK_BLOCK + 100
    rng = np.random.default_rng(bits)
    x = (rng.standard_normal(d) * np.exp2(rng.integers(-12, 1, d))).astype(np.float32)
    norm = np.float32(np.max(np.abs(x)) * 1.25)
    p = codec.encode(x, seed=6, norm=norm)
    u = uniforms(d, derive_key(6))
    r = np.minimum(np.abs(x) * (np.float32(1) / norm), np.float32(1))
    rb = r.view(np.int32)
    u23 = np.floor(u.astype(np.float64) * 2.0 ** 23).astype(np.int32)
    e_hi = 127 + c - (rb >> 23) - (u23 < (rb & 0x7FFFFF))
    e_lo = np.where(u < r * np.float32(2.0 ** (s - 1)), s - 1 + c, 0)
    e = np.where((rb >> 23) >= 128 - s, e_hi, e_lo)
    want = e | np.where((x < 0) & (e > 0), 1 << (bits - 1), 0)
    assert p.nbytes == packed_nbytes(d, bits)
    assert np.array_equal(codes_of(codec, p), want)
    assert e.max() <= c + s - 1 and (e[e > 0].min(initial=c) >= c)


# --------------------------------------------------------------------------------------------
# unbiasedness and variance
# --------------------------------------------------------------------------------------------
def spread_vector(d: int, seed: int) -> np.ndarray:
    """Magnitudes over many binades, exact levels, zeros and both signs."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(d) * np.exp2(rng.integers(-9, 1, d))
    x[:4] = [0.0, 1.0, -0.5, 0.25]
    return x.astype(np.float32)


@pytest.mark.parametrize("levels,bits,norm", [("linear", 4, "max"), ("linear", 8, "l2"),
                                              ("exponential", 4, "max"), ("exponential", 8, "l2")])
def test_worker_quantizer_unbiased_with_exact_variance(levels, bits, norm):
    """One worker's decode is unbiased (z-tests on exact two-point variances) and its mean
    squared error equals the exact variance (5 sigma, from the per-trial spread)."""
    codec = GlobalQSGD(world_size=1, bits=bits, levels=levels, norm=norm)
    x = spread_vector(64, bits)
    g = np.float32(codec.global_norm([x]) * np.float32(2))  # others hold the larger values
    T = 3000
    trials = np.stack([codec.decode(codec.encode(x, seed=t, norm=g)) for t in range(T)])
    moments = linear_moments if levels == "linear" else exp_moments
    _, var = moments(x, float(g), codec.s)
    z = z_scores(trials.astype(np.float64), x.astype(np.float64), var)
    assert z["max_fixed_dev"] == 0.0
    assert abs(z["z_proj"]) < Z and abs(z["z_sign"]) < Z and z["z_max"] < 6.0, z
    err = np.sum((trials - x) ** 2, axis=1, dtype=np.float64)
    assert abs(err.mean() - var.sum()) < Z * err.std(ddof=1) / math.sqrt(T)


@pytest.mark.parametrize("levels,reduction,n", [("linear", "tree", 3), ("exponential", "tree", 2),
                                                ("exponential", "tree", 3),
                                                ("exponential", "tree", 5),
                                                ("exponential", "ring", 3),
                                                ("exponential", "ring", 4)])
def test_mean_estimate_unbiased(levels, reduction, n):
    """E[mean_estimate] = mean of the workers' vectors, including every exponent rounding."""
    codec = GlobalQSGD(world_size=n, bits=8, levels=levels, reduction=reduction)
    xs = [spread_vector(48, 10 * n + r) for r in range(n)]
    mean = np.mean(np.stack(xs).astype(np.float64), axis=0)
    T = 1500
    trials = np.stack([mean_estimate(codec, xs, seed=t)[0] for t in range(T)]).astype(np.float64)
    z = z_scores(trials, mean)
    assert z["max_fixed_dev"] < 1e-6
    assert abs(z["z_proj"]) < Z and abs(z["z_sign"]) < Z and z["z_max"] < 6.0, z


@pytest.mark.parametrize("reduction,n", [("tree", 4), ("tree", 6), ("ring", 5)])
def test_exponent_reduce_unbiased(reduction, n):
    """The reduction alone (fixed payloads, fresh reduction seeds) keeps the exact sum of the
    decoded payloads in expectation."""
    codec = GlobalQSGD(world_size=n, bits=8, reduction=reduction)
    xs = [spread_vector(40, 7 * n + r) for r in range(n)]
    norm = codec.global_norm(xs)
    payloads = [codec.encode(x, worker_seed(1, r), norm=norm) for r, x in enumerate(xs)]
    exact = np.sum([codec.decode(p).astype(np.float64) for p in payloads], axis=0) / n
    T = 3000
    trials = np.stack([codec.decode_sum(codec.reduce(payloads, seed=t), n) for t in range(T)])
    z = z_scores(trials.astype(np.float64), exact)
    assert z["max_fixed_dev"] < 1e-6
    assert abs(z["z_proj"]) < Z and abs(z["z_sign"]) < Z and z["z_max"] < 6.0, z


def paper_theta(levels: str, n: int, d: int, s: int) -> float:
    """Theorem 3.3 through Lemma 3.2 (theta = omega / n of the one-worker quantizer on the
    concatenated n*d vector), written from the papers for a norm between max|x| and ||x||_2:
    linear levels QSGD Lemma 3.1's min(nd / s^2, sqrt(nd) / s) / n (Theorem 3.3's
    sqrt(d) / (sqrt(n) s) when s <= sqrt(nd)); exponential levels Theorem 3.3's second bound
    1 / (8n) + sqrt(d) / (sqrt(n) 2^(s-1)) (printed under Global-L; its form is natural
    dithering's, for levels 2^-j)."""
    if levels == "linear":
        return min(n * d / s ** 2, math.sqrt(n * d) / s) / n
    return 1 / (8 * n) + math.sqrt(d) / (math.sqrt(n) * 2.0 ** (s - 1))


def reduced_theta(n: int, d: int, s: int, reduction: str) -> float:
    """paper_theta of exponential levels after the exponent reduction (docs/formats.md,
    "Global-QSGD"): rounding the sum of independent unbiased partial sums A, B to a power of
    two adds at most E(A + B)^2 / 8 (natural-compression Theorem 1), so
    MSE_AB <= 9/8 (MSE_A + MSE_B) + ||x_A + x_B||^2 / 8. Over R roundings, the k-th summing
    at most g_k workers (tree: R = ceil(log2 n), g_k = min(2^k, n); ring: R = n - 1,
    g_k = k + 1): (9/8)^R paper_theta + sum_k (9/8)^(R-k) g_k / (8n)."""
    rounds = math.ceil(math.log2(n)) if reduction == "tree" else n - 1
    sizes = [min(2 ** k, n) if reduction == "tree" else k + 1 for k in range(1, rounds + 1)]
    return ((9 / 8) ** rounds * paper_theta("exponential", n, d, s)
            + sum((9 / 8) ** (rounds - k) * g for k, g in enumerate(sizes, start=1)) / (8 * n))


def cnat_worst_vectors(n: int, d: int) -> list[np.ndarray]:
    """Workers whose every element but the first (1, setting the max norm) is (4/3) 2^-j of
    it: C_nat's worst case, relative variance exactly 1/8 per element (natural-compression
    Theorem 1 is tight), so Theorem 3.3's exponential bound is nearly attained."""
    k = np.arange(d)
    xs = []
    for r in range(n):
        x = (4 / 3) * np.ldexp(1.0, -1 - ((k + r) % 20)) * (-1.0) ** (k + r)
        x[0] = 1.0
        xs.append(x.astype(np.float32))
    return xs


@pytest.mark.parametrize("levels", ["linear", "exponential"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_normalized_variance_within_theta(levels, n):
    """E||est - mean||^2 / ((1/n) sum ||x_i||^2) within the bound computed here from the
    papers (Theorem 3.3, and for exponential levels the reduction term), which theta(d) must
    not exceed; for linear levels it equals the exact Lemma 3.2 variance."""
    codec = GlobalQSGD(world_size=n, bits=8, levels=levels)
    d, T = 2048, 40
    rng = np.random.default_rng(n)
    xs = [rng.standard_normal(d).astype(np.float32) for _ in range(n)]
    mean = np.mean(np.stack(xs).astype(np.float64), axis=0)
    denom = np.mean([np.sum(x.astype(np.float64) ** 2) for x in xs])
    errs = np.array([np.sum((mean_estimate(codec, xs, seed=t)[0] - mean) ** 2) / denom
                     for t in range(T)])
    se = errs.std(ddof=1) / math.sqrt(T)
    if levels == "linear":
        bound = paper_theta(levels, n, d, codec.s)
    else:
        bound = reduced_theta(n, d, codec.s, "tree")
    assert codec.theta(d) <= bound * (1 + 1e-12), (codec.theta(d), bound)
    assert errs.mean() > 0
    assert errs.mean() - Z * se <= bound, (errs.mean(), bound)
    if levels == "linear":
        g = float(codec.global_norm(xs))
        exact = sum(linear_moments(x, g, codec.s)[1].sum() for x in xs) / n ** 2 / denom
        assert abs(errs.mean() - exact) < Z * se


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n", [1, 2, 4, 5])
def test_exponential_quantization_within_theorem33(n, bits):
    """Before the reduction (payloads decoded and summed exactly), exponential levels stay
    within Theorem 3.3's 1/(8n) + sqrt(d)/(sqrt(n) 2^(s-1)), and C_nat's worst case comes
    within 10% of it."""
    codec = GlobalQSGD(world_size=n, bits=bits, levels="exponential")
    d, T = 2048, 30
    xs = cnat_worst_vectors(n, d)
    mean = np.mean(np.stack(xs).astype(np.float64), axis=0)
    denom = np.mean([np.sum(x.astype(np.float64) ** 2) for x in xs])
    norm = codec.global_norm(xs)
    errs = []
    for t in range(T):
        est = sum(codec.decode(codec.encode(x, worker_seed(t, r), norm=norm)).astype(np.float64)
                  for r, x in enumerate(xs)) / n
        errs.append(np.sum((est - mean) ** 2) / denom)
    errs = np.array(errs)
    se = errs.std(ddof=1) / math.sqrt(T)
    bound = paper_theta("exponential", n, d, codec.s)
    assert errs.mean() - Z * se <= bound, (errs.mean(), bound)
    if math.sqrt(n * d) * 2.0 ** (1 - codec.s) < 0.01:  # the 1/(8n) term dominates
        assert errs.mean() + Z * se >= 0.9 * bound, (errs.mean(), bound)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_linear_lemma31_nearly_attained(n):
    """One level (s = 1) and the L2 norm on equal constant vectors: every y = 1/sqrt(nd)
    rounds to 0 or 1, exact variance (sqrt(nd) - 1) / n, within 2% of Lemma 3.1's
    sqrt(nd) / (n s) (Theorem 3.3's sqrt(d) / (sqrt(n) s)); measured, not only computed."""
    d, T = 1024, 30
    codec = GlobalQSGD(world_size=n, bits=8, levels="linear", num_levels=1, norm="l2")
    xs = [np.full(d, 0.5, np.float32) for _ in range(n)]
    denom = float(np.sum(xs[0].astype(np.float64) ** 2))
    errs = np.array([np.sum((mean_estimate(codec, xs, seed=t)[0] - 0.5) ** 2) / denom
                     for t in range(T)])
    se = errs.std(ddof=1) / math.sqrt(T)
    bound = paper_theta("linear", n, d, 1)
    exact = (math.sqrt(n * d) - 1) / n
    assert abs(errs.mean() - exact) < Z * se, (errs.mean(), exact)
    assert 0.95 * bound < exact <= bound
    assert codec.theta(d) <= bound


def test_reduction_variance_exceeds_paper_factor_but_not_theta():
    """Workers at 1 and 1/2 quantize exactly; their sum 3/8 (after the 2^-c scaling) rounds to
    1/4 or 1/2 with probability 1/2: normalized variance 0.1, above (9/8) omega / n (the
    paper's factor) and below the derived reduction bound."""
    codec = GlobalQSGD(world_size=2, bits=8)
    d = 4096
    xs = [np.ones(d, np.float32), np.full(d, 0.5, np.float32)]
    est, _ = mean_estimate(codec, xs, seed=3)
    assert set(np.unique(est)) <= {0.5, 1.0}
    frac = float(np.mean(est == 1.0))
    assert abs(frac - 0.5) < Z * math.sqrt(0.25 / d)
    normalized = float(np.sum((est - 0.75) ** 2) / np.mean([np.sum(x ** 2) for x in xs]))
    low = 2.0 ** (1 - codec.s)
    paper = (9 / 8) * (1 / 8 + min(2 * d * low * low / 4, math.sqrt(2 * d) * low)) / 2
    assert normalized > paper + 0.02
    assert normalized < reduced_theta(2, d, codec.s, "tree")


# --------------------------------------------------------------------------------------------
# linear sums: exact at the width's limit
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,n", [(2, 1), (3, 3), (4, 7), (5, 15), (8, 1), (8, 2), (8, 127),
                                    (13, 40), (16, 5), (16, 32767)])
def test_linear_sum_exact_at_width_limit(bits, n):
    """All n workers at the top level with both signs: the fields sum to 2ns and 0 exactly, also
    through an int64 (wrapping) allreduce, and decode to +-norm."""
    codec = GlobalQSGD(world_size=n, bits=bits, levels="linear")
    s = codec.s
    assert s == ((1 << bits) - 1) // (2 * n) and 2 * n * s <= (1 << bits) - 1
    per = 64 // bits
    d = WORD_BLOCK * per + per + 1
    x = np.where(np.arange(d) % 3 == 1, -2.0, 2.0).astype(np.float32)
    x[5] = 0
    payload = codec.encode(x, seed=1, norm=np.float32(2))
    total = payload.data.copy()
    wrapped = payload.data.view(np.int64).copy()
    for _ in range(n - 1):  # every worker sends the same words
        total += payload.data
        wrapped += payload.data.view(np.int64)
    fields = unpack_words(total, d, bits)
    want = np.where(x > 0, 2 * n * s, np.where(x < 0, 0, n * s))
    assert np.array_equal(fields, want)
    assert np.array_equal(wrapped.view(np.uint64), total)
    summed = codec.payload_from_wire(wrapped, d, norm=np.float32(2))
    est = codec.decode_sum(summed, n)
    assert np.allclose(est, x, rtol=2 ** -21, atol=0)
    assert est[5] == 0


# --------------------------------------------------------------------------------------------
# parameters
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("params,match", [
    ({}, "needs world_size"),
    ({"world_size": 0}, "world_size=0"),
    ({"world_size": -3}, "world_size=-3"),
    ({"world_size": 2.5}, "integer"),
    ({"world_size": True}, "integer"),
    ({"world_size": 2, "bits": 1}, "bits=1"),
    ({"world_size": 2, "bits": 9}, "bits=9"),
    ({"world_size": 2, "bits": 17, "levels": "linear"}, "bits=17"),
    ({"world_size": 2, "bits": 9, "mode": "sparse", "levels": "linear"}, "bits=9"),
    ({"world_size": 8, "bits": 4, "levels": "linear"}, r"bits >= 5.*world_size <= 7"),
    ({"world_size": 2, "bits": 8, "levels": "linear", "num_levels": 64},
     r"bits >= 9.*num_levels <= 63"),
    ({"world_size": 16, "bits": 4}, r"bits >= 5.*world_size <= 8"),
    ({"world_size": 4, "bits": 4, "num_levels": 4}, r"bits >= 5.*num_levels <= 3"),
    ({"world_size": 5, "bits": 4, "reduction": "ring"}, r"bits >= 5.*world_size <= 4"),
    ({"world_size": 2, "levels": "cubic"}, "levels='cubic'"),
    ({"world_size": 2, "norm": "l1"}, "norm='l1'"),
    ({"world_size": 2, "mode": "tiny"}, "mode='tiny'"),
    ({"world_size": 2, "reduction": "star"}, "reduction='star'"),
    ({"world_size": 2, "levels": "linear", "reduction": "ring"}, "exponential"),
    ({"world_size": 2, "mode": "sparse", "num_levels": 200}, "num_levels=200"),
])
def test_invalid_parameters(params, match):
    with pytest.raises(ValueError, match=match):
        get_codec("global_qsgd", **params)


def test_default_levels_fill_the_width():
    assert GlobalQSGD(world_size=4, bits=8, levels="linear").s == 31
    assert GlobalQSGD(world_size=4, bits=8).s == 127 - 3 - 2 + 1
    assert GlobalQSGD(world_size=4, bits=8, reduction="ring").s == 127 - 4 - 3 + 1
    assert GlobalQSGD(world_size=4, bits=4, mode="sparse").s == 7
    assert GlobalQSGD(world_size=1, bits=2).s == 1


def test_call_errors():
    codec = GlobalQSGD(world_size=2)
    x = np.ones(5, np.float32)
    with pytest.raises(ValueError, match="norm=-1"):
        codec.encode(x, norm=-1.0)
    with pytest.raises(ValueError, match="world_size=3"):
        mean_estimate(codec, [x, x, x], 0)
    with pytest.raises(ValueError, match="meta has no 'norm'"):
        codec.decode(Payload(codec.encode(x).data, 5))
    # sparse payloads are gathered: the codec has no way to decode a sum
    assert not hasattr(GlobalQSGD(world_size=2, mode="sparse"), "decode_sum")


# --------------------------------------------------------------------------------------------
# sizes, payload budget, special values
# --------------------------------------------------------------------------------------------
CONFIGS = [
    {"levels": "linear", "bits": 8},
    {"levels": "linear", "bits": 5},
    {"levels": "exponential", "bits": 8},
    {"levels": "exponential", "bits": 5, "reduction": "ring"},
    {"levels": "linear", "bits": 3, "mode": "sparse", "norm": "l2"},
    {"levels": "exponential", "bits": 4, "mode": "sparse"},
]
SIZES = [0, 1, 7, 8, 9, PACK_BLOCK - 1, PACK_BLOCK + 1, WORD_BLOCK * 12 + 1]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
@pytest.mark.parametrize("size", SIZES)
def test_sizes_and_payload_budget(cfg, size):
    n = 3
    codec = GlobalQSGD(world_size=n, **cfg)
    rng = np.random.default_rng(size)
    xs = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    norm = codec.global_norm(xs)
    p = codec.encode(xs[0], seed=2, norm=norm)
    assert p.size == size and p.data.dtype == codec.traits.wire_dtype and p.data.ndim == 1
    dec = codec.decode(p)
    assert dec.shape == (size,) and dec.dtype == np.float32
    if cfg.get("mode") == "sparse":
        nnz = int(np.count_nonzero(dec))
        assert p.nbytes == 4 + 4 * nnz + packed_nbytes(nnz, codec.bits)
        assert int(p.data[:4].view(np.uint32)[0]) == nnz
    elif cfg["levels"] == "linear":
        assert p.nbytes == 8 * math.ceil(size / (64 // codec.bits)) == codec.payload_nbytes(size)
    else:
        # packing.py: per block, one plane per binary digit of bits (8 alone), each rounded up
        widths = [8] if codec.bits == 8 else [w for w in (1, 2, 4) if codec.bits & w]
        blocks = [min(PACK_BLOCK, size - b) for b in range(0, size, PACK_BLOCK)]
        assert p.nbytes == sum(math.ceil(m * w / 8) for m in blocks for w in widths)
    est, _ = mean_estimate(codec, xs, seed=5)
    assert est.shape == (size,) and est.dtype == np.float32 and np.all(np.isfinite(est))
    if size:
        assert np.max(np.abs(est - np.mean(xs, axis=0))) <= 2 * float(norm)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_gives_non_finite_output(cfg, bad):
    codec = GlobalQSGD(world_size=2, **cfg)
    xs = [np.ones(100, np.float32), np.ones(100, np.float32)]
    xs[1][37] = bad
    assert not math.isfinite(codec.global_norm(xs))
    est, _ = mean_estimate(codec, xs, seed=0)
    assert not np.any(np.isfinite(est))
    assert not np.any(np.isfinite(codec.decode(codec.encode(xs[1]))))


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
def test_zeros_decode_to_zeros(cfg):
    codec = GlobalQSGD(world_size=3, **cfg)
    xs = [np.zeros(1000, np.float32) for _ in range(3)]
    est, _ = mean_estimate(codec, xs, seed=1)
    assert np.array_equal(est, np.zeros(1000, np.float32))
    x = spread_vector(1000, 1)
    x[::7] = 0
    assert np.all(codec.decode(codec.encode(x, seed=3))[::7] == 0)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
def test_subnormal_norm_rounds_like_a_normal_one(cfg):
    """A norm near the subnormal range (s / norm overflows float32) gives the same codes as the
    vector scaled up by 2^120: scaling by a power of two commutes with the rounding."""
    codec = GlobalQSGD(world_size=1, **cfg)
    x = spread_vector(300, 2)
    x[::5] = 0
    tiny = (x.astype(np.float64) * 2.0 ** -132).astype(np.float32)  # a subnormal norm
    big = (tiny.astype(np.float64) * 2.0 ** 120).astype(np.float32)
    p_tiny, p_big = codec.encode(tiny, seed=3), codec.encode(big, seed=3)
    assert np.array_equal(p_tiny.data, p_big.data)
    assert np.all(codec.decode(p_tiny)[::5] == 0)


# --------------------------------------------------------------------------------------------
# global norm and the registry path
# --------------------------------------------------------------------------------------------
def test_norm_statistics():
    x = np.array([3.0, -4.0, 0.5], np.float32)
    cmax = GlobalQSGD(world_size=2, norm="max")
    c2 = GlobalQSGD(world_size=2, norm="l2")
    assert cmax.combine_statistics([1.0, 3.0, 2.0]) == 3.0
    assert c2.combine_statistics([1.0, 3.0, 2.0]) == 6.0
    assert math.isnan(cmax.combine_statistics([1.0, math.nan])) and c2.combine_statistics([]) == 0
    assert cmax.norm_statistic(x) == 4.0 and c2.norm_statistic(x) == 25.25
    assert cmax.norm_from_statistic(4.0) == np.float32(4.0)
    root = c2.norm_from_statistic(2.0)
    assert root.dtype == np.float32 and float(root) >= math.sqrt(2.0)
    assert float(np.nextafter(root, np.float32(0))) < math.sqrt(2.0)
    y = np.array([1.0, np.nan], np.float32)
    assert math.isnan(cmax.global_norm([x, y])) and math.isnan(c2.global_norm([x, y]))
    assert c2.global_norm([x, 2 * x]) == c2.norm_from_statistic(25.25 * 5)


def test_encode_uses_the_given_global_norm():
    codec = GlobalQSGD(world_size=2, levels="linear")
    small, big = np.full(64, 0.01, np.float32), np.full(64, 10.0, np.float32)
    g = codec.global_norm([small, big])
    assert g == np.float32(10.0)
    p = codec.encode(small, seed=0, norm=g)
    assert p.meta["norm"] == g and codec.encode(small).meta["norm"] == np.float32(0.01)
    assert np.allclose(codec.decode(p).mean(), 0.01, atol=5 * 10.0 / codec.s / 8)


@pytest.mark.parametrize("levels", ["linear", "exponential"])
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_mean_estimate_through_registry(levels, mode):
    n = 4
    codec = get_codec("global_qsgd", world_size=n, levels=levels, mode=mode)
    assert codec.traits.combine == {"dense": "sum" if levels == "linear" else "custom",
                              "sparse": "gather"}[mode]
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(3000).astype(np.float32) for _ in range(n)]
    a, wa = mean_estimate(codec, xs, seed=1)
    b, _ = mean_estimate(codec, xs, seed=1)
    c, _ = mean_estimate(codec, xs, seed=2)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    mean = np.mean(xs, axis=0)
    err = np.sum((a - mean) ** 2) / np.mean([np.sum(x ** 2) for x in xs])
    if levels == "linear":
        bound = paper_theta("linear", n, 3000, codec.s)
    elif mode == "sparse":  # gathered payloads are summed exactly: no reduction rounding
        bound = paper_theta("exponential", n, 3000, codec.s)
    else:
        bound = reduced_theta(n, 3000, codec.s, "tree")
    assert err < bound, (err, bound)
    assert wa == max(codec.encode(x, worker_seed(1, r), norm=codec.global_norm(xs)).nbytes
                     for r, x in enumerate(xs))
    if mode == "dense":
        assert wa == codec.payload_nbytes(3000)
