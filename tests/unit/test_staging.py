"""Device payloads over host-only collectives (HostStaged) and the choice between staging and
device collectives. A NumPy subclass stands in for device arrays, so this runs without a GPU;
tests/gpu runs the same exchanges with CuPy."""
import types

import numpy as np
import pytest

import horovod_quant as hq
import horovod_quant.gpu as G
from horovod_quant.doors import DDP_DOOR, OPTIMIZER_DOOR, TORCH_COMPRESSOR_DOOR, DoorEnvironment
from horovod_quant.exchange import HostStaged
from horovod_quant.exchange.collectives import LocalCollectives
from horovod_quant.exchange.mpi_exponent_allreduce import mpi_exponent_factory
from horovod_quant.gpu import device_collectives

from threaded_comm import run_ranks


class FakeDevice(np.ndarray):
    """Marks an array as living on a device."""


@pytest.fixture
def fake_device(monkeypatch):
    copies = {"to_host": 0, "to_device": 0}

    def to_host(a):
        if not isinstance(a, FakeDevice):
            return a
        copies["to_host"] += 1
        return np.array(a.view(np.ndarray), copy=True)

    def to_device(a, like):
        assert isinstance(like, FakeDevice)
        copies["to_device"] += 1
        return np.array(a, copy=True).view(FakeDevice)

    monkeypatch.setattr(G, "is_device_array", lambda a: isinstance(a, FakeDevice))
    monkeypatch.setattr(G, "to_host", to_host)
    monkeypatch.setattr(G, "to_device", to_device)
    return copies


class _HostOnly:
    """Wraps threaded collectives and fails on anything but plain host arrays."""

    def __init__(self, inner):
        self.inner, self.rank, self.size = inner, inner.rank, inner.size

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def call(arr, *args, **kw):
            assert type(arr) is np.ndarray, f"{name} got {type(arr).__name__}"
            return fn(arr, *args, **kw)
        return call


def test_device_arrays_cross_as_host_copies_and_come_back(fake_device):
    def rank_fn(comm):
        staged = HostStaged(_HostOnly(comm))
        r = comm.rank
        dev = (np.arange(6, dtype=np.int64) * (r + 1)).view(FakeDevice)
        total = staged.allreduce_async(dev, "sum").wait()
        gathered = staged.allgather_async(np.full(r + 1, r, np.uint8).view(FakeDevice),
                                          "gather").wait()
        data, splits = staged.alltoall_async(np.array([r, r, 10 + r], np.uint8).view(FakeDevice),
                                             [2, 1] if r == 0 else [1, 2], "a2a").wait()
        host = staged.allgather_async(np.array([float(r)]), "host").wait()
        return total, gathered, data, splits, host

    (t0, g0, d0, s0, h0), (t1, g1, d1, s1, h1) = run_ranks(2, rank_fn)
    for t in (t0, t1):
        assert isinstance(t, FakeDevice) and t.tolist() == [0, 3, 6, 9, 12, 15]
    for g in (g0, g1):
        assert isinstance(g, FakeDevice) and g.tolist() == [0, 1, 1]
    assert isinstance(d0, FakeDevice) and d0.tolist() == [0, 0, 1] and s0 == [2, 1]
    assert isinstance(d1, FakeDevice) and d1.tolist() == [10, 1, 11] and s1 == [1, 2]
    for h in (h0, h1):  # host arrays pass through without copies
        assert type(h) is np.ndarray and h.tolist() == [0.0, 1.0]
    assert fake_device == {"to_host": 6, "to_device": 6}


def _horovod(nccl=0, cuda=False, mpi=False):
    return types.SimpleNamespace(nccl_built=lambda: nccl, cuda_built=lambda: cuda,
                                 mpi_enabled=lambda: mpi)


@pytest.mark.parametrize("hvd, env, want", [
    (_horovod(nccl=21805), {}, True),
    (_horovod(), {}, False),
    (_horovod(cuda=True, mpi=True), {"HQ_CUDA_AWARE_MPI": "1"}, True),
    (_horovod(cuda=True, mpi=True), {"HQ_CUDA_AWARE_MPI": "0"}, False),
    (_horovod(cuda=True, mpi=False), {"HQ_CUDA_AWARE_MPI": "1"}, False),
    (_horovod(nccl=21805), {"HQ_DEVICE_COLLECTIVES": "0"}, False),
    (_horovod(), {"HQ_DEVICE_COLLECTIVES": "yes"}, True),
])
def test_horovod_device_collectives(monkeypatch, hvd, env, want):
    """The door reads the variables; the gpu helpers take its values and read nothing."""
    for k in ("HQ_CUDA_AWARE_MPI", "HQ_DEVICE_COLLECTIVES"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    door = DoorEnvironment.read(OPTIMIZER_DOOR)
    answer, reason = G.horovod_device_collectives(hvd, door.device_collectives,
                                                  door.cuda_aware_mpi)
    assert answer is want and reason
    assert G.horovod_device_collectives(hvd) == G.horovod_device_collectives(
        hvd, DoorEnvironment().device_collectives, DoorEnvironment().cuda_aware_mpi)


def test_bad_override_says_what_to_use(monkeypatch):
    monkeypatch.setenv("HQ_DEVICE_COLLECTIVES", "maybe")
    with pytest.raises(ValueError, match="HQ_DEVICE_COLLECTIVES='maybe'.*use 1 or 0"):
        DoorEnvironment.read(TORCH_COMPRESSOR_DOOR)
    assert DoorEnvironment.read(DDP_DOOR).device_collectives is None  # not its variable


def test_cuda_aware_mpi_override_and_ompi_info(monkeypatch):
    monkeypatch.setenv("HQ_CUDA_AWARE_MPI", "true")
    door = DoorEnvironment.read(TORCH_COMPRESSOR_DOOR)
    assert G.cuda_aware_mpi(explain=True, override=door.cuda_aware_mpi) == (
        True, "HQ_CUDA_AWARE_MPI")
    monkeypatch.setenv("HQ_CUDA_AWARE_MPI", "off")
    door = DoorEnvironment.read(OPTIMIZER_DOOR)
    assert G.cuda_aware_mpi(override=door.cuda_aware_mpi) is False
    text = "mca:mpi:base:param:mpi_built_with_cuda_support:value:{}\n"
    assert device_collectives.parse_ompi_info(text.format("true")) is True
    assert device_collectives.parse_ompi_info(text.format("false")) is False
    assert device_collectives.parse_ompi_info("nothing here") is None


def test_staging_keeps_how_the_inner_collectives_pair():
    """A door asks the staged collectives whether to issue in one order: the answer is the
    inner collectives' (a gloo group staged for CUDA payloads pairs by call order)."""
    from horovod_quant.exchange import LocalCollectives

    class ByOrder(LocalCollectives):
        pairs_by_order = True

    assert HostStaged(ByOrder()).pairs_by_order
    assert not HostStaged(LocalCollectives()).pairs_by_order


@pytest.mark.parametrize("cuda_aware", [False, True])
def test_the_exponent_allreduce_takes_device_buffers_only_where_its_collectives_say(cuda_aware):
    """Whether MPI gets device buffers comes down from the door through the collectives
    (staged or not), never from the environment below the door."""
    class WithMpi(LocalCollectives):
        mpi_moves_device_arrays = cuda_aware

        def mpi_communicator(self):
            return object()

    codec = hq.get_codec("global_qsgd", world_size=2, bits=8, levels="exponential")
    for comm in (WithMpi(), HostStaged(WithMpi())):
        reduce = mpi_exponent_factory(codec, comm)
        assert reduce.device_buffers is cuda_aware and len(reduce.comms) >= 1
    assert mpi_exponent_factory(codec, LocalCollectives()) is None
