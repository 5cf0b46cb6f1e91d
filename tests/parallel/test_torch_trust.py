"""Training programs as people write them: every rank ends with the bit-identical result or the
same clear error, never a silent difference or a hang (the trust issue, PyTorch doors).

Every test runs on every rank and issues its collectives in an order every rank follows,
including after an expected error (see ``_resync`` where a rank is left one check behind).
"""
import horovod.torch as hvd
import numpy as np
import pytest
import torch

import horovod_quant as hq
import horovod_quant.torch as hqt
from horovod_quant.core.rng import derive_key, name_key
from horovod_quant.exchange.check import CHECKS, ConfigCheck
from horovod_quant.torch.collectives import HorovodTorchCollectives

from conftest import codec_params, rank_gradients

MULTI = pytest.mark.usefixtures("several_ranks")
EVERYTHING = hqt.LayerPolicy.everything()
CODECS = [("qsgd", {}), ("natural", {}), ("dithered", {}), ("bf16", {}), ("nuqsgd", {}),
          ("global_qsgd", {"levels": "linear"}), ("global_qsgd", {}), ("nested_dithered", {})]


@pytest.fixture
def several_ranks(horovod_world):
    if hvd.size() == 1:
        pytest.skip("needs several ranks")


def _same_everywhere(t: torch.Tensor) -> bool:
    everyone = hvd.allgather(t.detach().reshape(1, -1).float())
    return all(torch.equal(everyone[0], e) for e in everyone)


def _compressor(name, params, **kw):
    return getattr(hqt.Compression, name)(**params, **codec_params(name), **kw)


class Branchy(torch.nn.Module):
    """A model whose middle layer runs only on some ranks and steps."""

    def __init__(self, mid_out=48):
        super().__init__()
        self.lin = torch.nn.Linear(32, 48)
        self.extra = torch.nn.Linear(48, mid_out)
        self.out = torch.nn.Linear(mid_out if mid_out != 48 else 48, 4)

    def forward(self, x, use_extra):
        h = torch.relu(self.lin(x))
        if use_extra:
            h = torch.relu(self.extra(h))
        return self.out(h)


def _train(opt, model, steps=3, pattern=lambda step, rank: (step + rank) % 2 == 0):
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    for step in range(steps):
        opt.zero_grad()
        x = torch.randn(16, 32, generator=gen)
        model(x, pattern(step, hvd.rank())).square().mean().backward()
        opt.step()


def _wrap(door, model, compression, **kw):
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    wrap = hvd.DistributedOptimizer if door == "horovod" else hqt.DistributedOptimizer
    return wrap(base, named_parameters=model.named_parameters(), compression=compression, **kw)


def _synced_model(**kw):
    torch.manual_seed(0)
    model = Branchy(**kw)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model


# -- 1. unused parameters ---------------------------------------------------------------------
@MULTI
@pytest.mark.parametrize("name,params", CODECS,
                         ids=[f"{n}-{p.get('levels', '')}" for n, p in CODECS])
@pytest.mark.parametrize("door", ["horovod", "quant"])
def test_layer_unused_on_some_ranks_keeps_ranks_identical(door, name, params):
    model = _synced_model()
    opt = _wrap(door, model, _compressor(name, params, policy=EVERYTHING))
    _train(opt, model)
    for pname, p in model.named_parameters():
        assert torch.isfinite(p).all(), pname
        assert _same_everywhere(p), f"{pname} differs between ranks ({door}, {name})"
    assert model.extra.weight.grad is not None  # averaged, also where this rank skipped it


@MULTI
@pytest.mark.parametrize("name,params", [("qsgd", {"bits": 8}),
                                         ("global_qsgd", {"levels": "linear"}),
                                         ("global_qsgd", {})])
@pytest.mark.parametrize("door", ["horovod", "quant"])
def test_unused_parameter_gets_the_mean_of_the_ranks_that_used_it(door, name, params):
    """Exact oracle: rank 0 alone uses `extra`; the others contribute zeros, as in Horovod.
    Global-QSGD: the buckets of the ranks that skip `extra` start in another order, each with
    its own norm, and nothing waits for another rank's bucket."""
    model = _synced_model()
    comp = _compressor(name, params, seed=4, policy=EVERYTHING)
    opt = _wrap(door, model, comp, **({"fusion_bytes": 1} if door == "quant" else {}))
    _train(opt, model, steps=1, pattern=lambda step, rank: rank == 0)
    assert _same_everywhere(model.extra.weight.grad)
    torch.manual_seed(0)  # rank 0's gradient of extra.weight, recomputed on every rank
    ref = Branchy()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100))
    ref(x, True).square().mean().backward()
    g0 = ref.extra.weight.grad.reshape(-1).numpy()
    flats = [g0] + [np.zeros_like(g0)] * (hvd.size() - 1)
    codec = hq.get_codec(name, **params, **codec_params(name))
    if door == "horovod":
        seed = derive_key(4, 0, name_key("extra.weight"))
        want, _ = hq.mean_estimate(codec, flats, seed=seed, gather="auto")
        assert np.array_equal(model.extra.weight.grad.reshape(-1).numpy(), want)
    else:  # one parameter per bucket (fusion_bytes=1): its bucket index in reverse order
        index = [n for n, _ in model.named_parameters()][::-1].index("extra.weight")
        want, _ = hq.mean_estimate(codec, flats, seed=derive_key(4, 0, index), gather="auto",
                                   topology=opt.topology)
        assert np.array_equal(model.extra.weight.grad.reshape(-1).numpy(), want)


# -- 2. layers of different shapes on different ranks -----------------------------------------
@MULTI
@pytest.mark.parametrize("name,params", [("qsgd", {}), ("natural", {}), ("dithered", {}),
                                         ("global_qsgd", {"levels": "linear"}),
                                         ("global_qsgd", {})])
@pytest.mark.parametrize("door", ["horovod", "quant"])
def test_layers_of_other_shapes_raise_on_every_rank(door, name, params):
    torch.manual_seed(0)
    model = Branchy(mid_out=48 if hvd.rank() == 0 else 40)
    comp = _compressor(name, params, policy=EVERYTHING)
    with pytest.raises((ValueError, RuntimeError), match="differ|Mismatched"):
        opt = _wrap(door, model, comp)
        _train(opt, model, steps=1, pattern=lambda step, rank: True)
    _resync()


def _resync():
    """Leave every rank at the same configuration-check number after a test in which some
    ranks started a check that the others never reached: the others join it (never waited)."""
    comm = HorovodTorchCollectives()
    target = max(hvd.allgather_object(CHECKS.started(comm)))
    while CHECKS.started(comm) < target:
        ConfigCheck(comm, {"resync": True})


# -- 3. integer and boolean tensors -----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_tensors_pass_exactly(dtype):
    comp = hqt.Compression.qsgd(policy=EVERYTHING)
    t = (torch.arange(5000, dtype=dtype) * (hvd.rank() + 3)) % 1000
    got = hvd.allreduce(t, op=hvd.Sum, compression=comp, name=f"ints.{dtype}")
    want = sum((torch.arange(5000, dtype=dtype) * (r + 3)) % 1000 for r in range(hvd.size()))
    assert got.dtype == dtype and torch.equal(got, want)
    assert comp.stats.bytes_raw == comp.stats.bytes_sent  # not quantized


# -- 4. sparse gradients ----------------------------------------------------------------------
class Embedder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.big = torch.nn.Embedding(2000, 16, sparse=True)   # 32000 values: compressible size
        self.small = torch.nn.Embedding(10, 4, sparse=True)    # travels raw by size
        self.head = torch.nn.Linear(20, 3)

    def forward(self, a, b):
        return self.head(torch.cat([self.big(a), self.small(b)], dim=1))


@MULTI
@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_embeddings_train_and_stay_identical(sparse_as_dense):
    torch.manual_seed(0)
    model = Embedder()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(),
                                   compression=hqt.Compression.qsgd(bits=8),
                                   sparse_as_dense=sparse_as_dense, fallback="never")
    gen = torch.Generator().manual_seed(7 + hvd.rank())
    for _ in range(3):
        opt.zero_grad()
        a, b = (torch.randint(0, 2000, (8,), generator=gen),
                torch.randint(0, 10, (8,), generator=gen))
        model(a, b).square().mean().backward()
        opt.step()
    for n, p in model.named_parameters():
        assert _same_everywhere(p), n
        assert not torch.equal(p.detach(), before[n]), f"{n} never trained"


# -- 5. per-layer codec rules -----------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 50))


def _mlp_step(model, opt):
    gen = torch.Generator().manual_seed(30 + hvd.rank())
    opt.zero_grad()
    model(torch.randn(8, 40, generator=gen)).square().mean().backward()
    opt.step()


def _rank_grads(model):
    """Every rank's local gradients of the MLP step, recomputed on this rank."""
    out = []
    for r in range(hvd.size()):
        ref = _mlp()
        ref.load_state_dict(model.state_dict())
        x = torch.randn(8, 40, generator=torch.Generator().manual_seed(30 + r))
        ref(x).square().mean().backward()
        out.append({n: p.grad.reshape(-1).numpy().copy() for n, p in ref.named_parameters()})
    return out


#: how Horovod's optimizer groups the gradients it hands the compressor (the grouped ones reach
#: compress from a list comprehension, which Python 3.12 inlines)
GROUPINGS = {"none": lambda model: {}, "num_groups": lambda model: {"num_groups": 2},
             "groups": lambda model: {"groups": [[model[2].weight, model[0].bias],
                                                 [model[0].weight, model[2].bias]]}}


@MULTI
@pytest.mark.parametrize("rule_as", ["codec", "compression"])
@pytest.mark.parametrize("door,grouping", [("horovod", g) for g in GROUPINGS] + [("quant", "none")])
def test_rules_choose_the_codec_per_layer(door, grouping, rule_as):
    eight = hq.get_codec("qsgd", bits=8) if rule_as == "codec" else hqt.Compression.qsgd(bits=8)
    policy = hqt.LayerPolicy(rules=[(r"^2\.weight", eight), (r"^0\.bias", None)],
                             compress_1d=True, min_elements=0)
    model = _mlp()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    base = torch.optim.SGD(model.parameters(), lr=0.0)
    comp = hqt.Compression.qsgd(bits=4, seed=6, policy=policy)
    if door == "horovod":
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       compression=comp, **GROUPINGS[grouping](model))
    else:
        opt = hqt.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       compression=comp, fusion_bytes=1)
    _mlp_step(model, opt)
    ref = _mlp()
    ref.load_state_dict(init)
    per_rank = _rank_grads(ref)
    got = dict(model.named_parameters())
    # 2.weight at 8 bits; in the quant door it is the one bucket of the rule's codec (last)
    flats = [g["2.weight"] for g in per_rank]
    if door == "horovod":
        seed = derive_key(6, 0, name_key("2.weight"))
    else:
        seed = derive_key(6, 0, len(opt._exchanger.layout.buckets) - 1)
        assert [p for p in opt._exchanger.layout.buckets[-1].params] == [got["2.weight"]]
    like = {"gather": "auto", "topology": getattr(opt, "topology", None)}
    want, _ = hq.mean_estimate(hq.get_codec("qsgd", bits=8), flats, seed=seed, **like)
    assert np.array_equal(got["2.weight"].grad.reshape(-1).numpy(), want)
    four, _ = hq.mean_estimate(hq.get_codec("qsgd", bits=4), flats, seed=seed, **like)
    assert not np.array_equal(want, four)
    # 0.bias uncompressed: Horovod's float average
    np.testing.assert_allclose(got["0.bias"].grad.numpy(),
                               np.mean([g["0.bias"] for g in per_rank], axis=0), rtol=1e-6,
                               atol=1e-7)
    for p in model.parameters():
        assert _same_everywhere(p.grad)


@MULTI
def test_rules_apply_to_grouped_allreduce_names():
    """``hvd.grouped_allreduce(name="grads")`` names its i-th tensor ``grads[i]``; a tensor
    without a name gets the size rules alone, and the compressor says so once."""
    shapes = [(40, 50), (40, 50)]
    policy = hqt.LayerPolicy(rules=[(r"^grads\[1\]$", None)], min_elements=0)
    comp = hqt.Compression.qsgd(bits=4, seed=6, policy=policy)
    per_rank = [rank_gradients(shapes, 0, r) for r in range(hvd.size())]
    got = hvd.grouped_allreduce([torch.from_numpy(g) for g in per_rank[hvd.rank()]],
                                name="grads", compression=comp)
    want, _ = hq.mean_estimate(hq.get_codec("qsgd", bits=4), [g[0].reshape(-1) for g in per_rank],
                               seed=derive_key(6, 0, name_key("grads[0]")))
    assert np.array_equal(got[0].reshape(-1).numpy(), want)
    np.testing.assert_allclose(got[1].numpy(), np.mean([g[1] for g in per_rank], axis=0),
                               rtol=1e-6, atol=1e-7)  # its rule: Horovod's float average
    with pytest.warns(RuntimeWarning, match=r"without a name.*\^grads"):
        unnamed = hvd.allreduce(torch.from_numpy(per_rank[hvd.rank()][1]), compression=comp)
    assert not np.allclose(unnamed.numpy(), got[1].numpy(), rtol=1e-6, atol=1e-7)  # quantized


@MULTI
@pytest.mark.parametrize("door", ["horovod", "quant"])
def test_rules_that_differ_between_ranks_raise_on_every_rank(door):
    bits = 8 if hvd.rank() == 0 else 6
    policy = hqt.LayerPolicy(rules=[(r"^2\.weight", hq.get_codec("qsgd", bits=bits))])
    model = _mlp()
    with pytest.raises(ValueError, match="differs between ranks"):
        base = torch.optim.SGD(model.parameters(), lr=0.0)
        wrap = hvd.DistributedOptimizer if door == "horovod" else hqt.DistributedOptimizer
        opt = wrap(base, named_parameters=model.named_parameters(),
                   compression=hqt.Compression.qsgd(policy=policy))
        _mlp_step(model, opt)
    _resync()


def test_bad_rule_codec_is_refused():
    with pytest.raises(TypeError, match="rule"):
        hqt.LayerPolicy(rules=[("x", "qsgd")])


# -- 6. hangs ---------------------------------------------------------------------------------
@MULTI
@pytest.mark.parametrize("door", ["horovod", "quant"])
def test_extra_unused_compressor_on_one_rank_shifts_nothing(door):
    if hvd.rank() == 0:
        hqt.Compression.qsgd(bits=8)  # built, never used
        hqt.Compression.natural()
    model = _synced_model()
    opt = _wrap(door, model, hqt.Compression.qsgd(policy=EVERYTHING))
    _train(opt, model, steps=2)
    for p in model.parameters():
        assert _same_everywhere(p)


@MULTI
@pytest.mark.parametrize("door", ["horovod", "quant"])
def test_different_codecs_on_different_ranks_raise_on_every_rank(door):
    """Under MPI the global_qsgd exchange sets up an MPI communicator (a collective Dup): the
    check must come first, or the other rank waits in Dup forever."""
    model = _synced_model()
    comp = (_compressor("global_qsgd", {}, policy=EVERYTHING) if hvd.rank() == 0
            else hqt.Compression.qsgd(policy=EVERYTHING))
    with pytest.raises(ValueError, match="differs between ranks"):
        opt = _wrap(door, model, comp)
        _train(opt, model, steps=1)
    _resync()


@MULTI
def test_compressor_on_one_rank_only_raises_on_every_rank():
    """hq compressor on rank 0, Horovod's own compression on the others: Horovod sees the
    placeholder and the gradient under one name and refuses them on every rank."""
    model = _synced_model()
    comp = hqt.Compression.qsgd(policy=EVERYTHING) if hvd.rank() == 0 else hvd.Compression.none
    with pytest.raises(Exception, match="Mismatched|shape"):
        _train(_wrap("horovod", model, comp), model, steps=1)
    _resync()


@MULTI
def test_configuration_wait_has_a_deadline(monkeypatch):
    """A check that no other rank joins fails after HQ_CONFIG_TIMEOUT instead of hanging."""
    monkeypatch.setenv("HQ_CONFIG_TIMEOUT", "2")
    comm = HorovodTorchCollectives()
    if hvd.rank() == 0:
        with pytest.raises(RuntimeError, match="waited .* configuration"):
            ConfigCheck(comm, {"alone": True}, timeout=2).wait()
    _resync()


# -- 8. trust between ranks -------------------------------------------------------------------
def test_configs_travel_as_json_not_pickle():
    comm = HorovodTorchCollectives()
    got = comm.allgather_object({"rank": hvd.rank(), "t": (1, 2)}, "hq.test.json")
    assert got == [{"rank": r, "t": [1, 2]} for r in range(hvd.size())]


def test_non_integral_seeds_are_refused():
    with pytest.raises(ValueError, match="seed"):
        hqt.Compression.qsgd(seed=7.9)
    model = _mlp()
    with pytest.raises(ValueError, match="seed"):
        hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(), seed=7.9)
