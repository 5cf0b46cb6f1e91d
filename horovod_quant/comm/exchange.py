"""Run one codec's exchange for a flat float32 vector over :class:`Collectives`.

The result equals :func:`horovod_quant.mean_estimate` for the same inputs, seed and schedule,
bit for bit, on every rank:

* ``sum`` codecs: the payload array goes through one allreduce(sum) (unsigned integer words are
  reinterpreted as int64, whose wrapping sum is exact modulo 2^64) and ``decode_sum`` turns the
  sum into the mean.
* ``gather`` codecs: ``allgather`` or ``sra`` (see :mod:`horovod_quant.core.schedules`). Every
  gathered payload travels with an 8-byte length, so variable-length payloads (Elias) and
  unequal chunks need no extra round.
* ``custom`` codecs: the codec's own collective when one is registered (the mpi4py exponent
  allreduce of Global-QSGD); otherwise the payloads are allgathered and every rank runs the
  codec's reduction locally (``combine_gathered``), which gives the same bytes everywhere.

Codecs with a global norm (Global-QSGD) get it from one allreduce before encoding unless the
caller passes it (the optimizer groups all buckets of a step into one norm allreduce).
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from ..core.base import Codec, worker_seed
from ..core.payload import Payload
from ..core.schedules import chunk_bounds, chunk_seed, reencode_seed, resolve_gather
from .backend import Collectives, Handle

_LEN = np.dtype("<u8")

#: custom collectives by codec name: ``factory(codec, comm) -> runner`` where
#: ``runner(payload, seed, name) -> Handle`` whose wait() gives the mean estimate.
CUSTOM_COLLECTIVES: dict[str, Callable] = {}


def frame(payload: Payload) -> np.ndarray:
    """``[uint64 little-endian byte length][payload bytes]`` as one uint8 array."""
    body = payload.data.reshape(-1).view(np.uint8)
    out = np.empty(_LEN.itemsize + body.size, np.uint8)
    out[: _LEN.itemsize].view(_LEN)[0] = body.size
    out[_LEN.itemsize :] = body
    return out


def unframe(buf: np.ndarray) -> list[np.ndarray]:
    """Split a concatenation of :func:`frame` outputs back into payload byte arrays."""
    parts, o = [], 0
    while o < buf.size:
        length = int(buf[o : o + _LEN.itemsize].view(_LEN)[0])
        o += _LEN.itemsize
        parts.append(buf[o : o + length])
        o += length
    return parts


def global_norm(codec: Codec, xs_local: list[np.ndarray], comm: Collectives, name: str) -> float:
    """Global norm over every rank and every given vector.

    The per-rank statistics (one float64 each) are allgathered and combined in rank order, as
    the reference does: an allreduce would sum in the backend's order and MPI's max of a NaN
    is implementation-defined, and either would break bit-exactness.
    """
    stats = [codec.norm_statistic(x) for x in xs_local]
    local = max(stats) if codec.norm_op == "max" else sum(stats)
    per_rank = comm.allgather_async(np.array([local], np.float64), name).wait()
    return codec.norm_from_statistics([float(s) for s in per_rank])


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


def _timed_wait(handle: Handle, stats: ExchangeStats):
    t = time.perf_counter()
    out = handle.wait()
    stats.exchange_s += time.perf_counter() - t
    return out


class Exchange:
    """Exchanges for one codec over one group of ranks.

    Args:
        codec: the codec.
        comm: the collectives of the group.
        gather: schedule for gather codecs ("auto", "allgather", "sra").
    """

    def __init__(self, codec: Codec, comm: Collectives, gather: str = "auto") -> None:
        self.codec = codec
        self.comm = comm
        self.gather = resolve_gather(gather, comm.size, codec)
        factory = CUSTOM_COLLECTIVES.get(codec.name) if codec.exchange == "custom" else None
        self._custom = factory(codec, comm) if factory is not None else None

    @property
    def needs_norm(self) -> bool:
        return hasattr(self.codec, "norm_statistic")

    def start(self, x: np.ndarray, seed: int, name: str, norm: float | None = None) -> Pending:
        """Encode ``x`` (float32, 1-D) and start its exchange under collective name ``name``."""
        stats = ExchangeStats(x.size * 4)
        if self.needs_norm and norm is None:
            norm = global_norm(self.codec, [x], self.comm, name + ".norm")
        if self.codec.exchange == "gather" and self.gather == "sra":
            return self._start_sra(x, seed, name, stats)
        t = time.perf_counter()
        payload = self.codec.encode_worker(x, seed, self.comm.rank, norm)
        stats.encode_s += time.perf_counter() - t
        if self.codec.exchange == "sum":
            return self._start_sum(payload, name, stats)
        if self._custom is not None:
            handle = self._custom(payload, seed, name)
            stats.bytes_sent += payload.nbytes
            return Pending(lambda: _timed_wait(handle, stats), stats)
        return self._start_allgather(payload, seed, name, stats)

    def _start_sum(self, payload: Payload, name: str, stats: ExchangeStats) -> Pending:
        data = payload.data
        wire = data.view(np.int64) if data.dtype == np.uint64 else data
        handle = self.comm.allreduce_async(wire, name, "sum")
        stats.bytes_sent += data.nbytes

        def finish() -> np.ndarray:
            total = np.asarray(_timed_wait(handle, stats)).view(data.dtype)
            t = time.perf_counter()
            est = self.codec.decode_sum(Payload(total, payload.size, payload.meta), self.comm.size)
            stats.decode_s += time.perf_counter() - t
            return est

        return Pending(finish, stats)

    def _gathered_payloads(self, parts: list[np.ndarray], size: int, seeds: list[int],
                           meta: dict) -> list[Payload]:
        return [self.codec.payload_from_wire(b, size, **{**meta, "seed": s})
                for b, s in zip(parts, seeds)]

    def _start_allgather(self, payload: Payload, seed: int, name: str,
                         stats: ExchangeStats) -> Pending:
        buf = frame(payload)
        handle = self.comm.allgather_async(buf, name)
        stats.bytes_sent += buf.nbytes
        shared_meta = {k: v for k, v in payload.meta.items() if k != "seed"}

        def finish() -> np.ndarray:
            parts = unframe(np.asarray(_timed_wait(handle, stats)))
            t = time.perf_counter()
            seeds = [worker_seed(seed, r) for r in range(self.comm.size)]
            payloads = self._gathered_payloads(parts, payload.size, seeds, shared_meta)
            est = self.codec.combine_gathered(payloads, seed)
            stats.decode_s += time.perf_counter() - t
            return est

        return Pending(finish, stats)

    def _start_sra(self, x: np.ndarray, seed: int, name: str, stats: ExchangeStats) -> Pending:
        comm, codec = self.comm, self.codec
        bounds = chunk_bounds(x.size, comm.size)
        t = time.perf_counter()
        frames = [frame(codec.encode(x[lo:hi], seed=chunk_seed(seed, comm.rank, c)))
                  for c, (lo, hi) in enumerate(bounds)]
        stats.encode_s += time.perf_counter() - t
        send = np.concatenate(frames)
        handle = comm.alltoall_async(send, [f.size for f in frames], name + ".scatter")
        stats.bytes_sent += send.nbytes

        def finish() -> np.ndarray:
            received, _ = _timed_wait(handle, stats)
            lo, hi = bounds[comm.rank]
            t0 = time.perf_counter()
            seeds = [chunk_seed(seed, r, comm.rank) for r in range(comm.size)]
            mine = self._gathered_payloads(unframe(np.asarray(received)), hi - lo, seeds, {})
            mean = Codec.combine_gathered(codec, mine, seed)
            again = frame(codec.encode(mean, seed=reencode_seed(seed, comm.rank)))
            stats.decode_s += time.perf_counter() - t0
            stats.bytes_sent += again.nbytes
            gathered = unframe(np.asarray(_timed_wait(comm.allgather_async(again, name + ".gather"), stats)))
            t1 = time.perf_counter()
            out = np.empty(x.size, np.float32)
            for c, ((clo, chi), part) in enumerate(zip(bounds, gathered)):
                p = codec.payload_from_wire(part, chi - clo, seed=reencode_seed(seed, c))
                codec.decode(p, out[clo:chi])
            stats.decode_s += time.perf_counter() - t1
            return out

        return Pending(finish, stats)
