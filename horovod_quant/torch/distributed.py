""":class:`Collectives` over a ``torch.distributed`` process group: the DDP door's transport
(:class:`ProcessGroupCollectives`, :func:`process_group_collectives`), and the Horovod
optimizer's gloo transport beside Horovod (:class:`StandaloneGroupCollectives`).

``torch.distributed`` matches collectives by call order per process group, not by name: the
names an :class:`~horovod_quant.exchange.Exchange` passes are not sent, and the callers issue
their collectives in the same order on every rank. Every exchange still carries its tag in its
data, so a rank that pairs another tensor raises.

* allreduce: ``all_reduce`` on a copy (int64 sums wrap exactly, on gloo and NCCL);
* allgather of arrays whose lengths may differ: one ``all_gather`` of ``[int64 byte
  length][the bytes, padded to the longest array of the previous allgather of that name]``;
  what does not fit follows in a second ``all_gather`` on every rank;
* alltoall: one ``all_to_all_single`` of the split sizes, then one of the data;
* Global-QSGD's exponent allreduce (:mod:`horovod_quant.exchange.mpi_exponent_allreduce`) over
  ``isend``/``irecv`` (:class:`PointToPoint`).

NCCL groups move device (CuPy) arrays as CUDA tensors; the others take host arrays (device
payloads are staged through host memory, :class:`~horovod_quant.exchange.staging.HostStaged`).
"""
from __future__ import annotations

import atexit
import inspect
import itertools
import logging
import os
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import gpu
from ..exchange.collectives import Collectives, Handle
from ..exchange.job_end import StoreRendezvous
from ..exchange.shared_memory import host_collectives
from ..exchange.staging import for_device_arrays
from ..exchange.topology import Hierarchy, SerialWorker, Topology
from .tensors import as_array, as_tensor

log = logging.getLogger("horovod_quant")

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
_LENGTH_BYTES = 8  # the int64 byte count before each rank's part of an allgather


def store_end_of_job(comm: Collectives) -> StoreRendezvous | None:
    """Where the DDP door's ranks (``comm``, a group's collectives) agree on the job's end
    (:mod:`~horovod_quant.exchange.job_end`): torch.distributed's default store (torchrun's
    agent holds it, so it outlives the ranks), or None where the group has none."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None
    return StoreRendezvous(store, comm.rank, comm.size, f"hq.end.{comm.group_id}")


def group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group`` (None: the default group), in group rank order."""
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def takes_device_arrays(group: Any) -> bool:
    """Whether ``group``'s collectives take CUDA tensors (an NCCL backend)."""
    return "nccl" in str(dist.get_backend(group)).lower()


class _HandedTensors:
    """The tensors given to torch.distributed collectives, referenced from Python until the
    process group has dropped them.

    gloo's worker thread drops a collective's tensors after completing it, which may be after
    the caller's wait has returned. Were the tensor's Python object gone by then, that thread
    would have to take the GIL to free it; one that needs the GIL once the interpreter is
    finalizing aborts the process ("terminate called without an active exception", after a
    DDP job's last step: torchrun reports the job failed). Kept here, each tensor's last
    reference is dropped by Python: once torch holds it no longer (``Tensor._use_count()``,
    torch's count of references to the tensor, is 1: this one), at a later hand-over or in
    :meth:`release`, which runs at exit (before the interpreter finalizes).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the hierarchy's worker thread hands over tensors too
        self._tensors: list[torch.Tensor] = []

    def _prune(self) -> int:
        """Drop the tensors torch holds no longer; returns how many it still holds."""
        with self._lock:
            self._tensors = [t for t in self._tensors if t._use_count() > 1]
            return len(self._tensors)

    def add(self, work: Any, *tensors: torch.Tensor) -> Any:
        """Keep ``tensors``, which ``work`` (returned) runs on, until torch drops them."""
        self._prune()
        with self._lock:
            self._tensors.extend(tensors)
        return work

    def release(self, timeout: float) -> bool:
        """Wait, the GIL released, until torch holds none of the tensors (at most ``timeout``
        seconds), then drop them; returns whether it holds none."""
        deadline = time.monotonic() + timeout
        while self._prune():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True


#: every tensor this module hands to a collective (see :class:`_HandedTensors`)
HANDED = _HandedTensors()

#: seconds the interpreter's exit waits for torch.distributed to drop the handed tensors: a
#: completed collective's are dropped within microseconds; one that never completes (a failed
#: job) would hold them for the process group's whole timeout
EXIT_WAIT_S = 10.0


#: seconds the exit of a process that used a process group then waits, the GIL released, for
#: gloo's worker threads to free the tensors of collectives this package never saw that
#: completed just before (the script's own last ``all_gather_object``, say): PyTorch's gloo
#: frees those after the caller's wait too, which aborted 6 of 20 two-node jobs (docs/ddp.md)
EXIT_GRACE_S = 0.25

_groups_used = threading.Event()  # set once this process builds collectives over a group


def _release_at_exit() -> None:
    if not HANDED.release(EXIT_WAIT_S):
        log.warning("horovod_quant: at exit, torch.distributed still holds collective tensors "
                    "after %.0f s (a collective did not complete); the exit may abort", EXIT_WAIT_S)
    if _groups_used.is_set():
        time.sleep(EXIT_GRACE_S)


atexit.register(_release_at_exit)


class WorkHandle(Handle):
    """A torch.distributed work in flight and the function that reads its result (called
    once: it may run a collective of its own). Once read, the handle keeps the result alone:
    the work and its tensors are let go (:data:`HANDED` keeps the tensors until torch drops
    them), also where the handle itself is kept."""

    def __init__(self, work: Any, result: Callable[[], Any]) -> None:
        self._work: Any = work
        self._result: Callable[[], Any] | None = result
        self._value: Any = None

    def wait(self) -> Any:
        if self._result is not None:
            self._work.wait()
            self._value = self._result()
            self._work = self._result = None
        return self._value

    def done(self) -> bool:
        return self._result is None or self._work.is_completed()


class ProcessGroupCollectives(Collectives):
    """The collectives of a torch.distributed process group on NumPy arrays (and CuPy arrays
    when the group is NCCL's), paired by call order (:attr:`pairs_by_order`).

    Args:
        group: the process group (None: the default group).
    """

    pairs_by_order = True

    def __init__(self, group: Any = None) -> None:
        ranks = group_ranks(group)
        self._attach(group, dist.get_rank(group), ranks, "torch:" + ",".join(map(str, ranks)),
                     torch.device("cuda", torch.cuda.current_device())
                     if takes_device_arrays(group) else torch.device("cpu"))

    def _attach(self, group: Any, rank: int, ranks: list[int], group_id: str,
                device: torch.device) -> None:
        """Set up the collectives of ``group``: this process's ``rank`` in it, the global
        ranks of its members (``send_async`` addresses them), its name, and the device its
        collectives take tensors on."""
        self.group, self.rank, self.size, self._ranks = group, rank, len(ranks), ranks
        _groups_used.set()
        self.group_id = group_id
        #: where the group's collectives take tensors
        self.device = device
        self._p2p_channels = itertools.count()
        self._bounds: dict[str, int] = {}  # collective name -> longest bytes last gathered

    @property
    def moves_device_arrays(self) -> bool:
        """Whether the group takes CUDA tensors (NCCL): device arrays go to it unstaged."""
        return self.device.type == "cuda"

    def _tensor(self, arr: Any) -> torch.Tensor:
        """A copy of ``arr`` as a tensor on the group's device (collectives write in place)."""
        return as_tensor(arr).to(self.device, copy=True)

    def like(self, tensor: torch.Tensor, arr: Any) -> Any:
        """``tensor`` as an array where ``arr`` lives (host or device)."""
        if gpu.is_device_array(arr) == (tensor.device.type == "cuda"):
            return as_array(tensor)
        return as_array(tensor.cpu()) if tensor.device.type == "cuda" else gpu.to_device(
            as_array(tensor), arr)

    def _sizes(self, counts: list[int]) -> torch.Tensor:
        return torch.tensor(counts, dtype=torch.int64, device=self.device)

    # the group's primitives (each returns the work in flight): the registered group's
    # torch.distributed calls here, the ProcessGroup object's own methods in StandaloneGroup
    def _all_gather(self, parts: list[torch.Tensor], send: torch.Tensor) -> Any:
        return dist.all_gather(parts, send, group=self.group, async_op=True)

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> Any:
        return dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=True)

    def _all_to_all(self, out: torch.Tensor, send: torch.Tensor, out_splits: list[int],
                    send_splits: list[int]) -> Any:
        return dist.all_to_all_single(out, send, out_splits, send_splits, group=self.group,
                                      async_op=True)

    def send_async(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        """Start sending ``tensor`` to group rank ``peer`` under ``tag``; returns the work."""
        return dist.isend(tensor, self._ranks[peer], group=self.group, tag=tag)

    def recv_async(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        """Start receiving into ``tensor`` from group rank ``peer`` under ``tag``."""
        return dist.irecv(tensor, self._ranks[peer], group=self.group, tag=tag)

    def allreduce_async(self, arr: Any, name: str, op: str = "sum") -> Handle:
        tensor = self._tensor(arr)
        return WorkHandle(HANDED.add(self._all_reduce(tensor, op), tensor),
                           lambda: self.like(tensor, arr))

    def allgather_async(self, arr: Any, name: str) -> Handle:
        tensor = self._tensor(arr).reshape(-1)
        data = (tensor.view(torch.uint8) if tensor.numel()  # (an empty one has stride 0)
                else torch.empty(0, dtype=torch.uint8, device=self.device))
        bound = self._bounds.get(name, 0)
        send = torch.zeros(_LENGTH_BYTES + bound, dtype=torch.uint8, device=self.device)
        send[:_LENGTH_BYTES] = self._sizes([data.numel()]).view(torch.uint8)
        send[_LENGTH_BYTES:_LENGTH_BYTES + min(bound, data.numel())] = data[:bound]
        parts = [torch.empty_like(send) for _ in range(self.size)]
        work = HANDED.add(self._all_gather(parts, send), send, *parts)

        def result() -> Any:
            lengths = torch.stack([p[:_LENGTH_BYTES] for p in parts]).view(torch.int64)
            lengths = [int(n) for n in lengths.reshape(-1).tolist()]
            chunks = [p[_LENGTH_BYTES:_LENGTH_BYTES + min(n, bound)]
                      for p, n in zip(parts, lengths)]
            self._bounds[name] = longest = max(lengths)
            if longest > bound:  # the rest of what did not fit: every rank sees it is needed
                rest = torch.zeros(longest - bound, dtype=torch.uint8, device=self.device)
                rest[:max(0, data.numel() - bound)] = data[bound:]
                tails = [torch.empty_like(rest) for _ in range(self.size)]
                HANDED.add(self._all_gather(tails, rest), rest, *tails).wait()
                chunks = [torch.cat([c, t[:max(0, n - bound)]])
                          for c, t, n in zip(chunks, tails, lengths)]
            return self.like(torch.cat(chunks).view(tensor.dtype), arr)

        return WorkHandle(work, result)

    def alltoall_async(self, arr: Any, splits: list[int], name: str) -> Handle:
        tensor = self._tensor(arr).reshape(-1)
        received, sizes = self._sizes([0] * self.size), self._sizes(splits)
        ones = [1] * self.size
        HANDED.add(self._all_to_all(received, sizes, ones, ones), received, sizes).wait()
        received = [int(n) for n in received.tolist()]
        out = torch.empty(sum(received), dtype=tensor.dtype, device=self.device)
        work = HANDED.add(self._all_to_all(out, tensor, received, list(splits)), out, tensor)
        return WorkHandle(work, lambda: (self.like(out, arr), received))

    def mpi_communicator(self) -> PointToPoint | None:
        """Not MPI: the point-to-point messages of this group in the subset of mpi4py's
        communicator that the exponent allreduce calls (a new channel per call). None for an
        NCCL group, whose point-to-point messages pair by order, not by tag (the lanes'
        channels would cross), and whose use from the lanes' threads beside other threads'
        NCCL work can deadlock: its exchanges take the allgather plan (the same bits)."""
        if self.moves_device_arrays:
            return None
        return PointToPoint(self, next(self._p2p_channels))


class _Request:
    """An ``isend``/``irecv`` in flight, as an mpi4py request (``Wait``); a buffer received
    through a staging copy on the group's device is copied into place on ``Wait``."""

    def __init__(self, work: Any, land: Callable[[], None] | None = None) -> None:
        self._work = work
        self._land = land

    def Wait(self) -> None:  # mpi4py's method names
        self._work.wait()
        if self._land is not None:
            self._land()


class PointToPoint:
    """The mpi4py communicator calls of :func:`~horovod_quant.exchange.mpi_exponent_allreduce.
    allreduce_exponent_codes` (``Get_rank``, ``Get_size``, ``Isend``, ``Irecv``, ``Allgatherv``)
    over ``isend``/``irecv`` of a torch.distributed process group.

    The reduction runs on a worker thread beside the collectives of the hook's thread: point-
    to-point messages are matched by sender and tag, not by call order, so they cannot pair with
    those collectives. Tags are ``channel * 2^20 + (reduction % 256) * 2^12 + round``: channels
    (one per exchange, numbered in the same order on every rank) and consecutive reductions of
    one channel never share one.

    Args:
        comm: the group's collectives (its group, ranks and device).
        channel: this communicator's number in the group.
    """

    _ROUND_TAGS = 1 << 12
    _GATHER_TAG = _ROUND_TAGS - 1  # the closing Allgatherv; rounds take the tags below
    _REDUCTIONS = 256

    def __init__(self, comm: ProcessGroupCollectives, channel: int) -> None:
        if channel >= 1 << 10:
            raise ValueError(f"too many exponent-allreduce channels ({channel}) in one process "
                             "group: build fewer DDP states or exchanges on it")
        self._comm = comm
        self._rank, self._size = comm.rank, comm.size
        self._channel = channel
        self._reductions = 0

    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return self._size

    def _tag(self, round_tag: int) -> int:
        if not 0 <= round_tag <= self._GATHER_TAG:
            raise ValueError(f"exponent allreduce: round {round_tag} exceeds the "
                             f"{self._GATHER_TAG} rounds a tag range holds")
        reduction = self._reductions % self._REDUCTIONS
        return (self._channel << 20) + reduction * self._ROUND_TAGS + round_tag

    def _wire(self, buf: Any) -> tuple[torch.Tensor, bool]:
        """``buf`` as a tensor sharing its memory, or a copy on the group's device (staged)
        where ``buf`` lives elsewhere (a device buffer on gloo, a host one on NCCL)."""
        tensor = as_tensor(buf)
        if tensor.device.type == self._comm.device.type:
            return tensor, False
        return tensor.to(self._comm.device), True

    def Isend(self, buf: Any, dest: int, tag: int) -> _Request:
        tensor, _ = self._wire(buf)
        return _Request(self._comm.send_async(tensor, dest, self._tag(tag)))

    def Irecv(self, buf: Any, source: int, tag: int) -> _Request:
        tensor, staged = self._wire(buf)

        def land() -> None:
            buf[:] = self._comm.like(tensor, buf)

        return _Request(self._comm.recv_async(tensor, source, self._tag(tag)),
                        land if staged else None)

    def Allgatherv(self, sendbuf: Any, recv: list) -> None:
        """``recv = [out, (counts, displs)]``: rank r's ``counts[r]`` elements land at
        ``out[displs[r]:]``; each rank sends its part to every other rank."""
        out, (counts, displs) = recv
        requests = []
        for r in range(self._size):
            if r == self._rank:
                continue
            if counts[self._rank]:
                requests.append(self.Isend(sendbuf, r, self._GATHER_TAG))
            if counts[r]:
                requests.append(self.Irecv(out[displs[r]:displs[r] + counts[r]], r,
                                           self._GATHER_TAG))
        if counts[self._rank]:
            out[displs[self._rank]:displs[self._rank] + counts[self._rank]] = sendbuf
        for request in requests:
            request.Wait()
        self._reductions += 1


class StandaloneGroupCollectives(ProcessGroupCollectives):
    """:class:`ProcessGroupCollectives` of a ``ProcessGroup`` object that is not registered
    with ``torch.distributed`` (its own methods are called, with group ranks), so a library
    can build one without touching the default group the user may initialize
    (:func:`horovod_quant.torch.transport.gloo_group_beside_horovod`).

    Args:
        group: the ProcessGroup object.
        group_id: names the group's ranks, the same on each of them.
        device: the CUDA device an NCCL group's tensors live on; None: host tensors (gloo).
    """

    def __init__(self, group: Any, group_id: str, device: torch.device | None = None) -> None:
        # its own methods take group ranks: member r is addressed as r
        self._attach(group, group.rank(), list(range(group.size())), group_id,
                     device or torch.device("cpu"))

    def _all_gather(self, parts: list[torch.Tensor], send: torch.Tensor) -> Any:
        return self.group.allgather([parts], [send])

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> Any:
        options = dist.AllreduceOptions()
        options.reduceOp = _OPS[op]
        return self.group.allreduce([tensor], options)

    def _all_to_all(self, out: torch.Tensor, send: torch.Tensor, out_splits: list[int],
                    send_splits: list[int]) -> Any:
        return self.group.alltoall_base(out, send, out_splits, send_splits,
                                        dist.AllToAllOptions())

    def send_async(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        return self.group.send([tensor], peer, tag)

    def recv_async(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        return self.group.recv([tensor], peer, tag)


def process_group_topology(comm: ProcessGroupCollectives) -> Topology:
    """Which ranks of ``comm``'s group share a host: torchrun's node (``GROUP_RANK``) of each
    rank; one rank per host where a rank does not know its node. Collective."""
    node = os.environ.get("GROUP_RANK")
    nodes = comm.allgather_object(node, f"hq.topology.{comm.group_id}")
    if any(n is None for n in nodes):
        return Topology.grid(comm.size, 1)
    return Topology.from_host_keys(nodes)


_hierarchies: dict[str, Hierarchy] = {}  # group id -> its hierarchy, built once

#: whether ``dist.new_group`` can keep the order of the ranks it is given (older PyTorch
#: releases sort them: a group rank is then a member's place among the sorted ranks)
_GROUPS_KEEP_ORDER = "sort_ranks" in inspect.signature(dist.new_group).parameters


def own_group(group: Any = None) -> Any:
    """A new process group of ``group``'s ranks, in its rank order, and of its backend (None:
    the default group), for the collectives this package issues from its own threads.
    torch.distributed pairs a group's collectives by call order: issued beside DDP's own on
    the user's group (the unused-parameter map during backward), they would pair differently
    on different ranks. Collective over ``group``'s ranks only, as in the order they call it.

    Raises:
        ValueError: this PyTorch's ``new_group`` sorts ranks and ``group``'s do not ascend.
    """
    ranks = group_ranks(group)
    if not _GROUPS_KEEP_ORDER and ranks != sorted(ranks):
        raise ValueError(f"horovod_quant: this PyTorch's new_group sorts ranks, and the "
                         f"process group's global ranks {ranks} do not ascend: give the state "
                         f"a group whose ranks ascend")
    order = {"sort_ranks": False} if _GROUPS_KEEP_ORDER else {}
    return dist.new_group(ranks, backend=dist.get_backend(group),
                          use_local_synchronization=True, **order)


def _subgroups_possible(comm: ProcessGroupCollectives, topology: Topology) -> bool:
    """Whether every host group and shard group of ``topology`` can be built with group ranks
    in the topology's order (always where ``new_group`` keeps the order; else where each
    group's global ranks ascend, as under torchrun, which numbers each node's ranks in a row)."""
    return _GROUPS_KEEP_ORDER or all(
        [comm._ranks[r] for r in ranks] == sorted(comm._ranks[r] for r in ranks)
        for ranks in topology.groups())


def hierarchy_of(comm: ProcessGroupCollectives, topology: Topology) -> Hierarchy:
    """The collectives of ``comm``'s rank's host group and shard group (torch.distributed
    groups; every rank builds its host's, then its shard's, so no two ranks wait on each
    other), built once per group: the exchanges of every state on it share one worker."""
    if comm.group_id not in _hierarchies:
        order = {"sort_ranks": False} if _GROUPS_KEEP_ORDER else {}
        local, cross = (ProcessGroupCollectives(dist.new_group(
            [comm._ranks[r] for r in ranks], use_local_synchronization=True, **order))
            for ranks in (topology.local_group(comm.rank), topology.cross_group(comm.rank)))
        if local.device.type == "cpu":  # NCCL moves device shards itself
            local = host_collectives(local)
        _hierarchies[comm.group_id] = Hierarchy(topology, local, cross,
                                                SerialWorker(f"hq.hierarchy.{comm.group_id}"))
    return _hierarchies[comm.group_id]


def process_group_collectives(group: Any = None) -> Collectives:
    """The collectives of ``group``'s exchanges, with a :class:`~horovod_quant.exchange.
    topology.Hierarchy` where its ranks share nodes (torchrun's ``GROUP_RANK``; its host and
    shard groups of ``group``'s backend), and device payloads staged through host memory
    (:class:`~horovod_quant.exchange.staging.HostStaged`) on the groups that are not NCCL's.
    Collective: every rank of the world calls it at the same point."""
    comm = ProcessGroupCollectives(group)
    topology = process_group_topology(comm)
    if topology.hierarchical and _subgroups_possible(comm, topology):
        comm.hierarchy = hierarchy_of(comm, topology)
    elif topology.hierarchical and comm.rank == 0:
        log.warning("horovod_quant: this PyTorch's new_group sorts ranks, and the nodes' ranks "
                    "are not numbered node by node (%s): the exchanges stay flat",
                    topology.hosts)
    if torch.cuda.is_available() and gpu.available():
        return for_device_arrays(comm)
    return comm
