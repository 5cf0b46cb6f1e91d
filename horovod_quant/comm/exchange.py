"""Run one codec's exchange for a flat float32 vector over :class:`Collectives`, pipelined.

:class:`Exchange` drives the steps of :mod:`horovod_quant.comm.steps` (the one implementation
of every exchange, which the TensorFlow adapter runs as graph ops) through asynchronous
collectives, and returns :class:`Pending` handles. The result equals
:func:`horovod_quant.mean_estimate` (with the same ``gather`` and ``pipeline_elems``) bit for
bit, on every rank:

* ``sum`` codecs: the payload words go through one allreduce(sum) (uint64 words as int64,
  whose wrapping sum is exact modulo 2^64) and ``decode_sum`` turns the sum into the mean;
* ``gather`` codecs: ``allgather`` or ``sra`` (:mod:`horovod_quant.core.schedules`), payloads
  framed with their length and tag (:func:`~.steps.frame`);
* ``custom`` codecs: the codec's own collective when one is registered (the mpi4py exponent
  allreduce of Global-QSGD), else allgather and the codec's reduction on every rank.

Pipelining: a vector longer than ``pipeline_elems`` is exchanged as pieces
(:func:`~horovod_quant.core.schedules.pipeline_bounds`), each started as soon as it is
encoded. Horovod (or the custom collective's thread) moves piece k while this thread encodes
piece k + 1, and :meth:`Pending.wait` decodes piece k while later pieces are still on the wire,
so encode and decode hide behind the transfer instead of adding to it.

Codecs with a global norm (Global-QSGD) get it from one allgather of per-rank statistics
before encoding unless the caller passes it (the optimizer groups all buckets of a step).

Device vectors (CuPy) are encoded and decoded on their device; their payloads go to
collectives that take device arrays, or through
:class:`~horovod_quant.comm.staging.HostStaged` to ones that do not.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from ..core.base import Codec, array_module
from ..core.schedules import (DEFAULT_PIPELINE_ELEMS, check_pipeline_elems, pipeline_bounds,
                              pipeline_seed)
from . import steps
from .backend import Collectives, Handle

#: custom collectives by the name codecs declare (``Codec.custom_collective``):
#: ``factory(codec, comm) -> runner`` (or None to fall back)
#: where ``runner(payload, seed, name) -> Handle`` whose wait() gives the mean estimate.
CUSTOM_COLLECTIVES: dict[str, Callable] = {}


def global_norm(codec: Codec, xs_local: list[np.ndarray], comm: Collectives, name: str,
                tag: steps.Tag = steps.NO_TAG) -> float:
    """Global norm over every rank and every given vector (one allgather of the float64
    statistic and ``tag``, which every rank checks: :func:`~.steps.check_tags`)."""
    wire = steps.norm_wire(codec, xs_local, tag)
    return steps.norm_from_gathered(codec, comm.allgather_async(wire, name).wait(), name)


class ExchangeStats:
    """Bytes and seconds of one exchange (filled as it runs)."""

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


class _Timer:
    """Adds the seconds of a ``with`` block to one field of an :class:`ExchangeStats`."""

    __slots__ = ("stats", "field", "t")

    def __init__(self, stats: ExchangeStats, field: str) -> None:
        self.stats, self.field = stats, field

    def __enter__(self) -> None:
        self.t = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        setattr(self.stats, self.field,
                getattr(self.stats, self.field) + time.perf_counter() - self.t)


class Exchange:
    """Exchanges for one codec over one group of ranks.

    Args:
        codec: the codec.
        comm: the collectives of the group.
        gather: schedule for gather codecs ("auto", "allgather", "sra").
        pipeline_elems: piece length of the pipeline in elements (default
            :data:`~horovod_quant.core.schedules.DEFAULT_PIPELINE_ELEMS`, 8 MiB of float32);
            None exchanges every vector whole. It pays where a transfer progresses while the
            rank encodes (measured: Horovod on gloo, 1.1-1.8x at 256 MB); with Open MPI's
            busy-polling progress on oversubscribed cores it does not (docs/cluster.md).
    """

    def __init__(self, codec: Codec, comm: Collectives, gather: str = "auto",
                 pipeline_elems: int | None = DEFAULT_PIPELINE_ELEMS) -> None:
        self.codec = codec
        self.comm = comm
        self.kind = steps.plan(codec, comm.size, gather)
        self.gather = "sra" if self.kind == "sra" else "allgather"
        self.pipeline_elems = check_pipeline_elems(pipeline_elems)
        factory = (CUSTOM_COLLECTIVES.get(codec.custom_collective)
                   if codec.exchange == "custom" else None)
        self._custom = factory(codec, comm) if factory is not None else None

    @property
    def needs_norm(self) -> bool:
        return steps.needs_norm(self.codec)

    @property
    def blocks_on_peers(self) -> bool:
        """Whether :meth:`start` waits for the other ranks (the global norm) or pairs its data
        with theirs by call order rather than by name (a custom collective): such exchanges
        must be started in the same order on every rank; the others only need the same names."""
        return self.needs_norm or self._custom is not None

    def start(self, x: np.ndarray, seed: int, name: str, norm: float | None = None,
              out: np.ndarray | None = None, tag: steps.Tag | None = None) -> Pending:
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
            tag: what the ranks must agree this exchange carries (:func:`~.steps.exchange_tag`;
                default: ``name`` and ``x.size``), checked at its first collective on every
                rank, which raises ValueError if any rank's differs.

        Returns:
            The exchange in flight.
        """
        stats = ExchangeStats(x.size * 4)
        if tag is None:
            tag = steps.exchange_tag(name, (x.size,))
        if out is None:
            out = array_module(x).empty(x.size, np.float32)
        if self.needs_norm and norm is None:
            with _Timer(stats, "exchange_s"):
                norm = global_norm(self.codec, [x], self.comm, name + ".norm", tag)
            stats.bytes_sent += steps.NORM_WIRE_WORDS * 8
        bounds = pipeline_bounds(x.size, self.pipeline_elems)
        finishes = [self._start_piece(x[lo:hi], pipeline_seed(seed, k, len(bounds)),
                                      name if len(bounds) == 1 else f"{name}.p{k}", norm, stats,
                                      out[lo:hi], tag)
                    for k, (lo, hi) in enumerate(bounds)]

        def finish() -> np.ndarray:
            for piece in finishes:
                piece()
            return out

        return Pending(finish, stats)

    def _wait(self, handle: Handle, stats: ExchangeStats) -> Any:
        with _Timer(stats, "exchange_s"):
            return handle.wait()

    def _start_piece(self, x: np.ndarray, seed: int, name: str, norm: float | None,
                     stats: ExchangeStats, out: np.ndarray, tag: steps.Tag
                     ) -> Callable[[], None]:
        """Encode one piece and start its collectives; returns the function that finishes it
        (writing the piece's mean into ``out``)."""
        codec, comm, n = self.codec, self.comm, self.comm.size
        if self.kind == "sra":
            return self._start_sra(x, seed, name, stats, out, tag)
        if self._custom is not None:
            with _Timer(stats, "encode_s"):
                payload = steps.encode_payload(codec, x, seed, comm.rank, norm)
            stats.bytes_sent += payload.nbytes
            handle = self._custom(payload, seed, name)

            def finish_custom() -> None:
                out[:] = self._wait(handle, stats)

            return finish_custom
        with _Timer(stats, "encode_s"):
            wire, meta = steps.encode_wire(codec, x, seed, comm.rank, self.kind, norm, tag)
        stats.bytes_sent += wire.nbytes
        if self.kind == "sum":
            handle = comm.allreduce_async(wire, name, "sum")

            def finish_sum() -> None:
                total = self._wait(handle, stats)
                with _Timer(stats, "decode_s"):
                    steps.decode_sum_wire(codec, total, x.size, n, meta, out)

            return finish_sum
        handle = comm.allgather_async(wire, name)

        def finish_gather() -> None:
            gathered = self._wait(handle, stats)
            with _Timer(stats, "decode_s"):
                own = (comm.rank, x) if steps.counts_outage(codec) else None
                steps.combine_wire(codec, gathered, x.size, seed, n, meta, own, out, name)
            if own is not None:
                total = self._wait(comm.allreduce_async(steps.outage_wire(codec),
                                                        name + ".outage", "sum"), stats)
                steps.outage_from_wire(codec, total)
                stats.bytes_sent += 8

        return finish_gather

    def _start_sra(self, x: np.ndarray, seed: int, name: str, stats: ExchangeStats,
                   out: np.ndarray, tag: steps.Tag) -> Callable[[], None]:
        codec, comm, n = self.codec, self.comm, self.comm.size
        with _Timer(stats, "encode_s"):
            send, splits = steps.sra_encode_wire(codec, x, seed, comm.rank, n, tag)
        stats.bytes_sent += send.nbytes
        handle = comm.alltoall_async(send, splits.tolist(), name + ".scatter")

        def finish() -> None:
            received, _ = self._wait(handle, stats)
            with _Timer(stats, "decode_s"):
                again = steps.sra_reduce_wire(codec, received, x.size, seed, comm.rank, n, name)
            stats.bytes_sent += again.nbytes
            gathered = self._wait(comm.allgather_async(again, name + ".gather"), stats)
            with _Timer(stats, "decode_s"):
                steps.sra_decode_wire(codec, gathered, x.size, seed, n, out)

        return finish
