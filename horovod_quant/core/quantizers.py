"""Per-worker level quantizers: QSGD, standard dithering, NUQSGD, natural dithering, C_nat.

All five are "general dithering" (natural-compression paper, Definition 3): normalize a bucket
by a scale, round each magnitude stochastically to one of two neighbouring levels so that the
expectation is exact, and send the sign with the level index. They share one kernel
(``Backend.encode`` with a grid mode, :mod:`horovod_quant.backends`) and differ in the level grid
and the scale. ``bits`` counts every bit sent per element, the sign included. How ``bits`` maps
to each codec's levels, and where the codecs depart from their papers: docs/codecs.md.
"""
from __future__ import annotations

import abc
import math
from typing import Any, ClassVar, Sequence

import numpy as np

from ..backends import (
    MODE_GEOMETRIC,
    MODE_UNIFORM,
    NORM_L2,
    NORM_MAX,
    NORM_P,
    NORM_POW2,
    backend_of,
    elias_error,
    packed_nbytes,
)
from .base import Codec, WireLayout, check_choice, check_int
from .payload import Payload
from .rng import derive_key, split_key

DEFAULT_BUCKET = 512


def _check_bucket(bucket_size: Any) -> int | None:
    if bucket_size is None:
        return None
    return check_int("bucket_size", bucket_size, 1, hint="None means one bucket per tensor.")


def _check_p(p: Any) -> float:
    try:
        p = float(p)
    except (TypeError, ValueError):
        raise ValueError(f"p={p!r} must be a number >= 1 or float('inf')") from None
    if not p >= 1:
        raise ValueError(f"p={p} is not a norm: use p >= 1 (2 for L2, float('inf') for max)")
    return p


def uniform_grid_omega(d: int, s: int, p: float = 2.0) -> float:
    """Variance bound of uniform levels {j/s} with a p-norm scale on a d-element bucket.

    Per element the variance is at most min(1/(4 s^2), y_i / s) times the squared scale; with
    ||x||_p <= d^(1/r - 1/2) ||x||_2 and ||x||_1 <= sqrt(d) ||x||_2 (r = min(p, 2)) this gives
    min(d^(2/r) / (4 s^2), d^(1/r) / s): QSGD Lemma 3.1 (min(d/s^2, sqrt(d)/s)) for p = 2,
    sharpened by the 1/4 of a Bernoulli variance.
    """
    if d <= 1:
        return 0.0 if d == 0 else min(1 / (4 * s * s), 1 / s)
    r = min(p, 2.0)
    return min(d ** (2 / r) / (4 * s * s), d ** (1 / r) / s)


def geometric_grid_omega(d: int, s: int, p: float = 2.0, scale_slack: float = 1.0) -> float:
    """Variance bound of binary-geometric levels {0, 2^(1-s), ..., 1} (s nonzero levels).

    Between powers of two the relative variance is at most 1/8 (C_nat, Theorem 1); below the
    smallest level l = 2^(1-s) it is at most min(l^2/4, y_i l). With r = min(p, 2) this is
    natural dithering's Theorem 4 with its first term read as max(1/8, 1/s) (docs/codecs.md,
    "Departures from the papers").
    ``scale_slack`` bounds scale / ||x||_p (2 for C_nat's power-of-two scale).
    """
    if d == 0:
        return 0.0
    r = min(p, 2.0)
    low = 2.0 ** (1 - s) * scale_slack
    return max(1 / 8, 1 / s) + min(d ** (2 / r) * low * low / 4, d ** (1 / r) * low)


class LevelQuantizer(Codec):
    """Shared implementation; subclasses fix the grid and how parameters map to it."""

    #: the level grid, as the backends' encode mode (``MODE_UNIFORM``: j/s; ``MODE_GEOMETRIC``:
    #: 0, 2^(1-s), ..., 1/2, 1); a new grid needs its own mode in every backend
    grid: ClassVar[int]

    def __init__(self, params: dict[str, Any], *, bits: int, nonzero_levels: int,
                 bucket_size: int | None, p: float, pow2_scale: bool = False) -> None:
        super().__init__(**params)
        self.bits = bits
        self.s = nonzero_levels
        self.bucket_size = bucket_size
        self.p = p
        if pow2_scale:
            self.norm_kind = NORM_POW2
        elif p == 2:
            self.norm_kind = NORM_L2
        elif math.isinf(p):
            self.norm_kind = NORM_MAX
        else:
            self.norm_kind = NORM_P
        self.table = self._signed_table()

    def _levels(self) -> np.ndarray:
        """Level value of each magnitude index 0..s."""
        j = np.arange(self.s + 1, dtype=np.float64)
        if self.grid == MODE_UNIFORM:
            return (j / self.s).astype(np.float32)
        lv = np.ldexp(1.0, (j - self.s).astype(np.int64))
        lv[0] = 0.0
        return lv.astype(np.float32)

    def _signed_table(self) -> np.ndarray:
        half = 1 << (self.bits - 1)
        table = np.zeros(2 * half, np.float32)
        lv = self._levels()
        table[: self.s + 1] = lv
        table[half : half + self.s + 1] = -lv
        return table

    def _bucket(self, n: int) -> int:
        return self.bucket_size if self.bucket_size is not None else max(n, 1)

    def payload_nbytes(self, n: int) -> int:
        """Exact payload size for n elements: one float32 per bucket plus packed codes."""
        return 4 * -(-n // self._bucket(n)) + int(packed_nbytes(n, self.bits))

    def _layout_detail(self) -> str:
        return f"bits={self.bits}, bucket_size={self.bucket_size}"

    def wire_layout(self, size: int, head: np.ndarray | None = None) -> WireLayout:
        return WireLayout(size, self.payload_nbytes(size), True, self._layout_detail())

    def encode(self, x: Any, seed: int = 0) -> Payload:
        be = backend_of(x)
        v = be.vector(x)
        n = int(v.size)
        out = be.xp.empty(self.payload_nbytes(n), np.uint8)
        self._encode_fixed(be, v, seed, out)
        return Payload(out, n)

    def _encode_fixed(self, be: Any, v: Any, seed: int, out: Any) -> None:
        """The fixed-width payload ``[float32 scale per bucket][packed codes]`` of v into out."""
        be.encode(v, out, 0, self._bucket(int(v.size)), self.grid, self.bits,
                  split_key(derive_key(seed)), norm_kind=self.norm_kind, p=float(self.p),
                  s=self.s)

    def decode(self, payload: Payload, out: Any | None = None) -> Any:
        n = self.check_payload(payload, out).size
        be = backend_of(payload.data)
        dst = be.xp.empty(n, np.float32) if out is None else be.array(out)
        self._decode_into(be, payload, n, dst, False)
        return dst if out is None else out

    def decode_add(self, payload: Payload, out: Any) -> Any:
        n = self.check_payload(payload, out).size
        be = backend_of(payload.data)
        self._decode_into(be, payload, n, be.array(out), True)
        return out

    def _decode_into(self, be: Any, payload: Payload, n: int, out: Any, accumulate: bool
                     ) -> None:
        """Decode a checked payload of n elements into ``out`` (``+=`` if accumulate)."""
        if n:
            be.decode_levels(_bytes(be, payload), n, self._bucket(n), self.bits,
                             be.constant(self.table), out, accumulate)

    def combine_gathered(self, payloads: Sequence[Payload], seed: int,
                         out: Any | None = None) -> Any:
        """The gather exchange's mean in one fused pass (``Backend.combine_levels``), bit for
        bit the rank-order ``decode_add`` of :meth:`Codec.combine_gathered`."""
        n = self.check_payloads(payloads, out)[0].size
        be = backend_of(payloads[0].data)
        dst = be.xp.empty(n, np.float32) if out is None else be.array(out)
        be.combine_levels([_bytes(be, p) for p in payloads], n, self._bucket(n), self.bits,
                          be.constant(self.table), np.float32(1.0 / len(payloads)), dst)
        return dst if out is None else out

    @abc.abstractmethod
    def omega(self, d: int) -> float:
        """Bound on E||Q(x) - x||^2 / ||x||^2 for one bucket of d elements."""


def _bytes(be: Any, payload: Payload) -> Any:
    """A payload's data as a flat uint8 array of backend ``be`` (a view)."""
    return be.array(payload.data).view(np.uint8)


def _default_levels(name: str, levels: Any, bits: int, most: int, least: int = 1) -> int:
    if levels is None:
        return most
    return check_int(f"{name} levels", levels, least, most,
                     hint=f"{bits} bits hold at most {most}; raise bits for more levels.")


class QSGD(LevelQuantizer):
    """QSGD (Alistarh et al., 2017, Section 3.1): uniform levels j/s scaled by the bucket's L2
    norm, or by its max norm for the "QSGDinf" variant used in the paper's experiments.

    The defaults are the safe choice of docs/choosing.md, 8 bits and the max norm (the paper's
    analysis uses the L2 norm, Lemma 3.1; its experiments use the max norm, which measured 13-16x
    less variance on real gradients at the same bytes: docs/results/variance_tables.md).

    Args:
        bits: wire bits per element including the sign, 2..8; s = 2^(bits-1) - 1 by default.
        bucket_size: elements per bucket (one float32 scale each); None = whole tensor.
        norm: "max" (QSGDinf, default) or "l2" (Lemma 3.1).
        levels: s, to use fewer levels than ``bits`` can hold.
        elias: send the codes Elias-coded (Section 3.2,
            :mod:`horovod_quant.backends.numba.elias`): payload
            ``[float32 scale per bucket][Elias bit stream]`` of data-dependent length, smaller
            than ``bits`` bits per element in the sparse regime (small s, large buckets).
    """

    name = "qsgd"
    grid = MODE_UNIFORM

    def __init__(self, bits: int = 8, bucket_size: int | None = DEFAULT_BUCKET, norm: str = "max",
                 levels: int | None = None, elias: bool = False) -> None:
        bits = check_int("bits", bits, 2, 8)
        check_choice("norm", norm, ("l2", "max"))
        check_choice("elias", elias, (False, True))
        s = _default_levels("qsgd", levels, bits, (1 << (bits - 1)) - 1)
        super().__init__({"bits": bits, "bucket_size": bucket_size, "norm": norm, "levels": s,
                          "elias": bool(elias)}, bits=bits, nonzero_levels=s,
                         bucket_size=_check_bucket(bucket_size),
                         p=2.0 if norm == "l2" else math.inf)
        self.elias = bool(elias)

    def payload_nbytes(self, n: int) -> int:
        if self.elias:
            raise ValueError("Elias payload sizes depend on the data; payload_nbytes is for "
                             "elias=False (the fixed-width size)")
        return super().payload_nbytes(n)

    def wire_layout(self, size: int, head: np.ndarray | None = None) -> WireLayout:
        if not self.elias:
            return super().wire_layout(size, head)
        # the bucket scales, then a stream of at least one byte (the terminator), whose reads
        # the decoding kernel checks
        nb = -(-size // self._bucket(size))
        return WireLayout(size, 4 * nb + 1, False,
                          f"{self._layout_detail()}, elias=True: {nb} float32 scales and a "
                          f"stream of at least one byte")

    def encode(self, x: Any, seed: int = 0) -> Payload:
        if not self.elias:
            return super().encode(x, seed)
        # the fixed-width codes first (same kernel, same codes), then their Elias form
        be = backend_of(x)
        be.require("elias_encode_levels")  # before the fixed-width encode
        v = be.vector(x)
        n = int(v.size)
        bucket = self._bucket(n)
        fixed = be.xp.empty(super().payload_nbytes(n), np.uint8)
        self._encode_fixed(be, v, seed, fixed)
        return Payload(be.elias_encode_levels(fixed, n, bucket, self.bits), n)

    def _decode_into(self, be: Any, payload: Payload, n: int, out: Any, accumulate: bool
                     ) -> None:
        """Fixed width: the levels decode; Elias: ``Backend.elias_decode``, whose damaged
        stream raises ValueError (``out`` then holds a partial result)."""
        if not self.elias:
            return super()._decode_into(be, payload, n, out, accumulate)
        err = be.elias_decode(_bytes(be, payload), n, self._bucket(n), self.bits,
                              be.constant(self.table), out, accumulate)
        if err:
            raise ValueError(f"{self.name}: corrupt Elias stream ({elias_error(err)}; "
                             f"size={n}, {self._layout_detail()})")

    def combine_gathered(self, payloads: Sequence[Payload], seed: int,
                         out: Any | None = None) -> Any:
        if not self.elias:
            return super().combine_gathered(payloads, seed, out)
        return Codec.combine_gathered(self, payloads, seed, out)  # variable-length payloads

    def omega(self, d: int) -> float:
        return uniform_grid_omega(d, self.s, self.p)


class StandardDithering(LevelQuantizer):
    """Standard random dithering D_sta^{p,s} (natural-compression paper, Definition 3).

    Args:
        bits: wire bits per element including the sign, 2..8.
        bucket_size: elements per bucket; None = whole tensor.
        p: norm used for the scale (>= 1, ``float('inf')`` for max).
        levels: s (default 2^(bits-1) - 1).
    """

    name = "standard_dithering"
    grid = MODE_UNIFORM

    def __init__(self, bits: int = 4, bucket_size: int | None = DEFAULT_BUCKET, p: float = 2.0,
                 levels: int | None = None) -> None:
        bits = check_int("bits", bits, 2, 8)
        p = _check_p(p)
        s = _default_levels("standard_dithering", levels, bits, (1 << (bits - 1)) - 1)
        super().__init__({"bits": bits, "bucket_size": bucket_size, "p": p, "levels": s},
                         bits=bits, nonzero_levels=s, bucket_size=_check_bucket(bucket_size), p=p)

    def omega(self, d: int) -> float:
        return uniform_grid_omega(d, self.s, self.p)


class NUQSGD(LevelQuantizer):
    """NUQSGD (Ramezani-Kebrya et al.): levels (0, 2^-s, ..., 1/2, 1), L2 bucket norm.

    Args:
        bits: wire bits per element including the sign, 3..8; s = 2^(bits-1) - 2 internal
            levels by default (s + 2 levels with zero and one).
        bucket_size: elements per bucket; None = whole tensor.
        levels: s, the paper's number of internal levels (>= 1).
    """

    name = "nuqsgd"
    grid = MODE_GEOMETRIC

    def __init__(self, bits: int = 4, bucket_size: int | None = DEFAULT_BUCKET,
                 levels: int | None = None) -> None:
        bits = check_int("bits", bits, 3, 8, hint="NUQSGD needs s >= 1 internal levels.")
        s = _default_levels("nuqsgd", levels, bits, (1 << (bits - 1)) - 2)
        super().__init__({"bits": bits, "bucket_size": bucket_size, "levels": s}, bits=bits,
                         nonzero_levels=s + 1, bucket_size=_check_bucket(bucket_size), p=2.0)

    def omega(self, d: int) -> float:
        return geometric_grid_omega(d, self.s, 2.0)


class NaturalDithering(LevelQuantizer):
    """Natural dithering D_nat^{p,s} (natural-compression paper, Definition 3, Theorem 4):
    binary-geometric levels 0, 2^(1-s), ..., 1/2, 1 with a p-norm scale.

    Args:
        bits: wire bits per element including the sign, 2..8; s = 2^(bits-1) - 1 by default.
        bucket_size: elements per bucket; None = whole tensor.
        p: norm used for the scale.
        levels: s.
    """

    name = "natural_dithering"
    grid = MODE_GEOMETRIC

    def __init__(self, bits: int = 4, bucket_size: int | None = DEFAULT_BUCKET, p: float = 2.0,
                 levels: int | None = None) -> None:
        bits = check_int("bits", bits, 2, 8)
        p = _check_p(p)
        s = _default_levels("natural_dithering", levels, bits, (1 << (bits - 1)) - 1)
        super().__init__({"bits": bits, "bucket_size": bucket_size, "p": p, "levels": s},
                         bits=bits, nonzero_levels=s, bucket_size=_check_bucket(bucket_size), p=p)

    def omega(self, d: int) -> float:
        return geometric_grid_omega(d, self.s, self.p)


class NaturalCompression(LevelQuantizer):
    """Natural compression C_nat (natural-compression paper, Definition 1, Theorem 1):
    each value rounds to one of its two neighbouring powers of two, unbiasedly.

    Args:
        bits: wire bits per element including the sign, 2..8 (2^(bits-1) - 1 binades kept
            below each bucket's top power of two; 8 reproduces C_nat for all normal floats
            within 2^-126 of the bucket maximum).
        bucket_size: elements sharing one top exponent; None = whole tensor.
    """

    name = "natural"
    grid = MODE_GEOMETRIC

    def __init__(self, bits: int = 8, bucket_size: int | None = DEFAULT_BUCKET) -> None:
        bits = check_int("bits", bits, 2, 8)
        super().__init__({"bits": bits, "bucket_size": bucket_size}, bits=bits,
                         nonzero_levels=(1 << (bits - 1)) - 1,
                         bucket_size=_check_bucket(bucket_size), p=math.inf, pow2_scale=True)

    def omega(self, d: int) -> float:
        low = 2.0 ** (1 - self.s) * 2.0
        return 1 / 8 + min(d * low * low / 4, math.sqrt(d) * low)
