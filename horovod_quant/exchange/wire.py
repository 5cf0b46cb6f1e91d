"""What goes on the wire besides the codecs' payloads: frames, tags and the norm statistics.

A frame (:func:`frame`) prefixes a payload with its byte length and the exchange's :data:`Tag`,
so that gathered payloads of any length split again without an extra round
(:func:`unframe`) and every rank can check that all ranks sent the same tensor at the same step
(:func:`check_tags`). The global norm's statistics travel as float64 words with the tag
(:func:`norm_wire`). The plans (:mod:`horovod_quant.exchange.plans`) use these.
"""
from __future__ import annotations

from typing import Any, Sequence, Tuple

import numpy as np

from .. import gpu
from ..core.base import array_module, as_vector
from ..core.contract import GlobalNorm
from ..core.payload import Payload
from ..core.rng import name_key

#: what the ranks exchange under one collective name: (elements of the whole tensor, 64-bit key
#: of its name and shape, the door's step or sequence number); every rank's must be equal, or
#: different tensors, or tensors of different steps, would be combined
Tag = Tuple[int, int, int]
NO_TAG: Tag = (0, 0, 0)

_HEADER = np.dtype("<u8")
_STEP_MASK = (1 << 64) - 1  # a step travels as a uint64 word
HEADER_WORDS = 1 + len(NO_TAG)  # byte length, tag numel, tag key, tag step
FRAME_HEADER_BYTES = HEADER_WORDS * _HEADER.itemsize


def exchange_tag(key: str, shape: Sequence[int], step: int = 0) -> Tag:
    """The :data:`Tag` of a tensor called ``key`` (any name the ranks share) of ``shape``,
    exchanged at ``step`` (the door's step or sequence number, the same on every rank)."""
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel, name_key(f"{key}|{tuple(int(d) for d in shape)}"), int(step) & _STEP_MASK


def frame(payload: Payload, tag: Tag = NO_TAG) -> np.ndarray:
    """``[uint64 byte length][uint64 numel][uint64 key][uint64 step][payload bytes]``
    (little-endian) as one
    uint8 array: gathered payloads of any length (Elias, unequal chunks) split again without an
    extra round, and each says which tensor it belongs to (:func:`check_tags`).
    The frame lives where the payload does (host or device)."""
    return frames([payload], tag)[0]


def frames(payloads: Sequence[Payload], tag: Tag = NO_TAG) -> tuple[np.ndarray, list[int]]:
    """The :func:`frame` of each payload, back to back in one uint8 array (what an alltoall
    sends: one copy of each payload), and each frame's byte count."""
    xp = array_module(payloads[0].data)
    bodies = [p.data.reshape(-1).view(np.uint8) for p in payloads]
    sizes = [FRAME_HEADER_BYTES + b.size for b in bodies]
    out = xp.empty(sum(sizes), np.uint8)
    headers = np.array([[b.size, *tag] for b in bodies], _HEADER).view(np.uint8)
    o = 0
    for body, header in zip(bodies, xp.asarray(headers.reshape(len(bodies), -1))):
        out[o:o + FRAME_HEADER_BYTES] = header
        out[o + FRAME_HEADER_BYTES:o + FRAME_HEADER_BYTES + body.size] = body
        o += FRAME_HEADER_BYTES + body.size
    return out, sizes


def unframe(buf: np.ndarray) -> tuple[list[np.ndarray], list[Tag]]:
    """Split a concatenation of :func:`frame` outputs back into payload byte arrays (views,
    on the device of ``buf``; only the headers are read on the host) and their tags.

    Raises:
        ValueError: a header or a payload runs past the end of ``buf``.
    """
    xp = array_module(buf)
    buf = xp.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    parts, tags, o = [], [], 0
    while o < buf.size:
        if buf.size - o < FRAME_HEADER_BYTES:
            raise ValueError(f"damaged exchange: {buf.size - o} bytes at offset {o} are too "
                             f"few for a {FRAME_HEADER_BYTES}-byte frame header")
        length, *tag = (int(v) for v in gpu.to_host(buf[o:o + FRAME_HEADER_BYTES]).view(_HEADER))
        o += FRAME_HEADER_BYTES
        if length > buf.size - o:
            raise ValueError(f"damaged exchange: frame {len(parts)} declares {length} bytes, "
                             f"{buf.size - o} remain")
        parts.append(buf[o:o + length])
        tags.append(tuple(tag))
        o += length
    return parts, tags


def unframe_all(buf: Any, n: int, what: str, name: str = "") -> list[Any]:
    """The n payloads of a concatenation of n ranks' frames (rank order), or of a list of
    buffers holding them; raises ValueError (naming ``what`` and the exchange ``name``) unless
    they are n with equal tags."""
    parts, tags = [], []
    for one in (buf if isinstance(buf, list) else [buf]):
        more, more_tags = unframe(one)
        parts += more
        tags += more_tags
    if len(parts) != n:
        raise ValueError(f"damaged exchange {name!r}: expected {n} {what}, got {len(parts)}")
    check_tags(tags, name)
    return parts


class TagMismatch(ValueError):
    """The ranks' tags differ: their exchanges paired different tensors (:func:`check_tags`)."""


class OutOfStep(TagMismatch):
    """The ranks' exchanges paired payloads of different steps (:func:`check_tags`)."""


def check_tags(tags: Sequence[Tag], name: str = "") -> None:
    """Raise :class:`TagMismatch` when the ranks' tags differ (:class:`OutOfStep` where their
    steps do). Every rank holds every tag, so every rank raises the same error (or none does).

    Args:
        tags: one per rank, in rank order (the senders' tags).
        name: the exchange's collective name, for the message.
    """
    tags = [tuple(int(v) for v in t) for t in tags]
    if all(t == tags[0] for t in tags):
        return
    keys = {t[1] for t in tags}
    if any(k ^ _SPOILED in keys for k in keys):
        raise TagMismatch(
            f"horovod_quant: the ranks of another host disagree on exchange {name!r} (their "
            "own error names the ranks and the steps or tensors); nothing was combined")
    steps = [t[2] for t in tags]
    if any(s != steps[0] for s in steps):
        ranks = ", ".join(f"rank {r} at step {s}" for r, s in enumerate(steps))
        raise OutOfStep(
            f"horovod_quant: the ranks are out of step in exchange {name!r}: {ranks}; nothing "
            "was combined. Load the checkpoint on every rank, or broadcast the optimizer state "
            "from the rank that loaded it (horovod_quant.torch.broadcast_state beside Horovod's "
            "broadcasts), and run every step on every rank")
    lines = "\n".join(f"  rank {r}: {t[0]} elements (key {t[1]:016x})"
                      for r, t in enumerate(tags))
    raise TagMismatch(
        f"horovod_quant: the ranks sent different tensors to exchange {name!r} (a layer of "
        "another shape or name on some rank, or ranks that call the compressor in a "
        f"different order); nothing was combined:\n{lines}")


def spoiled(tag: Tag) -> Tag:
    """A tag no rank exchanging ``tag`` sends: what a rank that found its host's ranks at odds
    sends on, so that the ranks of every other host raise too."""
    return tag[0], tag[1] ^ _SPOILED, tag[2]


_SPOILED = 0xFFFF_FFFF_FFFF_FFFF  # what spoils a key


def tag_words(tag: Tag) -> np.ndarray:
    """``tag`` as uint64 words, to be allgathered and checked (:func:`check_tag_words`)."""
    return np.array(tag, _HEADER)


def check_tag_words(gathered: Any, name: str = "") -> None:
    """:func:`check_tags` on allgathered :func:`tag_words` (rank order)."""
    words = np.ascontiguousarray(gpu.to_host(gathered)).reshape(-1).view(_HEADER).reshape(
        -1, len(NO_TAG))
    check_tags([tuple(int(v) for v in row) for row in words], name)


# -- global norm -------------------------------------------------------------------------------
NORM_WIRE_WORDS = 1 + len(NO_TAG)


def norm_wire(codec: GlobalNorm, xs: list[Any], tag: Tag = NO_TAG) -> np.ndarray:
    """This rank's part of the global norm over the vectors ``xs``: one float64 statistic
    (``codec.combine_statistics`` of the vectors') and the exchange's tag (its bits in
    float64 words), :data:`NORM_WIRE_WORDS` float64 to be allgathered. The norm is the
    first collective of a global-norm exchange, so the tag check happens before anything
    else (the exponent allreduce included) pairs the ranks' data."""
    stats = [codec.norm_statistic(as_vector(x)) for x in xs]
    local = codec.combine_statistics(stats)
    wire = np.zeros(NORM_WIRE_WORDS, np.float64)
    wire[0] = local
    wire[1:].view(_HEADER)[:] = tag
    return wire


def norm_from_gathered(codec: GlobalNorm, gathered: np.ndarray, name: str = "") -> np.float32:
    """The float32 global norm from the allgathered ``norm_wire`` words (rank order), after
    :func:`check_tags` on the ranks' tags."""
    words = np.ascontiguousarray(gathered, np.float64).reshape(-1, NORM_WIRE_WORDS)
    check_tags([tuple(int(v) for v in row[1:].view(_HEADER)) for row in words], name)
    return codec.norm_from_statistics([float(t) for t in words[:, 0]])
