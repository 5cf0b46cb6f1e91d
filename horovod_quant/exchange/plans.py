"""Every exchange kind written once, as a plan: local steps between collective requests.

A plan is a generator function of one :class:`Piece` (one rank's part of one exchange). It runs
local steps (codec calls, framing from :mod:`.wire`) and yields a collective request
(:class:`Allreduce`, :class:`Allgather`, :class:`Alltoall`, :class:`Custom`) whenever it needs
the other ranks; the runner performs the collective and sends the result back in. The plan
returns the float32 mean estimate, the same on every rank. Runners: :class:`.driver.Exchange`
(asynchronous collectives), the TensorFlow compressor (graph ops, laid out by
:func:`signature`) and :func:`.reference.mean_estimate` (n ranks in lockstep).

:func:`plan_kind` picks the plan from the codec's declared capabilities:

* ``"sum"``: the payload's words (uint64 as int64, whose wrapping sum is exact) -> allreduce ->
  ``decode_sum``;
* ``"allgather"`` (gather codecs; custom codecs whose collective is not available): framed
  payloads -> allgather -> every rank combines the n payloads in rank order; codecs that
  ``counts_outage`` (NDQSG) end with an allreduce of each rank's wrong coarse bins;
* ``"custom"``: the payload -> the codec's collective (``custom_collective``), which returns
  the mean;
* ``"sra"`` (scatter-reduce-allgather, natural compression paper, Algorithm 1): rank r sends
  chunk c, encoded with :func:`chunk_seed`, to rank c (alltoall); rank c combines its chunk's n
  payloads, re-encodes the mean with :func:`reencode_seed`, and the chunks are allgathered.
  Receive volume about 2 (n - 1) / n * P instead of (n - 1) * P, for a second quantization.

Codecs that ``needs_norm`` first run :func:`norm_plan` over the whole vector (statistics
gathered and combined in rank order: an allreduce would add in the backend's order, not
bit-exact for n >= 3, and MPI's max of a NaN is implementation-defined). Pipelining: a vector
longer than ``pipeline_elems`` is exchanged as pieces (:func:`pipeline_bounds`), each its own
plan with seed :func:`pipeline_seed`; runners start every piece before finishing any, so piece
k is on the wire while k + 1 is encoded, and a stateful codec (NDQSG) encodes every piece with
one state.
"""
from __future__ import annotations

from typing import Any, Callable, Generator, NamedTuple, Sequence, Union

import numpy as np

from ..core.base import Codec, array_module, as_vector, worker_seed
from ..core.exp_reduce import chunk_bounds
from ..core.payload import Payload
from ..core.rng import derive_key
from . import wire

REENCODE_TAG = 0x5EA
PIPELINE_TAG = 0x919E
SRA_MIN_WORLD = 5
GATHER_SCHEDULES = ("auto", "allgather", "sra")
#: default piece length of a pipelined exchange (Exchange, the torch doors): 2^21 float32 =
#: 8 MiB, a multiple of the packing block and of every power-of-two bucket size up to it (so
#: no bucket is cut in two). mean_estimate exchanges whole vectors unless given this value.
DEFAULT_PIPELINE_ELEMS = 1 << 21


# -- collective requests -----------------------------------------------------------------------
class Allreduce(NamedTuple):
    """The elementwise sum of the ranks' ``array`` (integers wrap; plans sum nothing else that
    must be bit-exact across backends); the result is the sum."""

    array: Any
    suffix: str = ""  # appended to the exchange's collective name
    payload_bytes: int = 0  # codec payload bytes in ``array`` (mean_estimate's wire count)


class Allgather(NamedTuple):
    """The ranks' ``array`` concatenated in rank order."""

    array: Any
    suffix: str = ""
    payload_bytes: int = 0


class Alltoall(NamedTuple):
    """``array[sum(splits[:r]):sum(splits[:r + 1])]`` to rank r; the result is ``(received,
    received splits)``."""

    array: Any
    splits: list
    suffix: str = ""
    payload_bytes: int = 0


class Custom(NamedTuple):
    """The codec's own collective (``Codec.custom_collective``) on ``payload``; the result is
    the float32 mean estimate."""

    payload: Payload
    seed: int
    suffix: str = ""
    payload_bytes: int = 0

    @property
    def array(self) -> Any:
        return self.payload.data


Request = Union[Allreduce, Allgather, Alltoall, Custom]
Plan = Generator[Request, Any, Any]


class Piece(NamedTuple):
    """One rank's part of one exchange (a whole vector, or a piece of a pipelined one)."""

    codec: Codec
    x: Any  # this rank's float32 vector (host or device); NDQSG reads it after the gather
    seed: int  # the exchange seed of this piece (the same on every rank)
    rank: int
    n: int  # ranks
    norm: float | None  # the global norm of ``needs_norm`` codecs
    tag: wire.Tag  # what every rank must agree this exchange carries (wire.exchange_tag)
    out: Any  # float32 buffer of x.size the mean estimate is written to
    label: str = ""  # the exchange's name in error messages


# -- the plans ---------------------------------------------------------------------------------
def norm_plan(codec: Codec, xs: Sequence[Any], tag: wire.Tag = wire.NO_TAG,
              label: str = "") -> Plan:
    """The global norm over every rank and every vector of ``xs``: one allgather of each
    rank's statistic and ``tag`` (checked on every rank). Returns the norm."""
    gathered = yield Allgather(wire.norm_wire(codec, list(xs), tag))
    return wire.norm_from_gathered(codec, gathered, label)


def _sum_dtype(codec: Codec) -> np.dtype:
    """The dtype a sum codec's words are allreduced as: uint64 words as int64 (collectives have
    no uint64 sum; two's complement wraps the same), others as they are."""
    dt = np.dtype(codec.wire_dtype)
    return np.dtype(np.int64) if dt == np.uint64 else dt


def sum_plan(p: Piece) -> Plan:
    codec = p.codec
    payload = codec.encode_worker(as_vector(p.x), p.seed, p.rank, p.norm)
    words = payload.data.reshape(-1)
    total = yield Allreduce(words.view(_sum_dtype(codec)), payload_bytes=payload.nbytes)
    total = array_module(total).ascontiguousarray(total).reshape(-1).view(codec.wire_dtype)
    return codec.decode_sum(Payload(total, p.x.size, dict(payload.meta)), p.n, p.out)


def allgather_plan(p: Piece) -> Plan:
    codec, n = p.codec, p.n
    payload = codec.encode_worker(as_vector(p.x), p.seed, p.rank, p.norm)
    gathered = yield Allgather(wire.frame(payload, p.tag), payload_bytes=payload.nbytes)
    seeds = [worker_seed(p.seed, r) for r in range(n)]
    payloads = [codec.payload_from_wire(b, p.x.size, **{**payload.meta, "seed": s})
                for b, s in zip(wire.unframe_all(gathered, n, "framed payloads", p.label), seeds)]
    if not codec.counts_outage:
        return codec.combine_gathered(payloads, p.seed, out=p.out)
    # NDQSG: this rank counts its own wrong coarse bins; one allreduce sums every rank's count
    inputs: list[Any] = [None] * n
    inputs[p.rank] = p.x
    mean = codec.decode_side_info(payloads, seeds, inputs=inputs, out=p.out)
    count = np.array([codec.last_stats.get("outside_count", 0)], np.int64)  # read before a
    total = yield Allreduce(count, ".outage")  # lockstep runner's next rank combines
    codec.set_outside_total(int(np.asarray(total).reshape(-1)[0]))
    return mean


def custom_plan(p: Piece) -> Plan:
    payload = p.codec.encode_worker(as_vector(p.x), p.seed, p.rank, p.norm)
    p.out[:] = yield Custom(payload, p.seed, payload_bytes=payload.nbytes)
    return p.out


def sra_plan(p: Piece) -> Plan:
    codec, n, bounds = p.codec, p.n, chunk_bounds(p.x.size, p.n)
    v = as_vector(p.x)
    chunks = [codec.encode(v[lo:hi], seed=chunk_seed(p.seed, p.rank, c))
              for c, (lo, hi) in enumerate(bounds)]
    frames = [wire.frame(c, p.tag) for c in chunks]  # chunk c to rank c, which checks the tags
    received, _ = yield Alltoall(array_module(v).concatenate(frames), [f.size for f in frames],
                                 ".scatter", sum(c.nbytes for c in chunks))
    lo, hi = bounds[p.rank]
    mine = [codec.payload_from_wire(b, hi - lo, seed=chunk_seed(p.seed, r, p.rank))
            for r, b in enumerate(wire.unframe_all(received, n, "chunks", p.label))]
    again = codec.encode(Codec.combine_gathered(codec, mine, p.seed),
                         seed=reencode_seed(p.seed, p.rank))
    gathered = yield Allgather(wire.frame(again), ".gather", again.nbytes)
    for c, ((lo, hi), part) in enumerate(zip(bounds, wire.unframe_all(
            gathered, n, "re-encoded chunks", p.label))):
        codec.decode(codec.payload_from_wire(part, hi - lo, seed=reencode_seed(p.seed, c)),
                     p.out[lo:hi])
    return p.out


PLANS: dict[str, Callable[[Piece], Plan]] = {
    "sum": sum_plan, "allgather": allgather_plan, "custom": custom_plan, "sra": sra_plan}


def signature(kind: str, codec: Codec) -> list[tuple[type, np.dtype | None]]:
    """The requests a plan of ``kind`` yields, in order, with their arrays' dtypes: what a
    runner that must build its collectives before the plan runs (a TensorFlow graph) lays out.
    The plan is checked against it as it runs (:func:`check_request`)."""
    if kind == "norm":
        return [(Allgather, np.dtype(np.float64))]
    if kind == "sum":
        return [(Allreduce, _sum_dtype(codec))]
    if kind == "allgather":
        outage = [(Allreduce, np.dtype(np.int64))] if codec.counts_outage else []
        return [(Allgather, np.dtype(np.uint8))] + outage
    if kind == "sra":
        return [(Alltoall, np.dtype(np.uint8)), (Allgather, np.dtype(np.uint8))]
    return [(Custom, None)]


def check_request(request: Any, expected: tuple[type, np.dtype | None] | None,
                  label: str) -> None:
    """Raise RuntimeError when a plan yields another request than its :func:`signature` says
    (``expected``: the signature's next entry, None past its end; ``request``: None when the
    plan returned)."""
    kind, dtype = expected if expected is not None else (type(None), None)
    if type(request) is not kind or (dtype is not None and request.array.dtype != dtype):
        got = ("its end" if request is None
               else f"{type(request).__name__} of {request.array.dtype}")
        raise RuntimeError(f"exchange {label!r}: the plan reached {got} where its signature "
                           f"says {kind.__name__} of {dtype}")


# -- which plan, which pieces, which seeds -----------------------------------------------------
def resolve_gather(schedule: str, n: int, codec: Codec | None = None) -> str:
    """The concrete schedule for ``schedule`` ("auto", "allgather" or "sra") and n ranks.

    Codecs that ``needs_norm`` (sparse Global-QSGD) always allgather: re-encoding a chunk mean
    would need a second global norm, which the sra plan does not have. ``auto`` picks allgather
    below ``SRA_MIN_WORLD`` ranks and sra from there on.
    """
    if schedule not in GATHER_SCHEDULES:
        raise ValueError(f"gather={schedule!r} is not valid: choose one of "
                         f"{list(GATHER_SCHEDULES)}")
    if codec is not None and codec.needs_norm:
        return "allgather"
    if schedule == "auto":
        return "sra" if n >= SRA_MIN_WORLD else "allgather"
    return schedule


def plan_kind(codec: Codec, n: int, gather: str = "auto", custom: bool = False) -> str:
    """The plan (module doc) an exchange of ``codec`` between ``n`` ranks runs; ``custom``:
    the runner has the codec's custom collective."""
    if codec.combine == "sum":
        return "sum"
    if codec.combine == "custom":
        return "custom" if custom else "allgather"
    return "sra" if resolve_gather(gather, n, codec) == "sra" else "allgather"


def chunk_seed(seed: int, rank: int, chunk: int) -> int:
    """Seed rank ``rank`` encodes chunk ``chunk`` with in the sra plan."""
    return derive_key(worker_seed(seed, rank), chunk)


def reencode_seed(seed: int, chunk: int) -> int:
    """Seed the owner of ``chunk`` re-encodes the chunk mean with in the sra plan."""
    return derive_key(seed, REENCODE_TAG, chunk)


def pipeline_bounds(size: int, pipeline_elems: int | None) -> list[tuple[int, int]]:
    """The pieces of a pipelined exchange: ``[(0, size)]`` when ``pipeline_elems`` is None or
    at least ``size``, else pieces of ``pipeline_elems`` elements (the last one shorter)."""
    if pipeline_elems is None or size <= pipeline_elems:
        return [(0, size)]
    return [(lo, min(lo + pipeline_elems, size)) for lo in range(0, size, pipeline_elems)]


def check_pipeline_elems(pipeline_elems: int | None) -> int | None:
    """Validate a ``pipeline_elems`` argument (None: no pipelining)."""
    if pipeline_elems is None:
        return None
    if isinstance(pipeline_elems, bool) or not isinstance(pipeline_elems, (int, np.integer)) \
            or pipeline_elems < 1:
        raise ValueError(f"pipeline_elems={pipeline_elems!r} must be a positive integer "
                         f"(elements per piece, e.g. {DEFAULT_PIPELINE_ELEMS}) or None")
    return int(pipeline_elems)


def pipeline_seed(seed: int, piece: int, pieces: int) -> int:
    """Seed of piece ``piece`` of ``pieces``: the exchange seed itself when there is one piece
    (an unpipelined exchange), else an independent key per piece."""
    return seed if pieces == 1 else derive_key(seed, PIPELINE_TAG, piece)


def piece_name(name: str, piece: int, pieces: int) -> str:
    """Collective name of piece ``piece`` of an exchange called ``name``."""
    return name if pieces == 1 else f"{name}.p{piece}"

