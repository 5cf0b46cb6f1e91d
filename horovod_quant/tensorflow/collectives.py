""":class:`Collectives` over ``horovod.tensorflow``, run eagerly (NumPy arrays in and out).

The compressor's exchanges run as graph ops (see :mod:`.compression`); this eager form serves
the one-time cross-rank configuration check, which runs under ``tf.init_scope()`` even while a
``tf.function`` is being traced.
"""
from __future__ import annotations

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from ..comm.backend import Done, Handle, ProcessSetCollectives

_OPS = {"sum": hvd.Sum, "max": hvd.Max}


class HorovodTFCollectives(ProcessSetCollectives):
    """Horovod's TensorFlow collectives, executed eagerly on CPU (results are ready on return).

    Args:
        process_set: the Horovod process set to run in (default: all ranks).
    """

    def allreduce_async(self, arr: np.ndarray, name: str, op: str = "sum") -> Handle:
        with tf.init_scope(), tf.device("/cpu:0"):
            out = hvd.allreduce(tf.constant(np.ascontiguousarray(arr)), op=_OPS[op], name=name,
                                process_set=self.process_set)
            return Done(out.numpy())

    def allgather_async(self, arr: np.ndarray, name: str) -> Handle:
        with tf.init_scope(), tf.device("/cpu:0"):
            out = hvd.allgather(tf.constant(np.ascontiguousarray(arr)), name=name,
                                process_set=self.process_set)
            return Done(out.numpy())

    def alltoall_async(self, arr: np.ndarray, splits: list[int], name: str) -> Handle:
        with tf.init_scope(), tf.device("/cpu:0"):
            out, received = hvd.alltoall(tf.constant(np.ascontiguousarray(arr)),
                                         splits=tf.constant(splits, tf.int32), name=name,
                                         process_set=self.process_set)
            return Done((out.numpy(), received.numpy().tolist()))
