"""Launches of ``kernels/levels.cu`` (twin of :mod:`horovod_quant.backends.numba.levels`): the
packed encode of every mode, level decodes and the gather exchange's one-pass mean."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..protocol import (
    MODE_DITHER,
    MODE_EXP,
    MODE_NESTED,
    NORM_MAX,
    NORM_POW2,
    PACK_BLOCK,
    SCALED_MODES,
    Keys,
)
from .launch import (
    ENCODE_MODES,
    START_ASSIGN,
    START_OUT,
    START_ZERO,
    Launches,
    LevelValues,
    decode_payloads,
    int_keys,
    log2_exact,
)
from .specs import FAST_BITS, TILE_LOG2_BUCKETS, TILE_SCALES


class LevelLaunches(Launches):
    """``Backend`` entry points of levels.cu."""

    def _tile_log2_bucket(self, x: Any, out: Any, scales_off: int, codes_off: int, bucket: int,
                          mode: int, kind: int, bits: int) -> int | None:
        """log2 of the bucket (0 without scales) when the warp-tile encode can take the full
        packing blocks, else None: 4- or 8-bit codes, a max, power-of-two or L2 scale (or
        none) of buckets that fit a tile, x 16-byte aligned, scales and codes 4-byte aligned
        (payload buffers are; views at odd offsets take the generic program)."""
        if bits not in FAST_BITS:
            return None
        addr = self.kernels.address
        if addr(x) % 16 or (addr(out) + scales_off) % 4 or (addr(out) + codes_off) % 4:
            return None
        if mode == MODE_EXP:
            return 0
        lb = log2_exact(bucket)
        return lb if kind in TILE_SCALES and lb in TILE_LOG2_BUCKETS else None

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
        kind = NORM_MAX if mode in (MODE_DITHER, MODE_NESTED, MODE_EXP) else norm_kind
        k0, k1 = int_keys(keys)
        lb = self._tile_log2_bucket(x, out, offset, codes_off, bucket, mode, kind, bits)
        full = n // PACK_BLOCK if lb is not None else 0
        if full:
            self.kernels.encode_tiles(x, full, lb, mode, kind, bits, s, c, M, k, float(am),
                                      float(gnorm), k0, k1, out, offset, codes_off)
        if full * PACK_BLOCK == n:
            return
        # the generic program: the rest, or everything
        fused = PACK_BLOCK % bucket == 0  # every bucket inside a block: scales in the block
        if scaled and not fused:
            scales = out[offset: offset + 4 * nb].view(self.xp.float32)
            if kind in (NORM_MAX, NORM_POW2):
                self.kernels.max_scales(x, n, bucket, kind, scales)
            else:
                self.kernels.scales(x, n, bucket, kind, float(p), scales)
        self.kernels.encode_blocks(x, n, bucket, mode, bits, norm_kind, float(p), s, c, M, k,
                                   float(am), float(gnorm), k0, k1, out, offset, codes_off,
                                   fused, full)

    def decode_levels(self, data: Any, n: int, bucket: int, bits: int, table: Any, out: Any,
                      accumulate: bool) -> None:
        if n:
            decode_payloads(self.kernels, LevelValues(table), [data], 0, 4 * -(-n // bucket),
                            None, n, bucket, bits, out, START_OUT if accumulate else START_ASSIGN,
                            None)

    def combine_levels(self, datas: Sequence[Any], n: int, bucket: int, bits: int, table: Any,
                       inv_count: float, out: Any) -> None:
        if n:
            decode_payloads(self.kernels, LevelValues(table), list(datas), 0,
                            4 * -(-n // bucket), None, n, bucket, bits, out, START_ZERO,
                            np.float32(inv_count))

    def decode_codes(self, data: Any, n: int, bits: int, table: Any, scale: float, out: Any,
                     accumulate: bool) -> None:
        if n:
            decode_payloads(self.kernels, LevelValues(table), [data], -1, 0, np.float32(scale),
                            n, 1, bits, out, START_OUT if accumulate else START_ASSIGN, None)
