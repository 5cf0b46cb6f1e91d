"""An in-process n-rank world on threads, for testing exchanges without Horovod."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from horovod_quant.exchange.collectives import Collectives, Done


class _World:
    def __init__(self, n: int) -> None:
        self.n = n
        self.lock = threading.Condition()
        self.slots: dict[str, dict[int, object]] = {}

    def exchange(self, name: str, rank: int, value):
        """Deposit ``value`` under ``name`` and wait until every rank has deposited."""
        with self.lock:
            self.slots.setdefault(name, {})[rank] = value
            self.lock.notify_all()
            self.lock.wait_for(lambda: len(self.slots[name]) == self.n, timeout=30)
            if len(self.slots[name]) != self.n:
                raise TimeoutError(f"collective {name!r} never completed")
            return [self.slots[name][r] for r in range(self.n)]


class ThreadCollectives(Collectives):
    def __init__(self, world: _World, rank: int) -> None:
        self.world, self.rank, self.size = world, rank, world.n
        self.group_id = f"threads{id(world)}"

    def allreduce_async(self, arr, name, op="sum"):
        vals = self.world.exchange(name, self.rank, np.array(arr, copy=True))
        total = vals[0].copy()
        for v in vals[1:]:
            total = np.maximum(total, v) if op == "max" else total + v
        return Done(total)

    def allgather_async(self, arr, name):
        return Done(np.concatenate(self.world.exchange(name, self.rank, np.array(arr, copy=True))))

    def alltoall_async(self, arr, splits, name):
        offs = np.concatenate([[0], np.cumsum(splits)])
        pieces = [np.array(arr[offs[r]:offs[r + 1]], copy=True) for r in range(self.size)]
        everyone = self.world.exchange(name, self.rank, pieces)
        mine = [everyone[s][self.rank] for s in range(self.size)]
        return Done((np.concatenate(mine), [m.size for m in mine]))


def run_ranks(n: int, fn):
    """Run ``fn(comm)`` on n threads, one per rank; return the results in rank order."""
    world = _World(n)
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(fn, ThreadCollectives(world, r)) for r in range(n)]
        return [f.result() for f in futures]
