"""The collectives an exchange needs, on NumPy arrays, independent of the framework.

The framework doors implement :class:`Collectives` over Horovod (``horovod.torch``,
``horovod.tensorflow``; their base is :class:`horovod_quant.process_sets.ProcessSetCollectives`)
or a torch.distributed process group (the DDP door); tests use :class:`LocalCollectives` and
threaded ranks. Nothing here imports a framework or Horovod.
Every call names its collective, because Horovod matches operations across ranks by name.
"""
from __future__ import annotations

import abc
import json
from typing import Any, Callable, Iterator

import numpy as np

from ..core.payload import Payload


class Handle(abc.ABC):
    """A collective in flight."""

    @abc.abstractmethod
    def wait(self) -> Any:
        """Block until done; return the result (a NumPy array, or for alltoall a pair of the
        received array and the received split sizes)."""

    def done(self) -> bool:
        """Whether :meth:`wait` would return without blocking (backends that cannot tell say
        True, and their ``wait`` blocks as before)."""
        return True


def growing_pauses(first: float, longest: float) -> Iterator[float]:
    """The sleeps of a poll loop, seconds: ``first``, doubling up to ``longest``, without end."""
    pause = first
    while True:
        yield pause
        pause = min(2 * pause, longest)


class Then(Handle):
    """``fn`` applied to another handle's result."""

    def __init__(self, inner: Handle, fn: Callable[[Any], Any]) -> None:
        self._inner = inner
        self._fn = fn

    def wait(self) -> Any:
        return self._fn(self._inner.wait())

    def done(self) -> bool:
        return self._inner.done()


def encode_object(obj: Any) -> np.ndarray:
    """``obj`` as JSON (sorted keys) in a payload frame (:func:`~.wire.frame`), a writable
    uint8 array."""
    from .wire import frame

    body = np.frombuffer(bytearray(json.dumps(obj, sort_keys=True, allow_nan=True).encode()),
                         np.uint8)
    return frame(Payload(body, body.size))


def decode_objects(gathered: np.ndarray, count: int) -> list[Any]:
    """The ``count`` objects of a concatenation of :func:`encode_object` outputs.

    Only JSON is read from peers (never pickle: a peer's bytes must not run code here), and
    every length is checked against the bytes received (:func:`~.wire.unframe`).

    Raises:
        ValueError: the bytes are not ``count`` well-formed objects.
    """
    from .wire import unframe

    parts, _ = unframe(np.ascontiguousarray(gathered).reshape(-1).view(np.uint8))
    if len(parts) != count:
        raise ValueError(f"gathered objects: expected {count}, got {len(parts)}")
    objects = []
    for i, part in enumerate(parts):
        try:
            objects.append(json.loads(part.tobytes().decode()))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"gathered objects: object {i} is not JSON: {exc}") from None
    return objects


def joined(data: Any) -> Any:
    """An allgather's or alltoall's data as one array: itself, or its parts concatenated
    (collectives that hand out the senders' parts in place, without a copy, give a list)."""
    if not isinstance(data, list):
        return data
    return data[0] if len(data) == 1 else np.concatenate(data)


class Done(Handle):
    """An already available result."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def wait(self) -> Any:
        return self.value


class Collectives(abc.ABC):
    """Asynchronous collectives over 1-D NumPy arrays (and CuPy arrays, for backends that
    move device buffers; :class:`~horovod_quant.exchange.staging.HostStaged` adapts the others).

    Attributes:
        rank: this process's rank in the group.
        size: number of ranks.
        group_id: names the group of ranks, the same on each of them (the process set's id).
        pairs_by_order: see below.
    """

    rank: int
    size: int
    group_id: str = "0"
    #: whether the ranks' collectives pair by the order they are called in (torch.distributed)
    #: rather than by their names (Horovod): then every rank must issue them in one order
    pairs_by_order: bool = False
    #: where ranks share hosts: the collectives of this rank's host and of the ranks holding
    #: its shard on the other hosts (:class:`~.topology.Hierarchy`), for hierarchical plans
    hierarchy: Any = None
    #: whether device (CuPy) arrays may be handed to these collectives (NCCL groups, Horovod's
    #: GPU operations, or staged through host memory: :func:`~.staging.for_device_arrays`)
    moves_device_arrays: bool = False
    #: whether the communicator of :meth:`mpi_communicator` takes device arrays (a CUDA-aware
    #: MPI, as the door says or detects); otherwise a custom collective stages them
    mpi_moves_device_arrays: bool = False

    @abc.abstractmethod
    def allreduce_async(self, arr: np.ndarray, name: str, op: str = "sum") -> Handle:
        """Elementwise ``op`` ("sum" or "max") over ranks. Integer sums must be exact
        (two's-complement wrap-around included), float sums in the backend's order."""

    @abc.abstractmethod
    def allgather_async(self, arr: np.ndarray, name: str) -> Handle:
        """Concatenation of every rank's array in rank order (lengths may differ), or the
        list of those arrays (:func:`joined` concatenates either)."""

    @abc.abstractmethod
    def alltoall_async(self, arr: np.ndarray, splits: list[int], name: str) -> Handle:
        """Send ``arr[sum(splits[:r]):sum(splits[:r+1])]`` to rank r; receive the pieces sent
        to this rank, concatenated in sender order (or their list); ``wait()`` gives (data,
        received splits)."""

    def allgather_object_async(self, obj: Any, name: str) -> Handle:
        """Every rank's JSON-serializable object, in rank order, from one allgather (tuples
        arrive as lists, as after a JSON round trip on every rank)."""
        return Then(self.allgather_async(encode_object(obj), name),
                    lambda gathered: decode_objects(gathered, self.size))

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        """:meth:`allgather_object_async`, blocking."""
        return self.allgather_object_async(obj, name).wait()

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

