"""The end of a job: the ranks agree how many steps each door ran, so that a rank that runs a
step more than the others (an uneven data loader, a skipped batch) fails on every rank with the
same error, naming the ranks and their steps, instead of waiting for an exchange no other rank
starts while the others report success.

Every door registers a :class:`DoorSteps` (its completed steps, whether a step has begun) with
the process's :data:`LEDGER`, and a :class:`StoreRendezvous` over a store its ranks share. At
the interpreter's exit (before Horovod and torch.distributed shut down) each rank announces its
doors' steps there and waits for every rank's announcement. A rank still inside a step sees the
announcement where it waits (:func:`wait` polls; a door's error path asks
:meth:`Ledger.explain`, e.g. after the peer's Horovod shut down; an error raised inside
Horovod's own wait is explained at this rank's exit), announces and raises
:class:`~.wire.OutOfStep`; the ranks at exit exit with status 1. Every rank prints the message
before any rank may end (a launcher stops the job at its first failed rank). A
rank stuck where nothing polls (a wait inside Horovod that its peer's shut-down did not end) is
ended by the ledger's watch thread :data:`STUCK_AFTER_S` after the announcement, with the same
message. Ranks that agree pay a few store round trips at exit.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .collectives import Handle, growing_pauses
from .wire import OutOfStep

log = logging.getLogger("horovod_quant")

#: seconds a wait lasts before it looks at the alarms, then between looks
LOOK_EVERY_S = 0.5
#: seconds an announcement waits for every rank's (a rank busy elsewhere, e.g. evaluating, is
#: waited for this long; then the job ends without an agreement, as it would without this)
ANNOUNCE_TIMEOUT_S = 120.0
#: seconds a rank stays inside a step after a peer announced the end of its job before the
#: watch thread announces for it, prints the agreement and ends the process with status 1
STUCK_AFTER_S = 10.0


@dataclass
class DoorSteps:
    """A door's completed steps, as the door updates them (the ledger keeps no door alive, so
    the doors' entries stay in every rank's ledger, in the order the doors were built)."""

    door: str
    steps: int = 0
    begun: bool = False  # a step has begun and not ended (its exchanges may wait for peers)
    failed: bool = False  # the door stopped at an error (every rank's record says so alike)

    def begin(self) -> None:
        """A step begins (its first exchange)."""
        self.begun = True

    def end(self, steps: int) -> None:
        """A step ended: ``steps`` steps are complete."""
        self.steps, self.begun = steps, False


class StoreRendezvous:
    """The ranks' announcements in a key-value store they share (torch's ``TCPStore``, or the
    pure-Python one of ``horovod_quant.store``): each rank sets its record and counts itself
    in (the count is the alarm a waiting rank looks at); every rank waits for the count, reads
    the records, and counts itself out (the store's host waits for that before its process
    ends).

    Args:
        store: the store (``set``, ``get``, ``add``, ``check``).
        rank, size: this rank and the number of ranks (of the doors' group).
        prefix: the keys' prefix (one per group).
        unblock: called once the rank announced (Horovod's ``shutdown``, as at any exit: a peer
            blocked inside Horovod's own collectives, where nothing of this package polls,
            gets an error and agrees at its exit), or None.
    """

    def __init__(self, store: Any, rank: int, size: int, prefix: str,
                 unblock: Callable[[], Any] | None = None) -> None:
        self._store, self.rank, self.size, self._prefix = store, rank, size, prefix
        self._unblock = unblock

    def rang(self) -> bool:
        """Whether a rank has announced (false where the store is gone: its host ended)."""
        try:
            return bool(self._store.check([f"{self._prefix}/in"]))
        except Exception:  # noqa: BLE001 - the store's host has ended: nothing to agree with
            return False

    def _count(self, what: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        pauses = growing_pauses(1e-3, 0.05)
        while self._store.add(f"{self._prefix}/{what}", 0) < self.size:
            if time.monotonic() > deadline:
                return False
            time.sleep(next(pauses))
        return True

    def announce(self, record: dict, agreed: Callable[[list[dict]], Any] | None = None
                 ) -> list[dict] | None:
        """This rank's record to every rank; every rank's records (rank order), or None when
        some rank did not announce within :data:`ANNOUNCE_TIMEOUT_S`. ``agreed(records)`` runs
        before this rank counts itself out: no rank returns (and ends its process) before
        every rank has acted on the records, so a launcher that stops a job at its first
        failed rank cuts no rank's report short."""
        self._store.set(f"{self._prefix}/record{self.rank}", json.dumps(record))
        self._store.add(f"{self._prefix}/in", 1)
        if self._unblock is not None:
            _quietly(self._unblock)
        if not self._count("in", ANNOUNCE_TIMEOUT_S):
            return None
        records = [json.loads(self._store.get(f"{self._prefix}/record{r}"))
                   for r in range(self.size)]
        if agreed is not None:
            agreed(records)
        self._store.add(f"{self._prefix}/out", 1)
        try:
            self._count("out", 10.0)
        except Exception:  # noqa: BLE001 - the store's host ends once every rank counted out
            pass
        return records


def _quietly(call: Callable[[], Any]) -> None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the transport is gone already
        log.debug("horovod_quant: %s", exc)


_STOPPED = -1  # a door's steps in a record where the door stopped at an error


def _said(rank: int, steps: int, waiting: bool) -> str:
    if steps == _STOPPED:
        return f"rank {rank} stopped at an error"
    if waiting:
        return f"rank {rank} waits in an exchange of its step {steps} that no other rank started"
    return f"rank {rank} ended its job after {steps} steps"


def disagreement(records: list[dict]) -> str | None:
    """The message for the ranks' records when they disagree (a rank ended its job while
    another waits in an exchange, or the ranks ended a door at different steps), else None:
    where no rank ended a door (each stopped at an error or inside a step), their own errors
    tell. Every rank composes the same message."""
    doors = [r["doors"] for r in records]
    if any(len(d) != len(doors[0]) for d in doors):
        counts = ", ".join(f"rank {r} {len(d)}" for r, d in enumerate(doors))
        return f"the ranks built different numbers of horovod_quant doors ({counts})"
    for i in range(len(doors[0])):
        entries = [d[i] for d in doors]
        if all(e == entries[0] for e in entries) or all(
                steps == _STOPPED or waiting for _, steps, waiting in entries):
            continue  # ended alike, or no rank ended (each stopped or failed inside a step)
        said = ", ".join(_said(r, steps, waiting) for r, (_, steps, waiting) in enumerate(entries))
        return (f"the ranks ran different numbers of steps of the {entries[0][0]}: {said}. "
                "Run the same number of steps on every rank (e.g. a DistributedSampler with "
                "drop_last=True, or a step count every rank agrees on)")
    return None


class Ledger:
    """The process's doors, their rendezvous and alarms, and the agreement at exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._agreeing = threading.RLock()  # one announcement per process, whichever thread
        self.doors: list[DoorSteps] = []
        self.rendezvous: StoreRendezvous | None = None
        self.ended = False  # announced (at exit, while waiting, or by the watch thread)
        self._agreement: str | None = None  # the announcement's disagreement, once ended
        self._exit_hook = False

    def register(self, door: str, steps: int, rendezvous: StoreRendezvous | None) -> DoorSteps:
        """A door's entry, before its first exchange (after Horovod's or torch.distributed's
        start, so the exit hook runs before their shut-down). The first door's rendezvous
        serves every door of the process; without one (no store) the entry is not kept."""
        entry = DoorSteps(door, steps)
        if rendezvous is None:
            return entry
        with self._lock:
            self.doors.append(entry)
            self.rendezvous = self.rendezvous or rendezvous
            if not self._exit_hook:
                atexit.register(self.at_exit)
                threading.Thread(target=self._watch, name="horovod_quant-job-end",
                                 daemon=True).start()
                self._exit_hook = True
            return entry

    def _agree(self) -> str | None:
        """Announce the doors' steps (once per process) and return the ranks'
        disagreement, if any, which every rank prints before any rank may end."""
        with self._agreeing:
            if not self.ended:
                self.ended = True
                record = {"doors": [[d.door, _STOPPED, False] if d.failed
                                    else [d.door, d.steps, d.begun] for d in self.doors]}
                self.rendezvous.announce(record, self._agreed)
            return self._agreement

    def _agreed(self, records: list[dict]) -> None:
        self._agreement = disagreement(records)
        if self._agreement is not None:
            self._print(self._agreement)

    @staticmethod
    def _print(message: str) -> None:
        """The disagreement on this rank's standard error."""
        sys.stdout.flush()
        sys.stderr.write(f"{OutOfStep.__module__}.OutOfStep: horovod_quant: {message}\n")
        sys.stderr.flush()

    def _stuck(self) -> bool:
        """Whether a door is inside a step (not stopped at an error) while a peer has
        announced the end of its job."""
        return any(d.begun and not d.failed for d in self.doors) and self.rang()

    def _watch(self) -> None:
        """The watch thread: a rank inside a step :data:`STUCK_AFTER_S` after a peer
        announced waits where nothing of this package polls (Horovod's own wait, which the
        peer's shut-down normally ends): it announces for the rank, prints the agreement and
        ends the process with status 1. It looks at the store only while a step is begun."""
        since = None
        while not self.ended:
            time.sleep(LOOK_EVERY_S)
            try:
                stuck = self._stuck()  # (false once this rank announced)
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                return
            since = (since or time.monotonic()) if stuck else None
            if since is not None and time.monotonic() - since >= STUCK_AFTER_S:
                with self._agreeing:  # held to the end: the exit hook waits for it
                    if self._agree() is not None:  # (printed)
                        os._exit(1)
                return

    def rang(self) -> bool:
        """Whether a peer announced the end of its job (and this rank has not)."""
        return not self.ended and self.rendezvous is not None and self.rendezvous.rang()

    def explain(self) -> OutOfStep | None:
        """Once a peer announced the end of its job (a door's wait or error path asks): the
        agreement's error for this rank, or None where the ranks agree."""
        if not self.rang():
            return None
        message = self._agree()
        return None if message is None else OutOfStep(f"horovod_quant: {message}")

    def at_exit(self) -> None:
        """The agreement at exit: a disagreement is printed, and where nothing else failed the
        process exits with status 1. After an uncaught exception it agrees only where a peer
        announced first (this rank's error may be Horovod's, raised by its shut-down)."""
        crashed = getattr(sys, "last_value", None) is not None
        if self.ended:  # announced while waiting (raised), or by the watch thread (it ends
            with self._agreeing:  # the process itself, holding this lock)
                return
        if not self.doors or (crashed and not self.rang()):
            return
        try:
            message = self._agree()
        except Exception as exc:  # noqa: BLE001 - the job is ending anyway (a peer failed)
            log.debug("horovod_quant: no agreement at exit: %s", exc)
            return
        if message is not None and not crashed:  # (printed)
            os._exit(1)


#: the process's ledger
LEDGER = Ledger()


def wait(handle: Handle) -> Any:
    """``handle.wait()``, polling where the ledger has a rendezvous: every
    :data:`LOOK_EVERY_S` it looks whether a peer announced the end of its job, and raises the
    agreement's :class:`~.wire.OutOfStep` (:meth:`Ledger.explain`)."""
    if LEDGER.rendezvous is None or handle.done():
        return handle.wait()
    pauses = growing_pauses(1e-5, 1e-3)
    look_at = time.monotonic() + LOOK_EVERY_S
    while not handle.done():
        time.sleep(next(pauses))
        if time.monotonic() >= look_at:
            error = LEDGER.explain()
            if error is not None:
                raise error
            look_at = time.monotonic() + LOOK_EVERY_S
    return handle.wait()
