""":class:`Collectives` over ``horovod.torch``: arrays in and out, zero-copy.

NumPy arrays travel as CPU tensors. CuPy arrays (payloads of CUDA gradients) travel as CUDA
tensors through DLPack when Horovod's collectives take device buffers, else through
:class:`~horovod_quant.exchange.staging.HostStaged`
(:func:`horovod_quant.torch.transport.transport_collectives` decides).
"""
from __future__ import annotations

import time
from typing import Any

import horovod.torch as hvd
import torch

from .. import gpu
from ..exchange.collectives import Handle, growing_pauses
from ..process_sets import ProcessSetCollectives, world_communicator
from .tensors import as_array, as_tensor

_OPS = {"sum": hvd.Sum, "max": hvd.Max}
_LONGEST_PAUSE_S = 1e-4


def wait_until_done(handle: Any) -> None:
    """Return once Horovod's collective ``handle`` is done, polling without spinning.

    Horovod's own wait calls ``sched_yield`` in a loop; where a host's ranks outnumber its
    cores, those loops take the cores that the other ranks' codecs and Horovod's background
    threads need (docs/dev/benchmarks.md measures both waits). The pauses between polls grow
    to ``_LONGEST_PAUSE_S`` requested (the kernel's timer slack adds about 0.05 ms), which
    bounds the latency this adds. The handle stays Horovod's: ``hvd.synchronize`` takes its
    result (a handle Horovod no longer knows returns at once, for that call to report).

    Args:
        handle: a handle of one of Horovod's ``*_async`` collectives.
    """
    pauses = growing_pauses(1e-5, _LONGEST_PAUSE_S)
    try:
        while not hvd.poll(handle):
            time.sleep(next(pauses))
    except ValueError:  # an unknown or cleared handle: Horovod's own wait says what it is
        pass


def synchronize(handle: Any) -> Any:
    """``hvd.synchronize(handle)``, entered once the collective is done
    (:func:`wait_until_done`).

    Args:
        handle: a handle of one of Horovod's ``*_async`` collectives.

    Returns:
        what ``hvd.synchronize`` returns: it raises Horovod's error of a failed collective, and
        answers for a handle Horovod no longer knows (``hvd.poll`` would raise ValueError).
    """
    wait_until_done(handle)
    return hvd.synchronize(handle)


class _TorchHandle(Handle):
    def __init__(self, handle: Any, post=None) -> None:
        self._handle = handle
        self._post = post

    def wait(self) -> Any:
        out = synchronize(self._handle)
        return self._post(out) if self._post else as_array(out)

    def done(self) -> bool:
        return hvd.poll(self._handle)


class HorovodTorchCollectives(ProcessSetCollectives):
    """Horovod's torch collectives (gloo or MPI controller, whichever runs) on NumPy arrays,
    and on CuPy arrays where Horovod has GPU operations.

    Args:
        process_set: the Horovod process set to run in (default: all ranks).
        environment: the door's environment: ``mpi_exchange``, whether a codec's custom
            reduction may run over MPI (the global process set under an MPI controller only);
            ``device_collectives`` and ``cuda_aware_mpi``, whether Horovod takes CUDA tensors.
    """

    @property
    def moves_device_arrays(self) -> bool:
        """Whether Horovod's collectives take CUDA tensors
        (:func:`horovod_quant.gpu.horovod_device_collectives`, the door's settings first)."""
        return gpu.horovod_device_collectives(hvd, self.environment.device_collectives,
                                              self.environment.cuda_aware_mpi)[0]

    def allreduce_async(self, arr: Any, name: str, op: str = "sum") -> Handle:
        return _TorchHandle(hvd.allreduce_async(as_tensor(arr), name=name, op=_OPS[op],
                                                process_set=self.process_set))

    def allgather_async(self, arr: Any, name: str) -> Handle:
        return _TorchHandle(hvd.allgather_async(as_tensor(arr), name=name,
                                                process_set=self.process_set))

    def alltoall_async(self, arr: Any, splits: list[int], name: str) -> Handle:
        handle = hvd.alltoall_async(as_tensor(arr), splits=torch.tensor(splits, dtype=torch.int32),
                                    name=name, process_set=self.process_set)
        return _TorchHandle(handle, lambda out: (as_array(out[0]), out[1].tolist()))

    def mpi_communicator(self) -> Any | None:
        if self.process_set is not hvd.global_process_set:
            return None
        return world_communicator(hvd, self.environment.mpi_exchange)

