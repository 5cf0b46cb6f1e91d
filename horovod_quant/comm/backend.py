"""The collectives an exchange needs, on NumPy arrays, independent of the framework.

Adapters implement :class:`Collectives` over their Horovod module (``horovod.torch``,
``horovod.tensorflow``); tests and the single-process path use :class:`LocalCollectives`.
Every call names its collective, because Horovod matches operations across ranks by name.
"""
from __future__ import annotations

import abc
import pickle
from typing import Any

import numpy as np


class Handle(abc.ABC):
    """A collective in flight."""

    @abc.abstractmethod
    def wait(self) -> Any:
        """Block until done; return the result (a NumPy array, or for alltoall a pair of the
        received array and the received split sizes)."""


class Done(Handle):
    """An already available result."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def wait(self) -> Any:
        return self.value


class Collectives(abc.ABC):
    """Asynchronous collectives over 1-D NumPy arrays (and CuPy arrays, for backends that
    move device buffers; :class:`~horovod_quant.comm.staging.HostStaged` adapts the others).

    Attributes:
        rank: this process's rank in the group.
        size: number of ranks.
    """

    rank: int
    size: int

    @abc.abstractmethod
    def allreduce_async(self, arr: np.ndarray, name: str, op: str = "sum") -> Handle:
        """Elementwise ``op`` ("sum" or "max") over ranks. Integer sums must be exact
        (two's-complement wrap-around included), float sums in the backend's order."""

    @abc.abstractmethod
    def allgather_async(self, arr: np.ndarray, name: str) -> Handle:
        """Concatenation of every rank's array in rank order (lengths may differ)."""

    @abc.abstractmethod
    def alltoall_async(self, arr: np.ndarray, splits: list[int], name: str) -> Handle:
        """Send ``arr[sum(splits[:r]):sum(splits[:r+1])]`` to rank r; receive the pieces sent
        to this rank, concatenated in sender order; ``wait()`` gives (data, received splits)."""

    @abc.abstractmethod
    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        """Every rank's picklable object, in rank order (blocking)."""

    def mpi_communicator(self) -> Any | None:
        """An mpi4py communicator over the same ranks for custom collectives, or None.
        Collective: every rank calls it at the same point."""
        return None


class LocalCollectives(Collectives):
    """The one-rank world: every collective is the identity."""

    rank = 0
    size = 1

    def allreduce_async(self, arr, name, op="sum"):
        return Done(np.array(arr, copy=True))

    def allgather_async(self, arr, name):
        return Done(np.array(arr, copy=True))

    def alltoall_async(self, arr, splits, name):
        return Done((np.array(arr, copy=True), list(splits)))

    def allgather_object(self, obj, name):
        return [obj]


class ProcessSetCollectives(Collectives):
    """Base of the framework adapters' collectives: the ranks of a Horovod process set.

    Args:
        process_set: the Horovod process set to run in (default: all ranks).
    """

    def __init__(self, process_set: Any = None) -> None:
        if process_set is None:
            from horovod.common.process_sets import global_process_set

            process_set = global_process_set
        self.process_set = process_set
        self.rank = process_set.rank()
        self.size = process_set.size()

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        # Horovod's allgather_object takes no process set: the same two allgathers with one
        data = np.frombuffer(bytearray(pickle.dumps(obj)), np.uint8)  # writable: torch views it
        sizes = self.allgather_async(np.array([data.size], np.int64), name + ".size").wait()
        blob = self.allgather_async(data, name + ".data").wait()
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        return [pickle.loads(blob[bounds[r]:bounds[r + 1]].tobytes()) for r in range(self.size)]
