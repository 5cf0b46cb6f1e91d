"""The DDP door under the trust issue's cases: every rank ends with the bit-identical result or
the same clear error, never a silent difference or a hang."""
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import horovod_quant as hq
import horovod_quant.torch as hqt
from horovod_quant.exchange import Exchange
from horovod_quant.policy import LayerPolicy
from horovod_quant.torch import ddp
from horovod_quant.torch.distributed import PointToPoint, ProcessGroupCollectives

from conftest import codec_params, same_everywhere
from test_ddp_exact import Net, Recorder, _batch, _model

MULTI = pytest.mark.usefixtures("several_ranks")


def _backward(model, step=0):
    model(_batch(step)).square().mean().backward()


@MULTI
@pytest.mark.parametrize("what", ["seed", "codec", "bits", "policy", "names"])
def test_config_mismatch_raises_on_every_rank(what):
    rank = dist.get_rank()
    codec = {"codec": hq.get_codec("qsgd" if rank == 0 else "natural"),
             "bits": hq.get_codec("qsgd", bits=8 if rank == 0 else 4)}.get(
                 what, hq.get_codec("qsgd"))
    model = _model()
    named = [(f"rank{rank}.{n}" if what == "names" and n.endswith("c.bias") else n, p)
             for n, p in model.named_parameters()]
    state = ddp.QuantizationState(
        codec, seed=rank if what == "seed" else 0, named_parameters=named,
        policy=LayerPolicy(min_elements=1024 if what != "policy" or rank == 0 else 16))
    model.register_comm_hook(state, ddp.quantization_hook)
    with pytest.raises(Exception, match="configuration differs between ranks"):
        _backward(model)


@MULTI
def test_ranks_that_send_other_tensors_raise_on_every_rank():
    comm = ProcessGroupCollectives()
    exchange = Exchange(hq.get_codec("qsgd"), comm)
    x = np.ones(100 + dist.get_rank(), np.float32)
    with pytest.raises(ValueError, match="the ranks sent different tensors"):
        exchange.start(x, 1, "t").wait()


@pytest.mark.parametrize("name", ["qsgd", "global_qsgd", "nested_dithered", "bf16"])
def test_nonfinite_gradients_stay_nonfinite(name):
    codec = hq.get_codec(name, **codec_params(name))
    model = _model()
    state = ddp.QuantizationState(codec)
    rec = Recorder(state)
    model.register_comm_hook(state, rec.hook)
    bad = torch.zeros_like(model.module.b.weight)
    bad[3, 7] = float("inf") if dist.get_rank() == 0 else 0.0
    model.module.b.weight.register_hook(lambda g: g + bad)
    _backward(model)
    assert not torch.isfinite(model.module.b.weight.grad).all()
    rec.check()
    assert same_everywhere(model.module.b.weight.grad)


def test_compression_objects_and_world_size():
    """``Compression.<name>(...)`` without Horovod initialized: a world-sized codec takes the
    process group's size; seed and schedule come along; a wrong world_size is refused."""
    n = dist.get_world_size()
    state = ddp.QuantizationState(hqt.Compression.global_qsgd(bits=8, seed=4))
    assert state.codec.params["world_size"] == n and state.seed == 4
    state = ddp.QuantizationState(hqt.Compression.qsgd(bits=4, gather="sra", seed=2))
    assert state.codec.params["bits"] == 4 and (state.gather, state.seed) == ("sra", 2)
    assert ddp.QuantizationState("nested_dithered").codec.params["world_size"] == n
    with pytest.raises(ValueError, match=f"pass world_size={n}"):
        ddp.QuantizationState(hq.get_codec("global_qsgd", world_size=n + 1))
    with pytest.raises(ValueError, match="not understood"):
        ddp.QuantizationState(3)


def test_compression_object_trains_like_the_codec():
    model = _model()
    state = ddp.QuantizationState(hqt.Compression.global_qsgd(bits=8, seed=4),
                                  fallback="never")  # the plans of step 0's fabric
    rec = Recorder(state)
    model.register_comm_hook(state, rec.hook)
    for step in range(2):
        model.zero_grad()
        _backward(model, step)
        rec.check()


def test_exponent_reduce_runs_point_to_point(monkeypatch):
    sends = []
    isend = PointToPoint.Isend
    monkeypatch.setattr(PointToPoint, "Isend",
                        lambda self, *a, **k: sends.append(1) or isend(self, *a, **k))
    codec = hq.get_codec("global_qsgd", **codec_params("global_qsgd"))
    model = _model()
    state = ddp.QuantizationState(codec)
    rec = Recorder(state)
    model.register_comm_hook(state, rec.hook)
    _backward(model)
    rec.check()
    assert (len(sends) > 0) == (dist.get_world_size() > 1)


def test_configs_travel_as_json_not_pickle(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("peer data must not be unpickled")

    monkeypatch.setattr(dist, "all_gather_object", refuse)
    monkeypatch.setattr(dist, "broadcast_object_list", refuse)
    model = _model()
    state = ddp.QuantizationState(hq.get_codec("qsgd"))
    model.register_comm_hook(state, ddp.quantization_hook)
    _backward(model)


@pytest.mark.parametrize("name", ["global_qsgd", "qsgd"])
def test_custom_process_groups(name):
    """DDP on halves of the world (one-rank halves for two ranks): each half exchanges among
    its own ranks, with the seeds and exponent reduction of its own group."""
    n, rank = dist.get_world_size(), dist.get_rank()
    half = max(1, n // 2)
    groups = [dist.new_group(list(range(lo, min(lo + half, n)))) for lo in range(0, n, half)]
    group = groups[rank // half]
    torch.manual_seed(0)
    model = DDP(Net(), process_group=group, bucket_cap_mb=0.25)
    state = ddp.QuantizationState(hqt.Compression.__getattr__(name)(), process_group=group)
    assert state.codec.params.get("world_size", dist.get_world_size(group)) == \
        dist.get_world_size(group)
    rec = Recorder(state, group)
    model.register_comm_hook(state, rec.hook)
    _backward(model)
    rec.check()


def test_allgather_of_unequal_and_changing_lengths():
    """One name, lengths that differ between ranks and grow and shrink between calls (the
    bound of the padded gather is the last call's longest): every rank's bytes, in rank order."""
    comm = ProcessGroupCollectives()
    n, rank = comm.size, comm.rank
    for call, base in enumerate([5, 5, 40, 3, 0, 17]):
        def part(r, base=base, call=call):
            return np.arange(base + r * (call % 3), dtype=np.float64) + 100 * r

        got = comm.allgather_async(part(rank), "x").wait()
        assert got.dtype == np.float64
        assert np.array_equal(got, np.concatenate([part(r) for r in range(n)])), call


class _SparseNet(torch.nn.Module):
    """A sparse embedding (its gradient comes as a sparse tensor) before a dense layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8, sparse=True)
        self.lin = torch.nn.Linear(8, 3)

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(index))


def _train_sparse(codec, steps=3):
    torch.manual_seed(0)
    model = DDP(_SparseNet())
    if codec is not None:
        model.register_comm_hook(ddp.QuantizationState(codec), ddp.quantization_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):  # each rank looks up other rows
        opt.zero_grad()
        model(torch.tensor([1, 2, 3 + dist.get_rank() + step])).square().sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.module.parameters()]


@pytest.mark.parametrize("name", ["none", "qsgd"])
def test_sparse_embedding_gradients_average_exactly(name):
    """A sparse gradient is averaged exactly, as DDP's own reducer does (the dense layer goes
    through the codec): with ``none`` the model equals plain DDP's, with any codec the ranks
    stay identical."""
    got = _train_sparse(hq.get_codec(name))
    assert all(same_everywhere(p) for p in got)
    if name == "none":
        want = _train_sparse(None)
        for g, w in zip(got, want):
            assert torch.allclose(g, w, atol=1e-6)
