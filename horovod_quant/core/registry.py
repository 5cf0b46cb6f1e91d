"""Codecs by name: ``get_codec("qsgd", bits=4)``."""
from __future__ import annotations

from typing import Any

from .base import Codec
from .contract import HorovodWire

_CODECS: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator/function adding a codec class under ``cls.name``."""
    if cls.name in _CODECS and _CODECS[cls.name] is not cls:
        raise ValueError(f"codec name {cls.name!r} is already registered by {_CODECS[cls.name]}")
    _CODECS[cls.name] = cls
    return cls


def codec_class(name: str) -> type[Codec]:
    """The class registered under ``name`` (ValueError listing the valid names)."""
    try:
        return _CODECS[name]
    except KeyError:
        raise ValueError(
            f"unknown codec {name!r}; valid codecs: {', '.join(available_codecs())}"
        ) from None


def available_codecs() -> list[str]:
    """Names accepted by :func:`get_codec`, in registration order."""
    return list(_CODECS)


def horovod_equivalent(wire: HorovodWire) -> Codec:
    """The codec that does what one of Horovod's own compressors does: the registered codec
    whose ``traits.horovod_wire`` is ``wire``, :attr:`HorovodWire.KEEP` for
    ``hvd.Compression.none`` and :attr:`HorovodWire.FLOAT16` for ``hvd.Compression.fp16``.

    Raises:
        ValueError: no registered codec declares it.
    """
    for cls in _CODECS.values():
        if cls.traits.horovod_wire is wire:
            return cls()
    raise ValueError(f"no codec declares horovod_wire={wire!r}")


def get_codec(name: str, **params: Any) -> Codec:
    """Build a codec by name, validating its parameters.

    Args:
        name: one of :func:`available_codecs`.
        **params: the codec's parameters (see its class docstring and docs/codecs.md).

    Returns:
        The codec instance.

    Raises:
        ValueError: unknown name (the message lists the valid ones) or invalid parameters.
    """
    cls = codec_class(name)
    try:
        return cls(**params)
    except TypeError as exc:  # unexpected keyword: say which ones exist
        import inspect

        accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        raise ValueError(f"{name}: {exc}; accepted parameters: {accepted}") from None
