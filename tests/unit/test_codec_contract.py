"""The codec contract: every codec carries frozen traits computed once, what it can do is a
capability type the exchange checks with isinstance, and no method it has raises
NotImplementedError (horovod_quant/core/contract.py)."""
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
    Combine,
    ExchangeTraits,
    GlobalNorm,
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
    assert isinstance(codec.traits, ExchangeTraits)
    with pytest.raises(dataclasses.FrozenInstanceError):
        codec.traits.combine = Combine.SUM
    with pytest.raises(AttributeError):
        codec.traits = codec.traits
    shadowed = [k for k in vars(codec) if hasattr(type(codec), k)]
    assert not shadowed, f"{codec!r} overwrites class attributes per instance: {shadowed}"
    assert codec.traits.wire_dtype == type(codec).wire_dtype
    assert codec.traits.head_nbytes == type(codec).head_nbytes


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


def _capable(base: type, *capabilities: type) -> Codec:
    """A codec of ``base``'s configuration whose class adds ``capabilities``."""
    cls = type(f"Test{base.__name__}", (base, *capabilities), {
        name: (lambda self, *a, **k: None)
        for cap in capabilities for name in getattr(cap, "__abstractmethods__", ())})
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
    normed = _capable(qsgd, GlobalNorm)
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
