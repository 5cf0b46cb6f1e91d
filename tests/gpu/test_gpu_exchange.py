"""Whole exchanges of device vectors: the codecs run on the GPU, payloads cross an in-process
threaded world staged through host memory (HostStaged), and every rank's estimate is a device
array equal bit for bit to the CPU ``mean_estimate``. Skipped without a GPU; with
``HQ_TEST_GPU=1`` a missing GPU fails.

    HQ_TEST_GPU=1 python -m pytest -q tests/gpu
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import horovod_quant as hq
from horovod_quant.core.registry import codec_class
from horovod_quant.exchange import Exchange, HostStaged, plans
from horovod_quant.exchange.cost import GPU_RANKS
from horovod_quant.exchange.topology import Topology

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))
from test_gpu_parity import cp, gen, same, same_nan  # noqa: E402,F401  (the fixture)
from threaded_comm import run_ranks  # noqa: E402

CODECS = [c for c in hq.available_codecs() if c != "none"]


def _codec(name: str, n: int):
    params = {"world_size": n} if codec_class(name).needs_world_size else {}
    return hq.get_codec(name, **params)


def _inputs(n: int, size: int) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(size).astype(np.float32) * (r + 1) for r in range(n)]
    xs[0][7] = np.inf  # non-finite values stay non-finite through the device path
    return xs


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("pipeline_elems", [None, 1000])
def test_device_exchange_equals_cpu_reference(cp, name, n, pipeline_elems):  # noqa: F811 (the fixture)
    xs = _inputs(n, 3001)

    def rank_fn(comm):
        ex = Exchange(_codec(name, n), HostStaged(comm), pipeline_elems=pipeline_elems)
        return ex.start(cp.asarray(xs[comm.rank]), 11, "g").wait()

    want, _ = hq.mean_estimate(_codec(name, n), xs, seed=11, pipeline_elems=pipeline_elems)
    for got in run_ranks(n, rank_fn):
        assert isinstance(got, cp.ndarray)
        assert same_nan(got, want), name


def test_device_exchange_sra_schedule(cp):  # noqa: F811 (the fixture)
    n, xs = 3, _inputs(3, 4099)

    def rank_fn(comm):
        ex = Exchange(_codec("qsgd", n), HostStaged(comm), gather="sra")
        return ex.start(cp.asarray(xs[comm.rank]), 4, "s").wait()

    want, _ = hq.mean_estimate(_codec("qsgd", n), xs, seed=4, gather="sra")
    for got in run_ranks(n, rank_fn):
        assert same_nan(got, want)


@pytest.mark.parametrize("name", ["qsgd", "natural", "none", "global_qsgd"])
def test_device_hierarchical_exchange_equals_cpu_reference(cp, name):  # noqa: F811 (the fixture)
    """2 hosts x 2 ranks on threads, host and shard groups staged through host memory: the
    hierarchical pieces run on each rank's worker thread inside the non-default stream the
    vector was made on, the host mean is the exact kernel (subnormal host means kept: a
    ``+=`` of CuPy's would flush them), and the waiting stream reads the finished mean."""
    topology, n, size = Topology.grid(2, 2), 4, 20_011
    xs = [gen("special", size, 40 + r) for r in range(n)]
    for r, x in enumerate(xs):
        x[: size // 8] = np.float32(1e-39) * np.float32(r + 1)  # subnormal host means

    def rank_fn(comm):
        exchange = Exchange(_codec(name, n), HostStaged(comm), pipeline_elems=8192,
                            fabric=GPU_RANKS)
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            x = cp.asarray(xs[comm.rank])  # queued on the stream the worker must follow
            pending = exchange.start(x, 3, "h")
            got = pending.wait().copy()  # on this stream: after the fence
        stream.synchronize()
        return got, pending.stats.plans

    want, _ = hq.mean_estimate(_codec(name, n), xs, seed=3, gather="auto", pipeline_elems=8192,
                               topology=topology, fabric=GPU_RANKS)
    for got, kinds in run_ranks(n, rank_fn, asynchronous=True, topology=topology):
        assert isinstance(got, cp.ndarray) and same(got, want), name
        assert all(k.startswith(plans.HIERARCHICAL) for k in kinds), kinds
