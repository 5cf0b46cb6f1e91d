"""A short data-parallel training run converges like the uncompressed one for 8-bit codecs."""
import horovod.torch as hvd
import pytest
import torch

import horovod_quant.torch as hqt

from conftest import codec_params

# training quality: the exchanges it runs are checked bit for bit under every controller
# (test_torch_exact.py)
pytestmark = [pytest.mark.controller_independent, pytest.mark.size_independent]

EIGHT_BIT = [("qsgd", {"bits": 8}), ("nuqsgd", {"bits": 8}), ("natural", {"bits": 8}),
             ("natural_dithering", {"bits": 8}), ("global_qsgd", {"bits": 8}),
             ("dithered", {"bits": 8})]
STEPS = 60


def _data():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    shard = slice(hvd.rank(), None, hvd.size())
    return x[shard], y[shard], x, y


def _train(compression):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=compression,
                                   fallback="never")  # train with the codec, whatever it costs
    x, y, x_all, y_all = _data()
    gen = torch.Generator().manual_seed(hvd.rank())
    for _ in range(STEPS):
        idx = torch.randint(0, x.shape[0], (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(x_all), y_all).item()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(params.reshape(1, -1))
    assert all(torch.equal(everyone[0], everyone[r]) for r in range(everyone.shape[0]))
    return loss


@pytest.fixture(scope="module")
def baseline_loss():
    return _train(hqt.Compression.none())


@pytest.mark.parametrize("name,params", EIGHT_BIT)
def test_eight_bit_training_matches_uncompressed(name, params, baseline_loss):
    loss = _train(hqt.Compression.__getattr__(name)(**params, **codec_params(name)))
    # stated tolerance: within 0.05 nats (or 15 %) of the fp32 run after 60 steps
    assert loss <= max(baseline_loss + 0.05, baseline_loss * 1.15), (name, loss, baseline_loss)
