"""The fallback rule of horovod_quant.exchange.fallback: which buckets leave their codec, and that
every rank decides the same from timings that differ between ranks (no real timing here)."""
import time

import numpy as np
import pytest

from horovod_quant.exchange import fallback
from horovod_quant.exchange.fallback import (FALLBACK_MARGIN, BucketTrial, check_fallback,
                                             decide, measure_and_decide)

from threaded_comm import run_ranks


def _trials(count, seconds=None):
    """``count`` buckets; with ``seconds`` (codec, fp32) per bucket, runs that return them."""
    seconds = seconds or [(0.0, 0.0)] * count
    return [BucketTrial(i, "Codec(bits=8)", 4 << 20, lambda s=s: s[0], lambda s=s: s[1])
            for i, s in enumerate(seconds)]


def _injected(trial):
    """measure_bucket for tests: the trial's runs return the seconds they stand for."""
    return trial.run_codec(), trial.run_fp32()


@pytest.mark.parametrize("codec_s,fp32_s,falls_back", [
    (0.030, 0.040, False),  # the codec pays: kept
    (0.045, 0.039, True),  # the codec costs more than it saves: Horovod's allreduce
    (0.040, 0.040, False),  # a tie keeps the codec the user asked for
])
def test_rule(codec_s, fp32_s, falls_back):
    (d,) = decide(_trials(1), np.array([[codec_s, fp32_s]]), step=1)
    assert d.fallback is falls_back
    assert (d.codec_s, d.fp32_s, d.step, d.bucket) == (codec_s, fp32_s, 1, 0)
    assert FALLBACK_MARGIN == 1.0


def test_margin_scales_the_allreduce_time():
    seconds = np.array([[0.045, 0.040]])
    assert decide(_trials(1), seconds, step=1)[0].fallback
    assert not decide(_trials(1), seconds, step=1, margin=1.2)[0].fallback
    assert decide(_trials(1), np.array([[0.035, 0.040]]), step=1, margin=0.8)[0].fallback


def test_log_line_names_the_bucket_and_both_times():
    slow, fast = decide(_trials(2), np.array([[0.0451, 0.0392], [0.01, 0.02]]), step=1)
    assert slow.message() == (
        "horovod_quant: bucket 0 (Codec(bits=8), 4.2 MB): codec exchange 45.1 ms > float32 "
        "allreduce 39.2 ms (measured at step 1); the float32 allreduce carries it from now on")
    assert "the codec keeps it" in fast.message()


def test_ranks_decide_the_same_from_different_timings(monkeypatch):
    monkeypatch.setattr(fallback, "measure_bucket", _injected)
    # rank 0 alone would keep bucket 0 and drop bucket 1, rank 1 the opposite; the slowest
    # rank's times (codec 50 vs fp32 40, codec 30 vs fp32 35) decide for both
    per_rank = [[(0.020, 0.040), (0.030, 0.010)],
                [(0.050, 0.030), (0.010, 0.035)]]
    decisions = run_ranks(2, lambda comm: measure_and_decide(
        comm, _trials(2, per_rank[comm.rank]), step=1, name="fb"))
    assert decisions[0] == decisions[1]
    assert [d.fallback for d in decisions[0]] == [True, False]
    assert [(d.codec_s, d.fp32_s) for d in decisions[0]] == [(0.050, 0.040), (0.030, 0.035)]


def test_no_buckets_no_collective():
    assert measure_and_decide(None, [], step=1, name="fb") == []


def test_measure_bucket_keeps_the_shortest_run():
    calls = []
    slow_first = iter([0.2, 0.0])

    def run():
        calls.append(1)
        time.sleep(next(slow_first))

    trial = BucketTrial(0, "c", 4, run, lambda: None)
    codec_s, _ = fallback.measure_bucket(trial, trials=2)
    assert len(calls) == 2 and codec_s < 0.2


@pytest.mark.parametrize("mode", ["auto", "never"])
def test_modes_accepted(mode):
    assert check_fallback(mode) == mode


@pytest.mark.parametrize("mode", ["always", "Auto", None, True])
def test_other_modes_rejected(mode):
    with pytest.raises(ValueError, match=r"fallback=.*choose one of \['auto', 'never'\]"):
        check_fallback(mode)
