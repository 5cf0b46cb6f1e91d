// hq_codes.cuh: per-element code functions and the packed-block encode/decode programs of every
// codec whose payload is [optional header][float32 scale per bucket][packed b-bit codes]
// (level quantizers, Global-QSGD exponential / sparse codes, DQSG / NDQSG).
//
// Mirrors, bit for bit:
//   backends/numba/levels.py _round_uniform, _round_geometric, encode_levels, decode_levels
//   backends/numba/global_qsgd.py _linear_level, _exp_code, _codes_block, encode_exp, decode_packed
//   backends/numba/dithered.py _fine_index, _nested_index, encode_dithered, decode_dithered,
//                         decode_nested
// Element i always draws hash32(i, k0, k1) (global element index), which is what the CPU's
// per-block block_key + 32-bit counters compute.
#ifndef HQ_CODES_CUH
#define HQ_CODES_CUH

#include "hq_common.cuh"

// encode modes
#define HQ_MODE_UNIFORM 0     // qsgd, standard_dithering
#define HQ_MODE_GEOMETRIC 1   // nuqsgd, natural_dithering, natural
#define HQ_MODE_EXP 2         // global_qsgd exponential (global norm, no scales)
#define HQ_MODE_DITHER 3      // DQSG / NDQSG P1: code q + M
#define HQ_MODE_NESTED 4      // NDQSG P2: code (q + h) mod k
#define HQ_MODE_LINEAR_SM 5   // global_qsgd linear levels as sign-magnitude codes (sparse)

// backends/numba/levels.py _TINY_SCALE / _TINY_BOOST
#define HQ_TINY_SCALE 7.888609052210118e-31f  // 2^-100
#define HQ_TINY_BOOST 18446744073709551616.0f // 2^64

// Runtime parameters of an encode. The mode and the bit width are template parameters of the
// programs below (and the scale kind of the warp-tile program), so the per-element code is a
// straight-line function of the element.
struct HqEnc {
  int norm_kind;   // scale kind of the bucketed modes (generic program)
  double p;
  int s;           // levels (uniform / geometric / exp / linear)
  int c;           // exponent offset (exp)
  int M;           // dithered fine levels
  int k;           // nested coarse ratio (0 for DQSG)
  float am;        // dithered alpha * M
  float gnorm;     // global norm (exp / linear)
  hq_u32 k0, k1;
};

HQ_HD HqEnc hq_enc(int norm_kind, double p, int s, int c, int M, int k, float am, float gnorm,
                   hq_u32 k0, hq_u32 k1) {
  HqEnc e;
  e.norm_kind = norm_kind;
  e.p = p;
  e.s = s;
  e.c = c;
  e.M = M;
  e.k = k;
  e.am = am;
  e.gnorm = gnorm;
  e.k0 = k0;
  e.k1 = k1;
  return e;
}

template <int MODE>
HQ_HDT constexpr bool hq_has_scales() {
  return MODE == HQ_MODE_UNIFORM || MODE == HQ_MODE_GEOMETRIC || MODE == HQ_MODE_DITHER ||
         MODE == HQ_MODE_NESTED;
}

// The scale kind of a mode's buckets: DQSG / NDQSG always scale by max |x|.
template <int MODE>
HQ_HD int hq_scale_kind(const HqEnc& e) {
  return (MODE == HQ_MODE_DITHER || MODE == HQ_MODE_NESTED) ? HQ_NORM_MAX : e.norm_kind;
}

// Per-bucket (or global) values hoisted out of the element loop.
struct HqBucket {
  bool ok;         // scale > 0 and finite
  float vmul;      // levels: 2^64 for a tiny scale (round x * 2^64 against scale * 2^64), else
                   // 1 (exact either way, and one multiply instead of a branch per element)
  float a;         // uniform: s / scale; geometric: 1 / scale; exp: 1 / (norm boostf);
                   // linear: s / (norm boostf); dither: kappa
  float boostf;    // exp / linear: 2^64 for norms below 2^-100, else 1 (global_qsgd._boost)
  float low_mult;  // geometric / exp: 2^(s-1)
  hq_i32 i0, i1, i2;  // mode-dependent integer constants
  float invk;      // nested: 1 / k
};

template <int MODE>
HQ_HD HqBucket hq_bucket_params(const HqEnc& e, float sc) {
  HqBucket b;
  b.vmul = 1.0f;
  b.boostf = 1.0f;
  b.a = 0.0f;
  b.low_mult = 0.0f;
  b.i0 = b.i1 = b.i2 = 0;
  b.invk = 0.0f;
  if (MODE == HQ_MODE_EXP || MODE == HQ_MODE_LINEAR_SM) sc = e.gnorm;
  b.ok = sc > 0.0f && hq_isfinite(sc);
  if (MODE == HQ_MODE_UNIFORM || MODE == HQ_MODE_GEOMETRIC) {
    if (b.ok) {
      if (sc < HQ_TINY_SCALE) {
        b.vmul = HQ_TINY_BOOST;
        sc = hq_fmul(sc, HQ_TINY_BOOST);
      }
      if (MODE == HQ_MODE_UNIFORM) {
        b.a = hq_fdiv((float)e.s, sc);
      } else {
        b.a = hq_fdiv(1.0f, sc);
        b.low_mult = hq_pow2f(e.s - 1);
        b.i0 = e.s - 127;  // top_shift
      }
    }
  } else if (MODE == HQ_MODE_EXP) {
    b.boostf = sc < HQ_TINY_SCALE ? HQ_TINY_BOOST : 1.0f;
    b.a = hq_fdiv(1.0f, hq_fmul(sc, b.boostf));
    b.low_mult = hq_pow2f(e.s - 1);
    b.i0 = 127 + e.c;     // top
    b.i1 = 128 - e.s;     // s_floor
    b.i2 = e.s - 1 + e.c; // e_low
  } else if (MODE == HQ_MODE_LINEAR_SM) {
    b.boostf = sc < HQ_TINY_SCALE ? HQ_TINY_BOOST : 1.0f;
    b.a = hq_fdiv((float)e.s, hq_fmul(sc, b.boostf));
  } else {  // dithered
    b.a = sc;
    b.i0 = e.k > 0 ? (e.k - 1) / 2 : 0;  // h
    b.invk = e.k > 0 ? (float)(1.0 / (double)e.k) : 0.0f;
  }
  return b;
}

// global_qsgd._linear_level: signed level in [-s, s]; mult = s / (norm boost)
HQ_HD hq_i32 hq_linear_level(float v, float boost, float mult, float fs, hq_u32 h) {
  float t = hq_fmul(hq_fmul(fabsf(v), boost), mult);
  t = t < fs ? t : fs;  // NaN -> fs
  hq_i32 lvl = (hq_i32)t;
  hq_i32 mag = lvl + (hq_i32)(hq_u24(h) < hq_fsub(t, (float)lvl));
  return v < 0.0f ? -mag : mag;
}

// global_qsgd._exp_code; inv = 1 / (norm boost)
HQ_HD hq_i32 hq_exp_code(float v, float boost, float inv, float low_mult, hq_i32 top,
                         hq_i32 s_floor, hq_i32 e_low, hq_i32 smask, hq_u32 h) {
  float r = hq_fmul(hq_fmul(fabsf(v), boost), inv);
  r = r < 1.0f ? r : 1.0f;  // NaN -> 1
  hq_i32 rb = (hq_i32)hq_f2u(r);
  hq_i32 be = rb >> 23;
  hq_i32 up = (hq_i32)((hq_i32)(h >> 9) < (rb & 0x7FFFFF));
  hq_i32 e_hi = (top - be) - up;
  hq_i32 e_lo = hq_u24(h) < hq_fmul(r, low_mult) ? e_low : 0;
  hq_i32 e = be >= s_floor ? e_hi : e_lo;
  return (v < 0.0f && e != 0) ? (e | smask) : e;
}

// dithered._fine_index: ceil((v / kap) am - rho); |t| <= am < 2^22 (hq_floor_split)
HQ_HD hq_i32 hq_fine_index(float v, float kap, float am, float rho) {
  const float t = hq_fmul(hq_fdiv(v, kap), am);
  hq_i32 il;
  float lvl;
  hq_floor_split(t, &il, &lvl);
  return il + (hq_i32)(rho < hq_fsub(t, lvl));
}

// Code of element value v with random bits h under bucket parameters b; smask is the sign bit
// of a bits-wide code (1 << (bits - 1)). The level modes compute a code for a bucket without a
// valid scale too and discard it at the end: a select rather than a branch per element, which
// would keep the compiler from interleaving the elements of a row.
template <int MODE>
HQ_HD hq_u32 hq_encode_code(const HqEnc& e, const HqBucket& b, float v, hq_u32 h, hq_i32 smask) {
  if (MODE == HQ_MODE_UNIFORM) {
    v = hq_fmul(v, b.vmul);
    const float fs = (float)e.s;
    float t = hq_fmul(fabsf(v), b.a);
    t = fs < t ? fs : t;  // numba min(t, fs); t is finite and in [0, s] when b.ok
    hq_i32 lvl;
    float flvl;
    hq_floor_split(t, &lvl, &flvl);  // (int)t and (float)(int)t
    const float frac = hq_fsub(t, flvl);
    const hq_u32 mag = (hq_u32)lvl + (hq_u32)(hq_u24(h) < frac);
    const hq_u32 code = mag | ((v < 0.0f && mag != 0) ? (hq_u32)smask : 0u);
    return b.ok ? code : 0u;
  } else if (MODE == HQ_MODE_GEOMETRIC) {
    v = hq_fmul(v, b.vmul);
    float r = hq_fmul(fabsf(v), b.a);
    r = 1.0f < r ? 1.0f : r;  // numba min(r, 1)
    const hq_i32 rb = (hq_i32)hq_f2u(r);
    const hq_i32 lower = (rb >> 23) + b.i0;
    const hq_i32 up_hi = (hq_i32)((hq_i32)(h >> 9) < (rb & 0x7FFFFF));
    const hq_i32 up_lo = (hq_i32)(hq_u24(h) < hq_fmul(r, b.low_mult));
    const hq_i32 mag = lower >= 1 ? lower + up_hi : up_lo;
    const hq_u32 code = (hq_u32)(mag | ((v < 0.0f && mag != 0) ? smask : 0));
    return b.ok ? code : 0u;
  } else if (MODE == HQ_MODE_EXP) {
    const hq_i32 code = hq_exp_code(v, b.boostf, b.a, b.low_mult, b.i0, b.i1, b.i2, smask, h);
    return b.ok ? (hq_u32)code : 0u;
  } else if (MODE == HQ_MODE_LINEAR_SM) {
    if (!b.ok) return 0;
    const hq_i32 q = hq_linear_level(v, b.boostf, b.a, (float)e.s, h);
    return (hq_u32)(q < 0 ? ((-q) | smask) : q);
  } else if (MODE == HQ_MODE_DITHER) {
    if (!b.ok) return (hq_u32)e.M;  // neutral code
    const hq_i32 q = hq_fine_index(v, b.a, e.am, hq_u24(h));
    return (hq_u32)(hq_u8)(q + e.M);
  } else {  // nested
    const hq_i32 hh = b.i0;
    if (!b.ok) return (hq_u32)hh;
    const hq_i32 q = hq_fine_index(v, b.a, e.am, hq_u24(h));
    const hq_i32 a = q + hh;
    const float f = floorf(hq_fmul(hq_fadd((float)a, 0.5f), b.invk));
    return (hq_u32)(hq_u8)(a - e.k * (hq_i32)f);
  }
}

// ------------------------------------------------------------------------------------------
// encode, warp tiles: the fast program (bits 4 and 8; max, power-of-two, L2 scales or none)
// ------------------------------------------------------------------------------------------
// A warp encodes a "unit" of a full packing block held in registers: PARTS parts of PART
// contiguous elements, part p starting PART_STRIDE * p after part 0, so that the codes of all
// parts at one offset share the bytes of a 32-bit word (8 bits: one part; 4 bits: byte j of a
// block holds the codes of elements j and j + 4096). Lane l holds float4 rows
// r * 128 + 4 l of every part: 16-byte coalesced loads, and its 4-byte word of codes per row is
// a coalesced 32-bit store. A bucket (a power of two from 4 to PART elements) lies inside a
// part: its max |x| is the max over the rows of the bucket and over its lanes (warp
// butterflies on the int bit patterns, exact and order-free), so no shared memory and no block
// barrier (L2 scales: see hq_encode_tile). Registers per lane: 4 * ROWS * PARTS floats.
template <int BITS>
struct HqTileShape {
  static constexpr int PARTS = 8 / BITS;
  static constexpr int ROWS = 4;
  static constexpr int PART = ROWS * 128;
  static constexpr int UNITS = HQ_PACK_BLOCK / (PART * PARTS);  // units per packing block
  static constexpr int PART_STRIDE = HQ_PACK_BLOCK / PARTS;
  static constexpr int BLOCK_BYTES = HQ_PACK_BLOCK * BITS / 8;
};

// Shared memory of one warp for the L2 tiles (unused by the others): the unit's elements, a
// round of 32 float64 lane sums, the unit's bucket scales.
struct HqTileShared {
  float* x;        // PARTS * PART floats, 16-byte aligned
  double* lanes;   // 32
  float* scales;   // PARTS * PART / 4 (buckets of 4 elements)
};

// Encode unit `unit` (of the full packing blocks) of x. log2_bucket: 2 .. 9 (ignored without
// scales); scales / codes: the payload's float32 scales and packed codes (4-byte aligned),
// x 16-byte aligned. NORM: HQ_NORM_MAX or HQ_NORM_POW2 (maxima by warp butterflies), or
// HQ_NORM_L2: float64 sums of squares in the CPU's order (8 interleaved lanes, each left to
// right, combined in lane order), which is sequential by definition: the unit goes to the
// warp's shared memory `sh` and 8 lanes per bucket add its lanes (hq_lane_value, as the
// generic program does), 32 (bucket, lane) pairs per round.
template <int MODE, int NORM, int BITS, class Ex>
HQ_HDT inline void hq_encode_tile(Ex& ex, const HqEnc& e, const float* x, int log2_bucket,
                                  hq_i64 unit, float* scales, hq_u8* codes, HqTileShared sh) {
  using S = HqTileShape<BITS>;
  constexpr int NV = S::PARTS * S::ROWS;
  constexpr bool SCALED = hq_has_scales<MODE>();
  constexpr bool SUMS = SCALED && NORM == HQ_NORM_L2;
  const hq_i64 blk = unit / S::UNITS;
  const int col = (int)(unit - blk * S::UNITS) * S::PART;  // part 0's offset = its code byte
  const hq_i64 b0 = blk * HQ_PACK_BLOCK;
  const float* xu = x + b0 + col;
  // a bucket spans rows (>= 128 elements) or groups of lanes within a row
  const int bucket_rows = log2_bucket >= 7 ? 1 << (log2_bucket - 7) : 1;
  const int bucket_lanes = log2_bucket >= 7 ? 32 : 1 << (log2_bucket - 2);
  const int part_buckets = S::PART >> log2_bucket;
  typename Ex::template Reg<HqArr<float4, NV>> xs;
  typename Ex::template Reg<HqArr<hq_i32, NV>> mb;
  if (SUMS) ex.sync();  // every lane done with the warp's previous unit in sh
  ex.each([&](int lane) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int p = i / S::ROWS, r = i % S::ROWS;
      xs[lane].v[i] = hq_ldg_f4(xu + p * S::PART_STRIDE + r * 128 + 4 * lane);
      if (SUMS) reinterpret_cast<float4*>(sh.x + p * S::PART + r * 128)[lane] = xs[lane].v[i];
    }
    if (SCALED && !SUMS) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const float4 v = xs[lane].v[i];
        const hq_i32 a = hq_abs_bits(v.x), b = hq_abs_bits(v.y);
        const hq_i32 c = hq_abs_bits(v.z), d = hq_abs_bits(v.w);
        const hq_i32 ab = a > b ? a : b, cd = c > d ? c : d;
        mb[lane].v[i] = ab > cd ? ab : cd;
      }
#pragma unroll
      for (int s = 1; s < S::ROWS; s <<= 1) {  // butterflies over the rows of a bucket
        if (s < bucket_rows) {
#pragma unroll
          for (int i = 0; i < NV; ++i) {
            if ((i & s) == 0) {
              hq_i32& lo = mb[lane].v[i];
              hq_i32& hi = mb[lane].v[i | s];
              lo = hi > lo ? hi : lo;
              hi = lo;
            }
          }
        }
      }
    }
  });
  if (SCALED && !SUMS) ex.warp_max(mb, bucket_lanes);
  if (SUMS) {
    const int pairs = S::PARTS * part_buckets * HQ_LANES;
    for (int t0 = 0; t0 < pairs; t0 += 32) {
      ex.sync();  // sh.x stored / the previous round's lanes read
      ex.each([&](int lane) {
        const int t = t0 + lane;
        sh.lanes[lane] = t < pairs ? hq_lane_value(sh.x + ((t / HQ_LANES) << log2_bucket),
                                                   1 << log2_bucket, t % HQ_LANES, HQ_NORM_L2,
                                                   2.0)
                                   : 0.0;
      });
      ex.sync();
      ex.each([&](int lane) {
        const int t = t0 + lane;
        if (t % HQ_LANES == 0 && t < pairs) {
          const int kb = t / HQ_LANES;  // bucket of the unit: part kb / part_buckets
          const float sc = hq_lanes_scale(sh.lanes + lane, HQ_NORM_L2, 2.0);
          sh.scales[kb] = sc;
          const hq_i64 first = b0 + col + (kb / part_buckets) * S::PART_STRIDE +
                               ((kb % part_buckets) << log2_bucket);
          scales[first >> log2_bucket] = sc;
        }
      });
    }
    ex.sync();
  }
  ex.each([&](int lane) {
    const hq_u32 kb = hq_block_key((hq_u64)b0, e.k0);
    const hq_u32 lo0 = (hq_u32)b0 + (hq_u32)(col + 4 * lane);  // low index word of the lane
    const hq_i32 smask = 1 << (BITS - 1);
    const bool leader = (lane & (bucket_lanes - 1)) == 0;  // writes its bucket's scale
    HqBucket bp[S::PARTS];
#pragma unroll
    for (int p = 0; p < S::PARTS; ++p) bp[p] = hq_bucket_params<MODE>(e, 0.0f);
#pragma unroll
    for (int r = 0; r < S::ROWS; ++r) {
      hq_u32 word = 0;
#pragma unroll
      for (int p = 0; p < S::PARTS; ++p) {
        const int i = p * S::ROWS + r;
        const int off = p * S::PART_STRIDE + r * 128;  // from the lane's first element
        if (SCALED && (r & (bucket_rows - 1)) == 0) {
          float sc;
          if (SUMS) {
            sc = sh.scales[p * part_buckets + ((r * 128 + 4 * lane) >> log2_bucket)];
          } else {
            sc = hq_max_scale(mb[lane].v[i], NORM);
            if (leader) scales[(b0 + col + off + 4 * lane) >> log2_bucket] = sc;
          }
          bp[p] = hq_bucket_params<MODE>(e, sc);
        }
        // (L2: from the shared copy, so that the registers need not live through the sums)
        const float4 v = SUMS ? reinterpret_cast<const float4*>(sh.x + p * S::PART + r * 128)[lane]
                              : xs[lane].v[i];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const hq_u32 h = hq_hash32_lo(lo0 + (hq_u32)(off + k), kb, e.k1);
          const hq_u32 c = hq_encode_code<MODE>(e, bp[p], hq_f4_get(v, k), h, smask);
          word |= (c & ((1u << BITS) - 1u)) << (8 * k + p * BITS);  // as packing masks it
        }
      }
      hq_store_u32(codes + blk * S::BLOCK_BYTES + col + r * 128 + 4 * lane, word);
    }
  });
}

// ------------------------------------------------------------------------------------------
// encode, generic program: one CUDA block per packing block, any bit width and bucket
// ------------------------------------------------------------------------------------------
// Shared memory of the generic encode program.
struct HqEncShared {
  float* x;        // HQ_PACK_BLOCK floats: the block's input
  hq_u8* codes;    // HQ_PACK_BLOCK codes
  double* lanes;   // ex.nt doubles
};

// Encode packing block `blk` of x[0:n].
//   scales: float32 per bucket (written here when fused, else read; unused without scales)
//   codes_out: start of the packed codes of the whole vector
//   fused: every bucket of this block lies inside it (PACK_BLOCK % bucket == 0): the block
//          computes its own scales (8 threads per bucket, one per float64 lane, so L2 and
//          p-norm sums keep their order); otherwise they were computed before (hq_scales
//          kernels)
// The element chunk of a thread is 32 contiguous elements visited in a rotated order
// (shared-memory banks); each element's code depends on nothing but the element.
template <int MODE, int BITS, class Ex>
HQ_HDT inline void hq_encode_block(Ex& ex, const HqEnc& e, const float* x, hq_i64 n,
                                   hq_i64 bucket, hq_i64 blk, float* scales, bool fused,
                                   hq_u8* codes_out, HqEncShared sh) {
  const hq_i64 b0 = blk * HQ_PACK_BLOCK;
  const int m = (int)(n - b0 < HQ_PACK_BLOCK ? n - b0 : HQ_PACK_BLOCK);
  const float* xg = x + b0;
  float* xs = sh.x;
  // float4 loads when the block's input is 16-byte aligned and whole (block-uniform test)
  const bool vec = m % 4 == 0 && ((hq_u64)(const void*)xg & 15u) == 0;
  ex.each([&](int tid) {
    if (vec) {
      const float4* x4 = reinterpret_cast<const float4*>(xg);
      float4* s4 = reinterpret_cast<float4*>(xs);
      for (int j = tid; j < m / 4; j += ex.nt) s4[j] = x4[j];
    } else {
      for (int j = tid; j < m; j += ex.nt) xs[j] = xg[j];
    }
  });
  ex.sync();
  if (fused && hq_has_scales<MODE>()) {
    const hq_i64 kb0 = b0 / bucket;
    const hq_i64 kb1 = (b0 + m + bucket - 1) / bucket;
    hq_scales_phase(ex, xs, b0, n, bucket, kb0, kb1, hq_scale_kind<MODE>(e), e.p, sh.lanes,
                    scales);
  }
  const hq_u32 kb = hq_block_key((hq_u64)b0, e.k0);
  const int chunk = (HQ_PACK_BLOCK + ex.nt - 1) / ex.nt;
  // bucket of block element j: kbase + (j + off) / bucket, off = b0 mod bucket; the 32-bit
  // division runs only when a thread's element leaves its current bucket
  const hq_i64 kbase = b0 / bucket;
  const hq_i64 off = b0 - kbase * bucket;
  const bool small = bucket + off + HQ_PACK_BLOCK < 0x7FFFFFFFLL;
  const HqBucket global_params = hq_bucket_params<MODE>(e, 0.0f);
  const hq_i32 smask = 1 << (BITS - 1);
  ex.each([&](int tid) {
    const int c0 = tid * chunk;
    const int rot = tid % chunk;  // rotated start: the warp's shared-memory reads hit distinct banks
    hq_i64 lo = 1, hi = 0;        // current bucket as block-local [lo, hi)
    HqBucket bp = global_params;
    for (int r = 0; r < chunk; ++r) {
      int rr = r + rot;
      rr = rr >= chunk ? rr - chunk : rr;
      const int j = c0 + rr;
      if (j >= HQ_PACK_BLOCK) continue;
      if (j >= m) {
        sh.codes[j] = 0;
        continue;
      }
      if (hq_has_scales<MODE>() && !(j >= lo && j < hi)) {
        const hq_i64 q = small ? (hq_i64)((hq_u32)(j + off) / (hq_u32)bucket) : (j + off) / bucket;
        lo = q * bucket - off;
        hi = lo + bucket;
        bp = hq_bucket_params<MODE>(e, scales[kbase + q]);
      }
      const hq_u32 h = hq_hash32_lo((hq_u32)(b0 + j), kb, e.k1);
      sh.codes[j] = (hq_u8)hq_encode_code<MODE>(e, bp, xs[j], h, smask);
    }
  });
  ex.sync();
  hq_pack_phase<BITS>(ex, sh.codes, m, codes_out + hq_block_offset(blk, BITS));
}

// Pack an array of codes (one block program per packing block).
template <int BITS, class Ex>
HQ_HDT inline void hq_pack_block(Ex& ex, const hq_u8* codes, hq_i64 n, hq_i64 blk, hq_u8* out,
                                 hq_u8* sh_codes) {
  const hq_i64 b0 = blk * HQ_PACK_BLOCK;
  const int m = (int)(n - b0 < HQ_PACK_BLOCK ? n - b0 : HQ_PACK_BLOCK);
  ex.each([&](int tid) {
    for (int j = tid; j < m; j += ex.nt) sh_codes[j] = codes[b0 + j];
  });
  ex.sync();
  hq_pack_phase<BITS>(ex, sh_codes, m, out + hq_block_offset(blk, BITS));
}

// ------------------------------------------------------------------------------------------
// decode of [scales][packed codes] payloads, summed over several payloads in payload order
// ------------------------------------------------------------------------------------------
#define HQ_MAX_PAYLOADS 8  // payload pointers per launch (kernel arguments, no device array)

// How the sum over the payloads starts (a launch continues where the previous one stored):
#define HQ_START_ASSIGN 0  // the first payload's value (decode)
#define HQ_START_OUT 1     // out + ... (decode_add; later launches of a long payload list)
#define HQ_START_ZERO 2    // 0.0f + ... (the gather mean, which numba sums into zeros)

// a[q] of a small array held in registers or kernel parameters, q known only at run time
template <class T>
HQ_HD T hq_select(const T (&a)[HQ_MAX_PAYLOADS], int q) {
  T v = a[0];
#pragma unroll
  for (int i = 1; i < HQ_MAX_PAYLOADS; ++i) v = q == i ? a[i] : v;
  return v;
}

// What a decode launch reads and writes (kernel arguments; the payload pointers by value).
struct HqDecode {
  const hq_u8* pays[HQ_MAX_PAYLOADS];
  int npay;
  hq_i64 scales_off;  // byte offset of the float32 scales in each payload; < 0: gscale
  hq_i64 codes_off;   // byte offset of the packed codes
  float gscale;       // the one scale of every element when scales_off < 0
  hq_i64 n;
  hq_i64 bucket;
  int log2_bucket;    // word program: bucket == 1 << log2_bucket
  float* out;
  int start;          // HQ_START_*
  bool has_post;      // then out = sum * post
  float post;
  // pays[q] without indexing the array by a runtime q (which would copy it to local memory):
  // selects, folded away where q is a compile-time constant
  HQ_HD const hq_u8* payload(int q) const { return hq_select(pays, q); }
};

// The parameters of the decode kernels (levels.cu, dithered.cu) and the HqDecode they make.
#define HQ_DECODE_PARAMS                                                                     \
  const unsigned char *p0, const unsigned char *p1, const unsigned char *p2,                 \
      const unsigned char *p3, const unsigned char *p4, const unsigned char *p5,             \
      const unsigned char *p6, const unsigned char *p7, int npay, long long scales_off,      \
      long long codes_off, float gscale, long long n, long long bucket, int log2_bucket,     \
      float *out, int start, int has_post, float post

#define HQ_DECODE_ARGS                                                                       \
  {{p0, p1, p2, p3, p4, p5, p6, p7}, npay, scales_off, codes_off, gscale, n, bucket,         \
   log2_bucket, out, start, has_post != 0, post}

// Level codecs (levels, Global-QSGD exponent codes): table[code] * scale.
struct HqLevelValues {
  const float* table;  // signed level of each code (shared memory in the kernels)
  HQ_HD float step(float scale) const { return scale; }
  HQ_HD float value(int, hq_u32 code, float step, hq_i64) const {
    return hq_fmul(table[code], step);
  }
};

// DQSG: ((code - M) - 1/2 + rho) * (kappa / M), rho regenerated from the sender's key.
struct HqDitherValues {
  hq_u32 k0[HQ_MAX_PAYLOADS], k1[HQ_MAX_PAYLOADS];
  int M;
  HQ_HD float step(float kappa) const { return hq_fdiv(kappa, (float)M); }
  HQ_HD float value(int q, hq_u32 code, float step, hq_i64 i) const {
    const float rho = hq_u24(hq_hash32((hq_u64)i, hq_select(k0, q), hq_select(k1, q)));
    return hq_fmul(hq_fadd(hq_fsub((float)((hq_i32)code - M), 0.5f), rho), step);
  }
};

HQ_HD void hq_load_out4(const float* p, bool vec, float* acc) {
  if (vec) {
    const float4 o = *reinterpret_cast<const float4*>(p);
    acc[0] = o.x;
    acc[1] = o.y;
    acc[2] = o.z;
    acc[3] = o.w;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) acc[k] = p[k];
  }
}

HQ_HD void hq_store_out4(float* p, bool vec, const float* acc) {
  if (vec) {
    *reinterpret_cast<float4*>(p) = make_float4(acc[0], acc[1], acc[2], acc[3]);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) p[k] = acc[k];
  }
}

// Fast program (bits 4 and 8, full packing blocks, buckets a power of two >= 4 or one global
// scale): one 32-bit word of codes per call, read once per payload (read-only path), its 4
// (8 bits) or 8 (4 bits: low nibbles elements j.., high nibbles j + 4096..) values written as
// float4. Word w of the full blocks; every element of a word's part lies in one bucket.
template <int BITS, class Vals>
HQ_HD void hq_decode_word(const HqDecode& d, const Vals& vals, hq_i64 w) {
  constexpr int PARTS = 8 / BITS;
  constexpr int WORDS = HQ_PACK_BLOCK * BITS / 32;  // code words per packing block
  constexpr int PART_STRIDE = HQ_PACK_BLOCK / PARTS;
  constexpr hq_u32 MASK = (1u << BITS) - 1u;
  const hq_i64 blk = w / WORDS;
  const int j = 4 * (int)(w - blk * WORDS);
  const hq_i64 e0 = blk * HQ_PACK_BLOCK + j;
  const bool vec = ((hq_u64)(const void*)d.out & 15u) == 0;
  float acc[PARTS][4];
#pragma unroll
  for (int p = 0; p < PARTS; ++p) {
    if (d.start == HQ_START_OUT) {
      hq_load_out4(d.out + e0 + p * PART_STRIDE, vec, acc[p]);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) acc[p][k] = 0.0f;
    }
  }
#pragma unroll
  for (int q = 0; q < HQ_MAX_PAYLOADS; ++q) {
    if (q < d.npay) {
      const hq_u8* pay = d.payload(q);
      const hq_u32 word = hq_ldg_u32(pay + d.codes_off + blk * (HQ_PACK_BLOCK * BITS / 8) + j);
#pragma unroll
      for (int p = 0; p < PARTS; ++p) {
        const hq_i64 e = e0 + p * PART_STRIDE;
        const float sc = d.scales_off < 0
                             ? d.gscale
                             : hq_ldg_f32(pay + d.scales_off + 4 * (e >> d.log2_bucket));
        const float step = vals.step(sc);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const hq_u32 code = (word >> (8 * k + p * BITS)) & MASK;
          const float v = vals.value(q, code, step, e + k);
          acc[p][k] = (q == 0 && d.start == HQ_START_ASSIGN) ? v : hq_fadd(acc[p][k], v);
        }
      }
    }
  }
#pragma unroll
  for (int p = 0; p < PARTS; ++p) {
    if (d.has_post) {
#pragma unroll
      for (int k = 0; k < 4; ++k) acc[p][k] = hq_fmul(acc[p][k], d.post);
    }
    hq_store_out4(d.out + e0 + p * PART_STRIDE, vec, acc[p]);
  }
}

#define HQ_GROUP 4  // elements per call of the generic decode program

// Generic program (any bit width, bucket and block): elements i0 .. i0 + 3 (fewer at the end
// of the vector) of one packing block, i0 a multiple of 4, same sums as hq_decode_word.
template <int BITS, class Vals>
HQ_HD void hq_decode_group(const HqDecode& d, const Vals& vals, hq_i64 i0) {
  const int cnt = (int)(d.n - i0 < HQ_GROUP ? d.n - i0 : HQ_GROUP);
  const hq_i64 blk = i0 / HQ_PACK_BLOCK;
  const hq_i64 b0 = blk * HQ_PACK_BLOCK;
  const int m = (int)(d.n - b0 < HQ_PACK_BLOCK ? d.n - b0 : HQ_PACK_BLOCK);
  const bool scaled = d.scales_off >= 0;
  const hq_i64 k0 = scaled ? hq_div(i0, d.bucket) : 0;
  const hq_i64 bound = (k0 + 1) * d.bucket;  // first element of the next bucket
  const bool vec = cnt == HQ_GROUP && ((hq_u64)(const void*)d.out & 15u) == 0;
  float acc[HQ_GROUP] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (d.start == HQ_START_OUT) {
    if (vec) {
      hq_load_out4(d.out + i0, true, acc);
    } else {
#pragma unroll
      for (int k = 0; k < HQ_GROUP; ++k)
        if (k < cnt) acc[k] = d.out[i0 + k];
    }
  }
#pragma unroll 1
  for (int q = 0; q < d.npay; ++q) {  // not unrolled: the generic program stays small
    const hq_u8* pay = d.payload(q);
    const hq_u8* packed = pay + d.codes_off + hq_block_offset(blk, BITS);
    float step = vals.step(scaled ? hq_ldg_f32(pay + d.scales_off + 4 * k0) : d.gscale);
#pragma unroll
    for (int k = 0; k < HQ_GROUP; ++k) {
      if (k < cnt) {
        const hq_i64 i = i0 + k;
        if (scaled && i >= bound) {  // into the next bucket (buckets below 4: every element)
          const hq_i64 kk = d.bucket >= HQ_GROUP ? k0 + 1 : hq_div(i, d.bucket);
          step = vals.step(hq_ldg_f32(pay + d.scales_off + 4 * kk));
        }
        const hq_u32 code = hq_unpack_code<BITS>(packed, m, (int)(i - b0));
        const float v = vals.value(q, code, step, i);
        acc[k] = (q == 0 && d.start == HQ_START_ASSIGN) ? v : hq_fadd(acc[k], v);
      }
    }
  }
  if (d.has_post) {
#pragma unroll
    for (int k = 0; k < HQ_GROUP; ++k) acc[k] = hq_fmul(acc[k], d.post);
  }
  if (vec) {
    hq_store_out4(d.out + i0, true, acc);
  } else {
#pragma unroll
    for (int k = 0; k < HQ_GROUP; ++k)
      if (k < cnt) d.out[i0 + k] = acc[k];
  }
}

// NDQSG P2 decode of element i: out + x_hat (finite nonzero kappa), out + kappa * 0 (non-finite
// kappa), out (zero kappa). *resid gets (r - Q2(r)) / Delta1 for finite nonzero kappa.
template <int BITS>
HQ_HD float hq_decode_nested_elem(const hq_u8* d, hq_i64 scales_off, hq_i64 codes_off, hq_i64 n,
                                  hq_i64 bucket, int M, int k, float am, float alpha, float y,
                                  hq_u32 k0, hq_u32 k1, float out, float* resid, hq_i64 i) {
  const float kap = hq_load_f32(d + scales_off + 4 * (i / bucket));
  *resid = 0.0f;
  if (kap > 0.0f && hq_isfinite(kap)) {
    const hq_i32 h = (k - 1) / 2;
    const float kf = (float)k;
    const float invk = (float)(1.0 / (double)k);
    const float cmf = (float)((M + h) / k);
    const float fm = (float)M;
    const float beta = hq_fsub(1.0f, hq_fmul(alpha, alpha));
    const float step = hq_fdiv(kap, fm);
    const hq_u32 c = hq_packed_code<BITS>(d + codes_off, n, i);
    const float rho = hq_u24(hq_hash32((hq_u64)i, k0, k1));
    // _nested_index
    const hq_i32 m = (hq_i32)c - h;
    const float a = hq_fsub(hq_fadd(hq_fsub((float)m, 0.5f), rho), hq_fmul(hq_fdiv(y, kap), am));
    float f = floorf(hq_fadd(hq_fmul(a, invk), 0.5f));
    f = f > -cmf ? f : -cmf;
    f = f < cmf ? f : cmf;
    const hq_i32 qh = m - (hq_i32)kf * (hq_i32)f;
    *resid = hq_fsub(a, hq_fmul(kf, f));
    const float xh = hq_fmul(hq_fmul(hq_fadd(hq_fsub((float)qh, 0.5f), rho), step), alpha);
    return hq_fadd(out, hq_fadd(xh, hq_fmul(beta, y)));
  }
  if (kap != 0.0f) return hq_fadd(out, hq_fmul(kap, 0.0f));
  return out;
}

// Sum of squares of the NDQSG residuals in decode_nested's order: for every finite nonzero
// bucket piece inside a packing block (in index order), element t of the piece feeds lane
// t % 8; lanes add left to right and combine in lane order. Returns the lane value of `lane`.
HQ_HD double hq_resid_lane(const float* resid, const hq_u8* d, hq_i64 scales_off, hq_i64 n,
                           hq_i64 bucket, int lane) {
  double acc = 0.0;
  const hq_i64 nb = (n + bucket - 1) / bucket;
  for (hq_i64 k = 0; k < nb; ++k) {
    const float kap = hq_load_f32(d + scales_off + 4 * k);
    if (!(kap > 0.0f && hq_isfinite(kap))) continue;
    const hq_i64 lo = k * bucket;
    const hq_i64 hi = lo + bucket < n ? lo + bucket : n;
    hq_i64 s0 = lo;
    while (s0 < hi) {  // pieces split at packing block boundaries
      hq_i64 bend = (s0 / HQ_PACK_BLOCK + 1) * HQ_PACK_BLOCK;
      hq_i64 s1 = bend < hi ? bend : hi;
      for (hq_i64 e = s0 + lane; e < s1; e += HQ_LANES) {
        const double v = (double)resid[e];
        acc = hq_dadd(acc, hq_dmul(v, v));
      }
      s0 = s1;
    }
  }
  return acc;
}

// ------------------------------------------------------------------------------------------
// small elementwise pieces (kept out of CuPy's own elementwise kernels, which CuPy compiles
// with -ftz=true: subnormals would flush)
// ------------------------------------------------------------------------------------------
// Global-QSGD sparse decode of entry j of a payload [u32 cnt][cnt u32 positions][packed codes]:
// out[pos_j] += table[code_j] * scale (positions are distinct: no two threads share an output)
template <int BITS>
HQ_HD void hq_decode_sparse_elem(const hq_u8* data, hq_i64 cnt, const float* table, float scale,
                                 float* out, hq_i64 j) {
  const hq_u32 pos = hq_load_u32_bytes(data + 4 + 4 * j);
  const hq_u32 c = hq_packed_code<BITS>(data + 4 + 4 * cnt, cnt, j);
  out[pos] = hq_fadd(out[pos], hq_fmul(table[c], scale));
}

// ------------------------------------------------------------------------------------------
// the specialisations compiled as kernels (levels.cu, dithered.cu) and replayed by the host
// build (tests/cuda_parity/host_parity.cu); names in horovod_quant/backends/cuda/kernels.py
// ------------------------------------------------------------------------------------------
// warp-tile encodes: X(mode name, mode, scale name, scale kind, bits)
#define HQ_TILE_ENCODES_OF_BITS(X, B)                                                      \
  X(uniform, HQ_MODE_UNIFORM, max, HQ_NORM_MAX, B)                                         \
  X(uniform, HQ_MODE_UNIFORM, pow2, HQ_NORM_POW2, B)                                       \
  X(uniform, HQ_MODE_UNIFORM, l2, HQ_NORM_L2, B)                                           \
  X(geometric, HQ_MODE_GEOMETRIC, max, HQ_NORM_MAX, B)                                     \
  X(geometric, HQ_MODE_GEOMETRIC, pow2, HQ_NORM_POW2, B)                                   \
  X(geometric, HQ_MODE_GEOMETRIC, l2, HQ_NORM_L2, B)                                       \
  X(exp, HQ_MODE_EXP, global, HQ_NORM_MAX, B)                                              \
  X(dither, HQ_MODE_DITHER, max, HQ_NORM_MAX, B)                                           \
  X(nested, HQ_MODE_NESTED, max, HQ_NORM_MAX, B)
#define HQ_TILE_ENCODES(X) HQ_TILE_ENCODES_OF_BITS(X, 4) HQ_TILE_ENCODES_OF_BITS(X, 8)

// the bit widths of the generic programs: X(..., bits)
#define HQ_CODE_BITS(X, A, B) \
  X(A, B, 2) X(A, B, 3) X(A, B, 4) X(A, B, 5) X(A, B, 6) X(A, B, 7) X(A, B, 8)

// generic block encodes: X(mode name, mode, bits)
#define HQ_BLOCK_ENCODES(X)                                                                \
  HQ_CODE_BITS(X, uniform, HQ_MODE_UNIFORM) HQ_CODE_BITS(X, geometric, HQ_MODE_GEOMETRIC) \
  HQ_CODE_BITS(X, exp, HQ_MODE_EXP) HQ_CODE_BITS(X, dither, HQ_MODE_DITHER)                \
  HQ_CODE_BITS(X, nested, HQ_MODE_NESTED)

// decodes: X(values name, values type, bits); word programs at 4 and 8 bits
#define HQ_WORD_DECODES(X, NAME, VALS) X(NAME, VALS, 4) X(NAME, VALS, 8)
#define HQ_GROUP_DECODES(X, NAME, VALS) HQ_CODE_BITS(X, NAME, VALS)

#endif  // HQ_CODES_CUH
