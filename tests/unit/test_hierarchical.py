"""The hierarchical exchange: float32 inside each host, the codec between hosts only.

Checked here without Horovod: its structure against an independent composition of the flat
reference (host means, then one exchange per shard between the hosts), the Exchange runner on
threaded ranks with sub-groups against mean_estimate bit for bit, its statistics (unbiased;
the variance of one quantization per host), the cost model's choices and bytes, and
mismatched host shards."""
import glob
import os
import threading

import numpy as np
import pytest

import horovod_quant as hq
from horovod_quant.core.exponent_reduction import chunk_bounds
from horovod_quant.core.registry import codec_class
from horovod_quant.doors import (
    DDP_DOOR,
    FSDP_DOOR,
    OPTIMIZER_DOOR,
    OUTER_DOOR,
    TF_DOOR,
    TORCH_COMPRESSOR_DOOR,
    DoorEnvironment,
)
from horovod_quant.exchange import Exchange, plans
from horovod_quant.exchange.collectives import joined
from horovod_quant.exchange.cost import (
    CPU_RANKS,
    GPU_RANKS,
    Fabric,
    flat_cost,
    float32_ring,
    plan_cost,
)
from horovod_quant.exchange.shared_memory import SharedMemoryCollectives
from horovod_quant.exchange.topology import Topology

from threaded_comm import run_ranks

SHAPES = [(2, 2), (2, 3), (3, 2)]


def _codec(name, n, **params):
    if codec_class(name).needs_world_size:
        params["world_size"] = n
    return hq.get_codec(name, **params)


def _inputs(n, size, seed=0, spread=0.3):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(size).astype(np.float32)
    return [base + spread * rng.standard_normal(size).astype(np.float32) for _ in range(n)]


def test_topology_groups():
    t = Topology.from_host_keys(["b", "a", "b", "a"])  # round-robin placement
    assert t.hosts == ((0, 2), (1, 3)) and t.hierarchical
    assert t.local_group(3) == (1, 3) and t.cross_group(3) == (2, 3) and t.local_rank(3) == 1
    assert t.groups() == [(0, 2), (1, 3), (0, 1), (2, 3)]
    assert not Topology.grid(4, 1).hierarchical and not Topology.grid(1, 4).hierarchical
    assert not Topology.from_host_keys([0, 0, 1]).hierarchical  # hosts of unequal sizes


@pytest.mark.parametrize("name,params", [("qsgd", {"bits": 4}), ("none", {}),
                                         ("global_qsgd", {"levels": "linear"}),
                                         ("natural", {})])
def test_hierarchical_is_host_means_exchanged_between_hosts(name, params):
    """The plan equals its definition composed from the flat reference: each host's float32
    mean (summed in local rank order), shard k of it exchanged between the hosts with the
    codec built for that many hosts and seed shard_seed(seed, k), the shards concatenated."""
    hosts, k = 2, 3
    n, size, seed = hosts * k, 5003, 9
    codec = _codec(name, n, **params)
    xs = _inputs(n, size)
    topology = Topology.grid(hosts, k)
    got, _ = hq.mean_estimate(codec, xs, seed=seed, gather="hierarchical", topology=topology)
    cross = codec.for_world_size(hosts)
    host_means = []
    for ranks in topology.hosts:
        total = xs[ranks[0]].copy()
        for r in ranks[1:]:
            total += xs[r]
        host_means.append(total / np.float32(k))
    kind = plans.plan_kind(codec, topology, size, "hierarchical", hierarchy=True)
    inner = kind[len(plans.HIERARCHICAL):]
    want = np.empty(size, np.float32)
    for shard, (lo, hi) in enumerate(chunk_bounds(size, k)):
        want[lo:hi], _ = hq.mean_estimate(cross, [m[lo:hi] for m in host_means],
                                          seed=plans.shard_seed(seed, shard),
                                          gather=inner if inner in ("allgather", "sra")
                                          else "auto")
    assert np.array_equal(got, want)


@pytest.mark.parametrize("name", hq.available_codecs())
@pytest.mark.parametrize("hosts,local,shared", [s + (False,) for s in SHAPES] + [(2, 3, True)])
def test_exchange_over_threaded_hosts_matches_reference(name, hosts, local, shared):
    """Every codec through Exchange on threaded ranks whose collectives have sub-groups (the
    host's through shared memory, or not): pieces take the hierarchical plans (run on each
    rank's worker thread) and give mean_estimate's bits for that topology; the float32 shards
    count as bytes inside the host, not as bytes sent."""
    n = hosts * local
    topology = Topology.grid(hosts, local)
    xs = _inputs(n, 2500, seed=n)

    def rank_fn(comm):
        if shared:
            comm.hierarchy = comm.hierarchy._replace(
                local=SharedMemoryCollectives(comm.hierarchy.local))
        ex = Exchange(_codec(name, n), comm, gather="hierarchical", pipeline_elems=900)
        pending = ex.start(xs[comm.rank], 11, "t")
        return pending.wait(), pending.stats, ex.kind_for(2500)

    results = run_ranks(n, rank_fn, asynchronous=True, topology=topology)
    want, _ = hq.mean_estimate(_codec(name, n), xs, seed=11, gather="hierarchical",
                               pipeline_elems=900, topology=topology)
    for got, stats, kind in results:
        assert np.array_equal(got, want, equal_nan=True)
        assert kind.startswith(plans.HIERARCHICAL)
        assert sum(stats.plans.values()) == 3 and stats.bytes_local > 0
    assert all(np.array_equal(r[0], results[0][0], equal_nan=True) for r in results)


def test_auto_takes_the_hierarchy_only_where_ranks_share_hosts():
    codec = hq.get_codec("qsgd", bits=8)
    big = 1 << 20
    assert plans.plan_kind(codec, Topology.grid(2, 2), big, hierarchy=True) == \
        "hierarchical-allgather"
    assert plans.plan_kind(codec, Topology.grid(4, 2), big, hierarchy=True) == "hierarchical-sra"
    assert plans.plan_kind(codec, Topology.grid(4, 1), big, hierarchy=True) == "sra"
    assert plans.plan_kind(codec, Topology.grid(2, 2), big, hierarchy=False) == "sra"
    assert plans.plan_kind(codec, Topology.grid(2, 2), big, "sra", hierarchy=True) == "sra"
    gq = _codec("global_qsgd", 8)
    assert plans.plan_kind(gq, Topology.grid(4, 2), big, hierarchy=True) == "hierarchical-custom"
    assert plans.runnable("hierarchical-custom", True, cross_custom=False) == \
        "hierarchical-allgather"


@pytest.mark.parametrize("hosts,local,bits,plan,most", [
    (2, 1, 8, "allgather", 0.26), (2, 2, 8, "hierarchical-allgather", 0.17),
    (4, 1, 8, "sra", 0.26), (4, 2, 8, "hierarchical-sra", 0.22),
    (2, 2, 4, "hierarchical-allgather", 0.09), (4, 2, 4, "hierarchical-sra", 0.11)])
def test_chosen_plan_sends_a_fraction_of_a_float32_ring(hosts, local, bits, plan, most):
    """The plan 8-bit and 4-bit qsgd take for a 12 MiB vector (docs/scaling.md) and its bytes
    over the most loaded host's interface against Horovod's float32 ring allreduce: at most
    0.26 at 8 bits at every shape (the floor is 0.25 of a flat allreduce's)."""
    topology, numel = Topology.grid(hosts, local), 3 << 20
    codec = hq.get_codec("qsgd", bits=bits)
    kind = plans.plan_kind(codec, topology, numel, hierarchy=True)
    ratio = (plan_cost(kind, topology, numel, codec).host_bytes
             / flat_cost("sum", topology, 4.0 * numel).host_bytes)
    assert kind == plan and ratio <= most, (kind, ratio)


def test_cpu_ranks_fabric_is_the_earlier_model():
    """The CPU ranks' fabric gives the weights the plan choice always had: 64 KiB of the link
    per round across hosts, a byte inside a host a tenth of one over the link."""
    assert CPU_RANKS.round_bytes == 64 << 10 and CPU_RANKS.local_weight == 0.1
    assert Fabric.for_ranks(False) == CPU_RANKS


@pytest.mark.parametrize("hosts,local", [(2, 4), (4, 8)])
@pytest.mark.parametrize("bits,most", [(8, 0.30), (4, 0.17)])
def test_gpu_hosts_take_the_hierarchy(hosts, local, bits, most):
    """GPU ranks (PCIe inside a host, 10 Gbit/s between hosts: the GPU defaults) at 2 x 4 and
    4 x 8: qsgd (bucket 512, max norm) on 25 MB fused buckets takes a hierarchical plan, whose
    bytes across hosts per step, pipelined pieces included, are at most 0.30 of NCCL's float32
    ring's at 8 bits and 0.17 at 4 bits."""
    topology, numel = Topology.grid(hosts, local), (25 << 20) // 4
    codec = hq.get_codec("qsgd", bits=bits, bucket_size=512, norm="max")
    choice = plans.plan_choice(codec, topology, numel, hierarchy=True, fabric=GPU_RANKS)
    assert choice.kind.startswith(plans.HIERARCHICAL), choice
    assert choice.cost == plan_cost(choice.kind, topology, numel, codec)
    per_step = sum(plan_cost(choice.kind, topology, hi - lo, codec).host_bytes
                   for lo, hi in plans.pipeline_bounds(numel, plans.DEFAULT_PIPELINE_ELEMS))
    ring = float32_ring(topology, numel).host_bytes
    assert choice.cost.host_bytes / ring <= most and per_step / ring <= most, per_step / ring


def test_the_fabric_decides_between_the_plans(monkeypatch):
    """A network about as fast as the fabric inside a host (and quick rounds) makes the float32
    traffic inside the host dear: 8 ranks per host then exchange flat; the GPU defaults and
    NVLink take the hierarchy. The environment sets each field, read by the doors that weigh
    the fabric (``DoorEnvironment``), not by the fabric itself."""
    codec, topology, numel = hq.get_codec("qsgd"), Topology.grid(2, 8), 1 << 22
    slow_inside = Fabric(link_gbit=100.0, intra_gbyte=10.0, round_us=20.0)
    assert plans.plan_kind(codec, topology, numel, hierarchy=True, fabric=slow_inside) in \
        ("allgather", "sra")
    for fabric in (GPU_RANKS, Fabric(link_gbit=100.0, intra_gbyte=300.0)):
        assert plans.plan_kind(codec, topology, numel, hierarchy=True,
                               fabric=fabric).startswith(plans.HIERARCHICAL)
    monkeypatch.setenv("HQ_LINK_GBIT", "100")
    monkeypatch.setenv("HQ_INTRA_GBYTE", " 10 ")
    assert Fabric.for_ranks(True) == GPU_RANKS  # the environment is the doors' to read
    for door in (OPTIMIZER_DOOR, DDP_DOOR, FSDP_DOOR, OUTER_DOOR, TORCH_COMPRESSOR_DOOR,
                 TF_DOOR):  # every door weighs it
        assert DoorEnvironment.read(door).fabric(True) == \
            slow_inside._replace(round_us=GPU_RANKS.round_us)
    monkeypatch.setenv("HQ_ROUND_US", "20")
    assert DoorEnvironment.read(DDP_DOOR).fabric(False) == slow_inside
    assert Fabric.for_ranks(False, {"link_gbit": 100.0, "intra_gbyte": 10.0,
                                    "round_us": 20.0}) == slow_inside
    monkeypatch.setenv("HQ_ROUND_US", "0")
    with pytest.raises(ValueError, match="HQ_ROUND_US='0' must be a positive number of "
                                         "microseconds"):
        DoorEnvironment.read(OUTER_DOOR)


def test_a_door_fabric_reproduces_in_mean_estimate():
    """An Exchange with a fabric and mean_estimate with the same fabric choose the same plan,
    where the CPU default would choose another (at 4 x 2: the inner sra on CPU ranks, the
    inner allgather, one round fewer, on a 10 Gbit/s network whose rounds take 0.5 ms and so
    cost more link bytes)."""
    topology, n, size = Topology.grid(4, 2), 8, 100_000
    codec = hq.get_codec("qsgd", bits=4)
    assert plans.plan_kind(codec, topology, size, hierarchy=True) == "hierarchical-sra"
    xs = _inputs(n, size, seed=1)
    slow_rounds = GPU_RANKS._replace(round_us=CPU_RANKS.round_us)

    def rank_fn(comm):
        pending = Exchange(codec, comm, fabric=slow_rounds).start(xs[comm.rank], 4, "f")
        return pending.wait(), pending.stats.plans

    want, _ = hq.mean_estimate(codec, xs, seed=4, gather="auto", topology=topology,
                               fabric=slow_rounds)
    for got, kinds in run_ranks(n, rank_fn, asynchronous=True, topology=topology):
        assert np.array_equal(got, want) and list(kinds) == ["hierarchical-allgather"]


def _squared_error(estimates, target):
    return np.mean([np.sum((e.astype(np.float64) - target) ** 2) for e in estimates])


@pytest.mark.parametrize("name,params", [("qsgd", {"bits": 3}), ("natural", {}),
                                         ("standard_dithering", {"bits": 3})])
def test_variance_is_one_quantization_per_host(name, params):
    """E[estimate] is the mean of every rank's vector, and E||estimate - mean||^2 is
    (1/H^2) sum_h E||Q(x_h) - x_h||^2 over the H host means x_h (each shard of each quantized
    once, with independent seeds), within the codec's bound omega(d) / H^2 sum_h ||x_h||^2
    (docs/codecs.md, "Hierarchical exchange")."""
    hosts, local, size, trials = 2, 3, 1024, 400
    codec = hq.get_codec(name, **params)
    xs = [x.astype(np.float32) for x in _inputs(hosts * local, size, seed=4, spread=1.0)]
    topology = Topology.grid(hosts, local)
    estimates = [hq.mean_estimate(codec, xs, seed=t, gather="hierarchical",
                                  topology=topology)[0] for t in range(trials)]
    target = np.mean(np.asarray(xs, np.float64), axis=0)
    host_means = [np.mean(np.asarray([xs[r] for r in ranks], np.float64), axis=0)
                  .astype(np.float32) for ranks in topology.hosts]
    shards = chunk_bounds(size, local)  # each shard of a host mean is quantized on its own
    one_host = [_squared_error([codec.decode(codec.encode(m[lo:hi], seed=10_000 + t))
                                for t in range(trials)], m[lo:hi])
                for m in host_means for lo, hi in shards]
    predicted = sum(one_host) / hosts ** 2
    measured = _squared_error(estimates, target)
    # unbiased: the mean of the trials is within 5 standard errors of the target, per element
    spread = np.sqrt(predicted / size / trials)
    assert np.max(np.abs(np.mean(estimates, axis=0) - target)) < 5 * spread * 1.5
    assert abs(measured / predicted - 1) < 0.2, (measured, predicted)
    bucket = min(codec.params.get("bucket_size") or size, size // local)
    bound = codec.omega(bucket) / hosts ** 2 * sum(float(np.sum(m.astype(np.float64) ** 2))
                                                   for m in host_means)
    assert measured <= bound * 1.2, (measured, bound)


@pytest.mark.parametrize("odd,want", [
    ("tensor", "different tensors"),
    ("step", "out of step in exchange 't': rank 0 at step 0, rank 1 at step 1, rank 2 at step 0, "
             "rank 3 at step 0")])
def test_a_rank_at_odds_on_its_host_fails_every_rank_alike(odd, want):
    """The host shards carry the exchange's tag: a rank that exchanges another tensor, or at
    another step, makes every rank raise the same error (ranks numbered in the world) before
    anything is combined."""
    topology = Topology.grid(2, 2)
    xs = _inputs(4, 1000)

    def rank_fn(comm):
        ex = Exchange(hq.get_codec("qsgd"), comm, gather="hierarchical")
        at_odds = comm.rank == 1
        name = "other" if at_odds and odd == "tensor" else "t"
        step = int(at_odds and odd == "step")
        try:
            ex.start(xs[comm.rank], 3, "t", tag=plans.wire.exchange_tag(name, (1000,), step)
                     ).wait()
        except ValueError as exc:
            return str(exc)
        return None

    results = run_ranks(4, rank_fn, asynchronous=True, topology=topology)
    assert want in results[0] and len(set(results)) == 1, results


def _shared(n, fn):
    """``fn(collectives)`` on n threaded ranks sharing memory, the threaded world their
    control group."""
    return run_ranks(n, lambda comm: fn(SharedMemoryCollectives(comm)), asynchronous=True)


def test_shared_memory_collectives_equal_the_socket_ones():
    """allgather and alltoall through shared memory give what the control group's own
    collectives give, for lengths that differ by rank and grow (new regions), over many calls;
    a rank never holds more than its two regions' files, and none at exit."""

    def rank_fn(shm):
        r, files = shm.rank, []
        for call, size in enumerate([10, 10, 5000, 3, 200_000, 7, 200_001, 0, 12]):
            arr = (np.arange(size + r) * (r + 1) + call).astype(np.float32)
            got = joined(shm.allgather_async(arr, "x").wait())
            want = np.concatenate([(np.arange(size + q) * (q + 1) + call).astype(np.float32)
                                   for q in range(shm.size)])
            assert np.array_equal(got, want), (call, size)
            splits = [size // 3, size // 3, size - 2 * (size // 3)]
            payload = (np.arange(size) + 1000 * r).astype(np.int64)
            got, counts = shm.alltoall_async(payload, splits, "y").wait()
            got = joined(got)
            lo = sum(splits[:r])
            want = [(np.arange(size) + 1000 * q)[lo:lo + splits[r]] for q in range(shm.size)]
            assert np.array_equal(got, np.concatenate(want)) and counts == [splits[r]] * 3
            files.append(len(glob.glob(f"{shm._prefix}-r{r}-*")))
        shm._unlink(None)  # what exit does
        return files, glob.glob(f"{shm._prefix}-r{r}-*")

    for files, left in _shared(3, rank_fn):
        assert max(files) <= 2 and not left, (files, left)


def test_shared_memory_full_falls_back_to_sockets_on_every_rank(monkeypatch):
    """A rank whose region cannot be allocated (/dev/shm full) announces it: that call goes
    through the control group on every rank, with the same result."""
    real, rank_of = os.posix_fallocate, threading.local()

    def fallocate(fd, offset, size):
        if size > 100_000 and getattr(rank_of, "rank", None) == 1:
            raise OSError(28, "No space left on device")
        return real(fd, offset, size)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)

    def rank_fn(shm):
        rank_of.rank = shm.rank
        small = joined(shm.allgather_async(np.full(10, shm.rank, np.int32), "s").wait())
        big = joined(shm.allgather_async(np.full(100_000, shm.rank, np.int32), "b").wait())
        return small, big

    for small, big in _shared(2, rank_fn):
        assert np.array_equal(small, np.repeat([0, 1], 10))
        assert np.array_equal(big, np.repeat([0, 1], 100_000))
