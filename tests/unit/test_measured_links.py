"""The links measured, not assumed: the fallback's baseline timings give the rates between hosts
and inside a host (:func:`horovod_quant.exchange.cost.fitted_fabric`,
:func:`horovod_quant.fallback.measured_fabric`), and the plans are chosen again from them."""
import pytest

import horovod_quant as hq
from horovod_quant.doors import DDP_DOOR, LINK_ENV, OPTIMIZER_DOOR, DoorEnvironment
from horovod_quant.exchange import plans
from horovod_quant.exchange.cost import Fabric, fitted_fabric, ring_allreduce
from horovod_quant.exchange.topology import Topology
from horovod_quant.fallback import BaselineChoice, measured_fabric

SIZES = [1 << 18, 1 << 20, 1 << 22]


def _timed(topology, fabric, element_bytes=4.0):
    """Ring allreduces of SIZES over ``topology`` with the seconds ``fabric`` gives them."""
    return [(ring_allreduce(topology, n, element_bytes),
             ring_allreduce(topology, n, element_bytes).seconds(fabric)) for n in SIZES]


@pytest.mark.parametrize("link,intra", [(3.0, 7.0), (0.5, 20.0), (40.0, 2.0)])
def test_both_rates_are_recovered_from_their_collectives(link, intra):
    true = Fabric(link_gbit=link, intra_gbyte=intra)
    got = fitted_fabric(Fabric(), _timed(Topology.grid(2, 2), true),
                        _timed(Topology.grid(1, 2), true))
    assert got.link_gbit == pytest.approx(link, rel=1e-3)
    assert got.intra_gbyte == pytest.approx(intra, rel=1e-3)
    assert got.round_us == Fabric().round_us


def test_one_host_measures_only_its_inside_rate():
    true = Fabric(intra_gbyte=3.0)
    got = fitted_fabric(Fabric(), _timed(Topology.grid(1, 4), true))
    assert got.link_gbit == Fabric().link_gbit  # no byte crossed a host
    assert got.intra_gbyte == pytest.approx(3.0, rel=1e-3)


def test_one_rank_per_host_measures_only_the_link():
    true = Fabric(link_gbit=2.5, intra_gbyte=99.0)
    got = fitted_fabric(Fabric(), _timed(Topology.grid(3, 1), true))
    assert got.link_gbit == pytest.approx(2.5, rel=1e-3)
    assert got.intra_gbyte == Fabric().intra_gbyte


def test_a_time_below_the_latency_floor_says_the_link_is_at_least_that_fast():
    """Timings faster than the rounds' latency alone: the rate goes to the top of its range
    (the latency, not the bytes, costs the time) rather than to a nonsense value."""
    cost = ring_allreduce(Topology.grid(2, 1), 1 << 10, 4.0)
    got = fitted_fabric(Fabric(), [(cost, 1e-9)])
    assert got.link_gbit == pytest.approx(1e5, rel=1e-6)


def test_the_environment_overrides_a_measurement(monkeypatch):
    """The door reads HQ_LINK_GBIT (once, when it is built) and hands the fit the fields it
    sets: the measurement keeps them."""
    monkeypatch.setenv(LINK_ENV, "7")
    environment = DoorEnvironment.read(OPTIMIZER_DOOR)
    monkeypatch.delenv(LINK_ENV)  # read at the door: nothing below it looks again
    fixed = environment.fabric_set
    assert fixed == {"link_gbit": 7.0}
    base = environment.fabric(False)
    assert base == Fabric(link_gbit=7.0)
    got = fitted_fabric(base, _timed(Topology.grid(2, 2), Fabric(0.2, 5.0)),
                        _timed(Topology.grid(1, 2), Fabric(7.0, 5.0)), fixed)
    assert got.link_gbit == 7.0 and got.intra_gbyte == pytest.approx(5.0, rel=1e-3)


def test_measured_fabric_keeps_what_the_door_passes_it(monkeypatch):
    """The fallback's fit keeps the fields its door's environment sets, handed to it as a value
    (the fallback controller reads no environment variable)."""
    topology, fast = Topology.grid(2, 2), Fabric(link_gbit=100.0, intra_gbyte=1.0)
    choice = BaselineChoice(
        "fp32", "ring", {}, [{"fp32": ring_allreduce(topology, n, 4).seconds(fast)}
                             for n in SIZES],
        [ring_allreduce(Topology.grid(1, 2), n, 4).seconds(fast) for n in SIZES])
    monkeypatch.setenv(LINK_ENV, "3")  # not read here: only the door's value counts
    assert measured_fabric(choice, Fabric(), topology, SIZES).link_gbit == \
        pytest.approx(100.0, rel=1e-3)
    environment = DoorEnvironment.read(DDP_DOOR)
    got = measured_fabric(choice, environment.fabric(False), topology, SIZES,
                          environment.fabric_set)
    assert got.link_gbit == 3.0 and got.intra_gbyte != Fabric().intra_gbyte


def test_measured_fabric_reads_the_baseline_trial_and_changes_the_plan():
    """A 16-bit and a float32 allreduce per bucket and the allreduce inside the host, as the
    trial times them: the fitted links are the ones that produced the times, and where the
    link is fast the plan is no longer the hierarchical one the defaults chose."""
    topology = Topology.grid(2, 2)
    codec = hq.get_codec("global_qsgd", bits=8, world_size=4)
    numel = 1 << 22
    default = plans.plan_kind(codec, topology, numel, "auto", True, Fabric())
    assert default == "hierarchical-custom"
    fast = Fabric(link_gbit=100.0, intra_gbyte=1.0)
    one_host = Topology.grid(1, 2)
    choice = BaselineChoice(
        "fp16", "ring", {}, [{"fp32": ring_allreduce(topology, n, 4).seconds(fast),
                              "fp16": ring_allreduce(topology, n, 2).seconds(fast)}
                             for n in SIZES],
        [ring_allreduce(one_host, n, 4).seconds(fast) for n in SIZES])
    got = measured_fabric(choice, Fabric(), topology, SIZES)
    assert got.link_gbit == pytest.approx(100.0, rel=1e-3)
    assert got.intra_gbyte == pytest.approx(1.0, rel=1e-3)
    assert plans.plan_kind(codec, topology, numel, "auto", True, got) == "custom"


@pytest.mark.parametrize("timed,low,high", [
    (("fp32", "fp16"), 1.99, 2.01),
    (("fp16",), 0.9, 1.0),  # its doubled time read as a slower link (its latency doubled too)
])
def test_the_float32_allreduce_measures_the_link_where_it_was_timed(timed, low, high):
    """A 16-bit sum on CPU ranks costs CPU work of its own (here it takes twice its bytes'
    time): the link is fitted to the float32 allreduce where the trial timed one, else to the
    16-bit one (a user who fixed ``baseline="fp16"``)."""
    topology = Topology.grid(2, 1)
    link = Fabric(link_gbit=2.0)
    seconds = {"fp32": lambda n: ring_allreduce(topology, n, 4).seconds(link),
               "fp16": lambda n: 2 * ring_allreduce(topology, n, 2).seconds(link)}
    choice = BaselineChoice("fp32", "ring", {}, [{name: seconds[name](n) for name in timed}
                                                 for n in SIZES])
    got = measured_fabric(choice, Fabric(), topology, SIZES)
    assert low < got.link_gbit < high
