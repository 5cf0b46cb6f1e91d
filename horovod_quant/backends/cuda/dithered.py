"""Launches of ``kernels/dithered.cu`` (twin of :mod:`horovod_quant.backends.numba.dithered`):
DQSG decodes over several payloads, the NDQSG side-information decode."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..protocol import Keys
from .launch import START_ASSIGN, START_OUT, DitherValues, Launches, decode_payloads, int_keys


class DitheredLaunches(Launches):
    """``Backend`` entry points of dithered.cu."""

    def decode_dither(self, datas: Sequence[Any], keys: Sequence[Keys], offset: int, n: int,
                      bucket: int, bits: int, M: int, out: Any, accumulate: bool,
                      post: float | None = None) -> None:
        if n:
            decode_payloads(self.kernels, DitherValues([int_keys(kk) for kk in keys], M),
                            list(datas), offset, offset + 4 * -(-n // bucket), None, n, bucket,
                            bits, out, START_OUT if accumulate else START_ASSIGN,
                            None if post is None else np.float32(post))

    def decode_nested(self, data: Any, offset: int, n: int, bucket: int, M: int, k: int,
                      bits: int, am: float, alpha: float, y: Any, keys: Keys,
                      out: Any) -> tuple[float, int]:
        if n == 0:
            return 0.0, 0
        k0, k1 = int_keys(keys)
        return self.kernels.decode_nested(data, offset, offset + 4 * -(-n // bucket), n, bucket,
                                          M, k, bits, float(am), float(alpha), y, k0, k1, out)
