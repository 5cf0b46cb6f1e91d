"""The codec contract: every codec class carries frozen traits fixed when it is created, from
the capability types it inherits and the wire format it declares as class keywords; the other
layers decide on the traits alone, and no method a codec has raises NotImplementedError
(horovod_quant/core/contract.py)."""
from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import numpy as np
import pytest

import horovod_quant as hq
from horovod_quant.core.base import Codec
from horovod_quant.core.contract import (
    DECLARED,
    Combine,
    ExchangeTraits,
    GlobalNorm,
    HorovodWire,
    Reduced,
    SideInformation,
    SumDecodable,
)
from horovod_quant.core.registry import codec_class
from horovod_quant.exchange import plans

PACKAGE = Path(hq.__file__).parent
GLOBAL_QSGD_CONFIGS = [{"levels": lv, "mode": m} for lv in ("linear", "exponential")
                       for m in ("dense", "sparse")]


def configurations() -> list[Codec]:
    """One codec of every registered class, and every Global-QSGD mode and level."""
    out = []
    for name in hq.available_codecs():
        sized = codec_class(name).needs_world_size
        for params in (GLOBAL_QSGD_CONFIGS if name == "global_qsgd" else [{}]):
            out.append(hq.get_codec(name, **params, **({"world_size": 4} if sized else {})))
    return out


@pytest.mark.parametrize("codec", configurations(), ids=repr)
def test_traits_are_frozen_and_no_class_attribute_is_shadowed(codec):
    assert isinstance(codec.traits, ExchangeTraits) and codec.traits is type(codec).traits
    with pytest.raises(dataclasses.FrozenInstanceError):
        codec.traits.combine = Combine.SUM
    shadowed = [k for k in vars(codec) if hasattr(type(codec), k)]
    assert not shadowed, f"{codec!r} overwrites class attributes per instance: {shadowed}"


@pytest.mark.parametrize("codec", configurations(), ids=repr)
def test_no_class_attribute_repeats_a_trait(codec):
    """The traits are the one declaration: no codec (class or instance) has an attribute named
    like a trait, nor the string flag the traits replaced."""
    names = [f.name for f in dataclasses.fields(ExchangeTraits)] + ["horovod_allreduce"]
    repeated = [name for name in names if hasattr(codec, name)]
    assert not repeated, f"{codec!r} repeats traits as attributes: {repeated}"


@pytest.mark.parametrize("codec", configurations(), ids=repr)
def test_traits_follow_the_capabilities(codec):
    traits = codec.traits
    if isinstance(codec, SumDecodable):
        assert traits.combine is Combine.SUM
    elif isinstance(codec, (Reduced, SideInformation)):
        assert traits.combine is Combine.CUSTOM
    else:
        assert traits.combine is Combine.GATHER
    assert (traits.collective is not None) == isinstance(codec, Reduced)
    assert traits.needs_norm == isinstance(codec, GlobalNorm)
    assert traits.side_information == isinstance(codec, SideInformation)


def test_horovod_wire_names_the_baselines_horovod_carries():
    assert hq.get_codec("none").traits.horovod_wire is HorovodWire.KEEP
    assert hq.get_codec("fp16").traits.horovod_wire is HorovodWire.FLOAT16
    assert HorovodWire.KEEP.cast is None and HorovodWire.FLOAT16.cast == "float16"
    assert all(codec.traits.horovod_wire is None for codec in configurations()
               if codec.name not in ("none", "fp16"))


def test_a_codec_class_declares_its_wire_format_as_class_keywords():
    qsgd = type(hq.get_codec("qsgd"))
    wide = type("Wide", (qsgd,), {}, wire_dtype=np.uint32, head_nbytes=8)
    assert wide.traits.wire_dtype == np.uint32 and wide.traits.head_nbytes == 8
    assert wide.traits.combine is qsgd.traits.combine
    assert type("Wider", (wide,), {}).traits == wide.traits  # inherited unless declared
    assert set(DECLARED) < {f.name for f in dataclasses.fields(ExchangeTraits)}
    with pytest.raises(TypeError, match="unknown codec class keywords"):
        type("Bad", (qsgd,), {}, wire_type=np.uint32)
    with pytest.raises(TypeError, match="Reduced"):
        type("Lonely", (qsgd,), {}, collective="exponent_allreduce")
    with pytest.raises(TypeError, match="Reduced"):
        _capable(qsgd, Reduced)
    with pytest.raises(TypeError, match="HorovodWire"):
        type("Flag", (qsgd,), {}, horovod_wire="keep")
    reduced = _capable(qsgd, Reduced, collective="exponent_allreduce")
    assert reduced.traits.combine is Combine.CUSTOM
    assert reduced.traits.collective == "exponent_allreduce"
    assert plans.plan_kind(reduced, 4, 1 << 16) == "custom"


def test_global_qsgd_configurations_have_their_capabilities():
    def build(**params):
        return hq.get_codec("global_qsgd", world_size=4, **params)

    linear, exponential = build(levels="linear"), build()
    sparse = build(mode="sparse")
    assert all(isinstance(c, (hq.core.GlobalQSGD, GlobalNorm))
               for c in (linear, exponential, sparse))
    assert isinstance(linear, SumDecodable) and not isinstance(linear, Reduced)
    assert isinstance(exponential, Reduced) and not isinstance(exponential, SumDecodable)
    assert not hasattr(sparse, "decode_sum") and not hasattr(sparse, "reduce")
    assert linear.traits.wire_dtype == np.uint64 and sparse.traits.head_nbytes == 4
    assert type(linear.for_world_size(2)) is type(linear)


def _capable(base: type, *capabilities: type, **declared) -> Codec:
    """A codec of ``base``'s configuration whose class adds ``capabilities`` (and declares
    ``declared``)."""
    cls = type(f"Test{base.__name__}", (base, *capabilities), {
        name: (lambda self, *a, **k: None)
        for cap in capabilities for name in getattr(cap, "__abstractmethods__", ())},
        **declared)
    return cls(**{k: v for k, v in hq.get_codec("qsgd").params.items()})


def test_plans_accept_codecs_by_capability():
    qsgd = type(hq.get_codec("qsgd"))
    assert plans.plan_kind(hq.get_codec("qsgd"), 4, 1 << 16, "allgather") == "allgather"
    # the plan follows the capability a class declares, whatever the codec is called
    summed = _capable(qsgd, SumDecodable)
    assert summed.traits.combine is Combine.SUM and plans.plan_kind(summed, 4, 1 << 16) == "sum"
    side = _capable(qsgd, SideInformation)
    assert plans.plan_kind(side, 4, 1 << 16, "sra") == "allgather"
    assert plans.signature("allgather", side)[-1] == (plans.Allreduce, np.dtype(np.int64))
    assert side.traits.side_information and side.traits.combine is Combine.CUSTOM
    normed = _capable(qsgd, GlobalNorm)
    assert normed.traits.needs_norm and normed.traits.combine is Combine.GATHER
    assert plans.plan_kind(normed, 4, 1 << 16, "sra") == "allgather"


def test_no_not_implemented_error_in_the_package():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Raise) and "NotImplementedError" in ast.unparse(node):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, ("methods a codec cannot serve must not exist on it (declare a "
                       "capability in core/contract.py instead): " + ", ".join(found))


def test_capabilities_are_small_abstract_types():
    for cap in (SumDecodable, Reduced, GlobalNorm, SideInformation):
        assert inspect.isabstract(cap) and not issubclass(cap, Codec)
