"""``hq.torch.Compression.<codec>(**params)``: Horovod ``Compressor`` objects for every codec.

Horovod's ``DistributedOptimizer`` allreduces whatever ``compress`` returns, with the user's
``op``. Quantized payloads do not survive that (Horovod's torch allreduce has no int8, Average
truncates integers, gathered codes do not add), so a :class:`QuantizedCompressor` carries its
own exchange: ``compress`` encodes the gradient and *starts* the codec's collective
asynchronously (so communication still overlaps the rest of backward), keeps the handle in
``ctx``, and hands Horovod a one-element placeholder holding 1.0. Horovod reduces the
placeholder with the user's op, pre/postscale factors and process set, which tells
``decompress`` the exact factor to apply to the mean estimate: 1 for Average, n for Sum.
``none`` and ``fp16`` keep Horovod's own path (a cast, reduced by Horovod).

Collective names and seeds come from the order of calls: a step is a run of ``compress`` calls
(ended by the first ``decompress``), and the j-th tensor compressed in step t (both from 0) is
exchanged as ``hq.<id>.<j>`` with seed ``derive_key(seed, t, j)``. Horovod calls ``compress`` in
backward-hook order, the same on every rank for the same model (Horovod's own grouping assumes
it too); names repeat every step, so Horovod's response cache keeps working.

CUDA gradients are encoded and decoded on their GPU by the CUDA kernels (``horovod_quant.gpu``,
needs CuPy) on torch's current stream; only payloads move, through Horovod's GPU collectives or
staged through host memory (:func:`~.collectives.collectives_for`). Without CuPy they are copied
to host memory and encoded there.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
from typing import Any, ContextManager

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compressor

from ..comm.exchange import Exchange
from ..core.base import Codec
from ..core.rng import derive_key
from ..adapters import CompressionNamespace, CompressorSettings, check_same_config
from ..policy import LayerPolicy
from .collectives import as_array, as_tensor, collectives_for

_IDS = itertools.count()
_HOROVOD_PATH = ("none", "fp16")


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
                  "cupy-cuda12x (or cupy-cuda13x) to encode them on the GPU", RuntimeWarning,
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


class QuantizedCompressor(CompressorSettings, Compressor):
    """A ``horovod.torch.compression.Compressor`` running a horovod_quant codec.

    Args: see :class:`~horovod_quant.adapters.CompressorSettings` (codec, seed, gather,
    policy, process_set; ``stats`` holds the :class:`~horovod_quant.stats.StepStats`).
    """

    def __init__(self, codec: Codec, seed: int = 0, gather: str = "auto",
                 policy: LayerPolicy | None = None, process_set: Any = None) -> None:
        super().__init__(codec, seed, gather, policy, process_set)
        self._id = next(_IDS)
        self._step = 0
        self._index = 0
        self._decompressing = False
        self._exchange: Exchange | None = None

    def _start(self) -> Exchange:
        comm = collectives_for(self.process_set)
        check_same_config(comm, self.shared_config(), f"hq.config.{self._id}")
        return Exchange(self.codec, comm, gather=self.gather)

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if self._exchange is None:
            self._exchange = self._start()
        codec = self.policy.codec_for(self.codec, tensor.shape, sparse=tensor.is_sparse)
        if codec is None or self.codec.name == "none":
            self.stats.add_raw(tensor.numel() * tensor.element_size())
            return tensor, None
        if self.codec.name == "fp16":
            self.stats.add_raw(tensor.numel() * 2)
            return tensor.half(), tensor.dtype
        if self._decompressing:  # first compress after a decompress: a new step
            self._step, self._index, self._decompressing = self._step + 1, 0, False
        j = self._index
        self._index += 1
        with stream_of(tensor):
            pending = self._exchange.start(flat_array(tensor),
                                           derive_key(self.seed, self._step, j),
                                           f"hq.{self._id}.{j}")
        placeholder = torch.ones(1, dtype=torch.float32)
        return placeholder, (pending, tensor)

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        if ctx is None:
            return tensor
        self._decompressing = True
        if isinstance(ctx, torch.dtype):
            return tensor.to(ctx)
        pending, grad = ctx
        with stream_of(grad):
            mean = as_tensor(pending.wait()).reshape(grad.shape)
        self.stats.add(pending.stats)
        self.stats.bytes_sent += tensor.numel() * tensor.element_size()
        factor = float(tensor.reshape(-1)[0])
        if factor != 1.0:
            mean.mul_(factor)
        return mean.to(device=grad.device, dtype=grad.dtype)


Compression = CompressionNamespace(QuantizedCompressor, hvd.global_process_set, "PyTorch")
