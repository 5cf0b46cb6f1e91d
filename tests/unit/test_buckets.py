"""The bucket layout of ``hq.torch.DistributedOptimizer`` (``torch/buckets.py``), without Horovod:
buckets of about ``fusion_bytes`` in backward order, ``num_groups`` and ``groups``, one device
per bucket, a bucket's flat input, and which parameters Horovod's allreduce carries."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import horovod_quant as hq  # noqa: E402
from horovod_quant.policy import LayerPolicy  # noqa: E402
from horovod_quant.torch.buckets import Bucket, BucketLayout, form_buckets  # noqa: E402

QSGD = hq.get_codec("qsgd")


def params(*sizes: int) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(n)) for n in sizes]


def members(buckets: list[Bucket], ps: list[torch.nn.Parameter]) -> list[list[int]]:
    """Each bucket's parameters as indices into ``ps``."""
    index = {id(p): i for i, p in enumerate(ps)}
    return [[index[id(p)] for p in b.params] for b in buckets]


def test_buckets_of_fusion_bytes_in_backward_order() -> None:
    ps = params(100, 200, 300, 50)  # 400, 800, 1200, 200 float32 bytes
    buckets = form_buckets(ps, QSGD, None, fusion_bytes=1000, first=5)
    assert members(buckets, ps) == [[3, 2], [1, 0]]  # a bucket closes once it reaches 1000
    assert [b.index for b in buckets] == [5, 6]
    assert [b.numel for b in buckets] == [350, 300]
    assert all(b.codec is QSGD and b.mean.shape == (b.numel,) for b in buckets)


def test_num_groups_cuts_equal_bytes() -> None:
    ps = params(100, 200, 300, 50)  # 2600 bytes in all: 4 groups of at most 650 bytes
    assert members(form_buckets(ps, QSGD, 4, 1 << 30, 0), ps) == [[3, 2], [1], [0]]


def test_groups_lists_and_the_rest_one_bucket_each() -> None:
    ps = params(10, 20, 30, 40)
    other = params(5)[0]  # a parameter of another codec: not in these buckets
    buckets = form_buckets(ps, QSGD, [[ps[0], other, ps[2]], [other]], 1 << 30, 0)
    assert members(buckets, ps) == [[0, 2], [1], [3]]


def test_a_bucket_holds_one_device() -> None:
    mixed = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, device="meta"))]
    with pytest.raises(ValueError, match="mixes devices"):
        Bucket(0, mixed, QSGD)
    ps = params(10) + [torch.nn.Parameter(torch.zeros(10, device="meta"))] + params(10)
    with pytest.raises(ValueError, match="mixes devices"):  # user groups are not split
        form_buckets(ps, QSGD, [ps], 1 << 30, 0)


def test_fusion_buckets_split_where_the_device_changes() -> None:
    ps = params(10) + [torch.nn.Parameter(torch.zeros(10, device="meta"))] + params(10)
    assert members(form_buckets(ps, QSGD, None, 1 << 30, 0), ps) == [[2], [1], [0]]


def test_flat_input_views_one_gradient_and_copies_several() -> None:
    (alone,) = params(6)
    alone.grad = torch.arange(6, dtype=torch.float32)
    flat = Bucket(0, [alone], QSGD).flat_input(lambda p: True)
    assert np.shares_memory(flat, alone.grad.numpy())

    a, b, c = params(2, 3, 4)
    a.grad = torch.tensor([1.0, 2.0])
    c.grad = torch.full((4,), 7.0)  # b has no gradient this step: zeros
    bucket = Bucket(0, [a, b, c], QSGD)
    flat = bucket.flat_input(lambda p: True)
    assert flat.tolist() == [1, 2, 0, 0, 0, 7, 7, 7, 7]
    again = bucket.flat_input(lambda p: p is not c)  # c travels elsewhere: zeros
    assert again is flat and again.tolist() == [1, 2, 0, 0, 0, 0, 0, 0, 0]


def test_layout_leaves_small_cast_sparse_and_fallen_back_gradients_to_horovod() -> None:
    model = {"w": torch.nn.Parameter(torch.zeros(64, 64)), "b": torch.nn.Parameter(torch.zeros(64)),
             "head.weight": torch.nn.Parameter(torch.zeros(32, 64)),
             "special.weight": torch.nn.Parameter(torch.zeros(32, 64))}
    ps, names = list(model.values()), {id(p): n for n, p in model.items()}
    nuqsgd = hq.get_codec("nuqsgd")
    policy = LayerPolicy(rules=[("head", hq.get_codec("fp16")), ("special", nuqsgd)])
    layout = BucketLayout(ps, names, QSGD, policy, None, 1 << 20)
    assert [names[id(p)] for p in layout.raw] == ["b", "head.weight"]
    assert layout.cast == {id(model["b"]): torch.float32, id(model["head.weight"]): torch.float16}
    # the default codec's buckets first, then the rules' codecs, numbered in that order
    assert [(b.index, b.codec, [names[id(p)] for p in b.params]) for b in layout.buckets] == [
        (0, QSGD, ["w"]), (1, nuqsgd, ["special.weight"])]
    assert layout.bucket_of == {id(model["w"]): layout.buckets[0],
                                id(model["special.weight"]): layout.buckets[1]}
    described = layout.describe()
    assert described["sparse"] == [] and described["fusion_bytes"] == 1 << 20
    assert described["buckets"][1] == [nuqsgd.config(), [["special.weight", [32, 64]]]]

    layout.sparse.add(id(model["w"]))
    layout.form({id(model["special.weight"])}, keep_buffers=False)
    assert layout.buckets == [] and layout.bucket_of == {}
    assert [names[id(p)] for p in layout.raw] == ["w", "b", "head.weight", "special.weight"]
    assert layout.describe()["sparse"] == ["w"]


def test_a_bucket_formed_again_keeps_its_buffers() -> None:
    model = {f"l{i}": torch.nn.Parameter(torch.zeros(32, 32)) for i in range(2)}
    ps, names = list(model.values()), {id(p): n for n, p in model.items()}
    layout = BucketLayout(ps, names, QSGD, LayerPolicy(), 1, 1 << 20)  # num_groups=1
    (whole,) = layout.buckets
    layout.form({id(ps[0])}, keep_buffers=True)  # the step check's other layout
    (rest,) = layout.buckets
    assert rest is not whole and rest.params == [ps[1]]
    layout.form(set(), keep_buffers=True)
    assert layout.buckets == [whole]  # back, with its buffers
    layout.form({id(ps[0])}, keep_buffers=False)
    layout.form(set(), keep_buffers=False)
    assert layout.buckets[0] is not whole  # dropped when it left without keep_buffers


def test_scratch_views_share_the_largest_buckets_buffer() -> None:
    model = {f"l{i}": torch.nn.Parameter(torch.zeros(n, 32)) for i, n in enumerate((64, 32))}
    ps, names = list(model.values()), {id(p): n for n, p in model.items()}
    layout = BucketLayout(ps, names, QSGD, LayerPolicy(), None, 1)  # a bucket per tensor
    scratch = layout.scratch()
    assert sorted(len(scratch[b]) for b in layout.buckets) == [32 * 32, 64 * 32]
    (largest,) = [b for b in layout.buckets if b.numel == 64 * 32]
    base = scratch[largest].ctypes.data
    assert all(view.ctypes.data == base for view in scratch.values())  # one buffer
