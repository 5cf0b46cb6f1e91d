"""The float32 mean of a host's shards in a hierarchical exchange (twin of
``kernels/reduce.cu``): the parts added in order, then one IEEE division, as NumPy's ``+=`` and
``/=`` compute it; one pass over memory instead of one per part."""
from __future__ import annotations

import numba


@numba.njit(cache=True, nogil=True)
def mean_in_order(parts, count, out):
    """``out[i] = (parts[0][i] + ... + parts[-1][i]) / count`` in float32 (``parts``: a
    non-empty tuple of float32 vectors of ``out.size``; ``count``: float32)."""
    first = parts[0]
    for i in range(out.size):
        acc = first[i]
        for p in range(1, len(parts)):
            acc += parts[p][i]
        out[i] = acc / count
    return out
