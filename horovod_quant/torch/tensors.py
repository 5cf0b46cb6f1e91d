"""Tensors as arrays (zero-copy), where a torch tensor's codec work runs, the tensor as the flat
float32 array a codec takes, and the parameters' names: what every torch door needs of a tensor
(nothing here needs Horovod: the DDP door imports it).

CUDA tensors are encoded and decoded on their GPU by the CUDA kernels (``horovod_quant.gpu``,
needs CuPy) on torch's current stream; without CuPy they are copied to host memory and encoded
there (one warning).
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, ContextManager, Iterable

import numpy as np
import torch

from ..core.base import Codec
from ..core.baselines import BASELINE_TORCH_DTYPES
from ..core.contract import HorovodWire


def as_tensor(arr: Any) -> torch.Tensor:
    """A tensor sharing ``arr``'s memory: a CPU tensor of a NumPy array, a CUDA tensor of a
    CuPy array."""
    if isinstance(arr, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(arr))
    return torch.from_dlpack(arr)


def as_array(tensor: torch.Tensor) -> Any:
    """The array sharing ``tensor``'s memory: NumPy for CPU, CuPy for CUDA tensors."""
    if tensor.device.type == "cpu":
        return tensor.numpy()
    import cupy

    return cupy.from_dlpack(tensor.detach())


def on_gpu(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s codec work runs on its GPU (a CUDA tensor and CuPy installed)."""
    if not tensor.is_cuda:
        return False
    from .. import gpu

    if gpu.available():
        return True
    _warn_host_copies()
    return False


@functools.lru_cache(maxsize=None)
def _warn_host_copies() -> None:
    warnings.warn("horovod_quant: CUDA gradients are copied to host memory and encoded on the "
                  "CPU because CuPy (or a CUDA device it can use) is missing; pip install "
                  "cupy-cuda13x (cupy-cuda12x where torch.version.cuda is 12.x) to encode them "
                  "on the GPU", RuntimeWarning,
                  stacklevel=4)


def flat_array(tensor: torch.Tensor) -> Any:
    """A gradient as a flat float32 array: a view where possible (NumPy for CPU tensors, CuPy
    for CUDA tensors when :func:`on_gpu`), else a float32 copy on the host."""
    flat = tensor.detach().reshape(-1)
    device = flat.device if on_gpu(flat) else torch.device("cpu")
    if flat.dtype != torch.float32 or flat.device != device:
        flat = flat.to(device=device, dtype=torch.float32)
    return as_array(flat)


def stream_of(tensor: torch.Tensor) -> ContextManager[None]:
    """Where a tensor's codec kernels and copies are queued: torch's current CUDA stream for
    a tensor :func:`on_gpu`, nothing for the others."""
    if not on_gpu(tensor):
        return contextlib.nullcontext()
    from .. import gpu

    return gpu.device_scope(tensor)


def blocking_on(tensor: torch.Tensor, work: Callable[[], Any]) -> Callable[[], None]:
    """A run of ``work`` with ``tensor``'s stream current (:func:`stream_of`) that returns once
    the device work it queued is done: what a timed run (the fallback's trial) must include."""
    def run() -> None:
        with stream_of(tensor):
            work()
            if on_gpu(tensor):
                torch.cuda.synchronize(tensor.device)
    return run


#: the wire dtype of each uncompressed baseline (:data:`horovod_quant.fallback.BASELINES`)
BASELINE_DTYPES = {name: getattr(torch, dtype) for name, dtype in BASELINE_TORCH_DTYPES.items()}


def horovod_dtype(codec: Codec | None, tensor: torch.Tensor) -> torch.dtype | None:
    """The dtype in which Horovod's own allreduce carries ``tensor`` (no codec, or a codec that
    declares a ``traits.horovod_wire``), or None when the codec's exchange carries it. Horovod's CPU
    operations take no bfloat16: a bfloat16 host tensor kept as it is travels as float32 (its
    values exactly; the mean is rounded to bfloat16 once, alike on every rank)."""
    wire = None if codec is None else codec.traits.horovod_wire
    if codec is None or wire is HorovodWire.KEEP:
        if tensor.dtype == torch.bfloat16 and not tensor.is_cuda:
            return torch.float32
        return tensor.dtype
    if wire is not None:
        return getattr(torch, wire.cast)
    return None


def parameter_names(named_parameters: Iterable | None
                    ) -> dict[int, tuple[str, torch.Tensor]] | None:
    """``{id(parameter): (name, parameter)}`` from ``named_parameters`` (None: no names).

    Raises:
        ValueError: an item is not a ``(str, parameter)`` pair, or a name repeats.
    """
    if named_parameters is None:
        return None
    named = list(named_parameters)
    if any(not isinstance(t, tuple) or len(t) != 2 or not isinstance(t[0], str) for t in named):
        raise ValueError("named_parameters should be (name, parameter) pairs, usually "
                         "model.named_parameters()")
    names = [n for n, _ in named]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"parameter names must be unique; duplicates: {duplicates}")
    return {id(p): (n, p) for n, p in named}
