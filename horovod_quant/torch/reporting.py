"""Reports for PyTorch training: :class:`StatsLogger` with Horovod's rank filled in."""
from __future__ import annotations

import logging

import horovod.torch as hvd

from .. import stats


class StatsLogger(stats.StatsLogger):
    """:class:`horovod_quant.stats.StatsLogger` on Horovod's rank: one ``logging`` line of
    bytes sent/saved and encode/exchange/decode time every ``every`` steps and per epoch, on
    rank ``log_rank``.

    Args:
        every: log every this many steps (0: only at ``epoch_end``).
        log_rank: the rank that logs.
        logger: default ``logging.getLogger("horovod_quant")`` (INFO).

    Example::

        log = hqt.StatsLogger(every=100)
        opt = hqt.DistributedOptimizer(opt, model.named_parameters(), compression=...,
                                    on_step=log)
        # or, with hvd.DistributedOptimizer(compression=comp): log.step(comp) after opt.step()
    """

    def __init__(self, every: int = 100, log_rank: int = 0,
                 logger: logging.Logger | None = None) -> None:
        super().__init__(every, hvd.rank, log_rank, logger)
