"""Launches of ``kernels/reduce.cu`` (twin of :mod:`horovod_quant.backends.numba.reduce`): the
float32 mean of a hierarchical exchange's host shards, exact where CuPy's ``+=`` and ``/=``
would flush subnormals."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .launch import Launches


class ReduceLaunches(Launches):
    """``Backend`` entry points of reduce.cu."""

    def mean_in_order(self, parts: Sequence[Any], count: int, out: Any) -> Any:
        n = int(out.size)
        if n:
            shards = [self.xp.ascontiguousarray(part).reshape(-1) for part in parts]
            self.kernels.mean_parts(shards, len(shards), n, np.float32(count), out)
        return out
