"""A whole training job through the Horovod torch doors: synchronize() before step() exchanges
once, backward_passes_per_step changes between steps, a job resumed from a checkpoint continues
bit for bit, layers frozen and unfrozen between steps, fp16 and bf16 gradients and parameters,
GradScaler's skipped steps and a compiled model keep every rank identical."""
import functools
import io
import json
import time
import warnings

import horovod.torch as hvd
import numpy as np
import pytest
import torch

import horovod_quant as hq
import horovod_quant.torch as hqt
from horovod_quant import fallback
from horovod_quant.core.rng import payload_seed
from horovod_quant.torch.optimizer import STATE_KEY

from conftest import Linear, codec_params, rank_gradients

# the optimizer's job logic (synchronize, checkpoints, GradScaler, compile, frozen layers):
# the exchanges it runs are checked bit for bit under every controller (test_torch_exact.py)
pytestmark = [pytest.mark.controller_independent, pytest.mark.size_independent]

EVERYTHING = hqt.LayerPolicy.everything()
SHAPES = [(40, 50), (30, 20)]  # one bucket each (fusion_bytes=1), reversed: ps.1 is bucket 0
SEED = 5


def _same_everywhere(t):
    everyone = hvd.allgather(t.detach().float().reshape(1, -1))
    return all(torch.equal(everyone[0], e) for e in everyone)


def _params(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def correlated_gradients(shapes, step, rank):
    """A common part plus a little of each rank's own: NDQSG's coarse ratio adapts to it."""
    common = rank_gradients(shapes, step, 0)
    own = rank_gradients(shapes, step, rank + 1)
    return [c + np.float32(0.01) * o for c, o in zip(common, own)]


def _optimizer(model, name, momentum=0.9, **kw):
    params = {**codec_params(name), **kw.pop("codec", {})}
    comp = getattr(hqt.Compression, name)(seed=SEED, policy=EVERYTHING, **params)
    return hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                    momentum=momentum),
                                    named_parameters=model.named_parameters(), compression=comp,
                                    fusion_bytes=1, **{"fallback": "never", **kw})


# -- synchronize() and step() -------------------------------------------------------------------
def _compressed(model, name, momentum=0.9, **codec):
    """Horovod's optimizer with ``compression=`` a horovod_quant compressor; (optimizer,
    compressor)."""
    comp = getattr(hqt.Compression, name)(seed=SEED, policy=EVERYTHING, **codec_params(name),
                                          **codec)
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                    momentum=momentum),
                                    named_parameters=model.named_parameters(),
                                    compression=comp), comp


def _clipped_run(explicit_skip, door="optimizer"):
    torch.manual_seed(0)
    model = Linear(SHAPES)
    opt = _optimizer(model, "qsgd") if door == "optimizer" else _compressed(model, "qsgd")[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            opt.zero_grad()
            model.loss(rank_gradients(SHAPES, step, hvd.rank())).backward()
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            if explicit_skip:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
    ours = [w for w in caught if "skip_synchronize" in str(w.message)]
    return _params(model), opt, ours


def test_synchronize_then_step_exchanges_once():
    """step() after synchronize() without skip_synchronize(): one warning, no second exchange,
    the step (the seeds) counted once: the same parameters as with skip_synchronize()."""
    want, opt_skip, none = _clipped_run(explicit_skip=True)
    got, opt, warned = _clipped_run(explicit_skip=False)
    assert torch.equal(got, want)
    assert opt._exchanger.step == opt_skip._exchanger.step == 3
    assert none == [] and len(warned) == 1
    assert _same_everywhere(got)


def test_compression_synchronize_then_step_exchanges_once():
    """Horovod's optimizer with compression=: step() after synchronize() warns (Horovod's
    warning, once a step) and averages again, which gives the averaged gradients back
    unchanged: the same parameters and use counters (seeds) as with skip_synchronize()."""
    want, opt_skip, none = _clipped_run(explicit_skip=True, door="compression")
    got, opt, warned = _clipped_run(explicit_skip=False, door="compression")
    assert torch.equal(got, want)
    assert opt._compression._uses == opt_skip._compression._uses == {"ps.0": 3, "ps.1": 3}
    assert none == [] and (len(warned) == 3 if hvd.size() > 1 else warned == [])
    assert _same_everywhere(got)


def test_backward_passes_per_step_changes_between_steps():
    """set_backward_passes_per_step(2): two local passes make one exchange of their sum, as in
    Horovod; the ranks stay identical and the exchange is mean_estimate's."""
    torch.manual_seed(0)
    model = Linear(SHAPES)
    opt = hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(),
                                   compression=hqt.Compression.qsgd(seed=SEED, policy=EVERYTHING),
                                   fusion_bytes=1, fallback="never")
    opt.zero_grad()
    model.loss(rank_gradients(SHAPES, 0, hvd.rank())).backward()
    opt.step()
    opt.set_backward_passes_per_step(2)
    opt.zero_grad()
    for micro in (1, 2):
        model.loss(rank_gradients(SHAPES, micro, hvd.rank())).backward()
    opt.synchronize()
    if hvd.size() > 1:
        sums = [rank_gradients(SHAPES, 1, r)[1] + rank_gradients(SHAPES, 2, r)[1]
                for r in range(hvd.size())]
        want, _ = hq.mean_estimate(hq.get_codec("qsgd"), [s.reshape(-1) for s in sums],
                                   seed=payload_seed(SEED, 1, "ps.1"), gather="auto",
                                   pipeline_elems=opt.pipeline_elems, topology=opt.topology)
        assert np.array_equal(model.ps[1].grad.reshape(-1).numpy(), want)
    with opt.skip_synchronize():
        opt.step()
    if hvd.size() > 1:  # a one-rank optimizer hooks nothing
        with pytest.raises(AssertionError, match="backward_passes_per_step"):
            for micro in range(3):
                model.loss(rank_gradients(SHAPES, 3 + micro, hvd.rank())).backward()
        # the ranks' exchanges stopped part-way: the optimizer goes on no more
        with pytest.raises(RuntimeError, match="stopped at an error .*AssertionError"):
            opt.step()
    assert _same_everywhere(_params(model))
    with pytest.raises(ValueError, match="must be >= 1"):
        opt.set_backward_passes_per_step(0)


# -- resuming from a checkpoint -----------------------------------------------------------------
def _round_trip(obj):
    """``obj`` through torch.save / torch.load (torch's own checkpoint format)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def _run_steps(model, opt, steps, gradients=correlated_gradients):
    for step in steps:
        opt.zero_grad()
        model.loss(gradients(SHAPES, step, hvd.rank())).backward()
        opt.step()


RESUMED = [("qsgd", {}, "never"), ("nested_dithered", {"bits": 6}, "never"),
           ("qsgd", {}, "auto")]


@pytest.mark.parametrize("name,params,mode", RESUMED)
def test_optimizer_resumes_bit_for_bit(name, params, mode, monkeypatch):
    """N steps straight, or N/2, a checkpoint, new model and optimizer, N/2 more: the same
    parameters, bit for bit, on every rank (the step, NDQSG's adaptive state and the
    fallback's decisions travel in the optimizer's state_dict)."""
    if mode == "auto":  # bucket 0 is slower with its codec, bucket 1 clearly faster
        monkeypatch.setattr(fallback, "measure_bucket", lambda trial, sides, **_: [
            {"codec": 0.05 if trial.bucket == 0 else 0.01}.get(side, 0.04) for side in sides])
    n, half = 6, 3

    def fresh():
        torch.manual_seed(0)
        model = Linear(SHAPES)
        return model, _optimizer(model, name, codec=params, fallback=mode)

    model, opt = fresh()
    _run_steps(model, opt, range(n))
    straight = _params(model)

    model, opt = fresh()
    _run_steps(model, opt, range(half))
    saved = _round_trip({"model": model.state_dict(), "opt": opt.state_dict()})
    own = saved["opt"]["param_groups"][0][STATE_KEY]
    assert own["step"] == half and own["world_size"] == hvd.size()
    if name == "nested_dithered" and hvd.size() > 1:
        assert own["codec_states"]  # it has adapted
    model, opt = fresh()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    if mode == "auto" and hvd.size() > 1:
        assert [d.fallback for d in opt.fallback_decisions] == [True, False]
    _run_steps(model, opt, range(half, n))
    assert torch.equal(_params(model), straight)
    assert _same_everywhere(straight)


def _job(door, name, momentum=0.9, **codec):
    """A new model and its optimizer through ``door`` (hq's "optimizer", or Horovod's with
    "compression"): (model, optimizer, compressor or None)."""
    torch.manual_seed(0)
    model = Linear(SHAPES)
    if door == "optimizer":
        return model, _optimizer(model, name, momentum=momentum, codec=codec), None
    return (model, *_compressed(model, name, momentum, **codec))


def _checkpoint(model, opt, comp):
    """The job's checkpoint, through torch.save / torch.load."""
    return _round_trip({"model": model.state_dict(), "opt": opt.state_dict(),
                        "compression": None if comp is None else comp.state_dict()})


def _straight_and_saved(fresh, n, half):
    """The parameters after ``n`` steps of a ``fresh()`` job, and the checkpoint of another
    after ``half``."""
    model, opt, _ = fresh()
    _run_steps(model, opt, range(n))
    straight = _params(model)
    model, opt, comp = fresh()
    _run_steps(model, opt, range(half))
    return straight, _checkpoint(model, opt, comp)


def _horovod_resume(fresh, saved, steps, broadcast_state):
    """Horovod's recipe: a ``fresh()`` job, the checkpoint ``saved`` loaded on rank 0 alone,
    Horovod's broadcasts of the parameters and the optimizer state (and
    ``hqt.broadcast_state`` where asked), then ``steps``. Returns the parameters."""
    model, opt, comp = fresh()
    if hvd.rank() == 0:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        if comp is not None:
            comp.load_state_dict(saved["compression"])
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # first: docs/dev/jobs.md
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if broadcast_state:
        hqt.broadcast_state(opt, root_rank=0)
    _run_steps(model, opt, steps)
    return _params(model)


@pytest.mark.parametrize("door,momentum,broadcast_state", [
    ("optimizer", 0.9, False), ("optimizer", 0.0, True), ("compression", 0.9, True)])
def test_horovod_recipe_resumes_bit_for_bit(door, momentum, broadcast_state):
    """Horovod's resume recipe: the checkpoint loaded on rank 0 alone, then broadcast. The hq
    optimizer's own state rides in its state_dict's first parameter group, where
    hvd.broadcast_optimizer_state carries it; where Horovod broadcasts nothing (plain SGD,
    stateless) and for compression= (the compressor's state), hqt.broadcast_state carries
    it. The job continues bit for bit as the uninterrupted one, on every rank."""
    fresh = functools.partial(_job, door, "nested_dithered", momentum)
    straight, saved = _straight_and_saved(fresh, 6, 3)
    resumed = _horovod_resume(fresh, saved, range(3, 6), broadcast_state)
    assert torch.equal(resumed, straight)
    assert _same_everywhere(resumed)


@pytest.mark.parametrize("door", ["optimizer", "compression"])
def test_checkpoint_on_rank_0_alone_raises_on_every_rank_within_seconds(door):
    """Rank 0 loads a checkpoint and its horovod_quant state is not broadcast (a stateless
    SGD, which Horovod's broadcast skips; no hqt.broadcast_state): at the first step every
    rank raises, within seconds, an error naming each rank's step and the fix."""
    if hvd.size() == 1:
        return
    fresh = functools.partial(_job, door, "qsgd", 0.0)
    model, opt, comp = fresh()
    _run_steps(model, opt, range(3))
    saved = _checkpoint(model, opt, comp)
    start = time.monotonic()
    with pytest.raises(ValueError) as raised:
        _horovod_resume(fresh, saved, range(3, 4), broadcast_state=False)
    assert time.monotonic() - start < 30
    # either door's configuration check (the optimizer's at its first synchronize()) names them
    _same_message_naming_the_steps(str(raised.value), {0: 3}, 0, "is at")


def _same_message_naming_the_steps(message, ahead, step, at="at"):
    """Every rank raised ``message``, naming each rank's step (``ahead``: the ranks not at
    ``step``) and the fix, the same on every rank (hierarchical exchanges too)."""
    everyone = hvd.allgather_object(message)
    steps = ", ".join(f"rank {r} {at} step {ahead.get(r, step)}" for r in range(hvd.size()))
    assert steps in message and "broadcast the optimizer state" in message, message
    assert all(m == everyone[0] for m in everyone)


@pytest.mark.parametrize("door", ["optimizer", "compression"])
def test_a_rank_one_step_ahead_raises_on_every_rank_within_seconds(door):
    """Every rank loads a checkpoint, rank 0 one a step later (the others' counters behind its
    own): every rank raises the same out-of-step error within seconds, at the first exchange
    whose tags differ, and the optimizer goes on no more."""
    if hvd.size() == 1:
        return
    model, opt, comp = _job(door, "qsgd")
    _run_steps(model, opt, range(2))
    if hvd.rank() == 0:  # one step ahead of the others from here on
        if comp is None:
            saved = opt.state_dict()
            saved["param_groups"][0][STATE_KEY]["step"] += 1
            opt.load_state_dict(saved)
        else:  # the compressor's counters (loads come before its first step)
            comp._uses = {k: v + 1 for k, v in comp._uses.items()}
    start = time.monotonic()
    with pytest.raises(ValueError) as raised:
        _run_steps(model, opt, range(2, 3))
    message = str(raised.value)
    assert time.monotonic() - start < 30
    _same_message_naming_the_steps(message, {0: 3}, 2)
    with pytest.raises(RuntimeError, match="stopped at an error"):
        if comp is None:
            _run_steps(model, opt, range(3, 4))
        else:  # Horovod's optimizer keeps its own handles; the compressor refuses
            comp.compress(torch.ones(3))


def _as_if_saved_at(own, world):
    """``own`` (an optimizer's or compressor's state) as a job of ``world`` ranks saved it."""
    own["codec_states"] = {json.dumps({**json.loads(k), "world_size": world}, sort_keys=True): v
                           for k, v in own["codec_states"].items()}
    own["world_size"] = world


@pytest.mark.parametrize("door", ["optimizer", "compression"])
def test_a_state_saved_at_another_world_size_is_adapted_with_one_warning(door):
    """NDQSG's state saved by a job of another world size (here: this job's, relabelled as
    one rank more's) is carried to the codec built for this one, with one warning naming
    both sizes: the run continues as the uninterrupted one, so nothing was dropped."""
    if hvd.size() == 1:
        return
    n, half, other = 4, 2, hvd.size() + 1
    fresh = functools.partial(_job, door, "nested_dithered", bits=6)
    straight, saved = _straight_and_saved(fresh, n, half)
    own = saved["compression"] or saved["opt"]["param_groups"][0][STATE_KEY]
    assert own["codec_states"]
    _as_if_saved_at(own, other)
    model, opt, comp = fresh()
    model.load_state_dict(saved["model"])
    with pytest.warns(UserWarning) as caught:
        opt.load_state_dict(saved["opt"])
        if comp is not None:
            comp.load_state_dict(saved["compression"])
    ours = [str(w.message) for w in caught if "world size" in str(w.message)]
    want = f"saved at world size {other} and is loaded at world size {hvd.size()}"
    assert len(ours) == 1 and want in ours[0], ours
    _run_steps(model, opt, range(half, n))
    assert torch.equal(_params(model), straight)


def test_a_plain_torch_state_dict_still_loads():
    """The wrapped optimizer's own state dict (no horovod_quant key) loads as in torch."""
    torch.manual_seed(0)
    model = Linear(SHAPES)
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = _optimizer(model, "qsgd")
    _run_steps(model, opt, range(1))
    opt.load_state_dict(plain.state_dict())
    groups = opt.state_dict()["param_groups"]
    assert opt._exchanger.step == 1 and groups[0].pop(STATE_KEY)["step"] == 1
    assert groups == plain.state_dict()["param_groups"]


def test_compressor_resumes_bit_for_bit():
    """Horovod's optimizer with compression=: the compressor's use counters (the seeds) and
    codec states in its state_dict, beside the model's and the optimizer's."""
    n, half = 4, 2
    fresh = functools.partial(_job, "compression", "nested_dithered", 0.0, bits=6)
    straight, saved = _straight_and_saved(fresh, n, half)
    model, opt, comp = fresh()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    comp.load_state_dict(saved["compression"])
    _run_steps(model, opt, range(half, n))
    assert torch.equal(_params(model), straight)
    assert _same_everywhere(straight)


# -- low precision, AMP, torch.compile ----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_gradients_are_encoded_from_their_dtype(dtype):
    """fp16 / bf16 parameters: each bucket's gradients (their own dtype, as float32 values) go
    through the codec and its mean comes back in their dtype, on every rank; Horovod's path
    (the exempt biases) carries them too."""
    torch.manual_seed(0)
    model = Linear(SHAPES).to(dtype)
    bias = torch.nn.Parameter(torch.zeros(7, dtype=dtype))  # exempt: Horovod's allreduce
    opt = hqt.DistributedOptimizer(
        torch.optim.SGD(list(model.parameters()) + [bias], lr=0.1),
        named_parameters=list(model.named_parameters()) + [("bias", bias)],
        compression=hqt.Compression.qsgd(seed=SEED, policy=hqt.LayerPolicy(min_elements=100)),
        fusion_bytes=1, fallback="never")
    for step in range(2):
        opt.zero_grad()
        grads = rank_gradients(SHAPES, step, hvd.rank())
        (model.loss(grads) + bias.float().sum()).backward()
        opt.synchronize()
        for j, p in enumerate(model.ps):
            assert p.grad.dtype == dtype
            flats = [torch.from_numpy(rank_gradients(SHAPES, step, r)[j]).to(dtype).float()
                     .reshape(-1).numpy() for r in range(hvd.size())]
            want = flats[0]  # a one-rank optimizer exchanges nothing
            if hvd.size() > 1:
                want, _ = hq.mean_estimate(hq.get_codec("qsgd"), flats,
                                           seed=payload_seed(SEED, step, f"ps.{j}"), gather="auto",
                                           pipeline_elems=opt.pipeline_elems,
                                           topology=opt.topology)
            assert torch.equal(p.grad.reshape(-1), torch.from_numpy(want).to(dtype)), (j, step)
        assert bias.grad.dtype == dtype and torch.equal(bias.grad, torch.ones_like(bias))
        with opt.skip_synchronize():
            opt.step()
    assert _same_everywhere(_params(model)) and _same_everywhere(bias)


def _mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 4)).to(dtype)


def _batch(step, dtype=torch.float32):
    gen = torch.Generator().manual_seed(100 * step + hvd.rank())
    return torch.randn(16, 32, generator=gen).to(dtype)


def _door(door, model):
    """SGD over ``model`` with qsgd 8 bits through ``door``: "optimizer" (hq's, no fallback)
    or "compression" (Horovod's optimizer with the compressor)."""
    base = torch.optim.SGD(model.parameters(), lr=0.05)
    comp = hqt.Compression.qsgd(seed=SEED, bits=8)
    if door == "optimizer":
        return hqt.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                        compression=comp, fallback="never")
    return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                    compression=comp)


@pytest.mark.parametrize("door", ["optimizer", "compression"])
def test_grad_scaler_skips_an_overflow_step_on_every_rank(door):
    """fp16 autocast and GradScaler, Horovod's recipe (synchronize, unscale_, step inside
    skip_synchronize): one rank's overflow makes the averaged gradient non-finite on every
    rank, so every rank skips that step and lowers the scale alike."""
    model = _mlp()
    opt = _door(door, model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for step in range(4):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(_batch(step)).square().mean()
        if step == 2 and hvd.rank() == 0:
            loss = loss * float("inf")  # this rank overflows
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        before = _params(model)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        assert torch.equal(_params(model), before) == (step == 2), step
        assert _same_everywhere(torch.tensor([scaler.get_scale()]))
        assert _same_everywhere(_params(model))


@pytest.mark.parametrize("door", ["optimizer", "compression"])
def test_bf16_parameters_train_identically(door):
    """bf16 parameters through both doors: the codec encodes the bf16 gradients; what Horovod's
    allreduce carries (the biases, exact) travels as float32, since Horovod's CPU operations
    refuse bfloat16; the parameters stay bf16 and every rank identical."""
    model = _mlp(torch.bfloat16)
    opt = _door(door, model)
    first = _params(model)
    for step in range(3):
        opt.zero_grad()
        model(_batch(step, torch.bfloat16)).float().square().mean().backward()
        opt.step()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert not torch.equal(_params(model), first)
    assert _same_everywhere(_params(model))


def test_compiled_model_trains_identically():
    """torch.compile'd model, hq.DistributedOptimizer: the gradient hooks fire as for the
    eager model (every step exchanged), the ranks stay identical and the run is close to the
    eager one (the compiled graph orders its float operations otherwise)."""
    results = []
    for compiled in (False, True):
        model = _mlp()
        opt = hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(),
                                       compression=hqt.Compression.qsgd(seed=SEED, bits=8),
                                       fallback="never")
        run = torch.compile(model, backend="aot_eager") if compiled else model
        for step in range(3):
            opt.zero_grad()
            run(_batch(step)).square().mean().backward()
            opt.step()
        assert opt._exchanger.step == 3
        results.append(_params(model))
    assert torch.allclose(results[0], results[1], rtol=0, atol=1e-2)
    assert _same_everywhere(results[1])


@pytest.mark.parametrize("named", [True, False])
def test_layers_frozen_and_unfrozen_between_steps(named):
    """requires_grad changed between steps (fine-tuning): an unfrozen parameter's first
    gradient is Horovod's exact average, then it joins the bucket; a frozen one keeps no
    gradient and does not move (SGD with momentum), and leaves the bucket; every step's bucket
    is mean_estimate's."""
    model = Linear(SHAPES)
    first, second = model.ps
    first.requires_grad_(False)
    opt = hqt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters() if named else None,
        compression=hqt.Compression.qsgd(seed=SEED, policy=EVERYTHING), fallback="never")
    codec = hq.get_codec("qsgd")
    # step -> (parameter trainable before it, parameters in the step's bucket, in bucket order)
    plan = {0: ({0: False, 1: True}, [1]), 1: ({0: True, 1: True}, [1]),
            2: ({0: True, 1: True}, [1, 0]), 3: ({0: True, 1: False}, [1, 0]),
            4: ({0: True, 1: False}, [0])}
    for step, (trainable, bucket) in plan.items():
        for i, p in enumerate(model.ps):
            p.requires_grad_(trainable[i])
        frozen_before = second.detach().clone()
        opt.zero_grad()
        model.loss(rank_gradients(SHAPES, step, hvd.rank())).backward()
        opt.step()
        if hvd.size() == 1:
            continue
        per_rank = [rank_gradients(SHAPES, step, r) for r in range(hvd.size())]
        flats = [np.concatenate([g[i].reshape(-1) if trainable[i] else np.zeros(g[i].size,
                                                                                 np.float32)
                                 for i in bucket]) for g in per_rank]
        # the bucket's key: its parameters' names (unnamed: param.<i> in the order the
        # optimizer met them, the frozen first one last)
        names = ",".join((f"ps.{i}" if named else f"param.{1 - i}") for i in bucket)
        want, _ = hq.mean_estimate(codec, flats, seed=payload_seed(SEED, step, names),
                                   gather="auto", topology=opt.topology)
        got = np.concatenate([model.ps[i].grad.reshape(-1).numpy() if trainable[i]
                              else np.zeros(model.ps[i].numel(), np.float32) for i in bucket])
        assert np.array_equal(got, want), step
        if step == 1:  # unfrozen this step: Horovod's average of the whole gradient
            np.testing.assert_allclose(first.grad.numpy(),
                                       np.mean([g[0] for g in per_rank], axis=0),
                                       rtol=1e-6, atol=1e-6)
        if not trainable[1]:
            assert second.grad is None
            assert torch.equal(second.detach(), frozen_before), step
    for p in model.ps:
        assert _same_everywhere(p)
