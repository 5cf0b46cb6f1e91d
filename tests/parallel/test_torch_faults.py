"""Bad input and faults through the PyTorch doors: clear errors on every rank, never a hang."""
import horovod.torch as hvd
import numpy as np
import pytest
import torch

import horovod_quant.torch as hqt

from conftest import Linear, codec_params, rank_gradients

pytestmark = pytest.mark.size_independent
EVERYTHING = hqt.LayerPolicy.everything()


def _step(opt, model, grads):
    opt.zero_grad()
    model.loss(grads).backward()
    opt.step()


def test_config_mismatch_raises_on_every_rank():
    """At the first step (the constructor, as Horovod's, waits for no rank)."""
    model = Linear([(8, 8)])
    bits = 4 if hvd.rank() == 0 else 8
    opt = hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hqt.Compression.qsgd(bits=bits))
    if hvd.size() == 1:
        return
    with pytest.raises(ValueError, match="differs between ranks"):
        _step(opt, model, rank_gradients([(8, 8)], 0, hvd.rank()))


def test_config_mismatch_through_horovod_door():
    model = Linear([(8, 8)])
    seed = 1 if hvd.rank() == 0 else 2
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hqt.Compression.qsgd(seed=seed, policy=EVERYTHING))
    if hvd.size() == 1:
        return
    with pytest.raises(ValueError, match="differs between ranks"):
        _step(opt, model, rank_gradients([(8, 8)], 0, hvd.rank()))
    opt._handles.clear()


def test_world_too_large_for_width_fails_at_construction():
    with pytest.raises(ValueError, match="bits"):
        hqt.Compression.global_qsgd(bits=2, levels="linear", world_size=64)


def test_bad_gather_schedule_fails_at_construction():
    with pytest.raises(ValueError, match="allgather"):
        hqt.Compression.qsgd(gather="ring")


def test_unknown_codec_lists_valid_ones():
    with pytest.raises(AttributeError, match="qsgd"):
        hqt.Compression.qsdg


@pytest.mark.parametrize("name", ["qsgd", "natural", "global_qsgd", "dithered"])
@pytest.mark.parametrize("door", ["horovod", "quant"])
def test_nonfinite_zero_empty_and_unused(name, door):
    shapes = [(0,), (1,), (4, 300), (3, 3), (5,)]
    model = Linear(shapes)
    comp = hqt.Compression.__getattr__(name)(policy=EVERYTHING, **codec_params(name))
    wrap = hvd.DistributedOptimizer if door == "horovod" else hqt.DistributedOptimizer
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.0),
               named_parameters=model.named_parameters(), compression=comp)

    def run(grads):
        opt.zero_grad()
        # the last parameter gets no gradient (unused in this step)
        sum((p * torch.from_numpy(g)).sum()
            for p, g in zip(list(model.ps)[:4], grads[:4])).backward()
        if door == "horovod" and hvd.size() > 1:
            # Horovod's own optimizer requires a grad for every parameter it tracks
            model.ps[4].grad = torch.zeros(5)
        opt.step()

    grads = rank_gradients(shapes, 0, hvd.rank())
    grads[2][1, 7] = np.inf if hvd.rank() == 0 else 1.0
    run(grads)
    assert model.ps[0].grad.numel() == 0
    if hvd.size() > 1:
        assert not torch.isfinite(model.ps[2].grad).all(), "overflow must stay visible"
    # unused everywhere: like Horovod, every rank gets the (same) averaged gradient; here it
    # shares a quantization bucket with the overflow, so it may be non-finite too
    assert model.ps[4].grad is not None
    everyone = hvd.allgather(model.ps[4].grad.reshape(1, -1))
    assert all(np.array_equal(everyone[0].numpy(), e.numpy(), equal_nan=True) for e in everyone)
    run([np.zeros(s, np.float32) for s in shapes])
    for p in list(model.ps)[:4]:
        assert torch.equal(p.grad, torch.zeros_like(p)), "zero gradients decode to zeros"
    run(rank_gradients(shapes, 1, hvd.rank()))
    for p in list(model.ps)[:4]:
        assert torch.isfinite(p.grad).all()
