"""benchmarks/plateau.py: each simulated worker's gradient is the mean over its own windows (their
mean is the full batch's gradient); a run's row carries its curve, plateau and payload bytes;
the report flags divergence, a growing gap and a gap beyond the seed spread, and shows the
levels a summed codec keeps at each world."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from benchmark_module import load_benchmark

torch = pytest.importorskip("torch")

plateau = load_benchmark("plateau")
import plateau_report  # noqa: E402 (after the benchmark's path is set)


@pytest.fixture(scope="module")
def task_and_data():
    task = plateau.plateau_task()
    return task, task.data()


def test_the_workers_gradients_average_to_the_full_batch_gradient(task_and_data):
    task, data = task_and_data
    torch.manual_seed(0)
    model = task.model()
    gen = torch.Generator().manual_seed(1)
    x, y = task.batch_of(data["train"], gen, 8)
    per_worker = plateau.worker_gradients(model, x.reshape(4, 2, -1), y.reshape(4, 2, -1))
    assert per_worker.shape == (4, sum(p.numel() for p in model.parameters()))
    model.zero_grad()
    task.loss(model, x, y).backward()
    full = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(per_worker.mean(0), full, rtol=1e-4, atol=1e-6)
    # the workers' batches differ, so their gradients do
    assert not torch.allclose(per_worker[0], per_worker[1])


def test_a_run_records_its_curve_plateau_and_payload_bytes(task_and_data):
    task, data = task_and_data
    plateau.EVAL_EVERY, saved = 2, plateau.EVAL_EVERY
    try:
        row = plateau.train_one(task, data, "qsgd 4b", "adamw", 4, 1, 0, 4)
        base = plateau.train_one(task, data, "fp32", "adamw", 4, 1, 0, 4)
    finally:
        plateau.EVAL_EVERY = saved
    assert [c[0] for c in row["curve"]] == [0, 2, 4] and row["steps"] == 4
    assert row["curve"][0] == base["curve"][0]  # one initialisation per seed
    assert row["val_loss"] < row["curve"][0][1] and not row["diverged"]
    assert 0 < row["payload_bytes_per_step"] < 4 * sum(
        p.numel() for p in task.model().parameters()) / 4  # about 4 bits an element
    assert base["payload_bytes_per_step"] == 0  # float32 travels uncompressed, as Horovod's
    json.dumps(row)


def test_the_plateau_is_the_first_evaluation_near_the_best():
    curve = [[0, 5.0], [50, 2.1], [100, 2.02], [150, 2.0], [200, 2.01]]
    assert plateau.plateau_step(curve) == 100
    assert plateau.plateau_step([[0, math.nan]]) == 0
    assert plateau_report.steps_to_reach(curve, 2.0) == 100
    assert plateau_report.steps_to_reach(curve, 1.5) is None


def _row(codec, seed, final, at_plateau, workers=4, hosts=1, diverged=False, plateau=100):
    curve = ([[0, 5.0, 0.0, 5.0]] + [[s, at_plateau, 0.5, 1.5] for s in range(100, 600, 100)]
             + [[s, final, 0.5, 1.4] for s in range(600, 1100, 100)])
    return {"optimizer": "adamw", "workers": workers, "hosts": hosts, "codec": codec,
            "seed": seed, "steps": 1000, "val_loss": final, "val_acc": 0.5,
            "train_loss": 1.4, "plateau_step": plateau, "best_val_loss": min(final, at_plateau),
            "diverged": diverged, "lr": 3e-3, "load_1min": [1.0, 2.0], "curve": curve}


def test_the_report_pairs_by_seed_and_flags_divergence_growth_and_spread(tmp_path):
    rows = []
    for seed, base in enumerate((2.00, 2.01, 1.99)):
        rows += [_row("fp32", seed, base, base),
                 _row("qsgd 8b", seed, base + 0.001, base + 0.001),
                 # paired by seed its gaps are 0.05, 0.06, 0.07; paired otherwise not
                 _row("qsgd 4b", seed, base + 0.05 + 0.01 * seed, base + 0.01),
                 _row("ndqsg", seed, math.inf if seed == 1 else base, base, diverged=seed == 1),
                 _row("global-qsgd lin 8b", seed, base + 0.03, base + 0.03, workers=64),
                 # float32's plateau at the final window's first evaluation: the growth is
                 # measured from the evaluations before it
                 _row("fp32", seed, base, base, workers=16, plateau=600),
                 _row("qsgd 4b", seed, base + 0.05, base, workers=16)]
        rows.append(_row("fp32", seed, base, base, workers=64))
    plateau_report.report(rows, SimpleNamespace(out=str(tmp_path)))
    lines = (tmp_path / "plateau.md").read_text().splitlines()

    def gaps(codec):  # the codec's row of the gap table (the first table it leads a row of)
        return next(r for r in lines if r.startswith(f"| {codec} |"))

    assert "**" not in gaps("qsgd 8b")
    cells = gaps("qsgd 4b").split(" | ")
    assert "(+0.0600 ± 0.0100) **growing** **spread**" in cells[1]
    assert "(+0.0500 ± 0.0000) **growing** **spread**" in cells[2]
    assert "**diverged**" in gaps("ndqsg")
    assert "[1 levels]" in gaps("global-qsgd lin 8b")  # 64 workers' sum: one linear level
    saved = json.loads((tmp_path / "plateau.json").read_text())
    assert saved["meta"]["load_1min"] == [1.0, 2.0] and len(saved["rows"]) == len(rows)
    assert (tmp_path / "plateau_adamw.png").stat().st_size > 0
    # the committed plateau.json alone is enough to report again and to resume from
    again = plateau.read_rows(str(tmp_path))
    assert sorted(map(json.dumps, again)) == sorted(map(json.dumps, rows))


def test_a_run_s_last_row_counts_where_it_ran_twice(tmp_path):
    first, second = _row("fp32", 0, 2.0, 2.0), _row("fp32", 0, 1.9, 1.9)
    (tmp_path / "plateau.jsonl").write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    assert plateau.read_rows(str(tmp_path)) == [second]
