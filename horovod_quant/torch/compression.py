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

Which tensor is which. Ranks may compress their tensors in different orders (a layer used on
some ranks only: Horovod zero-fills its gradient on the others in ``synchronize()``, after the
rest), so exchanges are matched by name, as Horovod matches its own: the name the user gave
Horovod for the tensor (the parameter name in ``DistributedOptimizer``, grouped or not; the
``name=`` of ``hvd.allreduce``/``grouped_allreduce``), found by the tensor's identity in
Horovod's call (:mod:`~horovod_quant.torch.horovod_calls`). Tensor ``key``'s u-th exchange (u
from 0) uses seed ``derive_key(seed, u, name_key(key))`` and collective
``<check prefix>.<key>``. Unnamed tensors get the key ``#j``: the j-th compressed tensor of the
step (a step is a run of ``compress`` calls ended by the first ``decompress``). Every exchange also
carries a tag of its key and shape; ranks whose tags differ (another shape under one name,
unnamed tensors in another order) raise the same ValueError, so different tensors are never
combined. The policy's name rules need the name: a compressor whose policy has rules warns once
when a tensor comes without one.

Nothing that waits for a peer runs before the ranks' configurations are known to agree: the
first step's exchanges start at its first ``decompress``, after the configuration check, and
exchanges that pair data by call order (the MPI exponent allreduce) always start there, in key
order, which is the same on every rank. Global-QSGD's exchanges start in ``compress`` with
their norm's allgather, which does not wait for a peer. The first ``decompress`` of a step
puts every exchange's pieces on the wire (waiting for the global norms), then finishes every
exchange, each in key order: some finish with a collective of their own (NDQSG's outage
count, the second round of scatter-reduce-allgather), and Horovod calls ``decompress`` in each
rank's own order.

CUDA gradients are encoded and decoded on their GPU by the CUDA kernels (``horovod_quant.gpu``,
needs CuPy) on torch's current stream; only payloads move, through Horovod's GPU collectives or
staged through host memory (:func:`~.transport.collectives_for`). Without CuPy they are copied
to host memory and encoded there.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, ContextManager

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compressor

from ..doors import CompressionNamespace, CompressorSettings, ConfigCheck, mpi_exchange_config
from ..exchange.driver import Exchange
from ..exchange.wire import exchange_tag
from ..core.base import Codec
from ..core.rng import derive_key, name_key
from ..policy import LayerPolicy
from .collectives import as_array, as_tensor
from .horovod_calls import horovod_call
from .transport import collectives_for


def on_gpu(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s codec work runs on its GPU (a CUDA tensor and CuPy installed)."""
    if not tensor.is_cuda:
        return False
    from .. import gpu

    if gpu.available():
        return True
    _warn_host_copies()
    return False


def _warn_unnamed(policy: LayerPolicy) -> None:
    warnings.warn("horovod_quant: a tensor reached the compressor without a name, so the "
                  f"LayerPolicy's name rules ({', '.join(p for p, _ in policy.rules)}) do not "
                  "apply to it, only the size rules: pass name= to hvd.allreduce / "
                  "grouped_allreduce", RuntimeWarning, stacklevel=3)


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


def horovod_dtype(codec: Codec | None, tensor: torch.Tensor) -> torch.dtype | None:
    """The dtype in which Horovod's own allreduce carries ``tensor`` (no codec, or a codec that
    declares ``horovod_allreduce``), or None when the codec's exchange carries it."""
    if codec is None or codec.horovod_allreduce == "keep":
        return tensor.dtype
    if codec.horovod_allreduce is not None:
        return getattr(torch, codec.horovod_allreduce)
    return None


class _Job:
    """One tensor's exchange: started now or deferred (see the module doc), then finished."""

    __slots__ = ("key", "codec", "flat", "seed", "name", "tag", "grad", "pending")

    def __init__(self, key: str, codec: Codec, flat: Any, seed: int, name: str, tag: Any,
                 grad: torch.Tensor) -> None:
        self.key, self.codec, self.flat, self.seed = key, codec, flat, seed
        self.name, self.tag, self.grad = name, tag, grad
        self.pending = None

    def start(self, exchange: Exchange) -> None:
        with stream_of(self.grad):
            self.pending = exchange.start(self.flat, self.seed, self.name, tag=self.tag)


class QuantizedCompressor(CompressorSettings, Compressor):
    """A ``horovod.torch.compression.Compressor`` running a horovod_quant codec.

    Args: see :class:`~horovod_quant.doors.CompressorSettings` (codec, seed, gather,
    policy, process_set; ``stats`` holds the :class:`~horovod_quant.stats.StepStats`). The
    policy's name rules apply to tensors Horovod names (module doc). Integer, boolean and
    sparse tensors pass to Horovod unchanged (exact), never quantized.
    """

    def __init__(self, codec: Codec, seed: int = 0, gather: str = "auto",
                 policy: LayerPolicy | None = None, process_set: Any = None) -> None:
        super().__init__(codec, seed, gather, policy, process_set)
        self._check: ConfigCheck | None = None
        self._comm: Any = None
        self._exchanges: dict[str, Exchange] = {}
        self._uses: dict[str, int] = {}
        self._unnamed = 0
        self._warned_unnamed = False
        self._decompressing = False
        self._deferred: list[_Job] = []  # not started yet
        self._open: list[_Job] = []  # not finished yet

    def shared_config(self) -> dict:
        return {**super().shared_config(), **mpi_exchange_config(self.policy.codecs(self.codec))}

    def _finish_step(self) -> None:
        """Wait for the configuration check (the first time), build every exchange the policy
        can use in the policy's order (their collective set-up, e.g. the MPI communicator, then
        runs in the same order on every rank), start the deferred jobs, start the pieces of
        every open job (so no job's transfer waits for the job before it to finish) and finish
        them, each in key order."""
        if not self._exchanges:
            self._check.wait()
            self._exchanges = {c.config_key(): Exchange(c, self._comm, gather=self.gather)
                               for c in self.policy.codecs(self.codec)}
        by_key = lambda j: j.key  # noqa: E731
        jobs, self._deferred = sorted(self._deferred, key=by_key), []
        for job in jobs:
            job.start(self._exchanges[job.codec.config_key()])
        jobs, self._open = sorted(self._open, key=by_key), []
        for job in jobs:
            with stream_of(job.grad):
                job.pending.advance(block=True)
        for job in jobs:
            with stream_of(job.grad):
                job.pending.wait()

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        call = horovod_call()
        name = call.name(tensor) if call is not None else None
        if name is None and self.policy.rules and not self._warned_unnamed:
            self._warned_unnamed = True
            _warn_unnamed(self.policy)
        codec = None
        if tensor.dtype.is_floating_point and not tensor.is_sparse:
            codec = self.policy.codec_for(self.codec, tensor.shape, name)
        wire = horovod_dtype(codec, tensor)
        if wire is not None:
            self.stats.add_raw(tensor.numel() * wire.itemsize, tensor.numel() * tensor.element_size())
            return (tensor, None) if wire == tensor.dtype else (tensor.to(wire), tensor.dtype)
        if self._decompressing:  # first compress after a decompress: a new step
            self._unnamed, self._decompressing = 0, False
        if name is None:
            name, self._unnamed = f"#{self._unnamed}", self._unnamed + 1
        use = self._uses.get(name, 0)
        self._uses[name] = use + 1
        if self._check is None:  # the first compressed tensor: the check starts, unawaited
            # Horovod's collectives: a transport that pairs by call order would need the jobs
            # started in one order, and Horovod calls compress in each rank's hook order
            self._comm = collectives_for(self.process_set, "horovod")
            self._check = ConfigCheck(self._comm, self.shared_config())
        job = _Job(name, codec, flat_array(tensor), derive_key(self.seed, use, name_key(name)),
                   f"{self._check.prefix}.{name}", exchange_tag(name, tensor.shape), tensor)
        exchange = self._exchanges.get(codec.config_key())  # none before the check passed
        if exchange is None or exchange.blocks_on_peers:
            self._deferred.append(job)
        else:
            job.start(exchange)
        self._open.append(job)
        return torch.ones(1, dtype=torch.float32), job

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        if ctx is None:
            return tensor
        self._decompressing = True
        if isinstance(ctx, torch.dtype):
            return tensor.to(ctx)
        if self._open:
            self._finish_step()
        job, grad = ctx, ctx.grad
        with stream_of(grad):
            mean = as_tensor(job.pending.wait()).reshape(grad.shape)
        self.stats.add(job.pending.stats)
        self.stats.bytes_sent += tensor.numel() * tensor.element_size()
        factor = float(tensor.reshape(-1)[0])
        if factor != 1.0:
            mean.mul_(factor)
        return mean.to(device=grad.device, dtype=grad.dtype)


Compression = CompressionNamespace(QuantizedCompressor, hvd.global_process_set, "PyTorch")
