"""Per-step communication statistics a user can read, and a logger that reports them.

Nothing is printed by default: ``str(stats)`` is one human line, and :class:`StatsLogger` logs
one every N steps (and at epoch ends) on one rank through the standard ``logging`` module.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable

from .exchange.step_stats import StepStats

__all__ = ["StatsLogger", "StepStats", "progress_bar"]


class StatsLogger:
    """Logs the communication statistics of a training run: every ``every`` steps and at the end
    of each epoch, one line of the totals since the last line, on one rank.

    Use it as ``on_step=`` of ``hq.torch.DistributedOptimizer``; with a compressor in Horovod's
    own optimizer call ``logger.step(compressor)`` after each ``optimizer.step()`` (it takes the
    compressor's totals and resets them). The Keras door has
    :class:`horovod_quant.tensorflow.StatsCallback`.

    Args:
        every: log every this many steps (0: only at :meth:`epoch_end`).
        rank: this process's rank, or a function returning it (only ``log_rank`` logs).
        log_rank: the rank that logs (default 0).
        logger: where lines go (default ``logging.getLogger("horovod_quant")``, level INFO).

    Example::

        logging.basicConfig(level=logging.INFO)
        log = StatsLogger(every=100, rank=hvd.rank)
        opt = hq.DistributedOptimizer(opt, model.named_parameters(), compression=..., on_step=log)
        ...  # at the end of each epoch:
        log.epoch_end(epoch)
    """

    def __init__(self, every: int = 100, rank: int | Callable[[], int] = 0, log_rank: int = 0,
                 logger: logging.Logger | None = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"every={every!r} must be an integer >= 0")
        self.every = every
        self._rank = rank
        self.log_rank = log_rank
        self.logger = logger if logger is not None else logging.getLogger("horovod_quant")
        self.steps = 0
        self.window = StepStats()
        self._window_steps = 0

    def __call__(self, stats: StepStats, steps: int = 1) -> None:
        """Add the statistics of ``steps`` steps; log when ``every`` steps have gathered."""
        before = self.steps
        self.steps += steps
        self._window_steps += steps
        self.window += stats
        if self.every and self.steps // self.every > before // self.every:
            self._log(f"step {self.steps}")

    def step(self, source: Any) -> None:
        """Add the step of ``source``: a compressor (its ``stats``, reset here), an optimizer
        (its ``last_stats``) or a :class:`StepStats`."""
        if isinstance(source, StepStats):
            self(source)
        elif getattr(source, "last_stats", None) is not None:
            self(source.last_stats)
        else:
            self(source.stats.reset())

    def epoch_end(self, epoch: int) -> None:
        """Log what gathered since the last line (nothing when no step did)."""
        if self._window_steps:
            self._log(f"epoch {epoch}")

    def _log(self, when: str) -> None:
        rank = self._rank() if callable(self._rank) else self._rank
        if rank == self.log_rank:
            self.logger.info("horovod_quant %s (%d steps): %s", when, self._window_steps,
                             self.window)
        self.window, self._window_steps = StepStats(), 0


def progress_bar(total: int, rank: int, show: bool | None = None, unit: str = "step") -> Any:
    """A tqdm progress bar drawn by rank 0 only (the other ranks get a disabled one).

    Args:
        total: steps to come.
        rank: this process's rank.
        show: None: only when stderr is a terminal (under ``horovodrun``/``mpirun`` it is a
            pipe); True / False: always / never. Off a terminal it redraws at most every 10 s,
            so a log gets a few lines, not one per step.
        unit: what a step is called.
    """
    tty = sys.stderr.isatty()
    disable = True if rank != 0 else (None if show is None else not show)
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is in the dev extra only: a missing bar must not stop training
        if disable is not True and (show or tty):
            logging.getLogger("horovod_quant").warning(
                "no progress bar: tqdm is not installed (pip install tqdm)")
        return _NoBar()
    return tqdm(total=total, unit=unit, disable=disable, dynamic_ncols=tty,
                mininterval=0.5 if tty else 10.0)


class _NoBar:
    """Stands in for a tqdm bar where tqdm is missing: every method does nothing."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None
