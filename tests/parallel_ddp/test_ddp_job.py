"""A whole DDP training job with the hook: resumed from a checkpoint (state_dict or a pickled
state) it continues bit for bit; bf16 and fp16 parameters, GradScaler's skipped steps and a
compiled model keep every rank identical; the hook returns before the bucket's exchange is done
(backward goes on meanwhile)."""
import io
import itertools
import logging
import pickle
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import horovod_quant as hq
from horovod_quant import fallback
from horovod_quant.fallback import FALLBACK_STEP, STEP_CHECK_ROUNDS
from horovod_quant.torch import ddp
from horovod_quant.torch.tensors import BASELINE_DTYPES

from conftest import codec_params, same_everywhere
from test_ddp_exact import Net, Recorder, _batch, _model

pytestmark = pytest.mark.size_independent
SEED = 9


class BackwardOrderNet(torch.nn.Module):
    """Parameters registered in the order backward produces their gradients, so that DDP's
    first buckets are the ones it rebuilds after a first step (docs/ddp.md, "Checkpoints")."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        shapes = [(5,), (5, 200), (200,), (200, 300), (300,), (300, 24)]
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(0.05 * torch.randn(s))
                                          for s in shapes])

    def forward(self, x):
        cb, cw, bb, bw, ab, aw = self.ps
        h = torch.relu(torch.nn.functional.linear(x, aw, ab))
        h = torch.relu(torch.nn.functional.linear(h, bw, bb))
        return torch.nn.functional.linear(h, cw, cb)


def _params(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _correlated_batch(step):
    """Inputs close across ranks: NDQSG's coarse ratio adapts to the gradients' agreement."""
    common = torch.Generator().manual_seed(1000 * step)
    own = torch.Generator().manual_seed(1000 * step + 1 + dist.get_rank())
    return torch.randn(8, 24, generator=common) + 0.01 * torch.randn(8, 24, generator=own)


def _train(model, opt, steps):
    for step in steps:
        opt.zero_grad()
        model(_correlated_batch(step)).square().mean().backward()
        opt.step()


def _round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def _resumed(how, model, opt, state, fresh):
    """The model, optimizer and hook state saved (the state through its ``state_dict()``, or
    pickled as PowerSGDState is: ``how``) and round-tripped through torch.save, then loaded
    into the new objects ``fresh(unpickled state or None)`` builds; returns those."""
    saved = {"model": model.state_dict(), "opt": opt.state_dict()}
    if how == "state_dict":
        saved["hook"] = state.state_dict()
        saved = _round_trip(saved)
        model, opt, state = fresh()
        state.load_state_dict(saved["hook"])
    else:
        pickled = pickle.dumps(state)
        saved = _round_trip(saved)
        model, opt, state = fresh(pickle.loads(pickled))
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    return model, opt, state


@pytest.mark.parametrize("name,params", [("qsgd", {}), ("nested_dithered", {"bits": 6})])
@pytest.mark.parametrize("how", ["state_dict", "pickle"])
def test_resumed_job_continues_bit_for_bit(name, params, how):
    """N steps straight, or N/2, a checkpoint, a new model, optimizer and state, N/2 more:
    the same parameters bit for bit on every rank (the step and NDQSG's adaptive state travel
    in the state's state_dict, or in the pickled state as PowerSGDState's do)."""
    n, half = 6, 3
    codec = hq.get_codec(name, **params, **codec_params(name))

    def fresh(state=None):
        model = DDP(BackwardOrderNet(), bucket_cap_mb=0.25)
        state = state or ddp.QuantizationState(codec, seed=SEED, fallback="never")
        model.register_comm_hook(state, ddp.quantization_hook)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), state

    model, opt, _ = fresh()
    _train(model, opt, range(n))
    straight = _params(model)

    model, opt, state = fresh()
    _train(model, opt, range(half))
    if name == "nested_dithered" and dist.get_world_size() > 1:
        assert state.state_dict()["codec_states"]  # it has adapted
    model, opt, state = _resumed(how, model, opt, state, fresh)
    assert state.step == half
    _train(model, opt, range(half, n))
    assert torch.equal(_params(model), straight)
    assert same_everywhere(straight)


class LinearNet(torch.nn.Module):
    """Standard layers (``nn.Linear`` registers its weight before its bias): DDP's first
    buckets (one, in registration order, with find_unused_parameters=False) differ from the
    ones it rebuilds in backward's order after the first step (several, at 0.1 MB each)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        widths = [24, 400, 300, 300, 200, 5]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b)
                                          for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return self.layers[-1](x)


@pytest.mark.parametrize("name,params", [("qsgd", {}), ("nested_dithered", {"bits": 6})])
@pytest.mark.parametrize("named", [False, True])
@pytest.mark.parametrize("how", ["state_dict", "pickle"])
def test_resumed_job_on_standard_layers_continues_bit_for_bit(name, params, named, how):
    """As test_resumed_job_continues_bit_for_bit, on a model whose buckets DDP composes
    differently in a new process's first step than after its rebuild (the resumed job's first
    step exchanges the uninterrupted job's buckets, saved with the state), with and without
    the parameters' names."""
    n, half = 6, 3
    codec = hq.get_codec(name, **params, **codec_params(name))
    layouts = []  # each step's buckets: the names of their parameters

    def fresh(state=None):
        net = LinearNet()
        names = {id(p): k for k, p in net.named_parameters()}
        model = DDP(net, bucket_cap_mb=0.1, find_unused_parameters=False)
        state = state or ddp.QuantizationState(
            codec, seed=SEED, fallback="never",
            named_parameters=net.named_parameters() if named else None)

        def hook(state, bucket):
            if bucket.index() == 0:
                layouts.append([])
            layouts[-1].append([names[id(p)] for p in bucket.parameters()])
            return ddp.quantization_hook(state, bucket)

        model.register_comm_hook(state, hook)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), state

    model, opt, _ = fresh()
    _train(model, opt, range(n))
    straight = _params(model)
    assert len(layouts[0]) == 1 and len(layouts[1]) > 2, layouts[:2]  # DDP rebuilt
    assert layouts[1:] == [layouts[1]] * (n - 1)

    layouts.clear()
    model, opt, state = fresh()
    _train(model, opt, range(half))
    model, opt, state = _resumed(how, model, opt, state, fresh)
    _train(model, opt, range(half, n))
    assert len(layouts[half]) == 1  # the new DDP's first buckets, not the rebuilt ones
    assert torch.equal(_params(model), straight)
    assert same_everywhere(straight)


def test_a_resumed_state_refuses_another_models_buckets_and_bucket_indices():
    """A state saved from one model and loaded for another raises on every rank at the first
    bucket, before any exchange; seed_of takes a bucket or its key, not DDP's index."""
    state = ddp.QuantizationState(hq.get_codec("qsgd"), seed=SEED, fallback="never")
    model = DDP(LinearNet(), bucket_cap_mb=0.1)
    model.register_comm_hook(state, ddp.quantization_hook)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.05), range(2))
    assert len(state.state_dict()["buckets"]) > 2
    with pytest.raises(TypeError, match="not its index"):
        state.seed_of(2, 0)

    other = ddp.QuantizationState(hq.get_codec("qsgd"), seed=SEED, fallback="never")
    other.load_state_dict(_round_trip(state.state_dict()))
    model = DDP(BackwardOrderNet(), bucket_cap_mb=0.25)
    model.register_comm_hook(other, ddp.quantization_hook)
    seconds, message = _time_to_raise(model, 2)
    assert "the resumed state's buckets do not hold DDP's parameter" in message, message
    assert same_everywhere(torch.tensor([len(message)]))


def _time_to_raise(model, step):
    """Seconds until a training step of ``model`` raises (the step's error, for the test's
    match)."""
    start = time.monotonic()
    with pytest.raises(Exception) as raised:
        model(_batch(step)).square().mean().backward()
    return time.monotonic() - start, str(raised.value)


def test_a_rank_out_of_step_raises_the_same_error_on_every_rank(several_ranks):
    """Rank 0 one step ahead, at the first step (a checkpoint loaded there alone: the check)
    and after two steps (its counter moved on alone: the exchanges' tags): every rank raises,
    within seconds, an error naming each rank's step, and nothing is combined."""
    n = dist.get_world_size()
    ahead = {"step": 4 if dist.get_rank() == 0 else 3, "codec_states": {}}
    state = ddp.QuantizationState(hq.get_codec("qsgd"), seed=SEED)
    state.load_state_dict(ahead)
    model = _model()
    model.register_comm_hook(state, ddp.quantization_hook)
    seconds, message = _time_to_raise(model, 0)
    want = ", ".join(f"rank {r} is at step {4 if r == 0 else 3}" for r in range(n))
    assert want in message and "broadcast the optimizer state" in message, message
    assert seconds < 30
    assert same_everywhere(torch.tensor([len(message)]))

    # the codecs' exchanges carry the step; a bucket on the fallback's baseline allreduce does not
    state = ddp.QuantizationState(hq.get_codec("nested_dithered", **codec_params(
        "nested_dithered")), seed=SEED, fallback="never")
    model = _model()
    model.register_comm_hook(state, ddp.quantization_hook)
    for step in range(2):
        model(_batch(step)).square().mean().backward()
    if dist.get_rank() == 0:
        state.step += 1
    seconds, message = _time_to_raise(model, 2)
    assert seconds < 30
    want = ", ".join(f"rank {r} at step {3 if r == 0 else 2}" for r in range(n))
    assert "out of step" in message and want in message, message
    assert same_everywhere(torch.tensor([len(message)]))


def test_resume_at_another_world_size_adapts_with_one_warning(several_ranks):
    """A state saved at n ranks, loaded into a state of a one-rank group, and one pickled
    at one rank, unpickled at n: the world-sized codec is built for the new size, its adaptive
    state carried over, with one warning naming both sizes; training goes on (no late cast
    error), the n ranks identical."""
    n, rank = dist.get_world_size(), dist.get_rank()
    alone = [dist.new_group([r]) for r in range(n)][rank]
    state = ddp.QuantizationState("nested_dithered", seed=SEED)
    model = DDP(BackwardOrderNet(), bucket_cap_mb=0.25)
    model.register_comm_hook(state, ddp.quantization_hook)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.05), range(2))
    saved = _round_trip(state.state_dict())
    assert saved["world_size"] == n and saved["codec_states"]

    one = ddp.QuantizationState("nested_dithered", process_group=alone, seed=SEED)
    with pytest.warns(UserWarning) as caught:
        one.load_state_dict(saved)
    assert [str(w.message) for w in caught if "world size" in str(w.message)] == [
        str(caught[0].message)] and len(caught) == 1
    assert f"saved at world size {n} and is loaded at world size 1" in str(caught[0].message)
    assert list(one.codec_states.state_dict().values()) == list(saved["codec_states"].values())
    assert one.step == 2
    model = DDP(BackwardOrderNet(), bucket_cap_mb=0.25, process_group=alone)
    model.register_comm_hook(one, ddp.quantization_hook)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.05), range(2, 4))
    pickled = pickle.dumps(one)

    with pytest.warns(UserWarning, match=f"saved at world size 1 and is loaded at world size {n}"):
        back = pickle.loads(pickled)
    assert back.codec.params["world_size"] == n and back.step == 4
    model = DDP(BackwardOrderNet(), bucket_cap_mb=0.25)
    model.register_comm_hook(back, ddp.quantization_hook)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.05), range(4, 6))
    assert same_everywhere(_params(model))


def test_state_refuses_late_loads_and_rules_in_pickles():
    state = ddp.QuantizationState(hq.get_codec("qsgd"))
    model = _model()
    model.register_comm_hook(state, ddp.quantization_hook)
    model(_batch(0)).square().mean().backward()
    with pytest.raises(ValueError, match="load into a new state"):
        state.load_state_dict({"step": 0, "codec_states": {}})
    with pytest.raises(ValueError, match="not a QuantizationState state"):
        ddp.QuantizationState(hq.get_codec("qsgd")).load_state_dict({"steps": 1})
    named = list(_model().named_parameters())
    ruled = ddp.QuantizationState(hq.get_codec("qsgd"), named_parameters=named,
                                  policy=hq.torch.LayerPolicy(rules=[(r"c\.", None)]))
    with pytest.raises(ValueError, match="name rules does not pickle"):
        pickle.dumps(ruled)


def test_hook_returns_before_its_exchange_is_done():
    """The hook hands the bucket to the worker: its future is not complete when it returns
    (every bucket's but possibly the last's), and every future completes with the mean."""
    model = _model(bucket_cap_mb=0.05)
    state = ddp.QuantizationState(hq.get_codec("qsgd"), seed=SEED, fallback="never")
    rec = Recorder(state)
    pending_at_return = []

    def hook(state, bucket):
        fut = rec.hook(state, bucket)
        pending_at_return.append(not fut.done())
        return fut

    model.register_comm_hook(state, hook)
    for step in range(2):
        model.zero_grad()
        model(_batch(step)).square().mean().backward()
        rec.check()
    assert len(pending_at_return) >= 4 and any(pending_at_return[:-1])
    assert threading.current_thread() is threading.main_thread()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_buckets_match_reference(dtype):
    """bf16 / fp16 parameters: DDP's buckets are in their dtype; each codec part is encoded
    from the bucket's values and its mean written back in the bucket's dtype, on every rank."""
    torch.manual_seed(0)
    model = DDP(Net().to(dtype), bucket_cap_mb=0.25)
    state = ddp.QuantizationState(hq.get_codec("qsgd", bits=8), seed=SEED)
    calls = []

    def hook(state, bucket):
        inp = bucket.buffer().detach().float().clone()
        step = state.step
        fut = ddp.quantization_hook(state, bucket)
        calls.append((bucket, inp, step, fut))
        return fut

    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(2):
        opt.zero_grad()
        model(_batch(step).to(dtype)).float().square().mean().backward()
        for _, _, _, fut in calls:
            assert fut.wait().dtype == dtype and same_everywhere(fut.wait().float())
        calls.clear()
        opt.step()
    assert all(p.dtype == dtype for p in model.parameters())
    assert same_everywhere(_params(model))


def test_grad_scaler_skips_an_overflow_step_on_every_rank():
    """fp16 autocast and GradScaler: one rank's overflow makes the bucket's mean non-finite on
    every rank, so every rank skips that step and lowers the scale alike."""
    model = _model()
    state = ddp.QuantizationState(hq.get_codec("qsgd", bits=8), seed=SEED)
    model.register_comm_hook(state, ddp.quantization_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for step in range(4):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(_batch(step)).square().mean()
        if step == 2 and dist.get_rank() == 0:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        before = _params(model)
        scaler.step(opt)
        scaler.update()
        assert torch.equal(_params(model), before) == (step == 2), step
        assert same_everywhere(torch.tensor([scaler.get_scale()]))
        assert same_everywhere(_params(model))


def test_compiled_model_trains_identically():
    """torch.compile'd DDP model with the hook: every step's buckets go through the hook, the
    ranks stay identical and the run is close to the eager one (the compiled graph computes
    the same gradients in another order of float operations)."""
    results = []
    for compiled in (False, True):
        model = _model(bucket_cap_mb=25)  # compiled DDP: buckets of at least the first's 1 MB
        state = ddp.QuantizationState(hq.get_codec("qsgd", bits=8), seed=SEED,
                                      fallback="never")
        model.register_comm_hook(state, ddp.quantization_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        run = torch.compile(model, backend="aot_eager") if compiled else model
        for step in range(3):
            opt.zero_grad()
            run(_batch(step)).square().mean().backward()
            opt.step()
        assert state.step == 3
        results.append(_params(model))
    assert torch.allclose(results[0], results[1], rtol=0, atol=1e-2)
    assert same_everywhere(results[1])
    assert np.isfinite(results[1].numpy()).all()



def _slow_bucket_0_on_the_last_rank(bucket):
    """Bucket 0's codec slower than the baseline's 0.1 s on the last rank only (the ranks
    agree on the slowest rank's times, so it falls back everywhere), every other bucket's a
    clear win (no step check)."""
    return 0.5 if bucket == 0 and dist.get_rank() == dist.get_world_size() - 1 else 0.001


def _force_fallback(monkeypatch, baseline_s, codec_s=_slow_bucket_0_on_the_last_rank):
    """Replace the fallback's timing (fallback.measure_bucket, which still runs each side once):
    the baseline trial reports ``baseline_s`` (name -> seconds) per bucket (1 ms the allreduce
    inside a host); the bucket trial reports ``codec_s(bucket)`` for the codec, 0.1 s for the
    baseline."""
    def measure(trial, sides, sync=None, **_):
        for side in sides:
            trial.run(side)()
        if "codec" not in sides:  # the baseline trial
            return [baseline_s.get(side, 0.001) for side in sides]
        return [codec_s(trial.bucket), 0.1]

    monkeypatch.setattr(fallback, "measure_bucket", measure)


def _hooked(model, state, poison):
    """Registers a hook on ``model`` that records each bucket's input and mean of the current
    step, calling ``poison(step, buffer)`` on bucket 0's buffer first; returns the record."""
    record = {}

    def hook(state, bucket):
        buf = bucket.buffer()
        if bucket.index() == 0:
            poison(state.step, buf.view(-1))
        inp = buf.detach().clone()

        def done(fut):
            record[bucket.index()] = (inp, fut.value().detach().clone())
            return fut.value()

        return ddp.quantization_hook(state, bucket).then(done)

    model.register_comm_hook(state, hook)
    return record


@pytest.mark.parametrize("baseline,times,chosen", [
    ("fp32", {"fp32": 0.1}, "fp32"),
    ("bf16", {"bf16": 0.1}, "bf16"),
    ("auto", {"fp32": 0.1, "bf16": 0.2}, "fp32"),
    ("auto", {"fp32": 0.2, "bf16": 0.1}, "bf16"),
])
def test_fallback_moves_a_slow_bucket_to_the_baseline(baseline, times, chosen, monkeypatch,
                                                       caplog):
    """The bucket whose codec lost the trial (on one rank) is averaged by the chosen baseline
    from the next step on, on every rank, as DDP's own hooks average it (the whole bucket cast
    to the baseline's dtype, divided, allreduced; a NaN or inf stays one); the others keep the
    codec; the parameters stay identical; the log and the stats name the baseline, its plan
    and the measured links; the decisions travel in state_dict()."""
    _force_fallback(monkeypatch, times)
    caplog.set_level(logging.INFO, logger="horovod_quant")
    n, rank = dist.get_world_size(), dist.get_rank()
    poisoned = FALLBACK_STEP + 2

    def poison(step, flat):
        if step == poisoned:
            flat[3] = float("nan") if rank == 0 else 1.0
            flat[5] = float("inf") if rank == n - 1 else 1.0

    model = _model()
    state = ddp.QuantizationState(hq.get_codec("qsgd", bits=4), seed=SEED, baseline=baseline,
                                  named_parameters=model.module.named_parameters())
    record = _hooked(model, state, poison)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(poisoned + 1):
        record.clear()
        state.stats.reset()
        opt.zero_grad()
        model(_batch(step)).square().mean().backward()
        if step > FALLBACK_STEP:
            inp, mean = record[0]
            want = inp.to(BASELINE_DTYPES[chosen]).div_(n)
            dist.all_reduce(want)
            assert torch.equal(mean, want.to(mean.dtype)) or (
                step == poisoned and torch.allclose(mean, want.to(mean.dtype), equal_nan=True))
            assert state.stats.fallen_back == 1
        if step == poisoned:
            assert torch.isnan(mean[3]) and torch.isinf(mean[5])
        else:
            opt.step()
            assert same_everywhere(_params(model))
    decisions = state.fallback_decisions
    assert [d.fallback for d in decisions] == [True] + [False] * (len(decisions) - 1)
    assert {d.baseline for d in decisions} == {chosen}
    assert state.fallback_baseline.baseline == chosen
    assert state.fallback_settled and state.fallback_step_check is None
    assert state.stats.baseline == f"{chosen} (torch.distributed gloo allreduce, {n} ranks)"
    if rank == 0:
        assert f"baseline {chosen} (torch.distributed gloo allreduce" in caplog.text
        assert "links measured:" in caplog.text
    resumed = ddp.QuantizationState(hq.get_codec("qsgd", bits=4), seed=SEED, baseline=baseline,
                                    named_parameters=model.module.named_parameters())
    resumed.load_state_dict(_round_trip(state.state_dict()))
    assert resumed.fallback_decisions == decisions
    assert resumed.fallback_baseline == state.fallback_baseline
    assert resumed.state_dict() == state.state_dict()  # the measured fabric too


def test_a_narrow_win_is_checked_in_training_steps(monkeypatch):
    """Codecs that won the trial by less than 2x: the next steps alternate the codec layout
    and every bucket on the baseline (the stats count them); the baseline's steps were the
    faster (fallback.clock forced), so every bucket falls back from then on, on every rank."""
    _force_fallback(monkeypatch, {"fp32": 0.1}, lambda bucket: 0.08)
    calls = itertools.count()

    def clock():  # (start, stop) pairs: the codec layout's steps 0.2 s, the baseline's 0.1 s
        pair, stop = divmod(next(calls), 2)
        return 10.0 * pair + stop * (0.2 if pair % 2 == 0 else 0.1)

    monkeypatch.setattr(fallback, "clock", clock)
    model = _model()
    state = ddp.QuantizationState(hq.get_codec("qsgd", bits=4), seed=SEED, baseline="fp32")
    model.register_comm_hook(state, ddp.quantization_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    on_baseline = []
    for step in range(FALLBACK_STEP + 2 * STEP_CHECK_ROUNDS + 3):
        state.stats.reset()
        opt.zero_grad()
        model(_batch(step)).square().mean().backward()
        opt.step()
        on_baseline.append(state.stats.fallen_back)
        assert same_everywhere(_params(model))
    buckets = len(state.fallback_decisions)
    assert buckets and not any(d.fallback for d in state.fallback_decisions)
    check = on_baseline[FALLBACK_STEP + 1:FALLBACK_STEP + 1 + 2 * STEP_CHECK_ROUNDS]
    assert check == [0, buckets] * STEP_CHECK_ROUNDS, on_baseline
    assert on_baseline[-2:] == [buckets, buckets]
    assert state.fallback_step_check.fallback and state.fallback_settled


def test_fallback_settings_are_checked():
    with pytest.raises(ValueError, match="baseline"):
        ddp.QuantizationState(hq.get_codec("qsgd"), baseline="fp8")
    with pytest.raises(ValueError, match="fallback"):
        ddp.QuantizationState(hq.get_codec("qsgd"), fallback="sometimes")
    with pytest.raises(ValueError, match="fusion_bytes"):
        ddp.QuantizationState(hq.get_codec("qsgd"), fusion_bytes=1)
    state = ddp.QuantizationState(hq.get_codec("qsgd"), fallback="never", baseline="fp16")
    assert state.options.baseline == "fp16" and state.fallback_settled
    assert state.fallback_decisions == [] and state.fallback_baseline is None
