"""hq.torch.DistributedOptimizer's fallback: buckets whose codec was measured slower
than the baseline (Horovod's float32 or 16-bit allreduce, the faster with baseline="auto")
travel on that allreduce from the next step on, decided the same on every rank; a narrow win is
checked in training steps. Outcomes are forced by replacing fallback.measure_bucket and
fallback.clock (no real timing)."""
import logging
import time

import horovod.torch as hvd
import numpy as np
import pytest
import torch

import horovod_quant as hq
import horovod_quant.torch as hqt
from horovod_quant import fallback
from horovod_quant.core.rng import payload_seed
from horovod_quant.exchange.cost import Fabric
from horovod_quant.fallback import FALLBACK_STEP, STEP_CHECK_ROUNDS

from conftest import Linear, codec_params, rank_gradients

pytestmark = pytest.mark.size_independent
EVERYTHING = hqt.LayerPolicy.everything()
SHAPES = [(64, 128), (32, 64)]  # one bucket each (fusion_bytes=1), reversed: ps.1 is bucket 0
STEPS = FALLBACK_STEP + 3
SEED = 3


def _optimizer(model, name, **kw):
    comp = getattr(hqt.Compression, name)(seed=SEED, policy=EVERYTHING, **codec_params(name))
    return hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), compression=comp,
                                    fusion_bytes=1, **kw)


def _codec_mean(opt, name, j, step):
    """mean_estimate of parameter j's gradients when it is alone in its bucket (its plan
    chosen for CPU ranks' default links until the trial, at the end of FALLBACK_STEP, measured
    the optimizer's)."""
    codec = hq.get_codec(name, **codec_params(name))
    flats = [rank_gradients(SHAPES, step, r)[j].reshape(-1) for r in range(hvd.size())]
    fabric = opt.fabric if step > FALLBACK_STEP else Fabric.for_ranks(False)
    want, _ = hq.mean_estimate(codec, flats, seed=payload_seed(SEED, step, f"ps.{j}"),
                               gather="auto", pipeline_elems=opt.pipeline_elems,
                               topology=opt.topology, fabric=fabric)
    return want


def _same_everywhere(t):
    everyone = hvd.allgather(t.detach().reshape(1, -1))
    return all(torch.equal(everyone[0], e) for e in everyone)


def _inject(monkeypatch, seconds, sixteen_s=None):
    """measure_bucket runs every side of the trials (they must leave the gradients alone) and
    reports ``seconds(bucket) -> (codec, fp32)`` of this rank; the 16-bit allreduce takes
    ``sixteen_s(bucket)``, else as long as float32 (a tie: "auto" keeps float32)."""
    def measure(trial, sides, **_):
        codec_s, fp32_s = seconds(trial.bucket)
        times = {"codec": codec_s, "fp32": fp32_s, "local": 0.001,
                 "fp16": fp32_s if sixteen_s is None else sixteen_s(trial.bucket)}
        for side in sides:
            trial.run(side)()
        return [times[side] for side in sides]
    monkeypatch.setattr(fallback, "measure_bucket", measure)


def _train(model, opt, check, steps=STEPS):
    for step in range(steps):
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
            assert np.array_equal(got0, _codec_mean(opt, name, 0, step)), step
        else:  # the trials at the end of FALLBACK_STEP leave its gradients alone
            assert np.array_equal(got1, _codec_mean(opt, name, 1, step)), step
            assert np.array_equal(got0, _codec_mean(opt, name, 0, step)), step

    with caplog.at_level(logging.WARNING, logger="horovod_quant"):
        _train(model, opt, check)
    if hvd.size() == 1:
        assert opt.fallback_decisions == []
        return
    decisions = opt.fallback_decisions
    assert [(d.bucket, d.fallback, d.codec_s, d.baseline_s, d.step, d.baseline)
            for d in decisions] == [(0, True, 0.05, 0.03, FALLBACK_STEP, "fp32"),
                                    (1, False, 0.02, 0.04, FALLBACK_STEP, "fp32")]
    assert hvd.allgather_object([str(d) for d in decisions]) == [[str(d) for d in decisions]] * \
        hvd.size()
    lines = [r.getMessage() for r in caplog.records if r.name == "horovod_quant"]
    if hvd.rank() == 0:
        assert lines == [decisions[0].message()]
        assert "bucket 0" in lines[0] and "from now on" in lines[0]
    else:
        assert lines == []
    assert opt.fallback_baseline.baseline == "fp32"
    assert opt.last_stats.baseline.startswith("fp32 (Horovod's ring allreduce")


def test_faster_codec_is_kept(monkeypatch, caplog):
    _inject(monkeypatch, lambda b: (0.01, 0.02))
    model = Linear(SHAPES)
    opt = _optimizer(model, "qsgd")

    def check(step):
        got0, got1 = (p.grad.reshape(-1).numpy() for p in model.ps)
        assert np.array_equal(got1, _codec_mean(opt, "qsgd", 1, step)), step
        assert np.array_equal(got0, _codec_mean(opt, "qsgd", 0, step)), step

    with caplog.at_level(logging.WARNING, logger="horovod_quant"):
        _train(model, opt, check)
    assert [d.fallback for d in opt.fallback_decisions] == ([False, False]
                                                            if hvd.size() > 1 else [])
    assert not [r for r in caplog.records if r.name == "horovod_quant"]  # kept: info lines


def test_never_measures(monkeypatch):
    def measure(trial, sides, **_):
        raise AssertionError("fallback='never' measured a bucket")
    monkeypatch.setattr(fallback, "measure_bucket", measure)
    model = Linear(SHAPES)
    opt = _optimizer(model, "qsgd", fallback="never")

    def check(step):
        got0 = model.ps[0].grad.reshape(-1).numpy()
        assert np.array_equal(got0, _codec_mean(opt, "qsgd", 0, step)), step

    _train(model, opt, check)
    assert opt.fallback_decisions == []


def test_fallback_argument_is_checked():
    model = Linear(SHAPES)
    with pytest.raises(ValueError, match=r"fallback='always' is not valid.*\['auto', 'never'\]"):
        _optimizer(model, "qsgd", fallback="always")


# bucket 0 (ps.1): its codec (70 ms) loses to both baselines; bucket 1 (ps.0): its codec (5 ms)
# beats both. The 16-bit allreduce takes 20 ms a bucket, float32 40 ms: the speeds CPU ranks
# never promise (gloo's 16-bit sum can lose to float32), forced here
CODEC_S = {0: 0.07, 1: 0.005}


@pytest.mark.parametrize("baseline,sixteen_s,want", [
    ("auto", 0.02, "fp16"),  # the 16-bit allreduce won the trial: the baseline
    ("auto", 0.06, "fp32"),  # it lost: float32
    ("fp32", 0.02, "fp32"),  # asked for: float32 even though 16-bit was faster
    ("fp16", 0.06, "fp16"),  # asked for: 16-bit even though it was slower
])
def test_a_fallen_back_bucket_takes_the_baseline(baseline, sixteen_s, want, monkeypatch):
    """The trial compares each codec with the chosen baseline; a bucket that falls back goes to
    that baseline's allreduce (the 16-bit cast where it won), and a non-finite gradient stays
    non-finite through it (a loss scaler must still see the overflow)."""
    if hvd.size() == 1:
        pytest.skip("a one-rank world never measures")
    _inject(monkeypatch, lambda b: (CODEC_S[b], 0.04), lambda b: sixteen_s)
    model = Linear(SHAPES)
    opt = _optimizer(model, "qsgd", baseline=baseline)
    dtype = torch.float16 if want == "fp16" else torch.float32
    for step in range(STEPS):
        grads = rank_gradients(SHAPES, step, hvd.rank())
        if step == STEPS - 1:
            grads[1][0, 0], grads[1][0, 1] = np.inf, np.nan
        opt.zero_grad()
        model.loss(grads).backward()
        opt.step()
        if step <= FALLBACK_STEP:
            continue
        raw = torch.from_numpy(grads[1]).to(dtype)
        want1 = hvd.allreduce(raw, op=hvd.Average, name=f"baseline.check.{step}").float()
        got1 = model.ps[1].grad
        np.testing.assert_allclose(got1.numpy(), want1.numpy(), rtol=1e-6, atol=1e-6)
        if dtype == torch.float16:  # it travelled as 16-bit: its values are float16's
            torch.testing.assert_close(got1, got1.half().float(), rtol=0, atol=0, equal_nan=True)
        if step == STEPS - 1:
            assert not torch.isfinite(got1[0, :2]).any() and torch.isfinite(got1[1:]).all()
        assert np.array_equal(model.ps[0].grad.reshape(-1).numpy(),
                              _codec_mean(opt, "qsgd", 0, step)), step
    choice = opt.fallback_baseline
    assert choice.baseline == want and opt._fallback.baseline == want
    assert [(d.fallback, d.baseline) for d in opt.fallback_decisions] == [(True, want),
                                                                         (False, want)]
    assert [d.baseline_s for d in opt.fallback_decisions] == [
        (sixteen_s if want == "fp16" else 0.04)] * 2
    assert opt.last_stats.baseline == f"{want} ({choice.plan})"
    assert opt.last_stats.fallen_back == 1
    assert "links measured:" in choice.message() and opt.fabric == hvd.broadcast_object(
        opt.fabric)


def test_bfloat16_is_refused_for_cpu_gradients():
    with pytest.raises(ValueError, match="baseline='bf16': Horovod's CPU allreduce takes no "
                                         "bfloat16"):
        _optimizer(Linear(SHAPES), "qsgd", baseline="bf16")
    with pytest.raises(ValueError, match=r"baseline='fp8' is not valid"):
        _optimizer(Linear(SHAPES), "qsgd", baseline="fp8")


CHECK_FIRST = FALLBACK_STEP + 1  # the step check's first step
CHECK_STEPS = 2 * STEP_CHECK_ROUNDS


def _fp32_step(step):
    """Whether ``step`` runs with every bucket on the allreduce during the check."""
    return CHECK_FIRST <= step < CHECK_FIRST + CHECK_STEPS and (step - CHECK_FIRST) % 2 == 1


class _StepClock:
    """fallback.clock for the step check: a codec step's exchange lasts ``codec_s``, a float32
    one ``fp32_s`` (this rank's), whatever the real time."""

    def __init__(self, codec_s, fp32_s):
        self.codec_s, self.fp32_s, self.now, self.calls = codec_s, fp32_s, 0.0, 0

    def __call__(self):
        if self.calls % 2:  # stop() of the check's step number calls // 2
            self.now += self.fp32_s if (self.calls // 2) % 2 else self.codec_s
        self.calls += 1
        return self.now


def _checked_run(monkeypatch, caplog, codec_s, fp32_s):
    """Train with both buckets kept by a narrow trial (1.33x), the step check timed by
    _StepClock; check every step's gradients against the layout it ran."""
    _inject(monkeypatch, lambda b: (0.03, 0.04))
    monkeypatch.setattr(fallback, "clock", _StepClock(codec_s, fp32_s))
    model = Linear(SHAPES)
    opt = _optimizer(model, "qsgd")
    final_fp32 = []
    settled = []

    def check(step):
        fp32 = _fp32_step(step) or (step >= CHECK_FIRST + CHECK_STEPS and final_fp32[0])
        got0, got1 = (p.grad.reshape(-1).numpy() for p in model.ps)
        if fp32:
            for j, got in ((0, got0), (1, got1)):
                raw = torch.from_numpy(rank_gradients(SHAPES, step, hvd.rank())[j].reshape(-1))
                want = hvd.allreduce(raw, op=hvd.Average, name=f"check.{step}.{j}").numpy()
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        else:
            assert np.array_equal(got1, _codec_mean(opt, "qsgd", 1, step)), step
            assert np.array_equal(got0, _codec_mean(opt, "qsgd", 0, step)), step
        settled.append(opt.fallback_settled)
        if step == CHECK_FIRST + CHECK_STEPS - 1:
            final_fp32.append(opt.fallback_step_check.fallback)

    with caplog.at_level(logging.INFO, logger="horovod_quant"):
        _train(model, opt, check, steps=CHECK_FIRST + CHECK_STEPS + 2)
    return opt, settled, [r for r in caplog.records if r.name == "horovod_quant"]


@pytest.mark.parametrize("codec_wins", [True, False])
def test_narrow_win_is_checked_in_training_steps(codec_wins, monkeypatch, caplog):
    if hvd.size() == 1:
        pytest.skip("a one-rank world never measures")
    # alone, rank 0's exchanges favour the allreduce (0.7 vs 0.5); the ranks take the
    # shortest time of each step, the other ranks'
    codec_s = 0.7 if hvd.rank() == 0 else (0.4 if codec_wins else 0.6)
    opt, settled, records = _checked_run(monkeypatch, caplog, codec_s, 0.5)
    check = opt.fallback_step_check
    assert [d.fallback for d in opt.fallback_decisions] == [False, False]
    assert (check.fallback, check.first_step, check.steps) == (not codec_wins, CHECK_FIRST,
                                                                STEP_CHECK_ROUNDS)
    assert (check.codec_step_s, check.baseline_step_s) == pytest.approx(
        (0.4 if codec_wins else 0.6, 0.5))
    assert hvd.allgather_object(str(check)) == [str(check)] * hvd.size()
    # settled from the end of the check's last step on (checked after each step)
    assert settled == [False] * (CHECK_FIRST + CHECK_STEPS - 1) + [True] * 3
    lines = [(r.levelno, r.getMessage()) for r in records]
    if hvd.rank() == 0:
        assert lines == [(logging.INFO, opt.fallback_baseline.message())] + [
            (logging.INFO, d.message()) for d in opt.fallback_decisions] + [
            (logging.WARNING if check.fallback else logging.INFO, check.message())]
    else:
        assert lines == []


def test_clear_win_skips_the_step_check(monkeypatch):
    def clock():
        raise AssertionError("a 2x win was checked in training steps")
    _inject(monkeypatch, lambda b: (0.02, 0.04))
    monkeypatch.setattr(fallback, "clock", clock)
    model = Linear(SHAPES)
    opt = _optimizer(model, "qsgd")
    _train(model, opt, lambda step: None)
    assert opt.fallback_step_check is None
    assert opt.fallback_settled


STRAGGLE_S = 1.0  # far above an exchange of these buckets, even on loaded shared cores


def test_a_rank_slow_before_forward_is_not_charged_to_the_codec(monkeypatch):
    """Rank 1 sleeps before forward in every step of the check that runs the codec: the other
    ranks wait for it in those steps' exchanges, but the time each step's exchange took does
    not hold the sleep (real clock)."""
    if hvd.size() == 1:
        pytest.skip("a one-rank world never measures")
    _inject(monkeypatch, lambda b: (0.03, 0.04))  # a narrow win: the step check runs
    model = Linear(SHAPES)
    opt = _optimizer(model, "qsgd")
    for step in range(CHECK_FIRST + CHECK_STEPS):
        opt.zero_grad()
        if hvd.rank() == 1 and CHECK_FIRST <= step and not _fp32_step(step):
            time.sleep(STRAGGLE_S)
        model.loss(rank_gradients(SHAPES, step, hvd.rank())).backward()
        opt.step()
    check = opt.fallback_step_check
    assert check is not None and hvd.allgather_object(str(check)) == [str(check)] * hvd.size()
    assert check.codec_step_s < STRAGGLE_S / 2, check.message()
    assert check.baseline_step_s < STRAGGLE_S / 2, check.message()
