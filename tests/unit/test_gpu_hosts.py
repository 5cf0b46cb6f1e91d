"""The hierarchical exchange of CUDA gradients, run on the CPU (tests/unit/emulated_device.py:
arrays the package takes for device arrays, the numba kernels behind them).

Threaded ranks on 2 hosts x 3 compose their groups as the CUDA transport does: a gloo world
(staged), and host and shard groups that are NCCL's (device arrays in and out) or gloo's
(staged through host memory; the host's through shared memory). Checked: the exchanges equal
``mean_estimate`` with the topology and the GPU fabric bit for bit, subnormal host means
included, on every rank; the host mean runs as the device backend's ``mean_in_order`` (float
arithmetic on a device array outside a kernel raises); staged groups never see a device array
and NCCL groups get their device buffers unstaged; the pieces run on the hierarchy's worker
thread inside the stream captured at the start, and the caller waits on its fence."""
import threading

import numpy as np
import pytest

import horovod_quant as hq
from horovod_quant.core.registry import codec_class
from horovod_quant.exchange import Exchange, plans
from horovod_quant.exchange.collectives import Collectives
from horovod_quant.exchange.cost import GPU_RANKS
from horovod_quant.exchange.shared_memory import SharedMemoryCollectives
from horovod_quant.exchange.staging import HostStaged, for_device_arrays
from horovod_quant.exchange.topology import Topology

from emulated_device import DeviceArray, emulate_device, stream_entered
from threaded_comm import run_ranks

TOPOLOGY = Topology.grid(2, 3)
_SETUP = threading.local()  # on a rank's thread while it builds its groups (not recorded)


class _Group(Collectives):
    """A threaded rank's group as the CUDA transport builds it: ``nccl`` stands for an NCCL
    group (device arrays in, device arrays out; host arrays too), else for a gloo group
    (host arrays only: a device array here was not staged). ``calls`` records each call's
    group, kind of array, thread and whether a captured stream was current there."""

    pairs_by_order = True

    def __init__(self, inner: Collectives, label: str, nccl: bool, calls: list) -> None:
        self.inner, self.label, self.moves_device_arrays = inner, label, nccl
        self.rank, self.size, self.group_id = inner.rank, inner.size, inner.group_id
        self._calls = calls

    def _run(self, start, arr):
        device = isinstance(arr, DeviceArray)
        assert self.moves_device_arrays or not device, f"{self.label}: an unstaged device array"
        if not getattr(_SETUP, "on", False):
            self._calls.append((self.label, device, threading.current_thread().name,
                                stream_entered()))
        handle = start(arr.view(np.ndarray) if device else arr)
        if not device:
            return handle
        wait = handle.wait

        class _Back:
            def wait(self):
                out = wait()
                return ((out[0].view(DeviceArray), out[1]) if isinstance(out, tuple)
                        else out.view(DeviceArray))

            def done(self):
                return handle.done()
        return _Back()

    def allreduce_async(self, arr, name, op="sum"):
        return self._run(lambda a: self.inner.allreduce_async(a, name, op), arr)

    def allgather_async(self, arr, name):
        return self._run(lambda a: self.inner.allgather_async(a, name), arr)

    def alltoall_async(self, arr, splits, name):
        return self._run(lambda a: self.inner.alltoall_async(a, splits, name), arr)


def _compose(comm, nccl: bool, calls: list) -> Collectives:
    """The collectives the CUDA transport hands the exchanges, on threaded ranks."""
    h = comm.hierarchy
    local = _Group(h.local, "local", nccl, calls)
    if not nccl:  # a gloo host group goes through shared memory where it can
        _SETUP.on = True
        try:
            local = SharedMemoryCollectives(local)
        finally:
            _SETUP.on = False
    world = _Group(comm, "world", False, calls)
    world.hierarchy = h._replace(local=local, cross=_Group(h.cross, "cross", nccl, calls))
    return for_device_arrays(world)


def _codec(name, n, **params):
    if codec_class(name).needs_world_size:
        params["world_size"] = n
    return hq.get_codec(name, **params)


def _inputs(n, size, seed=3):
    """Gradients whose host means hold subnormals (a flushed host mean would show)."""
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    for r, x in enumerate(xs):
        x[: size // 4] = np.float32(1e-39) * np.float32(r + 1)
    return xs


def _same(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


@pytest.mark.parametrize("nccl", [False, True], ids=["gloo-staged", "nccl"])
@pytest.mark.parametrize("name", ["qsgd", "natural", "none", "global_qsgd"])
def test_cuda_hierarchical_exchange_equals_reference(monkeypatch, nccl, name):
    recorded = emulate_device(monkeypatch)
    n, size, calls = TOPOLOGY.size, 5003, []
    xs = _inputs(n, size)

    def rank_fn(comm):
        exchange = Exchange(_codec(name, n), _compose(comm, nccl, calls), pipeline_elems=2000,
                            fabric=GPU_RANKS)
        pending = exchange.start(np.array(xs[comm.rank]).view(DeviceArray), 7, "t")
        return pending.wait(), pending.stats, threading.current_thread().name

    results = run_ranks(n, rank_fn, asynchronous=True, topology=TOPOLOGY)
    want, _ = hq.mean_estimate(_codec(name, n), xs, seed=7, gather="auto", pipeline_elems=2000,
                               topology=TOPOLOGY, fabric=GPU_RANKS)
    if name == "none":  # a float32 sum between the hosts: the subnormal host means show
        assert np.count_nonzero(np.abs(want[: size // 4]) < np.finfo(np.float32).tiny) > 0
    pieces = len(plans.pipeline_bounds(size, 2000))
    for got, stats, _ in results:
        assert isinstance(got, DeviceArray) and _same(got, want), name
        assert list(stats.plans) and all(k.startswith(plans.HIERARCHICAL) for k in stats.plans)
    assert recorded["backend"].calls["mean_in_order"] == n * pieces  # the device host mean
    # the groups: staged ones saw host arrays only (checked in _Group); NCCL ones got the
    # float32 shards as device arrays; every hierarchical collective came from a worker
    # thread, inside the captured stream
    host_calls = [c for c in calls if c[0] in ("local", "cross")]
    assert host_calls and all(thread.startswith("hierarchy.") and entered
                              for _, _, thread, entered in host_calls)
    assert any(device for label, device, _, _ in host_calls if label == "local") == nccl
    assert not [c for c in calls if c[0] == "world"]  # nothing went flat
    # the stream: captured on each rank's thread, entered and fenced on its worker, the
    # fence waited for by the rank's thread
    events = recorded["streams"]
    callers = {thread for _, _, thread in results}
    assert {t for e, t in events if e == "captured"} == callers
    assert {t for e, t in events if e == "waited"} == callers
    assert all(t.startswith("hierarchy.") for e, t in events if e in ("entered", "fenced"))


def test_flat_exchanges_of_device_vectors_go_through_the_staged_world(monkeypatch):
    """A flat plan on the same collectives (gather="sra") runs on the calling thread over the
    world group, its device payloads staged through host memory."""
    recorded = emulate_device(monkeypatch)
    n, calls = TOPOLOGY.size, []
    xs = _inputs(n, 3001)

    def rank_fn(comm):
        composed = _compose(comm, True, calls)
        assert isinstance(composed, HostStaged)  # the world is gloo's
        exchange = Exchange(_codec("qsgd", n), composed, gather="sra", fabric=GPU_RANKS)
        return exchange.start(np.array(xs[comm.rank]).view(DeviceArray), 2, "f").wait()

    want, _ = hq.mean_estimate(_codec("qsgd", n), xs, seed=2, gather="sra")
    for got in run_ranks(n, rank_fn, asynchronous=True, topology=TOPOLOGY):
        assert isinstance(got, DeviceArray) and _same(got, want)
    assert calls and all(label == "world" and not device for label, device, _, _ in calls)
    assert recorded["copies"]["to_device"] >= 2 * n  # the alltoall's and the allgather's
    assert not recorded["streams"]  # flat pieces run on the caller's thread and stream


def test_staging_wraps_only_the_groups_that_need_it():
    """for_device_arrays: a gloo world is staged, NCCL host and shard groups are not, gloo
    ones are; collectives that move device arrays themselves stay as they are."""
    def rank_fn(comm):
        out = {}
        for nccl in (False, True):
            composed = _compose(comm, nccl, [])
            h = composed.hierarchy
            out[nccl] = (type(composed), type(h.local), type(h.cross))
        device_world = _Group(comm, "world", True, [])
        device_world.hierarchy = comm.hierarchy
        out["device world"] = for_device_arrays(device_world) is device_world
        return out

    for out in run_ranks(TOPOLOGY.size, rank_fn, asynchronous=True, topology=TOPOLOGY):
        assert out[False] == (HostStaged, HostStaged, HostStaged)
        assert out[True] == (HostStaged, _Group, _Group)
        assert out["device world"] is False  # its threaded host groups take host arrays only


def test_nccl_only_where_every_rank_of_a_host_has_a_gpu_of_its_own():
    """The CUDA transport's host and shard groups are NCCL's only where every rank has NCCL
    and a GPU no other rank of its host uses (NCCL refuses two ranks on one GPU): the answer
    every rank computes from the same reports."""
    transport = pytest.importorskip("horovod_quant.torch.transport")  # needs torch
    choose, topology = transport.host_group_backend, Topology.grid(2, 2)

    def ranks(*gpus, nccl=True):
        return [{"nccl": nccl, "gpu": g} for g in gpus]

    assert choose(ranks("a", "b", "a", "b"), topology)[0] == "nccl"  # hosts may repeat UUIDs
    backend, why = choose(ranks("a", "b", "c", "c"), topology)
    assert backend == "gloo" and "host 1 ([2, 3])" in why
    assert choose(ranks("a", "b", "c", "d", nccl=False), topology)[0] == "gloo"
    assert choose(ranks("a", None, "c", "d"), topology)[0] == "gloo"
    assert choose([None] + ranks("b", "c", "d"), topology)[0] == "gloo"
