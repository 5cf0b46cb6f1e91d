"""hq.torch.DistributedOptimizer's fallback (issue 16): buckets whose codec was measured slower
than Horovod's float32 allreduce travel on that allreduce from the next step on, decided the same
on every rank. Outcomes are forced by replacing fallback.measure_bucket (no real timing)."""
import logging

import numpy as np
import pytest
import torch
import horovod.torch as hvd

import horovod_quant as hq
import horovod_quant.torch as hqt
from horovod_quant.core.rng import derive_key
from horovod_quant.exchange import fallback
from horovod_quant.exchange.fallback import FALLBACK_STEP

from conftest import Linear, codec_params, rank_gradients

EVERYTHING = hqt.LayerPolicy.everything()
SHAPES = [(64, 128), (32, 64)]  # one bucket each (fusion_bytes=1), reversed: ps.1 is bucket 0
STEPS = FALLBACK_STEP + 3
SEED = 3


def _optimizer(model, name, **kw):
    comp = getattr(hqt.Compression, name)(seed=SEED, policy=EVERYTHING, **codec_params(name))
    return hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), compression=comp,
                                    fusion_bytes=1, **kw)


def _codec_mean(opt, name, j, step, bucket):
    """mean_estimate of parameter j's gradients when it is alone in bucket ``bucket``."""
    codec = hq.get_codec(name, **codec_params(name))
    flats = [rank_gradients(SHAPES, step, r)[j].reshape(-1) for r in range(hvd.size())]
    want, _ = hq.mean_estimate(codec, flats, seed=derive_key(SEED, step, bucket),
                               gather="auto", pipeline_elems=opt.pipeline_elems)
    return want


def _same_everywhere(t):
    everyone = hvd.allgather(t.detach().reshape(1, -1))
    return all(torch.equal(everyone[0], e) for e in everyone)


def _inject(monkeypatch, seconds):
    """measure_bucket runs both trials (they must leave the gradients alone) and reports
    ``seconds(bucket) -> (codec, fp32)`` of this rank."""
    def measure(trial):
        trial.run_codec()
        trial.run_fp32()
        return seconds(trial.bucket)
    monkeypatch.setattr(fallback, "measure_bucket", measure)


def _train(model, opt, check):
    for step in range(STEPS):
        opt.zero_grad()
        model.loss(rank_gradients(SHAPES, step, hvd.rank())).backward()
        opt.step()
        if hvd.size() > 1:
            check(step)
        for p in model.ps:
            assert _same_everywhere(p.data)


@pytest.mark.parametrize("name", ["qsgd", "global_qsgd"])
def test_slower_bucket_falls_back_to_horovods_average(name, monkeypatch, caplog):
    last = hvd.size() - 1
    # bucket 0 (ps.1): only the last rank's codec is slow; bucket 1 (ps.0): only rank 0's
    # allreduce is slow. Alone, rank 0 would keep bucket 0 and the last rank drop bucket 1.
    _inject(monkeypatch, lambda b: ((0.05 if hvd.rank() == last else 0.01), 0.03) if b == 0
            else (0.02, (0.04 if hvd.rank() == 0 else 0.01)))
    model = Linear(SHAPES)
    opt = _optimizer(model, name)

    def check(step):
        fell_back = step > FALLBACK_STEP
        got0, got1 = (p.grad.reshape(-1).numpy() for p in model.ps)
        if fell_back:
            raw = torch.from_numpy(rank_gradients(SHAPES, step, hvd.rank())[1].reshape(-1))
            want1 = hvd.allreduce(raw, op=hvd.Average, name=f"fallback.check.{step}").numpy()
            if hvd.size() <= 2:
                assert np.array_equal(got1, want1), step
            else:  # Horovod's float sum, in an order that depends on its fusion
                np.testing.assert_allclose(got1, want1, rtol=1e-6, atol=1e-6)
            # the codec's bucket is now the only one: index 0
            assert np.array_equal(got0, _codec_mean(opt, name, 0, step, 0)), step
        else:  # the trials at the end of FALLBACK_STEP leave its gradients alone
            assert np.array_equal(got1, _codec_mean(opt, name, 1, step, 0)), step
            assert np.array_equal(got0, _codec_mean(opt, name, 0, step, 1)), step

    with caplog.at_level(logging.WARNING, logger="horovod_quant"):
        _train(model, opt, check)
    if hvd.size() == 1:
        assert opt.fallback_decisions == []
        return
    decisions = opt.fallback_decisions
    assert [(d.bucket, d.fallback, d.codec_s, d.fp32_s, d.step) for d in decisions] == [
        (0, True, 0.05, 0.03, FALLBACK_STEP), (1, False, 0.02, 0.04, FALLBACK_STEP)]
    assert hvd.allgather_object([str(d) for d in decisions]) == [[str(d) for d in decisions]] * \
        hvd.size()
    lines = [r.getMessage() for r in caplog.records if r.name == "horovod_quant"]
    if hvd.rank() == 0:
        assert lines == [decisions[0].message()]
        assert "bucket 0" in lines[0] and "from now on" in lines[0]
    else:
        assert lines == []


def test_faster_codec_is_kept(monkeypatch, caplog):
    _inject(monkeypatch, lambda b: (0.01, 0.02))
    model = Linear(SHAPES)
    opt = _optimizer(model, "qsgd")

    def check(step):
        got0, got1 = (p.grad.reshape(-1).numpy() for p in model.ps)
        assert np.array_equal(got1, _codec_mean(opt, "qsgd", 1, step, 0)), step
        assert np.array_equal(got0, _codec_mean(opt, "qsgd", 0, step, 1)), step

    with caplog.at_level(logging.WARNING, logger="horovod_quant"):
        _train(model, opt, check)
    assert [d.fallback for d in opt.fallback_decisions] == ([False, False]
                                                            if hvd.size() > 1 else [])
    assert not [r for r in caplog.records if r.name == "horovod_quant"]


def test_never_measures(monkeypatch):
    def measure(trial):
        raise AssertionError("fallback='never' measured a bucket")
    monkeypatch.setattr(fallback, "measure_bucket", measure)
    model = Linear(SHAPES)
    opt = _optimizer(model, "qsgd", fallback="never")

    def check(step):
        got0 = model.ps[0].grad.reshape(-1).numpy()
        assert np.array_equal(got0, _codec_mean(opt, "qsgd", 0, step, 1)), step

    _train(model, opt, check)
    assert opt.fallback_decisions == []


def test_fallback_argument_is_checked():
    model = Linear(SHAPES)
    with pytest.raises(ValueError, match=r"fallback='always' is not valid.*\['auto', 'never'\]"):
        _optimizer(model, "qsgd", fallback="always")
