"""Dithered (DQSG) and nested dithered (NDQSG) quantization of gradients.

Paper: "Nested Dithered Quantization for Communication Reduction in Distributed Training"
(``../shared/papers/nested-dithered-quantization.md``).

DQSG (eq. (2), Alg. 1). Per bucket, ``kappa = max|x|`` and ``v = x / kappa`` in [-1, 1]; the
sender adds a dither ``u ~ U[-Delta/2, Delta/2]``, sends the index ``q = round((v + u) / Delta)``
and the receiver, which regenerates ``u`` from the sender's seed, decodes
``x_hat = kappa (Delta q - u)``. By Schuchman's theorem (Theorem 1) the error
``(x_hat - x) / kappa`` is uniform on [-Delta/2, Delta/2] and independent of x: unbiased, with the
data-independent variance ``kappa^2 Delta^2 / 12`` per element.

How ``bits`` maps to the step: ``Delta = 1/M`` with ``M = 2^(bits-1) - 1`` (bits = 4: M = 7).
Writing ``u = (1/2 - rho) Delta`` with ``rho`` the element's counter-based uniform in [0, 1)
(:func:`.rng.u24_float` of ``hash32`` under ``derive_key(seed)``), the index is
``q = ceil(v M - rho)`` (``round`` with ties down of ``v M + 1/2 - rho``); ``|v| <= 1`` gives
``q in [-M, M]``, 2M + 1 values, sent as the code ``q + M`` in ``bits`` bits, and
``x_hat = (kappa / M) (q - 1/2 + rho)``. (Codes here are offset binary, not sign-magnitude: the
dithered decode of index 0 still depends on the side of zero the dither pushed it to.)
``x / kappa`` is a division rather than a multiplication by ``M / kappa``, so a subnormal kappa
cannot overflow the scale, and ``|x / kappa| <= 1`` holds exactly in float32.

NDQSG (eq. (6)-(7), Alg. 2). Ranks ``0 .. n1-1`` (group P1) send DQSG codes with step
``Delta1 = 1/M``; the others (P2) send only the position of the fine bin inside a coarse bin of
``Delta2 = k Delta1`` (k odd, so coarse centres are fine centres): ``s = Q1(t) - Q2(t)`` with
``t = alpha v + u``, an index ``m = q - k round(q / k)`` in [-(k-1)/2, (k-1)/2], sent as
``m + (k-1)/2`` in ``ceil(log2 k)`` bits. Receivers decode P1, take the P1 mean ``y`` as side
information (``Y = (y / kappa_p) M`` in the P2 sender's fine steps) and recover the fine index
``q_hat = m - k round((m - 1/2 + rho - alpha Y) / k)``, which is eq. (7)
``x_hat = y + alpha (r - Q2(r))``, ``r = s - u - alpha y``, rewritten as
``x_hat = alpha (kappa / M) (q_hat - 1/2 + rho) + (1 - alpha^2) y``: with alpha = 1 and a correct
coarse bin it is bit for bit the DQSG decode. Decoding is correct iff
``|alpha z + e| < Delta2 / 2`` (z the side-information error, e the fine dither error);
Theorem 6 bounds the outage probability by ``Delta1^2 / (3 Delta2^2) + 4 alpha^2 sigma_z^2 /
Delta2^2`` (Chebyshev on ``alpha z + e``). The decoder clamps the coarse shift to the shifts
that real indices use (``|round(q / k)| <= round(M / k)``): a wrong coarse bin then still decodes
within ``|q_hat| <= M + (k-1)/2``, so an outage costs at most about ``(2 + Delta2/2) kappa`` per
element, and a wrong bin pointing past the range is corrected outright.

Wire layout. DQSG: ``[float32 kappa per bucket][packed codes]`` (:mod:`.packing`). NDQSG adds an
int32 header: ``[int32 k][float32 kappa per bucket][packed codes]`` with ``k = 0`` for a P1
payload (``bits``-bit DQSG codes) and the coarse ratio for a P2 payload. Sending k makes a P2
payload decodable whatever the receiver's state: exchanges of several tensors may be in flight
on one codec while its running estimate changes.

Randomness: worker r of an exchange with seed s encodes with ``worker_seed(s, r)``; decoding
needs that seed (``payload.meta["seed"]``, which every rank can compute, so it is not sent).
"""
from __future__ import annotations

import math
from typing import Any, ClassVar, Sequence

import numpy as np

from ..backends import (
    MODE_DITHER,
    MODE_NESTED,
    NORM_MAX,
    backend_of,
    numba_backend,
    packed_nbytes,
)
from .base import Codec, WireLayout, _numel, check_int, worker_seed
from .payload import Payload
from .quantizers import DEFAULT_BUCKET, _check_bucket
from .rng import derive_key, split_key

#: bytes of the NDQSG header (int32 k)
HEADER = 4


def fine_levels(bits: int) -> int:
    """M, the largest fine index of a ``bits``-bit dithered code: Delta = 1/M, q in [-M, M]."""
    return (1 << (bits - 1)) - 1


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


# -- codecs ----------------------------------------------------------------------------------
def _bytes(be: Any, payload: Payload) -> Any:
    """A payload's data as a flat uint8 array of backend ``be`` (a view)."""
    return be.array(payload.data).view(np.uint8)


def _keys(seed: int) -> tuple[np.uint32, np.uint32]:
    """The element key halves of a sender's seed."""
    return split_key(derive_key(int(seed)))


def _seed_of(payload: Payload) -> int:
    try:
        return int(payload.meta["seed"])
    except KeyError:
        raise ValueError("payload.meta has no 'seed': the receiver regenerates the sender's "
                         "dither from it; rebuild the payload with payload_from_wire(data, size, "
                         "seed=worker_seed(exchange_seed, rank))") from None


def _host_vector(x: Any) -> np.ndarray:
    """``x`` as a flat float32 NumPy array (a device array is copied to the host)."""
    be = backend_of(x)
    return numba_backend().vector(be.to_host(be.vector(x)))


def _check_bits(bits: Any) -> int:
    return check_int("bits", bits, 2, 8, hint="bits = b gives 2^b - 1 dithered levels "
                     "(Delta = 1/(2^(b-1) - 1)); b = 2 is the smallest with a nonzero level.")


class DitheredQuantizer(Codec):
    """DQSG (eq. (2), Alg. 1): subtractive uniform dither regenerated by the receiver.

    The error ``(x_hat - x) / kappa`` is uniform on [-Delta/2, Delta/2] and independent of x
    (Theorem 1), so the codec is unbiased with variance ``sum_buckets kappa^2 d Delta^2 / 12``
    (Lemma 3), whatever the data.

    Args:
        bits: wire bits per element, 2..8; ``Delta = 1/M``, ``M = 2^(bits-1) - 1`` (module doc).
        bucket_size: elements per bucket (one float32 ``kappa = max|x|`` each); None = whole
            tensor.
    """

    name = "dithered"
    combine: ClassVar[str] = "gather"

    def __init__(self, bits: int = 4, bucket_size: int | None = DEFAULT_BUCKET) -> None:
        bits = _check_bits(bits)
        super().__init__(bits=bits, bucket_size=bucket_size)
        self.bits = bits
        self.bucket_size = _check_bucket(bucket_size)
        self.M = fine_levels(bits)

    @property
    def delta(self) -> float:
        """The quantization step Delta = 1/M (in units of the bucket scale)."""
        return 1.0 / self.M

    def _bucket(self, n: int) -> int:
        return self.bucket_size if self.bucket_size is not None else max(n, 1)

    def payload_nbytes(self, n: int) -> int:
        """Payload bytes for n elements: one float32 per bucket plus packed codes."""
        return 4 * -(-n // self._bucket(n)) + int(packed_nbytes(n, self.bits))

    def wire_layout(self, size: int, head: np.ndarray | None = None) -> WireLayout:
        return WireLayout(size, self.payload_nbytes(size), True,
                          f"bits={self.bits}, bucket_size={self.bucket_size}")

    def encode(self, x: Any, seed: int = 0) -> Payload:
        """Encode a 1-D float array; ``meta["seed"]`` keeps the seed the decoder needs (not
        sent: a receiver knows every sender's seed)."""
        be = backend_of(x)
        v = be.vector(x)
        n = int(v.size)
        out = be.xp.empty(self.payload_nbytes(n), np.uint8)
        be.encode(v, out, 0, self._bucket(n), MODE_DITHER, self.bits, _keys(seed),
                  norm_kind=NORM_MAX, p=0.0, M=self.M, k=0, am=np.float32(self.M))
        return Payload(out, n, {"seed": int(seed)})

    def _decode(self, payloads: Sequence[Payload], out: Any | None, accumulate: bool,
                post: float | None = None) -> Any:
        """Decode checked payloads (their sum, in order; times ``post``) into ``out``."""
        n = payloads[0].size
        be = backend_of(payloads[0].data)
        dst = be.xp.empty(n, np.float32) if out is None else be.array(out)
        be.decode_dither([_bytes(be, p) for p in payloads], [_keys(_seed_of(p)) for p in payloads],
                         0, n, self._bucket(n), self.bits, self.M, dst, accumulate, post)
        return dst if out is None else out

    def decode(self, payload: Payload, out: Any | None = None) -> Any:
        self.check_payload(payload, out)
        return self._decode([payload], out, False)

    def decode_add(self, payload: Payload, out: Any) -> Any:
        self.check_payload(payload, out)
        return self._decode([payload], out, True)

    def combine_gathered(self, payloads: Sequence[Payload], seed: int,
                         out: Any | None = None) -> Any:
        """The gather exchange's mean in one pass: zeros, every payload added in rank order,
        times float32(1 / n) (the operations of :meth:`Codec.combine_gathered`)."""
        size = self.check_payloads(payloads, out)[0].size
        be = backend_of(payloads[0].data)
        est = be.xp.empty(size, np.float32) if out is None else be.array(out)
        est.fill(0)
        self._decode(payloads, est, True, np.float32(1.0 / len(payloads)))
        return est if out is None else out

    def error_variance(self, kappa: float) -> float:
        """Per-element error variance ``kappa^2 Delta^2 / 12`` (Theorem 1, Lemma 3)."""
        return kappa * kappa * self.delta * self.delta / 12.0


class NestedDitheredQuantizer(Codec):
    """NDQSG (eq. (6)-(7), Alg. 2, Theorem 6): P2 ranks send the fine bin's position inside a
    coarse bin; receivers resolve the coarse bin with the P1 mean as side information.

    The coarse ratio k adapts when ``coarse_ratio`` is None: each exchange measures the
    side-information error ``sigma_z^2 = E[(x/kappa - y/kappa)^2]`` of the P2 values from what
    every rank holds after decoding (the recovered residuals of eq. (7): with a correct decode
    ``r - Q2(r) = -(alpha z + e)`` (Appendix E), e the fine dither error, so
    ``E (r - Q2 r)^2 = alpha^2 sigma_z^2 + Delta1^2 / 12`` and
    ``sigma_z^2 = (E (r - Q2 r)^2 - Delta1^2 / 12) / alpha^2``), and the next exchange
    uses :func:`theorem6_ratio` of it. Before any measurement k = 2M + 1, which holds every fine
    index (no outage possible; the P2 payload then costs ``bits`` bits like DQSG). Residuals
    are wrapped into the coarse bin, so after an outage-heavy exchange the estimate is about
    ``Delta2^2 / 12`` and the next k grows by ~1/sqrt(3 outage): the rule recovers by itself.
    Every rank updates the state in :meth:`decode_side_info` from the same data in the same
    order, so ranks agree on k as long as they finish exchanges in the same order; each P2
    payload carries its k, so decoding never depends on that.

    After each exchange ``last_stats`` holds:

    * ``"outside_share"``: share of P2 values whose coarse bin was wrong, i.e. with
      ``|alpha z + u| > Delta2/2`` (recovered fine index != the sender's). Exact. A receiver
      cannot tell a wrong coarse bin from a right one (the decoded value is always within
      Delta2/2 of the side information), but each P2 sender can check its own values: in a
      distributed exchange every rank counts its own wrong bins (``"outside_count"``, from
      ``inputs=`` with only its own vector), and the exchange plan (run by
      :class:`horovod_quant.exchange.Exchange` and by :func:`horovod_quant.mean_estimate`) sums
      the counts with one integer allreduce and calls :meth:`set_outside_total`. None until
      then, and after a :meth:`decode_side_info` that was not given every P2 input.
    * ``"outside_count"``: wrong coarse bins among the P2 senders whose input was given;
      ``"p2_values"``: P2 values decoded (finite, non-zero buckets), the share's denominator.
    * ``"outside_bound"``: Theorem 6's bound evaluated at this exchange's k and the sigma_z^2
      measured from the decoded values: an estimate, not a bound, after outages (a wrong
      coarse bin shrinks the measured residual, so it can fall below ``"outside_share"``).
    * ``"k"``, ``"bits_p2"``: coarse ratio and P2 code width of this exchange (the largest if
      P2 payloads disagree).
    * ``"sigma2"``: the measured sigma_z^2 (None without P2 values); ``"next_k"``: the ratio
      the next exchange will use.

    Args:
        world_size: n, number of ranks in the exchange (required).
        bits: fine code width of P1 (2..8); ``Delta1 = 1/M``, ``M = 2^(bits-1) - 1``.
        p1_fraction: share of ranks in P1, in (0, 1]; ``n1 = max(1, ceil(p1_fraction n))``,
            ranks ``0 .. n1-1``.
        alpha: shrinkage in (0, 1]. 1 keeps DQSG's variance with Delta1 and an unbiased
            estimate when the coarse bin is right; ``sqrt(1 - Delta1^2 / (12 sigma_z^2))``
            gives the same variance but is biased towards the side information (eq. (9)).
        coarse_ratio: k, odd, 3..2M+1; None chooses it by Theorem 6 (above).
        outage: target outage probability for the automatic k, in (0, 1).
        bucket_size: elements per bucket (one float32 kappa each); None = whole tensor.
    """

    name = "nested_dithered"
    combine: ClassVar[str] = "custom"
    needs_world_size = True
    counts_outage = True

    def __init__(self, world_size: int | None = None, bits: int = 4, p1_fraction: float = 0.5,
                 alpha: float = 1.0, coarse_ratio: int | None = None, outage: float = 0.01,
                 bucket_size: int | None = DEFAULT_BUCKET) -> None:
        if world_size is None:
            raise ValueError("nested_dithered needs world_size: the number of ranks whose "
                             "payloads combine (hvd.size() for a full allreduce)")
        n = check_int("world_size", world_size, 1)
        bits = _check_bits(bits)
        M = fine_levels(bits)
        p1_fraction = self._check_unit("p1_fraction", p1_fraction, closed=True,
                                       hint="it is the share of ranks sending plain DQSG codes")
        alpha = self._check_unit("alpha", alpha, closed=True,
                                 hint="1.0 keeps the estimate unbiased (Theorem 6)")
        outage = self._check_unit("outage", outage, closed=False,
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
        self.world_size = n
        self.bits = bits
        self.M = M
        self.n1 = max(1, min(n, math.ceil(p1_fraction * n - 1e-9)))
        self.alpha = alpha
        self.coarse_ratio = coarse_ratio
        self.outage = outage
        self.bucket_size = _check_bucket(bucket_size)
        #: side-information error estimate (inf until an exchange has measured it)
        self.sigma2 = math.inf
        self.last_stats: dict[str, Any] = {}

    @staticmethod
    def _check_unit(name: str, value: Any, closed: bool, hint: str) -> float:
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name}={value!r} must be a number") from None
        if not (0 < v < 1 or (closed and v == 1)):
            rng = "(0, 1]" if closed else "(0, 1)"
            raise ValueError(f"{name}={value!r} is out of range: use a value in {rng}; {hint}")
        return v

    # -- groups and parameters --------------------------------------------------------------
    @property
    def delta1(self) -> float:
        """Fine step Delta1 = 1/M."""
        return 1.0 / self.M

    @property
    def current_k(self) -> int:
        """The coarse ratio the next P2 encode uses."""
        if self.coarse_ratio is not None:
            return self.coarse_ratio
        return theorem6_ratio(self.bits, self.alpha, self.sigma2, self.outage)

    def in_p1(self, rank: int) -> bool:
        """Whether ``rank`` sends plain DQSG codes (group P1)."""
        return check_int("rank", rank, 0, self.world_size - 1) < self.n1

    def _bucket(self, n: int) -> int:
        return self.bucket_size if self.bucket_size is not None else max(n, 1)

    def payload_nbytes(self, n: int, rank: int = 0) -> int:
        """Payload bytes for n elements from ``rank`` (P2 at the current k)."""
        return self._nbytes_k(n, 0 if self.in_p1(rank) else self.current_k)

    def _nbytes_k(self, n: int, k: int) -> int:
        bits = self.bits if k == 0 else coarse_bits(k)
        return HEADER + 4 * -(-n // self._bucket(n)) + int(packed_nbytes(n, bits))

    #: the int32 k leads every payload and decides its code width
    head_nbytes: ClassVar[int] = HEADER

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
    def encode(self, x: Any, seed: int = 0, rank: int = 0) -> Payload:
        """What rank ``rank`` sends: DQSG codes (P1) or nested codes at :attr:`current_k` (P2).

        Args:
            x: 1-D float array.
            seed: this rank's seed (``worker_seed(exchange_seed, rank)``), kept in
                ``meta["seed"]`` (not sent).
            rank: the sender's rank, 0 .. world_size - 1.

        Returns:
            The payload ``[int32 k][float32 kappa per bucket][packed codes]``, k = 0 for P1.
        """
        be = backend_of(x)
        v = be.vector(x)
        n = int(v.size)
        k = 0 if self.in_p1(rank) else self.current_k
        bits = self.bits if k == 0 else coarse_bits(k)
        am = np.float32(self.M) if k == 0 else np.float32(self.alpha * self.M)
        out = be.xp.empty(self.payload_nbytes(n, rank), np.uint8)
        out[:HEADER] = be.xp.asarray(np.array([k], np.int32).view(np.uint8))
        be.encode(v, out, HEADER, self._bucket(n), MODE_DITHER if k == 0 else MODE_NESTED, bits,
                  _keys(seed), norm_kind=NORM_MAX, p=0.0, M=self.M, k=k, am=am)
        return Payload(out, n, {"seed": int(seed)})

    def encode_worker(self, x: Any, seed: int, rank: int, norm: float | None = None) -> Payload:
        return self.encode(x, seed=worker_seed(seed, rank), rank=rank)

    @staticmethod
    def payload_k(payload: Payload) -> int:
        """The coarse ratio in a payload's header (0 for a P1 payload)."""
        be = backend_of(payload.data)
        data = _bytes(be, payload)
        if data.size < HEADER:
            raise ValueError(f"an NDQSG payload starts with a {HEADER}-byte header; got "
                             f"{data.size} bytes")
        return int(be.to_host(data[:HEADER]).view(np.int32)[0])

    def decode(self, payload: Payload, out: np.ndarray | None = None) -> np.ndarray:
        """Decode a P1 payload (DQSG). P2 payloads need side information:
        :meth:`decode_side_info`."""
        return self._decode_p1(payload, None, out, False)

    def decode_add(self, payload: Payload, out: np.ndarray) -> np.ndarray:
        return self._decode_p1(payload, None, out, True)

    def _decode_p1(self, payload: Payload, seed: int | None, out: np.ndarray | None,
                   accumulate: bool) -> np.ndarray:
        """Decode a checked P1 payload (``seed`` None: the payload's ``meta["seed"]``)."""
        lay = self.check_payload(payload, out)
        if lay.head != 0:
            raise ValueError(f"{self.name}: this is a P2 payload (coarse ratio {lay.head}): it "
                             f"decodes only with the P1 mean as side information; use "
                             f"decode_side_info")
        n = lay.size
        be = backend_of(payload.data)
        dst = be.xp.empty(n, np.float32) if out is None else be.array(out)
        keys = _keys(_seed_of(payload) if seed is None else seed)
        be.decode_dither([_bytes(be, payload)], [keys], HEADER, n, self._bucket(n), self.bits,
                         self.M, dst, accumulate)
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
        be.decode_nested(_bytes(be, payload), HEADER, n, self._bucket(n), self.M, k,
                         coarse_bits(k), np.float32(self.alpha * self.M), np.float32(self.alpha),
                         y, _keys(_seed_of(payload)), dst)
        return dst if out is None else out

    def decode_side_info(self, payloads_by_rank: Sequence[Payload], seeds_by_rank: Sequence[int],
                         inputs: Sequence[Any] | None = None,
                         out: np.ndarray | None = None) -> np.ndarray:
        """The mean estimate of an exchange (Alg. 2 "Server"), as every rank computes it.

        Decodes P1 in rank order into a float32 sum, takes the P1 mean y as side information,
        adds every P2 decode (eq. (7)) in rank order and divides by n. Updates ``sigma2`` (and
        so the next k) and ``last_stats``.

        Args:
            payloads_by_rank: the n payloads in rank order.
            seeds_by_rank: each sender's seed (``worker_seed(exchange_seed, rank)``).
            inputs: the senders' vectors in rank order, None (or a None entry) where not
                known: wrong coarse bins of the known P2 senders are counted in
                ``last_stats["outside_count"]``; with every P2 input known,
                ``last_stats["outside_share"]`` is set (else None, see the class doc).
            out: destination of the estimate (overwritten), or None for a new array.

        Returns:
            The float32 mean estimate.
        """
        n = len(payloads_by_rank)
        if n != self.world_size or len(seeds_by_rank) != n:
            raise ValueError(f"{self.name}: got {n} payloads and {len(seeds_by_rank)} seeds for "
                             f"a codec built with world_size={self.world_size}: pass one of "
                             f"each per rank, in rank order")
        ks_all = self.check_group_headers(payloads_by_rank, out)
        size = payloads_by_rank[0].size
        if inputs is not None:
            self.check_inputs(inputs, size)
        be = backend_of(payloads_by_rank[0].data)
        est = be.xp.empty(size, np.float32) if out is None else be.array(out)
        est.fill(0)
        bucket = self._bucket(size)
        be.decode_dither([_bytes(be, p) for p in payloads_by_rank[: self.n1]],
                         [_keys(s) for s in seeds_by_rank[: self.n1]], HEADER, size, bucket,
                         self.bits, self.M, est, True)
        y = be.scale(est, 1.0 / self.n1, be.xp.empty_like(est))
        am = np.float32(self.alpha * self.M)
        sum_r2, count, wrong, ks = 0.0, 0, 0, []
        for r in range(self.n1, n):
            k = ks_all[r]
            ks.append(k)
            data = _bytes(be, payloads_by_rank[r])
            keys = _keys(seeds_by_rank[r])
            s2, c = be.decode_nested(data, HEADER, size, bucket, self.M, k, coarse_bits(k), am,
                                     np.float32(self.alpha), y, keys, est)
            sum_r2 += s2
            count += c
            if inputs is not None and inputs[r] is not None:
                # a statistic of simulations that know the inputs: on the host, in numba
                host = numba_backend()
                wrong += host.count_outside(_host_vector(inputs[r]), be.to_host(data), HEADER,
                                            size, bucket, self.M, k, coarse_bits(k), am,
                                            be.to_host(y), keys)
        be.scale(est, 1.0 / n, est)
        self._update_state(sum_r2, count, wrong, ks, self._all_p2_known(inputs))
        return est if out is None else out

    def check_group_headers(self, payloads_by_rank: Sequence[Payload], out: Any | None = None
                            ) -> list[int]:
        """:meth:`check_payloads` of an exchange's payloads (rank order), whose header k must
        be 0 for ranks < n1 (P1) and an odd coarse ratio >= 3 for the others; raises
        ValueError otherwise. Returns each rank's k."""
        ks = [lay.head for lay in self.check_payloads(payloads_by_rank, out)]
        for r, k in enumerate(ks):
            if r < self.n1 and k != 0:
                raise ValueError(f"{self.name}: rank {r} is in P1 (ranks < {self.n1}) but its "
                                 f"payload header says k={k} (a P2 payload: it decodes only "
                                 f"with the P1 mean as side information): all ranks must "
                                 f"build the codec with the same world_size and p1_fraction")
            if r >= self.n1 and k == 0:
                raise ValueError(f"{self.name}: rank {r} is in P2 (ranks >= {self.n1}) but its "
                                 f"payload header says k={k}: all ranks must build the codec "
                                 f"with the same world_size and p1_fraction")
        return ks

    def check_inputs(self, inputs: Sequence[Any], size: int) -> None:
        """The senders' vectors given to :meth:`decode_side_info`: one entry per rank, None or
        ``size`` elements (the outage count reads them element by element)."""
        if len(inputs) != self.world_size:
            raise ValueError(f"{self.name}: got {len(inputs)} inputs for world_size="
                             f"{self.world_size}: pass one per rank (None where unknown)")
        for r, x in enumerate(inputs):
            if x is None:
                continue
            count = _numel(x)
            if count != size:
                raise ValueError(f"{self.name}: input of rank {r} has {count} elements, the "
                                 f"payloads size={size}")

    def _all_p2_known(self, inputs: Sequence[Any] | None) -> bool:
        return inputs is not None and all(x is not None for x in inputs[self.n1:])

    def set_outside_total(self, wrong: int) -> None:
        """Complete ``last_stats["outside_share"]`` from the wrong coarse bins of all P2 senders
        (the sum over ranks of each one's ``"outside_count"``)."""
        count = self.last_stats.get("p2_values", 0)
        self.last_stats["outside_share"] = int(wrong) / count if count else 0.0

    def _update_state(self, sum_r2: float, count: int, wrong: int, ks: list[int],
                      exact: bool) -> None:
        """sigma_z^2 from the P2 residuals (class doc) and ``last_stats``. An exchange without
        finite P2 values (or with non-finite side information) leaves the estimate as it was."""
        sigma2 = None
        if count and not math.isnan(sum_r2):
            d1 = self.delta1
            sigma2 = max(0.0, (sum_r2 / count - 1 / 12) * d1 * d1 / (self.alpha * self.alpha))
            self.sigma2 = sigma2
        k = max(ks) if ks else None
        self.last_stats = {
            "outside_share": None,
            "outside_count": wrong,
            "p2_values": count,
            "outside_bound": (outage_bound(k, self.alpha, sigma2, self.M)
                              if k is not None and sigma2 is not None else None),
            "k": k,
            "bits_p2": coarse_bits(k) if k is not None else None,
            "sigma2": sigma2,
            "next_k": self.current_k,
        }
        if exact:
            self.set_outside_total(wrong)

    def combine_gathered(self, payloads: Sequence[Payload], seed: int,
                         out: np.ndarray | None = None) -> np.ndarray:
        """The exchange's mean from every rank's payload in rank order (custom exchange
        fallback: allgather, then this on every rank)."""
        return self.decode_side_info(payloads, [worker_seed(seed, r) for r in range(len(payloads))],
                                     out=out)
