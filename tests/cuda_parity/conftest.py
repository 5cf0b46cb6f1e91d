"""Host build of the CUDA block programs (tests/cuda_parity/host_parity.cu) for the parity tests.

``nvcc`` compiles the __host__ __device__ code of ``kernels/*.cuh`` for the CPU into a shared
library (once per session); :class:`HostBackend` exposes it as the kernel launcher of
:class:`horovod_quant.backends.cuda.CudaBackend` on NumPy arrays, so the ``host_cuda`` fixture
(``CudaBackend(HostBackend(lib))``) runs the GPU code path (Python launch logic + block
programs) on this machine. Without nvcc every test here skips.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from horovod_quant.backends.cuda.launch import MAX_PAYLOADS, DitherValues, log2_exact
from horovod_quant.backends.cuda.specs import (
    TILE_UNITS,
    block_encode_kernel,
    decode_kernel,
    exp_combine_kernel,
    tile_encode_kernel,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
NVCC = os.environ.get("NVCC") or shutil.which("nvcc") or (
    "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)

#: host compile flags: no contraction anywhere (device: -fmad=false; host: -ffp-contract=off)
HOST_FLAGS = ["-x", "cu", "-shared", "-std=c++17", "-O2", "-fmad=false", "-Werror", "all-warnings",
              "-Xcompiler", "-fPIC", "-Xcompiler", "-ffp-contract=off"]

P = ctypes.c_void_p
I32, I64, U32, U64 = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint64
F32, F64 = ctypes.c_float, ctypes.c_double

_SIGS = {
    "hqh_splitmix64": (U64, [U64]),
    "hqh_derive_key": (U64, [U64, P, I32]),
    "hqh_hash32": (None, [P, I64, U32, U32, P]),
    "hqh_hash32_lo": (None, [P, I64, U32, U32, P]),
    "hqh_block_key": (None, [P, I64, U32, P]),
    "hqh_u24": (None, [P, I64, P]),
    "hqh_packed_nbytes": (I64, [I64, I32]),
    "hqh_pack": (None, [P, I64, I32, P, I32]),
    "hqh_unpack": (None, [P, I64, I32, P]),
    "hqh_scales": (None, [P, I64, I64, I32, F64, P, I32]),
    "hqh_max_scales": (None, [P, I64, I64, I32, P, I32]),
    "hqh_encode_tile": (I32, [I32, I32, I32, P, I64, I32, I32, I32, I32, I32, F32, F32, U32, U32,
                              P, I64, I64]),
    "hqh_encode_block": (I32, [I32, I32, P, I64, I64, I32, F64, I32, I32, I32, I32, F32, F32,
                               U32, U32, P, I64, I64, I32, I64, I32]),
    "hqh_codes": (None, [P, I64, I32, I32, I32, I32, F32, U32, U32, P]),
    "hqh_decode": (I32, [I32, I32, I32, P, I32, I64, I64, F32, I64, I64, I32, P, I32, I32, F32,
                         I64, P, P, I32]),
    "hqh_decode_nested": (None, [P, I64, I64, I64, I64, I32, I32, I32, F32, F32, P, U32, U32, P,
                                 P, P]),
    "hqh_linear_encode": (None, [P, I64, I32, I32, F32, U32, U32, P, I64]),
    "hqh_linear_decode": (None, [P, I64, I32, I32, F32, P, I32]),
    "hqh_exp_combine": (None, [P, P, P, I64, I64, I32, U32, U32, I64, I32]),
    "hqh_exp_combine_words": (I32, [P, P, P, I64, I64, I32, U32, U32]),
    "hqh_combine_elem": (U32, [U32, U32, U64, I32, U32, U32]),
    "hqh_combine_codes": (I32, [I32, I32, U32, I32]),
    "hqh_max_abs_bits": (I32, [P, I64]),
    "hqh_sum_squares": (F64, [P, I64]),
    "hqh_scale": (None, [P, I64, F32, P]),
    "hqh_to_f32": (None, [P, I64, P]),
    "hqh_decode_sparse": (None, [P, I64, I32, P, F32, P]),
    "hqh_mean_parts": (None, [P, I32, I64, F32, P]),
}


def build_hostlib(out_dir: Path) -> ctypes.CDLL:
    """Compile tests/cuda_parity/host_parity.cu (+ kernels/*.cuh) with nvcc for the host, once
    per ``out_dir``: pytest-xdist's workers of one run share the folder, and the first to take
    its lock builds while the others wait (a build takes a core for 11 s)."""
    lib_path = out_dir / "libhq_host.so"
    with open(out_dir / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib_path.exists():
            built = out_dir / "libhq_host.so.part"  # renamed once whole: no half-built library
            cmd = [NVCC, *HOST_FLAGS, str(HERE / "host_parity.cu"), "-o", str(built)]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if res.returncode != 0:
                raise RuntimeError(
                    f"nvcc failed ({' '.join(cmd)}):\n{res.stdout}\n{res.stderr}")
            os.replace(built, lib_path)
    lib = ctypes.CDLL(str(lib_path))
    for name, (restype, argtypes) in _SIGS.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def ptr(a: np.ndarray) -> int:
    return a.ctypes.data


class HostBackend:
    """The kernel launcher of :class:`horovod_quant.backends.cuda.CudaBackend` (see its module
    doc) on NumPy arrays, each call replaying the kernel of the same name on the CPU.
    ``launched`` lists the specialised entry points replayed (names as on the GPU), so tests
    can check which program ran."""

    xp = np

    def __init__(self, lib: ctypes.CDLL, nt: int = 256) -> None:
        self.lib = lib
        self.nt = nt
        self.launched: list[str] = []

    @staticmethod
    def _c(a: np.ndarray) -> np.ndarray:
        assert a.flags.c_contiguous, "kernels take contiguous buffers"
        return a

    def to_host(self, a):
        return np.asarray(a)

    def address(self, a):
        return ptr(a)

    def encode_tiles(self, x, full_blocks, log2_bucket, mode, kind, bits, s, c, M, k, am, gnorm,
                     k0, k1, out, scales_off, codes_off):
        self.launched.append(tile_encode_kernel(mode, kind, bits))
        units = full_blocks * TILE_UNITS[bits]
        rc = self.lib.hqh_encode_tile(mode, kind, bits, ptr(self._c(x)), units, log2_bucket, s, c,
                                      M, k, am, gnorm, k0, k1, ptr(self._c(out)), scales_off,
                                      codes_off)
        assert rc == 0, f"no warp-tile encode for mode={mode} kind={kind} bits={bits}"

    def encode_blocks(self, x, n, bucket, mode, bits, norm_kind, p, s, c, M, k, am, gnorm, k0,
                      k1, out, scales_off, codes_off, fused, first_block):
        if scales_off % 4:
            raise AssertionError("scales must be 4-byte aligned (float stores)")
        self.launched.append(block_encode_kernel(mode, bits))
        rc = self.lib.hqh_encode_block(mode, bits, ptr(self._c(x)), n, bucket, norm_kind, p, s, c,
                                       M, k, am, gnorm, k0, k1, ptr(self._c(out)), scales_off,
                                       codes_off, 1 if fused else 0, first_block, self.nt)
        assert rc == 0, f"no block encode for mode={mode} bits={bits}"

    def scales(self, x, n, bucket, kind, p, scales):
        self.lib.hqh_scales(ptr(x), n, bucket, kind, p, ptr(self._c(scales)), self.nt)

    def max_scales(self, x, n, bucket, kind, scales):
        self.lib.hqh_max_scales(ptr(x), n, bucket, kind, ptr(self._c(scales)), self.nt)

    def _decode(self, words, values, pays, scales_off, codes_off, gscale, n, bucket, bits, out,
                start, post, rng):
        ptrs = np.zeros(MAX_PAYLOADS, np.uint64)
        ptrs[: len(pays)] = [ptr(self._c(a)) for a in pays]
        keys = np.zeros(MAX_PAYLOADS, np.uint64)
        table = np.zeros(1, np.float32)
        if isinstance(values, DitherValues):
            keys[: len(values.keys)] = [k0 | (k1 << 32) for k0, k1 in values.keys]
            kind, M = 1, values.M
        else:
            table, kind, M = self._c(values.table), 0, 0
        self.launched.append(decode_kernel(("levels", "dither")[kind], words, bits))
        rc = self.lib.hqh_decode(kind, 1 if words else 0, bits, ptr(ptrs), len(pays), scales_off,
                                 codes_off, 0.0 if gscale is None else float(gscale), n, bucket,
                                 log2_exact(bucket) or 0, ptr(self._c(out)), start,
                                 0 if post is None else 1, 0.0 if post is None else float(post),
                                 rng, ptr(table), ptr(keys), M)
        assert rc == 0, f"no decode for bits={bits} (words={words})"

    def decode_words(self, values, pays, scales_off, codes_off, gscale, n, bucket, bits, out,
                     start, post, end):
        self._decode(True, values, pays, scales_off, codes_off, gscale, n, bucket, bits, out,
                     start, post, end)

    def decode_groups(self, values, pays, scales_off, codes_off, gscale, n, bucket, bits, out,
                      start, post, begin):
        self._decode(False, values, pays, scales_off, codes_off, gscale, n, bucket, bits, out,
                     start, post, begin)

    def codes(self, x, n, mode, bits, s, c, gnorm, k0, k1, codes):
        self.lib.hqh_codes(ptr(x), n, mode, bits, s, c, gnorm, k0, k1, ptr(self._c(codes)))

    def pack(self, codes, n, bits, out):
        self.lib.hqh_pack(ptr(self._c(codes)), n, bits, ptr(self._c(out)), self.nt)

    def unpack(self, packed, n, bits, codes):
        self.lib.hqh_unpack(ptr(self._c(packed)), n, bits, ptr(self._c(codes)))

    def decode_nested(self, d, scales_off, codes_off, n, bucket, M, k, bits, am, alpha, y, k0, k1,
                      out):
        total = np.zeros(1, np.float64)
        count = np.zeros(1, np.int64)
        self.lib.hqh_decode_nested(ptr(self._c(d)), scales_off, codes_off, n, bucket, M, k, bits,
                                   am, alpha, ptr(self._c(y)), k0, k1, ptr(self._c(out)),
                                   ptr(total), ptr(count))
        return float(total[0]), int(count[0])

    def linear_encode(self, x, n, bits, s, norm, k0, k1, words):
        self.lib.hqh_linear_encode(ptr(x), n, bits, s, norm, k0, k1, ptr(self._c(words)),
                                   words.size)

    def linear_decode(self, words, n, bits, offset, scale, out, accumulate):
        self.lib.hqh_linear_decode(ptr(self._c(words)), n, bits, offset, scale, ptr(self._c(out)),
                                   1 if accumulate else 0)

    def exp_combine(self, a, b, out, n, first, bits, k0, k1, first_block):
        self.launched.append(exp_combine_kernel(False, bits))
        self.lib.hqh_exp_combine(ptr(self._c(a)), ptr(self._c(b)), ptr(self._c(out)), n, first,
                                 bits, k0, k1, first_block, self.nt)

    def exp_combine_words(self, a, b, out, end, first, bits, k0, k1):
        self.launched.append(exp_combine_kernel(True, bits))
        rc = self.lib.hqh_exp_combine_words(ptr(self._c(a)), ptr(self._c(b)), ptr(self._c(out)),
                                            end, first, bits, k0, k1)
        assert rc == 0, f"no word combination for bits={bits}"

    def scale(self, src, n, f, dst):
        self.lib.hqh_scale(ptr(self._c(src)), n, f, ptr(self._c(dst)))

    def to_f32(self, src, n, dst):
        self.lib.hqh_to_f32(ptr(self._c(src)), n, ptr(self._c(dst)))

    def decode_sparse(self, data, cnt, bits, table, scale, out):
        self.lib.hqh_decode_sparse(ptr(self._c(data)), cnt, bits, ptr(self._c(table)), scale,
                                   ptr(self._c(out)))

    def mean_parts(self, parts, nparts, n, divisor, out):
        ptrs = np.array([self.address(self._c(a)) for a in parts], np.uint64)
        self.lib.hqh_mean_parts(ptr(ptrs), nparts, n, divisor, ptr(self._c(out)))

    def max_abs_bits(self, x, n):
        return int(self.lib.hqh_max_abs_bits(ptr(x), n))

    def sum_squares(self, x, n):
        return float(self.lib.hqh_sum_squares(ptr(x), n))


@pytest.fixture(scope="session")
def nvcc() -> str:
    """The nvcc of the host build (skips without one)."""
    if NVCC is None:
        pytest.skip("nvcc not found: the host parity tests compile kernels/*.cuh with it")
    return NVCC


@pytest.fixture(scope="session")
def hostlib(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found: the host parity tests compile kernels/*.cuh with it")
    # one folder per run: under pytest-xdist, its workers' temporary folders' shared parent
    run = tmp_path_factory.getbasetemp()
    folder = (run.parent if "PYTEST_XDIST_WORKER" in os.environ else run) / "hq_hostlib"
    folder.mkdir(exist_ok=True)
    return build_hostlib(folder)


@pytest.fixture(scope="session")
def host_cuda(hostlib):
    """The CUDA backend with the host launcher."""
    from horovod_quant.backends.cuda import CudaBackend

    return CudaBackend(HostBackend(hostlib))


@pytest.fixture(scope="session")
def host_cuda_small(hostlib):
    """Same, with 64-thread blocks: results must not depend on the block size."""
    from horovod_quant.backends.cuda import CudaBackend

    return CudaBackend(HostBackend(hostlib, nt=64))

