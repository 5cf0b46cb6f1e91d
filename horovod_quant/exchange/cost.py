"""Which exchange plan a vector takes: the one that sends the fewest bytes over the slowest link.

The slowest link is a host's network interface; the ranks of one host share a faster fabric.
For each plan the model counts the bytes one host's interface sends (the most loaded host),
adds :data:`ROUND_BYTES` for every round of collectives that crosses hosts (latency, in the
bytes the link moves meanwhile), and the bytes a rank moves inside its host weighted by
:data:`LOCAL_WEIGHT`. Collectives are costed as gloo runs them: allgather and allreduce as rings
over the ranks in rank order, alltoall pairwise, Global-QSGD's exponent allreduce by recursive
halving and doubling. The plans are those of :mod:`.plans`; a hierarchical plan runs an inner
plan between the hosts on each rank's shard (1/K of the vector for K ranks per host).
"""
from __future__ import annotations

import math
from typing import NamedTuple

from ..core.base import Codec
from .topology import Topology

#: what one round of collectives across hosts costs, in bytes of the slow link (about 0.5 ms
#: at 1 Gbit/s: a round trip and the collective's own work)
ROUND_BYTES = 64 << 10
#: how much a byte moved inside a host counts against a byte over the slow link
LOCAL_WEIGHT = 0.1
#: the prefix of the hierarchical plans' kinds: ``"hierarchical-" + inner kind``
HIERARCHICAL = "hierarchical-"


class Cost(NamedTuple):
    """What one plan moves, for the most loaded host."""

    host_bytes: float  # sent over the host's interface
    rounds: int  # rounds of collectives that cross hosts
    local_bytes: float = 0.0  # sent by one rank inside its host
    local_rounds: int = 0  # rounds of collectives inside a host

    @property
    def score(self) -> float:
        return (self.host_bytes + ROUND_BYTES * self.rounds
                + LOCAL_WEIGHT * (self.local_bytes + ROUND_BYTES * self.local_rounds))

    def __add__(self, other: "Cost") -> "Cost":  # type: ignore[override]
        return Cost(*(a + b for a, b in zip(self, other)))


def _host_of(topology: Topology) -> list[int]:
    owner = [0] * topology.size
    for h, ranks in enumerate(topology.hosts):
        for r in ranks:
            owner[r] = h
    return owner


def _ring(topology: Topology, per_link: float, rounds: int) -> Cost:
    """A ring over the ranks in rank order whose every link carries ``per_link`` bytes."""
    owner = _host_of(topology)
    n = topology.size
    crossings = [0] * topology.host_count
    for r in range(n):
        if owner[r] != owner[(r + 1) % n]:
            crossings[owner[r]] += 1
    crossing = max(crossings)
    local = topology.local_size > 1
    return Cost(crossing * per_link, rounds if crossing else 0, per_link if local else 0.0,
                rounds if local else 0)


def _alltoall(topology: Topology, block: float) -> Cost:
    """Every rank sends ``block`` bytes to every other rank."""
    n = topology.size
    host_bytes = max(len(ranks) * (n - len(ranks)) * block for ranks in topology.hosts)
    local = topology.local_size > 1
    return Cost(host_bytes, 1 if topology.host_count > 1 else 0,
                (topology.local_size - 1) * block, 1 if local else 0)


def _halving_doubling(topology: Topology, nbytes: float) -> Cost:
    """Recursive halving then doubling of ``nbytes`` per rank (a non-power-of-two world
    folds its extra ranks in first; costed as the next power of two)."""
    owner = _host_of(topology)
    n = topology.size
    steps = max(1, math.ceil(math.log2(n))) if n > 1 else 0
    sent = [0.0] * topology.host_count
    rounds, local, local_rounds = 0, 0.0, 0
    for i in range(steps):
        distance, block = 1 << (steps - 1 - i), nbytes / (2 << i)
        if any(r ^ distance < n and owner[r ^ distance] != owner[r] for r in range(n)):
            for r in range(n):
                if r ^ distance < n and owner[r ^ distance] != owner[r]:
                    sent[owner[r]] += 2 * block  # the halving round and its doubling twin
            rounds += 2
        else:
            local, local_rounds = local + 2 * block, local_rounds + 2
    return Cost(max(sent), rounds, local, local_rounds)


def flat_cost(kind: str, topology: Topology, payload: float) -> Cost:
    """The cost of a flat plan of :mod:`.plans` over ``topology``.

    Args:
        kind: "allgather", "sra", "sum" or "custom".
        payload: bytes of one rank's payload of the whole vector (a sum plan's words).
    """
    n = topology.size
    if n == 1:
        return Cost(0.0, 0, 0.0)
    if kind == "allgather":
        return _ring(topology, (n - 1) * payload, n - 1)
    if kind == "sra":
        return _alltoall(topology, payload / n) + _ring(topology, (n - 1) * payload / n, n - 1)
    if kind == "sum":
        return _ring(topology, 2 * (n - 1) * payload / n, 2 * (n - 1))
    if kind == "custom":
        return _halving_doubling(topology, payload)
    raise ValueError(f"no cost for plan kind {kind!r}")


def hierarchical_cost(inner: str, topology: Topology, numel: int, payload: float) -> Cost:
    """The cost of the hierarchical plan with ``inner`` between the hosts: a float32
    reduce-scatter and allgather inside each host, and on each host ``local_size`` inner
    exchanges of a shard (``payload / local_size`` bytes each) over one rank per host."""
    k = topology.local_size
    between = flat_cost(inner, Topology.grid(topology.host_count, 1), payload / k)
    inside = 2 * (k - 1) * 4.0 * numel / k
    return Cost(k * between.host_bytes, between.rounds, inside + between.local_bytes,
                2 + between.local_rounds)


def plan_cost(kind: str, topology: Topology, numel: int, codec: Codec,
              cross_codec: Codec | None = None) -> Cost:
    """The cost of exchanging ``numel`` elements with ``codec`` by the plan ``kind`` (a
    hierarchical kind's inner exchange runs ``cross_codec``, default ``codec``)."""
    if kind.startswith(HIERARCHICAL):
        return hierarchical_cost(kind[len(HIERARCHICAL):], topology, numel,
                                 float((cross_codec or codec).expected_nbytes(numel)))
    return flat_cost(kind, topology, float(codec.expected_nbytes(numel)))


def cheapest(kinds: list[str], topology: Topology, numel: int, codec: Codec,
             cross_codec: Codec | None = None) -> str:
    """The kind of ``kinds`` with the least :attr:`Cost.score`; ties go to the earlier kind
    (list flat plans first: fewer rounds, one quantization)."""
    return min(kinds, key=lambda k: (plan_cost(k, topology, numel, codec, cross_codec).score,
                                     kinds.index(k)))
