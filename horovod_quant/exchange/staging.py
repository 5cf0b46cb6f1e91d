"""Device payloads over host-only collectives: copy to host memory and back.

When gradients live on a GPU, the codecs encode and decode them there (``horovod_quant.gpu``),
and only the compressed payloads have to cross the network. If Horovod's collectives cannot take
device buffers (no NCCL, no CUDA-aware MPI: :func:`horovod_quant.gpu.horovod_device_collectives`),
:class:`HostStaged` copies each payload to host memory before its collective and the result back
to the device when it is waited for. That moves 4-8x fewer bytes over PCIe than staging the
float32 gradients would. :func:`for_device_arrays` stages exactly the groups that need it (the
world's, a hierarchy's host and shard groups), so NCCL groups keep their device buffers.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import numpy as np

from .. import gpu
from .collectives import Collectives, Handle, Then, joined
from .topology import Hierarchy


def for_device_arrays(comm: Collectives) -> Collectives:
    """``comm`` for device payloads: itself where its collectives move device arrays (NCCL),
    else :class:`HostStaged`; the same for each group of its hierarchy (so a gloo world with
    NCCL host and shard groups stages the world's payloads only). Returns ``comm`` or a new
    object; ``comm`` is not changed."""
    if not comm.moves_device_arrays:
        return HostStaged(comm)
    h = getattr(comm, "hierarchy", None)
    if isinstance(h, Hierarchy) and not (h.local.moves_device_arrays
                                         and h.cross.moves_device_arrays):
        comm = copy.copy(comm)
        comm.hierarchy = _hierarchy_for_device_arrays(h)
    return comm


def _hierarchy_for_device_arrays(h: Hierarchy) -> Hierarchy:
    return h._replace(local=for_device_arrays(h.local), cross=for_device_arrays(h.cross))


class HostStaged(Collectives):
    """``inner``'s collectives for device arrays too: a device array is copied to host memory
    (pinned) for the collective, and the result copied back to that array's device on
    ``wait()`` (alltoall: the received data; its split sizes stay a list), both on the current
    CUDA stream. Host arrays pass through. The groups of ``inner``'s hierarchy are staged where
    they do not move device arrays themselves (:func:`for_device_arrays`).

    Args:
        inner: collectives over host (NumPy) arrays.
    """

    moves_device_arrays = True

    def __init__(self, inner: Collectives) -> None:
        self.inner = inner
        self.rank = inner.rank
        self.size = inner.size
        self.group_id = inner.group_id
        self.pairs_by_order = inner.pairs_by_order
        h = getattr(inner, "hierarchy", None)
        self.hierarchy = _hierarchy_for_device_arrays(h) if isinstance(h, Hierarchy) else None

    def _staged(self, arr: Any, start: Callable[[np.ndarray], Handle],
                pick: Callable[[Any], Any] = lambda r: r,
                put: Callable[[Any, Any], Any] = lambda r, d: d) -> Handle:
        if not gpu.is_device_array(arr):
            return start(arr)
        return Then(start(gpu.to_host(arr)),
                    lambda result: put(result, gpu.to_device(joined(pick(result)), arr)))

    def allreduce_async(self, arr: Any, name: str, op: str = "sum") -> Handle:
        return self._staged(arr, lambda h: self.inner.allreduce_async(h, name, op))

    def allgather_async(self, arr: Any, name: str) -> Handle:
        return self._staged(arr, lambda h: self.inner.allgather_async(h, name))

    def alltoall_async(self, arr: Any, splits: list[int], name: str) -> Handle:
        return self._staged(arr, lambda h: self.inner.alltoall_async(h, splits, name),
                            pick=lambda r: r[0], put=lambda r, data: (data, r[1]))

    def mpi_communicator(self) -> Any | None:
        return self.inner.mpi_communicator()

    @property
    def mpi_moves_device_arrays(self) -> bool:  # type: ignore[override]
        return self.inner.mpi_moves_device_arrays
