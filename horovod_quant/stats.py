"""Per-step communication statistics a user can read, and a logger that reports them.

Nothing is printed by default: ``str(stats)`` is one human line, and :class:`StatsLogger` logs
one every N steps (and at epoch ends) on one rank through the standard ``logging`` module.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

_MB = 1e6


@dataclass
class StepStats:
    """Totals over the exchanges of one step (or since the last :meth:`reset`).

    Attributes:
        bytes_sent: bytes this rank handed to collectives (payloads, length frames, norms,
            and uncompressed tensors), except those to the ranks of its own host in a
            hierarchical exchange.
        bytes_local: bytes this rank handed to the ranks of its own host (a hierarchical
            exchange's float32 shards: they never cross the network between hosts).
        bytes_raw: bytes the same tensors take in float32.
        encode_s, exchange_s, decode_s: seconds spent encoding, waiting for collectives, and
            decoding/aggregating on this rank.
        tensors: tensors (or fused buckets) exchanged.
        plans: how many exchange pieces took each plan (``"allgather"``, ``"sra"``, ``"sum"``,
            ``"custom"``, ``"hierarchical-<one of those>"``).
        baseline: the uncompressed allreduce the fallback compares the codecs with and moves
            buckets to, and its plan (``"fp16 (Horovod ring allreduce)"``); empty before the
            trial chose it, and without a fallback.
        fallen_back: buckets the baseline carried (the fallback's, and the step check's).
    """

    bytes_sent: int = 0
    bytes_local: int = 0
    bytes_raw: int = 0
    encode_s: float = 0.0
    exchange_s: float = 0.0
    decode_s: float = 0.0
    tensors: int = 0
    plans: dict = field(default_factory=dict)
    baseline: str = ""
    fallen_back: int = 0

    @property
    def compression_ratio(self) -> float:
        """float32 bytes over bytes sent (inf when nothing was sent)."""
        return self.bytes_raw / self.bytes_sent if self.bytes_sent else float("inf")

    def add(self, exchange_stats) -> None:
        """Add one exchange's :class:`~horovod_quant.exchange.ExchangeStats`."""
        self.bytes_sent += exchange_stats.bytes_sent
        self.bytes_local += exchange_stats.bytes_local
        self.bytes_raw += exchange_stats.bytes_raw
        for kind, count in exchange_stats.plans.items():
            self.plans[kind] = self.plans.get(kind, 0) + count
        self.encode_s += exchange_stats.encode_s
        self.exchange_s += exchange_stats.exchange_s
        self.decode_s += exchange_stats.decode_s
        self.tensors += 1

    def __str__(self) -> str:
        """One line: ``sent 12.1 MB of 48.2 MB (3.98x, 36.1 MB saved) in 12 tensors; encode
        4.1 ms, exchange 30.2 ms, decode 2.0 ms``."""
        saved = self.bytes_raw - self.bytes_sent
        plans = ", ".join(f"{k} x{v}" for k, v in sorted(self.plans.items()))
        return (f"sent {self.bytes_sent / _MB:.1f} MB of {self.bytes_raw / _MB:.1f} MB "
                f"({self.compression_ratio:.2f}x, {saved / _MB:.1f} MB saved) in {self.tensors} "
                f"tensors; encode {self.encode_s * 1e3:.1f} ms, exchange "
                f"{self.exchange_s * 1e3:.1f} ms, decode {self.decode_s * 1e3:.1f} ms"
                + (f"; {self.bytes_local / _MB:.1f} MB inside the host" if self.bytes_local
                   else "") + (f"; plans: {plans}" if plans else "")
                + (f"; baseline {self.baseline}, {self.fallen_back} buckets on it"
                   if self.baseline else ""))

    def __iadd__(self, other: "StepStats") -> "StepStats":
        for k in self.__dataclass_fields__:
            if k not in ("plans", "baseline"):
                setattr(self, k, getattr(self, k) + getattr(other, k))
        self.baseline = other.baseline or self.baseline
        for kind, count in other.plans.items():
            self.plans[kind] = self.plans.get(kind, 0) + count
        return self

    def add_raw(self, nbytes: int, raw: int | None = None) -> None:
        """Count a tensor that Horovod's own allreduce carried: ``nbytes`` sent, ``raw`` its
        float32 size (default ``nbytes``: uncompressed)."""
        self.bytes_sent += nbytes
        self.bytes_raw += nbytes if raw is None else raw
        self.tensors += 1

    def reset(self) -> "StepStats":
        """Return a copy of the totals and zero them."""
        snapshot = StepStats(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        for k, f in self.__dataclass_fields__.items():
            setattr(self, k, {} if k == "plans" else f.default)
        return snapshot


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
