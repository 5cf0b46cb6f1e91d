"""The CUDA backend: :class:`~horovod_quant.backends.Backend` over the kernels of ``kernels/*.cu``.

:class:`CudaBackend` holds the launch logic (which kernels, in which order, with which grid
arguments; one module per ``kernels/*.cu`` file, twins of the numba backend's kernel modules:
``levels``, ``global_qsgd``, ``dithered``, ``reduce``) and hands each launch to a *kernel
launcher*: :class:`.kernels.CupyKernels` on a GPU (CuPy RawModules, NVRTC-compiled), or the
host build of the same block programs that ``tests/cuda_parity`` replays on NumPy arrays. So
everything here runs on machines without a GPU too. The launcher interface (one method per
kernel of ``kernels/*.cu``): docs/dev/architecture.md ("Backends").
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..protocol import Backend
from .arrays import as_cupy
from .dithered import DitheredLaunches
from .global_qsgd import GlobalQSGDLaunches
from .levels import LevelLaunches
from .reduce import ReduceLaunches

__all__ = ["CudaBackend", "cuda_backend"]


class CudaBackend(LevelLaunches, GlobalQSGDLaunches, DitheredLaunches, ReduceLaunches,
                  Backend):
    """The CUDA kernels, launched by ``kernels`` (see the module doc): the entry points of
    each ``kernels/*.cu`` file are in its twin module (``levels``, ``global_qsgd``,
    ``dithered``, ``reduce``), the array handling here."""

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

    def scale(self, src: Any, f: float, dst: Any) -> Any:
        # our kernel: CuPy's own elementwise kernels are compiled with flush-to-zero
        if src.size:
            self.kernels.scale(src, int(src.size), np.float32(f), dst)
        return dst


@functools.lru_cache(maxsize=1)
def cuda_backend() -> CudaBackend:
    """The CUDA backend on CuPy (created on first use)."""
    try:
        from .kernels import CupyKernels

        kernels = CupyKernels()
    except ImportError as exc:
        raise ImportError("device arrays need CuPy: pip install cupy-cuda13x (cupy-cuda12x "
                          "where torch.version.cuda is 12.x)") from exc
    return CudaBackend(kernels)
