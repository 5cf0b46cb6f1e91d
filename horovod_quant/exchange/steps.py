"""The local steps of the exchange plans (:mod:`horovod_quant.exchange.plans`) and the framing.

Each step takes what a collective delivered (NumPy or CuPy arrays) and returns what the next
collective sends, with the framing, seeds and checks that make every runner's result equal
:func:`horovod_quant.mean_estimate` bit for bit: encoding a rank's payload, framing payloads
with their length and the exchange's :data:`Tag` (:func:`frame`, :func:`unframe`,
:func:`check_tags`), the global norm's statistics, decoding a sum or a gather, the NDQSG outage
count, and the three steps of the scatter-reduce-allgather plan. The order in which they run
is written once, in the plans.
"""
from __future__ import annotations

from typing import Any, Sequence, Tuple

import numpy as np

from .. import gpu
from ..core.base import Codec, array_module, as_vector, worker_seed
from ..core.payload import Payload
from ..core.exp_reduce import chunk_bounds
from ..core.rng import derive_key, name_key

#: what the ranks exchange under one collective name: (elements of the whole tensor, 64-bit key
#: of its name and shape); every rank's must be equal, or different tensors would be combined
Tag = Tuple[int, int]
NO_TAG: Tag = (0, 0)

_HEADER = np.dtype("<u8")
HEADER_WORDS = 3  # byte length, tag numel, tag key
FRAME_HEADER_BYTES = HEADER_WORDS * _HEADER.itemsize


def exchange_tag(key: str, shape: Sequence[int]) -> Tag:
    """The :data:`Tag` of a tensor called ``key`` (any name the ranks share) of ``shape``."""
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel, name_key(f"{key}|{tuple(int(d) for d in shape)}")


def frame(payload: Payload, tag: Tag = NO_TAG) -> np.ndarray:
    """``[uint64 byte length][uint64 numel][uint64 key][payload bytes]`` (little-endian) as one
    uint8 array: gathered payloads of any length (Elias, unequal chunks) split again without an
    extra round, and each says which tensor it belongs to (:func:`check_tags`).
    The frame lives where the payload does (host or device)."""
    xp = array_module(payload.data)
    body = payload.data.reshape(-1).view(np.uint8)
    out = xp.empty(FRAME_HEADER_BYTES + body.size, np.uint8)
    header = np.array([body.size, tag[0], tag[1]], _HEADER).view(np.uint8)
    out[:FRAME_HEADER_BYTES] = xp.asarray(header)
    out[FRAME_HEADER_BYTES:] = body
    return out


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
        length, numel, key = (int(v) for v in
                              gpu.to_host(buf[o:o + FRAME_HEADER_BYTES]).view(_HEADER))
        o += FRAME_HEADER_BYTES
        if length > buf.size - o:
            raise ValueError(f"damaged exchange: frame {len(parts)} declares {length} bytes, "
                             f"{buf.size - o} remain")
        parts.append(buf[o:o + length])
        tags.append((numel, key))
        o += length
    return parts, tags


def check_tags(tags: Sequence[Tag], name: str = "") -> None:
    """Raise ValueError when the ranks' tags differ. Every rank holds every tag, so every
    rank raises (or none does).

    Args:
        tags: one per rank, in rank order (the senders' tags).
        name: the exchange's collective name, for the message.
    """
    if any(tuple(t) != tuple(tags[0]) for t in tags):
        lines = "\n".join(f"  rank {r}: {int(t[0])} elements (key {int(t[1]):016x})"
                          for r, t in enumerate(tags))
        raise ValueError(
            f"horovod_quant: the ranks sent different tensors to exchange {name!r} (a layer of "
            "another shape or name on some rank, or ranks that call the compressor in a "
            f"different order); nothing was combined:\n{lines}")


# -- global norm -------------------------------------------------------------------------------
NORM_WIRE_WORDS = 1 + len(NO_TAG)


def norm_wire(codec: Codec, xs: list[Any], tag: Tag = NO_TAG) -> np.ndarray:
    """This rank's part of the global norm over the vectors ``xs``: one float64 statistic
    (max or sum over the vectors, as ``codec.norm_op``) and the exchange's tag (its bits in
    two float64 words), :data:`NORM_WIRE_WORDS` float64 to be allgathered. The norm is the
    first collective of a global-norm exchange, so the tag check happens before anything
    else (the exponent allreduce included) pairs the ranks' data."""
    stats = [codec.norm_statistic(as_vector(x)) for x in xs]
    local = (max(stats) if codec.norm_op == "max" else sum(stats)) if stats else 0.0
    if any(np.isnan(t) for t in stats):  # max() may drop a NaN operand
        local = float("nan")
    wire = np.array([local, 0.0, 0.0], np.float64)
    wire[1:].view(_HEADER)[:] = tag
    return wire


def norm_from_gathered(codec: Codec, gathered: np.ndarray, name: str = "") -> np.float32:
    """The float32 global norm from the allgathered ``norm_wire`` words (rank order), after
    :func:`check_tags` on the ranks' tags."""
    words = np.ascontiguousarray(gathered, np.float64).reshape(-1, NORM_WIRE_WORDS)
    check_tags([tuple(int(v) for v in row[1:].view(_HEADER)) for row in words], name)
    return codec.norm_from_statistics([float(t) for t in words[:, 0]])


# -- sum, allgather and custom plans ------------------------------------------------------
def encode_payload(codec: Codec, x: Any, seed: int, rank: int,
                   norm: float | None = None) -> Payload:
    """Rank ``rank``'s payload in an exchange with seed ``seed`` (``norm``: the global norm of
    ``needs_norm`` codecs)."""
    return codec.encode_worker(as_vector(x), seed, rank, norm)


def sum_words(payload: Payload) -> Any:
    """The payload's words as the sum plan's allreduce adds them: uint64 words as int64 (whose
    wrapping sum is exact modulo 2^64), other word types as they are."""
    data = payload.data.reshape(-1)
    return data.view(np.int64) if data.dtype == np.uint64 else data


def decode_sum_wire(codec: Codec, total: np.ndarray, size: int, n: int, meta: dict,
                    out: np.ndarray | None = None) -> np.ndarray:
    """Sum plan: the float32 mean estimate from the elementwise sum of n ranks' words (into
    ``out`` when given; for float32 words that may be ``total`` itself)."""
    data = array_module(total).ascontiguousarray(total).reshape(-1).view(
        np.dtype(codec.wire_dtype))
    return codec.decode_sum(Payload(data, int(size), dict(meta)), int(n), out)


def combine_wire(codec: Codec, gathered: np.ndarray, size: int, seed: int, n: int,
                 meta: dict, own: tuple[int, Any] | None = None,
                 out: np.ndarray | None = None, name: str = "") -> np.ndarray:
    """Allgather plan: the float32 mean estimate from the concatenated frames of n ranks (into
    ``out`` when given), after :func:`check_tags` (``name`` is the exchange's, for the message).

    ``own = (rank, x)``: this rank's input, with which an NDQSG P2 sender counts its own wrong
    coarse bins (``codec.last_stats["outside_count"]``, see :func:`outage_wire`).
    """
    parts, tags = unframe(gathered)
    if len(parts) != n:
        raise ValueError(f"damaged exchange {name!r}: expected {n} framed payloads, "
                         f"got {len(parts)}")
    check_tags(tags, name)
    seeds = [worker_seed(seed, r) for r in range(n)]
    payloads = [codec.payload_from_wire(b, int(size), **{**meta, "seed": s})
                for b, s in zip(parts, seeds)]
    if own is not None and codec.counts_outage:
        inputs: list[Any] = [None] * n
        inputs[own[0]] = own[1]
        return codec.decode_side_info(payloads, seeds, inputs=inputs, out=out)
    return codec.combine_gathered(payloads, seed, out=out)


def outage_wire(codec: Codec) -> np.ndarray:
    """NDQSG: this rank's wrong coarse bins of the last ``combine_wire(own=...)`` as one int64,
    to be allreduced with sum."""
    return np.array([codec.last_stats.get("outside_count", 0)], np.int64)


def outage_from_wire(codec: Codec, total: np.ndarray) -> None:
    """NDQSG: set ``last_stats["outside_share"]`` from the allreduced :func:`outage_wire`."""
    codec.set_outside_total(int(np.asarray(total).reshape(-1)[0]))


# -- scatter-reduce-allgather plan -------------------------------------------------------------
REENCODE_TAG = 0x5EA


def chunk_seed(seed: int, rank: int, chunk: int) -> int:
    """Seed rank ``rank`` encodes chunk ``chunk`` with in the sra plan."""
    return derive_key(worker_seed(seed, rank), chunk)


def reencode_seed(seed: int, chunk: int) -> int:
    """Seed the owner of ``chunk`` re-encodes the chunk mean with in the sra plan."""
    return derive_key(seed, REENCODE_TAG, chunk)


def sra_encode_wire(codec: Codec, x: Any, seed: int, rank: int, n: int, tag: Tag = NO_TAG
                    ) -> tuple[Any, np.ndarray, int]:
    """Sra plan, step 1: ``(send bytes, int32 splits, payload bytes)`` for an alltoall; chunk
    c goes to rank c. Every frame carries ``tag``, checked by the receiving rank (each rank
    receives one frame of every rank, so all of them see a mismatch)."""
    v = as_vector(x)
    payloads = [codec.encode(v[lo:hi], seed=chunk_seed(seed, rank, c))
                for c, (lo, hi) in enumerate(chunk_bounds(v.size, n))]
    frames = [frame(p, tag) for p in payloads]
    return (array_module(v).concatenate(frames), np.array([f.size for f in frames], np.int32),
            sum(p.nbytes for p in payloads))


def sra_reduce_wire(codec: Codec, received: np.ndarray, size: int, seed: int, rank: int,
                    n: int, name: str = "") -> np.ndarray:
    """Sra plan, step 2: the mean of this rank's chunk from the n received frames (after
    :func:`check_tags`), re-encoded and framed for the allgather."""
    lo, hi = chunk_bounds(int(size), n)[rank]
    parts, tags = unframe(received)
    if len(parts) != n:
        raise ValueError(f"damaged exchange {name!r}: expected {n} chunks, got {len(parts)}")
    check_tags(tags, name)
    mine = [codec.payload_from_wire(b, hi - lo, seed=chunk_seed(seed, r, rank))
            for r, b in enumerate(parts)]
    mean = Codec.combine_gathered(codec, mine, seed)
    return frame(codec.encode(mean, seed=reencode_seed(seed, rank)))


def sra_decode_wire(codec: Codec, gathered: np.ndarray, size: int, seed: int, n: int,
                    out: np.ndarray | None = None) -> np.ndarray:
    """Sra plan, step 3: the float32 mean estimate from the allgathered re-encoded chunks
    (into ``out`` when given)."""
    out = array_module(gathered).empty(int(size), np.float32) if out is None else out
    parts, _ = unframe(gathered)  # the tags were checked at the scatter
    if len(parts) != n:
        raise ValueError(f"damaged exchange: expected {n} re-encoded chunks, got {len(parts)}")
    for c, ((lo, hi), part) in enumerate(zip(chunk_bounds(int(size), n), parts)):
        codec.decode(codec.payload_from_wire(part, hi - lo, seed=reencode_seed(seed, c)),
                     out[lo:hi])
    return out
