"""Launches of ``kernels/global_qsgd.cu`` (twin of :mod:`horovod_quant.backends.numba.global_qsgd`):
norm statistics, linear words, sparse payloads, the exponent combination."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..protocol import (
    MODE_EXP,
    MODE_LINEAR_SM,
    PACK_BLOCK,
    SPARSE_BAD_POSITIONS,
    SPARSE_OK,
    Keys,
    packed_nbytes,
)
from .launch import Launches, int_keys
from .specs import FAST_BITS


def sparse_positions_error(pos: Any, size: int) -> bool:
    """Whether the uint32 positions ``pos`` of a sparse payload break the rule the decoder
    checks (strictly increasing, below ``size``), in array operations before any launch."""
    if pos.size == 0:
        return False
    bad = pos[-1] >= size
    if pos.size > 1:
        bad = bad | (pos[1:] <= pos[:-1]).any()
    return bool(bad)


class GlobalQSGDLaunches(Launches):
    """``Backend`` entry points of global_qsgd.cu."""

    def max_abs(self, x: Any) -> float:
        bits = self.kernels.max_abs_bits(x, int(x.size)) if x.size else 0
        if bits >= 0x7F800000:
            return float("nan")
        return float(np.array([bits], np.int32).view(np.float32)[0])

    def sum_squares(self, x: Any) -> float:
        return float(self.kernels.sum_squares(x, int(x.size))) if x.size else 0.0

    def linear_encode(self, x: Any, bits: int, s: int, norm: float, keys: Keys,
                      words: Any) -> None:
        if words.size:
            k0, k1 = int_keys(keys)
            self.kernels.linear_encode(x, int(x.size), bits, s, float(norm), k0, k1, words)

    def linear_decode(self, words: Any, n: int, bits: int, offset: int, scale: float, out: Any,
                      accumulate: bool) -> None:
        if n:
            self.kernels.linear_decode(words, n, bits, offset, float(scale), out, accumulate)

    def encode_sparse(self, x: Any, mode: int, norm: float, s: int, c: int, bits: int,
                      keys: Keys) -> Any:
        if mode not in (MODE_EXP, MODE_LINEAR_SM):
            raise ValueError(f"encode_sparse: mode {mode} is not MODE_EXP or MODE_LINEAR_SM")
        xp = self.xp
        n = int(x.size)
        codes = xp.empty(n, xp.uint8)
        if n:
            k0, k1 = int_keys(keys)
            self.kernels.codes(x, n, mode, bits, s, c, float(norm), k0, k1, codes)
        pos = xp.flatnonzero(codes)
        cnt = int(pos.size)
        data = xp.empty(4 + 4 * cnt + int(packed_nbytes(cnt, bits)), xp.uint8)
        data[:4] = xp.asarray(np.array([cnt], np.uint32).view(np.uint8))
        if cnt:
            data[4: 4 + 4 * cnt] = pos.astype(xp.uint32).view(xp.uint8)
            self.kernels.pack(xp.ascontiguousarray(codes[pos]), cnt, bits, data[4 + 4 * cnt:])
        return data

    def decode_sparse(self, data: Any, n: int, bits: int, table: Any, scale: float,
                      out: Any) -> int:
        cnt = int(self.to_host(data[:4]).view(np.uint32)[0])
        if sparse_positions_error(data[4: 4 + 4 * cnt].view(self.xp.uint32), n):
            return SPARSE_BAD_POSITIONS
        if cnt:
            self.kernels.decode_sparse(self.xp.ascontiguousarray(data), cnt, bits, table,
                                       np.float32(scale), out)
        return SPARSE_OK

    def exp_combine(self, a: Any, b: Any, out: Any, n_elements: int, first_element_index: int,
                    bits: int, k0: int, k1: int) -> int:
        if first_element_index % PACK_BLOCK != 0 or first_element_index < 0:
            raise ValueError("first_element_index must be a multiple of PACK_BLOCK")
        nbytes = int(packed_nbytes(n_elements, bits))
        if a.size < nbytes or b.size < nbytes or out.size < nbytes:
            raise ValueError("packed buffers are shorter than packed_nbytes(n_elements, bits)")
        n, first = int(n_elements), int(first_element_index)
        # full packing blocks of 4- / 8-bit codes a word per thread, the rest a block each
        aligned = all(self.kernels.address(v) % 4 == 0 for v in (a, b, out))
        full = n // PACK_BLOCK if bits in FAST_BITS and aligned else 0
        if full:
            self.kernels.exp_combine_words(a, b, out, full * PACK_BLOCK, first, int(bits),
                                           int(k0), int(k1))
        if full * PACK_BLOCK < n:
            self.kernels.exp_combine(a, b, out, n, first, int(bits), int(k0), int(k1), full)
        return nbytes
