"""A whole DDP training job with the hook: resumed from a checkpoint (state_dict or a pickled
state) it continues bit for bit; bf16 and fp16 parameters, GradScaler's skipped steps and a
compiled model keep every rank identical; the hook returns before the bucket's exchange is done
(backward goes on meanwhile)."""
import io
import pickle
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import horovod_quant as hq
from horovod_quant.torch import ddp

from conftest import codec_params, same_everywhere
from test_ddp_exact import Net, Recorder, _batch, _model

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
        state = state or ddp.QuantizationState(codec, seed=SEED)
        model.register_comm_hook(state, ddp.quantization_hook)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), state

    model, opt, _ = fresh()
    _train(model, opt, range(n))
    straight = _params(model)

    model, opt, state = fresh()
    _train(model, opt, range(half))
    saved = {"model": model.state_dict(), "opt": opt.state_dict()}
    if how == "state_dict":
        saved["hook"] = state.state_dict()
        saved = _round_trip(saved)
        if name == "nested_dithered" and dist.get_world_size() > 1:
            assert saved["hook"]["codec_states"]  # it has adapted
        model, opt, state = fresh()
        state.load_state_dict(saved["hook"])
    else:
        pickled = pickle.dumps(state)
        saved = _round_trip(saved)
        model, opt, state = fresh(pickle.loads(pickled))
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    assert state.step == half
    _train(model, opt, range(half, n))
    assert torch.equal(_params(model), straight)
    assert same_everywhere(straight)


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

    state = ddp.QuantizationState(hq.get_codec("nested_dithered", **codec_params(
        "nested_dithered")), seed=SEED)
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
    state = ddp.QuantizationState(hq.get_codec("qsgd"), seed=SEED)
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
        state = ddp.QuantizationState(hq.get_codec("qsgd", bits=8), seed=SEED)
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
