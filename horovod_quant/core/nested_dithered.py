"""Nested dithered quantization (NDQSG; nested-dithered-quantization paper, eq. (6)-(7),
Alg. 2, Theorem 6): ranks of group P1 send DQSG codes; the others (P2) send only the position
of their fine bin inside a coarse bin, which receivers resolve with the P1 mean as side
information.

The coarse ratio adapts between exchanges from the side-information error they measure; that
state is a :class:`NestedState` (``new_state()``) held by the exchange that runs the codec, not
by the codec, and advanced by every side-information decode (the ``Codec`` side-information
interface: ``combine_side_info``, ``finish_side_info``).
Arithmetic, the decode rule and the wire layout ``[int32 k][float32 kappa per bucket][packed
codes]``: docs/dev/formats.md ("Dithered codes").
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..backends import MODE_DITHER, MODE_NESTED, NORM_MAX, backend_of, numba_backend, packed_nbytes
from .base import Codec, CodecState, WireLayout, _numel, check_int, worker_seed
from .contract import SideInfoOutcome, SideInformation
from .dithered import check_dither_bits, dither_keys, fine_levels, payload_bytes, seed_of
from .payload import Payload
from .quantizers import DEFAULT_BUCKET, _check_bucket

#: bytes of the NDQSG header: the int32 k leads every payload and decides its code width
HEADER = 4


def coarse_bits(k: int) -> int:
    """Bits of a nested index in [-(k-1)/2, (k-1)/2]: ceil(log2 k)."""
    return (k - 1).bit_length()


def outage_bound(k: int, alpha: float, sigma2: float, M: int) -> float:
    """Theorem 6, eq. (8): ``P(|alpha z + u| > Delta2/2) <= Delta1^2 / (3 Delta2^2)
    + 4 alpha^2 sigma_z^2 / Delta2^2`` with ``Delta1 = 1/M``, ``Delta2 = k Delta1`` and
    ``sigma_z^2 = E z^2`` in units of the bucket scale (Chebyshev on ``alpha z + u``)."""
    d1 = 1.0 / M
    d2 = k * d1
    return d1 * d1 / (3 * d2 * d2) + 4 * alpha * alpha * sigma2 / (d2 * d2)


def theorem6_ratio(bits: int, alpha: float, sigma2: float, outage: float) -> int:
    """The smallest odd k >= 3 whose Theorem 6 bound (:func:`outage_bound`) is <= ``outage``,
    capped at ``2M + 1`` (``M = 2^(bits-1) - 1``): a coarse bin of 2M + 1 fine bins holds every
    index, so that k never decodes wrongly (and costs ``bits`` bits, like DQSG).

    Args:
        bits: fine code width (P1).
        alpha: shrinkage factor in (0, 1].
        sigma2: side-information error variance in units of the bucket scale (inf: no
            measurement yet).
        outage: target probability of a wrong coarse bin.

    Returns:
        The coarse ratio k.
    """
    M = fine_levels(bits)
    top = 2 * M + 1
    if not math.isfinite(sigma2):
        return top
    for k in range(3, top, 2):
        if outage_bound(k, alpha, sigma2, M) <= outage:
            return k
    return top


def measured_sigma2(sum_r2: float, count: int, alpha: float, M: int) -> float | None:
    """sigma_z^2 from an exchange's P2 residuals (``sum_r2`` over ``count`` values, in fine
    steps): ``(E (r - Q2 r)^2 - Delta1^2 / 12) / alpha^2``, at least 0 (docs/dev/formats.md). None
    without finite P2 values: the estimate then stays as it was."""
    if not count or math.isnan(sum_r2):
        return None
    d1 = 1.0 / M
    return max(0.0, (sum_r2 / count - 1 / 12) * d1 * d1 / (alpha * alpha))


def complete_outage_share(stats: dict[str, Any], wrong: int) -> None:
    """Set an exchange's ``"outside_share"`` from the wrong coarse bins of all its P2 senders."""
    count = stats.get("p2_values", 0)
    stats["outside_share"] = int(wrong) / count if count else 0.0


@dataclass
class NestedState(CodecState):
    """What an exchange of an NDQSG codec carries from one exchange to the next, and the rule
    that moves it: each side-information decode measures sigma_z^2, which sets the coarse ratio
    of the next P2 encode (Theorem 6, :func:`theorem6_ratio`) unless the ratio is fixed.

    Attributes:
        bits, alpha, outage, coarse_ratio: the codec's parameters the rule reads.
        sigma2: the side-information error last measured (inf before any).
        last_stats: the statistics of the last exchange decoded (class doc of
            :class:`NestedDitheredQuantizer`).
    """

    bits: int
    alpha: float
    outage: float
    coarse_ratio: int | None
    sigma2: float = math.inf
    last_stats: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        """``{"sigma2": ..., "last_stats": ...}``: what moves (the parameters are the codec's)."""
        return {"sigma2": self.sigma2, "last_stats": dict(self.last_stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            sigma2, last_stats = float(state["sigma2"]), dict(state["last_stats"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"not an NDQSG exchange state: {state!r} (expected the "
                             "state_dict() of a NestedState)") from None
        self.sigma2, self.last_stats = sigma2, last_stats

    @property
    def next_k(self) -> int:
        """The coarse ratio the next P2 encode uses."""
        if self.coarse_ratio is not None:
            return self.coarse_ratio
        return theorem6_ratio(self.bits, self.alpha, self.sigma2, self.outage)

    def advance(self, sum_r2: float, count: int, wrong: int, ks: list[int],
                exact: bool) -> dict[str, Any]:
        """Move on by one exchange: its P2 residuals (``sum_r2`` over ``count`` values), wrong
        coarse bins among the inputs known, its P2 ratios ``ks``, and whether every P2 input
        was known. Returns the exchange's statistics, now :attr:`last_stats`."""
        M = fine_levels(self.bits)
        sigma2 = measured_sigma2(sum_r2, count, self.alpha, M)
        if sigma2 is not None:
            self.sigma2 = sigma2
        k = max(ks) if ks else None
        stats = {
            "outside_share": None,
            "outside_count": wrong,
            "p2_values": count,
            "outside_bound": (outage_bound(k, self.alpha, sigma2, M)
                              if k is not None and sigma2 is not None else None),
            "k": k,
            "bits_p2": coarse_bits(k) if k is not None else None,
            "sigma2": sigma2,
            "next_k": self.next_k,
        }
        if exact:
            complete_outage_share(stats, wrong)
        self.last_stats = stats
        return stats


def check_inputs(name: str, inputs: Sequence[Any], world_size: int, size: int) -> None:
    """The senders' vectors given to a side-information decode: one entry per rank, None or
    ``size`` elements (the outage count reads them element by element)."""
    if len(inputs) != world_size:
        raise ValueError(f"{name}: got {len(inputs)} inputs for world_size={world_size}: pass "
                         f"one per rank (None where unknown)")
    for r, x in enumerate(inputs):
        if x is None:
            continue
        count = _numel(x)
        if count != size:
            raise ValueError(f"{name}: input of rank {r} has {count} elements, the payloads "
                             f"size={size}")


def header_k(payload: Payload) -> int:
    """The coarse ratio in an NDQSG payload's header (0 for a P1 payload)."""
    be = backend_of(payload.data)
    data = payload_bytes(be, payload)
    if data.size < HEADER:
        raise ValueError(f"an NDQSG payload starts with a {HEADER}-byte header; got "
                         f"{data.size} bytes")
    return int(be.to_host(data[:HEADER]).view(np.int32)[0])


def check_groups(name: str, ks: Sequence[int], n1: int) -> None:
    """The header ks of an exchange's payloads (rank order): 0 for ranks < n1 (P1), a coarse
    ratio for the others; ValueError naming the first rank at odds."""
    for r, k in enumerate(ks):
        if r < n1 and k != 0:
            raise ValueError(f"{name}: rank {r} is in P1 (ranks < {n1}) but its payload header "
                             f"says k={k} (a P2 payload: it decodes only with the P1 mean as "
                             f"side information): all ranks must build the codec with the same "
                             f"world_size and p1_fraction")
        if r >= n1 and k == 0:
            raise ValueError(f"{name}: rank {r} is in P2 (ranks >= {n1}) but its payload header "
                             f"says k={k}: all ranks must build the codec with the same "
                             f"world_size and p1_fraction")


def _unit(name: str, value: Any, closed: bool, hint: str) -> float:
    """``value`` as a float in (0, 1) (``closed``: (0, 1]); raises ValueError with ``hint``."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} must be a number") from None
    if not (0 < v < 1 or (closed and v == 1)):
        rng = "(0, 1]" if closed else "(0, 1)"
        raise ValueError(f"{name}={value!r} is out of range: use a value in {rng}; {hint}")
    return v


def _host_vector(x: Any) -> np.ndarray:
    """``x`` as a flat float32 NumPy array (a device array is copied to the host)."""
    be = backend_of(x)
    return numba_backend().vector(be.to_host(be.vector(x)))


class NestedDitheredQuantizer(SideInformation, Codec, head_nbytes=HEADER):
    """NDQSG (eq. (6)-(7), Alg. 2, Theorem 6): P2 ranks send the fine bin's position inside a
    coarse bin; receivers resolve the coarse bin with the P1 mean as side information.

    With ``coarse_ratio=None`` the ratio k adapts between exchanges: the exchange holds a
    :class:`NestedState` (:meth:`new_state`) that its encodes read and its side-information
    decodes advance; the codec itself never changes. Each P2 payload carries its k, so
    decoding never depends on that state. The state's ``last_stats`` describes the last
    exchange decoded: ``"outside_share"`` (share of P2 values with a wrong coarse bin: exact,
    None until every P2 sender's count is known), ``"outside_count"``, ``"p2_values"``,
    ``"outside_bound"`` (Theorem 6 at this k: an estimate after outages), ``"k"``,
    ``"bits_p2"``, ``"sigma2"``, ``"next_k"`` (docs/codecs.md).

    Args:
        world_size: n, number of ranks in the exchange (required).
        bits: fine code width of P1 (2..8); ``Delta1 = 1/M``, ``M = 2^(bits-1) - 1``.
        p1_fraction: share of ranks in P1, in (0, 1]; ``n1 = max(1, ceil(p1_fraction n))``,
            ranks ``0 .. n1-1``.
        alpha: shrinkage in (0, 1]; 1 keeps the estimate unbiased when the coarse bin is right
            (eq. (9) for other values).
        coarse_ratio: k, odd, 3..2M+1; None chooses it by Theorem 6 (above).
        outage: target outage probability for the automatic k, in (0, 1).
        bucket_size: elements per bucket (one float32 kappa each); None = whole tensor.
    """

    name = "nested_dithered"
    needs_world_size = True

    def __init__(self, world_size: int | None = None, bits: int = 4, p1_fraction: float = 0.5,
                 alpha: float = 1.0, coarse_ratio: int | None = None, outage: float = 0.01,
                 bucket_size: int | None = DEFAULT_BUCKET) -> None:
        if world_size is None:
            raise ValueError("nested_dithered needs world_size: the number of ranks whose "
                             "payloads combine (hvd.size() for a full allreduce)")
        n = check_int("world_size", world_size, 1)
        bits = check_dither_bits(bits)
        M = fine_levels(bits)
        p1_fraction = _unit("p1_fraction", p1_fraction, closed=True,
                            hint="it is the share of ranks sending plain DQSG codes")
        alpha = _unit("alpha", alpha, closed=True,
                      hint="1.0 keeps the estimate unbiased (Theorem 6)")
        outage = _unit("outage", outage, closed=False,
                       hint="e.g. 0.01 for one wrong coarse bin in a hundred")
        if coarse_ratio is not None:
            coarse_ratio = check_int("coarse_ratio", coarse_ratio, 3, 2 * M + 1,
                                     hint=f"an odd k <= 2^bits - 1 = {2 * M + 1} (larger k "
                                          f"cost more bits than DQSG), or None to choose k by "
                                          f"Theorem 6.")
            if coarse_ratio % 2 == 0:
                raise ValueError(f"coarse_ratio={coarse_ratio} must be odd so that coarse "
                                 f"bins are centred on fine ones: use {coarse_ratio - 1} or "
                                 f"{coarse_ratio + 1}")
        super().__init__(world_size=n, bits=bits, p1_fraction=p1_fraction, alpha=alpha,
                         coarse_ratio=coarse_ratio, outage=outage, bucket_size=bucket_size)
        self.bits = bits
        self.M = M
        self.n1 = max(1, min(n, math.ceil(p1_fraction * n - 1e-9)))
        self.alpha = alpha
        self.coarse_ratio = coarse_ratio
        self.outage = outage
        self.bucket_size = _check_bucket(bucket_size)

    # -- groups, parameters and state --------------------------------------------------------
    def new_state(self) -> NestedState:
        """A fresh exchange state: no side-information error measured yet, so the first P2
        encode uses ``coarse_ratio`` (or 2M + 1 when it adapts)."""
        return NestedState(self.bits, self.alpha, self.outage, self.coarse_ratio)

    def coarse_ratio_of(self, state: NestedState | None) -> int:
        """The coarse ratio a P2 encode uses in an exchange with ``state`` (None: a fresh
        one's)."""
        return (state or self.new_state()).next_k

    @property
    def delta1(self) -> float:
        """Fine step Delta1 = 1/M."""
        return 1.0 / self.M

    def in_p1(self, rank: int) -> bool:
        """Whether ``rank`` sends plain DQSG codes (group P1)."""
        return check_int("rank", rank, 0, self.world_size - 1) < self.n1

    def _bucket(self, n: int) -> int:
        return self.bucket_size if self.bucket_size is not None else max(n, 1)

    def payload_nbytes(self, n: int, rank: int = 0, state: NestedState | None = None) -> int:
        """Payload bytes for n elements from ``rank`` (P2 at the k of ``state``, None: a fresh
        one's)."""
        return self._nbytes_k(n, 0 if self.in_p1(rank) else self.coarse_ratio_of(state))

    def _nbytes_k(self, n: int, k: int) -> int:
        bits = self.bits if k == 0 else coarse_bits(k)
        return HEADER + 4 * -(-n // self._bucket(n)) + int(packed_nbytes(n, bits))

    def wire_layout(self, size: int, head: np.ndarray | None = None) -> WireLayout:
        """From the header's k: 0 (P1, ``bits``-bit codes) or an odd coarse ratio in
        [3, 2M + 1] (P2, ``ceil(log2 k)``-bit codes); any other k is a damaged header."""
        k = int(np.asarray(head)[:HEADER].view(np.int32)[0])
        top = 2 * self.M + 1
        if k != 0 and not (3 <= k <= top and k % 2 == 1):
            raise ValueError(f"{self.name}: payload header says k={k}: expected 0 (a P1 "
                             f"payload) or an odd coarse ratio in [3, {top}] (bits={self.bits})")
        bits = self.bits if k == 0 else coarse_bits(k)
        return WireLayout(size, self._nbytes_k(size, k), True,
                          f"k={k}: {bits}-bit codes, bucket_size={self.bucket_size}", k)

    # -- contract ----------------------------------------------------------------------------
    def encode(self, x: Any, seed: int = 0, rank: int = 0,
               state: NestedState | None = None) -> Payload:
        """What rank ``rank`` sends: DQSG codes (P1) or nested codes at the coarse ratio of
        ``state`` (P2, :meth:`coarse_ratio_of`).

        Args:
            x: 1-D float array.
            seed: this rank's seed (``worker_seed(exchange_seed, rank)``), kept in
                ``meta["seed"]`` (not sent).
            rank: the sender's rank, 0 .. world_size - 1.
            state: the exchange's state (None: a fresh one).

        Returns:
            The payload ``[int32 k][float32 kappa per bucket][packed codes]``, k = 0 for P1.
        """
        be = backend_of(x)
        v = be.vector(x)
        n = int(v.size)
        k = 0 if self.in_p1(rank) else self.coarse_ratio_of(state)
        bits = self.bits if k == 0 else coarse_bits(k)
        am = np.float32(self.M) if k == 0 else np.float32(self.alpha * self.M)
        out = be.xp.empty(self._nbytes_k(n, k), np.uint8)
        out[:HEADER] = be.xp.asarray(np.array([k], np.int32).view(np.uint8))
        be.encode(v, out, HEADER, self._bucket(n), MODE_DITHER if k == 0 else MODE_NESTED, bits,
                  dither_keys(seed), norm_kind=NORM_MAX, p=0.0, M=self.M, k=k, am=am)
        return Payload(out, n, {"seed": int(seed)})

    def encode_worker(self, x: Any, seed: int, rank: int, norm: float | None = None,
                      state: NestedState | None = None) -> Payload:
        return self.encode(x, seed=worker_seed(seed, rank), rank=rank, state=state)

    payload_k = staticmethod(header_k)

    def decode(self, payload: Payload, out: np.ndarray | None = None) -> np.ndarray:
        """Decode a P1 payload (DQSG). P2 payloads need side information:
        :meth:`decode_side_info`."""
        return self._decode_p1(payload, out, False)

    def decode_add(self, payload: Payload, out: np.ndarray) -> np.ndarray:
        return self._decode_p1(payload, out, True)

    def _decode_p1(self, payload: Payload, out: np.ndarray | None, accumulate: bool
                   ) -> np.ndarray:
        """Decode a checked P1 payload with its ``meta["seed"]``."""
        lay = self.check_payload(payload, out)
        if lay.head != 0:
            raise ValueError(f"{self.name}: this is a P2 payload (coarse ratio {lay.head}): it "
                             f"decodes only with the P1 mean as side information; use "
                             f"decode_side_info")
        n = lay.size
        be = backend_of(payload.data)
        dst = be.xp.empty(n, np.float32) if out is None else be.array(out)
        be.decode_dither([payload_bytes(be, payload)], [dither_keys(seed_of(payload))], HEADER,
                         n, self._bucket(n), self.bits, self.M, dst, accumulate)
        return dst if out is None else out

    def decode_p2(self, payload: Payload, y: np.ndarray, out: np.ndarray | None = None
                  ) -> np.ndarray:
        """Decode one P2 payload with side information ``y`` (eq. (7)); no state changes.

        Args:
            payload: a P2 payload with ``meta["seed"]``.
            y: float32 side information (the P1 mean) of the payload's length.
            out: destination (overwritten), or None for a new array.

        Returns:
            The sender's estimate ``x_hat``.
        """
        lay = self.check_payload(payload, out)
        k, n = lay.head, lay.size
        if k == 0:
            raise ValueError(f"{self.name}: this is a P1 payload: decode it with decode()")
        be = backend_of(payload.data)
        y = be.vector(y)
        if y.size != n:
            raise ValueError(f"{self.name}: side information has {y.size} elements, the "
                             f"payload size={n}")
        dst = be.xp.zeros(n, np.float32) if out is None else be.array(out)
        dst[:] = 0
        be.decode_nested(payload_bytes(be, payload), HEADER, n, self._bucket(n), self.M, k,
                         coarse_bits(k), np.float32(self.alpha * self.M), np.float32(self.alpha),
                         y, dither_keys(seed_of(payload)), dst)
        return dst if out is None else out

    # -- side information ----------------------------------------------------------------------
    def decode_side_info(self, payloads_by_rank: Sequence[Payload], seeds_by_rank: Sequence[int],
                         inputs: Sequence[Any] | None = None,
                         out: np.ndarray | None = None,
                         state: NestedState | None = None) -> np.ndarray:
        """The mean estimate of an exchange (Alg. 2 "Server"), as every rank computes it.

        Decodes P1 in rank order into a float32 sum, takes the P1 mean y as side information,
        adds every P2 decode (eq. (7)) in rank order and divides by n. Advances ``state``
        (sigma2, so the next k, and ``last_stats``).

        Args:
            payloads_by_rank: the n payloads in rank order.
            seeds_by_rank: each sender's seed (``worker_seed(exchange_seed, rank)``).
            inputs: the senders' vectors in rank order, None (or a None entry) where not
                known: wrong coarse bins of the known P2 senders are counted in
                ``last_stats["outside_count"]``; with every P2 input known,
                ``last_stats["outside_share"]`` is set (else None, see the class doc).
            out: destination of the estimate (overwritten), or None for a new array.
            state: the exchange's state (:meth:`new_state`), advanced; None: a fresh one,
                dropped after.

        Returns:
            The float32 mean estimate.
        """
        return self._decode_side_info(payloads_by_rank, seeds_by_rank, inputs, out, state)[0]

    def combine_side_info(self, payloads: Sequence[Payload], seed: int, rank: int, x: Any,
                          out: Any | None = None, state: NestedState | None = None
                          ) -> SideInfoOutcome:
        inputs: list[Any] = [None] * len(payloads)
        inputs[rank] = x
        seeds = [worker_seed(seed, r) for r in range(len(payloads))]
        mean, stats = self._decode_side_info(payloads, seeds, inputs, out, state)
        return SideInfoOutcome(mean, stats["outside_count"], stats)

    def finish_side_info(self, outcome: SideInfoOutcome, total_outages: int) -> None:
        complete_outage_share(outcome.record, total_outages)

    def _decode_side_info(self, payloads_by_rank: Sequence[Payload],
                          seeds_by_rank: Sequence[int], inputs: Sequence[Any] | None,
                          out: Any | None, state: NestedState | None
                          ) -> tuple[Any, dict[str, Any]]:
        """:meth:`decode_side_info`'s estimate and the exchange's statistics."""
        n = len(payloads_by_rank)
        if n != self.world_size or len(seeds_by_rank) != n:
            raise ValueError(f"{self.name}: got {n} payloads and {len(seeds_by_rank)} seeds for "
                             f"a codec built with world_size={self.world_size}: pass one of "
                             f"each per rank, in rank order")
        ks_all = self.check_group_headers(payloads_by_rank, out)
        size = payloads_by_rank[0].size
        if inputs is not None:
            check_inputs(self.name, inputs, self.world_size, size)
        be = backend_of(payloads_by_rank[0].data)
        est = be.xp.empty(size, np.float32) if out is None else be.array(out)
        est.fill(0)
        bucket = self._bucket(size)
        be.decode_dither([payload_bytes(be, p) for p in payloads_by_rank[: self.n1]],
                         [dither_keys(s) for s in seeds_by_rank[: self.n1]], HEADER, size, bucket,
                         self.bits, self.M, est, True)
        y = be.scale(est, 1.0 / self.n1, be.xp.empty_like(est))
        am = np.float32(self.alpha * self.M)
        sum_r2, count, wrong, ks = 0.0, 0, 0, []
        for r in range(self.n1, n):
            k = ks_all[r]
            ks.append(k)
            data = payload_bytes(be, payloads_by_rank[r])
            keys = dither_keys(seeds_by_rank[r])
            s2, c = be.decode_nested(data, HEADER, size, bucket, self.M, k, coarse_bits(k), am,
                                     np.float32(self.alpha), y, keys, est)
            sum_r2 += s2
            count += c
            if inputs is not None and inputs[r] is not None:
                # a statistic of simulations that know the inputs: on the host, in numba
                wrong += numba_backend().count_outside(
                    _host_vector(inputs[r]), be.to_host(data), HEADER, size, bucket, self.M, k,
                    coarse_bits(k), am, be.to_host(y), keys)
        be.scale(est, 1.0 / n, est)
        exact = inputs is not None and all(x is not None for x in inputs[self.n1:])
        stats = (state or self.new_state()).advance(sum_r2, count, wrong, ks, exact)
        return (est if out is None else out), stats

    def check_group_headers(self, payloads_by_rank: Sequence[Payload], out: Any | None = None
                            ) -> list[int]:
        """:meth:`check_payloads` of an exchange's payloads (rank order), whose header k must
        be 0 for ranks < n1 (P1) and an odd coarse ratio >= 3 for the others; raises
        ValueError otherwise. Returns each rank's k."""
        ks = [lay.head for lay in self.check_payloads(payloads_by_rank, out)]
        check_groups(self.name, ks, self.n1)
        return ks

    def combine_gathered(self, payloads: Sequence[Payload], seed: int,
                         out: np.ndarray | None = None) -> np.ndarray:
        """The exchange's mean from every rank's payload in rank order (custom exchange
        fallback: allgather, then this on every rank)."""
        return self.decode_side_info(payloads, [worker_seed(seed, r) for r in range(len(payloads))],
                                     out=out)
