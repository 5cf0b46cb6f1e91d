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
rank shares (:attr:`pairs_by_order`). A call's result is the list of the ranks' parts, read in
place (no copy): valid until this rank's next call.
"""
from __future__ import annotations

import atexit
import logging
import mmap
import os
import secrets
from typing import Any

import numpy as np

from .collectives import Collectives, Handle

log = logging.getLogger("horovod_quant")

#: where the regions live
SHM_DIR = "/dev/shm"


class _Region:
    """One rank's region of one slot: a file in :data:`SHM_DIR` mapped into memory."""

    def __init__(self, path: str, nbytes: int, create: bool) -> None:
        """``nbytes``: the size of a region to create; a region opened takes its file's."""
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:  # allocated now: a full SHM_DIR fails here, not with SIGBUS later
                os.posix_fallocate(fd, 0, nbytes)
            else:
                nbytes = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, nbytes)
        except OSError:
            if create:
                os.unlink(path)
            raise
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
            announcements (the only synchronization, module doc).

    Construction is collective (the ranks agree on a name for their regions). A region's file
    is unlinked two calls after its creation, when every rank has mapped it, and at exit, so
    a job leaves nothing in :data:`SHM_DIR` unless it is killed within those two calls.
    """

    pairs_by_order = True

    def __init__(self, control: Collectives) -> None:
        self.control = control
        self.rank, self.size, self.group_id = control.rank, control.size, f"shm:{control.group_id}"
        token = secrets.token_hex(6) if control.rank == 0 else None
        self._prefix = os.path.join(SHM_DIR, "hq-" + control.allgather_object(
            token, "hq.shm.token")[0])
        self._calls = 0
        self._own: list[_Region | None] = [None, None]  # this rank's region of each slot
        self._generation = [0, 0]
        self._peers: dict[tuple[int, int], _Region] = {}  # (rank, slot) -> mapped region
        self._linked: list[tuple[str, int]] = []  # own files not unlinked yet, call created
        self._warned = False
        atexit.register(self._unlink, None)

    def works(self) -> bool:
        """Whether every rank can share a region here (one small call). Collective."""
        try:
            ok = len(self._call(np.arange(64, dtype=np.uint8), None).wait()) == self.size
        except OSError:
            ok = False
        return all(self.control.allgather_object(ok, "hq.shm.works"))

    def allgather_async(self, arr: Any, name: str) -> Handle:
        return self._call(arr, None)

    def alltoall_async(self, arr: Any, splits: list[int], name: str) -> Handle:
        return self._call(arr, list(splits))

    def allreduce_async(self, arr: Any, name: str, op: str = "sum") -> Handle:
        return self.control.allreduce_async(arr, name, op)

    def _path(self, rank: int, slot: int, generation: int) -> str:
        return f"{self._prefix}-r{rank}-s{slot}-g{generation}"

    def _unlink(self, before: int | None) -> None:
        """Unlink this rank's files created before call ``before`` (None: all of them)."""
        keep = []
        for path, created in self._linked:
            if before is None or created < before:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            else:
                keep.append((path, created))
        self._linked = keep

    def _write(self, call: int, data: np.ndarray) -> int:
        """``data`` into this rank's region of the call's slot (a new, larger one when it does
        not fit); returns the region's generation."""
        slot = call % 2
        region = self._own[slot]
        if region is None or region.nbytes < data.size:
            self._generation[slot] += 1
            size = max(data.size, 2 * (region.nbytes if region else 0), 1 << 16)
            path = self._path(self.rank, slot, self._generation[slot])
            region = self._own[slot] = _Region(path, size, create=True)
            self._linked.append((path, call))
        region.bytes[:data.size] = data
        return self._generation[slot]

    def _view(self, rank: int, slot: int, generation: int, nbytes: int) -> np.ndarray:
        """Bytes ``[0, nbytes)`` of rank ``rank``'s region of ``slot`` (mapped once per
        generation)."""
        if rank == self.rank:
            return self._own[slot].bytes[:nbytes]
        path = self._path(rank, slot, generation)
        region = self._peers.get((rank, slot))
        if region is None or region.path != path:
            region = self._peers[rank, slot] = _Region(path, 0, create=False)
        return region.bytes[:nbytes]

    def _call(self, arr: Any, splits: list[int] | None) -> Handle:
        call = self._calls
        self._calls += 1
        data = np.ascontiguousarray(arr).reshape(-1)
        itemsize = data.dtype.itemsize

        def run() -> Any:
            self._unlink(before=call - 1)  # every rank has mapped those (module doc)
            try:
                generation = self._write(call, data.view(np.uint8))
            except OSError as exc:  # SHM_DIR full: this call goes through ``control``
                generation = -1
                if not self._warned:
                    self._warned = True
                    log.warning("horovod_quant: %s has no room for %d bytes (%s); the ranks "
                                "of this host exchange through sockets where it does not "
                                "fit (docker run --shm-size raises the room)", SHM_DIR,
                                data.nbytes, exc)
            announced = np.asarray(self.control.allgather_async(
                np.array([generation, data.nbytes], np.int64), f"hq.shm.{call}").wait())
            announced = announced.reshape(self.size, 2).tolist()
            if any(gen < 0 for gen, _ in announced):  # every rank sees it: all take the socket
                if splits is None:
                    return self.control.allgather_async(data, f"hq.shm.{call}.data").wait()
                return self.control.alltoall_async(data, splits, f"hq.shm.{call}.data").wait()
            if splits is not None and any(nbytes != data.nbytes for _, nbytes in announced):
                raise ValueError("shared memory alltoall: the ranks send "
                                 f"{[nbytes for _, nbytes in announced]} bytes; every rank "
                                 "of a host must split the same byte count alike")
            parts = [self._view(r, call % 2, gen, nbytes)
                     for r, (gen, nbytes) in enumerate(announced)]
            if splits is not None:  # the part each rank sends to this rank
                lo = sum(splits[:self.rank]) * itemsize
                hi = lo + splits[self.rank] * itemsize
                parts = [part[lo:hi] for part in parts]
            parts = [part.view(data.dtype) for part in parts]
            return parts if splits is None else (parts, [p.size for p in parts])

        return _Call(run)


def host_collectives(control: Collectives) -> Collectives:
    """The collectives a host's ranks exchange host-memory float32 shards with: shared memory
    where every rank of the host can map a region, else ``control`` itself. Collective over
    ``control``'s ranks."""
    shared = SharedMemoryCollectives(control)
    return shared if shared.works() else control
