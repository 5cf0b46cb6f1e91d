"""The FSDP hook (horovod_quant.torch.fsdp) on 4 ranks as 2 hosts x 2 (run.sh's 2x2 world;
skipped in the others): a small transformer, each layer ``fully_shard``-ed over a host's ranks
({0, 1} and {2, 3}), its shards averaged across the hosts over the replicate groups ({0, 2}
and {1, 3}). The replicas end bit for bit equal; with every parameter exact the run is FSDP2's
own HSDP's bit for bit (the divisors agree); 8-bit QSGD ends within the uncompressed run's
spread over seeds and sends at most 0.30 of float32's bytes; a shard's mean is mean_estimate's
with the state's seed; a run resumed from a checkpoint equals one that was not; a shard the
fallback moves is averaged by the baseline."""
import io
import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import horovod_quant as hq
from horovod_quant import fallback
from horovod_quant.fallback import FALLBACK_STEP
from horovod_quant.policy import LayerPolicy

from conftest import gather_rows, same_everywhere

fsdp_api = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp_api, "fully_shard"):
    pytest.skip("this PyTorch has no FSDP2 (torch.distributed.fsdp.fully_shard)",
                allow_module_level=True)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from horovod_quant.torch import fsdp  # noqa: E402

VOCAB, WIDTH, LENGTH, BATCH, STEPS = 128, 64, 16, 8, 20
QSGD8 = hq.get_codec("qsgd", bits=8, bucket_size=512)
_RUNS: dict = {}  # (kind, seed, ...) -> (model, state, final loss): the tests share runs


@pytest.fixture(scope="module")
def mesh(process_group):
    """The 2 x 2 mesh: "replicate" across the nodes, "shard" inside one."""
    if dist.get_world_size() != 4 or os.environ.get("LOCAL_WORLD_SIZE") != "2":
        pytest.skip("needs 4 ranks as 2 nodes x 2 (run.sh's 2x2 world)")
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


class Tiny(nn.Module):
    """A two-layer transformer language model; ``forward`` returns the loss."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True)
            for _ in range(2))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x, y):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return nn.functional.cross_entropy(self.head(self.norm(h)).flatten(0, 1), y.flatten())


def _batch(seed, step):
    """This rank's batch of ``step``: tokens and their images under a fixed map."""
    g = torch.Generator().manual_seed(10_000 * seed + 16 * step + dist.get_rank())
    x = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
    return x, (3 * x + 1) % VOCAB


def _build(mesh, init, codec=None, native=False, **options):
    """The model of seed ``init`` sharded per layer, its optimizer and the hook's state: FSDP2's
    own HSDP over the 2-D mesh (``native``), else a 1-D mesh per host and the hook (None
    without a codec: FSDP alone, no replica mean)."""
    torch.manual_seed(init)
    model = Tiny()
    over = mesh if native else mesh["shard"]
    for layer in model.layers:
        fsdp_api.fully_shard(layer, mesh=over)
    fsdp_api.fully_shard(model, mesh=over)
    state = None if codec is None else fsdp.compress_replica_allreduce(
        model, mesh.get_group("replicate"), codec, **options)
    return model, torch.optim.Adam(model.parameters(), lr=3e-3), state


def _train(model, opt, seed, steps):
    """Train ``steps`` (a range); returns the last step's loss averaged over the ranks."""
    for step in steps:
        loss = model(*_batch(seed, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def _run(mesh, kind, seed=0):
    """``kind``: "hsdp" (FSDP2's own), "qsgd8" or "exact" (the hook, every parameter exact),
    :data:`STEPS` steps from ``seed``, once per module."""
    if (kind, seed) not in _RUNS:
        if kind == "hsdp":
            model, opt, state = _build(mesh, seed, native=True)
        else:
            policy = LayerPolicy(min_elements=1 << 40) if kind == "exact" else LayerPolicy()
            model, opt, state = _build(mesh, seed, QSGD8, fallback="never", policy=policy)
        _RUNS[kind, seed] = (model, state, _train(model, opt, seed, range(STEPS)))
    return _RUNS[kind, seed]


def _shards(model):
    return [p.to_local().detach().clone() for p in model.parameters()]


def test_replicas_end_bit_for_bit_equal(mesh):
    model, state, _ = _run(mesh, "qsgd8")
    assert state.step == STEPS
    for p in model.parameters():
        assert same_everywhere(p.full_tensor())  # both hosts' full parameters
        assert same_everywhere(p.to_local(), mesh.get_group("replicate"))


def test_every_parameter_exact_is_native_hsdp_bit_for_bit(mesh):
    """FSDP's reduce-scatter mean inside the host, then the hook's mean over the replicas: the
    numbers of FSDP2's own HSDP (its reduce-scatter and all-reduce means)."""
    exact, _, _ = _run(mesh, "exact")
    native, _, _ = _run(mesh, "hsdp")
    assert all(torch.equal(a, b) for a, b in zip(_shards(exact), _shards(native)))


def test_eight_bits_stay_within_the_seeds_spread_and_send_under_a_third(mesh):
    losses = [_run(mesh, "hsdp", seed)[2] for seed in range(3)]
    _, state, loss = _run(mesh, "qsgd8")
    spread = max(losses) - min(losses)
    assert spread > 0
    assert abs(loss - losses[0]) <= spread, (loss, losses)
    stats = state.stats
    assert stats.bytes_sent <= 0.30 * stats.bytes_raw, str(stats)
    assert stats.bytes_local == 0  # one rank per host in a replicate group: all crosses hosts


def test_resumed_run_equals_the_straight_one_bit_for_bit(mesh):
    straight, straight_state, _ = _run(mesh, "qsgd8")
    model, opt, state = _build(mesh, 0, QSGD8, fallback="never")
    _train(model, opt, 0, range(STEPS // 2))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "hq": state.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    model, opt, state = _build(mesh, 7, QSGD8, fallback="never")  # other weights, replaced
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    state.load_state_dict(saved["hq"])
    assert state.step == STEPS // 2
    _train(model, opt, 0, range(STEPS // 2, STEPS))
    assert all(torch.equal(a, b) for a, b in zip(_shards(model), _shards(straight)))
    assert state.state_dict() == straight_state.state_dict()


def _own_parameters(module):
    """The parameters a ``fully_shard`` module shards itself (not its sharded submodules'),
    in FSDP's order: a module's children first, each module's own parameters in order."""
    found = []

    def visit(m):
        if m is not module and isinstance(m, fsdp_api.FSDPModule):
            return
        for child in m.children():
            visit(child)
        found.extend(p for p in m.parameters(recurse=False)
                     if all(p is not seen for seen in found))

    visit(module)
    return found


@pytest.mark.parametrize("codec_name", ["qsgd", "global_qsgd"])
def test_a_shard_mean_is_mean_estimate_with_the_state_seed(mesh, codec_name):
    """Each shard's elements (FSDP's padding left out) become mean_estimate of the replicas'
    shards with seed derive_key(seed, step, name_key(the names), the shard's offset)."""
    codec = hq.get_codec(codec_name, bits=4, world_size=2) if codec_name == "global_qsgd" \
        else hq.get_codec(codec_name, bits=4)
    model, opt, state = _build(mesh, 0, codec, fallback="never", seed=11,
                               policy=LayerPolicy.everything())
    calls, exchange = [], state.exchange_shard

    def recording(shard, grad):
        before, step = grad.clone(), state.step
        exchange(shard, grad)
        calls.append((shard.index(), before, grad.clone(), step))

    state.exchange_shard = recording
    _train(model, opt, 0, range(2))
    modules = [m for m in model.modules() if isinstance(m, fsdp_api.FSDPModule)]
    names = {id(p): n for n, p in model.named_parameters()}
    rank, group = mesh["shard"].get_local_rank(), mesh.get_group("replicate")
    assert len(calls) == 2 * len(modules)
    for index, before, after, step in calls:
        params = _own_parameters(modules[index])
        slots = [math.ceil(p.shape[0] / 2) * math.prod(p.shape[1:]) for p in params]
        starts = np.cumsum([0] + slots)
        real = np.concatenate([np.arange(s, s + p.to_local().numel())
                               for s, p in zip(starts, params)])
        key, offset = ",".join(names[id(p)] for p in params), rank * int(starts[-1])
        seed = state.shard_seed(step, key, offset)
        assert seed == state.seed_of(step, index)
        rows = [r.numpy()[real] for r in gather_rows(before, group)]
        want, _ = hq.mean_estimate(codec, rows, seed, gather=state.gather,
                                   pipeline_elems=state.pipeline_elems, topology=state.topology,
                                   fabric=state.fabric)
        assert np.array_equal(after.numpy()[real], want)
        pad = np.setdiff1d(np.arange(before.numel()), real)
        assert torch.equal(after[pad], before[pad])


def test_a_shard_the_fallback_moves_is_averaged_by_the_baseline(mesh, monkeypatch):
    """The trial (its timings forced) moves shard 0 to float32: from the next step its mean is
    the replicas' float32 allreduce of the shard divided by 2; the others keep the codec; the
    decisions travel in state_dict()."""
    def measure(trial, sides, sync=None, **_):
        for side in sides:
            trial.run(side)()
        if "codec" not in sides:
            return [0.1 if side == "fp32" else 0.2 for side in sides]
        return [0.5 if trial.bucket == 0 else 0.001, 0.1]

    monkeypatch.setattr(fallback, "measure_bucket", measure)
    model, opt, state = _build(mesh, 0, QSGD8)
    calls, exchange = [], state.exchange_shard

    def recording(shard, grad):
        before = grad.clone()
        exchange(shard, grad)
        calls.append((shard.index(), before, grad.clone()))

    state.exchange_shard = recording
    group = mesh.get_group("replicate")
    for step in range(FALLBACK_STEP + 3):
        calls.clear()
        state.stats.reset()
        _train(model, opt, 0, [step])
        if step > FALLBACK_STEP:
            assert state.stats.fallen_back == 1
            (before, after), = [(b, a) for i, b, a in calls if i == 0]
            want = before.div(2)
            dist.all_reduce(want, group=group)
            assert torch.equal(after, want)
    decisions = state.fallback_decisions
    assert {d.bucket: d.fallback for d in decisions} == {0: True, 1: False, 2: False}
    assert state.fallback_baseline.baseline == "fp32"
    for p in model.parameters():
        assert same_everywhere(p.to_local(), group)
    resumed = _build(mesh, 0, QSGD8)[2]
    resumed.load_state_dict(state.state_dict())
    assert resumed.fallback_decisions == decisions


def test_what_the_hook_refuses(mesh):
    with pytest.raises(TypeError, match="fully_shard"):
        fsdp.compress_replica_allreduce(Tiny(), mesh.get_group("replicate"), QSGD8)
    native, _, _ = _build(mesh, 0, native=True)
    with pytest.raises(ValueError, match="2-D mesh"):
        fsdp.compress_replica_allreduce(native, mesh.get_group("replicate"), QSGD8)
    model, _, _ = _build(mesh, 0)
    with pytest.raises(ValueError, match=r"fusion_bytes=1: the FSDP hook does not take"):
        fsdp.compress_replica_allreduce(model, mesh.get_group("replicate"), QSGD8,
                                        fusion_bytes=1)
