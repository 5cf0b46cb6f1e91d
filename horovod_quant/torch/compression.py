"""``hq.torch.Compression.<codec>(**params)``: Horovod ``Compressor`` objects for every codec.

``compress`` encodes the gradient and starts the codec's own exchange without blocking (Horovod
would reduce quantized codes with the user's ``op``), keeps it in ``ctx`` and hands Horovod a
one-element placeholder holding 1.0; the placeholder's reduced value is the factor of the user's
op and pre/postscale factors, which ``decompress`` applies to the mean. ``none`` and ``fp16``
keep Horovod's own path.

Tensors are matched across ranks by the name the user gave Horovod
(:mod:`~horovod_quant.torch.horovod_calls`); tensor ``key``'s u-th exchange (step u) uses seed
``payload_seed(seed, u, key)``, as every door (:mod:`~horovod_quant.exchange.runtime`), and
collective ``<check prefix>.<key>``; unnamed tensors are keyed ``#j`` (the j-th of the step). No
exchange that waits for a peer starts before the configuration check passed; the first
``decompress`` of a step puts every exchange on the wire and finishes them in key order. Tags carry
the use count (ranks out of step raise); after an error it refuses to go on. The use counters and
codec states are a job's state (``state_dict``,
:func:`~horovod_quant.torch.broadcast.broadcast_state`). Horovod's optimizer averaging again
(``step()`` after ``synchronize()``) gets the means back unchanged. docs/pytorch.md, section 2.
"""
from __future__ import annotations

import warnings
from typing import Any

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compressor

from ..core.base import Codec
from ..doors import (
    TORCH_COMPRESSOR_DOOR,
    CompressionNamespace,
    CompressorSettings,
    DoorOptions,
    Refusal,
    RequestedCodec,
    door_options,
    load_codec_states,
    mpi_exchange_config,
)
from ..exchange.runtime import ExchangeRuntime
from ..policy import LayerPolicy
from .horovod_calls import horovod_call
from .tensors import as_tensor, flat_array, horovod_dtype, on_gpu, stream_of
from .transport import horovod_end_of_job, transport_collectives


def _warn_unnamed(policy: LayerPolicy) -> None:
    warnings.warn("horovod_quant: a tensor reached the compressor without a name, so the "
                  f"LayerPolicy's name rules ({', '.join(p for p, _ in policy.rules)}) do not "
                  "apply to it, only the size rules: pass name= to hvd.allreduce / "
                  "grouped_allreduce", RuntimeWarning, stacklevel=3)


class _Job:
    """One tensor's exchange: started now or deferred (see the module doc), then finished."""

    __slots__ = ("key", "codec", "flat", "use", "name", "grad", "pending")

    def __init__(self, key: str, codec: Codec, flat: Any, use: int, name: str,
                 grad: torch.Tensor) -> None:
        self.key, self.codec, self.flat, self.use = key, codec, flat, use
        self.name, self.grad = name, grad
        self.pending = None

    def start(self, runtime: ExchangeRuntime) -> None:
        with stream_of(self.grad):
            self.pending = runtime.start(self.codec, self.flat, self.use, self.key, self.name,
                                         shape=tuple(self.grad.shape))


class _Averaged:
    """The ``ctx`` of a gradient Horovod's optimizer averages again: it comes back as it is."""

    __slots__ = ("grad",)

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad


class QuantizedCompressor(CompressorSettings, Compressor):
    """A ``horovod.torch.compression.Compressor`` running a horovod_quant codec.

    Args: the codec, ``process_set``, and the settings of
    :class:`~horovod_quant.doors.DoorOptions` as ``options=`` or as keywords (seed, gather,
    policy, pipeline_elems; the others raise ValueError naming the doors that take them, pass
    them to ``hq.torch.DistributedOptimizer`` itself); ``HQ_MPI_EXCHANGE`` is read here, once
    (:class:`~horovod_quant.doors.DoorEnvironment`); ``stats`` holds the
    :class:`~horovod_quant.stats.StepStats`. The policy's name rules apply to tensors Horovod
    names (module doc). Integer, boolean and sparse tensors pass to Horovod unchanged (exact),
    never quantized. ``codec_states`` holds the adaptive codecs' states (NDQSG's) its exchanges
    carry from step to step.
    """

    def __init__(self, codec: Codec | RequestedCodec, process_set: Any = None,
                 options: DoorOptions | None = None, **settings: Any) -> None:
        super().__init__(codec, door_options(settings, options, door=TORCH_COMPRESSOR_DOOR),
                         TORCH_COMPRESSOR_DOOR, process_set)
        self._comm: Any = None
        self._uses: dict[str, int] = {}
        self._resumed: list = []  # the use counters loaded from a checkpoint, for the check
        self._unnamed = 0
        self._warned_unnamed = False
        self._decompressing = False
        self._deferred: list[_Job] = []  # not started yet
        self._open: list[_Job] = []  # not finished yet
        self._refusal = Refusal("compressor", "a new compressor (and a new Horovod "
                                "DistributedOptimizer)")

    def shared_config(self) -> dict:
        return {**super().shared_config(),
                **mpi_exchange_config(self.policy.codecs(self.codec),
                                      self.environment.mpi_exchange),
                "fabric": list(self.runtime.fabric),
                "step": max((n for _, n in self._resumed), default=0),
                "resumed_uses": self._resumed}

    def _finish_step(self) -> None:
        """Wait for the configuration check (the first time), build every exchange the policy
        can use in the policy's order (their collective set-up, e.g. the MPI communicator, then
        runs in the same order on every rank), start the deferred jobs, start the pieces of
        every open job (so no job's transfer waits for the job before it to finish) and finish
        them, each in key order."""
        if not self.runtime.opened:
            self.runtime.open(self.policy.codecs(self.codec), self._comm)
            self._refusal.register(max(self._uses.values()) - 1, horovod_end_of_job(self._comm))
        by_key = lambda j: j.key  # noqa: E731
        jobs, self._deferred = sorted(self._deferred, key=by_key), []
        for job in jobs:
            job.start(self.runtime)
        jobs, self._open = sorted(self._open, key=by_key), []
        for job in jobs:
            with stream_of(job.grad):
                job.pending.advance(block=True)
        for job in jobs:
            with stream_of(job.grad):
                job.pending.wait()
        self._refusal.count(max(self._uses.values()))

    def _world_size(self) -> int:
        return (self.process_set if self.process_set is not None else hvd.global_process_set
                ).size()

    def state_dict(self) -> dict[str, Any]:
        """What a resumed job needs to continue with the same seeds and codec states: how many
        times each tensor key was exchanged, the world size, and the codec states (plain Python
        values, for ``torch.save`` beside the model's and optimizer's state dicts)."""
        return {"uses": dict(self._uses), "world_size": self._world_size(),
                "codec_states": self.codec_states.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s state before the first step, on every rank (or on
        one, then :func:`~horovod_quant.torch.broadcast.broadcast_state`); the cross-rank check
        at the first step compares the loaded counters: ranks at different steps raise the same
        error. A state saved at another world size is adapted, with one warning
        (:func:`~horovod_quant.doors.load_codec_states`).

        Raises:
            ValueError: ``state`` is not such a state, or the compressor has exchanged already.
        """
        if self.runtime.checking:
            raise ValueError("load_state_dict() on a compressor that has exchanged tensors: "
                             "load into a new compressor, before the first backward pass")
        try:
            uses = {str(key): int(count) for key, count in state["uses"].items()}
        except (KeyError, TypeError, AttributeError, ValueError):
            raise ValueError("not a compressor state: pass what QuantizedCompressor."
                             "state_dict() returned") from None
        self._uses, self._resumed = uses, sorted(uses.items())
        load_codec_states(self.codec_states, state["codec_states"], state.get("world_size"),
                          self._world_size(), "compressor")

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        with self._refusal.guard():
            return self._compress(tensor, horovod_call())

    def _compress(self, tensor: torch.Tensor, call: Any) -> tuple[torch.Tensor, Any]:
        if call is not None and call.repeats_synchronize:  # averaged already: not again
            return torch.ones(1, dtype=torch.float32), _Averaged(tensor)
        self._refusal.begin()  # a step begins at its first tensor, whichever path it takes
        name = call.name(tensor) if call is not None else None
        if name is None and self.policy.rules and not self._warned_unnamed:
            self._warned_unnamed = True
            _warn_unnamed(self.policy)
        codec = None
        if tensor.dtype.is_floating_point and not tensor.is_sparse:
            codec = self.policy.codec_for(self.codec, tensor.shape, name)
        wire = horovod_dtype(codec, tensor)
        if wire is not None:
            self.stats.add_raw(tensor.numel() * wire.itemsize,
                               tensor.numel() * tensor.element_size())
            # a contiguous copy of a strided tensor (channels_last), which Horovod refuses
            sent = tensor.to(wire, memory_format=torch.contiguous_format)
            return (sent, None) if wire == tensor.dtype else (sent, tensor.dtype)
        if self._decompressing:  # first compress after a decompress: a new step
            self._unnamed, self._decompressing = 0, False
        if name is None:
            name, self._unnamed = f"#{self._unnamed}", self._unnamed + 1
        use = self._uses.get(name, 0)
        self._uses[name] = use + 1
        if not self.runtime.checking:  # the first compressed tensor: the check starts, unawaited
            # Horovod's collectives: a transport that pairs by call order would need the jobs
            # started in one order, and Horovod calls compress in each rank's hook order
            self._comm = transport_collectives(self.process_set, "horovod",
                                               environment=self.environment)
            # the plans weigh the links of the ranks where the gradients live
            self.runtime.use_fabric(self.environment.fabric(on_gpu(tensor)))
            self.runtime.check(self._comm, self.shared_config())
        job = _Job(name, codec, flat_array(tensor), use, f"{self.runtime.prefix}.{name}", tensor)
        if self.runtime.blocks_on_peers(codec):  # (every codec, before the check passed)
            self._deferred.append(job)
        else:
            job.start(self.runtime)
        self._open.append(job)
        return torch.ones(1, dtype=torch.float32), job

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        if ctx is None:
            return tensor
        if isinstance(ctx, _Averaged):
            return ctx.grad
        with self._refusal.guard():
            return self._decompress(tensor, ctx)

    def _decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        self._decompressing = True
        if isinstance(ctx, torch.dtype):
            return tensor.to(ctx)
        if self._open:
            self._finish_step()
        job, grad = ctx, ctx.grad
        with stream_of(grad):
            mean = as_tensor(self.runtime.finish(job.pending)).reshape(grad.shape)
        self.stats.bytes_sent += tensor.numel() * tensor.element_size()
        factor = float(tensor.reshape(-1)[0])
        if factor != 1.0:
            mean.mul_(factor)
        return mean.to(device=grad.device, dtype=grad.dtype)


Compression = CompressionNamespace(QuantizedCompressor, hvd.global_process_set, "PyTorch",
                                  host_count=hvd.cross_size)
