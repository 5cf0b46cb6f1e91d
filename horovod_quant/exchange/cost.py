"""Which exchange plan a vector takes: the one that sends the fewest bytes over the slowest link.

The slowest link is a host's network interface; the ranks of one host share a faster fabric.
For each plan the model counts the bytes one host's interface sends (the most loaded host),
adds the bytes the link moves during one round of collectives for every round that crosses
hosts (latency), and the bytes a rank moves inside its host weighted by how much slower the
link is than the fabric inside the host. :class:`Fabric` holds those speeds (defaults per kind
of rank, with the fields a door sets: ``doors.DoorEnvironment``). Collectives are costed as
gloo runs them: allgather and allreduce as rings over the ranks in rank order, alltoall
pairwise, Global-QSGD's exponent allreduce by recursive halving and doubling. The plans are
those of :mod:`.plans` (:func:`.plans.plan_choice` picks one); a hierarchical plan runs an
inner plan between the hosts on each rank's shard (1/K of the vector for K ranks per host).
In seconds (the predictor's model, :mod:`horovod_quant.tools.predict`): :class:`LinkTimes`
times a plan's bytes and rounds at a transport's rates and latencies, :class:`Throughput` its
:func:`codec_work` at the codec kernels' rates.
"""
from __future__ import annotations

import math
from typing import Callable, Collection, Mapping, NamedTuple, Sequence

from ..core.base import Codec
from .topology import Topology

#: the prefix of the hierarchical plans' kinds: ``"hierarchical-" + inner kind``
HIERARCHICAL = "hierarchical-"


class Fabric(NamedTuple):
    """How fast the links of a cluster are, which is what the plan choice weighs.

    Attributes:
        link_gbit: the network between hosts, Gbit/s per host interface.
        intra_gbyte: what one rank moves to the others of its host, GB/s (shared memory for
            CPU ranks; PCIe, or NVLink, for GPUs).
        round_us: the latency of one round of collectives across hosts, microseconds (a
            round inside a host is taken to move as many bytes of its fabric in that time).
    """

    link_gbit: float = 1.0
    intra_gbyte: float = 1.25
    round_us: float = 524.288

    @classmethod
    def for_ranks(cls, on_gpu: bool, fields: Mapping[str, float] | None = None) -> "Fabric":
        """The default of CPU ranks (:data:`CPU_RANKS`) or GPU ranks (:data:`GPU_RANKS`), with
        ``fields`` (field -> value) in place of the default's: the fields a door sets
        (``doors.DoorEnvironment``: ``HQ_LINK_GBIT``, ``HQ_INTRA_GBYTE``, ``HQ_ROUND_US``)."""
        return (GPU_RANKS if on_gpu else CPU_RANKS)._replace(**(fields or {}))

    def describe(self) -> str:
        """The fabric in words, for log lines."""
        return (f"{self.link_gbit:g} Gbit/s between hosts, {self.intra_gbyte:g} GB/s inside, "
                f"{self.round_us:g} us per round")

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbit * 1e9 / 8

    @property
    def round_bytes(self) -> float:
        """What one round across hosts costs, in bytes of the link."""
        return self.round_us * 1e-6 * self.link_bytes_per_s

    @property
    def local_weight(self) -> float:
        """How much a byte moved inside a host counts against a byte over the link."""
        return self.link_bytes_per_s / (self.intra_gbyte * 1e9)


#: CPU ranks: a 1 Gbit/s network, shared memory counted at 1.25 GB/s (a byte inside a host
#: weighs a tenth of a byte over the link), 64 KiB of the link per round (about 0.5 ms)
CPU_RANKS = Fabric()
#: GPU ranks: a 10 Gbit/s network, 16 GB/s between the GPUs of a host (PCIe 4.0 x16, or
#: payloads staged through pinned host memory; NVLink moves 10-30x that: HQ_INTRA_GBYTE), and
#: 50 us per round across hosts: a step of NCCL's ring over Ethernet is tens of microseconds
#: (NCCL's own tuning model counts about 14 us per network hop), where the CPU ranks' 0.5 ms
#: is a round of gloo collectives issued from Python.
GPU_RANKS = Fabric(link_gbit=10.0, intra_gbyte=16.0, round_us=50.0)


class Cost(NamedTuple):
    """What one plan moves, for the most loaded host."""

    host_bytes: float  # sent over the host's interface
    rounds: int  # rounds of collectives that cross hosts
    local_bytes: float = 0.0  # sent by one rank inside its host
    local_rounds: int = 0  # rounds of collectives inside a host
    rank_bytes: float = 0.0  # sent by the busiest rank over every link, inside its host or not

    def score(self, fabric: Fabric = CPU_RANKS) -> float:
        """The plan's cost in bytes of the link: its bytes across hosts, a round's bytes per
        round across hosts, and the bytes and rounds inside a host weighted by the fabric's
        :attr:`Fabric.local_weight`."""
        rounds = fabric.round_bytes
        return (self.host_bytes + rounds * self.rounds
                + fabric.local_weight * (self.local_bytes + rounds * self.local_rounds))

    def seconds(self, fabric: Fabric = CPU_RANKS) -> float:
        """The plan's time on ``fabric``: :meth:`score` over the link's rate, that is the bytes
        across hosts at the link's rate, a round's latency per round across hosts, and the
        bytes (and rounds) inside a host at the fabric's rate inside the host. The plan
        choice and :func:`fitted_fabric` weigh the same quantity (:class:`LinkTimes` times a
        plan's bytes and rounds with NCCL's or gloo's rates and latencies)."""
        return self.score(fabric) / fabric.link_bytes_per_s

    def __add__(self, other: "Cost") -> "Cost":  # type: ignore[override]
        return Cost(*(a + b for a, b in zip(self, other)))


#: GPU ranks' latency of one round, microseconds: NCCL's own tuning model (src/graph/tuning.cc
#: of github.com/NVIDIA/nccl, ``hwLat``, ring algorithm, Simple protocol, which carries large
#: buckets) counts 14 us per step over the network and 5.7 us per step over PCIe
NCCL_NET_STEP_US, NCCL_PCI_STEP_US = 14.0, 5.7
#: the share of a network's line rate that NCCL's allreduce reaches (nccl-tests' bus bandwidth
#: of large messages, as NCCL's maintainers report it: 192 GB/s on a DGX A100's eight 200
#: Gbit/s adapters, 12.2 GB/s on one 100 Gbit/s adapter; docs/dev/benchmarks.md cites both)
NET_EFFICIENCY = 0.96


class LinkTimes(NamedTuple):
    """What a plan's :class:`Cost` takes in seconds where the transport's own rates and
    latencies are known (the predictor's): the rates reached (bytes/s) across hosts and inside
    a host, and the latency (s) of a round across hosts and of a round inside a host."""

    link_bytes_per_s: float
    intra_bytes_per_s: float
    round_s: float
    local_round_s: float

    @classmethod
    def of(cls, fabric: Fabric, on_gpu: bool, round_us: float | None = None) -> "LinkTimes":
        """GPU ranks: NCCL's share of the line rate (:data:`NET_EFFICIENCY`) and its steps'
        latency (:data:`NCCL_NET_STEP_US`, :data:`NCCL_PCI_STEP_US`; ``round_us`` given: that
        across hosts). CPU ranks: the fabric's rates (TCP as measured) and its round, in or out
        of a host alike (a gloo collective issued from Python)."""
        if on_gpu:
            across = NCCL_NET_STEP_US if round_us is None else round_us
            return cls(fabric.link_bytes_per_s * NET_EFFICIENCY, fabric.intra_gbyte * 1e9,
                       across * 1e-6, NCCL_PCI_STEP_US * 1e-6)
        return cls(fabric.link_bytes_per_s, fabric.intra_gbyte * 1e9, fabric.round_us * 1e-6,
                   fabric.round_us * 1e-6)

    def seconds(self, cost: Cost) -> float:
        """The plan's time: its bytes across hosts and inside a host at their rates, and the
        latency of its rounds across hosts and inside a host."""
        return (cost.host_bytes / self.link_bytes_per_s + cost.rounds * self.round_s
                + cost.local_bytes / self.intra_bytes_per_s
                + cost.local_rounds * self.local_round_s)

    def scaled(self, factor: float) -> "LinkTimes":
        """Both rates times ``factor``, the latencies as they are."""
        return self._replace(link_bytes_per_s=self.link_bytes_per_s * factor,
                             intra_bytes_per_s=self.intra_bytes_per_s * factor)


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
                rounds if local else 0, per_link)


def _alltoall(topology: Topology, block: float) -> Cost:
    """Every rank sends ``block`` bytes to every other rank."""
    n = topology.size
    host_bytes = max(len(ranks) * (n - len(ranks)) * block for ranks in topology.hosts)
    local = topology.local_size > 1
    return Cost(host_bytes, 1 if topology.host_count > 1 else 0,
                (topology.local_size - 1) * block, 1 if local else 0, (n - 1) * block)


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
    return Cost(max(sent), rounds, local, local_rounds,
                sum(2 * nbytes / (2 << i) for i in range(steps)))


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


def hierarchical_cost(inner: str, topology: Topology, numel: int, payload: float,
                      inside_element_bytes: float = 4.0) -> Cost:
    """The cost of the hierarchical plan with ``inner`` between the hosts: a reduce-scatter
    and allgather inside each host (float32: ``inside_element_bytes`` per element), and on each
    host ``local_size`` inner exchanges of a shard (``payload / local_size`` bytes each) over
    one rank per host."""
    k = topology.local_size
    between = flat_cost(inner, Topology.grid(topology.host_count, 1), payload / k)
    inside = 2 * (k - 1) * inside_element_bytes * numel / k
    return Cost(k * between.host_bytes, between.rounds, inside + between.local_bytes,
                2 + between.local_rounds, inside + between.rank_bytes)


def plan_cost(kind: str, topology: Topology, numel: int, codec: Codec,
              cross_codec: Codec | None = None) -> Cost:
    """The cost of exchanging ``numel`` elements with ``codec`` by the plan ``kind`` (a
    hierarchical kind's inner exchange runs ``cross_codec``, default ``codec``)."""
    if kind.startswith(HIERARCHICAL):
        return hierarchical_cost(kind[len(HIERARCHICAL):], topology, numel,
                                 float((cross_codec or codec).expected_nbytes(numel)))
    return flat_cost(kind, topology, float(codec.expected_nbytes(numel)))


def cheapest(kinds: list[str], topology: Topology, numel: int, codec: Codec,
             cross_codec: Codec | None = None, fabric: Fabric = CPU_RANKS) -> tuple[str, Cost]:
    """The kind of ``kinds`` with the least :meth:`Cost.score` on ``fabric``, and its cost;
    ties go to the earlier kind (list flat plans first: fewer rounds, one quantization)."""
    costs = [plan_cost(k, topology, numel, codec, cross_codec) for k in kinds]
    best = min(range(len(kinds)), key=lambda i: (costs[i].score(fabric), i))
    return kinds[best], costs[best]


def ring_allreduce(topology: Topology, numel: int, element_bytes: float) -> Cost:
    """What a ring allreduce of ``numel`` elements of ``element_bytes`` bytes each moves
    (NCCL's, Horovod's: 4 for float32, 2 for a 16-bit allreduce)."""
    return flat_cost("sum", topology, element_bytes * numel)


def hierarchical_allreduce(topology: Topology, numel: int, element_bytes: float) -> Cost:
    """What a hierarchical allreduce of ``numel`` elements of ``element_bytes`` bytes moves, as
    NCCL's and Horovod's hierarchical allreduce run it: a reduce-scatter inside each host, a
    ring allreduce of each shard across the hosts, an allgather inside each host."""
    return hierarchical_cost("sum", topology, numel, element_bytes * numel, element_bytes)


def float32_ring(topology: Topology, numel: int) -> Cost:
    """What a float32 ring allreduce of ``numel`` elements (NCCL's, Horovod's) moves: the
    reference the plans' bytes are compared with."""
    return ring_allreduce(topology, numel, 4.0)


#: the range a measured rate is fitted in (Gbit/s between hosts, GB/s inside), wide enough
#: for any link: a measurement at a bound says the timings carried no information on it
FIT_LINK_GBIT = (1e-3, 1e5)
FIT_INTRA_GBYTE = (1e-3, 1e4)


def _fit_rate(samples: Sequence[tuple[Cost, float]], fabric_at: Callable[[float], Fabric],
              bounds: tuple[float, float], current: float) -> float:
    """The rate (a :class:`Fabric` field, ``fabric_at(rate)``) at which the samples' predicted
    seconds (:meth:`Cost.seconds`) add up to their measured seconds, by bisection on its
    logarithm (the prediction falls as the rate grows); ``current`` where the samples do not
    depend on it."""
    measured = sum(seconds for _, seconds in samples)

    def predicted(rate: float) -> float:
        return sum(cost.seconds(fabric_at(rate)) for cost, _ in samples)

    lo, hi = (math.log(b) for b in bounds)
    if not samples or predicted(bounds[0]) - predicted(bounds[1]) <= 1e-12 * max(measured, 1e-9):
        return current
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(math.exp(mid)) > measured else (lo, mid)
    return float(math.exp((lo + hi) / 2))


def _misfit(samples: Sequence[tuple[Cost, float]], fabric: Fabric) -> float:
    """How far the model's times on ``fabric`` are from the measured ones: the sum of squared
    relative errors (every bucket counts alike, whatever its size)."""
    return sum((cost.seconds(fabric) / seconds - 1.0) ** 2 for cost, seconds in samples
               if seconds > 0)


def fitted_fabric(base: Fabric, across: Sequence[tuple[Cost, float]],
                  inside: Sequence[tuple[Cost, float]] = (),
                  fixed: Collection[str] = ()) -> Fabric:
    """The fabric whose model (:meth:`Cost.seconds`) gives measured collectives their measured
    time: ``intra_gbyte`` from collectives among the ranks of one host (``inside``; without
    them, from those of ``across`` that cross no host: a one-host group), so that their summed
    prediction equals their summed measurement; ``link_gbit`` from collectives over every rank
    (``across``: (cost, seconds) pairs), the rate whose times (with the rate inside fitted for
    it: a round inside a host is costed in bytes of the link) are nearest the measured ones,
    by golden-section search on its logarithm. Where no collective crossed a host the link is
    not measured. ``round_us`` and the fields in ``fixed`` (those the door's environment
    sets) stay as in ``base``. Every rank fitting the same agreed timings gets the same fabric."""
    inside = list(inside) or [(cost, s) for cost, s in across if cost.host_bytes == 0]

    def at_link(link: float) -> Fabric:
        fabric = base._replace(link_gbit=link)
        if "intra_gbyte" in fixed:
            return fabric
        return fabric._replace(intra_gbyte=_fit_rate(
            inside, lambda r: fabric._replace(intra_gbyte=r), FIT_INTRA_GBYTE,
            fabric.intra_gbyte))

    if "link_gbit" in fixed or not any(cost.host_bytes for cost, _ in across):
        return at_link(base.link_gbit)
    samples = [*across, *inside]
    lo, hi = (math.log(b) for b in FIT_LINK_GBIT)
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(80):
        left, right = hi - golden * (hi - lo), lo + golden * (hi - lo)
        if _misfit(samples, at_link(math.exp(left))) <= _misfit(samples, at_link(math.exp(right))):
            hi = right
        else:
            lo = left
    return at_link(float(math.exp((lo + hi) / 2)))


class CodecWork(NamedTuple):
    """The elements of float32 one rank runs through each codec kernel in one exchange.

    Attributes:
        encode: elements encoded (the codec's encode kernels).
        decode: elements decoded once (a sum's decode, the last decode of a re-encoded chunk).
        combine: elements decoded and accumulated, summed over the payloads combined (the
            mean of gathered payloads; a custom reduction's local combining).
    """

    encode: float
    decode: float
    combine: float

    def __add__(self, other: "CodecWork") -> "CodecWork":  # type: ignore[override]
        return CodecWork(*(a + b for a, b in zip(self, other)))


def codec_work(kind: str, topology: Topology, numel: int) -> CodecWork:
    """What one rank encodes, decodes and combines in the plan ``kind`` of :mod:`.plans` over
    ``topology``, ``numel`` elements: the codec's share of a plan's time, as the plans run
    it. A hierarchical plan's float32 mean inside the host is memory traffic, counted by
    :func:`hierarchical_cost` as bytes inside the host, not here.

    Args:
        kind: a plan kind: "sum", "allgather", "sra", "custom" or "hierarchical-<inner>".
        topology: which ranks share hosts.
        numel: elements of the exchanged vector.

    Returns:
        The elements per kernel (:class:`CodecWork`).
    """
    if kind.startswith(HIERARCHICAL):  # the inner plan between the hosts on 1/K of the vector
        return codec_work(kind[len(HIERARCHICAL):], Topology.grid(topology.host_count, 1),
                          -(-numel // topology.local_size))
    n = topology.size
    if kind == "sum":  # one encode; the summed words decode once
        return CodecWork(numel, numel, 0.0)
    if kind == "allgather":  # one encode; every rank's payload decoded into the mean
        return CodecWork(numel, 0.0, n * numel)
    if kind == "sra":  # chunks encoded, this rank's chunk combined from n payloads and
        # encoded again, every re-encoded chunk decoded
        return CodecWork(numel + numel / n, numel, numel)
    if kind == "custom":  # the reduction combines about one payload over its rounds
        return CodecWork(numel, numel, numel)
    raise ValueError(f"no codec work for plan kind {kind!r}")


def _gbps_seconds(elements: float, gbps: float) -> float:
    return 0.0 if not elements else elements * 4.0 / (gbps * 1e9)


class Throughput(NamedTuple):
    """GB/s of float32 input of one codec's kernels on one rank (``combine``: per payload
    accumulated; None where the codec has no combine kernel of its own, then ``decode``)."""

    encode: float
    decode: float
    combine: float | None = None

    def seconds(self, work: CodecWork, share: float = 1.0) -> tuple[float, float]:
        """``(encode, decode)`` seconds of ``work`` at these rates times ``share`` (a rank's
        share of a core); the decode includes the combining."""
        combine = self.combine if self.combine is not None else self.decode
        return (_gbps_seconds(work.encode, self.encode * share),
                _gbps_seconds(work.decode, self.decode * share)
                + _gbps_seconds(work.combine, combine * share))
