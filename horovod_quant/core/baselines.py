"""Uncompressed and half-precision baselines, so every comparison runs through one interface."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backends import backend_of
from .base import Codec, WireLayout, check_int
from .contract import HorovodWire, SumDecodable
from .payload import Payload


def float32_to_bf16_bits(x: Any) -> Any:
    """Round float32 to bfloat16 (nearest, ties to even; NaN stays NaN) as uint16 bit patterns
    (NumPy or CuPy: integer operations only)."""
    xp = backend_of(x).xp
    b = x.view(xp.uint32)
    one = xp.uint32(1)
    rounded = (b + (xp.uint32(0x7FFF) + ((b >> xp.uint32(16)) & one))) >> xp.uint32(16)
    nan = xp.isnan(x)
    return xp.where(nan, (b >> xp.uint32(16)) | xp.uint32(0x40), rounded).astype(xp.uint16)


def bf16_bits_to_float32(h: Any) -> Any:
    xp = backend_of(h).xp
    return (h.astype(xp.uint32) << xp.uint32(16)).view(xp.float32)


def _wire_values(codec: Codec, payload: Payload, out: Any | None) -> Any:
    """The payload's data as a flat array of ``codec.traits.wire_dtype`` on its backend after
    :meth:`Codec.check_payload` (exactly ``size`` values)."""
    codec.check_payload(payload, out)
    return backend_of(payload.data).array(payload.data).view(codec.traits.wire_dtype)


def _store(values: Any, out: Any | None) -> Any:
    """``values`` as float32 into the caller's ``out`` (returned), or a new array."""
    if out is None:
        return values.astype(np.float32, copy=True)
    backend_of(out).array(out)[:] = values
    return out


class _FloatBaseline(SumDecodable, Codec):
    """A float cast; payloads add up under allreduce."""

    def __init__(self) -> None:
        super().__init__()

    def wire_layout(self, size: int, head: np.ndarray | None = None) -> WireLayout:
        item = self.traits.wire_dtype.itemsize
        return WireLayout(size, item * size, True, f"{item} bytes per element")

    def decode_sum(self, payload: Payload, n: int, out: np.ndarray | None = None) -> np.ndarray:
        n = check_int("n", n, 1, hint=f"{self.name}: the number of summed payloads.")
        data = _wire_values(self, payload, out)
        be = backend_of(payload.data)
        # the backend's scale, not the array module's multiply: CuPy's elementwise kernels
        # flush subnormals (out may be the summed buffer itself)
        wide = data if data.dtype == np.float32 else be.vector(data)
        dst = be.xp.empty(payload.size, np.float32) if out is None else be.array(out)
        be.scale(wide, np.float32(1.0 / n), dst)
        return dst if out is None else out


class NoCompression(_FloatBaseline, wire_dtype=np.float32, horovod_wire=HorovodWire.KEEP):
    """float32 on the wire (Horovod's default)."""

    name = "none"

    def encode(self, x: Any, seed: int = 0) -> Payload:
        v = backend_of(x).vector(x)
        return Payload(v.copy(), int(v.size))

    def decode(self, payload: Payload, out: Any | None = None) -> Any:
        return _store(_wire_values(self, payload, out), out)


class FP16(_FloatBaseline, wire_dtype=np.float16, horovod_wire=HorovodWire.FLOAT16):
    """IEEE half precision on the wire (Horovod's ``Compression.fp16``); sums run in fp16."""

    name = "fp16"

    def encode(self, x: Any, seed: int = 0) -> Payload:
        v = backend_of(x).vector(x)
        return Payload(v.astype(np.float16), int(v.size))

    def decode(self, payload: Payload, out: Any | None = None) -> Any:
        return _store(_wire_values(self, payload, out), out)


class BF16(Codec):
    """bfloat16 on the wire (the top 16 bits of float32, rounded to nearest even).

    NumPy has no bfloat16 arithmetic, so payloads hold bit patterns and travel by gather: each
    rank widens every payload to float32 and sums in rank order (one rounding per addition in
    float32 instead of bfloat16, so the mean is at least as accurate as a bfloat16 allreduce).
    """

    name = "bf16"

    def __init__(self) -> None:
        super().__init__()

    def encode(self, x: Any, seed: int = 0) -> Payload:
        v = backend_of(x).vector(x)
        return Payload(float32_to_bf16_bits(v).view(np.uint8), int(v.size))

    def wire_layout(self, size: int, head: np.ndarray | None = None) -> WireLayout:
        return WireLayout(size, 2 * size, True, "2 bytes per element")

    def decode(self, payload: Payload, out: np.ndarray | None = None) -> np.ndarray:
        self.check_payload(payload, out)
        vals = bf16_bits_to_float32(backend_of(payload.data).array(payload.data).view(np.uint16))
        if out is None:
            return vals
        return _store(vals, out)


#: the uncompressed allreduces a door's fallback can compare a codec with and move a bucket to
#: (its ``baseline`` setting, :mod:`horovod_quant.fallback`), each by the codec that describes
#: what it sends, and the torch dtype it travels in
BASELINE_CODECS: dict[str, type[Codec]] = {"fp32": NoCompression, "fp16": FP16, "bf16": BF16}
BASELINE_TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
#: the 16-bit allreduce each framework's users run today: Horovod's ``Compression.fp16``, and
#: PyTorch DDP's ``bf16_compress_hook``
HOROVOD_SIXTEEN_BIT = "fp16"
DDP_SIXTEEN_BIT = "bf16"


def baseline_element_bytes(baseline: str) -> float:
    """Bytes per element a baseline's allreduce sends (4 for float32, 2 for a 16-bit one)."""
    return BASELINE_CODECS[baseline]().expected_nbytes(1 << 20) / (1 << 20)
