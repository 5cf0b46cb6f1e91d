"""The cross-rank configuration check every door runs before its first exchange.

:class:`ConfigCheck` allgathers each rank's description of everything that changes what goes
on the wire (codec, seed, policy, layout, step) and raises the same error on every rank when
they differ, naming each rank's configuration (and the steps, where a checkpoint was loaded on
some ranks only). A rank that never joins makes the others raise after the door's timeout
instead of hanging (:func:`wait_for_peers`).
"""
from __future__ import annotations

import logging
import time
from typing import Any

from .collectives import Collectives, Handle, growing_pauses

log = logging.getLogger("horovod_quant")

#: default of ``HQ_CONFIG_TIMEOUT``: how long a rank waits for the others' configuration
CONFIG_TIMEOUT_S = 600.0


class _CheckNumbers:
    """The n-th check of a process in a group of ranks pairs with the n-th check of every other
    rank of the group: checks are numbered when they start (not when a compressor is built),
    so a compressor built on one rank only, and never used, shifts nothing. The number also
    names the checked object's collectives."""

    def __init__(self) -> None:
        self._started: dict[tuple[str, int], int] = {}

    def started(self, comm: Collectives) -> int:
        """How many checks this rank started in ``comm``'s group."""
        return self._started.get((comm.group_id, comm.rank), 0)

    def take(self, comm: Collectives) -> int:
        n = self.started(comm)
        self._started[comm.group_id, comm.rank] = n + 1
        return n


CHECKS = _CheckNumbers()


def wait_for_peers(handle: Handle, what: str, timeout: float = CONFIG_TIMEOUT_S) -> Any:
    """``handle.wait()``, giving up after ``timeout`` seconds (the doors pass
    ``HQ_CONFIG_TIMEOUT``'s, :class:`~horovod_quant.doors.DoorEnvironment`).

    A collective that only some ranks call never completes; Horovod then waits forever. This
    logs a warning once a tenth of the time has passed and raises RuntimeError at the end, so
    the job fails with a message saying what it was waiting for.
    """
    start, pauses, warned = time.monotonic(), growing_pauses(1e-4, 0.05), False
    while not handle.done():
        waited = time.monotonic() - start
        if waited > timeout:
            raise RuntimeError(
                f"horovod_quant: waited {waited:.0f} s for {what}; some rank is not running the "
                "same horovod_quant compressor or optimizer at this point (a different "
                "compression= such as hvd.Compression.none, or a different number of "
                "horovod_quant compressors/optimizers). HQ_CONFIG_TIMEOUT sets how long to wait.")
        if not warned and waited > timeout / 10:
            log.warning("horovod_quant: still waiting for %s after %.0f s", what, waited)
            warned = True
        time.sleep(next(pauses))
    return handle.wait()


class ConfigCheck:
    """One cross-rank agreement check: every rank's ``config`` from one allgather of JSON.

    Started without blocking; :meth:`wait` raises the same ValueError on every rank when the
    configurations differ (every rank sees all of them), or RuntimeError when a rank never
    joins (:func:`wait_for_peers`).

    Args:
        comm: the collectives of the group.
        config: JSON-serializable description of everything that must agree.
        timeout: seconds :meth:`wait` waits for a rank that does not join
            (:func:`wait_for_peers`).

    Attributes:
        prefix: ``hq.<group>.<n>`` for the n-th check in the group, the same on every rank;
            the prefix of the checked object's collective names.
    """

    def __init__(self, comm: Collectives, config: dict,
                 timeout: float = CONFIG_TIMEOUT_S) -> None:
        self.prefix = f"hq.{comm.group_id}.{CHECKS.take(comm)}"
        self._handle = (comm.allgather_object_async(config, f"{self.prefix}.config")
                        if comm.size > 1 else None)
        self._done = comm.size == 1
        self._error: ValueError | None = None
        self._timeout = timeout

    def wait(self) -> str:
        """Block until every rank's configuration is here; returns :attr:`prefix`. A mismatch
        raises again at every later call."""
        if not self._done:
            configs = wait_for_peers(self._handle, f"every rank's configuration "
                                                   f"(collective {self.prefix}.config)",
                                     self._timeout)
            self._done = True
            if any(c != configs[0] for c in configs):
                lines = "\n".join(f"  rank {r}: {c}" for r, c in enumerate(configs))
                self._error = ValueError(
                    f"horovod_quant configuration differs between ranks; {_steps_at_odds(configs)}"
                    "every rank must build the same codec, parameters, seed, policy and "
                    f"layout:\n{lines}")
        if self._error is not None:
            raise self._error
        return self.prefix


def _steps_at_odds(configs: list[dict]) -> str:
    """The sentence naming each rank's ``"step"`` where they differ (a checkpoint loaded on
    some ranks only), else ""."""
    steps = [c.get("step") if isinstance(c, dict) else None for c in configs]
    if all(s == steps[0] for s in steps):
        return ""
    ranks = ", ".join(f"rank {r} is at step {s}" for r, s in enumerate(steps))
    return (f"{ranks}: load the checkpoint on every rank, or broadcast the optimizer state from "
            "the rank that loaded it (horovod_quant.torch.broadcast_state beside Horovod's "
            "broadcasts); ")
