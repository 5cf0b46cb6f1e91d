"""The test oracle: n ranks' plans run in lockstep in one process, collectives simulated exactly.

:func:`mean_estimate` runs the plans that every other runner runs, one generator per simulated
rank, and answers each request as an exact n-rank world does (sums and concatenations in rank
order, integers wrapping), without Horovod, TensorFlow or threads. The codec states (NDQSG's,
``states=``) are each rank's own, or one the ranks share: every rank encodes before any combines,
as in a real run, and a plan reads what a later rank's step would overwrite (its own outage
count) into its request, so a shared state ends where every rank's ends in a flat plan (a
hierarchical plan's ranks advance their shards' states, which differ: pass one per rank).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from ..core.base import Codec, as_vector
from . import plans, wire
from .codec_states import CodecStates
from .cost import CPU_RANKS, Fabric
from .topology import Topology


def _simulate(requests: list[plans.Request]) -> list[Any]:
    """Every rank's result of one collective, given every rank's request (rank order)."""
    first = requests[0]
    if any(type(r) is not type(first) or r.suffix != first.suffix for r in requests):
        raise RuntimeError(f"the ranks' plans diverged: {[type(r).__name__ for r in requests]}")
    if isinstance(first, plans.Allreduce):
        total = np.array(first.array, copy=True)
        for r in requests[1:]:
            total += r.array  # in rank order; integers wrap
        return [total] * len(requests)
    if isinstance(first, plans.Allgather):
        return [np.concatenate([r.array for r in requests])] * len(requests)
    if isinstance(first, plans.Alltoall):
        cuts = [np.split(r.array, np.cumsum(r.splits)[:-1]) for r in requests]
        received = [[cuts[s][d] for s in range(len(requests))] for d in range(len(requests))]
        return [(np.concatenate(parts), [p.size for p in parts]) for parts in received]
    raise RuntimeError(f"{type(first).__name__} has no simulation: the reference runs the "
                       "codec's allgather plan in place of its custom collective")


def _simulate_groups(requests: list[plans.Request], topology: Topology) -> list[Any]:
    """:func:`_simulate` within each group of ranks the requests name (every rank's request
    names the same group)."""
    group = requests[0].group
    if any(r.group != group for r in requests):
        raise RuntimeError(f"the ranks' plans diverged: groups {[r.group for r in requests]}")
    if group == plans.WORLD:
        return _simulate(requests)
    members = topology.hosts if group == plans.LOCAL else [
        topology.cross_group(r) for r in topology.hosts[0]]
    results: list[Any] = [None] * len(requests)
    for ranks in members:
        for r, result in zip(ranks, _simulate([requests[r] for r in ranks])):
            results[r] = result
    return results


class Lockstep:
    """One plan per simulated rank, advanced collective by collective.

    Args:
        ranks: the plans in rank order, not yet started.
        topology: which ranks share hosts (for requests to a hierarchical plan's groups).
        witness: a rank whose result alone is wanted, of plans that keep no state past their
            last collective: each answer goes to it first, and where its plan ends there, the
            others are left before their last local work (a gathered exchange's n decodes on
            every rank: n^2 in all). Every other rank's result is then None. None (default):
            every plan runs to its end.

    Attributes:
        payload_bytes: per rank, the codec payload bytes its requests carried.
    """

    def __init__(self, ranks: Sequence[plans.Plan], topology: Topology | None = None,
                 witness: int | None = None) -> None:
        self.ranks = list(ranks)
        self.topology = topology or Topology.grid(len(self.ranks), 1)
        self.witness = witness
        self.payload_bytes = [0] * len(self.ranks)
        self.results: list[Any] = [None] * len(self.ranks)
        self._requests = self._resume([None] * len(self.ranks))

    def _resume(self, values: list[Any]) -> list[plans.Request] | None:
        w = self.witness
        if w is not None and values[w] is not None:
            try:  # the plans run in lockstep: where the witness's ends, every one's would
                request = self.ranks[w].send(values[w])
            except StopIteration as stop:
                self.results[w] = stop.value
                return None
            values = list(values)
            values[w] = _Sent(request)
        requests = []
        for r, (plan, value) in enumerate(zip(self.ranks, values)):
            if isinstance(value, _Sent):
                self.payload_bytes[r] += value.request.payload_bytes
                requests.append(value.request)
                continue
            try:
                request = plan.send(value)
            except StopIteration as stop:
                self.results[r] = stop.value
                continue
            self.payload_bytes[r] += request.payload_bytes
            requests.append(request)
        if requests and len(requests) != len(self.ranks):
            raise RuntimeError("the ranks' plans diverged: some ended, others yielded")
        return requests or None

    def step(self) -> bool:
        """Answer every rank's current collective, running each plan to its next one; returns
        whether the plans have ended."""
        if self._requests is not None:
            self._requests = self._resume(_simulate_groups(self._requests, self.topology))
        return self._requests is None

    def finish(self) -> list[Any]:
        """Run every rank's plan to its end; returns their results in rank order."""
        while not self.step():
            pass
        return self.results


class _Sent(NamedTuple):
    """A witness's request, already resumed (:class:`Lockstep`)."""

    request: plans.Request


def mean_estimate(codec: Codec, xs: Sequence, seed: int = 0, gather: str = "allgather",
                  pipeline_elems: int | None = None, topology: Topology | None = None,
                  fabric: Fabric | None = None,
                  states: CodecStates | Sequence[CodecStates] | None = None
                  ) -> tuple[np.ndarray, int]:
    """The n-worker mean that the distributed exchange computes, simulated in one process.

    Runs the codec's exchange plan (:mod:`~.plans`) for n simulated ranks, rank ``r``
    encoding ``xs[r]`` with ``worker_seed(seed, r)``; a custom codec's reduction runs on every
    rank (the allgather plan, the same bits). A real n-rank run with the same inputs, seed,
    schedule, pieces and topology gives bit-identical numbers.

    Args:
        codec: a codec from :func:`get_codec`.
        xs: n 1-D arrays of equal length, one per worker.
        seed: the exchange seed.
        gather: "allgather", "sra", "hierarchical" or "auto" (the plan the real exchange
            picks by its cost model, :func:`~.plans.plan_kind`).
        pipeline_elems: piece length of a pipelined exchange (:mod:`~.plans`); None (default)
            exchanges the vectors whole. Pass the :class:`~horovod_quant.exchange.Exchange`'s
            value (default :data:`~.plans.DEFAULT_PIPELINE_ELEMS`) to reproduce it on longer
            vectors.
        topology: which workers share a host (:class:`~.topology.Topology`); given, the
            exchange may take a hierarchical plan, as a real one whose collectives have a
            hierarchy; None: one worker per host, flat plans only.
        fabric: the links' speeds the plan choice weighs under "auto"
            (:class:`~.cost.Fabric`; None: CPU ranks' defaults): pass the door's
            (``opt.fabric``, ``state.fabric``) to reproduce its choice.
        states: the codec states an adaptive codec (NDQSG) reads and advances
            (:class:`~.codec_states.CodecStates`), one shared by the ranks or a list of one per
            rank (a hierarchical plan's ranks advance different states, each its shard's, as
            real ranks do): keep them across calls to reproduce a door's
            successive exchanges of one codec; None: fresh ones (the state of a first
            exchange).

    Returns:
        ``(estimate, wire_bytes)``: the float32 mean estimate and the largest number of payload
        bytes one worker sends (per piece, summed over pieces; frame headers, the norm
        statistics, outage counts and a hierarchical plan's float32 shards inside a host are
        not counted).
    """
    return start_estimate(codec, xs, seed, gather, pipeline_elems, topology, fabric,
                          states).finish()


class StartedEstimate:
    """A simulated exchange whose ranks' plans have all run to their first collective (every
    flat plan has encoded), none further: :meth:`finish` runs them to their ends, piece by
    piece. Several started before any finishes encode as a door's buckets of one step do: all
    of them with the codec states of the step's start (:func:`start_estimate`)."""

    def __init__(self, out: np.ndarray, pieces: list[Lockstep], interleaved: bool) -> None:
        self._out, self._pieces, self._interleaved = out, pieces, interleaved

    def finish(self) -> tuple[np.ndarray, int]:
        """:func:`mean_estimate`'s ``(estimate, wire_bytes)``: the pieces run to their ends one
        after the other, or, ``interleaved`` (a hierarchical plan's, as the hierarchy's worker
        runs them), one collective of each in turn."""
        if self._interleaved:
            running = list(self._pieces)
            while running:
                running = [piece for piece in running if not piece.step()]
        for piece in self._pieces:  # (interleaved: ended already)
            piece.finish()
        return self._out, sum(max(piece.payload_bytes) for piece in self._pieces)


def start_estimate(codec: Codec, xs: Sequence, seed: int = 0, gather: str = "allgather",
                   pipeline_elems: int | None = None, topology: Topology | None = None,
                   fabric: Fabric | None = None,
                   states: CodecStates | Sequence[CodecStates] | None = None
                   ) -> StartedEstimate:
    """:func:`mean_estimate`'s exchange, started and not finished (same arguments and errors).

    A door starts every bucket of a step before it finishes any: its flat exchanges all encode
    before the first combines (and advances an adaptive codec's state), while its hierarchical
    ones run one after the other on the hierarchy's worker. Starting each bucket's estimate
    in the door's bucket order, then finishing them in that order, reproduces both.
    """
    vecs = [as_vector(x) for x in xs]
    if not vecs:
        raise ValueError("mean_estimate needs at least one worker's vector")
    if len({v.size for v in vecs}) != 1:
        raise ValueError(f"all workers' vectors must have one length, got {[v.size for v in vecs]}")
    n, size = len(vecs), vecs[0].size
    if codec.needs_world_size and n != codec.world_size:
        raise ValueError(f"got {n} workers' vectors for a codec built with "
                         f"world_size={codec.world_size}; pass world_size={n}")
    if topology is not None and topology.size != n:
        raise ValueError(f"the topology has {topology.size} ranks for {n} workers' vectors")
    bounds = plans.pipeline_bounds(size, plans.check_pipeline_elems(pipeline_elems))
    kind = plans.runnable(plans.plan_kind(codec, topology or n, size, gather,
                                          topology is not None, fabric or CPU_RANKS),
                          custom=False)
    norm = None
    if codec.traits.needs_norm and not kind.startswith(plans.HIERARCHICAL):
        norm = Lockstep([plans.norm_plan(codec, [v]) for v in vecs]).finish()[0]
    places = [None] * n
    if topology is not None:
        places = [plans.Place(topology.host_of(r), topology.host_count, topology.local_rank(r),
                              topology.local_size) for r in range(n)]
    rank_states = list(states) if isinstance(states, Sequence) else [states] * n
    if len(rank_states) != n:
        raise ValueError(f"got {len(rank_states)} ranks' codec states for {n} workers")
    outs = [np.empty(size, np.float32) for _ in vecs]
    # rank 0's mean is the estimate; the other ranks' last decodes matter only where they
    # advance a codec state
    witness = 0 if codec.new_state() is None else None
    pieces = [Lockstep([plans.plan_of(kind)(plans.Piece(
        codec, v[lo:hi], plans.pipeline_seed(seed, k, len(bounds)), r, n, norm, wire.NO_TAG,
        out[lo:hi], place=place, states=rank_states[r]))
        for r, (v, out, place) in enumerate(zip(vecs, outs, places))],
        topology, witness) for k, (lo, hi) in enumerate(bounds)]
    return StartedEstimate(outs[0], pieces, kind.startswith(plans.HIERARCHICAL))


def _rank_zero_answer(request: plans.Request, members: int) -> Any:
    """Rank 0's result of ``request`` when each of ``members`` ranks sent the same: only what
    that rank receives is built (the allgather's n payloads, the alltoall's n blocks for
    rank 0), and a sum is one pass over the vector, as a ring's share of it roughly is."""
    array = request.array
    if isinstance(request, plans.Allreduce):
        return array * array.dtype.type(members)  # integers wrap as the sum does
    if isinstance(request, plans.Allgather):
        return np.concatenate([array] * members)
    if isinstance(request, plans.Alltoall):
        mine = array[:request.splits[0]]
        return np.concatenate([mine] * members), [mine.size] * members
    raise RuntimeError(f"{type(request).__name__} has no answer of rank 0")


def one_rank(codec: Codec, x: np.ndarray, kind: str, topology: Topology,
             pipeline_elems: int | None = None, seed: int = 0) -> np.ndarray:
    """Rank 0's work in the plan ``kind`` over ``topology``, every other rank taken to send
    what rank 0 sends: what one rank computes in a real exchange (its encodes, frames,
    decodes and combines, the copies and sums a collective makes of what it receives), without
    the other ranks' work, for the predictor to time
    (:func:`horovod_quant.tools.predict.measure_throughput`).

    Args:
        codec: the codec built for the plan's world (``topology.size`` ranks; a hierarchical
            plan builds its own for the hosts); not a side-information codec (NDQSG's ranks
            must send different payloads).
        x: rank 0's float32 vector; its pieces should split evenly into the plan's chunks
            and shards (a multiple of ``topology.size * topology.local_size`` elements), as
            rank 0's chunk stands for every rank's.
        kind: a runnable plan kind (:func:`~.plans.runnable`).
        topology: the ranks and hosts the plan runs over.
        pipeline_elems: piece length (None: the vector whole).
        seed: the exchange seed.

    Returns:
        Rank 0's float32 output: the mean estimate of n equal vectors in the allgather and sum
        plans; in the others the chunks and shards of every rank repeat rank 0's.

    Raises:
        ValueError: a side-information codec.
    """
    if codec.traits.side_information:
        raise ValueError(f"{codec.name}: its ranks' payloads must differ (side information); "
                         "one rank's payload cannot stand for every rank's")
    v = as_vector(x)
    members = {plans.WORLD: topology.size, plans.LOCAL: topology.local_size,
               plans.CROSS: topology.host_count}

    def run(plan: plans.Plan) -> Any:
        try:
            request = next(plan)
            while True:
                request = plan.send(_rank_zero_answer(request, members[request.group]))
        except StopIteration as stop:
            return stop.value

    hierarchical = kind.startswith(plans.HIERARCHICAL)
    place = plans.Place(0, topology.host_count, 0, topology.local_size) if hierarchical else None
    norm = None
    if codec.traits.needs_norm and not hierarchical:
        norm = run(plans.norm_plan(codec, [v]))
    out = np.empty(v.size, np.float32)
    bounds = plans.pipeline_bounds(v.size, plans.check_pipeline_elems(pipeline_elems))
    for k, (lo, hi) in enumerate(bounds):
        run(plans.plan_of(kind)(plans.Piece(
            codec, v[lo:hi], plans.pipeline_seed(seed, k, len(bounds)), 0, topology.size, norm,
            wire.NO_TAG, out[lo:hi], place=place)))
    return out
