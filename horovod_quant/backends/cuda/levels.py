"""Launches of ``kernels/levels.cu`` (twin of :mod:`horovod_quant.backends.numba.levels`): the
packed encode of every mode, level decodes and the gather exchange's one-pass mean."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..protocol import (
    MODE_DITHER,
    MODE_NESTED,
    NORM_MAX,
    NORM_POW2,
    PACK_BLOCK,
    SCALED_MODES,
    Keys,
)
from .launch import ENCODE_MODES, Launches, int_keys


class LevelLaunches(Launches):
    """``Backend`` entry points of levels.cu."""

    def encode(self, x: Any, out: Any, offset: int, bucket: int, mode: int, bits: int,
               keys: Keys, *, norm_kind: int = NORM_MAX, p: float = 2.0, s: int = 0,
               c: int = 0, M: int = 0, k: int = 0, am: float = 0.0, gnorm: float = 0.0) -> None:
        if mode not in ENCODE_MODES:
            raise ValueError(f"encode: unknown mode {mode}: use one of the MODE_* constants of "
                             f"horovod_quant.backends")
        n = int(x.size)
        if n == 0:
            return
        scaled = mode in SCALED_MODES
        nb = -(-n // bucket)
        codes_off = offset + (4 * nb if scaled else 0)
        # one pass when buckets tile the packing blocks; else the scales first
        fused = PACK_BLOCK % bucket == 0
        if scaled and not fused:
            scales = out[offset: offset + 4 * nb].view(self.xp.float32)
            kind = NORM_MAX if mode in (MODE_DITHER, MODE_NESTED) else norm_kind
            if kind in (NORM_MAX, NORM_POW2):
                self.kernels.max_scales(x, n, bucket, kind, scales)
            else:
                self.kernels.scales(x, n, bucket, kind, float(p), scales)
        k0, k1 = int_keys(keys)
        self.kernels.encode(x, n, bucket, mode, bits, norm_kind, float(p), s, c, M, k,
                            float(am), float(gnorm), k0, k1, out, offset, codes_off, fused)

    def decode_levels(self, data: Any, n: int, bucket: int, bits: int, table: Any, out: Any,
                      accumulate: bool) -> None:
        if n:
            self.kernels.decode_levels([data], 0, 4 * -(-n // bucket), None, n, bucket, bits,
                                       table, out, accumulate, None)

    def combine_levels(self, datas: Sequence[Any], n: int, bucket: int, bits: int, table: Any,
                       inv_count: float, out: Any) -> None:
        out.fill(0)  # then accumulate: 0 + first decode, as the numba combine
        if n:
            self.kernels.decode_levels(list(datas), 0, 4 * -(-n // bucket), None, n, bucket,
                                       bits, table, out, True, np.float32(inv_count))

    def decode_codes(self, data: Any, n: int, bits: int, table: Any, scale: float, out: Any,
                     accumulate: bool) -> None:
        if n:
            self.kernels.decode_levels([data], -1, 0, [np.float32(scale)], n, 1, bits, table,
                                       out, accumulate, None)
