"""Launch every CUDA kernel of kernels/*.cu once, on small valid inputs: for
compute-sanitizer (memcheck, racecheck) and for profiling one kernel with ncu.

Every specialisation is launched: the warp-tile encodes (each mode, scale kind and 4 / 8 bits),
the generic block encodes (each mode, bits 2..8), the word decodes (levels and DQSG at 4 / 8
bits, one payload and nine: two launches), the group decodes (bits 2..8), and the other
kernels (scales, codes, packing, Global-QSGD words and exponent combination, NDQSG, norm
statistics). Each case goes through the CUDA backend's entry points with the inputs that select
its program (a misaligned input for the block encodes of 4 / 8 bits, a bucket that is not a
power of two for the group decodes, ...), and the kernels it launches are printed (names as
ncu shows them). Without --only / --kernels the run fails if a kernel of
horovod_quant.backends.cuda.specs.kernel_names() was not launched.

examples:
  compute-sanitizer --tool memcheck python3 benchmarks/kernel_launches.py
  compute-sanitizer --tool racecheck python3 benchmarks/kernel_launches.py
  ncu -k regex:hq_encode_tile_uniform_max_8b -c 1 python3 benchmarks/kernel_launches.py \\
      --size 256M --only encode --kernels uniform_max_8b
  ncu -k regex:hq_decode_words_levels_4b -c 1 python3 benchmarks/kernel_launches.py \\
      --size 256M --only decode --kernels words_levels_4b
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from typing import Any, Callable, NamedTuple

import numpy as np

import horovod_quant as hq
from horovod_quant.backends import (
    MODE_DITHER,
    MODE_EXP,
    MODE_LINEAR_SM,
    MODE_NESTED,
    MODE_UNIFORM,
    NORM_L2,
    NORM_MAX,
    PACK_BLOCK,
    SCALED_MODES,
    numba_backend,
    packed_nbytes,
)
from horovod_quant.backends.cuda.specs import (
    CODE_BITS,
    FAST_BITS,
    MODE_NAMES,
    block_encode_kernel,
    decode_kernel,
    exp_combine_kernel,
    kernel_names,
    tile_encode_kernel,
    tile_encode_specs,
)

KEYS = (0x12345678, 0x9ABCDEF0)


class Case(NamedTuple):
    """A launch: the kernels it runs (entry point names), encode / decode / other, and the
    call ``run(backend, xp, n)``."""

    kernels: tuple[str, ...]
    direction: str
    run: Callable[[Any, Any, int], None]


def _params(mode: int, bits: int) -> dict:
    """Encode keywords of a codec of ``mode`` with ``bits``-bit codes."""
    if mode == MODE_UNIFORM:
        return {"s": hq.get_codec("qsgd", bits=bits).s}
    if mode == MODE_EXP:
        codec = hq.get_codec("global_qsgd", world_size=1, bits=bits, levels="exponential")
        return {"s": codec.s, "c": codec.c, "gnorm": 8.0}
    if mode == MODE_DITHER:
        return {"M": (1 << (bits - 1)) - 1, "am": float((1 << (bits - 1)) - 1)}
    if mode == MODE_NESTED:
        return {"M": 127, "k": (1 << bits) - 1, "am": float(np.float32(0.7 * 127))}
    return {"s": hq.get_codec("natural_dithering", bits=bits).s}


def _input(xp: Any, n: int, seed: int = 0) -> Any:
    return xp.asarray(np.random.default_rng(seed).standard_normal(n).astype(np.float32))


def _payload(be: Any, xp: Any, x: Any, mode: int, bits: int, bucket: int, offset: int = 0,
             norm_kind: int = NORM_MAX, keys: tuple = KEYS) -> Any:
    n = int(x.size)
    size = offset + (4 * -(-n // bucket) if mode in SCALED_MODES else 0) + packed_nbytes(n, bits)
    out = xp.zeros(size, np.uint8)
    be.encode(x, out, offset, bucket, mode, bits, keys, norm_kind=norm_kind,
              **_params(mode, bits))
    return out


def _tile_case(mode: int, kind: int, bits: int) -> Case:
    def run(be, xp, n):
        full = max(PACK_BLOCK, n // PACK_BLOCK * PACK_BLOCK)  # full blocks only: the tile alone
        x = _input(xp, full)
        _payload(be, xp, x, mode, bits, full if mode == MODE_EXP else 512, norm_kind=kind,
                 offset=4 if mode == MODE_NESTED else 0)
    return Case((tile_encode_kernel(mode, kind, bits),), "encode", run)


def _block_case(mode: int, bits: int) -> Case:
    def run(be, xp, n):
        x = _input(xp, n + 1)[1:]  # not 16-byte aligned: the generic program, every block
        _payload(be, xp, x, mode, bits, 512, offset=4 if mode == MODE_NESTED else 0)
    return Case((block_encode_kernel(mode, bits),), "encode", run)


def _level_decode_case(bits: int, words: bool, payloads: int) -> Case:
    bucket = 512 if words else 100

    def run(be, xp, n):  # one payload (encoded on the host) stands for every peer
        m = max(PACK_BLOCK, n // PACK_BLOCK * PACK_BLOCK) if words else n
        codec = hq.get_codec("qsgd", bits=bits)
        pay = xp.asarray(_payload(numba_backend(), np, _input(np, m), MODE_UNIFORM, bits,
                                  bucket))
        out = xp.empty(m, np.float32)
        be.combine_levels([pay] * payloads, m, bucket, bits, be.constant(codec.table),
                          1.0 / payloads, out)
    return Case((decode_kernel("levels", words, bits),), "decode", run)


def _dither_decode_case(bits: int, words: bool, payloads: int) -> Case:
    bucket = 512 if words else 100

    def run(be, xp, n):  # one payload for every peer, each with its own keys
        m = max(PACK_BLOCK, n // PACK_BLOCK * PACK_BLOCK) if words else n
        pay = xp.asarray(_payload(numba_backend(), np, _input(np, m), MODE_DITHER, bits,
                                  bucket))
        out = xp.empty(m, np.float32)
        be.decode_dither([pay] * payloads, [(r, 77) for r in range(payloads)], 0, m, bucket,
                         bits, (1 << (bits - 1)) - 1, out, False, 1.0 / payloads)
    return Case((decode_kernel("dither", words, bits),), "decode", run)


def _other_cases() -> list[Case]:
    def scales(be, xp, n):  # buckets across packing blocks: scales before the encode
        x = _input(xp, n + 1)[1:]
        for kind in (NORM_L2, NORM_MAX):
            _payload(be, xp, x, MODE_UNIFORM, 3, PACK_BLOCK + 1, norm_kind=kind)

    def sparse(be, xp, n):
        x = _input(xp, n)
        for mode in (MODE_EXP, MODE_LINEAR_SM):
            data = be.encode_sparse(x, mode, 40.0, 3, 2, 8, KEYS)
            out = xp.zeros(n, np.float32)
            be.decode_sparse(data, n, 8, be.constant(np.linspace(-1, 1, 256, dtype=np.float32)),
                             0.5, out)

    def unpack(be, xp, n):
        packed = _payload(be, xp, _input(xp, n), MODE_EXP, 3, n)
        be.kernels.unpack(packed, n, 3, xp.empty(n, np.uint8))

    def elementwise(be, xp, n):
        x = _input(xp, n)
        be.scale(x, 0.5, xp.empty(n, np.float32))
        be.vector(x.astype(np.float64))
        be.max_abs(x)
        be.sum_squares(x)

    def linear(be, xp, n):
        x = _input(xp, n)
        words = xp.empty(-(-n // 8), np.uint64)
        be.linear_encode(x, 8, 60, 40.0, KEYS, words)
        be.linear_decode(words, n, 8, 60, 0.01, xp.empty(n, np.float32), False)

    def exp_combine(be, xp, n):  # full packing blocks (words) and a partial one (block)
        m = max(PACK_BLOCK, n // PACK_BLOCK * PACK_BLOCK) + 5
        for bits in FAST_BITS:
            a, b = (xp.asarray(_payload(numba_backend(), np, _input(np, m, r), MODE_EXP, bits, m))
                    for r in (1, 2))
            be.exp_combine(a, b, a, m, 0, bits, *KEYS)

    def nested(be, xp, n):
        data = _payload(be, xp, _input(xp, n), MODE_NESTED, 3, 512, offset=4)
        p = _params(MODE_NESTED, 3)
        be.decode_nested(data, 4, n, 512, p["M"], p["k"], 3, p["am"], 0.7, _input(xp, n, 3),
                         KEYS, xp.zeros(n, np.float32))

    def host_mean(be, xp, n):  # the hierarchical exchange's host mean of three shards
        be.mean_in_order([_input(xp, n, r) for r in range(3)], 3, xp.empty(n, np.float32))

    return [
        Case(("hq_scales", "hq_max_bits", "hq_scales_from_bits",
              block_encode_kernel(MODE_UNIFORM, 3)), "encode", scales),
        Case(("hq_codes", "hq_pack", "hq_decode_sparse"), "other", sparse),
        Case((block_encode_kernel(MODE_EXP, 3), "hq_unpack"), "other", unpack),
        Case(("hq_scale", "hq_to_f32", "hq_max_abs_bits", "hq_sum_squares"), "other",
             elementwise),
        Case(("hq_linear_encode", "hq_linear_decode"), "other", linear),
        Case((*(exp_combine_kernel(True, b) for b in FAST_BITS), exp_combine_kernel(False, 8)),
             "other", exp_combine),
        Case((block_encode_kernel(MODE_NESTED, 3), "hq_decode_nested", "hq_resid_sum"), "other",
             nested),
        Case(("hq_mean_parts",), "other", host_mean),
    ]


def cases() -> list[Case]:
    """Every launch, in order: encodes, decodes (one payload and nine), the rest."""
    out = [_tile_case(*spec) for spec in tile_encode_specs()]
    out += [_block_case(mode, bits) for mode in MODE_NAMES for bits in CODE_BITS]
    for bits in FAST_BITS:
        out += [_level_decode_case(bits, True, 1), _level_decode_case(bits, True, 9),
                _dither_decode_case(bits, True, 1), _dither_decode_case(bits, True, 9)]
    for bits in CODE_BITS:
        out += [_level_decode_case(bits, False, 2), _dither_decode_case(bits, False, 2)]
    return out + _other_cases()


def select(all_cases: list[Case], only: str | None, pattern: str | None) -> list[Case]:
    """The cases of direction ``only`` whose kernels match the regular expression
    ``pattern``."""
    rx = re.compile(pattern) if pattern else None
    return [c for c in all_cases if (only is None or c.direction == only)
            and (rx is None or any(rx.search(k) for k in c.kernels))]


def run_cases(be: Any, xp: Any, n: int, chosen: list[Case]) -> None:
    for c in chosen:
        c.run(be, xp, n)


def main(argv: list[str] | None = None) -> int:
    summary, _, rest = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(description=summary, epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="20000",
                    help="elements per launch, e.g. 20000, 64M (default: 20000, a few packing "
                         "blocks and a partial one)")
    ap.add_argument("--only", choices=("encode", "decode"), default=None,
                    help="launch only the encode or only the decode cases")
    ap.add_argument("--kernels", default=None, metavar="REGEX",
                    help="launch only the cases with a kernel whose name matches REGEX")
    ap.add_argument("--list", action="store_true", help="list the cases, launch nothing")
    args = ap.parse_args(argv)
    text = args.size.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    n = int(float(text.rstrip("KMG")) * mult)
    chosen = select(cases(), args.only, args.kernels)
    if args.list:
        for c in chosen:
            print(f"{c.direction:<7} {' '.join(c.kernels)}")
        return 0

    import cupy

    import horovod_quant.gpu as gpu
    from horovod_quant.backends.cuda import cuda_backend
    from horovod_quant.backends.cuda import kernels as K

    gpu.compile_kernels()
    launched: Counter = Counter()
    get_function = K.get_function

    def recording(fname: str, kernel: str) -> Any:
        launched[kernel] += 1
        return get_function(fname, kernel)

    K.get_function = recording
    run_cases(cuda_backend(), cupy, n, chosen)
    cupy.cuda.get_current_stream().synchronize()
    for name, count in launched.items():
        print(f"launched {name}" + (f" x{count}" if count > 1 else ""))
    expected = {k for c in chosen for k in c.kernels}
    missing = sorted(expected - set(launched))
    if args.only is None and args.kernels is None:
        missing = sorted({k for ks in kernel_names().values() for k in ks} - set(launched))
    print(f"# {len(launched)} kernels, {sum(launched.values())} launches, {n} elements")
    if missing:
        print("# not launched: " + " ".join(missing), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
