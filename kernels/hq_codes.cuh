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

struct HqEnc {
  int mode;
  int bits;
  int norm_kind;   // scale kind of the bucketed modes
  double p;
  int s;           // levels (uniform / geometric / exp / linear)
  int c;           // exponent offset (exp)
  int M;           // dithered fine levels
  int k;           // nested coarse ratio (0 for DQSG)
  float am;        // dithered alpha * M
  float gnorm;     // global norm (exp / linear)
  hq_u32 k0, k1;
};

HQ_HD bool hq_has_scales(int mode) {
  return mode == HQ_MODE_UNIFORM || mode == HQ_MODE_GEOMETRIC || mode == HQ_MODE_DITHER ||
         mode == HQ_MODE_NESTED;
}

// Per-bucket (or global) values hoisted out of the element loop.
struct HqBucket {
  bool ok;         // scale > 0 and finite
  bool boost;      // levels: tiny scale, round x * 2^64 against scale * 2^64
  float a;         // uniform: s / scale; geometric: 1 / scale; exp: 1 / (norm boostf);
                   // linear: s / (norm boostf); dither: kappa
  float boostf;    // exp / linear: 2^64 for norms below 2^-100, else 1 (global_qsgd._boost)
  float low_mult;  // geometric / exp: 2^(s-1)
  hq_i32 i0, i1, i2;  // mode-dependent integer constants
  float invk;      // nested: 1 / k
};

HQ_HD HqBucket hq_bucket_params(const HqEnc& e, float sc) {
  HqBucket b;
  b.boost = false;
  b.boostf = 1.0f;
  b.a = 0.0f;
  b.low_mult = 0.0f;
  b.i0 = b.i1 = b.i2 = 0;
  b.invk = 0.0f;
  if (e.mode == HQ_MODE_EXP || e.mode == HQ_MODE_LINEAR_SM) sc = e.gnorm;
  b.ok = sc > 0.0f && hq_isfinite(sc);
  switch (e.mode) {
    case HQ_MODE_UNIFORM:
    case HQ_MODE_GEOMETRIC:
      if (b.ok) {
        if (sc < HQ_TINY_SCALE) {
          b.boost = true;
          sc = hq_fmul(sc, HQ_TINY_BOOST);
        }
        if (e.mode == HQ_MODE_UNIFORM) {
          b.a = hq_fdiv((float)e.s, sc);
        } else {
          b.a = hq_fdiv(1.0f, sc);
          b.low_mult = hq_pow2f(e.s - 1);
          b.i0 = e.s - 127;  // top_shift
        }
      }
      break;
    case HQ_MODE_EXP:
      b.boostf = sc < HQ_TINY_SCALE ? HQ_TINY_BOOST : 1.0f;
      b.a = hq_fdiv(1.0f, hq_fmul(sc, b.boostf));
      b.low_mult = hq_pow2f(e.s - 1);
      b.i0 = 127 + e.c;     // top
      b.i1 = 128 - e.s;     // s_floor
      b.i2 = e.s - 1 + e.c; // e_low
      break;
    case HQ_MODE_LINEAR_SM:
      b.boostf = sc < HQ_TINY_SCALE ? HQ_TINY_BOOST : 1.0f;
      b.a = hq_fdiv((float)e.s, hq_fmul(sc, b.boostf));
      break;
    default:  // dithered
      b.a = sc;
      b.i0 = e.k > 0 ? (e.k - 1) / 2 : 0;  // h
      b.invk = e.k > 0 ? (float)(1.0 / (double)e.k) : 0.0f;
      break;
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

// dithered._fine_index: ceil((v / kap) am - rho)
HQ_HD hq_i32 hq_fine_index(float v, float kap, float am, float rho) {
  float t = hq_fmul(hq_fdiv(v, kap), am);
  float lvl = floorf(t);
  return (hq_i32)lvl + (hq_i32)(rho < hq_fsub(t, lvl));
}

// Code of element value v with random bits h under bucket parameters b.
HQ_HD hq_u32 hq_encode_code(const HqEnc& e, const HqBucket& b, float v, hq_u32 h) {
  const hq_i32 smask = 1 << (e.bits - 1);
  switch (e.mode) {
    case HQ_MODE_UNIFORM: {
      if (!b.ok) return 0;
      if (b.boost) v = hq_fmul(v, HQ_TINY_BOOST);
      const float fs = (float)e.s;
      float t = hq_fmul(fabsf(v), b.a);
      t = fs < t ? fs : t;  // numba min(t, fs)
      hq_i32 lvl = (hq_i32)t;
      float frac = hq_fsub(t, (float)lvl);
      hq_i32 mag = lvl + (hq_i32)(hq_u24(h) < frac);
      return (hq_u32)(mag | ((v < 0.0f && mag != 0) ? smask : 0));
    }
    case HQ_MODE_GEOMETRIC: {
      if (!b.ok) return 0;
      if (b.boost) v = hq_fmul(v, HQ_TINY_BOOST);
      float r = hq_fmul(fabsf(v), b.a);
      r = 1.0f < r ? 1.0f : r;  // numba min(r, 1)
      hq_i32 rb = (hq_i32)hq_f2u(r);
      hq_i32 lower = (rb >> 23) + b.i0;
      hq_i32 up_hi = (hq_i32)((hq_i32)(h >> 9) < (rb & 0x7FFFFF));
      hq_i32 up_lo = (hq_i32)(hq_u24(h) < hq_fmul(r, b.low_mult));
      hq_i32 mag = lower >= 1 ? lower + up_hi : up_lo;
      return (hq_u32)(mag | ((v < 0.0f && mag != 0) ? smask : 0));
    }
    case HQ_MODE_EXP:
      if (!b.ok) return 0;
      return (hq_u32)hq_exp_code(v, b.boostf, b.a, b.low_mult, b.i0, b.i1, b.i2, smask, h);
    case HQ_MODE_LINEAR_SM: {
      if (!b.ok) return 0;
      hq_i32 q = hq_linear_level(v, b.boostf, b.a, (float)e.s, h);
      return (hq_u32)(q < 0 ? ((-q) | smask) : q);
    }
    case HQ_MODE_DITHER: {
      if (!b.ok) return (hq_u32)e.M;  // neutral code
      hq_i32 q = hq_fine_index(v, b.a, e.am, hq_u24(h));
      return (hq_u32)(hq_u8)(q + e.M);
    }
    default: {  // nested
      const hq_i32 hh = b.i0;
      if (!b.ok) return (hq_u32)hh;
      hq_i32 q = hq_fine_index(v, b.a, e.am, hq_u24(h));
      hq_i32 a = q + hh;
      float f = floorf(hq_fmul(hq_fadd((float)a, 0.5f), b.invk));
      return (hq_u32)(hq_u8)(a - e.k * (hq_i32)f);
    }
  }
}

// ------------------------------------------------------------------------------------------
// encode: one CUDA block per packing block
// ------------------------------------------------------------------------------------------
// Shared memory of the encode program.
struct HqEncShared {
  float* x;        // HQ_PACK_BLOCK floats: the block's input
  hq_u8* codes;    // HQ_PACK_BLOCK codes
  double* lanes;   // ex.nt doubles
};

// Encode packing block `blk` of x[0:n].
//   scales: float32 per bucket (written here when fused, else read; unused for EXP/LINEAR_SM)
//   codes_out: start of the packed codes of the whole vector
//   fused: every bucket of this block lies inside it (PACK_BLOCK % bucket == 0): the block
//          computes its own scales; otherwise they were computed before (hq_scales kernels)
// The element chunk of a thread is 32 contiguous elements visited in a rotated order
// (shared-memory banks); each element's code depends on nothing but the element.
template <class Ex>
HQ_HDT inline void hq_encode_block(Ex& ex, const HqEnc& e, const float* x, hq_i64 n, hq_i64 bucket,
                                   hq_i64 blk, float* scales, bool fused, hq_u8* codes_out,
                                   HqEncShared sh) {
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
  if (fused && hq_has_scales(e.mode)) {
    const int kind = (e.mode == HQ_MODE_DITHER || e.mode == HQ_MODE_NESTED) ? HQ_NORM_MAX : e.norm_kind;
    const hq_i64 kb0 = b0 / bucket;
    const hq_i64 kb1 = (b0 + m + bucket - 1) / bucket;
    hq_scales_phase(ex, xs, b0, n, bucket, kb0, kb1, kind, e.p, sh.lanes, scales);
  }
  const hq_u32 kb = hq_block_key((hq_u64)b0, e.k0);
  const int chunk = (HQ_PACK_BLOCK + ex.nt - 1) / ex.nt;
  // bucket of block element j: kbase + (j + off) / bucket, off = b0 mod bucket; the 32-bit
  // division runs only when a thread's element leaves its current bucket
  const hq_i64 kbase = b0 / bucket;
  const hq_i64 off = b0 - kbase * bucket;
  const bool small = bucket + off + HQ_PACK_BLOCK < 0x7FFFFFFFLL;
  const HqBucket global_params = hq_bucket_params(e, 0.0f);
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
      if (hq_has_scales(e.mode) && !(j >= lo && j < hi)) {
        const hq_i64 q = small ? (hq_i64)((hq_u32)(j + off) / (hq_u32)bucket) : (j + off) / bucket;
        lo = q * bucket - off;
        hi = lo + bucket;
        bp = hq_bucket_params(e, scales[kbase + q]);
      }
      const hq_u32 h = hq_hash32_lo((hq_u32)(b0 + j), kb, e.k1);
      sh.codes[j] = (hq_u8)hq_encode_code(e, bp, xs[j], h);
    }
  });
  ex.sync();
  hq_pack_phase(ex, sh.codes, m, e.bits, codes_out + hq_block_offset(blk, e.bits));
}

// Pack an array of codes (one block program per packing block).
template <class Ex>
HQ_HDT inline void hq_pack_block(Ex& ex, const hq_u8* codes, hq_i64 n, int bits, hq_i64 blk,
                                 hq_u8* out, hq_u8* sh_codes) {
  const hq_i64 b0 = blk * HQ_PACK_BLOCK;
  const int m = (int)(n - b0 < HQ_PACK_BLOCK ? n - b0 : HQ_PACK_BLOCK);
  ex.each([&](int tid) {
    for (int j = tid; j < m; j += ex.nt) sh_codes[j] = codes[b0 + j];
  });
  ex.sync();
  hq_pack_phase(ex, sh_codes, m, bits, out + hq_block_offset(blk, bits));
}

// Code of element i of the packed codes of an n-element vector.
HQ_HD hq_u32 hq_packed_code(const hq_u8* packed, hq_i64 n, int bits, hq_i64 i) {
  const hq_i64 blk = i / HQ_PACK_BLOCK;
  const hq_i64 b0 = blk * HQ_PACK_BLOCK;
  const int m = (int)(n - b0 < HQ_PACK_BLOCK ? n - b0 : HQ_PACK_BLOCK);
  return hq_unpack_code(packed + hq_block_offset(blk, bits), m, bits, (int)(i - b0));
}

// ------------------------------------------------------------------------------------------
// decode (elementwise; no shared state between threads)
// ------------------------------------------------------------------------------------------
// Plane geometry of one packing block (hq_unpack_code without the per-element plane walk).
struct HqPlanes {
  int np;
  int w[3], sh[3], L[3], off[3], tshift[3];
};

HQ_HD HqPlanes hq_planes(int m, int bits) {
  HqPlanes g;
  g.np = 0;
  int o = 0;
#pragma unroll
  for (int q = 0; q < 3; ++q) {  // constant indices: the struct stays in registers
    int w, sh;
    hq_plane(bits, q, &w, &sh);
    if (w == 8) w = 0;  // 8-bit codes are bytes (handled by the caller)
    const int per = w ? 8 / w : 1;
    g.w[q] = w;
    g.sh[q] = sh;
    g.L[q] = w ? (m + per - 1) / per : 0;
    g.off[q] = o;
    g.tshift[q] = m == HQ_PACK_BLOCK ? (w == 1 ? 10 : (w == 2 ? 11 : 12)) : -1;
    o += g.L[q];
    g.np += w ? 1 : 0;
  }
  return g;
}

// Code of element p of a packed block (same result as hq_unpack_code).
HQ_HD hq_u32 hq_plane_code(const hq_u8* blk, const HqPlanes& g, int bits, int p) {
  if (bits == 8) return blk[p];
  hq_u32 code = 0;
#pragma unroll
  for (int q = 0; q < 3; ++q) {
    if (q < g.np) {
      const int t = g.tshift[q] >= 0 ? p >> g.tshift[q] : p / g.L[q];
      const int j = p - t * g.L[q];
      code |= (((hq_u32)blk[g.off[q] + j] >> (t * g.w[q])) & ((1u << g.w[q]) - 1u)) << g.sh[q];
    }
  }
  return code;
}

#define HQ_GROUP 4  // elements per decode call: a multiple of 4 that divides HQ_PACK_BLOCK

// Level / exponential decode of elements i0 .. i0 + cnt - 1 (cnt <= HQ_GROUP, one packing
// block) summed over npay payloads in order:
//   acc = accumulate ? out[i] : <nothing>; acc (+)= table[code] * scale  (payload order)
// scales_off: byte offset of the float32 scales in each payload (-1: one global scale
// gscale[q] per payload); codes_off: byte offset of the packed codes.
HQ_HD void hq_decode_levels_group(const hq_u8* const* pays, int npay, hq_i64 scales_off,
                                  hq_i64 codes_off, const float* gscale, hq_i64 n,
                                  hq_i64 bucket, int bits, const float* table, float* acc,
                                  bool accumulate, hq_i64 i0, int cnt) {
  const hq_i64 blk = i0 / HQ_PACK_BLOCK;
  const hq_i64 b0 = blk * HQ_PACK_BLOCK;
  const int m = (int)(n - b0 < HQ_PACK_BLOCK ? n - b0 : HQ_PACK_BLOCK);
  const HqPlanes g = hq_planes(m, bits);
  const hq_i64 k0 = scales_off >= 0 ? i0 / bucket : 0;
  const hq_i64 bound = (k0 + 1) * bucket;  // first element of the next bucket
  for (int q = 0; q < npay; ++q) {
    const hq_u8* d = pays[q];
    const hq_u8* packed = d + codes_off + hq_block_offset(blk, bits);
    float sc = scales_off >= 0 ? hq_load_f32(d + scales_off + 4 * k0) : gscale[q];
#pragma unroll
    for (int e = 0; e < HQ_GROUP; ++e) {  // constant indices: acc stays in registers
      if (e < cnt) {
        const hq_i64 i = i0 + e;
        if (scales_off >= 0 && i >= bound)
          sc = hq_load_f32(d + scales_off + 4 * (bucket >= HQ_GROUP ? k0 + 1 : i / bucket));
        const float v = hq_fmul(table[hq_plane_code(packed, g, bits, (int)(i - b0))], sc);
        acc[e] = (q == 0 && !accumulate) ? v : hq_fadd(acc[e], v);
      }
    }
  }
}

// DQSG decode of element i over npay payloads (each with its own key), same accumulation rule.
//   x_hat = ((code - M) - 1/2 + rho) * (kappa / M)
HQ_HD float hq_decode_dither_elem(const hq_u8* const* pays, int npay, hq_i64 scales_off,
                                  hq_i64 codes_off, const hq_u32* keys, hq_i64 n, hq_i64 bucket,
                                  int bits, int M, float acc, bool accumulate, hq_i64 i) {
  const float fm = (float)M;
  for (int q = 0; q < npay; ++q) {
    const hq_u8* d = pays[q];
    const float step = hq_fdiv(hq_load_f32(d + scales_off + 4 * (i / bucket)), fm);
    const hq_u32 c = hq_packed_code(d + codes_off, n, bits, i);
    const float rho = hq_u24(hq_hash32((hq_u64)i, keys[2 * q], keys[2 * q + 1]));
    const float v = hq_fmul(hq_fadd(hq_fsub((float)((hq_i32)c - M), 0.5f), rho), step);
    acc = (q == 0 && !accumulate) ? v : hq_fadd(acc, v);
  }
  return acc;
}

// NDQSG P2 decode of element i: out + x_hat (finite nonzero kappa), out + kappa * 0 (non-finite
// kappa), out (zero kappa). *resid gets (r - Q2(r)) / Delta1 for finite nonzero kappa.
HQ_HD float hq_decode_nested_elem(const hq_u8* d, hq_i64 scales_off, hq_i64 codes_off, hq_i64 n,
                                  hq_i64 bucket, int M, int k, int bits, float am, float alpha,
                                  float y, hq_u32 k0, hq_u32 k1, float out, float* resid,
                                  hq_i64 i) {
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
    const hq_u32 c = hq_packed_code(d + codes_off, n, bits, i);
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
HQ_HD void hq_decode_sparse_elem(const hq_u8* data, hq_i64 cnt, int bits, const float* table,
                                 float scale, float* out, hq_i64 j) {
  const hq_u8* pp = data + 4 + 4 * j;
  const hq_u32 pos = (hq_u32)pp[0] | ((hq_u32)pp[1] << 8) | ((hq_u32)pp[2] << 16) |
                     ((hq_u32)pp[3] << 24);
  const hq_u32 c = hq_packed_code(data + 4 + 4 * cnt, cnt, bits, j);
  out[pos] = hq_fadd(out[pos], hq_fmul(table[c], scale));
}

#endif  // HQ_CODES_CUH
