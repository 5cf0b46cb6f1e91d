"""The torch door's wait on Horovod's handles: polls with bounded sleeps, then synchronizes
(``wait_until_done`` alone leaves the handle to Horovod)."""
import pytest

pytest.importorskip("horovod.torch")
from horovod_quant.torch import collectives  # noqa: E402


class FakeHorovod:
    """A collective that completes at the ``polls_until_done``-th poll."""

    def __init__(self, polls_until_done, error=None):
        self.polls, self.until, self.error = 0, polls_until_done, error
        self.synchronized = []

    def poll(self, handle):
        self.polls += 1
        if self.until is None:
            raise ValueError(f"Handle {handle} was not created or has been cleared.")
        return self.polls >= self.until

    def synchronize(self, handle):
        assert self.until is None or self.polls >= self.until, \
            "synchronize entered before the collective was done"
        self.synchronized.append(handle)
        if self.error:
            raise self.error
        return f"result of {handle}"


@pytest.fixture
def pauses(monkeypatch):
    slept = []
    monkeypatch.setattr(collectives.time, "sleep", slept.append)
    return slept


@pytest.mark.parametrize("polls", [1, 2, 40])
def test_synchronize_enters_horovods_wait_once_done(monkeypatch, pauses, polls):
    fake = FakeHorovod(polls)
    monkeypatch.setattr(collectives, "hvd", fake)
    assert collectives.synchronize(7) == "result of 7"
    assert fake.synchronized == [7] and fake.polls == polls
    assert len(pauses) == polls - 1
    assert pauses == sorted(pauses) and all(0 < p <= collectives._LONGEST_PAUSE_S for p in pauses)
    if polls == 40:
        assert pauses[-1] == collectives._LONGEST_PAUSE_S


def test_synchronize_raises_horovods_error(monkeypatch, pauses):
    monkeypatch.setattr(collectives, "hvd", FakeHorovod(3, error=RuntimeError("peer lost")))
    with pytest.raises(RuntimeError, match="peer lost"):
        collectives.synchronize(1)


def test_a_handle_horovod_no_longer_knows_goes_to_horovods_wait(monkeypatch, pauses):
    fake = FakeHorovod(None)
    monkeypatch.setattr(collectives, "hvd", fake)
    assert collectives.synchronize(5) == "result of 5"
    assert fake.synchronized == [5] and pauses == []


def test_wait_until_done_polls_and_leaves_the_handle_to_horovod(monkeypatch, pauses):
    fake = FakeHorovod(4)
    monkeypatch.setattr(collectives, "hvd", fake)
    assert collectives.wait_until_done(3) is None
    assert fake.polls == 4 and len(pauses) == 3 and fake.synchronized == []
