"""benchmarks/convergence.py's tasks: the standard-library split is by file and deterministic,
each task's model and batches fit its loss, and the output names keep the MLP's."""
from __future__ import annotations

import argparse
import os

import pytest
from benchmark_module import load_benchmark

torch = pytest.importorskip("torch")

conv = load_benchmark("convergence")


def test_stdlib_split_is_by_file_deterministic_and_disjoint():
    train, val = conv.stdlib_sources()
    assert (train, val) == conv.stdlib_sources()
    assert train and val and not set(train) & set(val)
    assert all(f.endswith(".py") for f in train + val)
    assert not any(part in ("test", "tests", "site-packages")
                   for f in train + val for part in f.split(os.sep))
    assert 0.03 < len(val) / (len(train) + len(val)) < 0.2


def test_bytelm_batches_are_shifted_windows_of_the_shard():
    task = conv.ByteLM()
    stream = torch.arange(1000) % 256
    shard = task.shard({"train": stream}, 1, 2)
    assert torch.equal(shard, stream[500:])
    x, y = task.batch_of(shard, torch.Generator().manual_seed(0), 3)
    assert x.shape == y.shape == (3, task.context)
    assert torch.equal(x[:, 1:], y[:, :-1])
    loss = task.loss(task.model(), x, y)
    assert loss.ndim == 0 and 5.0 < loss.item() < 6.5  # about ln 256 at initialisation


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_digits_tasks_train_on_their_batches(name):
    task = conv.TASKS[name]()
    x = torch.rand(40, 64)
    y = torch.arange(40) % 10
    shard = task.shard((x, y, x, y), 0, 2)
    xb, yb = task.batch_of(shard, torch.Generator().manual_seed(0), 8)
    model = task.model()
    assert model(xb).shape == (8, 10)
    task.loss(model, xb, yb).backward()
    assert set(task.evaluate(model, (x, y, x, y))) == {"train_loss", "test_loss", "test_acc"}


def test_output_names_keep_the_mlps():
    def ns(**kw):
        return argparse.Namespace(**{"tag": "", **kw})
    assert conv.prefix(ns(task="mlp")) == "convergence"
    assert conv.prefix(ns(task="mlp", tag="stress")) == "convergence_stress"
    assert conv.prefix(ns(task="bytelm")) == "convergence_bytelm"
    assert conv.prefix(ns(task="cnn", tag="x")) == "convergence_cnn_x"


def test_world_lr_scales_linearly_or_by_sqrt():
    assert conv.world_lr(conv.DigitsMLP, 0.025, 4) == pytest.approx(0.1)
    assert conv.world_lr(conv.ByteLM, 0.0015, 4) == pytest.approx(0.003)
