""":class:`Collectives` over ``horovod.torch``: NumPy arrays in and out, zero-copy on CPU."""
from __future__ import annotations

import pickle
from typing import Any

import horovod.torch as hvd
import numpy as np
import torch

from ..comm.backend import Collectives, Handle
from ..comm.mpi_exp import world_communicator

_OPS = {"sum": hvd.Sum, "max": hvd.Max}


class _TorchHandle(Handle):
    def __init__(self, handle: Any, post=None) -> None:
        self._handle = handle
        self._post = post

    def wait(self) -> Any:
        out = hvd.synchronize(self._handle)
        return self._post(out) if self._post else out.numpy()


class HorovodTorchCollectives(Collectives):
    """Horovod's torch collectives on CPU tensors (gloo or MPI controller, whichever runs).

    Args:
        process_set: the Horovod process set to run in (default: all ranks).
    """

    def __init__(self, process_set: Any = None) -> None:
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.rank = self.process_set.rank()
        self.size = self.process_set.size()

    def allreduce_async(self, arr: np.ndarray, name: str, op: str = "sum") -> Handle:
        t = torch.from_numpy(np.ascontiguousarray(arr))
        return _TorchHandle(hvd.allreduce_async(t, name=name, op=_OPS[op],
                                                process_set=self.process_set))

    def allgather_async(self, arr: np.ndarray, name: str) -> Handle:
        t = torch.from_numpy(np.ascontiguousarray(arr))
        return _TorchHandle(hvd.allgather_async(t, name=name, process_set=self.process_set))

    def alltoall_async(self, arr: np.ndarray, splits: list[int], name: str) -> Handle:
        t = torch.from_numpy(np.ascontiguousarray(arr))
        handle = hvd.alltoall_async(t, splits=torch.tensor(splits, dtype=torch.int32), name=name,
                                    process_set=self.process_set)
        return _TorchHandle(handle, lambda out: (out[0].numpy(), out[1].tolist()))

    def mpi_communicator(self) -> Any | None:
        if self.process_set is not hvd.global_process_set:
            return None
        return world_communicator(hvd)

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        # hvd.allgather_object has no process_set argument; the same two allgathers with one
        data = np.frombuffer(bytearray(pickle.dumps(obj)), np.uint8)
        sizes = self.allgather_async(np.array([data.size], np.int64), name + ".size").wait()
        blob = self.allgather_async(data, name + ".data").wait()
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        return [pickle.loads(blob[bounds[r]:bounds[r + 1]].tobytes()) for r in range(self.size)]
