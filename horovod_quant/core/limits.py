"""Limits a codec meets as ranks are added, said before a user meets them.

A codec whose payloads are summed (Global-QSGD) keeps headroom for the sum of every payload:
its levels shrink as the number of payloads grows, until it cannot be built. The codec warns
once (Python :mod:`warnings`, category :class:`CodecLimitWarning`) when it is built with fewer
than :data:`FEW_LEVELS` levels because of its world size, naming the alternatives; the
predictor (:mod:`horovod_quant.tools.predict`) prints the same text.
"""
from __future__ import annotations

import warnings

#: fewer levels than this, where fewer workers would have more, is worth a warning (3 bits of
#: resolution: the variance bound grows as 1/s^2)
FEW_LEVELS = 8
#: what a hierarchical exchange changes, in every message that names it
HIERARCHY_HINT = ("hq.DistributedOptimizer and the DDP hook exchange hierarchically where "
                  "ranks share hosts: float32 inside a host, one payload per host summed between "
                  "hosts, so the world size that counts is the number of hosts")


class CodecLimitWarning(UserWarning):
    """A codec built at a world size where it has degraded (fewer levels than with fewer
    workers); the message names the alternatives. Shown once per distinct message."""


def warn_limit(message: str) -> None:
    """Warn once per distinct ``message`` (Python's default filter for a UserWarning)."""
    warnings.warn(message, CodecLimitWarning, stacklevel=3)
