"""The optimizer's default transport on hosts as they are: two emulated hosts (network
namespaces on a bridge, ``benchmarks/emulator.py``), one rank each, trained by
``tests/emulated/train_ranks.py`` (``hq.torch.DistributedOptimizer`` with its defaults).

Hosts whose hostname resolves to 127.0.1.1 or 127.0.0.1 (most Debian/Ubuntu installs) or to
their own address, under ``mpirun`` and under Horovod's gloo controller (which needs the
Horovod that scripts/install.sh builds where hostnames resolve to loopback: see the emulator's
module doc). Every launch has a deadline
(``HQ_EMULATED_TIMEOUT`` seconds, default 120) after which its ranks' stacks are dumped and
they are killed. Needs root and ``ip`` (run through tests/emulated/run.sh).
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import HERE, ROOT, require_namespaces

require_namespaces()

from emulator import EmulatedCluster  # noqa: E402

#: from building the optimizer to the end of its first step, seconds at most
FIRST_STEP_S = 20.0
TIMEOUT_S = float(os.environ.get("HQ_EMULATED_TIMEOUT", "120"))
#: the start of Horovod's stall warning (stall_inspector.cc)
HOROVOD_STALL = "One or more tensors were submitted to be"
TRAIN = os.path.join(HERE, "train_ranks.py")


def launch(controller: str, resolves_to: str, faults=None):
    """Train on 2 emulated hosts; returns (LaunchResult, each rank's RESULT row or None).
    ``faults(cluster)`` gives the per-rank environment additions."""
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
           "OMPI_MCA_mpi_yield_when_idle": "1"}
    with EmulatedCluster(hosts=2, ranks_per_host=1, hostname_resolves_to=resolves_to) as cluster:
        res = cluster.run([sys.executable, TRAIN], controller=controller, env=env,
                          rank_env=faults(cluster) if faults else None, timeout=TIMEOUT_S)
        rows = []
        for rank in range(cluster.size):
            lines = [ln for ln in res.stdout(rank).splitlines() if ln.startswith("RESULT ")]
            rows.append(json.loads(lines[-1][len("RESULT "):]) if lines else None)
        report = res.report()
    return res, rows, report


def check_finished(res, rows, report: str) -> None:
    """Every rank exited 0 before the deadline, printed its row, met no Horovod stall, and
    ends with the same weights."""
    assert res.ok, report
    assert all(row is not None for row in rows), report
    for rank in range(len(rows)):
        assert HOROVOD_STALL not in res.stderr(rank), report
    assert len({row["weights_sha256"] for row in rows}) == 1, rows
    print(f"transport {[row['transport'] for row in rows]}, first step "
          f"{[round(row['first_step_s'], 2) for row in rows]} s, warnings "
          f"{[len(row['warnings']) for row in rows]}")  # shown by pytest -s


@pytest.mark.parametrize("controller,resolves_to",
                         [(controller, resolves_to) for controller in ("mpi", "gloo")
                          for resolves_to in ("127.0.1.1", "127.0.0.1", "own")])
def test_defaults_build_the_gloo_group_quickly_and_quietly(controller, resolves_to):
    """Hosts as they are: the optimizer with its defaults finishes its first step within the
    bound, over the gloo group, without a warning, and the ranks agree."""
    res, rows, report = launch(controller, resolves_to)
    check_finished(res, rows, report)
    for row in rows:
        assert row["transport"] == "gloo", rows
        assert row["first_step_s"] <= FIRST_STEP_S, rows
        assert row["warnings"] == [], rows


def _missing_interface_on_host_1(cluster):
    return lambda slot: {"GLOO_SOCKET_IFNAME": "doesnotexist"} if slot.host.index == 1 else {}


def _wrong_peer_address_on(rank_of):
    def faults(cluster):
        wrong, target = cluster.spare_address(), rank_of(cluster)
        return lambda slot: {"HQ_PEER_ADDR": wrong} if slot.rank == target else {}
    return faults


FAULTS = {
    "GLOO_SOCKET_IFNAME names an interface host 1 lacks": _missing_interface_on_host_1,
    "HQ_PEER_ADDR wrong on rank 0": _wrong_peer_address_on(lambda cluster: 0),
    "HQ_PEER_ADDR wrong on the last rank": _wrong_peer_address_on(lambda cluster:
                                                                  cluster.size - 1),
}


@pytest.mark.parametrize("controller,resolves_to", [("mpi", "127.0.1.1"), ("gloo", "127.0.1.1")])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_wrong_network_setting_never_stalls_the_job(fault, controller, resolves_to):
    """The job finishes and every rank takes the same transport within the time bound: the
    gloo group where it can still be built, else Horovod's collectives with one warning line,
    never in silence."""
    res, rows, report = launch(controller, resolves_to, FAULTS[fault])
    check_finished(res, rows, report)
    assert len({row["transport"] for row in rows}) == 1, rows
    for row in rows:
        assert row["first_step_s"] <= FIRST_STEP_S, rows
        assert len(row["warnings"]) <= 1, rows
    if rows[0]["transport"] == "horovod":
        assert any(row["warnings"] for row in rows), rows
