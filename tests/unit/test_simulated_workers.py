"""The simulated workers (``horovod_quant/tools/simulated.py``) at 8 to 64 workers, without
Horovod: every codec runs and gives finite means of the right shapes, the mean is close to
the exact one and closer still averaged over steps, one bucket is mean_estimate's with the
optimizer's seed at every step, and the settings are checked. tests/parallel/
test_simulated_workers.py shows them equal to a real job's, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import horovod_quant as hq  # noqa: E402
from horovod_quant.core.registry import codec_class  # noqa: E402
from horovod_quant.core.rng import payload_seed  # noqa: E402
from horovod_quant.doors import DoorOptions  # noqa: E402
from horovod_quant.exchange.codec_states import CodecStates  # noqa: E402
from horovod_quant.exchange.topology import Topology  # noqa: E402
from horovod_quant.policy import LayerPolicy  # noqa: E402
from horovod_quant.tools.simulated import SimulatedWorkers  # noqa: E402


def codec(name: str, workers: int) -> hq.Codec:
    params = {"world_size": workers} if codec_class(name).needs_world_size else {}
    return hq.get_codec(name, **params)


def model() -> torch.nn.Module:
    """A weight of 2400 elements (compressed), a bias and a small matrix (uncompressed by the
    default policy)."""
    return torch.nn.Sequential(torch.nn.Linear(60, 40), torch.nn.Linear(40, 4))


def worker_gradients(m: torch.nn.Module, workers: int, step: int) -> list[dict]:
    """Each worker's gradients: a common part plus its own noise, as shards of one batch."""
    common = {n: np.random.default_rng([step, 1, i]).standard_normal(p.shape)
              for i, (n, p) in enumerate(m.named_parameters())}
    return [{n: torch.from_numpy((g + 0.3 * np.random.default_rng([step, 2, r, i])
                                  .standard_normal(g.shape)).astype(np.float32))
             for i, (n, g) in enumerate(common.items())} for r in range(workers)]


def exact_mean(grads: list[dict], name: str) -> np.ndarray:
    return np.mean([g[name].numpy() for g in grads], axis=0, dtype=np.float64)


@pytest.mark.parametrize("name", hq.available_codecs())
def test_every_codec_runs_at_eight_workers(name: str) -> None:
    m = model()
    sim = SimulatedWorkers(m.named_parameters(), codec(name, 8), 8, hosts=2)
    for step in range(2):
        out = sim.average(worker_gradients(m, 8, step))
        assert list(out) == [n for n, _ in m.named_parameters()]
        for n, p in m.named_parameters():
            assert out[n].shape == p.shape and out[n].dtype == p.dtype
            assert torch.isfinite(out[n]).all(), (name, n)
    assert sim.step == 2
    assert sim.topology == Topology.grid(2, 4)


@pytest.mark.parametrize("name,hosts", [("qsgd", 1), ("global_qsgd", 8), ("nested_dithered", 1)])
def test_sixty_four_workers_average_close_to_the_exact_mean(name: str, hosts: int) -> None:
    """At 64 workers one step's mean is near the exact mean, and the mean of 8 steps' means
    (8 seeds) nearer: the estimate is unbiased up to the noise the steps average out."""
    m = model()
    sim = SimulatedWorkers(m.named_parameters(), codec(name, 64), 64, hosts=hosts)
    grads = worker_gradients(m, 64, 0)
    weight = "0.weight"
    want = exact_mean(grads, weight)
    means = [sim.average(grads)[weight].numpy() for _ in range(8)]
    error = np.linalg.norm(means[0] - want) / np.linalg.norm(want)
    averaged = np.linalg.norm(np.mean(means, axis=0) - want) / np.linalg.norm(want)
    assert error < 0.5, error  # Global-QSGD's linear levels at 8 hosts: 0.29
    assert averaged < error, (averaged, error)
    assert sim.last_wire_bytes < want.size * 4  # compressed
    bias = "0.bias"  # uncompressed: the exact mean
    np.testing.assert_allclose(sim.average(grads)[bias].numpy(), exact_mean(grads, bias),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hosts", [1, 4])
def test_one_bucket_is_mean_estimate_with_the_optimizers_seed(hosts: int) -> None:
    """One compressed parameter: its mean at step t is mean_estimate's with seed
    payload_seed(seed, t, its name), pieces, topology and codec states carried over."""
    m = torch.nn.Linear(100, 30, bias=False)
    nested = codec("nested_dithered", 16)
    options = DoorOptions(seed=7, pipeline_elems=1000)
    sim = SimulatedWorkers(m.named_parameters(), nested, 16, hosts=hosts, options=options)
    states = [CodecStates() for _ in range(16)]
    for step in range(3):
        grads = worker_gradients(m, 16, step)
        got = sim.average(grads)["weight"].numpy().reshape(-1)
        want, _ = hq.mean_estimate(nested, [g["weight"].numpy().reshape(-1) for g in grads],
                                   seed=payload_seed(7, step, "weight"), gather="auto",
                                   pipeline_elems=1000, topology=sim.topology, states=states)
        assert np.array_equal(got, want), step
    assert [s.state_dict() for s in sim.codec_states] == [s.state_dict() for s in states]


def test_flat_vectors_and_dicts_give_the_same_means() -> None:
    m = model()
    grads = worker_gradients(m, 8, 0)
    flats = [torch.cat([g[n].reshape(-1) for n, _ in m.named_parameters()]) for g in grads]
    a, b = (SimulatedWorkers(m.named_parameters(), codec("qsgd", 8), 8) for _ in range(2))
    by_name, by_vector = a.average(grads), b.average(flats)
    assert all(torch.equal(by_name[n], by_vector[n]) for n in by_name)


def test_the_layout_follows_the_policy_and_fusion_bytes() -> None:
    m = model()
    options = DoorOptions(policy=LayerPolicy.everything(), fusion_bytes=1)
    sim = SimulatedWorkers(m.named_parameters(), codec("qsgd", 4), 4, options=options)
    assert sim.bucket_keys == ["1.bias", "1.weight", "0.bias", "0.weight"]  # backward order
    assert SimulatedWorkers(m.named_parameters(), codec("qsgd", 4), 4).bucket_keys == \
        ["0.weight"]


def test_wrong_settings_raise() -> None:
    m = model()
    with pytest.raises(ValueError, match="world_size=8"):
        SimulatedWorkers(m.named_parameters(), codec("global_qsgd", 8), 16)
    with pytest.raises(ValueError, match="hosts"):
        SimulatedWorkers(m.named_parameters(), codec("qsgd", 8), 8, hosts=3)
    sim = SimulatedWorkers(m.named_parameters(), codec("qsgd", 8), 8)
    with pytest.raises(ValueError, match="7 workers"):
        sim.average(worker_gradients(m, 7, 0))
