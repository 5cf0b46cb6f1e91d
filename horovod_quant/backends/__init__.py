"""Kernel backends: the one interface through which every codec runs its arithmetic.

A codec method is written once (in its codec module, :mod:`horovod_quant.core`) and calls the
entry points of :class:`Backend` on the backend of its arrays, ``be = backend_of(x)``:

* :class:`horovod_quant.backends.numba.NumbaBackend` for NumPy arrays (and CPU tensors): the
  fused numba kernels of ``backends/numba/`` (``levels``, ``dithered``, ``global_qsgd``, twins of
  ``kernels/*.cu``);
* :class:`horovod_quant.backends.cuda.CudaBackend` for CuPy arrays and CUDA torch tensors: the
  CUDA kernels of ``kernels/*.cu``, launched by a *kernel launcher* (CuPy on a GPU; the test
  suite's host build of the same block programs, ``tests/cuda_parity``, on the CPU).

Both produce the same payload bytes and decoded bit patterns for the same seed. Imports run one
way: backends <- codecs (``core``) <- exchanges (``exchange``) <- framework doors; nothing here
imports a codec or knows a codec's name. What a kernel needs to know about a codec arrives as a
parameter: an encode ``mode`` (which code the element gets), a norm kind, a level table.

An entry point a backend has no kernel for raises :class:`MissingKernel` (no silent copy to the
host). :func:`use_backend` runs NumPy arrays on another backend (the tests' host-replayed CUDA
backend); :func:`backend_of` never imports CuPy or torch for NumPy input.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

from .protocol import (  # the interface, re-exported
    MODE_DITHER,
    MODE_EXP,
    MODE_GEOMETRIC,
    MODE_LINEAR_SM,
    MODE_NESTED,
    MODE_UNIFORM,
    NORM_L2,
    NORM_MAX,
    NORM_P,
    NORM_POW2,
    PACK_BLOCK,
    SCALED_MODES,
    SPARSE_BAD_POSITIONS,
    SPARSE_OK,
    SPARSE_SHORT,
    Backend,
    MissingKernel,
    elias_error,
    is_device_array,
    packed_nbytes,
)

_FORCED: contextvars.ContextVar[Backend | None] = contextvars.ContextVar("hq_backend",
                                                                          default=None)
_NUMBA: Backend | None = None


def numba_backend() -> Backend:
    """The numba backend (created on first use)."""
    global _NUMBA
    if _NUMBA is None:
        from .numba import NumbaBackend

        _NUMBA = NumbaBackend()
    return _NUMBA


def backend_of(obj: Any) -> Backend:
    """The backend that runs on ``obj``'s memory: CUDA for CuPy arrays and CUDA torch tensors,
    else numba (or the backend of an enclosing :func:`use_backend`)."""
    if is_device_array(obj):
        from .cuda import cuda_backend

        return cuda_backend()
    forced = _FORCED.get()
    return numba_backend() if forced is None else forced


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[Backend]:
    """Run codec methods on host (NumPy) arrays with ``backend`` inside the block, e.g. the
    host-replayed CUDA backend of ``tests/cuda_parity``."""
    token = _FORCED.set(backend)
    try:
        yield backend
    finally:
        _FORCED.reset(token)


__all__ = [
    "MODE_DITHER",
    "MODE_EXP",
    "MODE_GEOMETRIC",
    "MODE_LINEAR_SM",
    "MODE_NESTED",
    "MODE_UNIFORM",
    "NORM_L2",
    "NORM_MAX",
    "NORM_P",
    "NORM_POW2",
    "PACK_BLOCK",
    "SCALED_MODES",
    "SPARSE_BAD_POSITIONS",
    "SPARSE_OK",
    "SPARSE_SHORT",
    "Backend",
    "MissingKernel",
    "backend_of",
    "elias_error",
    "is_device_array",
    "numba_backend",
    "packed_nbytes",
    "use_backend",
]
