"""horovod_quant.torch.allreduce, the compressed all-reduce of outer steps: every rank gets
mean_estimate's numbers bit for bit, for any shape and 16-bit dtype; the average over many keys
converges to the mean within the codec's variance bound (a biased rounding fails the same
check); keys, tensors and groups at odds raise on every rank; examples/local_sgd.py runs."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import horovod_quant as hq
import horovod_quant.torch as hqt
from horovod_quant.exchange.codec_states import CodecStates
from horovod_quant.exchange.wire import OutOfStep, TagMismatch
from horovod_quant.torch import outer as outer_module

from conftest import codec_params, gather_rows, same_everywhere

pytestmark = pytest.mark.size_independent
MULTI = pytest.mark.usefixtures("several_ranks")
CODECS = [("qsgd", {"bits": 8}), ("nuqsgd", {"bits": 4}), ("natural", {}), ("global_qsgd", {}),
          ("global_qsgd", {"levels": "linear"}), ("dithered", {}), ("nested_dithered", {})]
#: (shape, dtype, key) of the calls each codec makes, one after the other
CALLS = [((7, 300), torch.float32, 0), ((50,), torch.bfloat16, "round-1"),
         ((3, 1000), torch.float16, 2 ** 70)]


def _input(shape, dtype, salt=0):
    gen = torch.Generator().manual_seed(1000 * salt + 10 * dist.get_rank() + len(shape))
    return (torch.randn(shape, generator=gen) * 3).to(dtype)


def _expected(outer, x, key, states=None):
    """mean_estimate of every rank's ``x`` with the seed and settings of ``outer``'s call
    with ``key``, as ``x``'s dtype and shape."""
    rows = [r.numpy() for r in gather_rows(x.float())]
    want, _ = hq.mean_estimate(outer.codec, rows, outer.seed_of(key), gather=outer.gather,
                               pipeline_elems=outer.pipeline_elems, topology=outer.topology,
                               fabric=outer.fabric, states=states)
    return torch.from_numpy(want).reshape(x.shape).to(x.dtype)


def _spec_id(spec):
    name, params = spec
    return name + "".join(f"-{v}" for v in params.values())


@pytest.mark.parametrize("spec", CODECS, ids=_spec_id)
def test_every_rank_gets_mean_estimate_bit_for_bit(spec):
    name, params = spec
    outer = hqt.OuterAllreduce(hq.get_codec(name, **params, **codec_params(name)), seed=9)
    for i, (shape, dtype, key) in enumerate(CALLS):
        x = _input(shape, dtype, i)
        states = CodecStates()  # the reference starts where the holder's states are
        states.load_state_dict(outer.state_dict()["codec_states"])
        got = hqt.allreduce(x, outer, key=key)
        assert got.shape == x.shape and got.dtype == dtype
        assert same_everywhere(got.float())
        assert torch.equal(got, _expected(outer, x, key, states)), (shape, dtype)
    assert outer.stats.tensors == len(CALLS) and outer.stats.bytes_sent > 0


def test_pipelined_pieces_match_the_reference():
    codec = hq.get_codec("global_qsgd", **codec_params("global_qsgd"))
    outer = hqt.OuterAllreduce(codec, pipeline_elems=1000)
    x = _input((2500,), torch.float32)
    got = outer(x, key=3)
    assert outer.stats.plans and sum(outer.stats.plans.values()) == 3
    assert same_everywhere(got) and torch.equal(got, _expected(outer, x, 3))


def test_the_function_keeps_one_holder_per_codec_and_group():
    x = _input((4, 256), torch.float32)
    first = hqt.allreduce(x, "qsgd:8", key=1)
    held = dict(outer_module._HOLDERS)
    second = hqt.allreduce(x, "qsgd:8", key=2)
    assert outer_module._HOLDERS == held
    outer = held[(id(None), "qsgd:8")][2]
    assert outer.codec.bits == 8 and outer.seed == 0
    assert torch.equal(first, _expected(outer, x, 1))
    assert torch.equal(second, _expected(outer, x, 2))
    assert not torch.equal(first, second)  # another key, other draws


def test_a_compressor_brings_its_settings():
    pytest.importorskip("horovod.torch")
    outer = hqt.OuterAllreduce(hqt.Compression.qsgd(bits=4, seed=5, pipeline_elems=None))
    assert outer.seed == 5 and outer.codec.bits == 4 and outer.pipeline_elems is None
    with pytest.raises(ValueError, match=r"^fallback='never': the outer all-reduce does not "
                                         r"take this setting \(fallback: hq.torch.Distributed"
                                         r"Optimizer, the DDP hook and the FSDP hook\)"):
        hqt.OuterAllreduce("qsgd", fallback="never")


def test_the_fabric_variables_are_read_when_the_holder_is_built(monkeypatch):
    """HQ_LINK_GBIT and HQ_ROUND_US are read once, by the door (the holder), not by its
    exchange: set when it is built, they are its fabric at its first call; the other doors'
    variables (HQ_TRANSPORT) it ignores, even where they are not valid."""
    monkeypatch.setenv("HQ_LINK_GBIT", "3")
    monkeypatch.setenv("HQ_ROUND_US", "40")
    monkeypatch.setenv("HQ_TRANSPORT", "not-a-transport")
    outer = hqt.OuterAllreduce("qsgd:8", seed=2)
    monkeypatch.delenv("HQ_LINK_GBIT")
    monkeypatch.delenv("HQ_ROUND_US")
    x = _input((5, 40), torch.float32)
    got = outer(x, key=0)
    assert (outer.fabric.link_gbit, outer.fabric.round_us) == (3.0, 40.0)
    assert torch.equal(got, _expected(outer, x, 0))

def _error_over_keys(outer, x, keys):
    """||average of outer's estimates over ``keys`` keys - the mean||^2, and the mean."""
    total = torch.zeros(x.numel(), dtype=torch.float64)
    for key in range(keys):
        total += outer(x, key=key).double()
    mean = torch.stack(gather_rows(x)).double().mean(0)
    return float(((total / keys - mean) ** 2).sum()), mean


def _round_to_nearest(x, bits=4, bucket=512):
    """Round-to-nearest on QSGD's grid of ``bits`` bits (L2 bucket scale): biased."""
    s, out = 2 ** (bits - 1) - 1, x.double().clone()
    for b in out.split(bucket):
        scale = b.norm()
        b.copy_(torch.round(b / scale * s) / s * scale)
    return out


@pytest.mark.parametrize("case", ["qsgd", "global_qsgd"])
def test_the_average_over_keys_converges_within_the_variance_bound(case):
    """Unbiased with the codec's own bound: over K keys, E||avg - mean||^2 <= V / K, where V
    bounds one estimate's error, (1/n^2) sum_i omega(d) ||x_i||^2 over QSGD's buckets (Lemma
    3.1), theta(d) (1/n) sum_i ||x_i||^2 for Global-QSGD (Definition 2.2). The flat exchange
    (gather="allgather") is the one these bounds are for."""
    n, keys, bucket = dist.get_world_size(), 128, 512
    x = _input((3 * bucket,), torch.float32)
    rows = torch.stack(gather_rows(x)).double()
    if case == "qsgd":
        codec = hq.get_codec("qsgd", bits=4, norm="l2", bucket_size=bucket)
        bound = sum(codec.omega(bucket) * float((b ** 2).sum())
                    for row in rows for b in row.split(bucket)) / n ** 2
    else:
        codec = hq.get_codec("global_qsgd", world_size=n)
        bound = codec.theta(x.numel()) * float((rows ** 2).sum()) / n
    error, mean = _error_over_keys(hqt.OuterAllreduce(codec, gather="allgather"), x, keys)
    assert error <= bound / keys, (error, bound / keys)
    # the check can fail: a biased round-to-nearest (the same average for every key) does
    biased = torch.stack([_round_to_nearest(row) for row in rows]).mean(0)
    assert float(((biased - mean) ** 2).sum()) > 10 * bound / keys


@MULTI
@pytest.mark.parametrize("spec", ["qsgd:8", "fp16"])
def test_different_keys_raise_on_every_rank(spec):
    """fp16's sum plan carries no tag of its own: the call's tag check catches it too."""
    outer = hqt.OuterAllreduce(spec)
    x = _input((600,), torch.float32)
    rank = dist.get_rank()
    for key in (rank, f"step-{rank}"):
        with pytest.raises(OutOfStep, match="different keys"):
            outer(x, key=key)
    assert same_everywhere(outer(x, key="same"))  # still paired: nothing was half done


@MULTI
def test_other_tensors_raise_on_every_rank():
    outer = hqt.OuterAllreduce("qsgd:8")
    rank = dist.get_rank()
    with pytest.raises(TagMismatch, match="different tensors"):
        outer(_input((600 + rank,), torch.float32), key=0)
    with pytest.raises(TagMismatch, match="different tensors"):
        outer(_input((600,), torch.bfloat16 if rank else torch.float32), key=1)


def test_inputs_are_checked_before_any_collective():
    x = torch.ones(10)
    for bad, match in [(torch.ones(10, dtype=torch.int64), "float32, float16 or bfloat16"),
                       (torch.ones(10, dtype=torch.float64), "float32, float16 or bfloat16"),
                       (x.to_sparse(), "dense")]:
        with pytest.raises(ValueError, match=match):
            hqt.allreduce(bad, "qsgd:8", key=0)
    for key in (None, 1.5, True):
        with pytest.raises(ValueError, match="key="):
            hqt.allreduce(x, "qsgd:8", key=key)
    with pytest.raises(TypeError, match="key"):
        hqt.allreduce(x, "qsgd:8")
    with pytest.raises(ValueError, match="integer number of bits"):
        hqt.allreduce(x, "qsgd:eight", key=0)


def test_an_adaptive_codec_needs_a_holder_to_checkpoint():
    with pytest.raises(ValueError, match="adapts from one exchange to the next"):
        hqt.allreduce(torch.ones(600), "nested_dithered", key=0)
    outer = hqt.OuterAllreduce("nested_dithered")
    x = _input((2000,), torch.float32)
    outer(x, key=0)
    saved = outer.state_dict()
    assert saved["codec_states"] and saved["world_size"] == dist.get_world_size()
    resumed = hqt.OuterAllreduce("nested_dithered")
    resumed.load_state_dict(saved)
    assert torch.equal(resumed(x, key=1), outer(x, key=1))  # continues bit for bit
    with pytest.raises(ValueError, match="not an OuterAllreduce state"):
        resumed.load_state_dict({"step": 3})


@MULTI
def test_a_rank_outside_the_group_is_refused():
    """Each rank builds the same number of process groups (torch names a group built by its
    members alone by the count of groups each member has): one of its own, twice."""
    n, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group([r]) for r in range(n)]  # every rank builds every group
    x = _input((600,), torch.float32)
    with pytest.raises(ValueError, match="not in the process group"):
        hqt.allreduce(x, "qsgd:8", groups[(rank + 1) % n], key=0)
    alone = groups[rank]
    assert torch.equal(hqt.allreduce(x, "qsgd:8", alone, key=0),
                       hqt.allreduce(x, hqt.OuterAllreduce("qsgd:8", alone), key=0))
    with pytest.raises(ValueError, match="not the OuterAllreduce's group"):
        hqt.allreduce(x, hqt.OuterAllreduce("qsgd:8"), alone, key=0)


@pytest.mark.parametrize("name", ["qsgd", "global_qsgd", "nested_dithered"])
def test_nonfinite_values_stay_nonfinite(name):
    outer = hqt.OuterAllreduce(hq.get_codec(name, **codec_params(name)))
    x = _input((2000,), torch.float32)
    if dist.get_rank() == 0:
        x[5] = float("nan")
    if dist.get_rank() == dist.get_world_size() - 1:
        x[1500] = float("inf")
    got = outer(x, key=0)
    assert not torch.isfinite(got[5]) and not torch.isfinite(got[1500])
    assert same_everywhere(got)


def test_the_local_sgd_example_runs():
    path = Path(__file__).resolve().parents[2] / "examples" / "local_sgd.py"
    spec = importlib.util.spec_from_file_location("local_sgd", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rows = example.main(["--outer-steps", "2", "--inner-steps", "3"])
    assert [r[0] for r in rows] == [0, 1]
    # qsgd:8 against float32: a quarter of the bytes, at most 1.5 times that handed to the
    # collectives (the scatter-reduce-allgather plan's scatter, then its chunk)
    assert all(np.isfinite(r[1]) and r[4] / r[3] > 2.5 for r in rows)
