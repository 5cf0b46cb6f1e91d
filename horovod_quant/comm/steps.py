"""One exchange cut into pure steps, for adapters that run collectives themselves.

:class:`~horovod_quant.comm.exchange.Exchange` drives the collectives itself (NumPy arrays in
and out through :class:`~horovod_quant.comm.backend.Collectives`). A graph framework wants the
opposite: it runs the collectives as its own ops (``hvd.allgather`` inside a ``tf.function``) and
calls back into NumPy only for the math, e.g. through ``tf.numpy_function``. These functions
are those callbacks: each takes what a collective delivered (NumPy arrays) and returns what the
next collective sends, with the same framing, seeds and order of operations as
:class:`Exchange`, so the result equals :func:`horovod_quant.mean_estimate` bit for bit.

An exchange of a flat float32 vector ``x`` with exchange seed ``seed`` between ``n`` ranks:

* global-norm codecs (``needs_norm``) first: ``norm_wire(codec, x)`` -> allreduce with
  ``codec.norm_op`` ("max" or "sum", elementwise) -> ``norm_from_wire(codec, reduced)``;
* ``plan(codec, n, gather)`` says which collectives follow:

  - ``"sum"``: ``encode_wire`` -> allreduce(sum) of the int64/float words -> ``decode_sum_wire``;
  - ``"allgather"`` (gather codecs with the allgather schedule, and custom codecs, whose
    reduction then runs locally on every rank): ``encode_wire`` (a framed uint8 array) ->
    allgather -> ``combine_wire``;
  - ``"sra"``: ``sra_encode_wire`` -> alltoall with the returned splits -> ``sra_reduce_wire``
    -> allgather -> ``sra_decode_wire``.

``encode_wire`` also returns the payload's ``meta`` (values every rank knows without sending
them, such as the global norm); pass it back to the decoding step of the same exchange.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..core.base import Codec, as_vector, worker_seed
from ..core.payload import Payload
from ..core.schedules import chunk_bounds, chunk_seed, reencode_seed, resolve_gather
from .exchange import frame, unframe

PLANS = ("sum", "allgather", "sra")


def needs_norm(codec: Codec) -> bool:
    """Whether the codec encodes with a global norm (one allreduce before encoding)."""
    return hasattr(codec, "norm_statistic")


def plan(codec: Codec, n: int, gather: str = "auto") -> str:
    """Which collectives an exchange of ``codec`` between ``n`` ranks runs (module doc)."""
    if codec.exchange == "sum":
        return "sum"
    if codec.exchange == "gather" and resolve_gather(gather, n) == "sra":
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
def norm_wire(codec: Codec, x: Any) -> np.ndarray:
    """This rank's contribution to the global norm: float64 ``[statistic, nan_flag]``.

    Reduce it elementwise with ``codec.norm_op`` over the ranks. A NaN statistic travels as
    ``[0, 1]``: an allreduce(max) may drop a NaN operand (``max(1, nan)`` depends on the order),
    while the reference (``GlobalQSGD.global_norm``) makes the norm NaN when any rank's is.
    """
    stat = float(codec.norm_statistic(as_vector(x)))
    if math.isnan(stat):
        return np.array([0.0, 1.0], np.float64)
    return np.array([stat, 0.0], np.float64)


def norm_from_wire(codec: Codec, reduced: np.ndarray) -> np.float32:
    """The float32 global norm from the reduced ``norm_wire`` arrays."""
    r = np.asarray(reduced, np.float64).reshape(-1)
    stat = math.nan if r[1] > 0 else float(r[0])
    return np.float32(codec.norm_from_statistic(stat))


# -- sum and allgather plans -------------------------------------------------------------------
def encode_wire(codec: Codec, x: Any, seed: int, rank: int, kind: str,
                norm: float | None = None) -> tuple[np.ndarray, dict]:
    """What rank ``rank`` sends in an exchange with seed ``seed``: ``(wire array, meta)``.

    For ``kind == "sum"`` the payload's words (dtype :func:`wire_dtype`), to be summed
    elementwise; for ``"allgather"`` the framed payload bytes (:func:`frame`).
    """
    payload = codec.encode_worker(as_vector(x), seed, rank, norm)
    if kind == "sum":
        data = payload.data.reshape(-1)
        wire = data.view(np.int64) if data.dtype == np.uint64 else data
        return wire, dict(payload.meta)
    return frame(payload), {k: v for k, v in payload.meta.items() if k != "seed"}


def decode_sum_wire(codec: Codec, total: np.ndarray, size: int, n: int, meta: dict) -> np.ndarray:
    """Sum plan: the float32 mean estimate from the elementwise sum of n ranks' words."""
    data = np.ascontiguousarray(total).reshape(-1).view(np.dtype(codec.wire_dtype))
    return codec.decode_sum(Payload(data, int(size), dict(meta)), int(n))


def combine_wire(codec: Codec, gathered: np.ndarray, size: int, seed: int, n: int,
                 meta: dict) -> np.ndarray:
    """Allgather plan: the float32 mean estimate from the concatenated frames of n ranks."""
    parts = unframe(np.ascontiguousarray(gathered).reshape(-1).view(np.uint8))
    if len(parts) != n:
        raise ValueError(f"expected {n} framed payloads, got {len(parts)}")
    payloads = [codec.payload_from_wire(b, int(size), **{**meta, "seed": worker_seed(seed, r)})
                for r, b in enumerate(parts)]
    return codec.combine_gathered(payloads, seed)


# -- scatter-reduce-allgather plan -------------------------------------------------------------
def sra_encode_wire(codec: Codec, x: Any, seed: int, rank: int, n: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Sra plan, step 1: ``(send bytes, int32 splits)`` for an alltoall; chunk c goes to rank c."""
    v = as_vector(x)
    frames = [frame(codec.encode(v[lo:hi], seed=chunk_seed(seed, rank, c)))
              for c, (lo, hi) in enumerate(chunk_bounds(v.size, n))]
    return np.concatenate(frames), np.array([f.size for f in frames], np.int32)


def sra_reduce_wire(codec: Codec, received: np.ndarray, size: int, seed: int, rank: int,
                    n: int) -> np.ndarray:
    """Sra plan, step 2: the mean of this rank's chunk from the n received frames, re-encoded
    and framed for the allgather."""
    lo, hi = chunk_bounds(int(size), n)[rank]
    parts = unframe(np.ascontiguousarray(received).reshape(-1).view(np.uint8))
    mine = [codec.payload_from_wire(b, hi - lo, seed=chunk_seed(seed, r, rank))
            for r, b in enumerate(parts)]
    mean = Codec.combine_gathered(codec, mine, seed)
    return frame(codec.encode(mean, seed=reencode_seed(seed, rank)))


def sra_decode_wire(codec: Codec, gathered: np.ndarray, size: int, seed: int, n: int
                    ) -> np.ndarray:
    """Sra plan, step 3: the float32 mean estimate from the allgathered re-encoded chunks."""
    out = np.empty(int(size), np.float32)
    parts = unframe(np.ascontiguousarray(gathered).reshape(-1).view(np.uint8))
    for c, ((lo, hi), part) in enumerate(zip(chunk_bounds(int(size), n), parts)):
        codec.decode(codec.payload_from_wire(part, hi - lo, seed=reencode_seed(seed, c)),
                     out[lo:hi])
    return out
