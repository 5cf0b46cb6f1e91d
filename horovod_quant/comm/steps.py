"""One exchange cut into pure steps: the single implementation every adapter runs.

Each step takes what a collective delivered (NumPy arrays) and returns what the next collective
sends, with the framing, seeds and order of operations that make the result equal
:func:`horovod_quant.mean_estimate` bit for bit. Two drivers run them:
:class:`~horovod_quant.comm.exchange.Exchange` calls the collectives itself (torch, tests), and
the TensorFlow adapter runs them as Horovod TF ops between ``tf.numpy_function`` callbacks.

An exchange of a flat float32 vector ``x`` with exchange seed ``seed`` between ``n`` ranks:

* global-norm codecs (``needs_norm``) first: ``norm_wire(codec, [x, ...])`` -> allgather ->
  ``norm_from_gathered(codec, gathered)``. The per-rank statistics are gathered and combined in
  rank order, as the reference does: an allreduce would add in the backend's order (not
  bit-exact for n >= 3) and MPI's max of a NaN is implementation-defined;
* ``plan(codec, n, gather)`` says which collectives follow:

  - ``"sum"``: ``encode_wire`` -> allreduce(sum) of the int64/float words -> ``decode_sum_wire``;
  - ``"allgather"`` (gather codecs with the allgather schedule, and custom codecs, whose
    reduction then runs locally on every rank): ``encode_wire`` (a framed uint8 array) ->
    allgather -> ``combine_wire``;
  - ``"sra"``: ``sra_encode_wire`` -> alltoall with the returned splits -> ``sra_reduce_wire``
    -> allgather -> ``sra_decode_wire``.

* NDQSG (``counts_outage``): ``combine_wire(..., own=(rank, x))`` counts this rank's wrong
  coarse bins; allreduce(sum) of ``outage_wire(codec)`` -> ``outage_from_wire`` makes the
  codec's ``last_stats["outside_share"]`` exact.

``encode_wire`` also returns the payload's ``meta`` (values every rank knows without sending
them, such as the global norm); pass it back to the decoding step of the same exchange.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import gpu
from ..core.base import Codec, array_module, as_vector, worker_seed
from ..core.dithered import NestedDitheredQuantizer
from ..core.payload import Payload
from ..core.schedules import chunk_bounds, chunk_seed, reencode_seed, resolve_gather

_LEN = np.dtype("<u8")


def frame(payload: Payload) -> np.ndarray:
    """``[uint64 little-endian byte length][payload bytes]`` as one uint8 array: gathered
    payloads of any length (Elias, unequal chunks) split again without an extra round.
    The frame lives where the payload does (host or device)."""
    xp = array_module(payload.data)
    body = payload.data.reshape(-1).view(np.uint8)
    out = xp.empty(_LEN.itemsize + body.size, np.uint8)
    out[: _LEN.itemsize] = xp.asarray(np.array([body.size], _LEN).view(np.uint8))
    out[_LEN.itemsize :] = body
    return out


def unframe(buf: np.ndarray) -> list[np.ndarray]:
    """Split a concatenation of :func:`frame` outputs back into payload byte arrays (views,
    on the device of ``buf``; only the 8-byte lengths are read on the host)."""
    xp = array_module(buf)
    buf = xp.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    parts, o = [], 0
    while o < buf.size:
        length = int(gpu.to_host(buf[o : o + _LEN.itemsize]).view(_LEN)[0])
        o += _LEN.itemsize
        parts.append(buf[o : o + length])
        o += length
    return parts


PLANS = ("sum", "allgather", "sra")


def needs_norm(codec: Codec) -> bool:
    """Whether the codec encodes with a global norm (one allreduce before encoding)."""
    return hasattr(codec, "norm_statistic")


def plan(codec: Codec, n: int, gather: str = "auto") -> str:
    """Which collectives an exchange of ``codec`` between ``n`` ranks runs (module doc)."""
    if codec.exchange == "sum":
        return "sum"
    if codec.exchange == "gather" and resolve_gather(gather, n, codec) == "sra":
        return "sra"
    return "allgather"


def wire_dtype(codec: Codec, kind: str) -> np.dtype:
    """dtype of the array ``encode_wire`` returns for plan ``kind``: uint8 frames, or for the
    sum plan the payload's words (uint64 words travel as int64, whose wrapping sum is exact)."""
    if kind != "sum":
        return np.dtype(np.uint8)
    dt = np.dtype(codec.wire_dtype)
    return np.dtype(np.int64) if dt == np.uint64 else dt


# -- global norm -------------------------------------------------------------------------------
def norm_wire(codec: Codec, xs: list[Any]) -> np.ndarray:
    """This rank's part of the global norm over the vectors ``xs``: one float64 statistic
    (max or sum over the vectors, as ``codec.norm_op``), to be allgathered."""
    stats = [codec.norm_statistic(as_vector(x)) for x in xs]
    local = (max(stats) if codec.norm_op == "max" else sum(stats)) if stats else 0.0
    if any(np.isnan(t) for t in stats):  # max() may drop a NaN operand
        local = float("nan")
    return np.array([local], np.float64)


def norm_from_gathered(codec: Codec, gathered: np.ndarray) -> np.float32:
    """The float32 global norm from the allgathered ``norm_wire`` statistics (rank order)."""
    return codec.norm_from_statistics([float(t) for t in np.asarray(gathered).reshape(-1)])


# -- sum and allgather plans -------------------------------------------------------------------
def encode_payload(codec: Codec, x: Any, seed: int, rank: int,
                   norm: float | None = None) -> Payload:
    """Rank ``rank``'s payload in an exchange with seed ``seed`` (for custom collectives that
    take payloads rather than wire arrays)."""
    return codec.encode_worker(as_vector(x), seed, rank, norm)


def encode_wire(codec: Codec, x: Any, seed: int, rank: int, kind: str,
                norm: float | None = None) -> tuple[np.ndarray, dict]:
    """What rank ``rank`` sends in an exchange with seed ``seed``: ``(wire array, meta)``.

    For ``kind == "sum"`` the payload's words (dtype :func:`wire_dtype`), to be summed
    elementwise; for ``"allgather"`` the framed payload bytes (:func:`frame`).
    """
    payload = encode_payload(codec, x, seed, rank, norm)
    if kind == "sum":
        data = payload.data.reshape(-1)
        wire = data.view(np.int64) if data.dtype == np.uint64 else data
        return wire, dict(payload.meta)
    return frame(payload), {k: v for k, v in payload.meta.items() if k != "seed"}


def decode_sum_wire(codec: Codec, total: np.ndarray, size: int, n: int, meta: dict,
                    out: np.ndarray | None = None) -> np.ndarray:
    """Sum plan: the float32 mean estimate from the elementwise sum of n ranks' words (into
    ``out`` when given; for float32 words that may be ``total`` itself)."""
    data = array_module(total).ascontiguousarray(total).reshape(-1).view(
        np.dtype(codec.wire_dtype))
    return codec.decode_sum(Payload(data, int(size), dict(meta)), int(n), out)


def counts_outage(codec: Codec) -> bool:
    """Whether an exchange of ``codec`` ends with the outage-count allreduce (NDQSG)."""
    return isinstance(codec, NestedDitheredQuantizer)


def combine_wire(codec: Codec, gathered: np.ndarray, size: int, seed: int, n: int,
                 meta: dict, own: tuple[int, Any] | None = None,
                 out: np.ndarray | None = None) -> np.ndarray:
    """Allgather plan: the float32 mean estimate from the concatenated frames of n ranks (into
    ``out`` when given).

    ``own = (rank, x)``: this rank's input, with which an NDQSG P2 sender counts its own wrong
    coarse bins (``codec.last_stats["outside_count"]``, see :func:`outage_wire`).
    """
    parts = unframe(gathered)
    if len(parts) != n:
        raise ValueError(f"expected {n} framed payloads, got {len(parts)}")
    seeds = [worker_seed(seed, r) for r in range(n)]
    payloads = [codec.payload_from_wire(b, int(size), **{**meta, "seed": s})
                for b, s in zip(parts, seeds)]
    if own is not None and counts_outage(codec):
        inputs: list[Any] = [None] * n
        inputs[own[0]] = own[1]
        return codec.decode_side_info(payloads, seeds, inputs=inputs, out=out)
    return codec.combine_gathered(payloads, seed, out=out)


def outage_wire(codec: Codec) -> np.ndarray:
    """NDQSG: this rank's wrong coarse bins of the last ``combine_wire(own=...)`` as one int64,
    to be allreduced with sum."""
    return np.array([codec.last_stats.get("outside_count", 0)], np.int64)


def outage_from_wire(codec: Codec, total: np.ndarray) -> None:
    """NDQSG: set ``last_stats["outside_share"]`` from the allreduced :func:`outage_wire`."""
    codec.set_outside_total(int(np.asarray(total).reshape(-1)[0]))


# -- scatter-reduce-allgather plan -------------------------------------------------------------
def sra_encode_wire(codec: Codec, x: Any, seed: int, rank: int, n: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Sra plan, step 1: ``(send bytes, int32 splits)`` for an alltoall; chunk c goes to rank c."""
    v = as_vector(x)
    frames = [frame(codec.encode(v[lo:hi], seed=chunk_seed(seed, rank, c)))
              for c, (lo, hi) in enumerate(chunk_bounds(v.size, n))]
    return (array_module(v).concatenate(frames),
            np.array([f.size for f in frames], np.int32))


def sra_reduce_wire(codec: Codec, received: np.ndarray, size: int, seed: int, rank: int,
                    n: int) -> np.ndarray:
    """Sra plan, step 2: the mean of this rank's chunk from the n received frames, re-encoded
    and framed for the allgather."""
    lo, hi = chunk_bounds(int(size), n)[rank]
    parts = unframe(received)
    mine = [codec.payload_from_wire(b, hi - lo, seed=chunk_seed(seed, r, rank))
            for r, b in enumerate(parts)]
    mean = Codec.combine_gathered(codec, mine, seed)
    return frame(codec.encode(mean, seed=reencode_seed(seed, rank)))


def sra_decode_wire(codec: Codec, gathered: np.ndarray, size: int, seed: int, n: int,
                    out: np.ndarray | None = None) -> np.ndarray:
    """Sra plan, step 3: the float32 mean estimate from the allgathered re-encoded chunks
    (into ``out`` when given)."""
    out = array_module(gathered).empty(int(size), np.float32) if out is None else out
    parts = unframe(gathered)
    for c, ((lo, hi), part) in enumerate(zip(chunk_bounds(int(size), n), parts)):
        codec.decode(codec.payload_from_wire(part, hi - lo, seed=reencode_seed(seed, c)),
                     out[lo:hi])
    return out
