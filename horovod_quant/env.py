"""horovod_quant's environment variables, parsed one way everywhere.

Booleans take ``1/true/yes/on`` or ``0/false/no/off`` (any case, surrounding blanks ignored);
anything else raises ValueError naming the variable, so a typo never silently means "off".
The doors' settings are read once, where a door is built (``doors.DoorEnvironment``, which
says which door reads which; a door ignores the others); nothing in the exchange layer or the
fallback controller reads the environment.

| variable | type | meaning (read by) |
| --- | --- | --- |
| ``HQ_MPI_EXCHANGE`` | bool, default on | Global-QSGD's mpi4py exponent allreduce (Horovod doors) |
| ``HQ_TRANSPORT`` | auto (default)/gloo/horovod | the optimizer's transport (optimizer) |
| ``HQ_LINK_GBIT``, ``HQ_INTRA_GBYTE``, ``HQ_ROUND_US`` | numbers | fabric (optimizer, DDP, outer) |
| ``HQ_CUDA_AWARE_MPI``, ``HQ_DEVICE_COLLECTIVES`` | bool, unset: detect | CUDA buffers (torch) |
| ``HQ_CONFIG_TIMEOUT`` | seconds, default 600 | a rank's wait for the others' configuration |
| ``HQ_PEER_ADDR`` | address, unset = detect | this rank's gloo bind address (rank 0 offers it) |
"""
from __future__ import annotations

import math
import os

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_flag(name: str, default: bool | None = None) -> bool | None:
    """The yes/no in environment variable ``name``; ``default`` when unset or empty.

    Raises:
        ValueError: the value is not one of 1/0, true/false, yes/no, on/off.
    """
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r} is not a yes/no value: use 1 or 0 "
                     "(true/false, yes/no, on/off are accepted too)")


def env_positive(name: str, default: float | None, unit: str) -> float | None:
    """A positive number (in ``unit``, for the message) in environment variable ``name``;
    ``default`` when unset or empty.

    Raises:
        ValueError: the value is not a positive finite number.
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={os.environ[name]!r} must be a positive number of {unit}")
    return value


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds in environment variable ``name``; ``default`` when unset.

    Raises:
        ValueError: the value is not a positive finite number.
    """
    return env_positive(name, default, "seconds")


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """One of ``choices`` from environment variable ``name``; ``default`` when unset or empty.

    Raises:
        ValueError: the value is not one of ``choices``.
    """
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if value not in choices:
        raise ValueError(f"{name}={os.environ[name]!r} is not valid: choose one of {list(choices)}")
    return value


def env_text(name: str) -> str | None:
    """The text of environment variable ``name``, blanks stripped; None when unset or empty."""
    return os.environ.get(name, "").strip() or None
