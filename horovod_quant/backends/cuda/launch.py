"""What the launch modules of the CUDA backend share (``levels``, ``global_qsgd``, ``dithered``,
one per ``kernels/*.cu`` file, combined in :class:`horovod_quant.backends.cuda.CudaBackend`):
keys as kernel arguments, and the decode of several payloads, which levels and DQSG share."""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from ..protocol import (
    MODE_DITHER,
    MODE_EXP,
    MODE_GEOMETRIC,
    MODE_NESTED,
    MODE_UNIFORM,
    PACK_BLOCK,
    Keys,
)
from .specs import FAST_BITS

#: the modes of the encode kernels
ENCODE_MODES = (MODE_UNIFORM, MODE_GEOMETRIC, MODE_EXP, MODE_DITHER, MODE_NESTED)

#: payloads per decode launch (HQ_MAX_PAYLOADS: their pointers are kernel arguments)
MAX_PAYLOADS = 8
#: how a decode launch starts each element's sum (HQ_START_*): the first payload's value
#: (decode), out + ... (decode_add, and every launch after the first of a long payload list),
#: 0.0f + ... (the gather mean, which the numba backend sums into zeros)
START_ASSIGN, START_OUT, START_ZERO = 0, 1, 2


def int_keys(keys: Keys) -> tuple[int, int]:
    """Key halves as Python ints (kernel arguments)."""
    return int(keys[0]), int(keys[1])


def log2_exact(v: int) -> int | None:
    """log2(v) for a power of two v >= 1, else None."""
    return v.bit_length() - 1 if v > 0 and v & (v - 1) == 0 else None


class LevelValues(NamedTuple):
    """Decoded value ``table[code] * scale`` (levels, Global-QSGD exponent codes)."""

    table: Any

    def part(self, lo: int, hi: int) -> "LevelValues":
        return self


class DitherValues(NamedTuple):
    """Decoded value of DQSG codes: the dither regenerated from each payload's keys."""

    keys: Sequence[Keys]
    M: int

    def part(self, lo: int, hi: int) -> "DitherValues":
        """The values of payloads ``lo:hi``."""
        return DitherValues(self.keys[lo:hi], self.M)


def decode_payloads(kernels: Any, values: Any, datas: Sequence[Any], scales_off: int,
                    codes_off: int, gscale: float | None, n: int, bucket: int, bits: int,
                    out: Any, start: int, post: float | None) -> None:
    """``out = start-value + value(payload 0) + value(payload 1) + ...`` (then ``* post``),
    payloads in order, for the n elements of ``[scales][packed codes]`` payloads.

    Up to :data:`MAX_PAYLOADS` payloads per launch; a longer list continues in more launches
    from the stored sums (float32 stores are exact, so the additions and their order are those
    of one pass). Full packing blocks go to the word program (one 32-bit code word per
    thread) when the bit width has one and every element of a code word's part shares a scale
    (a power-of-two bucket >= 4, or the one scale ``gscale``); the rest to the group program.
    """
    fast = bits in FAST_BITS and (gscale is not None or (log2_exact(bucket) or 0) >= 2)
    end = n // PACK_BLOCK * PACK_BLOCK if fast else 0
    for lo in range(0, len(datas), MAX_PAYLOADS):
        hi = min(lo + MAX_PAYLOADS, len(datas))
        args = (values.part(lo, hi), list(datas[lo:hi]), scales_off, codes_off, gscale, n,
                bucket, bits, out, start if lo == 0 else START_OUT,
                post if hi == len(datas) else None)
        if end:
            kernels.decode_words(*args, end)
        if end < n:
            kernels.decode_groups(*args, end)


class Launches:
    """Base of the launch classes: ``kernels`` is the kernel launcher (module doc of
    :mod:`horovod_quant.backends.cuda`), ``xp`` its array module."""

    kernels: Any
    xp: Any

    def to_host(self, a: Any) -> Any:
        """A NumPy copy of a device array."""
        return self.kernels.to_host(a)
