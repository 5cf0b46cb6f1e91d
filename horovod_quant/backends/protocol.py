"""The kernel interface every backend implements (:class:`Backend`), the parameters codecs
pass to it (encode modes, norm kinds, status codes), the wire layout every backend writes
(:data:`PACK_BLOCK`, :func:`packed_nbytes`) and :class:`MissingKernel`.

Backends import this module, never the package :mod:`horovod_quant.backends` (which picks a
backend and imports them).
"""
from __future__ import annotations

import abc
from typing import Any, Sequence

import numpy as np

#: Encode modes of ``Backend.encode`` (``kernels/hq_codes.cuh``): uniform levels j/s,
#: binary-geometric levels 0, 2^(1-s), ..., 1, Global-QSGD exponent codes, DQSG codes, NDQSG
#: nested codes.
MODE_UNIFORM, MODE_GEOMETRIC, MODE_EXP, MODE_DITHER, MODE_NESTED = 0, 1, 2, 3, 4
#: ``Backend.encode_sparse``'s code kind for linear (sign-magnitude j/s) codes (the kernels'
#: ``MODE_LINEAR_SM``)
MODE_LINEAR_SM = 5
#: Modes whose payload starts with one float32 scale per bucket.
SCALED_MODES = (MODE_UNIFORM, MODE_GEOMETRIC, MODE_DITHER, MODE_NESTED)
#: Bucket scales: L2 norm, max norm, p-norm, smallest power of two >= max|x|.
NORM_L2, NORM_MAX, NORM_P, NORM_POW2 = 0, 1, 2, 3
#: Status of ``Backend.decode_sparse``.
SPARSE_OK, SPARSE_SHORT, SPARSE_BAD_POSITIONS = 0, -1, -2
#: Status of ``Backend.elias_decode`` (:func:`elias_error` says what each means).
ELIAS_OK, ELIAS_PAST_END, ELIAS_BAD_LEVEL, ELIAS_NO_TERMINATOR, ELIAS_TRAILING = 0, 1, 2, 3, 4
_ELIAS_ERRORS = {
    ELIAS_PAST_END: "a position past the end of the vector",
    ELIAS_BAD_LEVEL: "a level past the code width",
    ELIAS_NO_TERMINATOR: "the stream ends without its terminator",
    ELIAS_TRAILING: "bytes after the terminator",
}

# -- wire layout of packed codes (docs/dev/formats.md, "Packed codes") ---------------------------
#: Elements per packing block. Part of the wire format: changing it changes payload bytes.
PACK_BLOCK = 8192


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes taken by ``n`` codes of ``bits`` bits (1..8), packed block by block: a block of m
    codes stores each binary digit group of ``bits`` (widths 1, 2, 4; or one 8-bit field) in a
    plane of ``ceil(m * width / 8)`` bytes. Plain Python that the numba backend also compiles
    (its kernels size buffers with it), so both backends and the codecs count alike."""
    full = n // PACK_BLOCK
    m = n - full * PACK_BLOCK
    if bits == 8:
        tail = m
    else:
        tail = 0
        for width in (1, 2, 4):
            if bits & width:
                tail += (m * width + 7) // 8
    return full * (PACK_BLOCK * bits // 8) + tail


def elias_error(code: int) -> str:
    """What a nonzero ``Backend.elias_decode`` status means."""
    return _ELIAS_ERRORS.get(int(code), f"status {code}")

Keys = tuple  # (k0, k1): the uint32 halves of an element key (rng.split_key)


class MissingKernel(NotImplementedError):
    """The backend of the arrays has no kernel for this entry point (e.g. Elias coding on a GPU).
    The message says what to change; nothing is copied to the host behind the caller's back."""


class Backend(abc.ABC):
    """The kernel entry points the codecs need, on the arrays of one kind of device.

    Arrays are ``xp`` arrays (flat, C-contiguous); ``keys`` are ``(k0, k1)`` pairs of
    ``rng.split_key``; ``out`` arguments are written in place. Every entry point reproduces the
    float32 operations and their order of the documented formats (docs/dev/formats.md), so
    backends agree bit for bit.
    """

    #: short name for messages ("numba", "CUDA")
    name: str = ""
    #: the array module (numpy or cupy)
    xp: Any = np

    # -- arrays ------------------------------------------------------------------------------
    @abc.abstractmethod
    def vector(self, x: Any) -> Any:
        """A flat contiguous float32 view of ``x`` (a copy only when dtype or layout need one;
        float64 is rounded to nearest, float16/bfloat16 widened exactly). Raises TypeError for
        non-float input."""

    @abc.abstractmethod
    def array(self, a: Any) -> Any:
        """``a`` (payload data, an ``out`` buffer; a CUDA torch tensor is viewed zero-copy) as a
        flat array of this backend, same dtype."""

    def constant(self, host: np.ndarray) -> Any:
        """This backend's copy of a small host constant (a level table), cached per array."""
        return host

    def to_host(self, a: Any) -> np.ndarray:
        """A NumPy copy (or the array itself on the host)."""
        return np.asarray(a)

    def scale(self, src: Any, f: float, dst: Any) -> Any:
        """``dst = src * float32(f)`` elementwise (IEEE, subnormals kept); returns ``dst``."""
        return self.xp.multiply(src, np.float32(f), out=dst)

    # -- levels.cu ---------------------------------------------------------------------------
    @abc.abstractmethod
    def encode(self, x: Any, out: Any, offset: int, bucket: int, mode: int, bits: int,
               keys: Keys, *, norm_kind: int = NORM_MAX, p: float = 2.0, s: int = 0,
               c: int = 0, M: int = 0, k: int = 0, am: float = 0.0, gnorm: float = 0.0) -> None:
        """Encode float32 ``x`` into ``out[offset:]``: ``[float32 scale per bucket][packed
        codes]`` (:data:`SCALED_MODES`) or the packed codes alone (:data:`MODE_EXP`).

        Args:
            x: float32 vector of n elements.
            out: uint8 payload buffer.
            offset: where the scales start (4-byte aligned).
            bucket: elements per bucket (scaled modes; n for one bucket).
            mode: one of the ``MODE_*`` constants; an unknown mode raises ValueError.
            bits: code width, 2..8.
            keys: element key halves.
            norm_kind: ``NORM_*`` of the bucket scale (levels; DQSG/NDQSG use ``NORM_MAX``).
            p: the p of ``NORM_P``.
            s: levels (uniform / geometric grids; Global-QSGD: levels s).
            c: Global-QSGD exponent offset.
            M, k, am: DQSG/NDQSG fine levels, coarse ratio (0 for DQSG) and ``alpha * M``.
            gnorm: Global-QSGD global norm (float32).
        """

    @abc.abstractmethod
    def decode_levels(self, data: Any, n: int, bucket: int, bits: int, table: Any, out: Any,
                      accumulate: bool) -> None:
        """``out[i] (+)= table[code_i] * scale_of_bucket(i)`` for a ``[float32 scale per
        bucket][packed codes]`` payload ``data`` (uint8) of n elements."""

    @abc.abstractmethod
    def combine_levels(self, datas: Sequence[Any], n: int, bucket: int, bits: int, table: Any,
                       inv_count: float, out: Any) -> None:
        """``out = (0 + decode(datas[0]) + decode(datas[1]) + ...) * inv_count`` in float32,
        payloads added in the given (rank) order: a gather exchange's mean in one pass."""

    @abc.abstractmethod
    def decode_codes(self, data: Any, n: int, bits: int, table: Any, scale: float, out: Any,
                     accumulate: bool) -> None:
        """``out[i] (+)= table[code_i] * scale`` for n packed codes (one scale for all)."""

    # -- global_qsgd.cu ----------------------------------------------------------------------
    @abc.abstractmethod
    def max_abs(self, x: Any) -> float:
        """max |x| as a float (float32 value), NaN when x holds a NaN or an infinity."""

    @abc.abstractmethod
    def sum_squares(self, x: Any) -> float:
        """sum x^2 in float64, in 8 interleaved lanes (element i feeds lane i % 8) added in lane
        order."""

    @abc.abstractmethod
    def linear_encode(self, x: Any, bits: int, s: int, norm: float, keys: Keys,
                      words: Any) -> None:
        """Global-QSGD linear levels of x as offset fields in the uint64 ``words``."""

    @abc.abstractmethod
    def linear_decode(self, words: Any, n: int, bits: int, offset: int, scale: float, out: Any,
                      accumulate: bool) -> None:
        """``out[i] (+)= (field_i - offset) * scale`` for the n fields of ``words``."""

    @abc.abstractmethod
    def encode_sparse(self, x: Any, mode: int, norm: float, s: int, c: int, bits: int,
                      keys: Keys) -> Any:
        """Sparse payload ``[uint32 count][count uint32 positions][packed nonzero codes]`` of
        ``MODE_EXP`` or ``MODE_LINEAR_SM`` codes, as a new uint8 array of exactly its size."""

    @abc.abstractmethod
    def decode_sparse(self, data: Any, n: int, bits: int, table: Any, scale: float,
                      out: Any) -> int:
        """``out[pos] += table[code] * scale`` for every entry of a sparse payload of an
        n-element vector, after checking that the positions increase strictly below n.
        Returns ``SPARSE_OK``, or ``SPARSE_SHORT`` / ``SPARSE_BAD_POSITIONS`` with ``out``
        untouched."""

    @abc.abstractmethod
    def exp_combine(self, a: Any, b: Any, out: Any, n_elements: int, first_element_index: int,
                    bits: int, k0: int, k1: int) -> int:
        """Algorithm 2 on two packed exponent-code ranges into ``out`` (may alias ``a`` or
        ``b``); see :func:`horovod_quant.backends.numba.global_qsgd.exp_combine`. Returns the
        bytes written."""

    # -- dithered.cu -------------------------------------------------------------------------
    @abc.abstractmethod
    def decode_dither(self, datas: Sequence[Any], keys: Sequence[Keys], offset: int, n: int,
                      bucket: int, bits: int, M: int, out: Any, accumulate: bool,
                      post: float | None = None) -> None:
        """DQSG decode of the payloads ``datas`` (scales at ``offset``), each with its sender's
        keys, summed into ``out`` in order (the first assigns unless ``accumulate``), then
        ``out *= post`` when given."""

    @abc.abstractmethod
    def decode_nested(self, data: Any, offset: int, n: int, bucket: int, M: int, k: int,
                      bits: int, am: float, alpha: float, y: Any, keys: Keys,
                      out: Any) -> tuple[float, int]:
        """``out += x_hat`` of an NDQSG P2 payload with side information ``y`` (eq. (7));
        returns (float64 sum of squared residuals in fine steps, their count)."""

    # -- reduce.cu ---------------------------------------------------------------------------
    @abc.abstractmethod
    def mean_in_order(self, parts: Sequence[Any], count: int, out: Any) -> Any:
        """``out = (((parts[0] + parts[1]) + ...) + parts[-1]) / float32(count)`` elementwise in
        float32: the parts added in the order given, each addition and the one division (not
        a multiplication by 1/count) rounded to nearest, subnormals kept (NumPy's ``+=`` and
        ``/=`` on the host); zeros when ``parts`` is empty. Returns ``out``.

        Args:
            parts: float32 vectors of ``out.size`` elements (a hierarchical exchange's shards
                from the ranks of a host, in local rank order).
            count: the divisor (the host's rank count).
            out: float32 buffer, written in place (may not alias a part but the first).
        """

    # -- kernels only some backends have -----------------------------------------------------
    def require(self, entry: str) -> None:
        """Raise :class:`MissingKernel` now, before any work, when this backend lacks the
        optional entry point ``entry`` (one of :data:`OPTIONAL_ENTRIES`)."""
        if getattr(type(self), entry) is getattr(Backend, entry):
            what, instead = OPTIONAL_ENTRIES[entry]
            raise MissingKernel(f"no {self.name} kernel for {what}; {instead}")

    def elias_encode_levels(self, fixed: Any, n: int, bucket: int, bits: int) -> Any:
        """The Elias form (QSGD Section 3.2) of a fixed-width levels payload."""
        self.require("elias_encode_levels")

    def elias_decode(self, data: Any, n: int, bucket: int, bits: int, table: Any, out: Any,
                     accumulate: bool) -> int:
        """Decode an Elias-coded levels payload; returns ``ELIAS_OK`` or the ``ELIAS_*`` status
        of the first violation (:func:`elias_error`)."""
        self.require("elias_decode")

    def count_outside(self, x: Any, data: Any, offset: int, n: int, bucket: int, M: int, k: int,
                      bits: int, am: float, y: Any, keys: Keys) -> int:
        """NDQSG P2 elements of a payload ``data`` whose recovered fine index differs from the
        one the sender computed from its input ``x`` (host arrays): the exact outage count a
        simulation or a sender can take. A statistic, never on the decode path."""
        self.require("count_outside")


#: Entry points a backend may lack: what the error names, and what the caller can do instead.
OPTIONAL_ENTRIES = {
    **{entry: ("Elias coding (qsgd elias=True)",
               "encode and decode on the host (NumPy arrays) or use elias=False")
       for entry in ("elias_encode_levels", "elias_decode")},
    "count_outside": ("the NDQSG outage count", "count on the host (NumPy arrays)"),
}


def is_device_array(obj: Any) -> bool:
    """A CuPy array or a CUDA torch tensor (checked by type name, importing neither)."""
    mod = type(obj).__module__
    if mod.startswith("cupy"):
        return True
    return mod.startswith("torch") and bool(getattr(obj, "is_cuda", False))
