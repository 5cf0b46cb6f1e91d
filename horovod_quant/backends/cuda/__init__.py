"""The CUDA backend: :class:`~horovod_quant.backends.Backend` over the kernels of ``kernels/*.cu``.

:class:`CudaBackend` holds the launch logic (which kernels, in which order, with which grid
arguments) and hands each launch to a *kernel launcher*: :class:`.kernels.CupyKernels` on a GPU
(CuPy RawModules, NVRTC-compiled), or the host build of the same block programs that
``tests/kernels`` replays on NumPy arrays. So everything here runs on machines without a GPU
too. Launcher interface (one method per kernel of ``kernels/*.cu``; arrays are ``xp`` arrays,
views where a kernel writes into part of a buffer):

* ``xp``, ``to_host(a)``
* ``encode(x, n, bucket, mode, bits, norm_kind, p, s, c, M, k, am, gnorm, k0, k1, out,
  scales_off, codes_off, fused)``: ``hq_encode``, one block per packing block
* ``scales(x, n, bucket, kind, p, scales)``: ``hq_scales`` (lane-ordered norms);
  ``max_scales(x, n, bucket, kind, scales)``: ``hq_max_bits`` + ``hq_scales_from_bits``
* ``decode_levels(pays, scales_off, codes_off, gscale, n, bucket, bits, table, out, accumulate,
  post)``: ``hq_decode_levels`` over several payloads
* ``codes``, ``pack``, ``unpack``, ``scale``, ``to_f32``, ``decode_sparse``
* ``decode_dither(pays, scales_off, codes_off, keys, n, bucket, bits, M, out, accumulate,
  post)``, ``decode_nested(d, scales_off, codes_off, n, bucket, M, k, bits, am, alpha, y, k0,
  k1, out) -> (sum, count)``
* ``linear_encode(x, n, bits, s, norm, k0, k1, words)``, ``linear_decode(words, n, bits,
  offset, scale, out, accumulate)``, ``exp_combine(a, b, out, n, first, bits, k0, k1)``,
  ``max_abs_bits(x, n) -> int``, ``sum_squares(x, n) -> float``
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np

from .. import (
    MODE_DITHER,
    MODE_EXP,
    MODE_GEOMETRIC,
    MODE_LINEAR_SM,
    MODE_NESTED,
    MODE_UNIFORM,
    NORM_MAX,
    NORM_POW2,
    SCALED_MODES,
    SPARSE_BAD_POSITIONS,
    SPARSE_OK,
    Backend,
    Keys,
)
from ..numba.packing import PACK_BLOCK, packed_nbytes
from .arrays import as_cupy

_MODES = (MODE_UNIFORM, MODE_GEOMETRIC, MODE_EXP, MODE_DITHER, MODE_NESTED)


def _k(keys: Keys) -> tuple[int, int]:
    return int(keys[0]), int(keys[1])


def sparse_positions_error(pos: Any, size: int) -> bool:
    """Whether the uint32 positions ``pos`` of a sparse payload break the rule the decoder
    checks (strictly increasing, below ``size``), in array operations before any launch."""
    if pos.size == 0:
        return False
    bad = pos[-1] >= size
    if pos.size > 1:
        bad = bad | (pos[1:] <= pos[:-1]).any()
    return bool(bad)


class CudaBackend(Backend):
    """The CUDA kernels, launched by ``kernels`` (see the module doc)."""

    name = "CUDA"

    def __init__(self, kernels: Any) -> None:
        self.kernels = kernels
        self.xp = kernels.xp
        self._constants: dict[int, tuple[np.ndarray, Any]] = {}

    # -- arrays ------------------------------------------------------------------------------
    def vector(self, x: Any) -> Any:
        xp = self.xp
        arr = xp.asarray(as_cupy(x))
        if arr.dtype.kind != "f":
            raise TypeError(f"expected a floating-point array, got dtype {arr.dtype}")
        if arr.dtype == xp.float64:  # rounded by our kernel (CuPy's casts flush subnormals)
            src = xp.ascontiguousarray(arr).reshape(-1)
            out = xp.empty(src.size, xp.float32)
            if src.size:
                self.kernels.to_f32(src, int(src.size), out)
            return out
        return xp.ascontiguousarray(arr, dtype=xp.float32).reshape(-1)  # float16: exact

    def array(self, a: Any) -> Any:
        return self.xp.asarray(as_cupy(a)).reshape(-1)

    def constant(self, host: np.ndarray) -> Any:
        hit = self._constants.get(id(host))
        if hit is None or hit[0] is not host:
            hit = (host, self.xp.asarray(np.ascontiguousarray(host)))
            self._constants[id(host)] = hit
        return hit[1]

    def to_host(self, a: Any) -> np.ndarray:
        return self.kernels.to_host(a)

    def scale(self, src: Any, f: float, dst: Any) -> Any:
        # our kernel: CuPy's own elementwise kernels are compiled with flush-to-zero
        if src.size:
            self.kernels.scale(src, int(src.size), np.float32(f), dst)
        return dst

    # -- levels.cu ---------------------------------------------------------------------------
    def encode(self, x: Any, out: Any, offset: int, bucket: int, mode: int, bits: int,
               keys: Keys, *, norm_kind: int = NORM_MAX, p: float = 2.0, s: int = 0,
               c: int = 0, M: int = 0, k: int = 0, am: float = 0.0, gnorm: float = 0.0) -> None:
        if mode not in _MODES:
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
        k0, k1 = _k(keys)
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

    # -- global_qsgd.cu ----------------------------------------------------------------------
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
            k0, k1 = _k(keys)
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
            k0, k1 = _k(keys)
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
        if n_elements:
            self.kernels.exp_combine(a, b, out, int(n_elements), int(first_element_index),
                                     int(bits), int(k0), int(k1))
        return nbytes

    # -- dithered.cu -------------------------------------------------------------------------
    def decode_dither(self, datas: Sequence[Any], keys: Sequence[Keys], offset: int, n: int,
                      bucket: int, bits: int, M: int, out: Any, accumulate: bool,
                      post: float | None = None) -> None:
        if n:
            flat = [k for pair in keys for k in _k(pair)]
            self.kernels.decode_dither(list(datas), offset, offset + 4 * -(-n // bucket), flat,
                                       n, bucket, bits, M, out, accumulate,
                                       None if post is None else np.float32(post))

    def decode_nested(self, data: Any, offset: int, n: int, bucket: int, M: int, k: int,
                      bits: int, am: float, alpha: float, y: Any, keys: Keys,
                      out: Any) -> tuple[float, int]:
        if n == 0:
            return 0.0, 0
        k0, k1 = _k(keys)
        return self.kernels.decode_nested(data, offset, offset + 4 * -(-n // bucket), n, bucket,
                                          M, k, bits, float(am), float(alpha), y, k0, k1, out)


@functools.lru_cache(maxsize=1)
def cuda_backend() -> CudaBackend:
    """The CUDA backend on CuPy (created on first use)."""
    try:
        from .kernels import CupyKernels

        kernels = CupyKernels()
    except ImportError as exc:
        raise ImportError("device arrays need CuPy: pip install cupy-cuda12x (or cupy-cuda13x), "
                          "matching your CUDA driver") from exc
    return CudaBackend(kernels)
