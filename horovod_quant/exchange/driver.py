"""The runner of the exchange plans over asynchronous :class:`Collectives`.

:class:`Exchange` (the torch doors, the DDP door, tests) gives the bits of
:func:`horovod_quant.mean_estimate` with the same ``gather`` and ``pipeline_elems``, on every
rank. Pieces of a pipelined exchange are all started (run to their first collective) before
:meth:`Pending.wait` finishes them in order, so Horovod (or a custom collective's thread) moves
piece k while this thread encodes k + 1 and decodes k - 1. Device (CuPy) vectors are encoded
and decoded on their device; their payloads go to collectives that take device arrays, or
through :class:`~horovod_quant.exchange.staging.HostStaged`.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from ..core.base import Codec, array_module
from . import plans, wire
from .collectives import Collectives, Handle

#: custom collectives by the name codecs declare (``Codec.custom_collective``):
#: ``factory(codec, comm) -> runner`` (or None to fall back to the allgather plan)
#: where ``runner(payload, seed, name) -> Handle`` whose wait() gives the mean estimate.
CUSTOM_COLLECTIVES: dict[str, Callable] = {}


class ExchangeStats:
    """Bytes and seconds of one exchange (filled as it runs): time in a plan's steps before its
    first collective counts as encoding, after it as decoding, waiting for one as exchange."""

    __slots__ = ("bytes_sent", "bytes_raw", "encode_s", "exchange_s", "decode_s")

    def __init__(self, bytes_raw: int) -> None:
        self.bytes_sent = 0
        self.bytes_raw = bytes_raw
        self.encode_s = 0.0
        self.exchange_s = 0.0
        self.decode_s = 0.0


class Pending:
    """An exchange in flight; :meth:`wait` returns the float32 mean estimate."""

    def __init__(self, finish: Callable[[], np.ndarray], stats: ExchangeStats) -> None:
        self._finish = finish
        self.stats = stats
        self._result: np.ndarray | None = None

    def wait(self) -> np.ndarray:
        if self._result is None:
            self._result = self._finish()
        return self._result


class _Running:
    """One plan in flight on one rank: its generator and the handle of its current collective."""

    def __init__(self, plan: plans.Plan, comm: Collectives, name: str, custom: Any,
                 stats: ExchangeStats) -> None:
        self.plan, self.comm, self.name, self.custom, self.stats = plan, comm, name, custom, stats
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
        self.stats.bytes_sent += request.array.nbytes
        self.handle = issue(self.comm, request, self.name + request.suffix, self.custom)

    def finish(self) -> Any:
        """Run the plan to its end; returns its result."""
        while self.handle is not None:
            t = time.perf_counter()
            value = self.handle.wait()
            self.stats.exchange_s += time.perf_counter() - t
            self._step(value)
        return self.result


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
    factory = CUSTOM_COLLECTIVES.get(codec.custom_collective if codec.combine == "custom" else "")
    return factory(codec, comm) if factory is not None else None


def global_norm(codec: Codec, xs_local: list[np.ndarray], comm: Collectives, name: str,
                tag: wire.Tag = wire.NO_TAG) -> float:
    """Global norm over every rank and every given vector (:func:`~.plans.norm_plan`: one
    allgather of the float64 statistic and ``tag``, which every rank checks)."""
    return _Running(plans.norm_plan(codec, xs_local, tag, name), comm, name, None,
                    ExchangeStats(0)).finish()


class Exchange:
    """Exchanges for one codec over one group of ranks.

    Args:
        codec: the codec.
        comm: the collectives of the group.
        gather: schedule for gather codecs ("auto", "allgather", "sra").
        pipeline_elems: piece length of the pipeline in elements (default
            :data:`~horovod_quant.exchange.plans.DEFAULT_PIPELINE_ELEMS`, 8 MiB of float32);
            None exchanges every vector whole. It pays where a transfer progresses while the
            rank encodes (measured: Horovod on gloo, 1.1-1.8x at 256 MB); with Open MPI's
            busy-polling progress on oversubscribed cores it does not (docs/cluster.md).
    """

    def __init__(self, codec: Codec, comm: Collectives, gather: str = "auto",
                 pipeline_elems: int | None = plans.DEFAULT_PIPELINE_ELEMS) -> None:
        self.codec = codec
        self.comm = comm
        self._custom = custom_collective(codec, comm)
        self.kind = plans.plan_kind(codec, comm.size, gather, self._custom is not None)
        self.gather = "sra" if self.kind == "sra" else "allgather"
        self.pipeline_elems = plans.check_pipeline_elems(pipeline_elems)

    @property
    def needs_norm(self) -> bool:
        """Whether the codec encodes with a global norm (:func:`global_norm` first)."""
        return self.codec.needs_norm

    @property
    def blocks_on_peers(self) -> bool:
        """Whether :meth:`start` waits for the other ranks (the global norm) or pairs its data
        with theirs by call order rather than by name (a custom collective): such exchanges
        must be started in the same order on every rank; the others only need the same names."""
        return self.needs_norm or self._custom is not None

    def start(self, x: np.ndarray, seed: int, name: str, norm: float | None = None,
              out: np.ndarray | None = None, tag: wire.Tag | None = None) -> Pending:
        """Encode ``x`` (float32, 1-D) and start its exchange under collective name ``name``
        (pieces add ``.p<k>``). Exchanges that :attr:`blocks_on_peers` must be started in the
        same order on every rank.

        Args:
            x: this rank's vector; read again when the exchange finishes (NDQSG), so it must
                not change before :meth:`Pending.wait` returns.
            seed: the exchange seed (the same on every rank).
            name: collective name (the same on every rank).
            norm: the global norm, for global-norm codecs whose caller computed it.
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
        if self.needs_norm and norm is None:
            norm = _Running(plans.norm_plan(self.codec, [x], tag, name + ".norm"), self.comm,
                            name + ".norm", None, stats).finish()
        bounds = plans.pipeline_bounds(x.size, self.pipeline_elems)
        plan, rank, n = plans.PLANS[self.kind], self.comm.rank, self.comm.size
        running = [_Running(plan(plans.Piece(self.codec, x[lo:hi],
                                             plans.pipeline_seed(seed, k, len(bounds)), rank, n,
                                             norm, tag, out[lo:hi], name)),
                            self.comm, plans.piece_name(name, k, len(bounds)), self._custom,
                            stats)
                   for k, (lo, hi) in enumerate(bounds)]

        def finish() -> np.ndarray:
            for piece in running:
                piece.finish()
            return out

        return Pending(finish, stats)
