"""StepStats in one human line, and StatsLogger's lines (every N steps, per epoch, one rank)."""
import logging
import sys

import pytest

from horovod_quant.stats import StatsLogger, StepStats, progress_bar


def _step(sent=1_000_000, raw=4_000_000):
    return StepStats(bytes_sent=sent, bytes_raw=raw, encode_s=0.001, exchange_s=0.01,
                     decode_s=0.002, tensors=3)


def test_one_human_line():
    line = str(_step())
    assert line == ("sent 1.0 MB of 4.0 MB (4.00x, 3.0 MB saved) in 3 tensors; encode 1.0 ms, "
                    "exchange 10.0 ms, decode 2.0 ms")
    assert "\n" not in line


def test_logs_every_n_steps_and_per_epoch(caplog):
    log = StatsLogger(every=2)
    with caplog.at_level(logging.INFO, logger="horovod_quant"):
        for _ in range(5):
            log(_step())
        log.epoch_end(0)
        log.epoch_end(1)  # nothing since the last line: no line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert lines[0].startswith("horovod_quant step 2 (2 steps): sent 2.0 MB of 8.0 MB")
    assert lines[1].startswith("horovod_quant step 4 (2 steps)")
    assert lines[2].startswith("horovod_quant epoch 0 (1 steps): sent 1.0 MB")


def test_only_the_chosen_rank_logs(caplog):
    with caplog.at_level(logging.INFO, logger="horovod_quant"):
        for rank in (0, 1):
            log = StatsLogger(every=1, rank=lambda r=rank: r, log_rank=1)
            log(_step())
    assert len(caplog.records) == 1


def test_step_takes_compressors_and_optimizers():
    class Compressor:
        stats = _step()

    class Optimizer:
        last_stats = _step(sent=2)

    log = StatsLogger(every=0)
    log.step(Compressor())
    assert Compressor.stats.bytes_sent == 0  # taken and reset
    log.step(Optimizer())
    log.step(_step(sent=5))
    assert log.steps == 3 and log.window.bytes_sent == 1_000_000 + 2 + 5


@pytest.mark.parametrize("every", [-1, 1.5, True])
def test_bad_every(every):
    with pytest.raises(ValueError, match="every"):
        StatsLogger(every=every)


def test_several_steps_at_once_cross_the_every_boundary(caplog):
    log = StatsLogger(every=10)
    with caplog.at_level(logging.INFO, logger="horovod_quant"):
        log(_step(), steps=7)
        log(_step(), steps=7)  # 14: crossed 10
        log(_step(), steps=5)  # 19: no line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("horovod_quant step 14 (14 steps)")


def test_progress_bar_without_tqdm_is_a_silent_stand_in(monkeypatch, caplog):
    """tqdm is in the dev extra only: without it the examples train on, with one warning
    where a bar was asked for and none on the other ranks."""

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    with caplog.at_level(logging.WARNING, logger="horovod_quant"):
        bar = progress_bar(10, rank=1, show=True)
        bar.update(1)
        bar.set_postfix_str("x")
        bar.close()
        assert caplog.records == []
        progress_bar(10, rank=0, show=True).update(1)
    assert [r.getMessage() for r in caplog.records] == [
        "no progress bar: tqdm is not installed (pip install tqdm)"]
