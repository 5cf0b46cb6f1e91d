"""The numba backend: :class:`~horovod_quant.backends.Backend` on NumPy arrays.

Each entry point maps onto a fused numba kernel of this package (``levels``, ``dithered``,
``global_qsgd``: twins of ``kernels/*.cu``; ``packing``, ``rng``, ``elias``). Kernels are
compiled with ``nogil=True`` (``tests/unit/test_threads.py``): other threads run beside them.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..protocol import (
    MODE_DITHER,
    MODE_EXP,
    MODE_GEOMETRIC,
    MODE_LINEAR_SM,
    MODE_NESTED,
    MODE_UNIFORM,
    NORM_MAX,
    Backend,
    Keys,
)
from . import dithered, elias, global_qsgd, levels, reduce


def _flat(a: Any) -> np.ndarray:
    return np.asarray(a).reshape(-1)


def _uint32_keys(k0: int, k1: int) -> tuple[np.uint32, np.uint32]:
    """Key halves as the kernels take them: numba compiles a kernel once per argument type, so
    Python integers (int64 to numba) would compile every keyed kernel a second time."""
    return np.uint32(k0), np.uint32(k1)


class NumbaBackend(Backend):
    """Numba kernels on NumPy arrays (the CPU)."""

    name = "numba"
    xp = np

    # -- arrays ------------------------------------------------------------------------------
    def vector(self, x: Any) -> np.ndarray:
        if type(x) is np.ndarray and x.dtype == np.float32 and x.flags.c_contiguous:
            return x.reshape(-1)  # the exchange's own vectors: no checks per chunk
        if str(getattr(x, "dtype", "")) == "torch.bfloat16":  # NumPy has no bfloat16: widen
            x = x.detach().float()  # exactly (a bf16 value is the top half of a float32)
        arr = np.asarray(x)
        if arr.dtype.kind not in "fV" and arr.dtype.name != "bfloat16":
            raise TypeError(f"expected a floating-point array, got dtype {arr.dtype}")
        return np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)

    def array(self, a: Any) -> np.ndarray:
        return _flat(a)

    # -- levels ------------------------------------------------------------------------------
    def encode(self, x: Any, out: Any, offset: int, bucket: int, mode: int, bits: int,
               keys: Keys, *, norm_kind: int = NORM_MAX, p: float = 2.0, s: int = 0, c: int = 0,
               M: int = 0, k: int = 0, am: float = 0.0, gnorm: float = 0.0) -> None:
        k0, k1 = _uint32_keys(*keys)
        if mode in (MODE_UNIFORM, MODE_GEOMETRIC):
            levels.encode_levels(x, bucket, norm_kind, p, mode, s, bits, k0, k1, out[offset:])
        elif mode in (MODE_DITHER, MODE_NESTED):
            dithered.encode_dithered(x, bucket, M, np.float32(am), k, bits, k0, k1, out, offset)
        elif mode == MODE_EXP:
            global_qsgd.encode_exp(x, np.float32(gnorm), s, c, bits, k0, k1, out[offset:])
        else:
            raise ValueError(f"encode: unknown mode {mode}: use one of the MODE_* constants of "
                             f"horovod_quant.backends")

    def decode_levels(self, data: Any, n: int, bucket: int, bits: int, table: Any, out: Any,
                      accumulate: bool) -> None:
        levels.decode_levels(data, n, bucket, bits, table, out, accumulate)

    def combine_levels(self, datas: Sequence[Any], n: int, bucket: int, bits: int, table: Any,
                       inv_count: float, out: Any) -> None:
        levels.combine_levels(tuple(datas), n, bucket, bits, table, np.float32(inv_count), out)

    def decode_codes(self, data: Any, n: int, bits: int, table: Any, scale: float, out: Any,
                     accumulate: bool) -> None:
        global_qsgd.decode_packed(data, n, bits, table, np.float32(scale), out, accumulate)

    # -- global_qsgd -------------------------------------------------------------------------
    def max_abs(self, x: Any) -> float:
        return float(global_qsgd._max_abs(x))

    def sum_squares(self, x: Any) -> float:
        return float(global_qsgd._sum_squares(x))

    def linear_encode(self, x: Any, bits: int, s: int, norm: float, keys: Keys,
                      words: Any) -> None:
        global_qsgd.encode_linear(x, np.float32(norm), s, bits, *_uint32_keys(*keys), words)

    def linear_decode(self, words: Any, n: int, bits: int, offset: int, scale: float, out: Any,
                      accumulate: bool) -> None:
        global_qsgd.decode_linear(words, n, bits, offset, np.float32(scale), out, accumulate)

    def encode_sparse(self, x: Any, mode: int, norm: float, s: int, c: int, bits: int,
                      keys: Keys) -> np.ndarray:
        if mode not in (MODE_EXP, MODE_LINEAR_SM):
            raise ValueError(f"encode_sparse: mode {mode} is not MODE_EXP or MODE_LINEAR_SM")
        return global_qsgd.encode_sparse(x, mode == MODE_EXP, np.float32(norm), s, c, bits,
                                         *_uint32_keys(*keys))

    def decode_sparse(self, data: Any, n: int, bits: int, table: Any, scale: float,
                      out: Any) -> int:
        return int(global_qsgd.decode_sparse(data, n, bits, table, np.float32(scale), out))

    def exp_combine(self, a: Any, b: Any, out: Any, n_elements: int, first_element_index: int,
                    bits: int, k0: int, k1: int) -> int:
        return int(global_qsgd.exp_combine(a, b, out, n_elements, first_element_index, bits,
                                           *_uint32_keys(k0, k1)))

    # -- dithered ----------------------------------------------------------------------------
    def decode_dither(self, datas: Sequence[Any], keys: Sequence[Keys], offset: int, n: int,
                      bucket: int, bits: int, M: int, out: Any, accumulate: bool,
                      post: float | None = None) -> None:
        for i, (data, key) in enumerate(zip(datas, keys)):
            dithered.decode_dithered(data, offset, n, bucket, M, bits, *_uint32_keys(*key), out,
                                     accumulate or i > 0)
        if post is not None:
            out *= np.float32(post)

    def decode_nested(self, data: Any, offset: int, n: int, bucket: int, M: int, k: int,
                      bits: int, am: float, alpha: float, y: Any, keys: Keys,
                      out: Any) -> tuple[float, int]:
        s2, count = dithered.decode_nested(data, offset, n, bucket, M, k, bits, np.float32(am),
                                           np.float32(alpha), y, *_uint32_keys(*keys), out)
        return float(s2), int(count)

    def count_outside(self, x: Any, data: Any, offset: int, n: int, bucket: int, M: int, k: int,
                      bits: int, am: float, y: Any, keys: Keys) -> int:
        am, (k0, k1) = np.float32(am), _uint32_keys(*keys)
        fine = dithered.fine_indices(x, bucket, am, k0, k1)
        return int(dithered.nested_outside(data, offset, n, bucket, M, k, bits, am, y, k0, k1,
                                           fine))

    # -- reduce ------------------------------------------------------------------------------
    def mean_in_order(self, parts: Sequence[Any], count: int, out: Any) -> Any:
        flat = _flat(out)
        if not parts:
            flat.fill(0)
            return out
        # one array type for every part (numba compiles once per number of parts)
        shards = tuple(np.require(_flat(part), np.float32, "CA") for part in parts)
        reduce.mean_in_order(shards, np.float32(count), flat)
        return out

    # -- elias -------------------------------------------------------------------------------
    def elias_encode_levels(self, fixed: Any, n: int, bucket: int, bits: int) -> np.ndarray:
        return elias.elias_encode_levels(fixed, n, bucket, bits)

    def elias_decode(self, data: Any, n: int, bucket: int, bits: int, table: Any, out: Any,
                     accumulate: bool) -> int:
        return int(elias.elias_decode(data, n, bucket, bits, table, out, accumulate))
