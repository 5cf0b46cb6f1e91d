"""A ``DistributedDataParallel`` communication hook running any codec of this package.

    import horovod_quant as hq
    from horovod_quant.torch import ddp

    model = torch.nn.parallel.DistributedDataParallel(model)
    state = ddp.QuantizationState(hq.get_codec("qsgd", bits=8, bucket_size=512))
    model.register_comm_hook(state, ddp.quantization_hook)

The hook starts a bucket's exchanges and returns a future; the last bucket's hook finishes every
exchange of the step in bucket order, from one thread, as torch.distributed's call-order pairing
needs. In each bucket the parameters the state's :class:`~horovod_quant.policy.LayerPolicy`
exempts are averaged exactly (one float32 allreduce); the others go through one exchange per
codec, the codecs in the order of ``state.codecs``. The exchange of codec ``k`` in bucket ``i``
of step ``t`` uses seed ``state.seed_of(t, i, k)``, so ``mean_estimate(codec, [that vector on
each rank], state.seed_of(t, i, k), gather=state.gather, pipeline_elems=state.pipeline_elems,
topology=state.topology, fabric=state.fabric)`` reproduces it exactly. The first hook runs the
cross-rank configuration check. docs/ddp.md
tells the whole story (seeds, names, clean exit).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from ..doors import (UNSET, CodecRequest, CompressorSettings, ConfigCheck, DoorOptions,
                     door_options)
from ..exchange.cost import Fabric
from ..exchange.driver import Exchange
from ..core.base import Codec
from ..core.rng import derive_key
from ..policy import LayerPolicy
from .tensors import as_array, as_tensor, flat_array, on_gpu, parameter_names, stream_of
from .distributed import process_group_collectives

__all__ = ["QuantizationState", "quantization_hook"]


class _BucketJob:
    """One bucket's exchanges of this step: ``finish()`` waits for them in order, writes the
    means into the bucket and returns the future's value."""

    __slots__ = ("finish", "future")

    def __init__(self, finish: Callable[[], torch.Tensor]) -> None:
        self.finish = finish
        self.future: torch.futures.Future[torch.Tensor] = torch.futures.Future()


class _Part:
    """The elements of a bucket's flat buffer that travel together: through the exact
    allreduce (``codec_index`` None) or through the exchange of ``state.codecs[codec_index]``.

    Args:
        codec_index: see above.
        runs: ``(start, stop)`` element ranges of the buffer, in bucket order.
    """

    __slots__ = ("codec_index", "runs", "numel")

    def __init__(self, codec_index: int | None, runs: list[tuple[int, int]]) -> None:
        self.codec_index = codec_index
        self.runs = runs
        self.numel = sum(stop - start for start, stop in runs)

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """This part of ``flat`` as one vector (a view when it is one range)."""
        if len(self.runs) == 1:
            start, stop = self.runs[0]
            return flat[start:stop]
        return torch.cat([flat[start:stop] for start, stop in self.runs])

    def scatter(self, flat: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` (this part's elements, in order) into ``flat``."""
        at = 0
        for start, stop in self.runs:
            flat[start:stop].copy_(values[at:at + stop - start])
            at += stop - start


def _parts(codec_indices: list[int | None], ranges: list[tuple[int, int]]) -> list[_Part]:
    """The parts of a bucket whose parameters occupy ``ranges`` and get ``codec_indices``:
    the exact part first, then one per codec in codec order; adjacent ranges merged."""
    runs: dict[int | None, list[tuple[int, int]]] = {}
    for k, (start, stop) in sorted(zip(codec_indices, ranges), key=lambda item: item[1]):
        part = runs.setdefault(k, [])
        if part and part[-1][1] == start:
            part[-1] = (part[-1][0], stop)
        else:
            part.append((start, stop))
    order = sorted(runs, key=lambda k: -1 if k is None else k)
    return [_Part(k, runs[k]) for k in order]


class QuantizationState(CompressorSettings):
    """The state of :func:`quantization_hook` for one DDP model.

    Args:
        codec: the codec (:func:`horovod_quant.get_codec`), a codec name, or a door's
            compressor, such as ``horovod_quant.torch.Compression.<name>(...)`` (which needs
            Horovod; its codec, seed, gather schedule and policy come along). A world-sized
            codec asked for by name or through ``Compression`` without ``world_size`` gets the
            process group's size.
        process_group: the DDP model's process group (None: the default group).
        seed, gather, pipeline_elems, policy, options: the settings of
            :class:`~horovod_quant.doors.DoorOptions`; one not given comes from ``options``,
            else from the compressor, else is DoorOptions' default
            (``LayerPolicy.everything()`` compresses every parameter). The optimizer-only
            settings raise ValueError here.
        named_parameters: ``(name, parameter)`` pairs of the model (``model.named_parameters()``),
            needed by a policy with name rules (ValueError without them); the names are part
            of the cross-rank check.

    Attributes:
        codecs: the codecs the policy can give a parameter, each with an exchange of its own:
            the state's codec first, then the rules' (each configuration once).
        stats: the :class:`~horovod_quant.stats.StepStats` of the exchanges since the last
            ``stats.reset()`` (the other doors report the same).
        step: steps whose gradients were exchanged so far.
        topology: which ranks share nodes where the exchanges may take hierarchical plans,
            else None.
        fabric: the links' speeds the plan choice weighs (:class:`~horovod_quant.exchange.
            cost.Fabric`: GPU or CPU ranks' defaults by where the first bucket lives, and the
            ``HQ_LINK_GBIT`` / ``HQ_INTRA_GBYTE`` / ``HQ_ROUND_US`` variables); None before the
            first step. With ``topology``, what ``mean_estimate`` needs to reproduce a bucket.
    """

    def __init__(self, codec: Codec | str | CompressorSettings, process_group: Any = None,
                 seed: int | None = None, gather: str | None = None,
                 pipeline_elems: int | None = UNSET, policy: LayerPolicy | None = None,
                 named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                 options: DoorOptions | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("horovod_quant DDP hook: call torch.distributed.init_process_group"
                               " before building a QuantizationState")
        comm = process_group_collectives(process_group)
        topology = getattr(comm.hierarchy, "topology", None)
        # a codec too small for every rank's payload may serve one payload per node
        nodes = (lambda: topology.host_count) if topology is not None else None
        inherited = None
        if isinstance(codec, CompressorSettings):  # a door's Compression.<codec>(...)
            inherited = codec.options
            request = codec.codec_request
            codec = (request.build(lambda: comm.size, nodes) if request is not None
                     and request.needs_world_size else codec.codec)
        elif isinstance(codec, str):
            codec = CodecRequest(codec, {}).build(lambda: comm.size, nodes)
        if not isinstance(codec, Codec):
            raise ValueError(f"codec={codec!r} is not understood: pass hq.get_codec(...), a "
                             "codec name, or hq.torch.Compression.<codec>(...)")
        # the payloads a world-sized codec combines: one per rank, or one per node where
        # only the hierarchical exchange can run it
        allowed = {comm.size} | ({topology.host_count} if topology is not None else set())
        if codec.needs_world_size and codec.params.get("world_size") not in allowed:
            raise ValueError(f"{codec.name} was built for world_size="
                             f"{codec.params.get('world_size')}, but the process group has "
                             f"{comm.size} ranks: leave world_size out (it is filled in) or "
                             f"pass world_size={comm.size}"
                             + (f" (or {topology.host_count}, its nodes: the hierarchical "
                                f"exchange alone then runs it)" if topology is not None else ""))
        settings = door_options(options, inherited, seed=seed, gather=gather,
                                pipeline_elems=pipeline_elems, policy=policy)
        super().__init__(codec, settings.check_door("DDP hook"))
        self._names = parameter_names(named_parameters)
        if self.policy.rules and self._names is None:
            raise ValueError(
                f"the policy has name rules ({[p for p, _ in self.policy.rules]}) but the "
                "QuantizationState has no parameter names: pass "
                "named_parameters=model.named_parameters()")
        self.process_group = process_group
        self.step = 0
        unique = {self.codec.config_key(): self.codec}
        for _, c in self.policy.rules:
            if c is not None and c.horovod_allreduce != "keep":  # a "keep" rule: exact
                unique.setdefault(c.config_key(), c)
        self.codecs: list[Codec] = list(unique.values())
        self._codec_indices = {key: k for k, key in enumerate(unique)}
        self._comm = comm
        # which ranks share nodes, where the exchanges may take hierarchical plans (several
        # nodes of several ranks, docs/codecs.md), else None: what mean_estimate needs
        self.topology = getattr(comm.hierarchy, "topology", None)
        self.fabric: Fabric | None = None  # set at the first bucket (where the codecs run)
        self._check: ConfigCheck | None = None
        self._exchanges: list[Exchange] | None = None
        self._layouts: dict[int, tuple[tuple[int, ...], list[_Part]]] = {}
        self._means: dict[tuple[int, int], Any] = {}  # (bucket, codec) -> reused output
        self._open: list[_BucketJob] = []

    def shared_config(self) -> dict:
        config = {**super().shared_config(), "door": "ddp",
                  "fabric": None if self.fabric is None else list(self.fabric)}
        if self._names is not None:
            config["parameters"] = [[name, list(p.shape)] for name, p in self._names.values()]
        return config

    def seed_of(self, step: int, index: int, codec_index: int = 0) -> int:
        """The seed of the exchange of ``codecs[codec_index]`` in bucket ``index`` at step
        ``step`` (module doc)."""
        if codec_index == 0:
            return derive_key(self.seed, step, index)
        return derive_key(self.seed, step, index, codec_index)

    def _codec_index(self, param: torch.Tensor) -> int | None:
        """Where the policy sends ``param``: ``codecs`` index, or None (exact)."""
        name = None
        if self._names is not None:
            if id(param) not in self._names:
                raise ValueError(f"a DDP bucket holds a parameter of shape {tuple(param.shape)} "
                                 "that is missing from named_parameters: pass every parameter "
                                 "of the DDP model (model.named_parameters())")
            name = self._names[id(param)][0]
        codec = self.policy.codec_for(self.codec, param.shape, name)
        return None if codec is None else self._codec_indices[codec.config_key()]

    def _layout(self, bucket: dist.GradBucket) -> list[_Part]:
        """The parts of ``bucket`` (kept per bucket index while its parameters stay)."""
        params = bucket.parameters()
        ids = tuple(id(p) for p in params)
        cached = self._layouts.get(bucket.index())
        if cached is None or cached[0] != ids:
            base = bucket.buffer().storage_offset()
            ranges = [(g.storage_offset() - base, g.storage_offset() - base + g.numel())
                      for g in bucket.gradients()]
            cached = self._layouts[bucket.index()] = (
                ids, _parts([self._codec_index(p) for p in params], ranges))
        return cached[1]

    def _mean_buffer(self, index: int, k: int, flat: Any) -> Any:
        """The float32 array the mean of codec ``k``'s part of bucket ``index`` is written
        to, where ``flat`` lives (kept across steps: DDP's buckets keep their sizes after
        the first rebuild)."""
        mean = self._means.get((index, k))
        if mean is None or mean.size != flat.size or type(mean) is not type(flat):
            device = as_tensor(flat).device
            mean = self._means[index, k] = as_array(torch.empty(flat.size, dtype=torch.float32,
                                                                device=device))
        return mean

    def exchange_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Start ``bucket``'s exchanges; the last bucket's call finishes the step (module
        doc)."""
        grad = bucket.buffer()
        if self._exchanges is None:  # the first bucket: nothing is combined before the check
            if self._check is None:
                self.fabric = Fabric.for_ranks(on_gpu(grad))
                self._check = ConfigCheck(self._comm, self.shared_config())
            self._check.wait()  # a mismatch raises here, at this and every later call
            self._exchanges = [Exchange(c, self._comm, gather=self.gather,
                                        pipeline_elems=self.pipeline_elems, fabric=self.fabric)
                               for c in self.codecs]
        job = _BucketJob(self._average_sparse(grad) if grad.is_sparse
                         else self._start_parts(bucket, grad))
        self._open.append(job)
        if bucket.is_last():
            self._finish_step()
        return job.future

    def _start_parts(self, bucket: dist.GradBucket, grad: torch.Tensor
                     ) -> Callable[[], torch.Tensor]:
        """Start the exact allreduce and the codec exchanges of ``bucket`` (buffer ``grad``);
        returns the function that finishes them and writes the means into ``grad``."""
        index, name = bucket.index(), f"{self._check.prefix}.b{bucket.index()}"
        flat, started = grad.detach().reshape(-1), []
        with stream_of(grad):
            for part in self._layout(bucket):
                vector = flat_array(part.gather(flat))
                if part.codec_index is None:
                    self.stats.add_raw(vector.nbytes)
                    started.append((part, self._comm.allreduce_async(vector, f"{name}.exact")))
                    continue
                k = part.codec_index
                pending = self._exchanges[k].start(
                    vector, self.seed_of(self.step, index, k), name if k == 0 else f"{name}.c{k}",
                    out=self._mean_buffer(index, k, vector))
                pending.advance(block=True)  # when a norm arrives differs between ranks
                started.append((part, pending))

        def finish() -> torch.Tensor:
            with stream_of(grad):
                for part, handle in started:
                    if part.codec_index is None:
                        mean = as_tensor(handle.wait()).div_(self._comm.size)
                    else:
                        mean = as_tensor(handle.wait())
                        self.stats.add(handle.stats)
                    part.scatter(flat, mean)
            return grad

        return finish

    def _average_sparse(self, grad: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start the exact mean of a sparse gradient (``nn.Embedding(sparse=True)``), as DDP's
        own reducer computes it: an allreduce of the sparse tensor. The codecs quantize dense
        vectors; the rows a sparse gradient sends are already few. Returns the function that
        waits for it and returns the mean (a sparse tensor)."""
        nbytes = grad._values().numel() * grad.element_size() + grad._indices().numel() * 8
        self.stats.add_raw(nbytes)
        # not HANDED's: DDP's reducer holds the bucket and the mean longer than gloo does
        work = dist.all_reduce(grad, group=self.process_group, async_op=True)

        def finish() -> torch.Tensor:
            return work.get_future().wait()[0].div_(self._comm.size)

        return finish

    def _finish_step(self) -> None:
        """Finish every open bucket in bucket order and complete its future with its mean
        (on error: every open future fails with it)."""
        jobs, self._open = self._open, []
        self.step += 1
        try:
            for job in jobs:
                job.future.set_result(job.finish())
        except BaseException as exc:
            for job in jobs:
                if not job.future.done():
                    job.future.set_exception(exc)
            raise


def quantization_hook(state: QuantizationState, bucket: dist.GradBucket
                      ) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the mean of ``bucket`` over the state's process group,
    estimated by the state's codec (register with
    ``model.register_comm_hook(state, quantization_hook)``).

    Args:
        state: the :class:`QuantizationState`.
        bucket: DDP's gradient bucket.

    Returns:
        A future whose value is the bucket's flat tensor holding the mean estimate (complete
        once the last bucket of the step has been handed to the hook).
    """
    return state.exchange_bucket(bucket)


# DDP compares the hook's annotations with the objects themselves (not their strings)
quantization_hook.__annotations__.update(
    {"state": QuantizationState, "bucket": dist.GradBucket,
     "return": torch.futures.Future[torch.Tensor]})

