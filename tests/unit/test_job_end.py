"""The end-of-job agreement (horovod_quant.exchange.job_end) on ranks in threads sharing an
in-memory store: the records' messages, the announcement, a waiting rank's polled wait, the
doors' begun and ended steps. The real launches are tests/unit/test_uneven_steps.py."""
import threading
import time

import pytest

from horovod_quant.exchange import job_end
from horovod_quant.exchange.collectives import Handle
from horovod_quant.exchange.job_end import Ledger, StoreRendezvous, disagreement
from horovod_quant.exchange.wire import OutOfStep


class MemoryStore:
    """TCPStore's calls the rendezvous makes, on a dict shared by the threads."""

    def __init__(self) -> None:
        self._values: dict[str, object] = {}
        self._lock = threading.Lock()

    def set(self, key, value):
        with self._lock:
            self._values[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        with self._lock:
            return self._values[key]

    def add(self, key, amount):
        with self._lock:
            self._values[key] = int(self._values.get(key, 0)) + amount
            return self._values[key]

    def check(self, keys):
        with self._lock:
            return all(k in self._values for k in keys)


def _record(*doors):
    return {"doors": [list(d) for d in doors]}


def test_ranks_that_ended_alike_agree():
    assert disagreement([_record(["optimizer", 5, False])] * 3) is None
    # no rank ended the door (each failed inside a step, or stopped at an error): their own
    # errors tell, at whatever steps
    assert disagreement([_record(["optimizer", 5, True])] * 2) is None
    assert disagreement([_record(["TensorFlow compressor", 1, True]),
                         _record(["TensorFlow compressor", 0, True])]) is None
    assert disagreement([_record(["DDP hook", -1, False]),
                         _record(["DDP hook", 4, True])]) is None


def test_a_rank_waiting_in_a_step_is_named_with_the_ranks_that_ended():
    message = disagreement([_record(["optimizer", 5, True]), _record(["optimizer", 5, False]),
                            _record(["optimizer", 5, False])])
    assert message.startswith(
        "the ranks ran different numbers of steps of the optimizer: rank 0 waits in an exchange "
        "of its step 5 that no other rank started, rank 1 ended its job after 5 steps, rank 2 "
        "ended its job after 5 steps. Run the same number of steps on every rank")


def test_steps_that_differ_at_the_end_and_a_stopped_door_are_named():
    message = disagreement([_record(["DDP hook", 7, False]), _record(["DDP hook", 4, False])])
    assert "rank 0 ended its job after 7 steps, rank 1 ended its job after 4 steps" in message
    message = disagreement([_record(["compressor", -1, False]), _record(["compressor", 2, False])])
    assert "rank 0 stopped at an error, rank 1 ended its job after 2 steps" in message
    message = disagreement([_record(["optimizer", 1, False]), _record()])
    assert message == ("the ranks built different numbers of horovod_quant doors (rank 0 1, "
                       "rank 1 0)")


def _ledgers(size, store=None):
    store = store or MemoryStore()
    unblocked = []
    ledgers = []
    for rank in range(size):
        ledger = Ledger()
        ledger.register("optimizer", 0, StoreRendezvous(store, rank, size, "hq.end.t",
                                                       lambda r=rank: unblocked.append(r)))
        ledgers.append(ledger)
    return ledgers, unblocked


def _announce_in_threads(ledgers, action):
    results = [None] * len(ledgers)

    def run(r):
        results[r] = action(r, ledgers[r])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(ledgers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return results


def test_every_rank_announces_and_reads_the_same_records():
    ledgers, unblocked = _ledgers(3)
    for ledger in ledgers:
        ledger.doors[0].end(4)
    results = _announce_in_threads(ledgers, lambda r, ledger: ledger._agree())
    assert results == [None, None, None]
    assert sorted(unblocked) == [0, 1, 2]  # each rank let its transport go once announced
    assert all(ledger.ended for ledger in ledgers)


def test_a_rank_waiting_in_an_exchange_raises_what_the_ended_ranks_print(monkeypatch):
    """Rank 0's step 3 waits on a collective no other rank starts; rank 1 ends after 3 steps
    and announces: rank 0's polled wait raises the agreement's error, rank 1 gets the same
    message."""
    monkeypatch.setattr(job_end, "LOOK_EVERY_S", 0.05)
    ledgers, _ = _ledgers(2)
    ledgers[0].doors[0].end(3)
    ledgers[0].doors[0].begin()
    ledgers[1].doors[0].end(3)
    monkeypatch.setattr(job_end, "LEDGER", ledgers[0])

    class Never(Handle):
        def wait(self):
            raise AssertionError("waited on a collective that never completes")

        def done(self):
            return False

    def rank(r, ledger):
        if r == 0:
            with pytest.raises(OutOfStep) as raised:
                job_end.wait(Never())
            return str(raised.value)
        time.sleep(0.2)  # rank 0 is waiting by now
        return ledger._agree()

    waiting, ended = _announce_in_threads(ledgers, rank)
    assert waiting == f"horovod_quant: {ended}"
    assert "rank 0 waits in an exchange of its step 3" in ended
    assert "rank 1 ended its job after 3 steps" in ended


def test_a_wait_without_a_rendezvous_or_already_done_does_not_poll(monkeypatch):
    class Done(Handle):
        def wait(self):
            return "value"

        def done(self):
            raise AssertionError("polled")

    monkeypatch.setattr(job_end, "LEDGER", Ledger())
    assert job_end.wait(Done()) == "value"


def test_an_announcement_no_rank_answers_ends_without_an_agreement(monkeypatch):
    """A peer busy elsewhere for longer than the deadline: the rank exits as it would have."""
    monkeypatch.setattr(job_end, "ANNOUNCE_TIMEOUT_S", 0.1)
    ledgers, _ = _ledgers(2)
    assert ledgers[1]._agree() is None


def test_a_door_without_a_store_is_not_entered():
    ledger = Ledger()
    entry = ledger.register("optimizer", 2, None)
    entry.end(3)
    assert ledger.doors == [] and ledger.rendezvous is None and entry.steps == 3


def test_an_error_explained_only_once_a_peer_announced():
    """A door's error path (Horovod's collectives failed after the peer's shut-down): before
    any peer announced, the door's own error stands; after, the agreement's error replaces it."""
    ledgers, _ = _ledgers(2)
    assert ledgers[0].explain() is None and not ledgers[0].ended
    ledgers[0].doors[0].end(2)
    ledgers[0].doors[0].begin()
    ledgers[1].doors[0].end(2)
    peer = threading.Thread(target=ledgers[1]._agree)
    peer.start()
    deadline = time.monotonic() + 10
    while not ledgers[0].rang() and time.monotonic() < deadline:
        time.sleep(0.01)
    error = ledgers[0].explain()
    peer.join(10)
    assert isinstance(error, OutOfStep)
    assert "rank 0 waits in an exchange of its step 2 that no other rank started, rank 1 ended " \
           "its job after 2 steps" in str(error)
    assert ledgers[0].explain() is None  # announced once


_STUCK_RANK = """
import json, sys, time
sys.path.insert(0, {tests!r})
from test_job_end import MemoryStore
from horovod_quant.exchange import job_end
job_end.STUCK_AFTER_S, job_end.LOOK_EVERY_S = 1.0, 0.05
store = MemoryStore()
ledger = job_end.Ledger()
ledger.register("compressor", 3, job_end.StoreRendezvous(store, 0, 2, "p"))
ledger.doors[0].end(3)
if {inside_step}:
    ledger.doors[0].begin()
# rank 1 ended its job after 3 steps: announced, and counted out once it read the records
store.set("p/record1", json.dumps({{"doors": [["compressor", 3, False]]}}))
store.add("p/in", 1)
store.add("p/out", 1)
time.sleep({sleep})  # a wait where nothing polls (inside Horovod's own, say)
print("the sleep ended")
"""


@pytest.mark.parametrize("inside_step", [True, False])
def test_a_rank_stuck_where_nothing_polls_is_ended_by_the_watch(inside_step):
    """A rank inside a step that no peer will join, waiting where no wait of this package
    polls: the watch thread announces, prints the agreement and ends the process with status 1
    (STUCK_AFTER_S after the peer's announcement); a rank outside any step is left alone."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    script = _STUCK_RANK.format(tests=tests, inside_step=inside_step,
                                sleep=60 if inside_step else 3)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=90)
    took = time.monotonic() - start
    if inside_step:
        assert proc.returncode == 1 and "the sleep ended" not in proc.stdout, proc.stderr
        assert took < 20, took
        assert ("OutOfStep: horovod_quant: the ranks ran different numbers of steps of the "
                "compressor: rank 0 waits in an exchange of its step 3 that no other rank "
                "started, rank 1 ended its job after 3 steps") in proc.stderr
    else:  # it ended its steps: the announcement at its exit agrees
        assert proc.returncode == 0 and "the sleep ended" in proc.stdout, proc.stderr
        assert "OutOfStep" not in proc.stderr
