"""DoorOptions: one default per setting, taken the same way by all four doors."""
import inspect

import pytest

import horovod_quant as hq
from horovod_quant.doors import (
    DEFAULT_FUSION_BYTES,
    OPTIMIZER_ONLY,
    UNSET,
    DoorOptions,
    door_options,
)
from horovod_quant.exchange.plans import DEFAULT_PIPELINE_ELEMS
from horovod_quant.policy import LayerPolicy

SHARED = ("seed", "gather", "policy", "pipeline_elems")


def test_defaults():
    options = DoorOptions()
    assert (options.seed, options.gather, options.pipeline_elems) == (0, "auto", 1 << 21)
    assert options.pipeline_elems == DEFAULT_PIPELINE_ELEMS
    assert options.policy == LayerPolicy()
    assert (options.fusion_bytes, options.transport, options.fallback, options.on_step) == (
        DEFAULT_FUSION_BYTES, None, "auto", None)


def test_keyword_over_options_over_inherited_over_default():
    inherited = DoorOptions(seed=3, gather="sra")
    assert door_options(None, inherited).seed == 3
    assert door_options(None, inherited, seed=None).seed == 3  # None: not given
    assert door_options(None, inherited, seed=5).seed == 5
    assert door_options(DoorOptions(seed=9), inherited).gather == "auto"  # options replace it
    assert door_options(DoorOptions(seed=9), inherited, seed=9).seed == 9  # the same value: fine
    assert door_options().pipeline_elems == 1 << 21
    assert door_options(pipeline_elems=UNSET).pipeline_elems == 1 << 21
    assert door_options(pipeline_elems=None).pipeline_elems is None  # None: whole vectors


def test_a_setting_given_twice_differently_raises():
    assert door_options(DoorOptions(seed=4), seed=4).seed == 4
    with pytest.raises(ValueError, match="seed given both as keyword arguments and in options="):
        door_options(DoorOptions(seed=4), seed=5)
    with pytest.raises(ValueError, match="is not a horovod_quant DoorOptions"):
        door_options({"seed": 4})


@pytest.mark.parametrize("setting,value,message", [
    ("seed", 7.9, "seed"), ("gather", "ring", "gather='ring'"),
    ("pipeline_elems", 0, "pipeline_elems=0"), ("fusion_bytes", 0, "fusion_bytes"),
    ("transport", "mpi", "transport='mpi'"), ("fallback", "sometimes", "fallback='sometimes'"),
    ("policy", "everything", "LayerPolicy"), ("on_step", 3, "on_step=3")])
def test_invalid_settings_say_what_to_change(setting, value, message):
    with pytest.raises(ValueError, match=message):
        DoorOptions(**{setting: value})


def test_optimizer_only_settings_raise_in_the_other_doors():
    assert DoorOptions(seed=2).check_door("DDP hook").seed == 2
    with pytest.raises(ValueError, match=r"fusion_bytes=1024, fallback='never': the DDP hook"):
        DoorOptions(fusion_bytes=1024, fallback="never").check_door("DDP hook")
    assert set(OPTIMIZER_ONLY) == {"fusion_bytes", "transport", "fallback", "on_step"}


def _defaults(function):
    return {name: p.default for name, p in inspect.signature(function).parameters.items()}


def _not_given(value):
    return value is None or value is UNSET


def test_every_door_takes_the_settings_with_no_default_of_its_own():
    """Each door's keyword for a setting defaults to "not given", so DoorOptions' default is
    the one every door runs with; each door takes ``options=``."""
    hvd_torch = pytest.importorskip("horovod.torch")
    import horovod_quant.torch as hqt
    from horovod_quant.torch import ddp

    doors = {"torch Compression": hqt.Compression.qsgd,
             "torch QuantizedCompressor": hqt.QuantizedCompressor,
             "hq.torch.DistributedOptimizer": hqt.DistributedOptimizer,
             "DDP QuantizationState": ddp.QuantizationState.__init__}
    try:
        import horovod_quant.tensorflow as hqtf
    except ImportError:  # a machine without TensorFlow: the torch doors alone
        hqtf = None
    if hqtf is not None:
        doors.update({"TF Compression": hqtf.Compression.qsgd,
                      "TF QuantizedCompressor": hqtf.QuantizedCompressor})
    for door, function in doors.items():
        defaults = _defaults(function)
        settings = SHARED + (OPTIMIZER_ONLY if "DistributedOptimizer" in door else ())
        assert "options" in defaults, door
        for setting in settings:
            assert setting in defaults and _not_given(defaults[setting]), (door, setting)
    assert hvd_torch is not None


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
