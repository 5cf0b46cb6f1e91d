"""Uncompressed and half-precision baselines, so every comparison runs through one interface."""
from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from .base import Codec, WireLayout, array_module, as_vector, check_int
from .payload import Payload


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even; NaN stays NaN) as uint16 bit patterns."""
    b = x.view(np.uint32)
    rounded = (b + (0x7FFF + ((b >> 16) & 1))) >> 16
    nan = np.isnan(x)
    return np.where(nan, (b >> 16) | 0x40, rounded).astype(np.uint16)


def bf16_bits_to_float32(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << 16).view(np.float32)


def _wire_values(codec: Codec, payload: Payload, out: np.ndarray | None) -> np.ndarray:
    """The payload's data as a flat array of ``codec.wire_dtype`` after
    :meth:`Codec.check_payload` (exactly ``size`` values)."""
    codec.check_payload(payload, out)
    data = payload.data
    if type(data).__module__.startswith("torch") and getattr(data, "is_cuda", False):
        return data  # decode_sum's device passthrough (horovod_quant.gpu): used as it is
    return array_module(data).asarray(data).reshape(-1).view(codec.wire_dtype)


class _FloatBaseline(Codec):
    """A float cast; payloads add up under allreduce (exchange "sum")."""

    exchange: ClassVar[str] = "sum"

    def __init__(self) -> None:
        super().__init__()

    def wire_layout(self, size: int, head: np.ndarray | None = None) -> WireLayout:
        item = self.wire_dtype.itemsize
        return WireLayout(size, item * size, True, f"{item} bytes per element")

    def decode_sum(self, payload: Payload, n: int, out: np.ndarray | None = None) -> np.ndarray:
        n = check_int("n", n, 1, hint=f"{self.name}: the number of summed payloads.")
        data = _wire_values(self, payload, out)
        # one pass: widen and scale together (out may be the summed buffer itself)
        return np.multiply(data, np.float32(1.0 / n), out=out, dtype=np.float32,
                           casting="unsafe")


class NoCompression(_FloatBaseline):
    """float32 on the wire (Horovod's default)."""

    name = "none"
    wire_dtype = np.dtype(np.float32)
    horovod_allreduce = "keep"

    def encode(self, x: Any, seed: int = 0) -> Payload:
        v = as_vector(x)
        return Payload(v.copy(), v.size)

    def decode(self, payload: Payload, out: np.ndarray | None = None) -> np.ndarray:
        data = _wire_values(self, payload, out)
        if out is None:
            return data.astype(np.float32, copy=True)
        out[:] = data
        return out


class FP16(_FloatBaseline):
    """IEEE half precision on the wire (Horovod's ``Compression.fp16``); sums run in fp16."""

    name = "fp16"
    wire_dtype = np.dtype(np.float16)
    horovod_allreduce = "float16"

    def encode(self, x: Any, seed: int = 0) -> Payload:
        v = as_vector(x)
        return Payload(v.astype(np.float16), v.size)

    def decode(self, payload: Payload, out: np.ndarray | None = None) -> np.ndarray:
        data = _wire_values(self, payload, out)
        if out is None:
            return data.astype(np.float32)
        out[:] = data
        return out


class BF16(Codec):
    """bfloat16 on the wire (the top 16 bits of float32, rounded to nearest even).

    NumPy has no bfloat16 arithmetic, so payloads hold bit patterns and travel by gather: each
    rank widens every payload to float32 and sums in rank order (one rounding per addition in
    float32 instead of bfloat16, so the mean is at least as accurate as a bfloat16 allreduce).
    """

    name = "bf16"
    exchange: ClassVar[str] = "gather"

    def __init__(self) -> None:
        super().__init__()

    def encode(self, x: Any, seed: int = 0) -> Payload:
        v = as_vector(x)
        return Payload(float32_to_bf16_bits(v).view(np.uint8), v.size)

    def wire_layout(self, size: int, head: np.ndarray | None = None) -> WireLayout:
        return WireLayout(size, 2 * size, True, "2 bytes per element")

    def decode(self, payload: Payload, out: np.ndarray | None = None) -> np.ndarray:
        self.check_payload(payload, out)
        vals = bf16_bits_to_float32(np.asarray(payload.data).reshape(-1).view(np.uint16))
        if out is None:
            return vals
        out[:] = vals
        return out
