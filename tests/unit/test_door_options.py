"""DoorOptions: one default per setting, taken the same way by all four doors, from one
place (keywords or options=)."""
import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

import horovod_quant as hq
from horovod_quant import doors
from horovod_quant.doors import (
    DEFAULT_FUSION_BYTES,
    DOOR_SETTINGS,
    FALLBACK,
    OPTIMIZER_ONLY,
    SHARED,
    DoorOptions,
    ExchangeSettings,
    OptimizerSettings,
    door_options,
)
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
    with pytest.raises(ValueError, match="fusion_bytes: not a setting of this door"):
        door_options({"fusion_bytes": 1024})
    assert door_options({"fusion_bytes": 1024}, takes=DOOR_SETTINGS).fusion_bytes == 1024


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
                                         r"door does not take these settings \(the fallback's, "
                                         r"fallback, baseline: hq.torch.DistributedOptimizer, "
                                         r"the DDP hook and the FSDP hook"):
        DoorOptions(fusion_bytes=1024, fallback="never").check_door("TensorFlow door")
    ddp = SHARED + FALLBACK
    assert DoorOptions(baseline="bf16", fallback="never").check_door("DDP hook", ddp).baseline \
        == "bf16"
    with pytest.raises(ValueError, match=r"^transport='gloo': the DDP hook"):
        DoorOptions(transport="gloo", baseline="fp32").check_door("DDP hook", ddp)
    assert set(OPTIMIZER_ONLY) == {"fusion_bytes", "transport", "on_step"}
    assert set(FALLBACK) == {"fallback", "baseline"}


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


def test_torch_compressor_keeps_its_settings_for_the_optimizer():
    pytest.importorskip("horovod.torch")
    import horovod_quant.torch as hqt

    compressor = hqt.Compression.qsgd(bits=4, seed=6, options=None, pipeline_elems=None)
    assert (compressor.seed, compressor.pipeline_elems, compressor.gather) == (6, None, "auto")
    assert compressor.codec.config_key() == hq.get_codec("qsgd", bits=4).config_key()
    shared = DoorOptions(seed=8, fusion_bytes=4096)
    assert hqt.Compression.qsgd(options=shared).options == shared


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
