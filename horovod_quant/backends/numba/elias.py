"""Elias recursive (omega) coding of sparse level codes (QSGD Section 3.2, "Efficient Coding
of Gradients"): the numba kernels of ``qsgd(..., elias=True)``.

A payload is ``[float32 scale per bucket][bit stream]``: per nonzero code in index order,
Elias(gap) | sign bit | Elias(level), ending with the gap that lands on n. Encoding runs after
the fixed-width encoder, from its payload; decoding checks every read and returns an
``ELIAS_*`` status of the backend protocol. The stream, bit for bit: docs/dev/formats.md ("Elias
streams"). The CUDA backend has no Elias kernel (``MissingKernel``).
"""
from __future__ import annotations

import numba
import numpy as np

from ..protocol import (
    ELIAS_BAD_LEVEL,
    ELIAS_NO_TERMINATOR,
    ELIAS_OK,
    ELIAS_PAST_END,
    ELIAS_TRAILING,
    PACK_BLOCK,
)
from .packing import unpack_block

#: Longest binary group the reader takes (values < 2^56, far above any position): a longer one
#: only comes from a corrupt stream, and reading it would overrun the 64-bit bit buffer
_MAX_GROUP = 56


def elias_length(k: int) -> int:
    """|Elias(k)| in bits for an integer k >= 1."""
    if k < 1:
        raise ValueError(f"Elias codes integers >= 1, got {k}")
    total = 1
    while k > 1:
        nbits = k.bit_length()
        total += nbits
        k = nbits - 1
    return total


@numba.njit(inline="always")
def _bit_length(k):
    """Number of binary digits of 1 <= k < 2^53 (exact via the float64 exponent)."""
    return np.int64((np.float64(k).view(np.int64) >> 52) - 1022)


@numba.njit(inline="always")
def _put(out, o, acc, nacc, value, length):
    """Append the low ``length`` (<= 56) bits of ``value`` to the stream. ``acc`` holds
    ``nacc`` < 8 pending bits; whole bytes go to ``out[o:]``. Returns (o, acc, nacc)."""
    acc = (acc << np.uint64(length)) | np.uint64(value)
    nacc += length
    while nacc >= 8:
        nacc -= 8
        out[o] = np.uint8((acc >> np.uint64(nacc)) & np.uint64(0xFF))
        o += 1
    return o, acc, nacc


@numba.njit(inline="always")
def _put_elias(out, o, acc, nacc, k, stack):
    """Append Elias(k), k >= 1: the groups are found from k downwards and written reversed."""
    depth = 0
    while k > 1:
        stack[depth] = k
        depth += 1
        k = _bit_length(k) - 1
    for g in range(depth - 1, -1, -1):
        o, acc, nacc = _put(out, o, acc, nacc, stack[g], _bit_length(stack[g]))
    return _put(out, o, acc, nacc, 0, 1)


@numba.njit(inline="always")
def _get(data, p, buf, nbuf, length):
    """Read ``length`` (1..56) bits. ``buf`` holds ``nbuf`` bits left-aligned; refills from
    ``data[p:]`` (zeros past the end). Returns (value, p, buf, nbuf)."""
    while nbuf <= 56:
        if p < data.size:
            buf |= np.uint64(data[p]) << np.uint64(56 - nbuf)
        p += 1
        nbuf += 8
    v = buf >> np.uint64(64 - length)
    buf = buf << np.uint64(length)
    return np.int64(v), p, buf, nbuf - length


@numba.njit(inline="always")
def _get_elias(data, p, buf, nbuf):
    """Read one Elias code; returns (k, p, buf, nbuf). Stops at 2^_MAX_GROUP (corrupt data)."""
    k = np.int64(1)
    while True:
        bit, p, buf, nbuf = _get(data, p, buf, nbuf, 1)
        if bit == 0 or k >= _MAX_GROUP:
            return k, p, buf, nbuf
        rest, p, buf, nbuf = _get(data, p, buf, nbuf, k)
        k = (np.int64(1) << k) | rest


@numba.njit(cache=True, nogil=True)
def elias_encode_ints(values):
    """Elias codes of ``values`` (int64, each in [1, 2^53)) concatenated, zero-padded to a
    byte. Returns a uint8 array."""
    total = 0
    for v in values:
        k = v
        total += 1
        while k > 1:
            nb = _bit_length(k)
            total += nb
            k = nb - 1
    out = np.empty((total + 7) // 8 + 1, np.uint8)
    stack = np.empty(8, np.int64)
    o, acc, nacc = 0, np.uint64(0), 0
    for v in values:
        o, acc, nacc = _put_elias(out, o, acc, nacc, v, stack)
    if nacc:
        o, acc, nacc = _put(out, o, acc, nacc, 0, 8 - nacc)
    return out[:o]


@numba.njit(cache=True, nogil=True)
def _decode_ints(data, out):
    """Fill ``out`` with the first ``out.size`` Elias-coded integers of ``data``; returns the
    number of bits read (more than ``8 * data.size`` when the stream ran out: the reader
    returns zeros past the end, and stops at the first integer that needs them)."""
    p, buf, nbuf = 0, np.uint64(0), 0
    limit = 8 * data.size
    for i in range(out.size):
        out[i], p, buf, nbuf = _get_elias(data, p, buf, nbuf)
        if 8 * p - nbuf > limit:
            break
    return 8 * p - nbuf


def elias_decode_ints(data: np.ndarray, count: int) -> np.ndarray:
    """The first ``count`` Elias-coded integers of ``data`` (uint8). Raises ValueError when the
    stream ends before ``count`` integers."""
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
        raise ValueError(f"Elias: count={count!r} must be an integer >= 0")
    data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    out = np.empty(int(count), np.int64)
    used = _decode_ints(data, out)
    if used > 8 * data.size:
        raise ValueError(f"Elias: the stream of {data.size} bytes ends before {count} integers")
    return out


@numba.njit(cache=True, nogil=True)
def elias_encode_levels(data, n, bucket, bits):
    """The Elias payload of a fixed-width level payload ``data`` (layout of
    :func:`.levels.encode_levels`: [float32 scale per bucket][packed codes]) holding n
    codes of ``bits`` bits. Returns a new uint8 array (docs/dev/formats.md, "Elias streams")."""
    nb = (n + bucket - 1) // bucket
    head = 4 * nb
    codes = np.empty(PACK_BLOCK + 8, np.uint8)
    wide = codes[: PACK_BLOCK // 8 * 8 + 8].view(np.uint64)
    mag_mask = np.int64((1 << (bits - 1)) - 1)
    # a nonzero takes at most 2 * 64 + 1 bits; the buffer doubles when fewer bytes are left
    out = np.empty(head + 64 + (n * bits) // 32, np.uint8)
    out[:head] = data[:head]
    stack = np.empty(8, np.int64)
    w, acc, nacc = head, np.uint64(0), 0
    prev = -1
    o = head
    for b0 in range(0, n, PACK_BLOCK):
        m = min(PACK_BLOCK, n - b0)
        o = unpack_block(data, o, m, bits, codes)
        codes[m : m + 8] = 0
        for t in range((m + 7) // 8):
            if wide[t] == 0:  # eight zero codes at once: the sparse regime's common case
                continue
            for j in range(8 * t, 8 * t + 8):
                c = np.int64(codes[j])
                if c != 0:
                    if w + 24 > out.size:
                        grown = np.empty(2 * out.size, np.uint8)
                        grown[:w] = out[:w]
                        out = grown
                    pos = b0 + j
                    w, acc, nacc = _put_elias(out, w, acc, nacc, pos - prev, stack)
                    w, acc, nacc = _put(out, w, acc, nacc, c >> (bits - 1), 1)
                    w, acc, nacc = _put_elias(out, w, acc, nacc, c & mag_mask, stack)
                    prev = pos
    if w + 24 > out.size:
        grown = np.empty(w + 24, np.uint8)
        grown[:w] = out[:w]
        out = grown
    # terminator: the gap that lands exactly on n
    w, acc, nacc = _put_elias(out, w, acc, nacc, n - prev, stack)
    if nacc:
        w, acc, nacc = _put(out, w, acc, nacc, 0, 8 - nacc)
    return out[:w].copy()


@numba.njit(cache=True, nogil=True)
def elias_decode(data, n, bucket, bits, table, out, accumulate):
    """Decode an Elias payload (:func:`elias_encode_levels`) into ``out`` (``+=`` if
    accumulate): ``table[code] * scale`` at each nonzero, 0 elsewhere; a bucket with a
    non-finite scale decodes to ``scale * 0`` (NaN), as the fixed-width decoder gives.

    ``out`` must hold n elements and ``data`` at least ``4 * ceil(n / bucket)`` bytes (the
    caller checks, :meth:`.quantizers.QSGD.wire_layout`). Every read of the stream is checked
    before anything is written: a position must be < n, a level < 2^(bits-1), no code may read
    past the stream's end, and the stream must end (up to its padding) at the terminator.
    Returns ``ELIAS_OK`` (0), or the status of the first violation (``out`` then holds a
    partial result).
    """
    nb = (n + bucket - 1) // bucket
    if data.size < 4 * nb or out.size < n:
        return ELIAS_NO_TERMINATOR
    scales = data[: 4 * nb].view(np.float32)
    if not accumulate:
        out[:] = 0
    for b in range(nb):
        sc = scales[b]
        if not np.isfinite(sc):
            lo = b * bucket
            for i in range(lo, min(lo + bucket, n)):
                out[i] += sc * np.float32(0.0)
    stream = data[4 * nb :]
    limit = 8 * stream.size
    top = 1 << (bits - 1)
    p, buf, nbuf = 0, np.uint64(0), 0
    pos = np.int64(-1)
    while True:
        gap, p, buf, nbuf = _get_elias(stream, p, buf, nbuf)
        pos += gap
        if pos >= n:
            used = 8 * p - nbuf
            if pos > n:
                return ELIAS_PAST_END
            if used > limit:
                return ELIAS_NO_TERMINATOR
            if (used + 7) // 8 != stream.size:
                return ELIAS_TRAILING
            return ELIAS_OK
        sign, p, buf, nbuf = _get(stream, p, buf, nbuf, 1)
        mag, p, buf, nbuf = _get_elias(stream, p, buf, nbuf)
        if 8 * p - nbuf > limit:
            return ELIAS_NO_TERMINATOR
        if mag >= top:
            return ELIAS_BAD_LEVEL
        out[pos] += table[(sign << (bits - 1)) | mag] * scales[pos // bucket]
