"""Which tensors get compressed: the per-layer policy shared by the framework doors."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .core.base import Codec
from .core.contract import HorovodWire


@dataclass
class LayerPolicy:
    """Decides, per tensor, whether it is compressed and with which codec.

    The QSGD and NUQSGD papers leave small layers and biases uncompressed: their bytes are
    negligible while their quantization variance is not (a bucket of 3 values has a large
    relative error). Sparse gradients always travel uncompressed (Horovod's sparse path).

    Args:
        min_elements: tensors with fewer elements travel uncompressed.
        compress_1d: compress 1-D tensors (biases, norm scales) too.
        rules: ``(regex, codec_or_None)`` pairs matched in order against the name the user
            gave the tensor (the parameter name, the ``name=`` of Horovod's allreduce); the
            first match wins (None = uncompressed). A tensor without a name gets the size
            rules alone.
    """

    min_elements: int = 1024
    compress_1d: bool = False
    rules: Sequence[tuple[str, Optional[Codec]]] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.min_elements < 0:
            raise ValueError(f"min_elements={self.min_elements} must be >= 0")
        self.rules = tuple((pattern, _rule_codec(pattern, c)) for pattern, c in self.rules)
        self._compiled = [(re.compile(p), c) for p, c in self.rules]

    def codec_for(self, default: Codec, shape: Sequence[int], name: str | None = None,
                  sparse: bool = False) -> Codec | None:
        """The codec for a tensor, or None when it travels uncompressed."""
        if sparse:
            return None
        if name is not None:
            for pattern, codec in self._compiled:
                if pattern.search(name):
                    kept = codec is None or codec.traits.horovod_wire is HorovodWire.KEEP
                    return None if kept else codec
        numel = 1
        for d in shape:
            numel *= int(d)
        if numel < self.min_elements or (len(shape) <= 1 and not self.compress_1d):
            return None
        return default

    def codecs(self, default: Codec) -> list[Codec]:
        """Every codec with an exchange of its own this policy can choose (not those Horovod's
        allreduce carries), ``default`` first, then the rules' in order, each once (by
        configuration): the same list on every rank that agrees on the policy."""
        out: list[Codec] = []
        for codec in [default, *(c for _, c in self.rules)]:
            if codec is not None and codec.traits.horovod_wire is None and all(
                    codec.config_key() != o.config_key() for o in out):
                out.append(codec)
        return out

    @classmethod
    def everything(cls) -> "LayerPolicy":
        """Compress every dense tensor, whatever its size (used by exactness tests)."""
        return cls(min_elements=0, compress_1d=True)


def _rule_codec(pattern: str, codec: Any) -> Codec | None:
    """A rule's codec: a Codec, or the codec of a ``Compression.<name>(...)`` object."""
    if codec is None or isinstance(codec, Codec):
        return codec
    inner = getattr(codec, "codec", None)
    if isinstance(inner, Codec):
        return inner
    raise TypeError(f"LayerPolicy rule {pattern!r}: expected a codec (get_codec(...)), a "
                    f"Compression.<name>(...) object or None, got {codec!r}")


def describe(policy: Any) -> dict[str, Any]:
    """A comparable summary for the cross-rank configuration check."""
    return {"min_elements": policy.min_elements, "compress_1d": policy.compress_1d,
            "rules": [(p, c.config() if c is not None else None) for p, c in policy.rules]}
