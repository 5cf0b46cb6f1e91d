"""Counter-based random numbers: every draw is a pure function of (key, element index).

Stochastic rounding needs one uniform number per element. Drawing them from a stateful
generator would (a) materialize a tensor of random numbers, (b) make a receiver unable to
regenerate a sender's dither (DQSG/NDQSG), and (c) make CPU and GPU disagree. Instead every
draw is ``hash32(index, key)``, where the 64-bit ``key`` is derived once per call from
``(seed, step, tensor, rank, round, ...)`` with SplitMix64. The same two functions are written
in CUDA in ``kernels/hq_common.cuh``; both must change together.

This module derives the keys (Python ints, shared by every backend); the element hash itself is
a kernel: :mod:`horovod_quant.backends.numba.rng` (and ``kernels/hq_common.cuh``).
"""
from __future__ import annotations

import hashlib
import operator

import numpy as np

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """SplitMix64 finalizer (Steele et al., 2014) on a Python int, modulo 2**64."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_key(seed: int, *fields: int) -> int:
    """Fold ``seed`` and any number of integer fields (step, tensor id, rank, round, ...) into a
    64-bit key. Different field tuples give statistically independent streams.

    Args:
        seed: user seed (any integer, Python or NumPy; reduced modulo 2**64).
        *fields: further integers identifying the draw (negative values are allowed).

    Returns:
        A 64-bit key as a Python int.

    Raises:
        TypeError: ``seed`` or a field is not an integer (``7.9`` is not silently ``7``).
    """
    key = splitmix64(_integer("seed", seed) & _MASK64)
    for f in fields:
        key = splitmix64(key ^ (_integer("field", f) & _MASK64))
    return key


def _integer(what: str, value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {value!r}") from None


def name_key(name: str) -> int:
    """A stable 64-bit integer for a string (a tensor's name), the same in every process and
    Python version (unlike ``hash``): a field of :func:`derive_key` and of exchange tags."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def payload_seed(seed: int, step: int, key: str, offset: int = 0, codec_index: int = 0) -> int:
    """The seed of a payload in every door (:class:`~horovod_quant.exchange.runtime.
    ExchangeRuntime`): at ``step`` (the door's step, or a tensor's use count), of ``key`` (a
    tensor's name, or a bucket's parameters' names comma-joined in the order their elements
    travel) from element ``offset`` of its elements, through the door's codec ``codec_index``:
    ``derive_key(seed, step, name_key(key), offset)``, and ``codec_index`` after them where it
    is not 0. Keyed by what a payload holds, not by where a framework puts it, so a bucket keeps
    its seeds however DDP numbers it, and a tensor named alike gets one seed in every door.
    """
    fields = (step, name_key(key), offset) + ((codec_index,) if codec_index else ())
    return derive_key(seed, *fields)


def split_key(key: int) -> tuple[np.uint32, np.uint32]:
    """The two 32-bit halves used by the element hash."""
    return np.uint32(key & 0xFFFFFFFF), np.uint32(key >> 32)
