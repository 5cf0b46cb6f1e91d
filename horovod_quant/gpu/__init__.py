"""GPU helpers around the CUDA backend (:mod:`horovod_quant.backends.cuda`).

Codec methods run on the GPU by themselves when given CuPy arrays or CUDA torch tensors
(``backend_of``); this module gathers what the exchanges, the doors and the benchmarks need
beside them:

* :func:`available`, :func:`compile_kernels`
* :func:`cuda_aware_mpi`: whether MPI can take device buffers (``HQ_CUDA_AWARE_MPI``
  overrides); :func:`horovod_device_collectives`: whether Horovod's collectives can (else
  exchanges stage their payloads through host memory,
  :class:`horovod_quant.exchange.staging.HostStaged`)
* :func:`is_device_array`, :func:`as_cupy`, :func:`to_host` / :func:`to_device` (the staging
  copies), :func:`device_scope` (the device and stream kernels run on), :func:`capture_stream`
  (that stream, to queue work on from another thread)
* :func:`exp_combine`, :func:`reduce_packed`: the Global-QSGD exponent combination and
  reduction on the backend of their buffers

CuPy is imported lazily: ``import horovod_quant.gpu`` works without it (``available()`` is
then False).
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

from ..backends import backend_of, is_device_array
from ..backends.cuda.arrays import StreamScope, as_cupy, device_scope, to_device, to_host
from .device_collectives import cuda_aware_mpi, horovod_device_collectives

__all__ = [
    "as_cupy", "available", "capture_stream", "compile_kernels", "cuda_aware_mpi", "device_scope",
    "exp_combine",
    "horovod_device_collectives", "is_device_array", "reduce_packed", "to_device", "to_host",
]


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when CuPy imports and sees at least one CUDA device (asked once per process)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, CUDARuntimeError without a driver, ...
        return False


def capture_stream() -> StreamScope:
    """The CUDA device and stream current on this thread (CuPy's; torch's inside
    :func:`device_scope`), to enter on another thread: work queued there runs after what this
    thread queued before (:class:`~horovod_quant.backends.cuda.arrays.StreamScope`)."""
    return StreamScope()


def compile_kernels() -> list[str]:
    """Compile every kernel file for the current device now (instead of at first use)."""
    from ..backends.cuda.kernels import compile_all

    return compile_all()


def exp_combine(a_codes_packed: Any, b_codes_packed: Any, out_packed: Any, n_elements: int,
                first_element_index: int, bits: int, k0: int, k1: int) -> int:
    """:func:`horovod_quant.backends.numba.global_qsgd.exp_combine` (same arguments) on the
    backend of the buffers: the ``hq_exp_combine`` kernel for device buffers (randomness drawn
    in the kernel), numba for host ones. Returns the number of bytes written."""
    be = backend_of(a_codes_packed)
    with device_scope(a_codes_packed, b_codes_packed, out_packed):
        a, b, o = (be.array(v).view("uint8") for v in
                   (a_codes_packed, b_codes_packed, out_packed))
        return be.exp_combine(a, b, o, int(n_elements), int(first_element_index), int(bits),
                              int(k0), int(k1))


def reduce_packed(buffers: Sequence[Any], size: int, bits: int, seed: int, reduction: str) -> Any:
    """:func:`horovod_quant.core.exponent_reduction.reduce_packed` on the buffers' backend."""
    from ..core.exponent_reduction import reduce_packed as reduce

    with device_scope(*buffers):
        return reduce(buffers, size, bits, seed, reduction)
