"""Registry and parameter validation: every mistake is a ValueError that says what to change."""
from __future__ import annotations

import math

import pytest

import horovod_quant as hq
from horovod_quant.core.base import Codec
from horovod_quant.core.contract import Combine, ExchangeTraits
from horovod_quant.core.registry import register

CORE = ["none", "fp16", "bf16", "qsgd", "nuqsgd", "natural", "natural_dithering",
        "standard_dithering"]
WORLD = ("global_qsgd", "nested_dithered")  # need world_size


def _build(name, **params):
    if name in WORLD:
        params.setdefault("world_size", 2)
    return hq.get_codec(name, **params)


def test_available_codecs():
    names = hq.available_codecs()
    assert set(CORE) <= set(names)
    assert len(names) == len(set(names))


@pytest.mark.parametrize("name", hq.available_codecs())
def test_every_codec_builds_and_round_trips_config(name):
    codec = _build(name)
    assert codec.name == name
    assert isinstance(codec.traits, ExchangeTraits) and codec.traits.combine in Combine
    cfg = codec.config()
    assert cfg["codec"] == name
    params = {k: v for k, v in cfg.items() if k != "codec"}
    assert _build(name, **params).config() == cfg
    assert name in repr(codec) or type(codec).__name__ in repr(codec)


def test_unknown_codec_lists_valid_ones():
    with pytest.raises(ValueError) as exc:
        hq.get_codec("qsgd8")
    msg = str(exc.value)
    assert "qsgd8" in msg
    for name in hq.available_codecs():
        assert name in msg


def test_unknown_parameter_lists_accepted_ones():
    with pytest.raises(ValueError) as exc:
        hq.get_codec("qsgd", bit=4)
    msg = str(exc.value)
    assert "bit" in msg and "bits" in msg and "bucket_size" in msg and "norm" in msg


LEVEL = ["qsgd", "standard_dithering", "nuqsgd", "natural_dithering", "natural"]


@pytest.mark.parametrize("name", LEVEL)
@pytest.mark.parametrize("bits", [0, 1, 9, 16, -4, "4", 4.0, True, None])
def test_bits_out_of_range(name, bits):
    with pytest.raises(ValueError, match="bits"):
        hq.get_codec(name, bits=bits)


def test_bits_ranges():
    for name in LEVEL:
        lo = 3 if name == "nuqsgd" else 2
        for b in range(lo, 9):
            assert hq.get_codec(name, bits=b).params["bits"] == b
    with pytest.raises(ValueError, match=r"\[3, 8\]"):
        hq.get_codec("nuqsgd", bits=2)


@pytest.mark.parametrize("name", LEVEL)
@pytest.mark.parametrize("bucket", [0, -1, 2.5, "512", True])
def test_bad_bucket_size(name, bucket):
    with pytest.raises(ValueError, match="bucket_size"):
        hq.get_codec(name, bucket_size=bucket)


@pytest.mark.parametrize("name", LEVEL)
def test_good_bucket_sizes(name):
    for bucket in (1, 7, 512, 10**9, None):
        assert hq.get_codec(name, bucket_size=bucket).params["bucket_size"] == bucket


@pytest.mark.parametrize("name", ["standard_dithering", "natural_dithering"])
@pytest.mark.parametrize("p", [0.5, 0, -1, "x", None, float("nan"), [2]])
def test_bad_p(name, p):
    with pytest.raises(ValueError, match="p="):
        hq.get_codec(name, p=p)


@pytest.mark.parametrize("name", ["standard_dithering", "natural_dithering"])
def test_good_p(name):
    for p in (1, 1.5, 2, 3, float("inf")):
        c = hq.get_codec(name, p=p)
        assert c.params["p"] == p or (math.isinf(p) and math.isinf(c.params["p"]))


@pytest.mark.parametrize("norm", ["l1", "L2", "inf", None, 2])
def test_bad_norm(norm):
    with pytest.raises(ValueError, match="norm"):
        hq.get_codec("qsgd", norm=norm)


@pytest.mark.parametrize("name,bits,most", [("qsgd", 4, 7), ("qsgd", 2, 1), ("qsgd", 8, 127),
                                            ("standard_dithering", 3, 3),
                                            ("natural_dithering", 4, 7),
                                            ("nuqsgd", 4, 6), ("nuqsgd", 3, 2)])
def test_levels_limited_by_bits(name, bits, most):
    assert hq.get_codec(name, bits=bits).params["levels"] == most  # the default is the most
    assert hq.get_codec(name, bits=bits, levels=most).params["levels"] == most
    assert hq.get_codec(name, bits=bits, levels=1).params["levels"] == 1
    with pytest.raises(ValueError, match="levels") as exc:
        hq.get_codec(name, bits=bits, levels=most + 1)
    assert str(most) in str(exc.value)
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="levels"):
            hq.get_codec(name, bits=bits, levels=bad)


def test_register_rejects_a_second_class_under_a_taken_name():
    class Fake(Codec):
        name = "qsgd"
        combine = "gather"

        def encode(self, x, seed=0):
            raise NotImplementedError

        def decode(self, payload, out=None):
            raise NotImplementedError

    with pytest.raises(ValueError, match="already registered"):
        register(Fake)
    cls = type(hq.get_codec("qsgd"))
    assert register(cls) is cls  # registering the same class again is harmless
