"""An in-process n-rank world on threads, for testing exchanges without Horovod."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from horovod_quant.exchange.collectives import Collectives, Done, Handle
from horovod_quant.exchange.topology import Hierarchy, SerialWorker, Topology


class _World:
    def __init__(self, n: int) -> None:
        self.n = n
        self.lock = threading.Condition()
        self.slots: dict[str, dict[int, object]] = {}

    def deposit(self, name: str, rank: int, value) -> None:
        """Deposit this rank's ``value`` under ``name``."""
        with self.lock:
            self.slots.setdefault(name, {})[rank] = value
            self.lock.notify_all()

    def complete(self, name: str) -> bool:
        """Whether every rank has deposited under ``name``."""
        with self.lock:
            return len(self.slots.get(name, {})) == self.n

    def collect(self, name: str) -> list:
        """Every rank's value under ``name`` in rank order, once all have deposited."""
        with self.lock:
            self.lock.wait_for(lambda: len(self.slots[name]) == self.n, timeout=30)
            if len(self.slots[name]) != self.n:
                raise TimeoutError(f"collective {name!r} never completed")
            return [self.slots[name][r] for r in range(self.n)]

    def exchange(self, name: str, rank: int, value):
        """Deposit ``value`` under ``name`` and wait until every rank has deposited."""
        self.deposit(name, rank, value)
        return self.collect(name)


class _Arrival(Handle):
    """A collective whose result is ready once every rank has deposited (``done()`` tells)."""

    def __init__(self, world: _World, name: str, result) -> None:
        self.world, self.name, self.result = world, name, result

    def done(self) -> bool:
        return self.world.complete(self.name)

    def wait(self):
        return self.result(self.world.collect(self.name))


class ThreadCollectives(Collectives):
    """One rank of the threaded world. Each collective returns once every rank has issued it,
    unless ``asynchronous``: then it returns at once, and its handle waits for the others."""

    def __init__(self, world: _World, rank: int, asynchronous: bool = False) -> None:
        self.world, self.rank, self.size = world, rank, world.n
        self.group_id = f"threads{id(world)}"
        self.asynchronous = asynchronous

    def _issue(self, name, value, result) -> Handle:
        self.world.deposit(name, self.rank, value)
        handle = _Arrival(self.world, name, result)
        return handle if self.asynchronous else Done(handle.wait())

    def allreduce_async(self, arr, name, op="sum"):
        def reduce(vals):
            total = vals[0].copy()
            for v in vals[1:]:
                total = np.maximum(total, v) if op == "max" else total + v
            return total
        return self._issue(name, np.array(arr, copy=True), reduce)

    def allgather_async(self, arr, name):
        return self._issue(name, np.array(arr, copy=True), np.concatenate)

    def alltoall_async(self, arr, splits, name):
        offs = np.concatenate([[0], np.cumsum(splits)])
        pieces = [np.array(arr[offs[r]:offs[r + 1]], copy=True) for r in range(self.size)]

        def receive(everyone):
            mine = [everyone[s][self.rank] for s in range(self.size)]
            return np.concatenate(mine), [m.size for m in mine]
        return self._issue(name, pieces, receive)


def run_ranks(n: int, fn, asynchronous: bool = False, topology: Topology | None = None):
    """Run ``fn(comm)`` on n threads, one per rank; return the results in rank order
    (``asynchronous``: collectives return before the other ranks issue them; ``topology``:
    ranks share hosts as it says, and each rank's collectives have the ``hierarchy`` of its
    host's and its shard's sub-groups)."""
    world = _World(n)
    comms = [ThreadCollectives(world, r, asynchronous) for r in range(n)]
    if topology is not None and topology.hierarchical:
        hosts = [_World(len(ranks)) for ranks in topology.hosts]
        shards = [_World(topology.host_count) for _ in range(topology.local_size)]
        for r, comm in enumerate(comms):
            h, k = topology.host_of(r), topology.local_rank(r)
            comm.hierarchy = Hierarchy(topology, ThreadCollectives(hosts[h], k, asynchronous),
                                       ThreadCollectives(shards[k], h, asynchronous),
                                       SerialWorker(f"hierarchy.{r}"))
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(fn, comm) for comm in comms]
        return [f.result() for f in futures]
