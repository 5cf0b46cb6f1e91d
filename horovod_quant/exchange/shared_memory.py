"""The collectives of the ranks of one host through shared memory (``/dev/shm``).

A hierarchical exchange moves float32 shards between the ranks of a host twice per vector;
through a socket every byte is copied into the kernel and out again. Here each rank writes
its part once into a region of its own, which the other ranks of the host map and read in
place. A small collective of ``control`` (the same ranks, e.g. their gloo group) carries each
call's byte counts and is the only synchronization: a call's data is written and then
announced, so a rank reads only what was announced. Each rank alternates between two regions
(call k writes region k mod 2): region k mod 2 is written again at call k + 2, after every rank
has announced call k + 1, and a rank announces k + 1 only once it is done reading call k.
Calls are therefore run when they are waited for, in the order they were issued, which every
rank shares (:attr:`pairs_by_order`).
"""
from __future__ import annotations

import mmap
import os
import secrets
from typing import Any

import numpy as np

from .collectives import Collectives, Handle

#: where the regions live
SHM_DIR = "/dev/shm"


class _Region:
    """One rank's region of one slot: a file in :data:`SHM_DIR` mapped into memory."""

    def __init__(self, path: str, nbytes: int, create: bool) -> None:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            self.map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.path, self.nbytes = path, nbytes
        self.bytes = np.frombuffer(self.map, np.uint8)


class _Call(Handle):
    """One call: run when waited for (module doc)."""

    def __init__(self, run: Any) -> None:
        self._run = run
        self._value: Any = None
        self._done = False

    def wait(self) -> Any:
        if not self._done:
            self._value, self._done = self._run(), True
        return self._value


class SharedMemoryCollectives(Collectives):
    """allgather and alltoall between the ranks of one host through shared memory.

    Args:
        control: the collectives of the same ranks, in the same rank order, for the small
            announcements (pairing by call order or by name: each call names its own).

    Construction is collective (the ranks agree on a name for their regions). Where
    :data:`SHM_DIR` cannot hold a region, :meth:`works` is False on every rank.
    """

    pairs_by_order = True

    def __init__(self, control: Collectives) -> None:
        self.control = control
        self.rank, self.size, self.group_id = control.rank, control.size, f"shm:{control.group_id}"
        token = secrets.token_hex(6) if control.rank == 0 else None
        self._prefix = os.path.join(
            SHM_DIR, f"hq-{control.allgather_object(token, 'hq.shm.token')[0]}-{os.getpid()}")
        self._calls = 0
        self._own: list[_Region | None] = [None, None]  # this rank's region of each slot
        self._generation = [0, 0]
        self._peers: dict[tuple[int, int], _Region] = {}  # (rank, slot) -> mapped region
        self._unlink: list[str] = []  # own files every peer has mapped by the next call

    def works(self) -> bool:
        """Whether every rank can write a region here (one small test call). Collective."""
        try:
            ok = bool(self._call(np.arange(64, dtype=np.uint8), None).wait().size)
        except OSError:
            ok = False
        return all(self.control.allgather_object(ok, "hq.shm.works"))

    def allgather_async(self, arr: Any, name: str) -> Handle:
        return self._call(arr, None)

    def alltoall_async(self, arr: Any, splits: list[int], name: str) -> Handle:
        return self._call(arr, list(splits))

    def allreduce_async(self, arr: Any, name: str, op: str = "sum") -> Handle:
        return self.control.allreduce_async(arr, name, op)

    def _write(self, slot: int, data: np.ndarray) -> int:
        """``data`` into this rank's region of ``slot`` (a larger one when it does not fit);
        returns the region's generation."""
        region = self._own[slot]
        if region is None or region.nbytes < data.size:
            if region is not None:
                self._unlink.append(region.path)
            self._generation[slot] += 1
            size = max(data.size, 2 * (region.nbytes if region else 0), 1 << 16)
            region = self._own[slot] = _Region(self._path(self.rank, slot), size, create=True)
        region.bytes[:data.size] = data
        return self._generation[slot]

    def _path(self, rank: int, slot: int, generation: int | None = None) -> str:
        gen = self._generation[slot] if generation is None else generation
        return f"{self._prefix}-{self.control.group_id}-r{rank}-s{slot}-g{gen}"

    def _call(self, arr: Any, splits: list[int] | None) -> Handle:
        call = self._calls
        self._calls += 1
        data = np.ascontiguousarray(arr).reshape(-1)

        def run() -> Any:
            slot = call % 2
            for path in self._unlink:  # mapped by every peer at the last call, or never used
                os.unlink(path)
            self._unlink = []
            generation = self._write(slot, data.view(np.uint8))
            announced = self.control.allgather_async(
                np.array([generation, data.nbytes], np.int64), f"hq.shm.{call}").wait()
            announced = np.asarray(announced).reshape(self.size, 2)
            itemsize = data.dtype.itemsize
            parts = []
            for rank, (gen, nbytes) in enumerate(announced.tolist()):
                view = self._view(rank, slot, gen, nbytes)
                if splits is None:
                    parts.append(view)
                else:  # the part rank ``rank`` sends to this rank, at the same offset
                    counts = self.control_splits(announced, rank, splits, itemsize)
                    lo = sum(counts[:self.rank])
                    parts.append(view[lo:lo + counts[self.rank]])
            out = np.concatenate(parts).view(data.dtype)
            if splits is None:
                return out
            return out, [p.size // itemsize for p in parts]

        return _Call(run)

    def control_splits(self, announced: np.ndarray, rank: int, splits: list[int],
                       itemsize: int) -> list[int]:
        """The byte counts rank ``rank`` sends to each rank: the same split sizes as this
        rank's where it sends as many bytes (every rank of a hierarchical exchange does)."""
        if int(announced[rank][1]) != sum(splits) * itemsize:
            raise ValueError(f"shared memory alltoall: rank {rank} sends "
                             f"{int(announced[rank][1])} bytes where this rank sends "
                             f"{sum(splits) * itemsize}: the ranks' splits differ")
        return [s * itemsize for s in splits]

    def _view(self, rank: int, slot: int, generation: int, nbytes: int) -> np.ndarray:
        """Bytes ``[0, nbytes)`` of rank ``rank``'s region of ``slot`` (mapped once per
        generation)."""
        if rank == self.rank:
            return self._own[slot].bytes[:nbytes]
        region = self._peers.get((rank, slot))
        if region is None or region.path != self._path(rank, slot, generation):
            region = _Region(self._path(rank, slot, generation), 0, create=False) \
                if False else _open(self._path(rank, slot, generation))
            self._peers[rank, slot] = region
        return region.bytes[:nbytes]


def _open(path: str) -> _Region:
    size = os.stat(path).st_size
    return _Region(path, size, create=False)
