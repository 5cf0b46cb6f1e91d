"""Bit packing of b-bit codes (b = 1..8) into bytes, block by block, in the layout of
docs/dev/formats.md ("Packed codes"): each binary digit group of b in its own plane, segment-strided
so that packing and unpacking are plain vertical loops that compilers vectorize. The CUDA twin
is ``kernels/hq_common.cuh``; block size and byte counts are the protocol's
(:data:`~horovod_quant.backends.protocol.PACK_BLOCK`, :func:`~..protocol.packed_nbytes`).
"""
from __future__ import annotations

import numba
import numpy as np

from .. import protocol
from ..protocol import PACK_BLOCK

#: :func:`horovod_quant.backends.protocol.packed_nbytes` compiled, for kernels that size buffers
packed_nbytes = numba.njit(cache=True, nogil=True)(protocol.packed_nbytes)


@numba.njit(inline="always")
def _plane_shift(bits, plane):
    """(width, shift) of the plane-th field of a ``bits``-wide code, or (0, 0) past the last."""
    if bits == 8:
        return (8, 0) if plane == 0 else (0, 0)
    shift = 0
    k = 0
    for w in (1, 2, 4):
        if bits & w:
            if k == plane:
                return (w, shift)
            k += 1
            shift += w
    return (0, 0)


@numba.njit(inline="always")
def pack_block(codes, m, bits, out, o):
    """Pack ``codes[:m]`` (uint8, each < 2**bits) into ``out[o:]``. ``codes`` must have room for
    ``m + 8`` entries; entries past m are overwritten with zeros. Returns the new offset."""
    for i in range(m, min(m + 8, codes.size)):
        codes[i] = 0
    for plane in range(4):
        w, shift = _plane_shift(bits, plane)
        if w == 0:
            break
        mask = np.uint8((1 << w) - 1)
        per = 8 // w
        L = (m + per - 1) // per
        if w == 8:
            out[o : o + m] = codes[:m]
        elif w == 4:
            dst = out[o : o + L]
            c0, c1 = codes[:L], codes[L : 2 * L]
            for j in range(L):
                dst[j] = np.uint8(((c0[j] >> shift) & mask) | (((c1[j] >> shift) & mask) << 4))
        elif w == 2:
            dst = out[o : o + L]
            c0, c1, c2, c3 = codes[:L], codes[L : 2 * L], codes[2 * L : 3 * L], codes[3 * L : 4 * L]
            for j in range(L):
                dst[j] = np.uint8(
                    ((c0[j] >> shift) & mask)
                    | (((c1[j] >> shift) & mask) << 2)
                    | (((c2[j] >> shift) & mask) << 4)
                    | (((c3[j] >> shift) & mask) << 6)
                )
        else:
            for j in range(L):
                v = np.uint8(0)
                for t in range(8):
                    v |= np.uint8(((codes[j + t * L] >> shift) & 1) << t)
                out[o + j] = v
        o += L
    return o


@numba.njit(inline="always")
def unpack_block(data, o, m, bits, codes):
    """Inverse of :func:`pack_block`: fill ``codes[:m]`` from ``data[o:]``; returns new offset.
    ``codes`` must have room for ``m + 8`` entries."""
    for i in range(m + 8 if m + 8 <= codes.size else codes.size):
        codes[i] = 0
    for plane in range(4):
        w, shift = _plane_shift(bits, plane)
        if w == 0:
            break
        mask = np.uint8((1 << w) - 1)
        per = 8 // w
        L = (m + per - 1) // per
        if w == 8:
            codes[:m] = data[o : o + m]
        else:
            src = data[o : o + L]
            for t in range(per):
                dst = codes[t * L : (t + 1) * L]
                sh = t * w
                for j in range(L):
                    dst[j] |= np.uint8(((src[j] >> sh) & mask) << shift)
        o += L
    return o


@numba.njit(cache=True, nogil=True)
def pack(codes, bits):
    """Pack a whole uint8 code array (values < 2**bits) into a new uint8 array."""
    n = codes.size
    out = np.empty(packed_nbytes(n, bits), np.uint8)
    scratch = np.empty(PACK_BLOCK + 8, np.uint8)
    o = 0
    for b0 in range(0, n, PACK_BLOCK):
        m = min(PACK_BLOCK, n - b0)
        scratch[:m] = codes[b0 : b0 + m]
        o = pack_block(scratch, m, bits, out, o)
    return out


@numba.njit(cache=True, nogil=True)
def unpack(data, n, bits):
    """Unpack ``n`` codes of ``bits`` bits from ``data``."""
    out = np.empty(n, np.uint8)
    scratch = np.empty(PACK_BLOCK + 8, np.uint8)
    o = 0
    for b0 in range(0, n, PACK_BLOCK):
        m = min(PACK_BLOCK, n - b0)
        o = unpack_block(data, o, m, bits, scratch)
        out[b0 : b0 + m] = scratch[:m]
    return out
