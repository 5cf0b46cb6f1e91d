"""Device payloads over host-only collectives: copy to host memory and back.

When gradients live on a GPU, the codecs encode and decode them there (``horovod_quant.gpu``),
and only the compressed payloads have to cross the network. If Horovod's collectives cannot take
device buffers (no NCCL, no CUDA-aware MPI: :func:`horovod_quant.gpu.horovod_device_collectives`),
:class:`HostStaged` copies each payload to host memory before its collective and the result back
to the device when it is waited for. That moves 4-8x fewer bytes over PCIe than staging the
float32 gradients would.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .. import gpu
from .topology import Hierarchy
from .collectives import Collectives, Handle, Then, joined


class HostStaged(Collectives):
    """``inner``'s collectives for device arrays too: a device array is copied to host memory
    for the collective, and the result copied back to that array's device on ``wait()``
    (alltoall: the received data; its split sizes stay a list). Host arrays pass through.

    Args:
        inner: collectives over host (NumPy) arrays.
    """

    def __init__(self, inner: Collectives) -> None:
        self.inner = inner
        self.rank = inner.rank
        self.size = inner.size
        self.group_id = inner.group_id
        self.pairs_by_order = inner.pairs_by_order
        h = getattr(inner, "hierarchy", None)
        self.hierarchy = (h._replace(local=HostStaged(h.local), cross=HostStaged(h.cross))
                          if isinstance(h, Hierarchy) else None)

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
