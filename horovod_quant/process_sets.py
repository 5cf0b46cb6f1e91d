"""What the Horovod doors (PyTorch and TensorFlow) share about Horovod: the ranks of a process
set as the base of their :class:`~horovod_quant.exchange.Collectives`, and the MPI
communicator beside Horovod that Global-QSGD's exponent allreduce runs on
(:mod:`horovod_quant.exchange.mpi_exponent_allreduce`), handed out only where the door's
``HQ_MPI_EXCHANGE`` lets it. The door's environment (``doors.DoorEnvironment``) is passed in:
also whether MPI and Horovod take CUDA buffers (``HQ_CUDA_AWARE_MPI``,
``HQ_DEVICE_COLLECTIVES``, else detected by :mod:`horovod_quant.gpu`).

The exchange layer never imports Horovod; only the doors do, through this module and their own
collectives.
"""
from __future__ import annotations

from typing import Any

from . import gpu
from .doors import DoorEnvironment
from .exchange.collectives import Collectives


def world_communicator(horovod_module: Any, mpi_exchange: bool = True) -> Any | None:
    """A duplicate of MPI.COMM_WORLD when the custom MPI reduction may run, else None.

    Args:
        horovod_module: ``horovod.torch`` or ``horovod.tensorflow`` (already initialized).
        mpi_exchange: the door's ``HQ_MPI_EXCHANGE`` (``doors.DoorEnvironment``): False
            decides None before Horovod is asked.
    """
    if not mpi_exchange:
        return None
    if not (horovod_module.mpi_enabled() and horovod_module.mpi_threads_supported()):
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return None
    world = MPI.COMM_WORLD
    if world.Get_size() != horovod_module.size() or world.Get_rank() != horovod_module.rank():
        return None
    return world.Dup()


class ProcessSetCollectives(Collectives):
    """Base of the Horovod doors' collectives: the ranks of a Horovod process set.

    Args:
        process_set: the Horovod process set to run in (default: all ranks).
        environment: the door's environment (default: every variable unset): its
            ``mpi_exchange`` says whether :meth:`mpi_communicator` may hand out MPI for a
            codec's custom reduction, its ``cuda_aware_mpi`` whether that MPI takes CUDA
            buffers.
    """

    def __init__(self, process_set: Any = None,
                 environment: DoorEnvironment = DoorEnvironment()) -> None:
        if process_set is None:
            from horovod.common.process_sets import global_process_set

            process_set = global_process_set
        self.process_set = process_set
        self.rank = process_set.rank()
        self.size = process_set.size()
        self.group_id = str(process_set.process_set_id)
        self.environment = environment

    @property
    def mpi_moves_device_arrays(self) -> bool:
        """Whether the MPI of :meth:`mpi_communicator` takes CUDA buffers
        (:func:`horovod_quant.gpu.cuda_aware_mpi`, the door's ``HQ_CUDA_AWARE_MPI`` first)."""
        return bool(gpu.cuda_aware_mpi(override=self.environment.cuda_aware_mpi))
