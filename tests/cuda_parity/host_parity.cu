// Host build of the kernels' block programs, for tests/cuda_parity/test_host_parity.py.
//
// Compiled by nvcc as host code (the __host__ __device__ functions of kernels/*.cuh) into a
// shared library loaded with ctypes. Each hqh_* function replays one CUDA kernel of
// kernels/*.cu on the CPU: the same block programs, every thread of a block in turn between
// two syncs (HqHostEx), every block in turn. The elementwise kernels are loops over the same
// element functions. Nothing here computes a result by other means.
#include "../../kernels/hq_global.cuh"
#include "../../kernels/hq_reduce.cuh"

#include <stdlib.h>
#include <vector>

#define HQH extern "C"

HQH hq_u64 hqh_splitmix64(hq_u64 x) { return hq_splitmix64(x); }
HQH hq_u64 hqh_derive_key(hq_u64 seed, const hq_u64* fields, int nfields) {
  return hq_derive_key(seed, fields, nfields);
}
HQH void hqh_hash32(const hq_u64* idx, hq_i64 n, hq_u32 k0, hq_u32 k1, hq_u32* out) {
  for (hq_i64 i = 0; i < n; ++i) out[i] = hq_hash32(idx[i], k0, k1);
}
HQH void hqh_hash32_lo(const hq_u32* lo, hq_i64 n, hq_u32 kb, hq_u32 k1, hq_u32* out) {
  for (hq_i64 i = 0; i < n; ++i) out[i] = hq_hash32_lo(lo[i], kb, k1);
}
HQH void hqh_block_key(const hq_u64* start, hq_i64 n, hq_u32 k0, hq_u32* out) {
  for (hq_i64 i = 0; i < n; ++i) out[i] = hq_block_key(start[i], k0);
}
HQH void hqh_u24(const hq_u32* h, hq_i64 n, float* out) {
  for (hq_i64 i = 0; i < n; ++i) out[i] = hq_u24(h[i]);
}
HQH hq_i64 hqh_packed_nbytes(hq_i64 n, int bits) { return hq_packed_nbytes(n, bits); }

// kernel hq_pack, grid = number of packing blocks
HQH void hqh_pack(const hq_u8* codes, hq_i64 n, int bits, hq_u8* out, int nt) {
  HqHostEx ex;
  ex.nt = nt;
  std::vector<hq_u8> sh(HQ_PACK_BLOCK);
  for (hq_i64 blk = 0; blk * HQ_PACK_BLOCK < n; ++blk) hq_pack_block(ex, codes, n, bits, blk, out, sh.data());
}

// kernel hq_unpack
HQH void hqh_unpack(const hq_u8* packed, hq_i64 n, int bits, hq_u8* codes) {
  for (hq_i64 i = 0; i < n; ++i) codes[i] = (hq_u8)hq_packed_code(packed, n, bits, i);
}

// kernel hq_scales, grid = ceil(nb / (nt / 8))
HQH void hqh_scales(const float* x, hq_i64 n, hq_i64 bucket, int kind, double p, float* scales,
                    int nt) {
  HqHostEx ex;
  ex.nt = nt;
  std::vector<double> lanes(nt);
  const hq_i64 nb = (n + bucket - 1) / bucket;
  const int per = nt / HQ_LANES;
  for (hq_i64 blk = 0; blk * per < nb; ++blk) {
    const hq_i64 kb0 = blk * per;
    const hq_i64 kb1 = kb0 + per < nb ? kb0 + per : nb;
    hq_scales_phase(ex, x, 0, n, bucket, kb0, kb1, kind, p, lanes.data(), scales);
  }
}

// kernels hq_max_bits (grid = packing blocks, atomicMax -> max) + hq_scales_from_bits
HQH void hqh_max_scales(const float* x, hq_i64 n, hq_i64 bucket, int kind, float* scales, int nt) {
  const hq_i64 nb = (n + bucket - 1) / bucket;
  std::vector<int> mbits(nb, 0);
  for (hq_i64 blk = 0; blk * HQ_PACK_BLOCK < n; ++blk) {
    const hq_i64 tile = blk * HQ_PACK_BLOCK;
    for (int t = 0; t < nt; ++t) {
      hq_i64 cur = -1;
      hq_i32 best = 0;
      for (hq_i64 i = tile + t; i < n && i < tile + HQ_PACK_BLOCK; i += nt) {
        const hq_i64 kk = i / bucket;
        if (kk != cur) {
          if (cur >= 0 && best > mbits[cur]) mbits[cur] = best;
          cur = kk;
          best = 0;
        }
        const hq_i32 a = (hq_i32)(hq_f2u(x[i]) & 0x7FFFFFFFu);
        best = a > best ? a : best;
      }
      if (cur >= 0 && best > mbits[cur]) mbits[cur] = best;
    }
  }
  for (hq_i64 kk = 0; kk < nb; ++kk) {
    double lanes[HQ_LANES] = {(double)mbits[kk], 0, 0, 0, 0, 0, 0, 0};
    scales[kk] = hq_lanes_scale(lanes, kind, 0.0);
  }
}

// kernel hq_encode, grid = packing blocks
HQH void hqh_encode(const float* x, hq_i64 n, hq_i64 bucket, int mode, int bits, int norm_kind,
                    double p, int s, int c, int M, int k, float am, float gnorm, hq_u32 k0,
                    hq_u32 k1, hq_u8* out, hq_i64 scales_off, hq_i64 codes_off, int fused,
                    int nt) {
  HqHostEx ex;
  ex.nt = nt;
  HqEnc e;
  e.mode = mode;
  e.bits = bits;
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
  std::vector<float> sx(HQ_PACK_BLOCK);
  std::vector<hq_u8> sc(HQ_PACK_BLOCK);
  std::vector<double> sl(nt);
  HqEncShared sh;
  sh.x = sx.data();
  sh.codes = sc.data();
  sh.lanes = sl.data();
  float* scales = reinterpret_cast<float*>(out + scales_off);
  for (hq_i64 blk = 0; blk * HQ_PACK_BLOCK < n; ++blk)
    hq_encode_block(ex, e, x, n, bucket, blk, scales, fused != 0, out + codes_off, sh);
}

// kernel hq_codes
HQH void hqh_codes(const float* x, hq_i64 n, int mode, int bits, int s, int c, float gnorm,
                   hq_u32 k0, hq_u32 k1, hq_u8* codes) {
  HqEnc e;
  e.mode = mode;
  e.bits = bits;
  e.norm_kind = 0;
  e.p = 2.0;
  e.s = s;
  e.c = c;
  e.M = 0;
  e.k = 0;
  e.am = 0.0f;
  e.gnorm = gnorm;
  e.k0 = k0;
  e.k1 = k1;
  const HqBucket b = hq_bucket_params(e, 0.0f);
  for (hq_i64 i = 0; i < n; ++i) codes[i] = (hq_u8)hq_encode_code(e, b, x[i], hq_hash32((hq_u64)i, k0, k1));
}

// kernel hq_decode_levels (groups of HQ_GROUP elements per thread)
HQH void hqh_decode_levels(const hq_u8* const* pays, int npay, hq_i64 scales_off, hq_i64 codes_off,
                           const float* gscale, hq_i64 n, hq_i64 bucket, int bits,
                           const float* table, float* out, int accumulate, int has_post,
                           float post) {
  const hq_i64 groups = (n + HQ_GROUP - 1) / HQ_GROUP;
  for (hq_i64 gi = 0; gi < groups; ++gi) {
    const hq_i64 i0 = gi * HQ_GROUP;
    const int cnt = (int)(n - i0 < HQ_GROUP ? n - i0 : HQ_GROUP);
    float acc[HQ_GROUP] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (accumulate)
      for (int e = 0; e < cnt; ++e) acc[e] = out[i0 + e];
    hq_decode_levels_group(pays, npay, scales_off, codes_off, gscale, n, bucket, bits, table, acc,
                           accumulate != 0, i0, cnt);
    if (has_post)
      for (int e = 0; e < cnt; ++e) acc[e] = hq_fmul(acc[e], post);
    for (int e = 0; e < cnt; ++e) out[i0 + e] = acc[e];
  }
}

// kernel hq_decode_dither
HQH void hqh_decode_dither(const hq_u8* const* pays, int npay, hq_i64 scales_off, hq_i64 codes_off,
                           const hq_u32* keys, hq_i64 n, hq_i64 bucket, int bits, int M, float* out,
                           int accumulate, int has_post, float post) {
  for (hq_i64 i = 0; i < n; ++i) {
    float acc = accumulate ? out[i] : 0.0f;
    acc = hq_decode_dither_elem(pays, npay, scales_off, codes_off, keys, n, bucket, bits, M, acc,
                                accumulate != 0, i);
    if (has_post) acc = hq_fmul(acc, post);
    out[i] = acc;
  }
}

// kernels hq_decode_nested + hq_resid_sum
HQH void hqh_decode_nested(const hq_u8* d, hq_i64 scales_off, hq_i64 codes_off, hq_i64 n,
                           hq_i64 bucket, int M, int k, int bits, float am, float alpha,
                           const float* y, hq_u32 k0, hq_u32 k1, float* out, double* sum,
                           hq_i64* count) {
  std::vector<float> resid(n > 0 ? n : 1);
  for (hq_i64 i = 0; i < n; ++i) {
    float r;
    out[i] = hq_decode_nested_elem(d, scales_off, codes_off, n, bucket, M, k, bits, am, alpha, y[i],
                                   k0, k1, out[i], &r, i);
    resid[i] = r;
  }
  double lanes[HQ_LANES];
  for (int l = 0; l < HQ_LANES; ++l) lanes[l] = hq_resid_lane(resid.data(), d, scales_off, n, bucket, l);
  double acc = 0.0;
  for (int j = 0; j < HQ_LANES; ++j) acc = hq_dadd(acc, lanes[j]);
  *sum = acc;
  hq_i64 cnt = 0;
  const hq_i64 nb = (n + bucket - 1) / bucket;
  for (hq_i64 kk = 0; kk < nb; ++kk) {
    const float kap = hq_load_f32(d + scales_off + 4 * kk);
    if (kap > 0.0f && hq_isfinite(kap)) {
      const hq_i64 lo = kk * bucket;
      cnt += (lo + bucket < n ? lo + bucket : n) - lo;
    }
  }
  *count = cnt;
}

// kernel hq_linear_encode
HQH void hqh_linear_encode(const float* x, hq_i64 n, int bits, int s, float norm, hq_u32 k0,
                           hq_u32 k1, hq_u64* words, hq_i64 nwords) {
  const bool ok = norm > 0.0f && hq_isfinite(norm);
  const float boost = hq_norm_boost(norm);
  const float mult = ok ? hq_fdiv((float)s, hq_fmul(norm, boost)) : 0.0f;
  for (hq_i64 w = 0; w < nwords; ++w) words[w] = hq_linear_word(x, n, bits, s, boost, mult, k0, k1, w);
}

// kernel hq_linear_decode
HQH void hqh_linear_decode(const hq_u64* words, hq_i64 n, int bits, int offset, float scale,
                           float* out, int accumulate) {
  for (hq_i64 i = 0; i < n; ++i) {
    const float v = hq_linear_value(words, n, bits, offset, scale, i);
    out[i] = accumulate ? hq_fadd(out[i], v) : v;
  }
}

// kernel hq_exp_combine, grid = packing blocks
HQH void hqh_exp_combine(const hq_u8* a, const hq_u8* b, hq_u8* out, hq_i64 n, hq_i64 first,
                         int bits, hq_u32 k0, hq_u32 k1, int nt) {
  HqHostEx ex;
  ex.nt = nt;
  std::vector<hq_u8> sh(HQ_PACK_BLOCK);
  for (hq_i64 blk = 0; blk * HQ_PACK_BLOCK < n; ++blk)
    hq_combine_block(ex, a, b, out, n, first, bits, k0, k1, blk, sh.data());
}

// combined code of single elements (for the rare exact path)
HQH hq_u32 hqh_combine_elem(hq_u32 a, hq_u32 b, hq_u64 index, int bits, hq_u32 k0, hq_u32 k1) {
  return hq_combine_elem(a, b, index, bits, k0, k1);
}
HQH hq_i32 hqh_combine_codes(hq_i32 a, hq_i32 b, hq_u32 h, hq_i32 smask) {
  return hq_combine_codes(a, b, h, smask);
}

// kernels hq_max_abs_bits / hq_sum_squares
HQH hq_i32 hqh_max_abs_bits(const float* x, hq_i64 n) {
  hq_i32 best = 0;
  for (hq_i64 i = 0; i < n; ++i) {
    const hq_i32 a = hq_abs_bits(x[i]);
    best = a > best ? a : best;
  }
  return best;
}
HQH double hqh_sum_squares(const float* x, hq_i64 n) {
  double lanes[HQ_LANES];
  for (int l = 0; l < HQ_LANES; ++l) lanes[l] = hq_lane_value(x, n, l, HQ_NORM_L2, 2.0);
  double acc = 0.0;
  for (int j = 0; j < HQ_LANES; ++j) acc = hq_dadd(acc, lanes[j]);
  return acc;
}

// kernels hq_scale / hq_to_f32 / hq_decode_sparse
HQH void hqh_scale(const float* src, hq_i64 n, float f, float* dst) {
  for (hq_i64 i = 0; i < n; ++i) dst[i] = hq_fmul(src[i], f);
}
HQH void hqh_to_f32(const double* src, hq_i64 n, float* dst) {
  for (hq_i64 i = 0; i < n; ++i) dst[i] = (float)src[i];
}
HQH void hqh_decode_sparse(const hq_u8* data, hq_i64 cnt, int bits, const float* table, float scale,
                           float* out) {
  for (hq_i64 j = 0; j < cnt; ++j) hq_decode_sparse_elem(data, cnt, bits, table, scale, out, j);
}

// kernel hq_mean_parts (reduce.cu)
HQH void hqh_mean_parts(const float* const* parts, int nparts, hq_i64 n, float divisor,
                        float* out) {
  for (hq_i64 i = 0; i < n; ++i) out[i] = hq_mean_elem(parts, nparts, i, divisor);
}
