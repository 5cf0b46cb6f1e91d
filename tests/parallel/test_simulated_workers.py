"""The simulated workers (horovod_quant/tools/simulated.py) give a real job's averaged gradients
bit for bit: hq.torch.DistributedOptimizer on these ranks and SimulatedWorkers in each rank's
process, for the same world shape (hosts x ranks per host, hierarchical where run.sh's 2 x 2
world has it), every codec, four steps (step counters, NDQSG's states carried over), the
default policy's uncompressed bias and small matrix, two buckets, one of them in two pieces.
The optimizer hands each bucket's mean over as the gradients (views, no copy); zero_grad keeps
them in two of the steps (set_to_none=False: backward accumulates into the bucket's buffer,
which the exchange must not read while it writes it).
Every rank recomputes every rank's gradients (a common part plus the rank's own, so NDQSG's
side information adapts)."""
import horovod.torch as hvd
import numpy as np
import pytest
import torch

import horovod_quant as hq
import horovod_quant.torch as hqt
from horovod_quant.tools.simulated import SimulatedWorkers

from conftest import codec_params

# buckets in backward order: b.weight first, in two pieces (NDQSG's state moves after the
# first), then a.weight; a.bias and c.weight travel uncompressed
SHAPES = {"a.weight": (30, 50), "a.bias": (30,), "b.weight": (40, 60), "c.weight": (8, 8)}
SETTINGS = {"seed": 11, "fusion_bytes": 6000, "pipeline_elems": 2000}


class Model(torch.nn.Module):
    """Parameters named as :data:`SHAPES`, whose gradients are chosen: loss = sum <p, g>."""

    def __init__(self):
        super().__init__()
        for layer in ("a", "b", "c"):
            setattr(self, layer, torch.nn.Module())
        for name, shape in SHAPES.items():
            layer, leaf = name.split(".")
            setattr(getattr(self, layer), leaf, torch.nn.Parameter(torch.zeros(shape)))

    def loss(self, grads):
        return sum((p * grads[n]).sum() for n, p in self.named_parameters())


def gradients(step, rank):
    common = np.random.default_rng([step, 77])
    own = np.random.default_rng([step, rank, 78])
    return {n: torch.from_numpy((common.standard_normal(s) + 0.1 * own.standard_normal(s))
                                .astype(np.float32)) for n, s in SHAPES.items()}


@pytest.mark.parametrize("name", hq.available_codecs())
def test_simulated_workers_equal_the_real_ranks(name):
    model = Model()
    opt = hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hq.get_codec(name, **codec_params(name)),
                                   fallback="never", **SETTINGS)
    sim = SimulatedWorkers(model.named_parameters(), opt.codec, hvd.size(), hvd.cross_size(),
                           options=opt.options, fabric=opt.fabric)
    for step in range(4):
        opt.zero_grad(set_to_none=step in (0, 3))
        model.loss(gradients(step, hvd.rank())).backward()
        opt.step()
        want = sim.average([gradients(step, r) for r in range(hvd.size())])
        if hvd.size() == 1:
            continue  # a one-rank optimizer exchanges nothing
        for n, p in model.named_parameters():
            raw = n not in ",".join(sim.bucket_keys).split(",")
            if raw and hvd.size() > 2:  # Horovod's float sum, in its order
                tol = 2e-3 if name == "fp16" else 1e-5
                np.testing.assert_allclose(p.grad.numpy(), want[n].numpy(), rtol=tol, atol=tol)
            else:
                assert torch.equal(p.grad, want[n]), (name, step, n)
            if not raw:  # handed over: a view of its bucket's mean
                mean = opt._exchanger.layout.bucket_of[id(p)].mean
                assert np.shares_memory(p.grad.numpy(), mean), (name, step, n)
    assert sim.topology == opt.topology  # (known from the first step on)
    assert sim.bucket_keys in ([], ["b.weight", "a.weight"])  # none, fp16: Horovod's
    assert sim.codec_states[hvd.rank()].state_dict() == opt.codec_states.state_dict()
