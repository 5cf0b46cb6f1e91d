"""Shared helpers for the unit tests: independent NumPy references of the level quantizers.

Everything here is written from the papers and from the wire format documented in
``docs/dev/architecture.md`` / ``horovod_quant/backends/numba/packing.py``, not from the
kernels, so that a wrong kernel disagrees with it. Tests reach the helpers through the
session fixture ``ref`` (``ref.levels(codec)``, ``ref.moments(codec, x, payload)``, ...);
importing this module by name would clash with other ``conftest.py`` files when several test
folders are collected together.

Statistical tolerances. A level quantizer rounds each r_i = |x_i| / scale to one of the two
levels l <= r_i <= u around it, up with probability p = (r - l) / (u - l). So the decode of
element i is a two-point variable whose every moment is known exactly:

* variance          var_i = (r - l)(u - r) * scale^2      (NUQSGD Lemma 1, summed over i)
* fourth moment     E e^4 = ((1 - p)(r - l)^4 + p (u - r)^4) * scale^4,   e = Q_i - x_i

from which tests derive z-scores for T independent trials instead of guessing tolerances.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from horovod_quant.backends.numba.packing import PACK_BLOCK, unpack
from horovod_quant.backends.numba.rng import uniforms
from horovod_quant.core.rng import derive_key

FLT_MIN = 2.0 ** -126  # smallest normal float32


# --------------------------------------------------------------------------------------------
# level grids and scales, from the papers
# --------------------------------------------------------------------------------------------
def level_count(codec) -> int:
    """Number of nonzero levels of a level quantizer, from its public parameters."""
    name, prm = codec.name, codec.params
    if name in ("qsgd", "standard_dithering", "natural_dithering"):
        return int(prm["levels"])
    if name == "nuqsgd":
        return int(prm["levels"]) + 1  # s internal levels plus the level 1
    if name == "natural":
        return (1 << (int(prm["bits"]) - 1)) - 1
    raise KeyError(name)


def levels(codec) -> np.ndarray:
    """Sorted level grid in [0, 1] (float64): uniform j/s or binary-geometric."""
    s = level_count(codec)
    if codec.name in ("qsgd", "standard_dithering"):
        return np.arange(s + 1, dtype=np.float64) / s
    # NUQSGD: 0, 2^-s, ..., 1/2, 1 (s internal); natural dithering / C_nat: 0, 2^(1-s), ..., 1
    return np.concatenate([[0.0], np.ldexp(1.0, np.arange(1 - s, 1))])


def norm_kind(codec):
    """'l2', 'max', a float p, or 'pow2' (C_nat's smallest power of two >= max|x|)."""
    name, prm = codec.name, codec.params
    if name == "qsgd":
        return "l2" if prm["norm"] == "l2" else "max"
    if name == "nuqsgd":
        return "l2"
    if name == "natural":
        return "pow2"
    p = float(prm["p"])
    return "l2" if p == 2 else ("max" if math.isinf(p) else p)


def bucket_len(codec, n: int) -> int:
    b = codec.params.get("bucket_size")
    return max(n, 1) if b is None else int(b)


def n_buckets(codec, n: int) -> int:
    b = bucket_len(codec, n)
    return (n + b - 1) // b


def buckets(codec, n: int):
    """(lo, hi) of every bucket."""
    b = bucket_len(codec, n)
    return [(lo, min(lo + b, n)) for lo in range(0, n, b)]


def ref_scale(kind, xb: np.ndarray) -> float:
    """Scale of one bucket in float64 (inf/nan for non-finite input)."""
    a = np.abs(xb.astype(np.float64))
    if a.size == 0:
        return 0.0
    if kind == "l2":
        return float(np.sqrt(np.sum(a * a)))
    if kind == "max":
        return float(np.max(a)) if np.all(np.isfinite(a)) else float("nan")
    if kind == "pow2":
        m = float(np.max(a)) if np.all(np.isfinite(a)) else float("nan")
        if not (m > 0) or not math.isfinite(m):
            return m
        return max(2.0 ** math.ceil(math.log2(m)), FLT_MIN)
    return float(np.sum(a ** kind) ** (1.0 / kind))


def ref_scales(codec, x: np.ndarray) -> np.ndarray:
    kind = norm_kind(codec)
    return np.array([ref_scale(kind, x[lo:hi]) for lo, hi in buckets(codec, x.size)])


def l2_scale_exact(xb: np.ndarray) -> np.float32:
    """The documented summation order of the L2 scale: 8 float64 lanes (element i of the bucket
    feeds lane i % 8, each summed left to right), lanes added in order, sqrt, rounded to float32.
    The GPU kernel reproduces this order, so it is part of the wire format."""
    sq = xb.astype(np.float64) ** 2
    acc = 0.0
    for j in range(8):
        lane = sq[j::8]
        acc += float(np.cumsum(lane)[-1]) if lane.size else 0.0
    return np.float32(np.sqrt(acc))


def payload_scales(codec, payload) -> np.ndarray:
    nb = n_buckets(codec, payload.size)
    return payload.data[: 4 * nb].view(np.float32)


def payload_codes(codec, payload) -> np.ndarray:
    nb = n_buckets(codec, payload.size)
    return unpack(payload.data[4 * nb:], payload.size, int(codec.params["bits"]))


def element_scales(codec, scales: np.ndarray, n: int) -> np.ndarray:
    """Per-element copy of the per-bucket scales."""
    return np.repeat(np.asarray(scales, np.float64), bucket_len(codec, n))[:n]


# --------------------------------------------------------------------------------------------
# exact two-point moments
# --------------------------------------------------------------------------------------------
def moments(codec, x: np.ndarray, scales: np.ndarray | None = None) -> SimpleNamespace:
    """Exact per-element distribution of the decode of x (finite buckets only).

    Returns a namespace of float64 arrays: ``r`` (|x| / scale), ``lo``/``hi`` (neighbouring
    levels, times sign and scale = the two values the decode can take), ``p`` (probability of
    ``hi``), ``var`` and ``m4`` (second and fourth moment of the error), ``scale``.
    ``scales`` defaults to the reference scales; pass the payload's to remove float32 noise.
    """
    x = np.asarray(x, np.float64)
    lv = levels(codec)
    if scales is None:
        scales = ref_scales(codec, x)
    sc = element_scales(codec, scales, x.size)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(sc > 0, np.abs(x) / np.where(sc > 0, sc, 1.0), 0.0)
    r = np.minimum(r, 1.0)
    k = np.clip(np.searchsorted(lv, r, side="right") - 1, 0, lv.size - 2)
    lo, hi = lv[k], lv[k + 1]
    gap = hi - lo
    p = np.clip((r - lo) / gap, 0.0, 1.0)
    var = (r - lo) * (hi - r) * sc * sc
    m4 = ((1 - p) * (r - lo) ** 4 + p * (hi - r) ** 4) * sc ** 4
    sgn = np.sign(x)
    return SimpleNamespace(r=r, p=p, lo_level=lo, hi_level=hi, lo=sgn * lo * sc, hi=sgn * hi * sc,
                           var=var, m4=m4, scale=sc)


def exact_variance(codec, x: np.ndarray, scales=None) -> float:
    """E||Q(x) - x||^2 from the level grid: sum of (r - l)(u - r) scale^2."""
    return float(np.sum(moments(codec, x, scales).var))


# --------------------------------------------------------------------------------------------
# bit-exact reference encoder (the kernel's float32 arithmetic, written in NumPy)
# --------------------------------------------------------------------------------------------
def reference_codes(codec, x: np.ndarray, seed: int, scales: np.ndarray) -> np.ndarray:
    """Codes the encoder must produce for float32 ``x`` given the bucket scales.

    Uniform grid: t = min(|x| * fl(s / scale), s), level floor(t), up iff u < t - floor(t),
    u = :func:`uniforms` draw of the element (24-bit grid). Geometric grid: r = min(|x| *
    fl(1 / scale), 1); at or above the smallest level up iff the 23-bit draw ``floor(u * 2^23)``
    is below r's mantissa; below it up iff u < r * 2^(s-1). Code = sign << (bits-1) | level.
    """
    x = np.ascontiguousarray(x, np.float32)
    n = x.size
    s = level_count(codec)
    bits = int(codec.params["bits"])
    u = uniforms(n, derive_key(seed))
    sc = np.repeat(np.asarray(scales, np.float32), bucket_len(codec, n))[:n]
    ok = (sc > 0) & np.isfinite(sc)
    sc1 = np.where(ok, sc, np.float32(1))
    ax = np.abs(x)
    with np.errstate(over="ignore", invalid="ignore"):
        if codec.name in ("qsgd", "standard_dithering"):
            mult = (np.float32(s) / sc1).astype(np.float32)
            t = np.minimum(ax * mult, np.float32(s)).astype(np.float32)
            lvl = np.floor(t).astype(np.int32)
            frac = (t - lvl.astype(np.float32)).astype(np.float32)
            mag = lvl + (u < frac)
        else:
            inv = (np.float32(1) / sc1).astype(np.float32)
            r = np.minimum(ax * inv, np.float32(1)).astype(np.float32)
            rb = r.view(np.int32)
            lower = (rb >> 23) + (s - 127)
            u23 = np.floor(u.astype(np.float64) * 2.0 ** 23).astype(np.int32)
            up_hi = u23 < (rb & 0x7FFFFF)
            up_lo = u < (r * np.float32(2.0 ** (s - 1))).astype(np.float32)
            mag = np.where(lower >= 1, lower + up_hi, up_lo.astype(np.int32))
    mag = np.where(ok, mag, 0).astype(np.int32)
    neg = (x < 0) & (mag != 0)
    return (mag | (neg.astype(np.int32) << (bits - 1))).astype(np.uint8)


# --------------------------------------------------------------------------------------------
# packing reference (the layout in packing.py's module doc, written plainly)
# --------------------------------------------------------------------------------------------
def plane_widths(bits: int) -> list[int]:
    return [8] if bits == 8 else [w for w in (1, 2, 4) if bits & w]


def ref_packed_nbytes(n: int, bits: int) -> int:
    total = 0
    for b0 in range(0, n, PACK_BLOCK):
        m = min(PACK_BLOCK, n - b0)
        total += sum((m * w + 7) // 8 for w in plane_widths(bits))
    return total


def ref_pack(codes: np.ndarray, bits: int) -> bytes:
    """Plain-Python packer: per block, per plane of width w (low fields first), byte j holds
    the fields of codes j, j + L, j + 2L, ... (L = ceil(m / (8 / w))), lowest bits first."""
    out = bytearray()
    codes = [int(c) for c in codes]
    for b0 in range(0, len(codes), PACK_BLOCK):
        blk = codes[b0:b0 + PACK_BLOCK]
        m = len(blk)
        shift = 0
        for w in plane_widths(bits):
            per = 8 // w
            L = (m + per - 1) // per
            for j in range(L):
                v = 0
                for t in range(per):
                    i = j + t * L
                    if i < m:
                        v |= ((blk[i] >> shift) & ((1 << w) - 1)) << (t * w)
                out.append(v)
            shift += w
    return bytes(out)


def ref_payload_nbytes(codec, n: int) -> int:
    """One float32 per bucket plus the packed codes (ceil rounding per plane and block)."""
    return 4 * n_buckets(codec, n) + ref_packed_nbytes(n, int(codec.params["bits"]))


# --------------------------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------------------------
def decode_trials(codec, x, seeds):
    """Stack of decodes (float64), one row per seed."""
    return np.stack([codec.decode(codec.encode(x, seed=int(s))).astype(np.float64) for s in seeds])


def unbiased_stats(codec, x, trials: np.ndarray, scales=None) -> dict:
    """z-scores of the mean of ``trials`` against x, from the exact two-point variances.

    * ``z_proj``: the projection sum_i x_i (mean_i - x_i), normal with variance
      sum_i x_i^2 var_i / T (a sum of many independent terms): detects a multiplicative bias.
    * ``z_sign``: the same with weights sign(x_i): detects an additive bias on magnitudes.
    * ``chi2_z``: (sum_i z_i^2 - K) / sd over the K random coordinates with T p q >= 5,
      where z_i is the coordinate's z-score and sd uses Var(z_i^2) = 2 + (1 - 6 p q) / (T p q),
      the exact excess kurtosis of a mean of T Bernoulli(p) trials.
    * ``max_abs_dev_fixed``: largest |mean - x| over coordinates whose decode is deterministic.
    """
    x64 = np.asarray(x, np.float64)
    T = trials.shape[0]
    mo = moments(codec, x64, scales)
    dev = trials.mean(axis=0) - x64
    rnd = mo.var > 0
    w = x64[rnd]
    z_proj = float(np.sum(w * dev[rnd]) / math.sqrt(np.sum(w * w * mo.var[rnd]) / T))
    sg = np.sign(w)
    z_sign = float(np.sum(sg * dev[rnd]) / math.sqrt(np.sum(mo.var[rnd]) / T))
    # coordinates with T p q < 5 make the sum heavy-tailed (a near-Poisson count): left out
    well = rnd & (T * mo.p * (1 - mo.p) >= 5)
    zi = dev[well] / np.sqrt(mo.var[well] / T)
    pq = mo.p[well] * (1 - mo.p[well])
    var_z2 = 2 + (1 - 6 * pq) / (T * pq)
    chi2_z = float((np.sum(zi * zi) - zi.size) / math.sqrt(np.sum(var_z2))) if zi.size else 0.0
    fixed = ~rnd
    max_fixed = 0.0
    if fixed.any():
        max_fixed = float(np.max(np.abs(dev[fixed]) / np.maximum(mo.scale[fixed], 1e-300)))
    return {"z_proj": z_proj, "z_sign": z_sign, "chi2_z": chi2_z, "max_abs_dev_fixed": max_fixed,
            "random_coords": int(rnd.sum())}


def variance_stats(codec, x, trials: np.ndarray, scales=None) -> dict:
    """Empirical E||Q - x||^2 against the exact value, with a z-score from the fourth moments."""
    x64 = np.asarray(x, np.float64)
    T = trials.shape[0]
    mo = moments(codec, x64, scales)
    err = np.sum((trials - x64) ** 2, axis=1)
    exact = float(np.sum(mo.var))
    sd_one = math.sqrt(max(float(np.sum(mo.m4 - mo.var ** 2)), 0.0))
    emp = float(err.mean())
    if sd_one > 0:
        z = (emp - exact) / (sd_one / math.sqrt(T))
    else:
        z = 0.0 if emp == exact else math.inf
    return {"empirical": emp, "exact": exact, "z": z, "norm2": float(np.sum(x64 * x64))}


@pytest.fixture(scope="session")
def ref():
    """The helpers above, as one namespace (see the module docstring)."""
    return SimpleNamespace(
        FLT_MIN=FLT_MIN, level_count=level_count, levels=levels, norm_kind=norm_kind,
        bucket_len=bucket_len, n_buckets=n_buckets, buckets=buckets, ref_scale=ref_scale,
        ref_scales=ref_scales, l2_scale_exact=l2_scale_exact, payload_scales=payload_scales,
        payload_codes=payload_codes, element_scales=element_scales, moments=moments,
        exact_variance=exact_variance, reference_codes=reference_codes,
        plane_widths=plane_widths, ref_packed_nbytes=ref_packed_nbytes, ref_pack=ref_pack,
        ref_payload_nbytes=ref_payload_nbytes, decode_trials=decode_trials,
        unbiased_stats=unbiased_stats, variance_stats=variance_stats,
    )
