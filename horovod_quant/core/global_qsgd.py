"""Global-QSGD (Global-QSGD paper, Definition 3.1, Algorithm 1): quantization by the GLOBAL norm.

Every worker scales its vector by the norm of the concatenation of all workers' vectors (one
scalar exchange, Algorithm 1 line 2) instead of its own, so all workers share one grid and
their codes combine without side information:

* ``levels="linear"`` (Global-L_s): levels j/s in summable fields of uint64 words, with the
  headroom that makes a plain integer sum of n workers' words exact (:class:`GlobalQSGDLinear`);
* ``levels="exponential"`` (Global-E_s): codes ``sign << (bits-1) | e`` of values
  ``sign * 2^-e``, summed by the stochastic exponent reduction of :mod:`.exponent_reduction`
  (:class:`GlobalQSGDExponential`);
* ``mode="sparse"``: only the nonzero codes and their positions travel, gathered
  (:class:`GlobalQSGDSparse`).

Word layouts, code tables and the rounding draws, bit for bit: docs/dev/formats.md ("Global-QSGD").
"""
from __future__ import annotations

import abc
import math
from typing import Any, Sequence

import numpy as np

from ..backends import (
    MODE_EXP,
    MODE_LINEAR_SM,
    NORM_L2,
    SPARSE_OK,
    SPARSE_SHORT,
    backend_of,
    packed_nbytes,
)
from .base import Codec, WireLayout, check_choice, check_int, worker_seed
from .contract import GlobalNorm, Reduced, SumDecodable
from .exponent_reduction import (
    REDUCTIONS,
    exponent_offset,
    partial_sum_sizes,
    reduce_packed,
    reduction_rounds,
)
from .limits import FEW_LEVELS, HIERARCHY_HINT, warn_limit
from .payload import Payload
from .quantizers import uniform_grid_omega
from .rng import derive_key, split_key

LEVELS = ("linear", "exponential")
NORMS = ("max", "l2")
MODES = ("dense", "sparse")
#: Largest field of the linear dense layout (levels and offsets stay exact in int32/float32).
MAX_LINEAR_BITS = 16


# -- codec -----------------------------------------------------------------------------------
def _bits_for(top: int) -> int:
    """Fewest bits whose sign-magnitude code holds magnitudes up to ``top``."""
    return max(2, top.bit_length() + 1)


def exponential_omega(d: int, s: int) -> float:
    """Bound on E||Q(x) - x||^2 / ||x||^2 for levels {0} U {2^-j, j < s} on d elements scaled
    by a norm >= max|x| and <= ||x||_2 (max or L2).

    Derived (it has the form of Theorem 3.3's second part, which cites natural dithering): with
    y = |x| / norm, an element between two powers of two has variance at most y^2 / 8 (C_nat's
    worst case, natural-compression Theorem 1); below the smallest level l = 2^(1-s) it is
    y (l - y) <= min(l^2 / 4, y l). Summing, with ||y||_1 <= sqrt(d) ||x||_2 / norm and
    norm <= ||x||_2: omega = 1/8 + min(d l^2 / 4, sqrt(d) l).
    """
    if d == 0:
        return 0.0
    low = 2.0 ** (1 - s)
    return 1 / 8 + min(d * low * low / 4, math.sqrt(d) * low)


def linear_dense_levels(n: int, bits: int, num_levels: int | None) -> int:
    """The default (or checked) s of linear dense fields: n workers' offsets v + s sum to at
    most 2ns, which ``bits`` must hold."""
    most = ((1 << bits) - 1) // (2 * n)
    s = most if num_levels is None else num_levels
    if s < 1 or s > most:
        s = max(s, 1)
        need = (2 * n * s).bit_length()  # ceil(log2(2ns + 1))
        raise ValueError(
            f"linear levels: {n} workers' sum with num_levels={s} needs fields of "
            f"ceil(log2(2*n*s+1)) = {need} bits, got bits={bits}; use bits >= {need}"
            + (f" or num_levels <= {most}" if most else "")
            + f" (bits={bits} supports world_size <= {((1 << bits) - 1) // (2 * s)} "
            f"at num_levels={s}). Alternatives: {_alternatives(n, bits, 'linear')}")
    return s


def _exponential_levels_at(n: int, bits: int, reduction: str = "tree") -> int:
    """The most exponential dense levels ``bits`` hold for n workers (< 1: none)."""
    top = (1 << (bits - 1)) - 1
    return top - (exponent_offset(n, reduction) + reduction_rounds(n, reduction)) + 1


def _alternatives(n: int, bits: int, levels: str) -> str:
    """What serves n workers better than ``levels`` at ``bits``, for the messages."""
    options = []
    if levels == "linear":
        exp = _exponential_levels_at(n, min(bits, 8))
        if exp >= 1:
            options.append(f"levels='exponential' ({exp} levels at {n} workers, "
                           f"bits={min(bits, 8)})")
        wide = ((1 << MAX_LINEAR_BITS) - 1) // (2 * n)
        if bits < MAX_LINEAR_BITS and wide >= 1:
            options.append(f"linear bits={MAX_LINEAR_BITS} ({wide} levels)")
    else:
        lin = ((1 << MAX_LINEAR_BITS) - 1) // (2 * n)
        if bits < 8 and _exponential_levels_at(n, 8) >= 1:
            options.append(f"bits=8 ({_exponential_levels_at(n, 8)} levels)")
        if lin >= 1:
            options.append(f"levels='linear' with bits={MAX_LINEAR_BITS} ({lin} levels)")
    options.append("a per-worker codec such as qsgd, whose payloads are gathered, not summed "
                   "(no limit in the number of workers)")
    return "; ".join(options) + f". {HIERARCHY_HINT}."


def levels_note(n: int, bits: int, levels: str, s: int, reduction: str = "tree") -> str | None:
    """A warning's text when ``s`` levels of n workers are fewer than :data:`FEW_LEVELS` and
    fewer than 2 workers would have (the codec degraded by its world size), else None."""
    at_two = (((1 << bits) - 1) // 4 if levels == "linear"
              else _exponential_levels_at(2, bits, reduction))
    if s >= FEW_LEVELS or s >= at_two:
        return None
    rule = ("floor((2^bits - 1) / (2n))" if levels == "linear"
            else "2^(bits-1) - c - R, the exponent offset and roundings growing with log2 n")
    return (f"global_qsgd {levels} levels, bits={bits}: {n} workers' sum leaves {s} level(s) "
            f"({rule}; {at_two} at 2 workers); the variance grows as the levels shrink. "
            f"Alternatives: {_alternatives(n, bits, levels)}")

def exponential_dense_levels(n: int, bits: int, num_levels: int | None, reduction: str) -> int:
    """The default (or checked) s of exponential dense codes: after the offset c and R roundings
    of the exponent reduction, exponents reach c + s - 1 + R, which ``bits`` must hold."""
    top = (1 << (bits - 1)) - 1

    def reach(m: int, s: int) -> int:
        return exponent_offset(m, reduction) + s - 1 + reduction_rounds(m, reduction)

    most = top - reach(n, 1) + 1
    s = most if num_levels is None else num_levels
    if s < 1 or s > most:
        s = max(s, 1)
        largest = 0
        while reach(largest + 1, s) <= top:
            largest += 1
        raise ValueError(
            f"exponential levels: {n} workers ({reduction} reduction) with num_levels={s} "
            f"reach exponent c + s - 1 + R = {reach(n, s)}, which needs "
            f"2^(bits-1) - 1 >= {reach(n, s)}, got bits={bits}; use bits >= "
            f"{_bits_for(reach(n, s))}" + (f" or num_levels <= {most}" if most >= 1 else "")
            + f" (bits={bits} supports world_size <= {largest} at num_levels={s}). "
            f"Alternatives: {_alternatives(n, bits, 'exponential')}")
    return s


def theta_bound(levels: str, n: int, d: int, s: int, reduction: str, rounds: int) -> float:
    """Bound on E||mean estimate - mean||^2 / ((1/n) sum_i ||x_i||^2) for n workers of d
    elements each (Definition 2.2's theta), with ``rounds`` roundings of the exponent
    reduction (0 for linear levels and sparse mode).

    Quantization (Lemma 3.2: theta = omega / n with omega of the one-worker quantizer on
    the concatenated n*d vector): linear levels use QSGD Lemma 3.1 (see
    :func:`.quantizers.uniform_grid_omega`), exponential ones :func:`exponential_omega`.
    The reduction adds ``sum_k (9/8)^(R-k) g_k / (8 n)`` and scales omega by ``(9/8)^R``
    (derived in docs/dev/formats.md, "Global-QSGD": the paper's factor bounds second moments,
    not variances).
    """
    if levels == "linear":
        omega = uniform_grid_omega(n * d, s, 2.0)
    else:
        omega = exponential_omega(n * d, s)
    growth = 9 / 8
    theta = growth ** rounds * omega / n
    if rounds:
        sizes = partial_sum_sizes(n, reduction)
        theta += sum(growth ** (rounds - k) * g
                     for k, g in enumerate(sizes, start=1)) / (8 * n)
    return theta


def signed_table(levels: str, bits: int, s: int, c: int) -> np.ndarray:
    """Value of each sign-magnitude code (exponential: ±2^(c - e); linear: ±j/s), so that
    decoded = table[code] * norm (divided by n for a reduced sum)."""
    half = 1 << (bits - 1)
    table = np.zeros(2 * half, np.float32)
    mag = np.arange(half, dtype=np.int64)
    if levels == "exponential":
        lv = np.where(mag > 0, np.ldexp(1.0, c - mag), 0.0)
    else:
        lv = mag / s
    table[:half] = lv
    table[half:] = -lv
    return table


class GlobalQSGD(GlobalNorm, Codec):
    """Global-QSGD (Definition 3.1, Algorithm 1) with linear or exponential levels.

    Every worker encodes with the global norm (:class:`.contract.GlobalNorm`); payload
    layouts: docs/dev/formats.md ("Global-QSGD"). Building one gives the class of its
    configuration, whose capabilities differ: :class:`GlobalQSGDLinear` (dense linear: words
    sum, :class:`.contract.SumDecodable`), :class:`GlobalQSGDExponential` (dense exponential:
    the exponent reduction, :class:`.contract.Reduced`) and :class:`GlobalQSGDSparse`
    (gathered).

    Args:
        world_size: n, the number of workers whose payloads combine (required; it sets the
            headroom of the linear fields and the exponent offset).
        bits: wire bits per element, the sign included. Linear dense: 2..16 (a field of a
            summable word); exponential and sparse: 2..8.
        levels: "linear" (Global-L_s) or "exponential" (Global-E_s).
        num_levels: s; default the largest that fits (linear dense:
            ``floor((2^bits - 1) / (2n))``; exponential dense: ``2^(bits-1) - c - R`` with
            ``c`` = :func:`.exponent_reduction.exponent_offset` and R roundings per element;
            sparse: ``2^(bits-1) - 1``).
        norm: "max" (L-infinity, the paper's default) or "l2" (global L2 norm).
        mode: "dense" (allreduce-style exchange) or "sparse" (nonzeros with positions, gather).
        reduction: exponential dense only: "tree" (recursive halving/doubling, ceil(log2 n)
            roundings per element) or "ring" (n - 1 roundings).
    """

    name = "global_qsgd"
    needs_world_size = True
    spec_suffixes = {"lin": {"levels": "linear"}, "exp": {"levels": "exponential"}}

    def __new__(cls, world_size: int | None = None, bits: int = 8, levels: str = "exponential",
                num_levels: int | None = None, norm: str = "max", mode: str = "dense",
                reduction: str = "tree") -> "GlobalQSGD":
        if cls is GlobalQSGD:  # the configuration's class; __init__ validates the arguments
            cls = (GlobalQSGDSparse if mode == "sparse"
                   else GlobalQSGDLinear if levels == "linear" else GlobalQSGDExponential)
        return super().__new__(cls)

    def __init__(self, world_size: int | None = None, bits: int = 8,
                 levels: str = "exponential", num_levels: int | None = None,
                 norm: str = "max", mode: str = "dense", reduction: str = "tree") -> None:
        if world_size is None:
            raise ValueError("global_qsgd needs world_size: the number of workers whose "
                             "payloads combine (hvd.size() for a full allreduce)")
        n = check_int("world_size", world_size, 1)
        check_choice("levels", levels, LEVELS)
        check_choice("norm", norm, NORMS)
        check_choice("mode", mode, MODES)
        check_choice("reduction", reduction, REDUCTIONS)
        dense = mode == "dense"
        linear = levels == "linear"
        if reduction != "tree" and not (dense and not linear):
            raise ValueError(f"reduction={reduction!r} applies to levels='exponential', "
                             f"mode='dense' only; leave it at 'tree' for {levels} {mode}")
        hi_bits = MAX_LINEAR_BITS if dense and linear else 8
        bits = check_int("bits", bits, 2, hi_bits,
                         hint=f"Codes of {levels} {mode} payloads take 2..{hi_bits} bits.")
        if num_levels is not None:
            num_levels = check_int("num_levels", num_levels, 1)
        self.requested_levels = num_levels
        self.bits = bits
        self.levels = levels
        self.norm = norm
        self.mode = mode
        self.reduction = reduction
        self.rounds = reduction_rounds(n, reduction) if dense and not linear else 0
        self.c = exponent_offset(n, reduction) if dense and not linear else 1
        if dense and linear:
            self.s = linear_dense_levels(n, bits, num_levels)
        elif dense:
            self.s = exponential_dense_levels(n, bits, num_levels, reduction)
        else:
            most = (1 << (bits - 1)) - 1
            self.s = most if num_levels is None else check_int(
                "num_levels", num_levels, 1, most,
                hint=f"{bits} bits hold at most {most} levels with the sign; raise bits.")
        self.table = signed_table(levels, bits, self.s, self.c)
        super().__init__(world_size=n, bits=bits, levels=levels, num_levels=self.s, norm=norm,
                         mode=mode, reduction=reduction)
        note = self.limit_note()
        if note is not None:
            warn_limit(note)

    def limit_note(self) -> str | None:
        """Dense modes with the default levels: :func:`levels_note` of this world size (levels
        the user chose are not the world's doing; sparse payloads are gathered)."""
        if self.mode != "dense" or self.requested_levels is not None:
            return None
        return levels_note(self.world_size, self.bits, self.levels, self.s, self.reduction)

    def resize_params(self, world_size: int) -> dict[str, Any]:
        """The same parameters for another world, with the levels the user asked for (the
        default fits the most levels that world allows)."""
        return {**self.params, "world_size": world_size, "num_levels": self.requested_levels}

    # -- global norm -----------------------------------------------------------------------
    def norm_statistic(self, x: Any) -> float:
        """This worker's part of the global norm: max|x| ("max") or sum x^2 ("l2"), computed
        in float64; NaN/Inf in x make it non-finite. Combine the workers' values with
        :meth:`combine_statistics` and pass the result to :meth:`norm_from_statistic`."""
        be = backend_of(x)
        v = be.vector(x)
        return be.max_abs(v) if self.norm == "max" else be.sum_squares(v)

    def norm_from_statistic(self, stat: float) -> np.float32:
        """The global norm from the combined statistic (the root for "l2"), as float32 rounded
        up, so that |x_i| / norm <= 1 holds for every element of every worker."""
        val = math.sqrt(stat) if self.norm == "l2" and stat >= 0 else float(stat)
        out = np.float32(val)
        if math.isfinite(val) and float(out) < val:
            out = np.nextafter(out, np.float32(np.inf))
        return out

    def global_norm(self, xs: Sequence[Any]) -> np.float32:
        """The global norm of the workers' vectors ``xs`` (see :meth:`norm_from_statistics`)."""
        return self.norm_from_statistics([self.norm_statistic(x) for x in xs])

    def combine_statistics(self, stats: Sequence[float]) -> float:
        """Statistics combined in the order given: float64 max ("max") or left-to-right sum
        ("l2"), NaN if any is NaN, 0.0 for none."""
        total = stats[0] if stats else 0.0
        for t in stats[1:]:
            total = max(total, t) if self.norm == "max" else total + t
        if any(math.isnan(t) for t in stats):  # max() keeps the first operand on a NaN
            total = math.nan
        return total

    def norm_from_statistics(self, stats: Sequence[float]) -> np.float32:
        """The global norm from per-worker statistics given in rank order
        (:meth:`combine_statistics`: the exchange allgathers the statistics so every rank
        combines them in this order)."""
        return self.norm_from_statistic(self.combine_statistics(stats))

    # -- contract --------------------------------------------------------------------------
    def _detail(self) -> str:
        return f"levels={self.levels}, mode={self.mode}, bits={self.bits}"

    def encode(self, x: Any, seed: int = 0, norm: float | None = None) -> Payload:
        """Encode one worker's vector with the global norm.

        Args:
            x: 1-D float array.
            seed: this worker's seed (``worker_seed(exchange_seed, rank)``).
            norm: the global norm over all workers (and all tensors of the step);
                None uses this vector's own norm (n = 1 semantics). Zero gives all-zero codes;
                NaN/Inf makes every decoded value non-finite.

        Returns:
            The payload; ``meta["norm"]`` holds the float32 norm (not sent: every rank knows
            the global norm from the norm allreduce).
        """
        be = backend_of(x)
        v = be.vector(x)
        n = int(v.size)
        if norm is None:
            g = self.norm_from_statistic(self.norm_statistic(v))
        else:
            g = np.float32(norm)
            if g < 0:
                raise ValueError(f"norm={norm} must be >= 0: pass the global norm "
                                 f"(norm_from_statistic of the combined statistics)")
        return Payload(self._encode_codes(be, v, g, split_key(derive_key(seed))), n,
                       {"norm": g})

    @abc.abstractmethod
    def _encode_codes(self, be: Any, v: Any, norm: np.float32, keys: Any) -> Any:
        """The payload data of vector ``v`` on backend ``be`` with the global norm."""

    @abc.abstractmethod
    def _decode_codes(self, be: Any, data: Any, size: int, norm: np.float32, n: int, dst: Any,
                      acc: bool) -> None:
        """Decode (``acc``: add) the payload data of ``size`` elements, combined from ``n``
        workers, into ``dst``."""

    def _norm_of(self, payload: Payload) -> np.float32:
        """The payload's float32 norm (any float, NaN and Inf included: they decode to
        non-finite values)."""
        try:
            norm = payload.meta["norm"]
        except KeyError:
            raise ValueError(f"{self.name}: payload.meta has no 'norm': rebuild it with "
                             "payload_from_wire(data, size, norm=<global norm>)") from None
        try:
            return np.float32(norm)
        except (TypeError, ValueError):
            raise ValueError(f"{self.name}: payload.meta['norm']={norm!r} is not a "
                             f"number") from None

    def _decode(self, payload: Payload, n: int, out: Any | None, acc: bool) -> Any:
        lay = self.check_payload(payload, out)
        size = lay.size
        norm = self._norm_of(payload)
        be = backend_of(payload.data)
        xp = be.xp
        if out is None:
            dst = xp.zeros(size, np.float32) if acc else xp.empty(size, np.float32)
        else:
            dst = be.array(out)
        self._decode_codes(be, be.array(payload.data), size, norm, n, dst, acc)
        return dst if out is None else out

    def decode(self, payload: Payload, out: np.ndarray | None = None) -> np.ndarray:
        """One worker's payload as float32 (its own estimate of x_i)."""
        return self._decode(payload, 1, out, False)

    def decode_add(self, payload: Payload, out: np.ndarray) -> np.ndarray:
        """``out += decode(payload)`` in one pass."""
        return self._decode(payload, 1, out, True)

    def encode_worker(self, x: Any, seed: int, rank: int, norm: float | None = None,
                      state: Any = None) -> Payload:
        """Worker ``rank``'s payload in an exchange with seed ``seed`` and global norm ``norm``
        (``state``: none, the codec does not adapt)."""
        return self.encode(x, seed=worker_seed(seed, rank), norm=norm)

    def theta(self, d: int) -> float:
        """Bound on E||mean estimate - mean||^2 / ((1/n) sum_i ||x_i||^2) for d elements per
        worker (Definition 2.2's theta; :func:`theta_bound`)."""
        return theta_bound(self.levels, self.world_size, d, self.s, self.reduction, self.rounds)


class _DenseGlobalQSGD(GlobalQSGD):
    """Dense Global-QSGD: one code per element, combined across workers into one payload
    (:meth:`reduce`) that :meth:`decode_sum` decodes."""

    def payload_nbytes(self, d: int) -> int:
        """Payload bytes for d elements."""
        return int(packed_nbytes(d, self.bits))

    def wire_layout(self, size: int, head: np.ndarray | None = None) -> WireLayout:
        """The exact size for ``size`` elements (:meth:`payload_nbytes`)."""
        return WireLayout(size, self.payload_nbytes(size), True, self._detail())

    def decode_sum(self, payload: Payload, n: int, out: np.ndarray | None = None) -> np.ndarray:
        """The mean estimate from the combined payload of n workers: the integer word sum for
        linear levels, ``(field - n s) * norm / (s n)``; the reduced codes (:meth:`reduce`) for
        exponential ones, ``decoded * norm * 2^c / n``."""
        n = check_int(f"{self.name}: n", n, 1, self.world_size,
                      hint=f"the codec was built for world_size={self.world_size}.")
        return self._decode(payload, n, out, False)

    def reduce(self, payloads: Sequence[Payload], seed: int) -> Payload:
        """The combined payload of n workers, as the dense exchange computes it: the wrapping
        uint64 sum of the words (linear) or the stochastic exponent reduction with the exchange
        seed ``seed`` (exponential, :func:`.exponent_reduction.reduce_packed`)."""
        n = len(payloads)
        check_int(f"{self.name}: number of payloads", n, 1, self.world_size,
                  hint=f"the codec was built for world_size={self.world_size}.")
        self.check_payloads(payloads)
        first = payloads[0]
        return Payload(self._combine_data(backend_of(first.data), payloads, seed), first.size,
                       dict(first.meta))

    @abc.abstractmethod
    def _combine_data(self, be: Any, payloads: Sequence[Payload], seed: int) -> Any:
        """The data of :meth:`reduce`'s combined payload (the payloads are checked)."""

    def combine_gathered(self, payloads: Sequence[Payload], seed: int,
                         out: np.ndarray | None = None) -> np.ndarray:
        """The dense sum / exponent reduction of every worker's payload (rank order), computed
        locally: what the exchange gives when run without MPI."""
        return self.decode_sum(self.reduce(payloads, seed), len(payloads), out)


class GlobalQSGDLinear(_DenseGlobalQSGD, SumDecodable, wire_dtype=np.uint64):
    """Global-L_s, dense: levels j/s in summable fields of uint64 words, whose plain integer
    sum over n workers is exact (docs/dev/formats.md)."""

    def payload_nbytes(self, d: int) -> int:
        """Payload bytes for d elements: whole uint64 words of ``64 // bits`` fields."""
        return 8 * -(-d // (64 // self.bits))

    def _encode_codes(self, be: Any, v: Any, norm: np.float32, keys: Any) -> Any:
        data = be.xp.empty(self.payload_nbytes(int(v.size)) // 8, np.uint64)
        be.linear_encode(v, self.bits, self.s, norm, keys, data)
        return data

    def _decode_codes(self, be: Any, data: Any, size: int, norm: np.float32, n: int, dst: Any,
                      acc: bool) -> None:
        scale = np.float32(np.float64(norm) / (self.s * n))
        be.linear_decode(data.view(np.uint64), size, self.bits, n * self.s, scale, dst, acc)

    def _combine_data(self, be: Any, payloads: Sequence[Payload], seed: int) -> Any:
        total = be.array(payloads[0].data).view(np.uint64).copy()
        for p in payloads[1:]:
            total += be.array(p.data).view(np.uint64)
        return total


class GlobalQSGDExponential(_DenseGlobalQSGD, Reduced, collective="exponent_allreduce"):
    """Global-E_s, dense: codes ``sign << (bits-1) | e`` of values ``sign * 2^-e``, combined by
    the stochastic exponent reduction (:mod:`.exponent_reduction`), which the mpi4py exponent
    allreduce runs between ranks."""

    def _encode_codes(self, be: Any, v: Any, norm: np.float32, keys: Any) -> Any:
        n = int(v.size)
        data = be.xp.empty(self.payload_nbytes(n), np.uint8)
        be.encode(v, data, 0, max(n, 1), MODE_EXP, self.bits, keys, norm_kind=NORM_L2,
                  s=self.s, c=self.c, gnorm=norm)
        return data

    def _decode_codes(self, be: Any, data: Any, size: int, norm: np.float32, n: int, dst: Any,
                      acc: bool) -> None:
        be.decode_codes(data.view(np.uint8), size, self.bits, be.constant(self.table),
                        np.float32(norm / np.float32(n)), dst, acc)

    def _combine_data(self, be: Any, payloads: Sequence[Payload], seed: int) -> Any:
        return reduce_packed([be.array(p.data).view(np.uint8) for p in payloads],
                             payloads[0].size, self.bits, seed, self.reduction)


class GlobalQSGDSparse(GlobalQSGD, head_nbytes=4):
    """Sparse Global-QSGD: only the nonzero codes and their positions travel, gathered and
    decoded one by one (docs/dev/formats.md); the leading uint32 nonzero count decides the
    length."""

    def wire_layout(self, size: int, head: np.ndarray | None = None) -> WireLayout:
        """From the count in ``head``: ``4 + 4 count + packed_nbytes(count, bits)`` (count <=
        size; the positions are checked by the decoder)."""
        cnt = int(np.asarray(head)[:4].view(np.uint32)[0])
        if cnt > size:
            raise ValueError(f"{self.name}: sparse payload counts {cnt} nonzeros for "
                             f"size={size} ({self._detail()})")
        return WireLayout(size, 4 + 4 * cnt + int(packed_nbytes(cnt, self.bits)), True,
                          f"{self._detail()}, {cnt} nonzeros", cnt)

    def _encode_codes(self, be: Any, v: Any, norm: np.float32, keys: Any) -> Any:
        n = int(v.size)
        if n >= 1 << 32:
            raise ValueError(f"sparse payloads index with uint32: split the {n}-element "
                             f"vector below 2^32 elements or use mode='dense'")
        mode = MODE_EXP if self.levels == "exponential" else MODE_LINEAR_SM
        return be.encode_sparse(v, mode, norm, self.s, self.c, self.bits, keys)

    def _decode_codes(self, be: Any, data: Any, size: int, norm: np.float32, n: int, dst: Any,
                      acc: bool) -> None:
        if not acc:
            dst[:] = 0
        if not math.isfinite(norm):  # no nonzero codes were sent; the norm still has to show
            dst += np.float32(np.nan)
            return
        err = be.decode_sparse(data.view(np.uint8), size, self.bits, be.constant(self.table),
                               norm / np.float32(n), dst)
        if err != SPARSE_OK:
            raise ValueError(f"{self.name}: damaged sparse payload: "
                             + ("shorter than its count says" if err == SPARSE_SHORT
                                else f"positions not strictly increasing below size={size}"))
