"""What the Horovod doors (PyTorch and TensorFlow) share about Horovod: the ranks of a process
set as the base of their :class:`~horovod_quant.exchange.Collectives`, and the MPI
communicator beside Horovod that Global-QSGD's exponent allreduce runs on
(:mod:`horovod_quant.exchange.mpi_exponent_allreduce`), handed out only where the door's
``HQ_MPI_EXCHANGE`` (``doors.DoorEnvironment``, passed in as ``mpi_exchange``) lets it.

The exchange layer never imports Horovod; only the doors do, through this module and their own
collectives.
"""
from __future__ import annotations

from typing import Any

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
        mpi_exchange: whether :meth:`mpi_communicator` may hand out MPI for a codec's custom
            reduction: the door's ``HQ_MPI_EXCHANGE`` (``doors.DoorEnvironment``; default on).
    """

    def __init__(self, process_set: Any = None, mpi_exchange: bool = True) -> None:
        if process_set is None:
            from horovod.common.process_sets import global_process_set

            process_set = global_process_set
        self.process_set = process_set
        self.rank = process_set.rank()
        self.size = process_set.size()
        self.group_id = str(process_set.process_set_id)
        self.mpi_exchange = mpi_exchange
