"""A rank that runs one step more than the others (tests/uneven_steps_job.py) fails the job on
every rank with the same error, naming the ranks and their steps, within seconds of the others'
end, in every door: the hq optimizer over its gloo group and over Horovod's collectives,
Horovod's optimizer with ``compression=``, under Horovod's gloo controller and under mpirun,
the DDP hook under torchrun (2 ranks, and 2 nodes x 2), TensorFlow's compressor. That ranks
which ran the same steps end with status 0 and no OutOfStep is checked where a job already runs
even steps: tests/unit/test_examples.py's torchrun job of examples/ddp_train.py (the DDP hook,
2 ranks), besides every multi-rank suite's launches, which fail on any rank's non-zero status."""
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

pytest.importorskip("horovod.torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "tests", "uneven_steps_job.py")
HOROVODRUN = [sys.executable, os.path.join(ROOT, "tests", "horovodrun.py")]
LAUNCHERS = {
    "gloo": HOROVODRUN + ["-np", "2", "-H", "localhost:2", "--gloo"],
    "mpi": ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"],
    "torchrun": ["torchrun", "--standalone", "--nproc_per_node", "2"],
}
#: each way a rank learns of the others' end: polling its gloo group's wait (optimizer-auto on
#: CPU), an error of Horovod's collectives in the door (optimizer-horovod), an error of
#: Horovod's own wait explained at exit (compression), polling the DDP hook's wait
JOBS = [("gloo", "optimizer-horovod"), ("gloo", "compression"), ("mpi", "optimizer-auto"),
        ("torchrun", "ddp"), ("gloo", "tensorflow")]
EXPECTED = ("the ranks ran different numbers of steps of the {door}: rank 0 waits in an "
            "exchange of its step 3 that no other rank started, {ended}")


def _run(launcher: list[str], *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """The job's result, and the time it ended (seconds since the epoch)."""
    tool = os.path.basename(launcher[0]) if launcher[0] != sys.executable else "horovodrun"
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", TF_USE_LEGACY_KERAS="1",
               TF_CPP_MIN_LOG_LEVEL="2", OMPI_MCA_mpi_yield_when_idle="1")
    python = [] if tool == "torchrun" else [sys.executable]
    proc = subprocess.run(launcher + python + [JOB, *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    return proc, time.time()


def _same_error_on_every_rank(proc: subprocess.CompletedProcess, door: str, ranks: int,
                              ended: float) -> None:
    """The job failed; every rank reported the same error (rank 0 raised it, or printed it at
    its exit after Horovod's own wait raised, or its ledger's watch thread printed it and
    ended it; the others printed it at their exit), rank 0 within 30 s of the others' last
    step (where rank 0 raised nothing, the job's end, ``ended``, counts)."""
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    ended = ", ".join(f"rank {r} ended its job after 3 steps" for r in range(1, ranks))
    expected = EXPECTED.format(door=door, ended=ended)
    assert out.count(expected) >= ranks, out[-3000:]
    raised = re.search(r"rank 0 raised at ([\d.]+)", out)
    done = [float(t) for t in re.findall(r"rank [1-9]\d* done at ([\d.]+)", out)]
    assert len(done) == ranks - 1 and "rank 0 done at" not in out, out[-3000:]
    assert (float(raised.group(1)) if raised else ended) - max(done) < 30


@pytest.mark.parametrize("launcher,door", JOBS)
def test_a_rank_with_one_step_more_fails_on_every_rank(launcher, door):
    if door == "tensorflow" and importlib.util.find_spec("tensorflow") is None:
        pytest.skip("TensorFlow is not installed")
    proc, ended = _run(LAUNCHERS[launcher], door)
    name = {"ddp": "DDP hook", "compression": "compressor",
            "tensorflow": "TensorFlow compressor"}.get(door, "optimizer")
    _same_error_on_every_rank(proc, name, 2, ended)


def test_ddp_on_two_nodes_of_two_ranks():
    """Rank 0 of node 0 one step ahead of the three other ranks (hierarchical exchanges)."""
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun is not installed")
    port = str(29500 + os.getpid() % 1000)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen(
        ["torchrun", "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", port, JOB, "ddp"],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in range(2)]
    outs = [node.communicate(timeout=300)[0] for node in nodes]
    proc = subprocess.CompletedProcess([], max(n.returncode for n in nodes), "".join(outs), "")
    _same_error_on_every_rank(proc, "DDP hook", 4, time.time())

