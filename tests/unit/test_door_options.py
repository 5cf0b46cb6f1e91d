"""DoorOptions: one default per setting, taken the same way by every door, from one place
(keywords or options=); a setting a door does not take is refused there, naming the doors that
take it; the environment's settings (DoorEnvironment) are read once, at the door."""
import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

import horovod_quant as hq
from horovod_quant import doors
from horovod_quant.doors import (
    DDP_DOOR,
    DEFAULT_FUSION_BYTES,
    DOOR_READS,
    DOOR_SETTINGS,
    DOOR_TAKES,
    FALLBACK,
    FSDP_DOOR,
    OPTIMIZER_DOOR,
    OPTIMIZER_ONLY,
    OUTER_DOOR,
    SHARED,
    TF_DOOR,
    TORCH_COMPRESSOR_DOOR,
    DoorEnvironment,
    DoorOptions,
    ExchangeSettings,
    OptimizerSettings,
    door_options,
)
from horovod_quant.exchange.cost import CPU_RANKS, GPU_RANKS
from horovod_quant.exchange.plans import DEFAULT_PIPELINE_ELEMS
from horovod_quant.policy import LayerPolicy


def test_defaults():
    options = DoorOptions()
    assert (options.seed, options.gather, options.pipeline_elems) == (0, "auto", 1 << 21)
    assert options.pipeline_elems == DEFAULT_PIPELINE_ELEMS
    assert options.policy == LayerPolicy()
    assert (options.fusion_bytes, options.transport, options.fallback, options.on_step) == (
        DEFAULT_FUSION_BYTES, None, "auto", None)


def test_keywords_over_inherited_over_default_or_options():
    inherited = DoorOptions(seed=3, gather="sra")
    assert door_options({}, None, inherited).seed == 3
    assert door_options({"seed": 5}, None, inherited) == DoorOptions(seed=5, gather="sra")
    assert door_options({}, DoorOptions(seed=9), inherited).gather == "auto"  # options replace
    assert door_options({}).pipeline_elems == 1 << 21
    assert door_options({"pipeline_elems": None}).pipeline_elems is None  # None: whole vectors


def test_keywords_and_options_together_raise_saying_which_to_use():
    for given in ({"seed": 4}, {"seed": 5}):  # the same value as options' too
        with pytest.raises(ValueError, match=r"seed given as keyword arguments and options= "
                                             r"given too: set seed inside options="):
            door_options(given, DoorOptions(seed=4))
    with pytest.raises(ValueError, match="is not a horovod_quant DoorOptions"):
        door_options({}, {"seed": 4})
    with pytest.raises(ValueError, match="fusion: not a setting of this door"):
        door_options({"fusion": 1024})
    with pytest.raises(ValueError, match=r"fusion_bytes=1024: the door does not take this "
                                         r"setting \(fusion_bytes: hq.torch.Distributed"):
        door_options({"fusion_bytes": 1024})
    assert door_options({"fusion_bytes": 1024}, takes=DOOR_SETTINGS).fusion_bytes == 1024
    assert door_options({"fusion_bytes": 1024}, door=OPTIMIZER_DOOR).fusion_bytes == 1024


def test_exchange_and_optimizer_settings_are_two_small_frozen_types():
    assert SHARED == tuple(f.name for f in dataclasses.fields(ExchangeSettings))
    assert OPTIMIZER_ONLY == tuple(f.name for f in dataclasses.fields(OptimizerSettings))
    assert DOOR_SETTINGS == tuple(f.name for f in dataclasses.fields(DoorOptions))
    options = DoorOptions()
    assert isinstance(options, ExchangeSettings) and isinstance(options, OptimizerSettings)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.seed = 1


def _package_sources():
    return sorted(Path(hq.__file__).parent.rglob("*.py"))


def test_no_sentinel_and_each_setting_attribute_written_once():
    """No "not given" sentinel: a door takes ``**settings``; each setting is read as a door's
    attribute in one place (doors.SettingsAttributes, the optimizer's own two)."""
    assert not hasattr(doors, "UNSET")
    defined = {}
    for path in _package_sources():
        text = path.read_text()
        assert "UNSET" not in text, path
        for node in ast.walk(ast.parse(text, str(path))):
            is_property = isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)
            if is_property and node.name in DOOR_SETTINGS and "options" in ast.unparse(node):
                defined.setdefault(node.name, []).append(path.name)
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                    and ast.unparse(node.value.func) == "property":
                names = [ast.unparse(t) for t in node.targets]
                assert not set(names) & set(DOOR_SETTINGS), (path, names)
    twice = {name: where for name, where in defined.items() if len(where) > 1}
    assert not twice and set(defined) == set(SHARED) | {"on_step", "fallback", "baseline"}, \
        defined


@pytest.mark.parametrize("setting,value,message", [
    ("seed", 7.9, "seed"), ("gather", "ring", "gather='ring'"),
    ("pipeline_elems", 0, "pipeline_elems=0"), ("fusion_bytes", 0, "fusion_bytes"),
    ("transport", "mpi", "transport='mpi'"), ("fallback", "sometimes", "fallback='sometimes'"),
    ("baseline", "fp8", "baseline='fp8'"),
    ("policy", "everything", "LayerPolicy"), ("on_step", 3, "on_step=3")])
def test_invalid_settings_say_what_to_change(setting, value, message):
    with pytest.raises(ValueError, match=message):
        DoorOptions(**{setting: value})


def test_settings_a_door_does_not_take_raise_there():
    assert DoorOptions(seed=2).check_door("TensorFlow door").seed == 2
    with pytest.raises(ValueError, match=r"fallback='never', fusion_bytes=1024: the TensorFlow "
                                         r"door does not take these settings \(fallback: "
                                         r"hq.torch.DistributedOptimizer, the DDP hook and the "
                                         r"FSDP hook; fusion_bytes: hq.torch.DistributedOptimizer"
                                         r"\); pass them to a door that takes them"):
        DoorOptions(fusion_bytes=1024, fallback="never").check_door("TensorFlow door")
    ddp = SHARED + FALLBACK
    assert DoorOptions(baseline="bf16", fallback="never").check_door("DDP hook", ddp).baseline \
        == "bf16"
    with pytest.raises(ValueError, match=r"^transport='gloo': the DDP hook"):
        DoorOptions(transport="gloo", baseline="fp32").check_door("DDP hook", ddp)
    with pytest.raises(ValueError, match=r"^policy=.*: the outer all-reduce does not take this "
                                         r"setting \(policy: hq.torch.DistributedOptimizer, the "
                                         r"DDP hook, the FSDP hook, the PyTorch compressor and "
                                         r"the TensorFlow door\)"):
        DoorOptions(policy=LayerPolicy.everything()).check_door(OUTER_DOOR)
    assert set(OPTIMIZER_ONLY) == {"fusion_bytes", "transport", "on_step"}
    assert set(FALLBACK) == {"fallback", "baseline"}
    assert DOOR_TAKES[OPTIMIZER_DOOR] == DOOR_SETTINGS
    assert DOOR_TAKES[DDP_DOOR] == DOOR_TAKES[FSDP_DOOR] == SHARED + FALLBACK
    assert DOOR_TAKES[TORCH_COMPRESSOR_DOOR] == DOOR_TAKES[TF_DOOR] == SHARED


@pytest.mark.parametrize("door", [d for d in DOOR_TAKES if d != OPTIMIZER_DOOR])
def test_each_door_refuses_every_other_setting_however_it_comes(door):
    """Given as a keyword (even at its default), in options=, or inherited from a compressor:
    a setting the door does not take raises, naming the door and those that take it."""
    for name in DOOR_SETTINGS:
        if name in DOOR_TAKES[door]:
            continue
        value = {"fusion_bytes": 4096, "transport": "gloo", "on_step": print,
                 "fallback": "never", "baseline": "fp32", "policy": LayerPolicy.everything()}[name]
        takers = [d for d, takes in DOOR_TAKES.items() if name in takes]
        message = rf"^{name}=.*: the {door} does not take this setting \({name}: "
        for way in ({"given": {name: value}}, {"given": {name: getattr(DoorOptions(), name)}},
                    {"options": DoorOptions(**{name: value})},
                    {"inherited": DoorOptions(**{name: value})}):
            with pytest.raises(ValueError, match=message) as excinfo:
                door_options(way.get("given", {}), way.get("options"), way.get("inherited"),
                             door)
            assert all(d in str(excinfo.value) for d in takers), (door, name, way)
    assert door_options({"seed": 4}, None, DoorOptions(gather="sra"), door).gather == "sra"


def test_the_environment_is_read_once_at_the_door(monkeypatch):
    """Each door reads the variables it uses, when it is built (``DoorEnvironment.read``), and
    ignores the others: a job sets them for all its ranks, and another door of the same job may
    use them. A value the door reads that is not valid raises there, naming the variable."""
    for name in ("HQ_LINK_GBIT", "HQ_INTRA_GBYTE", "HQ_ROUND_US", "HQ_MPI_EXCHANGE",
                 "HQ_TRANSPORT", "HQ_CUDA_AWARE_MPI", "HQ_DEVICE_COLLECTIVES"):
        monkeypatch.delenv(name, raising=False)
    assert all(DoorEnvironment.read(door) == DoorEnvironment() for door in DOOR_READS)
    assert set(DOOR_READS) == set(DOOR_TAKES)
    monkeypatch.setenv("HQ_LINK_GBIT", "25")
    monkeypatch.setenv("HQ_MPI_EXCHANGE", "off")
    monkeypatch.setenv("HQ_TRANSPORT", "horovod")
    monkeypatch.setenv("HQ_CUDA_AWARE_MPI", "1")
    monkeypatch.setenv("HQ_DEVICE_COLLECTIVES", "0")
    read = {door: DoorEnvironment.read(door) for door in DOOR_READS}
    cuda = {"cuda_aware_mpi": True, "device_collectives": False}
    assert read[OPTIMIZER_DOOR] == DoorEnvironment(link_gbit=25.0, mpi_exchange=False,
                                                   transport="horovod", **cuda)
    for door in (DDP_DOOR, FSDP_DOOR, OUTER_DOOR):  # the fabric, not MPI nor the transport
        assert read[door] == DoorEnvironment(link_gbit=25.0)
    # the fabric and MPI, not the transport; Horovod's CUDA buffers in PyTorch only
    assert read[TORCH_COMPRESSOR_DOOR] == DoorEnvironment(link_gbit=25.0, mpi_exchange=False,
                                                          **cuda)
    assert read[TF_DOOR] == DoorEnvironment(link_gbit=25.0, mpi_exchange=False)
    assert read[DDP_DOOR].fabric(True) == GPU_RANKS._replace(link_gbit=25.0)
    assert read[TF_DOOR].fabric(False) == CPU_RANKS._replace(link_gbit=25.0)
    assert read[DDP_DOOR].fabric_set == {"link_gbit": 25.0}
    assert read[OPTIMIZER_DOOR].transport_for(None) == "horovod"
    assert read[OPTIMIZER_DOOR].transport_for("gloo") == "gloo"  # transport= wins
    monkeypatch.setenv("HQ_TRANSPORT", "fast")
    with pytest.raises(ValueError, match="HQ_TRANSPORT='fast' is not valid"):
        DoorEnvironment.read(OPTIMIZER_DOOR)
    assert DoorEnvironment.read(DDP_DOOR).transport == "auto"  # not its variable: ignored
    monkeypatch.setenv("HQ_MPI_EXCHANGE", "maybe")
    with pytest.raises(ValueError, match="HQ_MPI_EXCHANGE='maybe' is not a yes/no value"):
        DoorEnvironment.read(TF_DOOR)
    assert DoorEnvironment.read(OUTER_DOOR).mpi_exchange is True
    for bad in ({"link_gbit": 0}, {"round_us": float("inf")}, {"intra_gbyte": True},
                {"transport": "mpi"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DoorEnvironment(**bad)


def test_every_door_takes_the_settings_as_keywords_or_options():
    """Each door takes ``options=`` and the settings as ``**settings`` (no default of its own:
    DoorOptions' is the one every door runs with)."""
    hvd_torch = pytest.importorskip("horovod.torch")
    import horovod_quant.torch as hqt
    from horovod_quant.torch import ddp, fsdp

    doors = {"torch Compression": hqt.Compression.qsgd,
             "torch QuantizedCompressor": hqt.QuantizedCompressor,
             "hq.torch.DistributedOptimizer": hqt.DistributedOptimizer,
             "DDP QuantizationState": ddp.QuantizationState.__init__,
             "FSDP ReplicaState": fsdp.ReplicaState.__init__}
    try:
        import horovod_quant.tensorflow as hqtf
    except ImportError:  # a machine without TensorFlow: the torch doors alone
        hqtf = None
    if hqtf is not None:
        doors.update({"TF Compression": hqtf.Compression.qsgd,
                      "TF QuantizedCompressor": hqtf.QuantizedCompressor})
    for door, function in doors.items():
        parameters = inspect.signature(function).parameters
        assert "options" in parameters, door
        assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()), door
        assert not set(parameters) & set(DOOR_SETTINGS), door
    assert hvd_torch is not None
    with pytest.raises(ValueError, match="seed given as keyword arguments and options="):
        hqt.QuantizedCompressor(hq.get_codec("qsgd"), seed=1, options=DoorOptions())


def test_torch_compressor_refuses_the_optimizers_settings():
    """The PyTorch compressor uses the shared settings alone: it keeps none for the optimizer
    it is passed to (which takes them itself), through options= or as keywords."""
    pytest.importorskip("horovod.torch")
    import horovod_quant.torch as hqt

    compressor = hqt.Compression.qsgd(bits=4, seed=6, options=None, pipeline_elems=None)
    assert (compressor.seed, compressor.pipeline_elems, compressor.gather) == (6, None, "auto")
    assert compressor.codec.config_key() == hq.get_codec("qsgd", bits=4).config_key()
    with pytest.raises(ValueError, match=r"^fusion_bytes=4096: the PyTorch compressor does not "
                                         r"take this setting \(fusion_bytes: "
                                         r"hq.torch.DistributedOptimizer\)"):
        hqt.Compression.qsgd(options=DoorOptions(seed=8, fusion_bytes=4096))
    with pytest.raises(ValueError, match=r"^transport='gloo': the PyTorch compressor"):
        hqt.Compression.qsgd(transport="gloo")
    with pytest.raises(ValueError, match=r"^fallback='never': the PyTorch compressor .*the DDP "
                                         r"hook and the FSDP hook"):
        hqt.QuantizedCompressor(hq.get_codec("qsgd"), fallback="never")
    with pytest.raises(ValueError, match=r"^on_step=None: the PyTorch compressor"):
        hqt.Compression.qsgd(on_step=None)  # given, at its default: still the wrong door


def test_tensorflow_door_refuses_optimizer_only_settings():
    pytest.importorskip("horovod.tensorflow")
    import horovod_quant.tensorflow as hqtf

    with pytest.raises(ValueError, match="transport='gloo': the TensorFlow door"):
        hqtf.Compression.qsgd(options=DoorOptions(transport="gloo"))
    assert hqtf.Compression.qsgd(seed=3).pipeline_elems == DEFAULT_PIPELINE_ELEMS


def test_a_codec_spec_is_a_name_or_name_and_bits():
    """``"name:bits"`` (the examples' --codec) as the doors over a torch.distributed group take
    it: the DDP hook and the outer all-reduce (``ddp.group_codec``)."""
    from types import SimpleNamespace

    from horovod_quant.torch.ddp import group_codec

    assert (doors.CodecRequest.from_spec("qsgd").params, doors.CodecRequest.from_spec(
        "qsgd:4").params) == ({}, {"bits": 4})
    with pytest.raises(ValueError, match="integer number of bits"):
        doors.CodecRequest.from_spec("qsgd:four")
    comm = SimpleNamespace(size=3, hierarchy=None)
    codec, inherited = group_codec("global_qsgd:8", comm)
    want = hq.get_codec("global_qsgd", bits=8, world_size=3)
    assert codec.config_key() == want.config_key() and inherited is None
    with pytest.raises(ValueError, match="compression=3 is not understood"):
        group_codec(3, comm, "compression")
