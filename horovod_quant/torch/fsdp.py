"""PyTorch FSDP2 with its replica all-reduce (HSDP's traffic between hosts) compressed.

    mesh = init_device_mesh("cuda", (hosts, per_host), mesh_dim_names=("replicate", "shard"))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = fsdp.compress_replica_allreduce(model, mesh.get_group("replicate"),
                                            hq.get_codec("qsgd", bits=8, bucket_size=512))

FSDP shards over the host's ranks (a 1-D mesh) and reduce-scatters inside the host; the hook
it runs on each reduce-scattered shard (``set_all_reduce_hook``) averages that shard over
``replicate_group``, the ranks holding it on the other hosts. FSDP2's own HSDP (a 2-D mesh)
all-reduces before its hook runs, so the hook cannot replace that all-reduce. FSDP's divisor
(its reduce-scatter's mean, or its division after the hook) and the replicas' mean give the
mean over every rank, as HSDP does. Each shard runs the DDP door's machinery
(:class:`~horovod_quant.torch.ddp.QuantizationState`: policy, exchanges, fallback, stats,
checkpoints), the shard of ``fully_shard`` module ``i`` as its bucket ``i``, with seed
:meth:`ReplicaState.shard_seed`. FSDP reads the shard as soon as the hook returns, so the hook
waits for its exchanges; the step ends with the backward (an autograd final callback).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.autograd import Variable

from .. import gpu
from ..core.base import Codec
from ..doors import FSDP_DOOR, CompressorSettings, DoorOptions, door_options
from .ddp import QuantizationState, _Part, _parts
from .tensors import on_gpu, stream_of

__all__ = ["ReplicaState", "compress_replica_allreduce"]

class _Shard:
    """The shard one ``fully_shard`` module's reduce-scatter hands the hook, as the DDP state
    and its fallback see a bucket (``index()``, ``parameters()``): FSDP's parameters with a
    gradient, each in a slot of the flat shard (its elements first, FSDP's padding after).

    Args:
        index: the module's place among the root's ``fully_shard`` modules (the bucket index).
        param_group: its FSDP parameter group.
        names: ``{id(parameter): name}`` of the root's parameters.
    """

    def __init__(self, index: int, param_group: Any, names: dict[int, str]) -> None:
        mesh = param_group.mesh_info
        self._index = index
        self.rank, self.size = mesh.shard_mesh_rank, mesh.shard_mesh_size
        # what FSDP reduce-scatters: the parameters that get a gradient, in its order
        self._params = [p for p in param_group.fsdp_params if p.sharded_param.requires_grad]
        self.names = {id(p): (names[id(p.sharded_param)], p) for p in self._params}
        #: the flat shard's elements (every slot, padding included)
        self.numel = sum(p.padded_sharded_param_size.numel() for p in self._params)
        self._parts: list[_Part] | None = None

    def index(self) -> int:
        return self._index

    def parameters(self) -> list[Any]:
        return self._params

    def config(self) -> list[int]:
        """What replicas must share: the shard's place among the host's shards."""
        return [self.rank, self.size]

    def offset(self) -> int:
        """Where this shard starts in its module's flat gradient (every shard's slots)."""
        return self.rank * self.numel

    def key(self) -> str:
        """The shard's parameters' names (the fallback's key of the bucket)."""
        return ",".join(name for name, _ in self.names.values())

    def parts(self, numel: int, codec_index: Callable[[Any, str], int | None]) -> list[_Part]:
        """The parts of the flat shard, FSDP's ``numel`` elements (``codec_index(parameter,
        name)``: where the policy sends a parameter); padding is in none."""
        if numel != self.numel:
            raise ValueError(
                f"horovod_quant FSDP hook: the shard of {self.key()} holds {numel} elements, "
                f"not the {self.numel} of its parameters that require a gradient: a parameter "
                "got no gradient this step (module.set_reduce_scatter_unused_params(True) "
                "reduce-scatters its zeros) or stopped requiring one")
        if self._parts is None:
            indices, ranges, at = [], [], 0
            for p in self._params:
                real = p.sharded_size.numel()
                if real:
                    indices.append(codec_index(p.sharded_param, self.names[id(p)][0]))
                    ranges.append((at, at + real))
                at += p.padded_sharded_param_size.numel()
            self._parts = _parts(indices, ranges)
        return self._parts


class ReplicaState(QuantizationState):
    """The state of :func:`compress_replica_allreduce`: a
    :class:`~horovod_quant.torch.ddp.QuantizationState` over ``replicate_group`` whose buckets
    are the module's shards (``stats``, ``codecs``, ``step``, ``fabric``, the fallback's
    records, ``state_dict`` / ``load_state_dict`` as there; it does not pickle). With FSDP's
    default divisors the result is HSDP's mean; a custom ``set_gradient_divide_factor(f)``
    divides the host's sum by ``f`` before the replicas' mean (HSDP's divides the whole sum).

    Args:
        module: the root ``fully_shard`` module.
        replicate_group: the ranks holding this rank's shards on the other hosts.
        codec, options, settings: as the DDP state's.
    """

    DOOR = FSDP_DOOR

    def __init__(self, module: torch.nn.Module, replicate_group: Any,
                 codec: Codec | str | CompressorSettings, options: DoorOptions | None = None,
                 **settings: Any) -> None:
        groups = _fsdp_groups(module)
        # another door's setting is refused here naming the doors that take it, before any
        # collective (the state itself takes the keywords over a compressor's settings, and
        # reads the environment, DoorEnvironment, as the DDP hook does)
        door_options(settings, options, door=self.DOOR)
        if dist.is_initialized() and dist.get_rank(replicate_group) < 0:
            raise ValueError(f"horovod_quant FSDP hook: rank {dist.get_rank()} is not in "
                             "replicate_group: pass the group of the ranks holding its shards")
        super().__init__(codec, replicate_group, module.named_parameters(), options, **settings)
        names = {id(p): name for name, p in module.named_parameters()}
        self._shards = [_Shard(i, group, names) for i, (_, group) in enumerate(groups)]
        self._step_open = False
        for shard, (fsdp_module, _) in zip(self._shards, groups):
            fsdp_module.set_all_reduce_hook(
                lambda grad, shard=shard: self.exchange_shard(shard, grad))

    def shared_config(self) -> dict:
        return {**super().shared_config(), "door": "fsdp",
                "shards": [s.config() for s in self._shards]}

    def shard_seed(self, step: int, key: str, offset: int, codec_index: int = 0) -> int:
        """The seed of the exchange of ``codecs[codec_index]`` at ``step`` for the shard of
        the parameters named ``key`` (comma-joined) starting at element ``offset`` of their
        module's flat gradient: the runtime's (:func:`~horovod_quant.core.rng.payload_seed`,
        the DDP hook's buckets' too)."""
        return self.runtime.seed_of(step, key, offset, codec_index)

    def seed_of(self, step: int, index: int, codec_index: int = 0) -> int:
        """The seed of ``codecs[codec_index]``'s exchange in the shard of ``fully_shard``
        module ``index`` at ``step`` (:meth:`shard_seed`)."""
        shard = self._shards[index]
        return self.shard_seed(step, shard.key(), shard.offset(), codec_index)

    def _payload_key(self, index: int) -> tuple[str, int]:
        shard = self._shards[index]
        return shard.key(), shard.offset()

    def _codec_of(self, param: Any, name: str) -> int | None:
        codec = self.policy.codec_for(self.codec, param.shape, name)
        return None if codec is None else self._codec_indices[codec.config_key()]

    def exchange_shard(self, shard: _Shard, grad: torch.Tensor) -> None:
        """FSDP's all-reduce hook: ``grad`` (``shard``'s flat gradient) becomes its mean over
        the replicas, in place, before this returns; the step's first also queues its end."""
        if not self.runtime.opened:
            self._open_exchanges(grad)
        parts = shard.parts(grad.numel(), self._codec_of)
        self._steps.begin()
        self._hook_fallback.bucket_arrived(False)
        start = (self._hook_fallback.start(shard, grad, parts, shard.names)
                 or self._start_parts(shard.index(), parts, grad, self.step))
        stream = None
        if on_gpu(grad):
            with stream_of(grad):
                stream = gpu.capture_stream()
        if not self._step_open:
            Variable._execution_engine.queue_callback(self._end_step)
            self._step_open = True
        self._pipeline.submit(start, True, stream).wait()

    def _end_step(self) -> None:
        """The end of a backward that exchanged shards: the fallback's end of the step (on
        the worker, after the shards), then the next step."""
        self._step_open = False
        self._hook_fallback.bucket_arrived(True)
        end = self._hook_fallback.then_end_step(lambda: lambda: None, self.step,
                                                self.runtime.prefix)
        self.step += 1
        self._pipeline.submit(end, True).wait()
        self._steps.end(self.step)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a ReplicaState does not pickle: save state.state_dict() and load it "
                        "into the state compress_replica_allreduce returns for the new model")


def _fsdp_groups(module: torch.nn.Module) -> list[tuple[Any, Any]]:
    """``(fully_shard module, its parameter group)`` for every module of ``module``'s tree
    that FSDP2 shards parameters of, in ``module.modules()`` order.

    Raises:
        TypeError: ``module`` is not a ``fully_shard`` module.
        ValueError: a module shards over a 2-D mesh (HSDP) or replicates (``replicate``).
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        raise TypeError(f"horovod_quant FSDP hook: {type(module).__name__} is not sharded: "
                        "call torch.distributed.fsdp.fully_shard(module, mesh=...) first")
    found = []
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        for group in sub._get_fsdp_state()._fsdp_param_groups:
            info = group.mesh_info  # FSDP alone: a shard dimension, no replicate one
            if (getattr(info, "shard_mesh_dim", None) is None
                    or getattr(info, "replicate_mesh_dim", None) is not None):
                raise ValueError(
                    "horovod_quant FSDP hook: a module is sharded over a 2-D mesh (HSDP) or "
                    "replicated, and FSDP all-reduces those gradients itself before any hook: "
                    "shard over the host's ranks alone (fully_shard(m, mesh=mesh['shard'])) "
                    "and pass mesh.get_group('replicate') as replicate_group")
            found.append((sub, group))
    return found


def compress_replica_allreduce(module: torch.nn.Module, replicate_group: Any,
                               compression: Codec | str | CompressorSettings,
                               **options: Any) -> ReplicaState:
    """Average the gradient shards of ``module`` (the root ``fully_shard`` module; every
    ``fully_shard`` module of its tree) across hosts through ``compression``.

    Args:
        module: the model, ``fully_shard``-ed over the host's ranks (a 1-D mesh).
        replicate_group: a ``torch.distributed`` group of the ranks holding the same shards
            on different hosts (``mesh.get_group("replicate")``).
        compression: a codec (``hq.get_codec(...)``), a codec name, or
            ``horovod_quant.torch.Compression.<name>(...)``.
        options: ``options=DoorOptions(...)``, or the DDP hook's settings as keywords (seed,
            gather, pipeline_elems, policy, fallback, baseline).

    Returns:
        The :class:`ReplicaState`.
    """
    return ReplicaState(module, replicate_group, compression, **options)
