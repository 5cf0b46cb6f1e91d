"""Codec-level GPU orchestration, written against a kernel backend.

Every function here mirrors one CPU method of a codec (same payload layout, same keys, same
order of floating-point operations) and calls the kernels of ``kernels/*.cu`` through a
*backend*: :class:`horovod_quant.gpu._cupy.CupyBackend` launches them on a GPU; the test suite's
host backend (``tests/kernels``) runs the same block programs compiled for the CPU on NumPy
arrays. So this file is exercised on machines without a GPU too.

Backend interface (arrays are ``be.xp`` arrays; views/slices are passed where a kernel writes
into part of a buffer):

* ``xp``: the array module (cupy or numpy)
* ``encode(x, n, bucket, mode, bits, norm_kind, p, s, c, M, k, am, gnorm, k0, k1, out,
  scales_off, codes_off, fused)``: kernel ``hq_encode``, one block per packing block
* ``scales(x, n, bucket, kind, p, scales)``: kernel ``hq_scales`` (lane-ordered norms)
* ``max_scales(x, n, bucket, kind, scales)``: kernels ``hq_max_bits`` + ``hq_scales_from_bits``
* ``decode_levels(pays, scales_off, codes_off, gscale, n, bucket, bits, table, out, accumulate,
  post)``: kernel ``hq_decode_levels``; ``gscale`` a list of float32 (or None), ``post`` a
  float32 multiplier applied last (or None)
* ``codes(x, n, mode, bits, s, c, gnorm, k0, k1, codes)``, ``pack(codes, n, bits, out)``,
  ``unpack(packed, n, bits, codes)``
* ``decode_dither(pays, scales_off, codes_off, keys, n, bucket, bits, M, out, accumulate, post)``
* ``decode_nested(d, scales_off, codes_off, n, bucket, M, k, bits, am, alpha, y, k0, k1, out)``
  -> ``(sum of squared residuals, count)``
* ``linear_encode(x, n, bits, s, norm, k0, k1, words)``,
  ``linear_decode(words, n, bits, offset, scale, out, accumulate)``
* ``exp_combine(a, b, out, n, first, bits, k0, k1)``
* ``max_abs_bits(x, n) -> int``, ``sum_squares(x, n) -> float``
* ``to_host(a) -> numpy array``
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ..core import base as _base
from ..core import kernels_cpu as K
from ..core.packing import PACK_BLOCK, packed_nbytes
from ..core.payload import Payload
from ..core.rng import derive_key, split_key

# encode modes of kernels/hq_codes.cuh
MODE_UNIFORM, MODE_GEOMETRIC, MODE_EXP, MODE_DITHER, MODE_NESTED, MODE_LINEAR_SM = range(6)


class Unsupported(Exception):
    """This codec / configuration has no kernel path: the dispatcher falls back to the CPU."""


def _keys(seed: int) -> tuple[int, int]:
    k0, k1 = split_key(derive_key(seed))
    return int(k0), int(k1)


class Ops:
    """The GPU implementation of each codec method, on top of a kernel backend ``be``."""

    def __init__(self, be: Any) -> None:
        self.be = be
        self.xp = be.xp
        self._tables: dict[int, Any] = {}

    # -- helpers -----------------------------------------------------------------------------
    def vector(self, x: Any) -> Any:
        """Flat contiguous float32 view/copy of a device array (``as_vector`` of the CPU)."""
        xp = self.xp
        arr = xp.asarray(x)
        if arr.dtype.kind != "f":
            raise TypeError(f"expected a floating-point array, got dtype {arr.dtype}")
        if arr.dtype == xp.float64:  # rounded by our kernel (CuPy's casts flush subnormals)
            src = xp.ascontiguousarray(arr).reshape(-1)
            out = xp.empty(src.size, xp.float32)
            if src.size:
                self.be.to_f32(src, int(src.size), out)
            return out
        return xp.ascontiguousarray(arr, dtype=xp.float32).reshape(-1)  # float16: exact

    def table(self, codec: Any) -> Any:
        """The codec's signed level table on the device (cached per codec object)."""
        key = id(codec)
        hit = self._tables.get(key)
        if hit is None or hit[0] is not codec.table:
            hit = (codec.table, self.xp.asarray(np.ascontiguousarray(codec.table, np.float32)))
            self._tables[key] = hit
        return hit[1]

    def _data(self, payload: Payload) -> Any:
        return self.xp.asarray(payload.data).reshape(-1)

    def _bytes(self, payload: Payload) -> Any:
        return self._data(payload).view(self.xp.uint8)

    def scale_into(self, src: Any, f: float, dst: Any) -> Any:
        """``dst = src * float32(f)`` elementwise (IEEE, in our kernel: CuPy's own elementwise
        kernels are compiled with flush-to-zero)."""
        if src.size:
            self.be.scale(src, int(src.size), np.float32(f), dst)
        return dst

    def _out(self, n: int, out: Any | None, zero: bool = False) -> Any:
        if out is None:
            return self.xp.zeros(n, self.xp.float32) if zero else self.xp.empty(n, self.xp.float32)
        if out.dtype != self.xp.float32 or out.size != n:
            raise ValueError(f"out must be a float32 array of {n} elements, got {out.dtype} "
                             f"of {out.size}")
        return out

    def bucket_scales(self, v: Any, n: int, bucket: int, kind: int, p: float, scales: Any) -> None:
        """Scales of every bucket into ``scales`` when buckets straddle packing blocks."""
        if n == 0:
            return
        if kind in (K.NORM_MAX, K.NORM_POW2):
            self.be.max_scales(v, n, bucket, kind, scales)
        else:
            self.be.scales(v, n, bucket, kind, p, scales)

    def encode_packed(self, v: Any, n: int, bucket: int, mode: int, bits: int, kind: int,
                      p: float, out: Any, scales_off: int, s: int = 0, c: int = 0, M: int = 0,
                      k: int = 0, am: float = 0.0, gnorm: float = 0.0, keys=(0, 0)) -> None:
        """Launch the fused encoder; buckets that straddle packing blocks get their scales from
        a separate pass first (bucket sizes dividing PACK_BLOCK are one pass)."""
        if n == 0:
            return
        nb = -(-n // bucket)
        has_scales = mode in (MODE_UNIFORM, MODE_GEOMETRIC, MODE_DITHER, MODE_NESTED)
        codes_off = scales_off + (4 * nb if has_scales else 0)
        fused = PACK_BLOCK % bucket == 0
        if has_scales and not fused:
            scales = out[scales_off: scales_off + 4 * nb].view(self.xp.float32)
            skind = K.NORM_MAX if mode in (MODE_DITHER, MODE_NESTED) else kind
            self.bucket_scales(v, n, bucket, skind, p, scales)
        self.be.encode(v, n, bucket, mode, bits, kind, p, s, c, M, k, am, gnorm, keys[0],
                       keys[1], out, scales_off, codes_off, fused)

    # -- level quantizers (core/quantizers.py) -------------------------------------------------
    def levels_encode(self, codec: Any, x: Any, seed: int = 0) -> Payload:
        if getattr(codec, "elias", False):
            raise Unsupported("Elias-coded QSGD runs on the CPU")
        v = self.vector(x)
        n = int(v.size)
        bucket = codec._bucket(n)
        out = self.xp.empty(codec.payload_nbytes(n), self.xp.uint8)
        mode = MODE_UNIFORM if codec.grid == K.GRID_UNIFORM else MODE_GEOMETRIC
        self.encode_packed(v, n, bucket, mode, codec.bits, codec.norm_kind, float(codec.p), out,
                           0, s=codec.s, keys=_keys(seed))
        return Payload(out, n)

    def levels_decode_many(self, codec: Any, payloads: Sequence[Payload], out: Any,
                           accumulate: bool, post: float | None = None) -> Any:
        """``out (+)= sum of decode(p)`` in payload order, then ``out *= post``: one pass."""
        if getattr(codec, "elias", False):
            raise Unsupported("Elias-coded QSGD runs on the CPU")
        n = codec.check_payloads(payloads, out)[0].size
        bucket = codec._bucket(n)
        nb = -(-n // bucket)
        if n:
            pays = [self._bytes(p) for p in payloads]
            self.be.decode_levels(pays, 0, 4 * nb, None, n, bucket, codec.bits, self.table(codec),
                                  out, accumulate, post)
        return out

    def levels_decode(self, codec: Any, payload: Payload, out: Any | None = None) -> Any:
        codec.check_payload(payload, out)  # before anything is allocated or launched
        out = self._out(payload.size, out)
        return self.levels_decode_many(codec, [payload], out, False)

    def levels_decode_add(self, codec: Any, payload: Payload, out: Any) -> Any:
        codec.check_payload(payload, out)
        return self.levels_decode_many(codec, [payload], self._out(payload.size, out), True)

    def gather_combine(self, codec: Any, payloads: Sequence[Payload], seed: int) -> Any:
        """``Codec.combine_gathered`` of the level quantizers: zeros, decode_add in rank order,
        times float32(1 / n), all in one kernel pass."""
        est = self.xp.zeros(codec.check_payloads(payloads)[0].size, self.xp.float32)
        post = np.float32(1.0 / len(payloads))
        return self.levels_decode_many(codec, payloads, est, True, post)

    # -- baselines (core/baselines.py) ---------------------------------------------------------
    def baseline_encode(self, codec: Any, x: Any, seed: int = 0) -> Payload:
        xp = self.xp
        v = self.vector(x)
        if codec.name == "none":
            return Payload(v.copy(), int(v.size))
        if codec.name == "fp16":
            return Payload(v.astype(xp.float16), int(v.size))
        if codec.name == "bf16":
            b = v.view(xp.uint32)
            rounded = (b + (xp.uint32(0x7FFF) + ((b >> xp.uint32(16)) & xp.uint32(1)))) >> xp.uint32(16)
            bits = xp.where(xp.isnan(v), (b >> xp.uint32(16)) | xp.uint32(0x40), rounded)
            return Payload(bits.astype(xp.uint16).view(xp.uint8), int(v.size))
        raise Unsupported(codec.name)

    def baseline_decode(self, codec: Any, payload: Payload, out: Any | None = None) -> Any:
        xp = self.xp
        codec.check_payload(payload, out)
        data = xp.asarray(payload.data).reshape(-1)
        if codec.name == "bf16":
            vals = (data.view(xp.uint16).astype(xp.uint32) << xp.uint32(16)).view(xp.float32)
        elif codec.name in ("none", "fp16"):
            vals = data.view(codec.wire_dtype).astype(xp.float32, copy=True)
        else:
            raise Unsupported(codec.name)
        if out is None:
            return vals
        out[:] = vals
        return out

    # -- Global-QSGD (core/global_qsgd.py) -----------------------------------------------------
    def gq_norm_statistic(self, codec: Any, x: Any) -> float:
        v = self.vector(x)
        n = int(v.size)
        if codec.norm == "max":
            bits = self.be.max_abs_bits(v, n) if n else 0
            if bits >= 0x7F800000:
                return math.nan
            return float(np.array([bits], np.int32).view(np.float32)[0])
        return float(self.be.sum_squares(v, n)) if n else 0.0

    def gq_encode(self, codec: Any, x: Any, seed: int = 0, norm: float | None = None) -> Payload:
        xp = self.xp
        v = self.vector(x)
        n = int(v.size)
        if norm is None:
            g = codec.norm_from_statistic(self.gq_norm_statistic(codec, v))
        else:
            g = np.float32(norm)
            if g < 0:
                raise ValueError(f"norm={norm} must be >= 0: pass the global norm "
                                 f"(norm_from_statistic of the combined statistics)")
        keys = _keys(seed)
        exp = codec.levels == "exponential"
        if codec.mode == "sparse":
            if n >= 1 << 32:
                raise ValueError(f"sparse payloads index with uint32: split the {n}-element "
                                 f"vector below 2^32 elements or use mode='dense'")
            codes = xp.empty(n, xp.uint8)
            if n:
                self.be.codes(v, n, MODE_EXP if exp else MODE_LINEAR_SM, codec.bits, codec.s,
                              codec.c, float(g), keys[0], keys[1], codes)
            pos = xp.flatnonzero(codes)
            cnt = int(pos.size)
            data = xp.empty(4 + 4 * cnt + int(packed_nbytes(cnt, codec.bits)), xp.uint8)
            data[:4] = xp.asarray(np.array([cnt], np.uint32).view(np.uint8))
            if cnt:
                data[4: 4 + 4 * cnt] = pos.astype(xp.uint32).view(xp.uint8)
                nz = xp.ascontiguousarray(codes[pos])
                self.be.pack(nz, cnt, codec.bits, data[4 + 4 * cnt:])
        elif exp:
            data = xp.empty(codec.payload_nbytes(n), xp.uint8)
            self.encode_packed(v, n, max(n, 1), MODE_EXP, codec.bits, 0, 2.0, data, 0,
                               s=codec.s, c=codec.c, gnorm=float(g), keys=keys)
        else:
            data = xp.empty(codec.payload_nbytes(n) // 8, xp.uint64)
            if data.size:
                self.be.linear_encode(v, n, codec.bits, codec.s, float(g), keys[0], keys[1], data)
        return Payload(data, n, {"norm": g})

    def gq_decode_n(self, codec: Any, payload: Payload, n: int, out: Any | None, acc: bool) -> Any:
        from ..core.global_qsgd import sparse_positions_error

        xp = self.xp
        lay = codec.check_payload(payload, out)
        size = lay.size
        norm = codec._norm_of(payload)
        out = self._out(size, out, zero=acc)
        if codec.mode == "sparse":
            data = self._bytes(payload)
            cnt = lay.head
            if math.isfinite(norm) and sparse_positions_error(
                    data[4: 4 + 4 * cnt].view(xp.uint32), size):
                raise ValueError(f"{codec.name}: damaged sparse payload: positions not "
                                 f"strictly increasing below size={size}")
            if not acc:
                out[:] = 0
            if math.isfinite(norm):
                if cnt:
                    self.be.decode_sparse(xp.ascontiguousarray(data), cnt, codec.bits,
                                          self.table(codec), np.float32(norm / np.float32(n)),
                                          out)
            else:
                out += np.float32(np.nan)
        elif codec.levels == "linear":
            scale = np.float32(np.float64(norm) / (codec.s * n))
            if size:
                words = self._data(payload).view(xp.uint64)
                self.be.linear_decode(words, size, codec.bits, n * codec.s, float(scale), out, acc)
        else:
            if size:
                self.be.decode_levels([self._bytes(payload)], -1, 0,
                                      [np.float32(norm / np.float32(n))], size, 1, codec.bits,
                                      self.table(codec), out, acc, None)
        return out

    def gq_decode(self, codec: Any, payload: Payload, out: Any | None = None) -> Any:
        return self.gq_decode_n(codec, payload, 1, out, False)

    def gq_decode_add(self, codec: Any, payload: Payload, out: Any) -> Any:
        return self.gq_decode_n(codec, payload, 1, out, True)

    def gq_decode_sum(self, codec: Any, payload: Payload, n: int, out: Any | None = None) -> Any:
        if codec.mode == "sparse":
            raise ValueError("sparse payloads are gathered, not summed: decode_add each one")
        n = _base.check_int(f"{codec.name}: n", n, 1, codec.world_size,
                            hint=f"the codec was built for world_size={codec.world_size}.")
        return self.gq_decode_n(codec, payload, n, out, False)

    def exp_combine(self, a: Any, b: Any, out: Any, n_elements: int, first_element_index: int,
                    bits: int, k0: int, k1: int) -> int:
        """:func:`horovod_quant.core.exp_reduce.exp_combine` on device buffers."""
        if first_element_index % PACK_BLOCK != 0:
            raise ValueError("first_element_index must be a multiple of PACK_BLOCK")
        nbytes = int(packed_nbytes(n_elements, bits))
        if a.size < nbytes or b.size < nbytes or out.size < nbytes:
            raise ValueError("packed buffers are shorter than packed_nbytes(n_elements, bits)")
        if n_elements:
            self.be.exp_combine(a, b, out, int(n_elements), int(first_element_index), int(bits),
                                int(k0), int(k1))
        return nbytes

    def reduce_packed(self, buffers: Sequence[Any], size: int, bits: int, seed: int,
                      reduction: str) -> Any:
        """:func:`horovod_quant.core.exp_reduce.reduce_packed` on device buffers."""
        from ..core.exp_reduce import reduce_packed

        return reduce_packed(buffers, size, bits, seed, reduction, xp=self.xp,
                             combine=self.exp_combine)

    def gq_reduce(self, codec: Any, payloads: Sequence[Payload], seed: int) -> Payload:
        xp = self.xp
        if codec.mode == "sparse":
            raise ValueError("sparse payloads are gathered, not reduced: decode_add each one")
        n = len(payloads)
        _base.check_int(f"{codec.name}: number of payloads", n, 1, codec.world_size,
                        hint=f"the codec was built for world_size={codec.world_size}.")
        codec.check_payloads(payloads)
        first = payloads[0]
        if codec.levels == "linear":
            total = self._data(first).view(xp.uint64).copy()
            for p in payloads[1:]:
                total += self._data(p).view(xp.uint64)
        else:
            total = self.reduce_packed([self._bytes(p) for p in payloads], first.size,
                                       codec.bits, seed, codec.reduction)
        return Payload(total, first.size, dict(first.meta))

    def gq_combine_gathered(self, codec: Any, payloads: Sequence[Payload], seed: int) -> Any:
        if codec.mode == "sparse":
            est = self.xp.zeros(codec.check_payloads(payloads)[0].size, self.xp.float32)
            for p in payloads:
                self.gq_decode_add(codec, p, est)
            return self.scale_into(est, 1.0 / len(payloads), est)
        return self.gq_decode_sum(codec, self.gq_reduce(codec, payloads, seed), len(payloads))

    # -- DQSG / NDQSG (core/dithered.py) -------------------------------------------------------
    def dq_encode(self, codec: Any, x: Any, seed: int = 0) -> Payload:
        v = self.vector(x)
        n = int(v.size)
        out = self.xp.empty(codec.payload_nbytes(n), self.xp.uint8)
        self.encode_packed(v, n, codec._bucket(n), MODE_DITHER, codec.bits, K.NORM_MAX, 0.0, out,
                           0, M=codec.M, k=0, am=float(np.float32(codec.M)), keys=_keys(seed))
        return Payload(out, n, {"seed": int(seed)})

    def _dither_many(self, codec: Any, payloads: Sequence[Payload], seeds: Sequence[int],
                     header: int, out: Any, accumulate: bool, post: float | None = None) -> Any:
        n = codec.check_payloads(payloads, out)[0].size
        if n:
            bucket = codec._bucket(n)
            nb = -(-n // bucket)
            keys = [k for s in seeds for k in _keys(int(s))]
            self.be.decode_dither([self._bytes(p) for p in payloads], header, header + 4 * nb,
                                  keys, n, bucket, codec.bits, codec.M, out, accumulate, post)
        return out

    def dq_decode(self, codec: Any, payload: Payload, out: Any | None = None) -> Any:
        from ..core.dithered import _seed_of

        codec.check_payload(payload, out)  # before anything is allocated or launched
        if codec.name == "nested_dithered":
            return self.nd_decode_p1(codec, payload, self._out(payload.size, out), False)
        return self._dither_many(codec, [payload], [_seed_of(payload)], 0,
                                 self._out(payload.size, out), False)

    def dq_decode_add(self, codec: Any, payload: Payload, out: Any) -> Any:
        from ..core.dithered import _seed_of

        codec.check_payload(payload, out)
        if codec.name == "nested_dithered":
            return self.nd_decode_p1(codec, payload, self._out(payload.size, out), True)
        return self._dither_many(codec, [payload], [_seed_of(payload)], 0,
                                 self._out(payload.size, out), True)

    def dq_combine_gathered(self, codec: Any, payloads: Sequence[Payload], seed: int) -> Any:
        from ..core.dithered import _seed_of

        est = self.xp.zeros(codec.check_payloads(payloads)[0].size, self.xp.float32)
        return self._dither_many(codec, payloads, [_seed_of(p) for p in payloads], 0, est, True,
                                 np.float32(1.0 / len(payloads)))

    def payload_k(self, payload: Payload) -> int:
        from ..core.dithered import HEADER

        data = self._bytes(payload)
        if data.size < HEADER:
            raise ValueError(f"an NDQSG payload starts with a {HEADER}-byte header; got "
                             f"{data.size} bytes")
        return int(self.be.to_host(data[:HEADER]).view(np.int32)[0])

    def nd_encode(self, codec: Any, x: Any, seed: int = 0, rank: int = 0) -> Payload:
        from ..core.dithered import HEADER, coarse_bits

        v = self.vector(x)
        n = int(v.size)
        k = 0 if codec.in_p1(rank) else codec.current_k
        bits = codec.bits if k == 0 else coarse_bits(k)
        am = np.float32(codec.M) if k == 0 else np.float32(codec.alpha * codec.M)
        out = self.xp.empty(codec.payload_nbytes(n, rank), self.xp.uint8)
        out[:HEADER] = self.xp.asarray(np.array([k], np.int32).view(np.uint8))
        self.encode_packed(v, n, codec._bucket(n), MODE_DITHER if k == 0 else MODE_NESTED, bits,
                           K.NORM_MAX, 0.0, out, HEADER, M=codec.M, k=k, am=float(am),
                           keys=_keys(seed))
        return Payload(out, n, {"seed": int(seed)})

    def nd_decode_p1(self, codec: Any, payload: Payload, out: Any, accumulate: bool,
                     seed: int | None = None) -> Any:
        from ..core.dithered import HEADER, _seed_of

        k = codec.check_payload(payload, out).head
        if k != 0:
            raise ValueError(f"{codec.name}: this is a P2 payload (coarse ratio {k}): it "
                             f"decodes only with the P1 mean as side information; use "
                             f"decode_side_info")
        seed = _seed_of(payload) if seed is None else seed
        return self._dither_many(codec, [payload], [seed], HEADER, out, accumulate)

    def nd_decode_side_info(self, codec: Any, payloads_by_rank: Sequence[Payload],
                            seeds_by_rank: Sequence[int], inputs: Sequence[Any] | None = None
                            ) -> Any:
        """``NestedDitheredQuantizer.decode_side_info`` with the decodes on the device."""
        from ..core.dithered import HEADER, coarse_bits, fine_indices, nested_outside

        xp = self.xp
        n = len(payloads_by_rank)
        if n != codec.world_size or len(seeds_by_rank) != n:
            raise ValueError(f"{codec.name}: got {n} payloads and {len(seeds_by_rank)} seeds "
                             f"for a codec built with world_size={codec.world_size}: pass one "
                             f"of each per rank, in rank order")
        ks_all = codec.check_group_headers(payloads_by_rank)
        size = payloads_by_rank[0].size
        if inputs is not None:
            codec.check_inputs(inputs, size)
        est = xp.zeros(size, xp.float32)
        self._dither_many(codec, list(payloads_by_rank[: codec.n1]),
                          [int(s) for s in seeds_by_rank[: codec.n1]], HEADER, est, True)
        y = self.scale_into(est, 1.0 / codec.n1, xp.empty_like(est))
        bucket = codec._bucket(size)
        nb = -(-size // bucket)
        am = np.float32(codec.alpha * codec.M)
        sum_r2, count, wrong, ks = 0.0, 0, 0, []
        for r in range(codec.n1, n):
            p = payloads_by_rank[r]
            k = ks_all[r]
            ks.append(k)
            data = self._bytes(p)
            k0, k1 = _keys(int(seeds_by_rank[r]))
            s2, c = (0.0, 0)
            if size:
                s2, c = self.be.decode_nested(data, HEADER, HEADER + 4 * nb, size, bucket, codec.M,
                                              k, coarse_bits(k), float(am),
                                              float(np.float32(codec.alpha)), y, k0, k1, est)
            sum_r2 += s2
            count += c
            if inputs is not None and inputs[r] is not None:
                hx = _base.as_vector(self.be.to_host(self.vector(inputs[r])))
                hk0, hk1 = np.uint32(k0), np.uint32(k1)
                fine = fine_indices(hx, bucket, am, hk0, hk1)
                wrong += nested_outside(self.be.to_host(data), HEADER, size, bucket, codec.M, k,
                                        coarse_bits(k), am, self.be.to_host(y), hk0, hk1, fine)
        self.scale_into(est, 1.0 / n, est)
        codec._update_state(sum_r2, count, wrong, ks, codec._all_p2_known(inputs))
        return est
