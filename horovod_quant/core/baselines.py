"""Uncompressed and half-precision baselines, so every comparison runs through one interface."""
from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from .base import Codec, as_vector
from .payload import Payload


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even; NaN stays NaN) as uint16 bit patterns."""
    b = x.view(np.uint32)
    rounded = (b + (0x7FFF + ((b >> 16) & 1))) >> 16
    nan = np.isnan(x)
    return np.where(nan, (b >> 16) | 0x40, rounded).astype(np.uint16)


def bf16_bits_to_float32(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << 16).view(np.float32)


class _FloatBaseline(Codec):
    """A float cast; payloads add up under allreduce (exchange "sum")."""

    exchange: ClassVar[str] = "sum"

    def __init__(self) -> None:
        super().__init__()

    def decode_sum(self, payload: Payload, n: int, out: np.ndarray | None = None) -> np.ndarray:
        # one pass: widen and scale together (out may be the summed buffer itself)
        return np.multiply(payload.data, np.float32(1.0 / n), out=out, dtype=np.float32,
                           casting="unsafe")


class NoCompression(_FloatBaseline):
    """float32 on the wire (Horovod's default)."""

    name = "none"
    wire_dtype = np.dtype(np.float32)

    def encode(self, x: Any, seed: int = 0) -> Payload:
        v = as_vector(x)
        return Payload(v.copy(), v.size)

    def decode(self, payload: Payload, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return payload.data.astype(np.float32, copy=True)
        out[:] = payload.data
        return out


class FP16(_FloatBaseline):
    """IEEE half precision on the wire (Horovod's ``Compression.fp16``); sums run in fp16."""

    name = "fp16"
    wire_dtype = np.dtype(np.float16)

    def encode(self, x: Any, seed: int = 0) -> Payload:
        v = as_vector(x)
        return Payload(v.astype(np.float16), v.size)

    def decode(self, payload: Payload, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return payload.data.astype(np.float32)
        out[:] = payload.data
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

    def decode(self, payload: Payload, out: np.ndarray | None = None) -> np.ndarray:
        vals = bf16_bits_to_float32(payload.data.view(np.uint16))
        if out is None:
            return vals
        out[:] = vals
        return out
