"""The DDP hook gives exactly mean_estimate's numbers, on every rank, for every codec, on DDP's
buckets (the small first one, the rebuilt ones after the first step), with no_sync(), unused
parameters and static graphs."""
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import horovod_quant as hq
from horovod_quant.core.contract import HorovodWire
from horovod_quant.torch import ddp

from conftest import codec_params, gather_rows, same_everywhere

CODEC_SPECS = [(name, {}) for name in hq.available_codecs()] + [
    ("global_qsgd", {"levels": "linear"}), ("global_qsgd", {"mode": "sparse"}),
    ("global_qsgd", {"reduction": "ring"}), ("qsgd", {"bits": 4, "elias": True})]


def _spec_id(spec):
    name, params = spec
    return name + "".join(f"-{k}={v}" for k, v in params.items())


class Net(torch.nn.Module):
    """Layers of several sizes; ``branch`` runs only when asked (unused parameters)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(24, 300)
        self.b = torch.nn.Linear(300, 200)
        self.branch = torch.nn.Linear(200, 200)
        self.c = torch.nn.Linear(200, 5)

    def forward(self, x, use_branch=True):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.c(h)


class Recorder:
    """Wraps the hook: keeps each bucket's input (on the host), the offsets and parameters of
    its gradients, the step and the bucket's key (what its seeds derive from) and the future,
    of the last step; ``group``: the process group the
    ranks compare over (None: the default); ``names``: the names the state was given."""

    def __init__(self, state, group=None, named_parameters=None):
        self.state, self.group = state, group
        self.names = {id(p): n for n, p in (named_parameters or [])}
        self.calls = []

    def hook(self, state, bucket):
        buf = bucket.buffer()
        inp = buf.detach().cpu().clone()
        params = [(g.storage_offset() - buf.storage_offset(), g.numel(), p)
                  for g, p in zip(bucket.gradients(), bucket.parameters())]
        step = state.step
        fut = ddp.quantization_hook(state, bucket)
        self.calls.append((bucket.index(), inp, sorted(params, key=lambda t: t[0]),
                           (step, state.bucket_key(bucket)), fut))
        return fut

    def parts(self, params):
        """``{codec index or None: element indices}`` of a bucket's parameters, in bucket
        order, as the state's policy assigns them."""
        keys = [c.config_key() for c in self.state.codecs]
        parts = {}
        for offset, numel, p in params:
            codec = self.state.policy.codec_for(self.state.codec, p.shape, self.names.get(id(p)))
            k = None if codec is None else keys.index(codec.config_key())
            parts.setdefault(k, []).append(np.arange(offset, offset + numel))
        return {k: np.concatenate(v) for k, v in parts.items()}

    def check(self):
        """Every recorded bucket's result is, on every rank: the exact mean on the parameters
        the policy exempts, and mean_estimate of each codec's part (the concatenation of its
        parameters' gradients) with that part's seed; returns the results (on the buckets'
        device)."""
        assert self.calls, "the hook never ran"
        results = []
        n = dist.get_world_size(self.group)
        for index, inp, params, (step, key), fut in self.calls:
            results.append(fut.wait())
            got = results[-1].cpu().numpy()
            rows = [r.numpy() for r in gather_rows(inp, self.group)]
            for k, idx in self.parts(params).items():
                if k is None:  # a float32 sum in rank order, then / n (gloo may add otherwise)
                    want, float_sum = sum(r[idx] for r in rows) / np.float32(n), HorovodWire.KEEP
                else:
                    codec = self.state.codecs[k]
                    want, _ = hq.mean_estimate(codec, [r[idx] for r in rows],
                                               self.state.seed_of(step, key, k),
                                               gather=self.state.gather,
                                               pipeline_elems=self.state.pipeline_elems,
                                               topology=self.state.topology,
                                               fabric=self.state.fabric)
                    float_sum = codec.traits.horovod_wire
                if float_sum is None or n <= 2:
                    assert np.array_equal(got[idx], want, equal_nan=True), (k, index)
                else:  # a float allreduce adds in the backend's order (the default hook's numbers)
                    eps = 4 * float(np.finfo(np.float16 if float_sum is HorovodWire.FLOAT16
                                             else np.float32).eps)
                    assert np.allclose(got[idx], want, rtol=eps,
                                       atol=eps * float(np.abs(want).max())), (k, index)
            assert same_everywhere(results[-1].cpu(), self.group)
        self.calls = []
        return results


def _model(bucket_cap_mb=0.25, **kw):
    torch.manual_seed(0)
    return DDP(Net(), bucket_cap_mb=bucket_cap_mb, **kw)


def _batch(step, micro=0):
    gen = torch.Generator().manual_seed(1000 * step + 10 * dist.get_rank() + micro)
    return torch.randn(8, 24, generator=gen)


@pytest.mark.parametrize("spec", CODEC_SPECS, ids=_spec_id)
def test_every_codec_matches_reference(spec):
    name, params = spec
    codec = hq.get_codec(name, **params, **codec_params(name))
    model = _model()
    state = ddp.QuantizationState(codec, seed=7, fallback="never")  # the codec at every step
    rec = Recorder(state)
    model.register_comm_hook(state, rec.hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):  # step 0 runs on DDP's first buckets, later steps on rebuilt ones
        opt.zero_grad()
        model(_batch(step)).square().mean().backward()
        rec.check()
        for p in model.parameters():
            assert same_everywhere(p.grad)
        opt.step()
    assert state.step == 3
    assert state.stats.tensors > 0 and state.stats.bytes_sent > 0


def test_first_buckets_then_rebuilt_ones():
    """Step 0 runs on DDP's first layout (everything fits the 1 MB first bucket here), step 1
    on the buckets DDP rebuilt by readiness with the 0.1 MB cap; the hook sees them in index
    order and both match the reference."""
    model = _model(bucket_cap_mb=0.1)
    state = ddp.QuantizationState(hq.get_codec("qsgd", bits=4), fallback="never")
    rec = Recorder(state)
    model.register_comm_hook(state, rec.hook)
    counts = []
    for step in range(2):
        model.zero_grad()
        model(_batch(step)).sum().backward()
        indices = [i for i, *_ in rec.calls]
        assert indices == list(range(len(indices)))
        counts.append(len(indices))
        rec.check()
    assert counts[0] == 1 and counts[1] >= 3


@pytest.mark.parametrize("gather", ["allgather", "sra"])
def test_gather_schedules(gather):
    codec = hq.get_codec("natural")
    model = _model()
    state = ddp.QuantizationState(codec, gather=gather, seed=3, fallback="never")
    rec = Recorder(state)
    model.register_comm_hook(state, rec.hook)
    for step in range(2):
        model.zero_grad()
        model(_batch(step)).sum().backward()
        rec.check()


def test_pipelined_buckets():
    codec = hq.get_codec("global_qsgd", **codec_params("global_qsgd"))
    model = _model(bucket_cap_mb=1)
    state = ddp.QuantizationState(codec, pipeline_elems=20000)
    rec = Recorder(state)
    model.register_comm_hook(state, rec.hook)
    model(_batch(0)).sum().backward()
    assert max(inp.numel() for _, inp, *_ in rec.calls) > 20000
    rec.check()


def test_no_sync_accumulates_then_exchanges_once():
    codec = hq.get_codec("qsgd", bits=8)
    model = _model()
    state = ddp.QuantizationState(codec)
    rec = Recorder(state)
    model.register_comm_hook(state, rec.hook)
    torch.manual_seed(0)
    local = Net()  # the same initial weights, no DDP: the accumulated local gradients
    for micro in range(2):
        local(_batch(0, micro)).sum().backward()
    with model.no_sync():
        model(_batch(0, 0)).sum().backward()
    assert rec.calls == [] and state.step == 0
    model(_batch(0, 1)).sum().backward()
    assert state.step == 1
    sent = sum(inp.double().sum() for _, inp, *_ in rec.calls)
    want = sum(p.grad.double().sum() for p in local.parameters())
    assert torch.isclose(sent, want, rtol=1e-5, atol=1e-4)
    rec.check()


@pytest.mark.parametrize("static_graph", [False, True])
def test_unused_parameters_keep_ranks_identical(static_graph):
    codec = hq.get_codec("qsgd", bits=4)
    kw = {"static_graph": True} if static_graph else {"find_unused_parameters": True}
    model = _model(**kw)
    state = ddp.QuantizationState(codec, seed=11, fallback="never")
    rec = Recorder(state)
    model.register_comm_hook(state, rec.hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        opt.zero_grad()
        # static graph: the same parameters every step; dynamic: the branch on some ranks only
        use = False if static_graph else (step + dist.get_rank()) % 2 == 0
        model(_batch(step), use_branch=use).sum().backward()
        rec.check()
        for p in model.parameters():
            if p.grad is not None:
                assert same_everywhere(p.grad)
        opt.step()
    for p in model.parameters():
        assert same_everywhere(p.data)


def test_gradients_as_bucket_views():
    codec = hq.get_codec("natural", bits=4)
    model = _model(gradient_as_bucket_view=True)
    state = ddp.QuantizationState(codec, seed=2, fallback="never")
    rec = Recorder(state)
    model.register_comm_hook(state, rec.hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        opt.zero_grad()
        model(_batch(step)).sum().backward()
        rec.check()
        for p in model.parameters():
            assert same_everywhere(p.grad)
        opt.step()
