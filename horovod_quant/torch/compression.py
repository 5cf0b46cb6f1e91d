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
"""
from __future__ import annotations

import itertools
from typing import Any

import horovod.torch as hvd
import numpy as np
import torch
from horovod.torch.compression import Compressor

from ..comm.exchange import Exchange
from ..core.base import Codec
from ..core.rng import derive_key
from ..adapters import CompressionNamespace, check_same_config
from ..policy import LayerPolicy, describe
from ..stats import StepStats
from .collectives import HorovodTorchCollectives

_IDS = itertools.count()
_HOROVOD_PATH = ("none", "fp16")


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A flat float32 NumPy view of a gradient (zero-copy for contiguous CPU float32)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype != torch.float32 or flat.device.type != "cpu":
        flat = flat.to(device="cpu", dtype=torch.float32)
    return flat.numpy()


class QuantizedCompressor(Compressor):
    """A ``horovod.torch.compression.Compressor`` running a horovod_quant codec.

    Args:
        codec: the codec (see :func:`horovod_quant.get_codec`).
        seed: base seed of every random draw.
        gather: schedule for gather codecs: "auto", "allgather" or "sra".
        policy: which tensors are compressed (default :class:`LayerPolicy`: small and 1-D
            tensors travel uncompressed through Horovod's own allreduce).
        process_set: Horovod process set of the optimizer, if not the global one.

    Attributes:
        stats: :class:`~horovod_quant.stats.StepStats` since the last ``stats.reset()``.
    """

    def __init__(self, codec: Codec, seed: int = 0, gather: str = "auto",
                 policy: LayerPolicy | None = None, process_set: Any = None) -> None:
        self.codec = codec
        self.seed = int(seed)
        self.gather = gather
        self.policy = policy if policy is not None else LayerPolicy()
        self.process_set = process_set
        self.stats = StepStats()
        self._id = next(_IDS)
        self._step = 0
        self._index = 0
        self._decompressing = False
        self._exchange: Exchange | None = None

    def _start(self) -> Exchange:
        comm = HorovodTorchCollectives(self.process_set)
        check_same_config(comm, {**self.codec.config(), "seed": self.seed, "gather": self.gather,
                                 "policy": describe(self.policy)}, f"hq.config.{self._id}")
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
        pending = self._exchange.start(to_numpy(tensor), derive_key(self.seed, self._step, j),
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
        mean = torch.from_numpy(pending.wait()).reshape(grad.shape)
        self.stats.add(pending.stats)
        self.stats.bytes_sent += tensor.numel() * tensor.element_size()
        factor = float(tensor.reshape(-1)[0])
        if factor != 1.0:
            mean.mul_(factor)
        return mean.to(device=grad.device, dtype=grad.dtype)


Compression = CompressionNamespace(QuantizedCompressor, hvd.global_process_set, "PyTorch")
