"""Every exchange kind written once, as a plan: local steps between collective requests.

A plan is a generator function of one :class:`Piece` (one rank's part of one exchange). It runs
local steps (codec calls, framing from :mod:`.wire`) and yields a collective request
(:class:`Allreduce`, :class:`Allgather`, :class:`Alltoall`, :class:`Custom`) whenever it needs
the other ranks; the runner performs the collective and sends the result back in. The plan
returns the float32 mean estimate, the same on every rank. Runners: :class:`.driver.Exchange`
(asynchronous collectives), the TensorFlow compressor (graph ops, laid out by
:func:`signature`) and :func:`.reference.mean_estimate` (n ranks in lockstep).

:func:`plan_kind` picks the plan from the codec's traits (:mod:`~..core.contract`):
``"sum"``, ``"allgather"``, ``"custom"``, ``"sra"`` (scatter-reduce-allgather) or
``"hierarchical-<inner>"``; the table of docs/dev/exchange.md says which codec takes which and
what each sends. A vector longer than ``pipeline_elems`` is exchanged as pieces
(:func:`pipeline_bounds`), each its own plan with seed :func:`pipeline_seed`; runners start
every piece before finishing any, so an adaptive codec (NDQSG) encodes every piece with one
state (the runner's :class:`~.codec_states.CodecStates`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Generator, NamedTuple, Sequence, Union

import numpy as np

from ..backends import backend_of
from ..core.base import Codec, array_module, as_vector, worker_seed
from ..core.contract import Combine, GlobalNorm
from ..core.exponent_reduction import chunk_bounds
from ..core.limits import HIERARCHY_HINT
from ..core.payload import Payload
from ..core.rng import derive_key
from . import wire
from .codec_states import CodecStates
from .cost import CPU_RANKS, HIERARCHICAL, Cost, Fabric, cheapest
from .topology import Topology

REENCODE_TAG = 0x5EA
PIPELINE_TAG = 0x919E
SHARD_TAG = 0x5BA4D
#: the values of a door's ``gather`` argument: "auto" (the cost model's choice), or the plan a
#: gather codec takes ("allgather", "sra") or "hierarchical" (with the cost model's inner plan)
GATHER_SCHEDULES = ("auto", "allgather", "sra", "hierarchical")
#: the groups of ranks a request goes to: every rank, the ranks of this rank's host, the ranks
#: holding this rank's shard on every host (:class:`~.topology.Hierarchy`)
WORLD, LOCAL, CROSS = "world", "local", "cross"
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
    group: str = WORLD  # which ranks: WORLD, or a hierarchical exchange's LOCAL / CROSS


class Allgather(NamedTuple):
    """The ranks' ``array`` concatenated in rank order."""

    array: Any
    suffix: str = ""
    payload_bytes: int = 0
    group: str = WORLD


class Alltoall(NamedTuple):
    """``array[sum(splits[:r]):sum(splits[:r + 1])]`` to rank r; the result is ``(received,
    received splits)``."""

    array: Any
    splits: list
    suffix: str = ""
    payload_bytes: int = 0
    group: str = WORLD


class Custom(NamedTuple):
    """The codec's own collective (``traits.collective``) on ``payload``; the result is
    the float32 mean estimate."""

    payload: Payload
    seed: int
    suffix: str = ""
    payload_bytes: int = 0
    group: str = WORLD

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
    norm: float | None  # the global norm of GlobalNorm codecs
    tag: wire.Tag  # what every rank must agree this exchange carries (wire.exchange_tag)
    out: Any  # float32 buffer of x.size the mean estimate is written to
    label: str = ""  # the exchange's name in error messages
    place: Place | None = None  # where the rank sits, for a hierarchical plan
    states: CodecStates | None = None  # the runner's codec states (None: fresh ones)

    def state_of(self, codec: Codec) -> Any:
        """The state ``codec`` reads and advances in this piece (None: it does not adapt)."""
        return None if self.states is None else self.states.of(codec)


class Place(NamedTuple):
    """A rank's place in a hierarchical exchange (:class:`~.topology.Topology`)."""

    host: int
    hosts: int
    local: int  # this rank's index on its host
    local_size: int


# -- the plans ---------------------------------------------------------------------------------
def norm_plan(codec: GlobalNorm, xs: Sequence[Any], tag: wire.Tag = wire.NO_TAG,
              label: str = "") -> Plan:
    """The global norm over every rank and every vector of ``xs``: one allgather of each
    rank's statistic and ``tag`` (checked on every rank). Returns the norm."""
    gathered = yield Allgather(wire.norm_wire(codec, list(xs), tag))
    return wire.norm_from_gathered(codec, gathered, label)


def _sum_dtype(codec: Codec) -> np.dtype:
    """The dtype a sum codec's words are allreduced as: uint64 words as int64 (collectives have
    no uint64 sum; two's complement wraps the same), others as they are."""
    dt = codec.traits.wire_dtype
    return np.dtype(np.int64) if dt == np.uint64 else dt


def sum_plan(p: Piece) -> Plan:
    """A :class:`~..core.contract.SumDecodable` codec's words summed by one allreduce."""
    codec = p.codec
    payload = codec.encode_worker(as_vector(p.x), p.seed, p.rank, p.norm, p.state_of(codec))
    words = payload.data.reshape(-1)
    total = yield Allreduce(words.view(_sum_dtype(codec)), payload_bytes=payload.nbytes)
    total = array_module(total).ascontiguousarray(total).reshape(-1).view(
        codec.traits.wire_dtype)
    return codec.decode_sum(Payload(total, p.x.size, dict(payload.meta)), p.n, p.out)


def allgather_plan(p: Piece) -> Plan:
    codec, n = p.codec, p.n
    state = p.state_of(codec)
    payload = codec.encode_worker(as_vector(p.x), p.seed, p.rank, p.norm, state)
    gathered = yield Allgather(wire.frame(payload, p.tag), payload_bytes=payload.nbytes)
    payloads = [codec.payload_from_wire(b, p.x.size, **{**payload.meta,
                                                        "seed": worker_seed(p.seed, r)})
                for r, b in enumerate(wire.unframe_all(gathered, n, "framed payloads", p.label))]
    if not codec.traits.side_information:
        return codec.combine_gathered(payloads, p.seed, out=p.out)
    # side information: each rank counts its own outages; one allreduce sums the counts
    outcome = codec.combine_side_info(payloads, p.seed, p.rank, p.x, out=p.out, state=state)
    total = yield Allreduce(np.array([outcome.own_outages], np.int64), ".outage")
    codec.finish_side_info(outcome, int(np.asarray(total).reshape(-1)[0]))
    return outcome.mean


def custom_plan(p: Piece) -> Plan:
    payload = p.codec.encode_worker(as_vector(p.x), p.seed, p.rank, p.norm,
                                    p.state_of(p.codec))
    p.out[:] = yield Custom(payload, p.seed, payload_bytes=payload.nbytes)
    return p.out


def sra_plan(p: Piece) -> Plan:
    codec, n, bounds = p.codec, p.n, chunk_bounds(p.x.size, p.n)
    v = as_vector(p.x)
    chunks = [codec.encode(v[lo:hi], seed=chunk_seed(p.seed, p.rank, c))
              for c, (lo, hi) in enumerate(bounds)]
    framed, sizes = wire.frames(chunks, p.tag)  # chunk c to rank c, which checks the tags
    received, _ = yield Alltoall(framed, sizes, ".scatter", sum(c.nbytes for c in chunks))
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


def _in_group(plan: Plan, group: str, suffix: str = "") -> Plan:
    """``plan`` with each of its requests sent to the ranks of ``group`` (its collective names
    extended by ``suffix``); returns its result."""
    value = None
    while True:
        try:
            request = plan.send(value)
        except StopIteration as stop:
            return stop.value
        value = yield request._replace(group=group, suffix=suffix + request.suffix)


def shard_seed(seed: int, shard: int) -> int:
    """Seed of the exchange of shard ``shard`` between the hosts in the hierarchical plan."""
    return derive_key(seed, SHARD_TAG, shard)


def hierarchical_plan(p: Piece, inner: str) -> Plan:
    """Compress only between hosts: the K ranks of a host sum their vectors in float32 (each
    rank shard k of K, summed in local rank order: a reduce-scatter, as an alltoall of framed
    shards), divide by K (``Backend.mean_in_order``: the same bits on every backend), exchange
    their host's mean shard with the ranks holding shard k on the other hosts by the ``inner``
    plan (``codec`` built for that many hosts, its own global norm, seed :func:`shard_seed`), and
    allgather the shards inside the host. One quantization per host, not per rank
    (docs/codecs.md).

    Tags: a host whose ranks sent different tensors goes on with a spoiled tag, so that the
    first collective between the hosts (which checks tags) fails on every rank; one allgather
    of the ranks' own tags then gives every rank the same error, ranks numbered in the world."""
    place, v = p.place, as_vector(p.x)
    xp = array_module(v)
    bounds = chunk_bounds(v.size, place.local_size)
    framed, sizes = wire.frames([Payload(v[lo:hi], hi - lo) for lo, hi in bounds], p.tag)
    received, _ = yield Alltoall(framed, sizes, ".local", group=LOCAL)
    lo, hi = bounds[place.local]
    try:
        parts, mismatch = wire.unframe_all(received, place.local_size, "host shards",
                                           p.label), None
    except ValueError as exc:
        parts, mismatch = [], exc
    # the parts in local rank order, one IEEE division: the backend's kernel, since CuPy's
    # own += and /= flush subnormals on device arrays
    host_mean = backend_of(v).mean_in_order([part.view(np.float32) for part in parts],
                                            place.local_size, xp.empty(hi - lo, np.float32))
    tag = p.tag if mismatch is None else wire.spoiled(p.tag)
    codec = p.codec.for_world_size(place.hosts)
    norm, at_odds = None, mismatch
    try:
        if codec.traits.needs_norm:
            norm = yield from _in_group(norm_plan(codec, [host_mean], tag, p.label), CROSS,
                                        ".norm")
        elif inner in ("sum", "custom"):  # their requests carry no tag: check it first
            tags = yield Allgather(wire.tag_words(tag), ".tags", group=CROSS)
            wire.check_tag_words(tags, p.label)
        shard = Piece(codec, host_mean, shard_seed(p.seed, place.local), place.host,
                      place.hosts, norm, tag, p.out[lo:hi], p.label, states=p.states)
        yield from _in_group(PLANS[inner](shard), CROSS)
    except wire.TagMismatch as exc:
        at_odds = mismatch or exc
    except ValueError:
        if mismatch is not None:
            raise mismatch from None
        raise
    if at_odds is not None:  # every rank is here: every cross group holds a rank of each host
        wire.check_tag_words((yield Allgather(wire.tag_words(p.tag), ".tags.world")), p.label)
        raise at_odds
    gathered = yield Allgather(p.out[lo:hi], ".local.gather", group=LOCAL)
    xp.concatenate(gathered if isinstance(gathered, list) else [gathered], out=p.out)
    return p.out


PLANS: dict[str, Callable[[Piece], Plan]] = {
    "sum": sum_plan, "allgather": allgather_plan, "custom": custom_plan, "sra": sra_plan}


def plan_of(kind: str) -> Callable[[Piece], Plan]:
    """The plan of a kind: one of :data:`PLANS`, or ``"hierarchical-" + inner``."""
    if kind.startswith(HIERARCHICAL):
        return functools.partial(hierarchical_plan, inner=kind[len(HIERARCHICAL):])
    return PLANS[kind]


def signature(kind: str, codec: Codec) -> list[tuple[type, np.dtype | None]]:
    """The requests a plan of ``kind`` yields, in order, with their arrays' dtypes: what a
    runner that must build its collectives before the plan runs (a TensorFlow graph) lays out.
    The plan is checked against it as it runs (:func:`check_request`)."""
    if kind == "norm":
        return [(Allgather, np.dtype(np.float64))]
    if kind == "sum":
        return [(Allreduce, _sum_dtype(codec))]
    if kind == "allgather":
        outage = [(Allreduce, np.dtype(np.int64))] if codec.traits.side_information else []
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
def check_gather(schedule: str) -> str:
    """Validate a ``gather`` argument (:data:`GATHER_SCHEDULES`)."""
    if schedule not in GATHER_SCHEDULES:
        raise ValueError(f"gather={schedule!r} is not valid: choose one of "
                         f"{list(GATHER_SCHEDULES)}")
    return schedule


def _flat_kinds(codec: Codec, gather: str) -> list[str]:
    """The flat plans ``codec`` can take under ``gather``, by its traits: sum-decodable codecs
    sum; reduced codecs (a collective of their own) run their own reduction; side-information
    codecs allgather; gather codecs allgather or scatter-reduce-allgather (never global-norm
    ones: re-encoding a chunk mean would need a second global norm)."""
    traits = codec.traits
    if traits.combine is Combine.SUM:
        return ["sum"]
    if traits.collective is not None:
        return ["custom"]
    if traits.side_information or traits.needs_norm or gather == "allgather":
        return ["allgather"]
    return ["sra"] if gather == "sra" else ["allgather", "sra"]


class PlanChoice(NamedTuple):
    """The plan an exchange takes and what it moves (:func:`plan_choice`).

    Attributes:
        kind: the plan (module doc), before :func:`runnable`'s substitution.
        cost: what it moves over the busiest host's interface and inside a host
            (:class:`~.cost.Cost`; ``cost.host_bytes``: the bytes across hosts per exchange).
    """

    kind: str
    cost: Cost


def plan_choice(codec: Codec, topology: Topology | int, numel: int, gather: str = "auto",
                hierarchy: bool = False, fabric: Fabric = CPU_RANKS) -> PlanChoice:
    """The plan an exchange of ``numel`` elements of ``codec`` takes, and its cost: of the
    plans ``gather`` allows, the one :func:`.cost.cheapest` says costs least on ``fabric``.
    Every runner makes the same choice (one without the codec's custom collective then runs
    :func:`runnable`'s substitute); a predictor asks the same function.

    Args:
        topology: which ranks share a host (an int n: n ranks, one per host).
        gather: "auto" (every plan), "allgather" / "sra" (that flat plan for gather codecs),
            "hierarchical" (a hierarchical plan where the runner has one).
        hierarchy: the runner has the collectives of a hierarchical exchange
            (:class:`~.topology.Hierarchy`; used when the topology allows one).
        fabric: the links' speeds (:class:`~.cost.Fabric`; default: CPU ranks').
    """
    check_gather(gather)
    if isinstance(topology, int):
        topology = Topology.grid(topology, 1)
    nested = hierarchy and topology.hierarchical and gather in ("auto", "hierarchical")
    # a world-sized codec sums (or reduces) at most its world size's payloads: a flat plan
    # sums one per rank, a hierarchical one one per host
    flat = _flat_kinds(codec, gather) if _serves(codec, topology.size) else []
    if not flat and not nested:
        raise ValueError(
            f"{codec!r} was built for world_size={codec.world_size}: it combines at most that "
            f"many payloads, and a flat exchange of {topology.size} ranks combines "
            f"{topology.size}. Build it for {topology.size} workers, or exchange "
            f"hierarchically ({HIERARCHY_HINT}; {topology.host_count} host(s) here"
            + ("" if topology.hierarchical else
               ", and a hierarchical exchange needs several hosts of the same number of "
               "ranks, at least two each") + ")")
    kinds = flat if gather != "hierarchical" else []
    cross = codec
    if nested:
        cross = codec.for_world_size(topology.host_count)
        kinds = kinds + [HIERARCHICAL + k for k in _flat_kinds(cross, "auto")]
    return PlanChoice(*cheapest(kinds or flat, topology, numel, codec, cross, fabric))


def _serves(codec: Codec, payloads: int) -> bool:
    """Whether ``codec`` can combine ``payloads`` payloads (a world-sized codec: at most its
    world size)."""
    return not codec.needs_world_size or codec.world_size is None \
        or codec.world_size >= payloads


def plan_kind(codec: Codec, topology: Topology | int, numel: int, gather: str = "auto",
              hierarchy: bool = False, fabric: Fabric = CPU_RANKS) -> str:
    """:func:`plan_choice`'s plan (same arguments)."""
    return plan_choice(codec, topology, numel, gather, hierarchy, fabric).kind


def runnable(kind: str, custom: bool, cross_custom: bool = False) -> str:
    """The plan a runner runs for :func:`plan_kind`'s ``kind``: a custom reduction becomes the
    allgather plan (the same bits) where the runner lacks the codec's collective (``custom``:
    over every rank; ``cross_custom``: between the hosts)."""
    if kind == "custom" and not custom:
        return "allgather"
    if kind == HIERARCHICAL + "custom" and not cross_custom:
        return HIERARCHICAL + "allgather"
    return kind


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

