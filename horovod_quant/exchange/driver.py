"""The runner of the exchange plans over asynchronous :class:`Collectives`.

:class:`Exchange` (the torch doors, the DDP door, tests) gives the bits of
:func:`horovod_quant.mean_estimate` with the same ``gather`` and ``pipeline_elems``, on every
rank. Pieces of a pipelined exchange are all started (run to their first collective) before
:meth:`Pending.wait` finishes them in order, so Horovod (or a custom collective's thread) moves
piece k while this thread encodes k + 1 and decodes k - 1. A global-norm codec's exchange
starts with the norm's small allgather alone and returns at once; its pieces start when
:meth:`Pending.advance` finds the norm arrived (the torch optimizer calls it from its backward
hooks), so the norm never holds the caller up while its peers catch up. Device (CuPy) vectors
are encoded and decoded on their device; their payloads go to collectives that take device
arrays, or through :class:`~horovod_quant.exchange.staging.HostStaged`. Hierarchical exchanges
run on the hierarchy's worker thread, on the caller's CUDA stream (:class:`_OnWorker`).
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable

import numpy as np

from .. import gpu
from ..core.base import Codec, array_module
from . import job_end, plans, wire
from .codec_states import CodecStates
from .collectives import Collectives, Handle
from .cost import CPU_RANKS, Fabric
from .mpi_exponent_allreduce import mpi_exponent_factory

log = logging.getLogger("horovod_quant")

#: custom collectives by the name reduced codecs declare (``codec.traits.collective``):
#: ``factory(codec, comm) -> runner`` (or None to fall back to the allgather plan)
#: where ``runner(payload, seed, name) -> Handle`` whose wait() gives the mean estimate.
CUSTOM_COLLECTIVES: dict[str, Callable] = {"exponent_allreduce": mpi_exponent_factory}


class ExchangeStats:
    """Bytes and seconds of one exchange (filled as it runs): time in a plan's steps before its
    first collective counts as encoding, after it as decoding, waiting for one as exchange.
    ``bytes_local`` counts what went to the ranks of this rank's host (a hierarchical plan's
    float32 shards), ``bytes_sent`` the rest; ``plans`` how many pieces took each plan."""

    __slots__ = ("bytes_sent", "bytes_local", "bytes_raw", "encode_s", "exchange_s",
                 "decode_s", "plans")

    def __init__(self, bytes_raw: int) -> None:
        self.bytes_sent = 0
        self.bytes_local = 0
        self.bytes_raw = bytes_raw
        self.encode_s = 0.0
        self.exchange_s = 0.0
        self.decode_s = 0.0
        self.plans: dict[str, int] = {}


class Pending:
    """An exchange in flight; :meth:`wait` returns the float32 mean estimate.

    Args:
        finish: runs the exchange to its end (blocking) and returns the mean estimate.
        stats: the exchange's bytes and seconds, filled as it runs.
        advance: ``advance(block)`` issues what the exchange has not issued yet (see
            :meth:`advance`) and returns whether everything is issued; None: everything was
            issued at the start.
    """

    def __init__(self, finish: Callable[[], np.ndarray], stats: ExchangeStats,
                 advance: Callable[[bool], bool] | None = None) -> None:
        self._finish = finish
        self._advance = advance
        self.stats = stats
        self._result: np.ndarray | None = None
        self._issued = advance is None

    @property
    def issued(self) -> bool:
        """Whether every collective the exchange can start before :meth:`wait` has started
        (for a global-norm codec: the norm has arrived and the pieces are on their way)."""
        return self._issued

    def advance(self, block: bool = False) -> None:
        """Move the exchange forward: once the global norm has arrived, encode the pieces and
        start their collectives. ``block=False`` never waits for a peer (it checks whether
        the norm's collective is done); ``block=True`` waits for the norm.

        It may issue collectives: over a transport that pairs collectives by call order
        rather than by name, call it at the same points on every rank.
        """
        if not self._issued and self._result is None:
            self._issued = self._advance(block)

    def wait(self) -> np.ndarray:
        if self._result is None:
            self._result = self._finish()
            self._issued = True
        return self._result


class _Running:
    """One plan in flight on one rank: its generator and the handle of its current collective.

    Args:
        routes: for each group a request may name (:data:`~.plans.WORLD`, ``LOCAL``,
            ``CROSS``), its collectives and the codec's custom collective there (or None).
    """

    def __init__(self, plan: plans.Plan, routes: dict[str, tuple[Collectives, Any]], name: str,
                 stats: ExchangeStats) -> None:
        self.plan, self.routes, self.name, self.stats = plan, routes, name, stats
        self.encoding = True
        self.handle: Handle | None = None
        self.result: Any = None
        self._step(None)

    def _step(self, value: Any) -> None:
        """Resume the plan with ``value`` (the last collective's result) and issue its next
        request, or keep its result when it returns."""
        t = time.perf_counter()
        try:
            request = self.plan.send(value)  # None starts a fresh plan
        except StopIteration as stop:
            self.handle, self.result = None, stop.value
            return
        finally:
            field = "encode_s" if self.encoding else "decode_s"
            setattr(self.stats, field, getattr(self.stats, field) + time.perf_counter() - t)
            self.encoding = False
        if request.group == plans.LOCAL:
            self.stats.bytes_local += request.array.nbytes
        else:
            self.stats.bytes_sent += request.array.nbytes
        comm, custom = self.routes[request.group]
        self.handle = issue(comm, request, self.name + request.suffix, custom)

    def _resume(self) -> None:
        """Wait for the current collective and resume the plan with its result."""
        t = time.perf_counter()
        value = job_end.wait(self.handle)  # polls where a peer's end of job can ring
        self.stats.exchange_s += time.perf_counter() - t
        self._step(value)

    def advance(self) -> bool:
        """Resume the plan past the collectives that are done, without waiting for one;
        returns whether the plan has finished."""
        while self.handle is not None and self.handle.done():
            self._resume()
        return self.handle is None

    def finish(self) -> Any:
        """Run the plan to its end; returns its result."""
        while self.handle is not None:
            self._resume()
        return self.result


class _NormThenPieces:
    """One exchange on one rank whose pieces wait for its global norm: until the norm's
    allgather has arrived only that is in flight, so starting it never waits for a peer.

    Args:
        norm: the running norm plan.
        start_pieces: ``start_pieces(norm)`` starts the pieces' plans.
        out: the buffer the pieces write the mean estimate to.
    """

    def __init__(self, norm: _Running, start_pieces: Callable[[float], list[_Running]],
                 out: Any) -> None:
        self._norm = norm
        self._start_pieces = start_pieces
        self._out = out
        self._pieces: list[_Running] | None = None

    def advance(self, block: bool) -> bool:
        """Start the pieces once the norm has arrived (``block``: wait for it); returns
        whether they have started."""
        if self._pieces is None and (block or self._norm.advance()):
            self._pieces = self._start_pieces(self._norm.finish())
        return self._pieces is not None

    def finish(self) -> Any:
        self.advance(block=True)
        return _finish_pieces(self._pieces, self._out)


def _finish_pieces(pieces: list[_Running], out: Any) -> Any:
    """Run the pieces to their ends in order; returns ``out``, which they filled."""
    for piece in pieces:
        piece.finish()
    return out


def _interleave(pieces: list[_Running]) -> None:
    """Run started pieces to their ends, resuming each in turn once its collective has
    returned (piece k + 1 encodes while piece k is on the wire): a blocking round robin in a
    fixed order, so the collectives are issued in the same order on every rank."""
    while pieces:
        for piece in pieces:
            piece._resume()
        pieces = [p for p in pieces if p.handle is not None]


def issue(comm: Collectives, request: plans.Request, name: str, custom: Any = None) -> Handle:
    """Start ``request`` over ``comm`` under the collective name ``name`` (``custom``: the
    codec's custom collective, for :class:`~.plans.Custom` requests)."""
    if isinstance(request, plans.Allreduce):
        return comm.allreduce_async(request.array, name, "sum")
    if isinstance(request, plans.Allgather):
        return comm.allgather_async(request.array, name)
    if isinstance(request, plans.Alltoall):
        return comm.alltoall_async(request.array, request.splits, name)
    return custom(request.payload, request.seed, name)


def custom_collective(codec: Codec, comm: Collectives) -> Any:
    """The runner of the codec's custom collective over ``comm`` (:data:`CUSTOM_COLLECTIVES`),
    or None: the allgather plan then reduces on every rank. Collective: call it at the same
    point on every rank (it may set up a communicator)."""
    factory = CUSTOM_COLLECTIVES.get(codec.traits.collective or "")
    return factory(codec, comm) if factory is not None else None


class _OnWorker:
    """An exchange's pieces run on the hierarchy's worker thread, from their start to their
    ends (:func:`_interleave`); :meth:`finish` waits for them and adds their bytes and seconds
    to the exchange's.

    Device vectors: ``stream`` is the CUDA stream current where the exchange started (the
    stream that produced the vector, :func:`horovod_quant.gpu.capture_stream`). The worker
    queues every kernel and copy of the pieces on it, and issues their collectives with it
    current, so they run after the vector's producer (one stream, in order) and NCCL orders
    with it; :meth:`finish` makes the waiting thread's current stream wait for the pieces'
    last work (an event), so the consumer of the mean reads it after it is written.
    """

    def __init__(self, worker: Any, pieces: list[tuple[plans.Plan, str]],
                 routes: dict[str, tuple[Collectives, Any]], into: ExchangeStats,
                 stream: Any = None) -> None:
        self._stats, self._into = ExchangeStats(0), into

        def run() -> Any:
            with stream.entered() if stream is not None else contextlib.nullcontext():
                _interleave([_Running(plan, routes, name, self._stats) for plan, name in pieces])
                return None if stream is None else stream.fence()

        self._future = worker.submit(run)

    def finish(self) -> Any:
        fence = self._future.result()
        if fence is not None:
            fence.wait()
        for field in ("bytes_sent", "bytes_local", "encode_s", "exchange_s", "decode_s"):
            setattr(self._into, field, getattr(self._into, field) + getattr(self._stats, field))
        return None


class Exchange:
    """Exchanges for one codec over one group of ranks.

    A vector takes the plan :func:`~.plans.plan_kind` picks for its length: the one that
    sends the fewest bytes over the slowest link, hierarchical plans included where ``comm``
    has a :attr:`~.collectives.Collectives.hierarchy` (ranks sharing hosts). Hierarchical
    exchanges run on the hierarchy's worker thread, in the order they were started, since the
    sub-groups' collectives pair by call order.

    Args:
        codec: the codec.
        comm: the collectives of the group.
        gather: "auto", "allgather", "sra" or "hierarchical" (:data:`~.plans.GATHER_SCHEDULES`).
        pipeline_elems: piece length of the pipeline in elements (default
            :data:`~horovod_quant.exchange.plans.DEFAULT_PIPELINE_ELEMS`, 8 MiB of float32);
            None exchanges every vector whole. It pays where a transfer progresses while the
            rank encodes (measured: Horovod on gloo, 1.1-1.8x at 256 MB); with Open MPI's
            busy-polling progress on oversubscribed cores it does not (docs/performance.md).
        fabric: the links' speeds the plan choice weighs (:class:`~.cost.Fabric`; None: CPU
            ranks' defaults; the optimizer and the DDP hook pass their gradients'
            :meth:`~.cost.Fabric.for_ranks`).
        states: the codec states its exchanges read and advance (an adaptive codec's, NDQSG:
            :class:`~.codec_states.CodecStates`); a door passes one object to all its
            exchanges, so that its checkpoint holds them. None: its own.
    """

    def __init__(self, codec: Codec, comm: Collectives, gather: str = "auto",
                 pipeline_elems: int | None = plans.DEFAULT_PIPELINE_ELEMS,
                 fabric: Fabric | None = None, states: CodecStates | None = None) -> None:
        self.codec = codec
        self.comm = comm
        self.gather = plans.check_gather(gather)
        self.fabric = fabric or CPU_RANKS
        self.pipeline_elems = plans.check_pipeline_elems(pipeline_elems)
        self._custom = custom_collective(codec, comm)
        self._routes: dict[str, tuple[Collectives, Any]] = {plans.WORLD: (comm, self._custom)}
        self.hierarchy = comm.hierarchy
        self._place = None
        if self.hierarchy is not None:
            topology, rank = self.hierarchy.topology, comm.rank
            self._place = plans.Place(topology.host_of(rank), topology.host_count,
                                      topology.local_rank(rank), topology.local_size)
            cross = codec.for_world_size(topology.host_count)
            self._routes[plans.LOCAL] = (self.hierarchy.local, None)
            self._routes[plans.CROSS] = (self.hierarchy.cross,
                                         custom_collective(cross, self.hierarchy.cross))
        self._kinds: dict[int, str] = {}
        self.states = states if states is not None else CodecStates()

    def use_fabric(self, fabric: Fabric) -> None:
        """Choose the plans again for ``fabric`` (a measured one)."""
        self.fabric = fabric
        self._kinds.clear()

    def kind_for(self, numel: int) -> str:
        """The plan every piece of a vector of ``numel`` elements takes (the same on every
        rank); the first time a kind is chosen it is logged (rank 0)."""
        kind = self._kinds.get(numel)
        if kind is None:
            topology = (self.hierarchy.topology if self.hierarchy is not None
                        else self.comm.size)
            kind = self._kinds[numel] = plans.runnable(
                plans.plan_kind(self.codec, topology, numel, self.gather,
                                self.hierarchy is not None, self.fabric),
                self._custom is not None, self._routes.get(plans.CROSS, (0, None))[1]
                is not None)
            _log_choice(self.codec, kind, numel, topology, self.fabric, self.comm.rank)
        return kind

    @property
    def needs_norm(self) -> bool:
        """Whether the codec encodes with a global norm (the norm plan's allgather first,
        unless the caller gives the norm)."""
        return self.codec.traits.needs_norm

    @property
    def blocks_on_peers(self) -> bool:
        """Whether the exchanges pair their data with the other ranks' by call order rather
        than by name (a custom collective): they must be started, advanced
        (:meth:`Pending.advance` with ``block=True`` only: when a norm arrives depends on the
        peers) and waited for in the same order on every rank. The others only need the same
        names: nothing in :meth:`start` waits for a peer (a global norm is waited for later,
        see :meth:`start`)."""
        return self._custom is not None

    def start(self, x: np.ndarray, seed: int, name: str, norm: float | None = None,
              out: np.ndarray | None = None, tag: wire.Tag | None = None) -> Pending:
        """Encode ``x`` (float32, 1-D) and start its exchange under collective name ``name``
        (pieces add ``.p<k>``). Exchanges that :attr:`blocks_on_peers`, and every exchange
        over collectives that pair by call order, must be started in the same order on every
        rank.

        A global-norm codec given no ``norm`` starts only the norm's allgather (under
        ``name + ".norm"``, with ``tag``) and returns without waiting for a peer: its pieces
        are encoded and started by the :meth:`Pending.advance` that finds the norm arrived,
        or by :meth:`Pending.wait`. The norm is that of all of ``x`` over every rank, as in
        :func:`~horovod_quant.exchange.reference.mean_estimate`; hierarchical pieces take
        their shard's norm between the hosts instead.

        Args:
            x: this rank's vector; read again when the exchange finishes (NDQSG), so it must
                not change before :meth:`Pending.wait` returns.
            seed: the exchange seed (the same on every rank).
            name: collective name (the same on every rank).
            norm: the global norm, for global-norm codecs whose caller computed it (the
                pieces then start at once).
            out: float32 buffer of ``x.size`` the mean is written to (reusing one buffer
                across steps avoids the page faults of a fresh allocation); None: a new array.
            tag: what the ranks must agree this exchange carries (:func:`~.wire.exchange_tag`;
                default: ``name`` and ``x.size``), checked at its first collective on every
                rank, which raises ValueError if any rank's differs.

        Returns:
            The exchange in flight.
        """
        stats = ExchangeStats(x.size * 4)
        if tag is None:
            tag = wire.exchange_tag(name, (x.size,))
        if out is None:
            out = array_module(x).empty(x.size, np.float32)
        bounds = plans.pipeline_bounds(x.size, self.pipeline_elems)
        kind = self.kind_for(x.size)
        stats.plans[kind] = len(bounds)
        on_worker = kind.startswith(plans.HIERARCHICAL)
        rank, n = self.comm.rank, self.comm.size

        def start_pieces(norm: float | None) -> list[Any]:
            pieces = [(plans.plan_of(kind)(plans.Piece(
                self.codec, x[lo:hi], plans.pipeline_seed(seed, k, len(bounds)), rank, n, norm,
                tag, out[lo:hi], name, self._place, self.states)),
                plans.piece_name(name, k, len(bounds)))
                for k, (lo, hi) in enumerate(bounds)]
            if on_worker:
                stream = gpu.capture_stream() if gpu.is_device_array(x) else None
                return [_OnWorker(self.hierarchy.worker, pieces, self._routes, stats, stream)]
            return [_Running(plan, self._routes, piece_name, stats) for plan, piece_name in pieces]

        if self.needs_norm and norm is None and not on_worker:
            exchange = _NormThenPieces(
                _Running(plans.norm_plan(self.codec, [x], tag, name + ".norm"),
                         {plans.WORLD: (self.comm, None)}, name + ".norm", stats),
                start_pieces, out)
            return Pending(exchange.finish, stats, exchange.advance)
        pieces = start_pieces(norm)
        return Pending(lambda: _finish_pieces(pieces, out), stats)


_logged: set[tuple[str, str]] = set()


def _log_choice(codec: Codec, kind: str, numel: int, topology: Any, fabric: Fabric,
                rank: int) -> None:
    """Log (once per codec and plan, on rank 0) which plan exchanges take."""
    if rank != 0 or (codec.config_key(), kind) in _logged:
        return
    _logged.add((codec.config_key(), kind))
    shape = (f"{topology.host_count} hosts x {topology.local_size} ranks"
             if hasattr(topology, "hosts") else f"{topology} ranks")
    log.info("horovod_quant: %r exchanges of %d elements take the %s plan (%s, %s; the least "
             "cost over the slowest link)", codec, numel, kind, shape, fabric.describe())
