"""Counter-based RNG (core/rng.py keys, backends/numba/rng.py hash): determinism, uniformity,
independence across keys."""
from __future__ import annotations

import math

import numba
import numpy as np
import pytest

from horovod_quant.backends.numba.rng import (
    block_key,
    hash32,
    hash32_at,
    hash32_lo,
    uniform24,
    uniforms,
)
from horovod_quant.core.rng import derive_key, split_key, splitmix64

N = 1 << 20
Z = 5.0


def _chi2_z(counts, expected):
    """(chi2 - dof) / sqrt(2 dof): about N(0, 1) for a correct generator."""
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    dof = counts.size - 1
    return (chi2 - dof) / math.sqrt(2 * dof)


def test_splitmix64_known_answer():
    # first output of SplitMix64 seeded with 0 (Steele, Lea and Flood 2014 reference code)
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert derive_key(0) == splitmix64(0)
    assert derive_key(5, 7) == splitmix64(splitmix64(5) ^ 7)


def test_derive_key_fields():
    keys = {derive_key(1, a, b) for a in range(30) for b in range(30)}
    assert len(keys) == 900
    assert derive_key(1, 2, 3) != derive_key(1, 3, 2)
    assert derive_key(1) != derive_key(1, 0)
    assert derive_key(-1) == derive_key(2**64 - 1)  # reduced modulo 2**64
    assert derive_key(3, -2) == derive_key(3, 2**64 - 2)
    assert all(0 <= k < 2**64 for k in keys)
    k0, k1 = split_key(0x0123456789ABCDEF)
    assert (int(k0), int(k1)) == (0x89ABCDEF, 0x01234567)


def test_determinism_and_offsets():
    key = derive_key(42)
    a = uniforms(1000, key)
    np.testing.assert_array_equal(a, uniforms(1000, key))
    np.testing.assert_array_equal(uniforms(600, key, start=400), a[400:])
    assert a.dtype == np.float32 and a.min() >= 0 and a.max() < 1
    # 24-bit grid: u * 2^24 is an integer
    assert np.all(np.floor(a.astype(np.float64) * 2**24) == a.astype(np.float64) * 2**24)
    # indices above 2^32 are distinct draws (the high word is folded into the key)
    hi = uniforms(1000, key, start=2**32)
    assert not np.array_equal(hi, a)
    np.testing.assert_array_equal(uniforms(10, key, start=2**32 + 5), hi[5:15])


@numba.njit
def _hash_ways(n, start, k0, k1):
    """Disagreements of hash32 vs hash32_lo, and of hash32_lo vs hash32_at, on n indices."""
    ab = 0
    bc = 0
    kb = block_key(start, k0)
    base = np.uint32(start & 0xFFFFFFFF)
    for j in range(n):
        a = hash32(np.uint64(start + j), k0, k1)
        b = hash32_lo(np.uint32((start + j) & 0xFFFFFFFF), kb, k1)
        c = hash32_at(base, j, kb, k1)
        ab += a != b
        bc += b != c
    return ab, bc


def test_hash_variants_agree():
    k0, k1 = split_key(derive_key(9))
    assert _hash_ways(5000, 0, k0, k1) == (0, 0)
    assert _hash_ways(5000, 3 * 2**32 + 17, k0, k1) == (0, 0)
    # block_key folds the high word once per block: valid while a block stays inside one
    # 2^32 window, which PACK_BLOCK-aligned blocks always do; the low-word add wraps alike
    assert _hash_ways(300, 2**32 - 100, k0, k1) == (200, 0)


def test_uniformity_chi_square():
    u = uniforms(N, derive_key(2024))
    counts = np.bincount((u * 1024).astype(np.int64), minlength=1024)
    assert abs(_chi2_z(counts, N / 1024)) < Z
    assert abs(float(u.mean()) - 0.5) < Z * math.sqrt(1 / 12 / N)
    assert abs(float(u.var()) - 1 / 12) < Z * math.sqrt(1 / 180 / N)


def test_every_bit_is_fair():
    u = uniforms(N, derive_key(77))
    h = (u.astype(np.float64) * 2**24).astype(np.uint32)
    for b in range(24):
        ones = int(np.sum((h >> b) & 1))
        assert abs(ones - N / 2) < Z * math.sqrt(N / 4), b


def test_serial_pairs_chi_square():
    """Consecutive elements of one stream: 2-D chi-square on 32 x 32 cells, and lag
    correlations, including lag 8192 (one packing block) and lag 512 (one bucket)."""
    u = uniforms(N, derive_key(11)).astype(np.float64)
    cells = (u[:-1:2] * 32).astype(np.int64) * 32 + (u[1::2] * 32).astype(np.int64)
    counts = np.bincount(cells, minlength=1024)
    assert abs(_chi2_z(counts, (N // 2) / 1024)) < Z
    c = u - 0.5
    for lag in (1, 2, 7, 8, 16, 512, 8192):
        r = float(np.mean(c[:-lag] * c[lag:])) * 12
        assert abs(r) < Z / math.sqrt(N - lag), lag


@pytest.mark.parametrize("pair", [("seed", (1,), (2,)), ("field", (1, 0), (1, 1)),
                                  ("rank", (7, 0x7A4B, 0), (7, 0x7A4B, 1)),
                                  ("round", (3, 5, 0), (3, 5, 1))])
def test_independence_across_keys(pair):
    """Streams of keys that differ in one field are uncorrelated and jointly uniform."""
    _, fa, fb = pair
    a = uniforms(N, derive_key(*fa)).astype(np.float64)
    b = uniforms(N, derive_key(*fb)).astype(np.float64)
    assert not np.array_equal(a, b)
    r = float(np.mean((a - 0.5) * (b - 0.5))) * 12
    assert abs(r) < Z / math.sqrt(N)
    cells = (a * 32).astype(np.int64) * 32 + (b * 32).astype(np.int64)
    assert abs(_chi2_z(np.bincount(cells, minlength=1024), N / 1024)) < Z
    # the same element under the two keys agrees only by chance (2^-24 per element)
    assert np.sum(a == b) < 10


def test_many_consecutive_seeds_per_element():
    """Across 2000 consecutive seeds, each element's draws are uniform: the variance of
    per-element means matches 1 / (12 T) (what unbiasedness tests over seeds rely on)."""
    T, n = 2000, 512
    U = np.stack([uniforms(n, derive_key(s)) for s in range(T)]).astype(np.float64)
    v = float(U.mean(axis=0).var(ddof=1)) * 12 * T
    assert abs(v - 1) < Z * math.sqrt(2 / (n - 1))
    counts = np.bincount((U[:, 0] * 16).astype(np.int64), minlength=16)
    assert abs(_chi2_z(counts, T / 16)) < Z


def test_uniform24_matches_uniforms():
    key = derive_key(3, 4)
    k0, k1 = split_key(key)
    np.testing.assert_array_equal(uniform24(100, k0, k1, 50), uniforms(100, key, 50))
