""":class:`Collectives` over ``horovod.tensorflow``, called from Python with NumPy arrays.

The compressor's exchanges run as graph ops (see :mod:`.compression`); these serve the
one-time cross-rank configuration check, which the compressor starts and waits for while a
``tf.function`` is being traced, and give a custom collective (the mpi4py exponent
allreduce) its MPI communicator.

Each collective runs on its own daemon thread, so the caller can stop waiting: a Horovod op
that a peer never joins blocks its thread forever, and
:func:`~horovod_quant.exchange.check.wait_for_peers` gives up after ``HQ_CONFIG_TIMEOUT`` seconds by
polling :meth:`Handle.done` instead of blocking in it. A thread left behind that way is a
daemon: it does not keep the process alive, and it finishes if the peer joins later.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from ..exchange.collectives import Handle, Then
from ..process_sets import ProcessSetCollectives, world_communicator

_OPS = {"sum": hvd.Sum, "max": hvd.Max}


class ThreadHandle(Handle):
    """``fn()`` running on a daemon thread; :meth:`done` says whether it has returned."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self._finished = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, args=(fn,), name=f"hq-tf {name}",
                         daemon=True).start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._result = fn()
        except BaseException as exc:  # noqa: BLE001 (handed to wait(), on the caller's thread)
            self._error = exc
        finally:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self) -> Any:
        self._finished.wait()
        if self._error is not None:
            raise self._error
        return self._result


class HorovodTFCollectives(ProcessSetCollectives):
    """Horovod's TensorFlow collectives on the CPU, each on its own thread (module doc) and
    named: every call runs its op in a small ``tf.function`` of its own, because Horovod gives
    an eagerly executed op the op type's name whatever ``name=`` says (two eager allgathers
    in flight at once collide, and ranks would pair them by order, not by name); ``wait()``
    returns NumPy arrays.

    Args:
        process_set: the Horovod process set to run in (default: all ranks).
        environment: the door's environment: its ``mpi_exchange`` says whether a codec's
            custom reduction may run over MPI (the global process set under an MPI controller
            only).
    """

    def _named(self, name: str, op: Callable[..., Any], *arrays: np.ndarray) -> Handle:
        def run() -> Any:
            with tf.device("/cpu:0"):
                inputs = [tf.constant(np.ascontiguousarray(a)) for a in arrays]
                out = tf.function(op, autograph=False)(*inputs)
            return tf.nest.map_structure(lambda t: t.numpy(), out)
        return ThreadHandle(run, name)

    def allreduce_async(self, arr: np.ndarray, name: str, op: str = "sum") -> Handle:
        return self._named(name, lambda t: hvd.allreduce(
            t, op=_OPS[op], name=name, process_set=self.process_set), arr)

    def allgather_async(self, arr: np.ndarray, name: str) -> Handle:
        return self._named(name, lambda t: hvd.allgather(
            t, name=name, process_set=self.process_set), arr)

    def alltoall_async(self, arr: np.ndarray, splits: list[int], name: str) -> Handle:
        handle = self._named(name, lambda t, s: hvd.alltoall(
            t, splits=s, name=name, process_set=self.process_set),
            arr, np.asarray(splits, np.int32))
        return Then(handle, lambda out: (out[0], out[1].tolist()))

    def mpi_communicator(self) -> Any | None:
        if self.process_set is not hvd.global_process_set:
            return None
        return world_communicator(hvd, self.environment.mpi_exchange)
