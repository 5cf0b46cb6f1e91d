"""horovod_quant's environment variables, parsed one way everywhere.

Booleans take ``1/true/yes/on`` or ``0/false/no/off`` (any case, surrounding blanks ignored);
anything else raises ValueError naming the variable, so a typo never silently means "off".

| variable | type | meaning |
| --- | --- | --- |
| ``HQ_MPI_EXCHANGE`` | bool, default on | the mpi4py exponent allreduce of Global-QSGD |
| ``HQ_CUDA_AWARE_MPI`` | bool, unset = detect | MPI takes device buffers |
| ``HQ_DEVICE_COLLECTIVES`` | bool, unset = detect | Horovod's collectives take device buffers |
| ``HQ_CONFIG_TIMEOUT`` | seconds, default 600 | a rank's wait for the others' configuration |
| ``HQ_TRANSPORT`` | auto (default)/gloo/horovod | what carries the torch Horovod door's payloads |
| ``HQ_PEER_ADDR`` | address, unset = detect | this rank's gloo bind address (rank 0 offers it) |
| ``HQ_LINK_GBIT``, ``HQ_INTRA_GBYTE``, ``HQ_ROUND_US`` | numbers | the plan choice's fabric |
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


def env_positive(name: str, default: float, unit: str) -> float:
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
