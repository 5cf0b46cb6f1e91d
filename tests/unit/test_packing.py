"""Bit packing (backends/numba/packing.py) against a plain-Python packer of the documented
layout."""
from __future__ import annotations

import numpy as np
import pytest

from horovod_quant.backends.numba.packing import PACK_BLOCK, pack, packed_nbytes, unpack

SIZES = [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 63, 100, 255, 256, 257, 1000, 4095,
         PACK_BLOCK - 1, PACK_BLOCK, PACK_BLOCK + 1, 2 * PACK_BLOCK + 37]


def _codes(n, bits, seed):
    return np.random.default_rng(seed).integers(0, 1 << bits, n).astype(np.uint8)


@pytest.mark.parametrize("bits", range(1, 9))
def test_round_trip_and_size(bits, ref):
    for n in SIZES:
        c = _codes(n, bits, n * 10 + bits)
        packed = pack(c, bits)
        assert packed.dtype == np.uint8 and packed.size == packed_nbytes(n, bits)
        assert packed.size == ref.ref_packed_nbytes(n, bits)
        np.testing.assert_array_equal(unpack(packed, n, bits), c)
        # exactly ceil(m * b / 8) per block up to one byte of rounding per plane
        planes = len(ref.plane_widths(bits))
        blocks = -(-n // PACK_BLOCK)
        assert n * bits <= packed.size * 8 <= n * bits + 8 * planes * blocks
        if n % PACK_BLOCK == 0:
            assert packed.size * 8 == n * bits


@pytest.mark.parametrize("bits", range(1, 9))
def test_layout_matches_documentation(bits, ref):
    """Bytes equal the plain-Python packer of the module doc (segment-strided bit planes)."""
    for n in (0, 1, 5, 8, 13, 64, 1001, PACK_BLOCK + 3):
        c = _codes(n, bits, 7 * n + bits)
        assert pack(c, bits).tobytes() == ref.ref_pack(c, bits)


def test_layout_small_example():
    # 4-bit codes, m = 3: L = 2 bytes; byte j holds codes j (low nibble) and j + L (high)
    assert list(pack(np.array([1, 2, 3], np.uint8), 4)) == [1 | 3 << 4, 2]
    # 3-bit codes = a 1-bit plane (bit 0) then a 2-bit plane (bits 1-2)
    c = np.array([0b101, 0b010, 0b111], np.uint8)
    # 1-bit plane, L = 1: bit t of byte 0 = bit 0 of code t
    # 2-bit plane, L = 1: field t of byte 0 = bits 1-2 of code t
    assert list(pack(c, 3)) == [0b101, 0b11 << 4 | 0b01 << 2 | 0b10]


def test_all_values_and_extremes():
    for bits in range(1, 9):
        vals = np.arange(1 << bits, dtype=np.uint8)
        c = np.tile(vals, 40)
        np.testing.assert_array_equal(unpack(pack(c, bits), c.size, bits), c)
        full = np.full(PACK_BLOCK + 9, (1 << bits) - 1, np.uint8)
        np.testing.assert_array_equal(unpack(pack(full, bits), full.size, bits), full)


def test_unpack_ignores_trailing_bytes():
    c = _codes(1000, 5, 1)
    data = np.concatenate([pack(c, 5), np.full(17, 255, np.uint8)])
    np.testing.assert_array_equal(unpack(data, 1000, 5), c)


def test_blocks_are_independent():
    """Each PACK_BLOCK of codes packs on its own: packing a prefix of whole blocks gives a
    prefix of the bytes (what lets the GPU kernel pack blocks in parallel)."""
    for bits in (1, 3, 4, 6, 8):
        c = _codes(3 * PACK_BLOCK + 100, bits, bits)
        full = pack(c, bits)
        head = pack(c[: 2 * PACK_BLOCK], bits)
        assert full[: head.size].tobytes() == head.tobytes()
