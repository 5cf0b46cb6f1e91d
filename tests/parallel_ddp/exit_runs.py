"""Runs exit_job.py's DDP job many times and fails unless every rank of every run exits 0.

    python3 tests/parallel_ddp/exit_runs.py --shape 2x2 --runs 20

Each run's ranks are processes forked from this one after it imported torch and the package,
each given the environment torchrun gives its ranks (RANK, LOCAL_RANK, GROUP_RANK, ...: "NxK"
is N nodes of K ranks, which the hook treats as N hosts). Importing torch takes most of a
torchrun launch's time on a small machine (three interpreters for two ranks, about 13 s a run
on 2 cores); forked, a run takes the job's own time. What is checked is the same: a forked
rank ends as a launched one does, its interpreter finalizing (atexit, thread shutdown, module
teardown), not through ``os._exit``, so a gloo thread that frees a tensor once finalization
has begun aborts it ("terminate called without an active exception", status -6), as it
aborted 6 of 20 torchrun launches of two-node jobs before the package released its tensors at
exit. ``--without-release`` takes that release out (atexit handler and kept tensors), to show
that this runner sees those aborts. The suites under torchrun (tests/parallel_ddp/run.sh) keep
the launcher's own exit path checked.
"""
from __future__ import annotations

import argparse
import atexit
import gc
import os
import signal
import sys
import time
import traceback

import numpy as np
import torch  # noqa: F401  (imported before forking: the children skip the imports)
import torch._dynamo  # noqa: F401  (DDP's constructor imports it: seconds more)

import horovod_quant as hq
from horovod_quant.torch import distributed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exit_job  # noqa: E402
from torchrun_env import free_port, rank_environment  # noqa: E402


def run_rank(env: dict[str, str]) -> None:
    """In a forked child: the job as one rank, then the interpreter's own exit (never returns)."""
    os.environ.update(env)
    status = 0
    try:
        exit_job.main()
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.exit(status)  # SystemExit unwinds to the top: the interpreter finalizes


def one_run(nodes: int, per_node: int, deadline_s: float) -> list[int]:
    """Forks the ranks of one run and waits for them; returns each rank's exit status
    (negative: killed by that signal; -9 also for a rank past the deadline)."""
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(nodes * per_node):
        pid = os.fork()
        if pid == 0:
            run_rank(rank_environment(rank, nodes, per_node, port))
        pids.append(pid)
    status = {}
    end = time.monotonic() + deadline_s
    while len(status) < len(pids):
        for pid in pids:
            if pid not in status:
                done, code = os.waitpid(pid, os.WNOHANG)
                if done:
                    status[pid] = os.waitstatus_to_exitcode(code)
        if time.monotonic() > end:
            for pid in set(pids) - set(status):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status[pid] = -signal.SIGKILL
        time.sleep(0.01)
    return [status[pid] for pid in pids]


def without_release() -> None:
    """Takes out the package's release of collective tensors at exit (for showing that the
    runner catches the aborts it prevents)."""
    atexit.unregister(distributed._release_at_exit)
    distributed.HANDED.add = lambda work, *tensors: work


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="2", help="N ranks, or NxK: N nodes of K ranks")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds per run")
    parser.add_argument("--without-release", action="store_true")
    args = parser.parse_args()
    nodes, per_node = map(int, args.shape.split("x")) if "x" in args.shape else (1, int(args.shape))
    if args.without_release:
        without_release()
    # the job's codec run once before forking: the children find its compiled functions loaded
    hq.mean_estimate(hq.get_codec("qsgd", bits=4), [np.ones(64, np.float32)] * 2, seed=0)
    # the parent's objects (torch's, the package's) out of the collector's reach: a child's
    # exit then spends no seconds collecting what it inherited; it still finalizes (atexit,
    # threads, module teardown) as a launched rank does
    gc.freeze()
    failed = 0
    for i in range(1, args.runs + 1):
        codes = one_run(nodes, per_node, args.deadline)
        if any(codes):
            failed += 1
            print(f"!! run {i} of {args.shape}: exit statuses {codes}", flush=True)
    print(f"exit_job.py: {args.runs - failed} of {args.runs} runs of {args.shape} ranks exited 0"
          f" (forked ranks{', without the release' if args.without_release else ''})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
