"""A ``DistributedDataParallel`` communication hook running any codec of this package.

    import horovod_quant as hq
    from horovod_quant.torch import ddp

    model = torch.nn.parallel.DistributedDataParallel(model)
    state = ddp.QuantizationState(hq.get_codec("qsgd", bits=8, bucket_size=512))
    model.register_comm_hook(state, ddp.quantization_hook)

The hook hands the bucket to the state's worker thread and returns a future at once, so
backward goes on while the worker encodes, exchanges and decodes (:class:`BucketPipeline`: the
collectives of every rank in one order, as torch.distributed's call-order pairing needs). The
parameters the policy exempts are averaged exactly; the others go through one exchange per
codec, in the order of ``state.codecs``. Codec ``k``'s exchange at step ``t`` in ``bucket`` has
seed ``state.seed_of(t, bucket, k)``, keyed by what the bucket holds (:meth:`QuantizationState.
bucket_key`): ``mean_estimate(codec, [that vector on each rank], that seed, gather=state.gather,
pipeline_elems=state.pipeline_elems, topology=state.topology, fabric=state.fabric)`` gives it.
The first hook checks the ranks' configurations; exchange tags carry the step. ``state_dict()``
and pickling (as ``PowerSGDState``) carry the step, the codecs' and the fallback's states and the
last step's buckets, which a resumed state's first step exchanges (:class:`_Replay`, docs/ddp.md).
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from .. import gpu
from ..core.base import Codec
from ..core.contract import HorovodWire
from ..doors import (
    DDP_DOOR,
    CodecRequest,
    CompressorSettings,
    DoorOptions,
    door_options,
    load_codec_states,
)
from ..exchange import job_end
from ..exchange.cost import Fabric
from ..exchange.job_end import LEDGER, DoorSteps
from ..exchange.topology import SerialWorker, Topology
from ..fallback import FallbackAttributes
from ..stats import StepStats
from .ddp_fallback import HookFallback
from .distributed import own_group, process_group_collectives, store_end_of_job
from .tensors import as_array, as_tensor, flat_array, on_gpu, parameter_names, stream_of

__all__ = ["QuantizationState", "quantization_hook"]

log = logging.getLogger("horovod_quant")

#: finishes a bucket's exchanges, writes the means into its buffer and returns the future's
#: value (the buffer, or a sparse bucket's mean)
Finish = Callable[[], torch.Tensor]


class _BucketJob:
    """One bucket's exchanges on the worker: :meth:`run_start` starts them, :meth:`run_finish`
    finishes them and completes :attr:`future` (or fails it with the error), both with the
    bucket's CUDA stream current (``stream``; None for host buckets)."""

    __slots__ = ("start", "finish", "future", "stream")

    def __init__(self, start: Callable[[], Finish], stream: Any) -> None:
        self.start, self.stream = start, stream
        self.finish: Finish | None = None  # set once started
        self.future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def _on_stream(self) -> Any:
        return self.stream.entered() if self.stream is not None else contextlib.nullcontext()

    def run_start(self) -> None:
        try:
            with self._on_stream():
                self.finish = self.start()
        except BaseException as exc:  # its future fails; the other buckets go on
            self.future.set_exception(exc)

    def run_finish(self) -> None:
        if self.finish is None:  # its start failed
            return
        try:
            with self._on_stream():
                value = self.finish()
        except BaseException as exc:
            self.future.set_exception(exc)
            return
        self.future.set_result(value)


class BucketPipeline:
    """Runs the buckets' exchanges on a worker thread while backward goes on.

    The hook hands over each bucket with :meth:`submit` and returns the bucket's future. The
    worker runs, in this order on every rank: bucket 0's start, bucket 1's start, bucket 0's
    finish, bucket 2's start, bucket 1's finish, ..., the last bucket's finish (submitted with
    the step's last bucket). So one bucket is on the wire while the next one is encoded, every
    collective comes from one thread in an order every rank shares (the order DDP hands over
    the buckets), and an adaptive codec's state moves at the same points on every rank. A
    future completes once its bucket's means are in place, or fails with its error.

    Args:
        name: the worker thread's name.
    """

    def __init__(self, name: str) -> None:
        self._worker = SerialWorker(name)
        self._open: _BucketJob | None = None  # started, not finished

    def submit(self, start: Callable[[], Finish], last: bool,
               stream: Any = None) -> torch.futures.Future[torch.Tensor]:
        """Queue ``start`` (it starts the bucket's collectives and returns the function that
        finishes them) and the finish of the bucket before; ``last``: the step's last bucket,
        finished at once after its start. ``stream``: the CUDA stream the work is queued on
        (:func:`horovod_quant.gpu.capture_stream`), None for host buckets."""
        job = _BucketJob(start, stream)
        self._worker.submit(job.run_start)
        if self._open is not None:
            self._worker.submit(self._open.run_finish)
        self._open = job
        if last:
            self._worker.submit(job.run_finish)
            self._open = None
        return job.future


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


class _Pieces:
    """A DDP bucket whose parameters travel in other buckets (:class:`_Replay`): its
    :attr:`future` completes with its ``buffer`` once the ``count`` buckets holding them are
    done, or fails with the first one's error."""

    __slots__ = ("buffer", "count", "future", "_lock")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer, self.count = buffer, 0
        self.future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._lock = threading.Lock()

    def one_done(self, done: torch.futures.Future) -> None:
        """A done callback of a bucket holding some of the parameters (on the worker, or on
        the hook's thread where that bucket was done before the callback was added)."""
        with self._lock:
            if self.future.done():
                return
            try:
                done.value()
            except BaseException as exc:
                self.future.set_exception(exc)
                return
            self.count -= 1
            if self.count == 0:
                self.future.set_result(self.buffer)


class _Held:
    """A bucket the hook forms itself (:class:`_Replay`), as its fallback sees a DDP bucket."""

    __slots__ = ("_index", "_params")

    def __init__(self, index: int, params: list[torch.Tensor]) -> None:
        self._index, self._params = index, params

    def index(self) -> int:
        return self._index

    def parameters(self) -> list[torch.Tensor]:
        return self._params


class _Replay:
    """The buckets of a resumed state's first step. DDP forms a new process's first buckets
    from the parameters' registration order (recent torch: one bucket, unless
    ``find_unused_parameters=True``) and rebuilds them after that step in the order backward
    produced the gradients; the saved job exchanged the rebuilt ones. So at that step the hook
    exchanges the saved step's buckets: each gathered from DDP's as soon as DDP has handed over
    all of its parameters, in the saved order, and a DDP bucket completes once every bucket
    holding one of its parameters is done (:class:`_Pieces`).

    Args:
        layout: the saved step's buckets, each a list of ``[position, numel]`` of its
            parameters (:meth:`QuantizationState.state_dict`).
    """

    def __init__(self, layout: list[list[list[int]]]) -> None:
        self.layout = [[(int(pos), int(numel)) for pos, numel in bucket] for bucket in layout]
        #: position -> (its bucket in the layout, its element count)
        self.holder = {pos: (j, numel) for j, bucket in enumerate(self.layout)
                       for pos, numel in bucket}
        #: position -> (its gradient in DDP's buffer, the parameter), as they arrive
        self.arrived: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        #: bucket of the layout -> the DDP buckets it completes
        self.waiting: dict[int, list[_Pieces]] = {}
        self.next = 0  # the next bucket of the layout to exchange

    def take(self, positions: list[int], gradients: list[torch.Tensor],
             params: list[torch.Tensor], pieces: _Pieces) -> list[int]:
        """DDP handed over a bucket (its parameters' ``positions``, their ``gradients`` in
        its buffer, the ``params``; ``pieces`` completes it): the buckets of the layout now
        complete, in order (each after the ones before it).

        Raises:
            ValueError: a parameter is in no bucket of the layout, or of another size.
        """
        for pos, grad, param in zip(positions, gradients, params):
            held = self.holder.get(pos)
            if held is None or held[1] != grad.numel():
                raise ValueError(
                    f"horovod_quant DDP hook: the resumed state's buckets do not hold DDP's "
                    f"parameter {pos} ({grad.numel()} elements): load the checkpoint into the "
                    "model it was saved from, built and wrapped in DDP as before")
            self.arrived[pos] = (grad, param)
        for j in {self.holder[pos][0] for pos in positions}:
            pieces.count += 1
            self.waiting.setdefault(j, []).append(pieces)
        ready = []
        while (self.next < len(self.layout)
               and all(pos in self.arrived for pos, _ in self.layout[self.next])):
            ready.append(self.next)
            self.next += 1
        return ready


class _Positions:
    """The parameters a state's hook has met, numbered in the order it first met them, and how
    a bucket's key names them (:meth:`QuantizationState.bucket_key`).

    Args:
        names: ``{id(parameter): (name, parameter)}`` of the state's ``named_parameters``, or
            None.
        pickled: an unpickled state's parameters' names in position order, or None.
    """

    def __init__(self, names: dict[int, tuple[str, torch.Tensor]] | None,
                 pickled: list[str] | None) -> None:
        self._names, self._pickled = names, pickled
        self._ids: dict[int, int] = {}  # id(parameter) -> position
        self._params: list[torch.Tensor] = []

    def place(self, params: Iterable[torch.Tensor]) -> list[int]:
        """The positions of ``params``, those met for the first time placed after the others."""
        positions = []
        for p in params:
            pos = self._ids.get(id(p))
            if pos is None:
                pos = self._ids[id(p)] = len(self._params)
                self._params.append(p)
            positions.append(pos)
        return positions

    def known(self, params: Iterable[torch.Tensor]) -> list[int] | None:
        """The positions of ``params``, or None where one was never met."""
        positions = [self._ids.get(id(p)) for p in params]
        return None if None in positions else positions

    def label(self, pos: int) -> str:
        """The parameter at ``pos`` as a key names it: its name, else ``#pos``."""
        if self._names is not None:
            return self._names[id(self._params[pos])][0]
        if self._pickled is not None and pos < len(self._pickled):
            return self._pickled[pos]
        return f"#{pos}"

    def key(self, positions: list[int]) -> str:
        """The key of a bucket of the parameters at ``positions``, in order."""
        return ",".join(self.label(pos) for pos in positions)

    def names(self) -> list[str] | None:
        """The parameters' names in position order, where the state has them (pickled: an
        unpickled state keys its buckets as this one)."""
        if not self._params:
            return self._pickled
        if self._names is None and self._pickled is None:
            return None
        return [self.label(pos) for pos in range(len(self._params))]


def _counted(start: Callable[[], Finish], steps: DoorSteps, count: int
             ) -> Callable[[], Finish]:
    """``start``, whose finish then records ``count`` completed steps in the job's ledger."""
    def counted_start() -> Finish:
        finish = start()

        def counted_finish() -> torch.Tensor:
            out = finish()
            steps.end(count)
            return out
        return counted_finish
    return counted_start


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


def group_codec(codec: Codec | str | CompressorSettings, comm: Any, what: str = "codec"
                ) -> tuple[Codec, DoorOptions | None]:
    """The codec a door over a torch.distributed group runs (the DDP hook, the outer
    all-reduce), and the settings of the compressor it came in (None for the others).

    Args:
        codec: a codec, a codec name or ``"name:bits"`` (``CodecRequest.from_spec``), or a
            door's compressor; a world-sized codec asked for by name or through
            ``Compression`` without ``world_size`` gets the group's size.
        comm: the group's collectives (:func:`~.distributed.process_group_collectives`).
        what: the argument's name in the errors.

    Raises:
        ValueError: ``codec`` is none of these, or a world-sized codec built for another size.
    """
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
        codec = CodecRequest.from_spec(codec).build(lambda: comm.size, nodes)
    if not isinstance(codec, Codec):
        raise ValueError(f"{what}={codec!r} is not understood: pass hq.get_codec(...), a "
                         "codec name (or name:bits), or hq.torch.Compression.<codec>(...)")
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
    return codec, inherited


class _Checkpoints:
    """A :class:`QuantizationState`'s checkpoints: ``state_dict`` / ``load_state_dict`` and
    pickling, as PyTorch's ``PowerSGDState``, and a resumed state's first step, which exchanges
    the saved step's buckets (:class:`_Replay`); a base class of the state."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed job needs to continue bit for bit: the step (the seeds), the world
        size, the adaptive codecs' states, the fallback's decisions and the last step's
        buckets (each a list of ``[position, numel]`` of its parameters: the resumed state's
        first step exchanges those, :class:`_Replay`), as plain values."""
        return {"step": self.step, "world_size": self._comm.size,
                "codec_states": self.codec_states.state_dict(),
                "fallback": self._hook_fallback.state_dict(), "buckets": self._last_layout}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s state, on every rank, before the first step
        (the first hook's cross-rank check then compares the steps too). Saved at another
        world size, the state is adapted with one warning
        (:func:`~horovod_quant.doors.load_codec_states`).

        Raises:
            ValueError: the state has run a step already, or ``saved`` is not such a state.
        """
        if self.runtime.checking:
            raise ValueError("load_state_dict() on a QuantizationState that has run a step: "
                             "load into a new state, before training")
        if not isinstance(saved, dict) or "step" not in saved or "codec_states" not in saved:
            raise ValueError("not a QuantizationState state: pass what state_dict() returned")
        self.step = int(saved["step"])
        load_codec_states(self.codec_states, saved["codec_states"], saved.get("world_size"),
                          self._comm.size, self.DOOR)
        if "fallback" in saved:  # (a state saved before the hook had a fallback: none)
            self._hook_fallback.load_state_dict(saved["fallback"])
        layout = saved.get("buckets")  # (a state saved before the hook kept them: none)
        if layout is not None:
            try:
                self._replay = _Replay(layout)
            except (TypeError, ValueError):
                raise ValueError("not a QuantizationState state: its 'buckets' are not lists "
                                 "of [position, numel] pairs") from None
            self._last_layout = layout

    def _replayed(self, bucket: dist.GradBucket, grad: torch.Tensor
                  ) -> tuple[torch.futures.Future[torch.Tensor],
                             list[tuple[Callable[[], Finish], list[_Pieces]]]]:
        """DDP's ``bucket`` (buffer ``grad``) in a resumed state's first step: its future,
        and the starts of the saved buckets it completes, each with the DDP buckets it
        completes in turn (:class:`_Replay`)."""
        replay, params = self._replay, bucket.parameters()
        pieces = _Pieces(grad)
        ready = replay.take(self._met.place(params), bucket.gradients(), params, pieces)
        jobs = []
        for j in ready:
            positions = [pos for pos, _ in replay.layout[j]]
            grads = [replay.arrived[pos][0] for pos in positions]
            held = _Held(j, [replay.arrived[pos][1] for pos in positions])
            self._keys[j] = self._met.key(positions)  # (its start reads the key)
            jobs.append((self._held_start(held, grads), replay.waiting.pop(j)))
            self._exchanged.append([list(pair) for pair in replay.layout[j]])
        return pieces.future, jobs

    def _held_start(self, held: _Held, grads: list[torch.Tensor]) -> Callable[[], Finish]:
        """The start of a bucket the hook forms (``held``, bucket ``held.index()``) of
        gradients ``grads`` (views in DDP's buffers): they are gathered into a buffer of its
        own, exchanged as a DDP bucket is, and their means written back."""
        ranges, at = [], 0
        for g in grads:
            ranges.append((at, at + g.numel()))
            at += g.numel()
        flat = torch.empty(at, dtype=grads[0].dtype, device=grads[0].device)
        parts = _parts([self._codec_index(p) for p in held.parameters()], ranges)
        start = (self._hook_fallback.start(held, flat, parts, self._names)
                 or self._start_parts(held.index(), parts, flat, self.step))

        def gathered() -> Finish:
            for g, (begin, end) in zip(grads, ranges):
                flat[begin:end].copy_(g.reshape(-1))
            finish = start()

            def scattered() -> torch.Tensor:
                finish()
                for g, (begin, end) in zip(grads, ranges):
                    g.copy_(flat[begin:end].view(g.shape))
                return flat

            return scattered

        return gathered

    def __getstate__(self) -> dict[str, Any]:
        """As PyTorch's ``PowerSGDState``: everything but the process group and what lives
        only in this process (collectives, buffers, threads)."""
        if self.policy.rules:
            raise ValueError("a QuantizationState whose policy has name rules does not "
                             "pickle (its names point at this process's parameters): save "
                             "state.state_dict() and load it into a state built as this one")
        return {"codec": self.codec, "options": self.options, "parameters": self._parameters,
                "names": self._met.names(), "saved": self.state_dict()}

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        """Unpickle on every rank, after ``init_process_group``: the state runs on the default
        group (set ``process_group`` by building a new state for another group). Pickled at
        another world size, a codec built for the number of workers is built again for this
        one, and its state adapted, with one warning."""
        log.warning("horovod_quant: an unpickled QuantizationState runs on the default "
                    "process group")
        comm = process_group_collectives(own_group(None))
        codec, saved = pickled["codec"], dict(pickled["saved"])
        if codec.needs_world_size and codec.params["world_size"] != comm.size:
            # the codec's group: the pickling job's (one without it in its state predates it)
            saved.setdefault("world_size", codec.params["world_size"])
            params = {k: v for k, v in codec.params.items() if k != "world_size"}
            codec = CodecRequest(codec.name, params).build(lambda: comm.size)
        CompressorSettings.__init__(self, codec, pickled["options"], self.DOOR)
        self._names, self._parameters = None, pickled["parameters"]
        self.codecs = [codec]  # a state that pickles has no rules, so no other codec
        self._codec_indices = {c.config_key(): k for k, c in enumerate(self.codecs)}
        self._connect(None, comm, pickled.get("names"))
        self.step = 0
        self.load_state_dict(saved)


class QuantizationState(_Checkpoints, CompressorSettings, FallbackAttributes):
    """The state of :func:`quantization_hook` for one DDP model.

    Args:
        codec: the codec (:func:`horovod_quant.get_codec`), a codec name, or a door's
            compressor, such as ``horovod_quant.torch.Compression.<name>(...)`` (which needs
            Horovod; its codec, seed, gather schedule and policy come along). A world-sized
            codec asked for by name or through ``Compression`` without ``world_size`` gets the
            process group's size.
        process_group: the DDP model's process group (None: the default group).
        named_parameters: ``(name, parameter)`` pairs of the model (``model.named_parameters()``),
            needed by a policy with name rules (ValueError without them); the names are part
            of the cross-rank check.
        options: the settings as :class:`~horovod_quant.doors.DoorOptions`, or
        settings: seed, gather, pipeline_elems, policy, fallback, baseline as keywords, over
            the compressor's, else DoorOptions' defaults (``LayerPolicy.everything()``
            compresses every parameter; ``fallback="auto"``, ``baseline="auto"``: the faster
            of float32 and DDP's bfloat16 allreduce, :mod:`~horovod_quant.torch.ddp_fallback`).
            The optimizer-only settings raise ValueError here.

    Attributes:
        codecs: the codecs the policy can give a parameter, each with an exchange of its own:
            the state's codec first, then the rules' (each configuration once).
        stats: the :class:`~horovod_quant.stats.StepStats` of the exchanges since the last
            ``stats.reset()`` (the other doors report the same).
        step: steps whose gradients were exchanged so far.
        topology: which ranks share nodes where the exchanges may take hierarchical plans,
            else None.
        fabric: the links' speeds the plan choice weighs (``exchange.cost.Fabric``: the first
            bucket's GPU or CPU ranks' defaults and ``HQ_LINK_GBIT``, ``HQ_INTRA_GBYTE``,
            ``HQ_ROUND_US`` as read when the state was built; then the fallback's measured
            rates; None before the first step): with ``topology``, what ``mean_estimate`` needs.
        fallback_baseline, fallback_decisions, fallback_step_check, fallback_settled: the
            fallback's records (:class:`~horovod_quant.fallback.FallbackAttributes`).
    """

    #: the door's name in messages (the FSDP door's state, a subclass, names its own)
    DOOR = DDP_DOOR

    def __init__(self, codec: Codec | str | CompressorSettings, process_group: Any = None,
                 named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                 options: DoorOptions | None = None, **settings: Any) -> None:
        if not dist.is_initialized():
            raise RuntimeError(f"horovod_quant {self.DOOR}: call torch.distributed."
                               "init_process_group before building its state")
        comm = process_group_collectives(own_group(process_group))
        codec, inherited = group_codec(codec, comm)
        super().__init__(codec, door_options(settings, options, inherited, self.DOOR), self.DOOR)
        self._names = parameter_names(named_parameters)
        if self.policy.rules and self._names is None:
            raise ValueError(
                f"the policy has name rules ({[p for p, _ in self.policy.rules]}) but the "
                "QuantizationState has no parameter names: pass "
                "named_parameters=model.named_parameters()")
        self._parameters = (None if self._names is None else
                            [[name, list(p.shape)] for name, p in self._names.values()])
        self.step = 0
        unique = {self.codec.config_key(): self.codec}
        for _, c in self.policy.rules:
            if c is not None and c.traits.horovod_wire is not HorovodWire.KEEP:  # kept: exact
                unique.setdefault(c.config_key(), c)
        self.codecs: list[Codec] = list(unique.values())
        self._codec_indices = {key: k for k, key in enumerate(unique)}
        self._connect(process_group, comm)

    def _connect(self, process_group: Any, comm: Any, names: list[str] | None = None) -> None:
        """What lives only in this process: the group's collectives (``comm``), the check, the
        exchanges, the parameters' positions (``names``: an unpickled state's names by
        position), the buckets' layouts and buffers, the worker (built again on unpickling)."""
        self.process_group = process_group
        self._comm = comm
        # which ranks share nodes, where the exchanges may take hierarchical plans (several
        # nodes of several ranks, docs/codecs.md), else None: what mean_estimate needs
        self.topology = getattr(comm.hierarchy, "topology", None)
        #: bucket index -> (its parameters' ids, parts, key, [[position, numel], ...])
        self._layouts: dict[int, tuple[tuple[int, ...], list[_Part], str, list[list[int]]]] = {}
        self._keys: dict[int, str] = {}  # bucket index -> its key, this step
        self._means: dict[tuple[int, int], Any] = {}  # (bucket, codec) -> reused output
        self._met = _Positions(self._names, names)
        self._exchanged: list[list[list[int]]] = []  # this step's buckets so far
        self._last_layout: list[list[list[int]]] | None = None  # the last step's
        self._replay: _Replay | None = None  # the loaded step's buckets, until the next step
        self._pipeline = BucketPipeline(f"hq.ddp.{comm.group_id}")
        self._hook_fallback = HookFallback(
            self.options, comm, self.stats, self.codecs,
            lambda index, parts, copy, step: self._start_parts(index, parts, copy, step,
                                                               StepStats()),
            lambda: (self.fabric, self.topology or Topology.grid(comm.size, 1)), self._use_fabric,
            self.environment.fabric_set)
        self._fallback = self._hook_fallback.controller

    @property
    def fallback_settled(self) -> bool:
        """Whether the fallback has decided for good (always with ``fallback="never"``)."""
        return self._fallback.settled(self.step)

    def shared_config(self) -> dict:
        config = {**super().shared_config(), "door": "ddp", "step": self.step,
                  "fabric": None if self.fabric is None else list(self.fabric),
                  "fallback": [self.options.fallback, self.options.baseline,
                               sorted(self._fallback.fallen_back)]}
        if self._parameters is not None:
            config["parameters"] = self._parameters
        return config

    def bucket_key(self, bucket: dist.GradBucket) -> str:
        """What the seeds of ``bucket`` (a DDP bucket the hook has met) derive from: its
        parameters' names, comma-joined in the bucket's order, where the state has them
        (``named_parameters``; an unpickled state: the pickled state's), else their positions
        (``#3``, module doc).

        Raises:
            ValueError: the hook has not met a parameter of ``bucket``.
        """
        positions = self._met.known(bucket.parameters())
        if positions is None:
            raise ValueError("the DDP hook has not met this bucket's parameters: ask for "
                             "its key from the hook, or after the hook ran")
        return self._met.key(positions)

    def seed_of(self, step: int, bucket: dist.GradBucket | str, codec_index: int = 0) -> int:
        """The seed of the exchange of ``codecs[codec_index]`` at ``step`` in ``bucket`` (the
        DDP bucket, or its :meth:`bucket_key`): :func:`~horovod_quant.core.rng.payload_seed`
        of the key at offset 0 (module doc)."""
        if isinstance(bucket, int):
            raise TypeError("seed_of(step, bucket, codec_index) takes the DDP bucket or its "
                            "state.bucket_key(bucket), not its index: the seeds follow the "
                            "bucket's parameters, not DDP's numbering")
        key = bucket if isinstance(bucket, str) else self.bucket_key(bucket)
        return self.runtime.seed_of(step, key, 0, codec_index)

    @property
    def fabric(self) -> Fabric | None:
        return self.runtime.fabric

    def _payload_key(self, index: int) -> tuple[str, int]:
        """The key and offset of this step's bucket ``index`` in the seeds
        (:meth:`~horovod_quant.exchange.runtime.ExchangeRuntime.seed_of`)."""
        return self._keys[index], 0

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

    def _layout(self, bucket: dist.GradBucket) -> tuple[list[_Part], list[list[int]]]:
        """The parts of ``bucket`` and its ``[position, numel]`` pairs (kept per bucket index
        while its parameters stay); sets its key for this step."""
        params = bucket.parameters()
        ids = tuple(id(p) for p in params)
        cached = self._layouts.get(bucket.index())
        if cached is None or cached[0] != ids:
            base = bucket.buffer().storage_offset()
            ranges = [(g.storage_offset() - base, g.storage_offset() - base + g.numel())
                      for g in bucket.gradients()]
            parts = _parts([self._codec_index(p) for p in params], ranges)
            positions = self._met.place(params)
            cached = self._layouts[bucket.index()] = (
                ids, parts, self._met.key(positions),
                [[pos, stop - start] for pos, (start, stop) in zip(positions, ranges)])
        self._keys[bucket.index()] = cached[2]
        return cached[1], cached[3]

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
        """Hand ``bucket`` to the worker and return its future (module doc); the first call
        waits for the cross-rank check. A resumed state's first step exchanges the saved
        step's buckets instead (:class:`_Replay`)."""
        grad = bucket.buffer()
        if not self.runtime.opened:
            self._open_exchanges(grad)
        last = bucket.is_last()
        self._steps.begin()
        self._hook_fallback.bucket_arrived(last)
        future = None  # a replayed DDP bucket's: completed by the buckets holding its parts
        if grad.is_sparse:
            self._met.place(bucket.parameters())
            jobs: list[tuple[Callable[[], Finish], list[_Pieces]]] = [
                (self._average_sparse(grad), [])]
        elif self._replay is not None:
            future, jobs = self._replayed(bucket, grad)
        else:
            parts, layout = self._layout(bucket)
            self._exchanged.append(layout)
            jobs = [(self._hook_fallback.start(bucket, grad, parts, self._names)
                     or self._start_parts(bucket.index(), parts, grad, self.step), [])]
        stream = None
        if on_gpu(grad):
            with stream_of(grad):
                stream = gpu.capture_stream()
        if last:
            if self._replay is not None:
                if self._replay.next < len(self._replay.layout) or not jobs:
                    raise ValueError(
                        "horovod_quant DDP hook: DDP handed over no parameter of the resumed "
                        "state's saved buckets "
                        f"{list(range(self._replay.next, len(self._replay.layout)))}: load the "
                        "checkpoint into the model it was saved from, built as before")
                self._replay = None
            self._last_layout, self._exchanged = self._exchanged, []
            start, pieces = jobs[-1]
            start = self._hook_fallback.then_end_step(start, self.step, self.runtime.prefix)
            self.step += 1
            jobs[-1] = (_counted(start, self._steps, self.step), pieces)
        for n, (start, pieces) in enumerate(jobs):
            done = self._pipeline.submit(start, last and n == len(jobs) - 1, stream)
            for piece in pieces:
                done.add_done_callback(piece.one_done)
            if future is None:
                future = done
        return future

    def _open_exchanges(self, grad: torch.Tensor) -> None:
        """At the first bucket (``grad``, where the codecs run): the fabric, the cross-rank
        check, waited for (nothing is combined before it), and the exchanges."""
        if not self.runtime.checking:
            self.runtime.use_fabric(self._hook_fallback.fabric
                                    or self.environment.fabric(on_gpu(grad)))
            self.runtime.check(self._comm, self.shared_config())
        # a mismatch raises here, at this and every later call
        self.runtime.open(self.codecs, self._comm)
        self._steps = LEDGER.register(self.DOOR, self.step, store_end_of_job(self._comm))

    def _start_parts(self, index: int, parts: list[_Part], grad: torch.Tensor, step: int,
                     stats: StepStats | None = None) -> Callable[[], Finish]:
        """The start of bucket ``index``'s exact allreduce and codec exchanges of ``step``
        (its ``parts`` of buffer ``grad``): it returns the function that finishes them and
        writes the means into ``grad``; they count in ``stats`` (None: :attr:`stats`)."""
        name = f"{self.runtime.prefix}.b{index}"
        key, offset = self._payload_key(index)
        stats = self.stats if stats is None else stats

        def start() -> Finish:
            flat, started = grad.detach().reshape(-1), []
            for part in parts:
                vector = flat_array(part.gather(flat))
                if part.codec_index is None:
                    stats.add_raw(vector.nbytes)
                    started.append((part, self._comm.allreduce_async(vector, f"{name}.exact")))
                    continue
                k = part.codec_index
                label = name if k == 0 else f"{name}.c{k}"
                pending = self.runtime.start(self.codecs[k], vector, step, key, label,
                                             offset=offset, codec_index=k,
                                             out=self._mean_buffer(index, k, vector))
                pending.advance(block=True)  # when a norm arrives differs between ranks
                started.append((part, pending))

            def finish() -> torch.Tensor:
                for part, handle in started:
                    if part.codec_index is None:
                        mean = as_tensor(job_end.wait(handle)).div_(self._comm.size)
                    else:
                        mean = as_tensor(handle.wait())
                        stats.add(handle.stats)
                    part.scatter(flat, mean)
                return grad

            return finish

        return start

    def _average_sparse(self, grad: torch.Tensor) -> Callable[[], Finish]:
        """The start of the exact mean of a sparse gradient (``nn.Embedding(sparse=True)``),
        as DDP's own reducer computes it: an allreduce of the sparse tensor. The codecs
        quantize dense vectors; the rows a sparse gradient sends are already few."""
        def start() -> Finish:
            nbytes = (grad._values().numel() * grad.element_size()
                      + grad._indices().numel() * 8)
            self.stats.add_raw(nbytes)
            # not HANDED's: DDP's reducer holds the bucket and the mean longer than gloo does
            work = dist.all_reduce(grad, group=self.process_group, async_op=True)
            return lambda: work.get_future().wait()[0].div_(self._comm.size)

        return start

    def _use_fabric(self, fabric: Fabric) -> None:
        """Choose the plans again for ``fabric`` (the fallback's measured one)."""
        self.runtime.use_fabric(fabric)


def quantization_hook(state: QuantizationState, bucket: dist.GradBucket
                      ) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the mean of ``bucket`` over the state's process group,
    estimated by the state's codec (register with
    ``model.register_comm_hook(state, quantization_hook)``).

    Args:
        state: the :class:`QuantizationState`.
        bucket: DDP's gradient bucket.

    Returns:
        A future whose value is the bucket's flat tensor holding the mean estimate, completed
        by the state's worker once the bucket's exchanges are done (module doc).
    """
    return state.exchange_bucket(bucket)


# DDP compares the hook's annotations with the objects themselves (not their strings)
quantization_hook.__annotations__.update(
    {"state": QuantizationState, "bucket": dist.GradBucket,
     "return": torch.futures.Future[torch.Tensor]})

