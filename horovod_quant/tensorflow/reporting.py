"""Reports for TensorFlow training: a Keras callback that logs a compressor's statistics."""
from __future__ import annotations

import logging
from typing import Any

import horovod.tensorflow as hvd
import tensorflow as tf

from .. import stats


class StatsCallback(tf.keras.callbacks.Callback):
    """Logs ``compressor``'s statistics (bytes sent/saved, encode/exchange/decode time) through
    ``logging`` every ``every`` batches and at each epoch's end, on rank ``log_rank``
    (:class:`horovod_quant.stats.StatsLogger`). Between lines a batch costs one counter
    increment; a line takes (and resets) the compressor's totals.

    Args:
        compressor: the ``hqtf.Compression.<name>(...)`` object given to Horovod's optimizer.
        every: log every this many batches (0: only per epoch).
        log_rank: the rank that logs.
        logger: default ``logging.getLogger("horovod_quant")`` (INFO).

    Example::

        comp = hqtf.Compression.qsgd(bits=8)
        opt = hvd.DistributedOptimizer(opt, compression=comp)
        model.fit(..., callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                  hqtf.StatsCallback(comp, every=100)])
    """

    def __init__(self, compressor: Any, every: int = 100, log_rank: int = 0,
                 logger: logging.Logger | None = None) -> None:
        super().__init__()
        self.compressor = compressor
        self.stats_logger = stats.StatsLogger(every, hvd.rank, log_rank, logger)
        self._batches = 0  # since the compressor's totals were last taken

    def _take(self) -> None:
        if self._batches:
            self.stats_logger(self.compressor.stats.reset(), self._batches)
            self._batches = 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._batches += 1
        every = self.stats_logger.every
        if every and (self.stats_logger.steps + self._batches) % every == 0:
            self._take()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._take()
        self.stats_logger.epoch_end(epoch)
