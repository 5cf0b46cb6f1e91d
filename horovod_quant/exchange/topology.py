"""Which ranks of a group share a host, and the collectives of the sub-groups a hierarchical
exchange runs on: the ranks of one host (``local``) and the ranks that hold the same shard on
every host (``cross``)."""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple, Sequence

from .collectives import Collectives


class Topology(NamedTuple):
    """The ranks of each host, in rank order; hosts ordered by their first rank.

    A hierarchical exchange needs :attr:`hierarchical`: at least two hosts, the same number of
    ranks on each (at least two).
    """

    hosts: tuple[tuple[int, ...], ...]

    @classmethod
    def from_host_keys(cls, keys: Sequence[Any]) -> "Topology":
        """The topology where rank r runs on the host named ``keys[r]`` (any comparable value
        that two ranks share exactly when they share a host)."""
        hosts: dict[Any, list[int]] = {}
        for rank, key in enumerate(keys):
            hosts.setdefault(key, []).append(rank)
        return cls(tuple(tuple(ranks) for ranks in hosts.values()))

    @classmethod
    def grid(cls, hosts: int, ranks_per_host: int) -> "Topology":
        """``hosts`` hosts of ``ranks_per_host`` consecutive ranks each."""
        return cls(tuple(tuple(range(h * ranks_per_host, (h + 1) * ranks_per_host))
                         for h in range(hosts)))

    @property
    def size(self) -> int:
        return sum(len(h) for h in self.hosts)

    @property
    def host_count(self) -> int:
        return len(self.hosts)

    @property
    def local_size(self) -> int:
        """Ranks per host (the largest host's count where they differ)."""
        return max(len(h) for h in self.hosts)

    @property
    def homogeneous(self) -> bool:
        return len({len(h) for h in self.hosts}) == 1

    @property
    def hierarchical(self) -> bool:
        """Whether a hierarchical exchange applies: several hosts, the same number of ranks
        on each, several per host."""
        return self.homogeneous and self.host_count > 1 and self.local_size > 1

    def host_of(self, rank: int) -> int:
        return next(h for h, ranks in enumerate(self.hosts) if rank in ranks)

    def local_rank(self, rank: int) -> int:
        return self.hosts[self.host_of(rank)].index(rank)

    def local_group(self, rank: int) -> tuple[int, ...]:
        """The ranks on ``rank``'s host, in rank order."""
        return self.hosts[self.host_of(rank)]

    def cross_group(self, rank: int) -> tuple[int, ...]:
        """The ranks with ``rank``'s local rank on every host, in host order."""
        local = self.local_rank(rank)
        return tuple(ranks[local] for ranks in self.hosts)

    def groups(self) -> list[tuple[int, ...]]:
        """Every local group, then every cross group: the sub-groups a transport builds, in an
        order every rank computes alike."""
        cross = [tuple(ranks[i] for ranks in self.hosts) for i in range(self.local_size)]
        return list(self.hosts) + cross


class SerialWorker:
    """A daemon thread that runs submitted functions one after another, in the order they
    were submitted: the collectives they issue reach sub-groups that pair collectives by call
    order in an order every rank shares (the order of the submissions), while the caller's
    thread goes on (backward computes the next gradients)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` after everything submitted before; its result (or error) in the future."""
        future: Future = Future()
        self._jobs.put((fn, future))
        return future

    def _run(self) -> None:
        while True:
            fn, future = self._jobs.get()
            try:
                future.set_result(fn())
            except BaseException as exc:  # the submitter re-raises it
                future.set_exception(exc)


class Hierarchy(NamedTuple):
    """The sub-group collectives of one rank in a :attr:`Topology.hierarchical` group.

    Attributes:
        topology: the group's topology.
        local: the collectives of this rank's host (group rank = local rank).
        cross: the collectives of the ranks holding this rank's shard on every host (group
            rank = host index).
        worker: runs the hierarchical exchanges, in the order they start.
    """

    topology: Topology
    local: Collectives
    cross: Collectives
    worker: SerialWorker
