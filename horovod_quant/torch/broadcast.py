"""``broadcast_state``: the package's own state from one rank to all, beside Horovod's broadcasts.

Horovod resumes a job by loading the checkpoint on one rank and broadcasting from it
(``hvd.broadcast_parameters``, ``hvd.broadcast_optimizer_state``). ``hq.torch.DistributedOptimizer``
keeps its own state where ``broadcast_optimizer_state`` carries it (its first parameter group),
except for an optimizer whose torch state stays empty (plain SGD), where Horovod broadcasts
nothing; a ``compression=`` compressor's state lies outside Horovod's optimizer altogether.
:func:`broadcast_state` carries either, as JSON (nothing read from a peer is unpickled).
"""
from __future__ import annotations

from typing import Any

from ..doors import config_timeout
from ..exchange.check import wait_for_peers
from .collectives import HorovodTorchCollectives
from .compression import QuantizedCompressor


def broadcast_state(obj: Any, root_rank: int = 0, process_set: Any = None) -> None:
    """Give every rank ``root_rank``'s state of ``obj``, the package's part of a job's state.
    Call it on every rank, beside ``hvd.broadcast_parameters`` and
    ``hvd.broadcast_optimizer_state``, after ``root_rank`` loaded the checkpoint.

    Args:
        obj: an ``hq.torch.DistributedOptimizer`` (its step, codec states and fallback
            decisions), a ``QuantizedCompressor``, or Horovod's ``DistributedOptimizer``
            built with one (``compression=``: the compressor's use counters and codec states;
            before its first step).
        root_rank: the rank whose state the others take.
        process_set: the Horovod process set of the ranks (None: the one ``obj`` was built
            with).

    Raises:
        ValueError: ``obj`` holds no horovod_quant state.
    """
    compressor = getattr(obj, "_compression", obj)  # Horovod's optimizer keeps it there
    if hasattr(obj, "own_state"):
        state, load = obj.own_state(), obj.load_own_state
    elif isinstance(compressor, QuantizedCompressor):
        state, load = compressor.state_dict(), compressor.load_state_dict
    else:
        raise ValueError(f"{type(obj).__name__} holds no horovod_quant state: pass an "
                         "hq.torch.DistributedOptimizer, a horovod_quant compressor, or "
                         "Horovod's DistributedOptimizer built with compression= one")
    comm = HorovodTorchCollectives(process_set if process_set is not None
                                   else getattr(compressor, "process_set", None))
    if comm.size == 1:
        return
    mine = state if comm.rank == root_rank else None
    gathered = wait_for_peers(comm.allgather_object_async(mine, "hq.broadcast_state"),
                              "every rank's call of horovod_quant.torch.broadcast_state",
                              config_timeout())
    if comm.rank != root_rank:
        load(gathered[root_rank])
