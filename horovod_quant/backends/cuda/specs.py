"""The specialisations compiled from ``kernels/*.cu`` and the names of their entry points.

The CUDA sources instantiate each encode and decode program per mode, bit width and (for the
warp-tile encode) scale kind, through the lists ``HQ_TILE_ENCODES``, ``HQ_BLOCK_ENCODES``,
``HQ_WORD_DECODES`` and ``HQ_GROUP_DECODES`` of ``kernels/hq_codes.cuh``; this module is their
Python side: the launch logic asks it which fast paths exist, the launcher which entry point
to call, ``benchmarks/kernel_launches.py`` what to launch, and ``tests/cuda_parity`` checks that
the compiled entry points are exactly :func:`kernel_names`. Names are built so that a profiler
filter can pick one kernel, e.g. ``ncu -k regex:hq_encode_tile_uniform_max_8b``.
"""
from __future__ import annotations

from ..protocol import (
    MODE_DITHER,
    MODE_EXP,
    MODE_GEOMETRIC,
    MODE_NESTED,
    MODE_UNIFORM,
    NORM_L2,
    NORM_MAX,
    NORM_POW2,
)

#: encode modes as they appear in kernel names
MODE_NAMES = {MODE_UNIFORM: "uniform", MODE_GEOMETRIC: "geometric", MODE_EXP: "exp",
              MODE_DITHER: "dither", MODE_NESTED: "nested"}
#: bit widths of the fast programs (warp-tile encode, word decode): a code word of 4 bytes
#: holds whole codes of one (8 bits) or two (4 bits) parts of a packing block
FAST_BITS = (4, 8)
#: bit widths of the generic programs (HQ_CODE_BITS)
CODE_BITS = tuple(range(2, 9))
#: scale kinds of the warp-tile encode: order-free maxima, and L2 norms (their ordered float64
#: sums from the warp's shared memory); Global-QSGD's exponent codes use the global norm and
#: have no scales
TILE_SCALES = {NORM_MAX: "max", NORM_POW2: "pow2", NORM_L2: "l2"}
#: bucket sizes of the warp-tile encode: powers of two 2^2 .. 2^9 (a bucket lies in one part)
TILE_LOG2_BUCKETS = range(2, 10)
#: units per packing block of the warp-tile encode (HqTileShape<bits>::UNITS)
TILE_UNITS = {4: 8, 8: 16}
#: decode value kinds and the file of their kernels
DECODE_FILES = {"levels": "levels.cu", "dither": "dithered.cu"}


def tile_encode_specs() -> list[tuple[int, int, int]]:
    """``(mode, scale kind, bits)`` of every warp-tile encode (HQ_TILE_ENCODES)."""
    modes = [(m, k) for m in (MODE_UNIFORM, MODE_GEOMETRIC) for k in TILE_SCALES]
    modes += [(MODE_EXP, NORM_MAX), (MODE_DITHER, NORM_MAX), (MODE_NESTED, NORM_MAX)]
    return [(m, k, b) for b in FAST_BITS for m, k in modes]


def tile_encode_kernel(mode: int, kind: int, bits: int) -> str:
    """Entry point of the warp-tile encode of ``mode`` with scale ``kind`` (``NORM_MAX`` for
    the exponent codes, which have none)."""
    scale = "global" if mode == MODE_EXP else TILE_SCALES[kind]
    return f"hq_encode_tile_{MODE_NAMES[mode]}_{scale}_{bits}b"


def block_encode_kernel(mode: int, bits: int) -> str:
    """Entry point of the generic (block per packing block) encode."""
    return f"hq_encode_block_{MODE_NAMES[mode]}_{bits}b"


def decode_kernel(values: str, words: bool, bits: int) -> str:
    """Entry point of a decode: ``values`` "levels" or "dither", the word program (fast) or
    the group program (generic)."""
    return f"hq_decode_{'words' if words else 'groups'}_{values}_{bits}b"


def exp_combine_kernel(words: bool, bits: int) -> str:
    """Entry point of the exponent combination: the word program (fast, per bit width) or the
    block program (one kernel for every width)."""
    return f"hq_exp_combine_words_{bits}b" if words else "hq_exp_combine"


def kernel_names() -> dict[str, list[str]]:
    """Every entry point of every ``kernels/*.cu`` file."""
    levels = [tile_encode_kernel(*spec) for spec in tile_encode_specs()]
    levels += [block_encode_kernel(m, b) for m in MODE_NAMES for b in CODE_BITS]
    decodes: dict[str, list[str]] = {f: [] for f in DECODE_FILES.values()}
    for values, fname in DECODE_FILES.items():
        decodes[fname] += [decode_kernel(values, True, b) for b in FAST_BITS]
        decodes[fname] += [decode_kernel(values, False, b) for b in CODE_BITS]
    levels += decodes["levels.cu"] + [
        "hq_scales", "hq_max_bits", "hq_scales_from_bits", "hq_codes", "hq_pack", "hq_unpack",
        "hq_scale", "hq_to_f32"]
    return {
        "levels.cu": levels,
        "dithered.cu": decodes["dithered.cu"] + ["hq_decode_nested", "hq_resid_sum"],
        "global_qsgd.cu": [exp_combine_kernel(True, b) for b in FAST_BITS] + [
            "hq_linear_encode", "hq_linear_decode", exp_combine_kernel(False, 8),
            "hq_max_abs_bits", "hq_sum_squares", "hq_decode_sparse"],
        "reduce.cu": ["hq_mean_parts"],
    }
