// Host build of the kernels' block programs, for tests/cuda_parity/test_host_parity.py.
//
// Compiled by nvcc as host code (the __host__ __device__ functions of kernels/*.cuh) into a
// shared library loaded with ctypes. Each hqh_* function replays one CUDA kernel of
// kernels/*.cu on the CPU: the same block programs, every thread of a block in turn between
// two syncs (HqHostEx), every block in turn; the warp programs (encode tiles) warp by warp,
// their collectives over the 32 lanes; the elementwise kernels (and the decode programs,
// whose threads share nothing) are loops over the same functions, every specialisation the
// kernels instantiate through the same lists (HQ_TILE_ENCODES, ...). Nothing here computes a
// result by other means.
#include "../../kernels/hq_global.cuh"
#include "../../kernels/hq_reduce.cuh"

#include <stdlib.h>
#include <vector>

#define HQH extern "C"

// a compile-time int for the host's generic lambdas (the host build may use them; NVRTC may not)
template <int V>
struct HqInt {
  static constexpr int value = V;
};

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
#define HQH_PACK(B)                                    \
  for (hq_i64 blk = 0; blk * HQ_PACK_BLOCK < n; ++blk) \
    hq_pack_block<B>(ex, codes, n, blk, out, sh.data());
  HQ_WITH_BITS(bits, HQH_PACK)
#undef HQH_PACK
}

// kernel hq_unpack
HQH void hqh_unpack(const hq_u8* packed, hq_i64 n, int bits, hq_u8* codes) {
#define HQH_UNPACK(B) \
  for (hq_i64 i = 0; i < n; ++i) codes[i] = (hq_u8)hq_packed_code<B>(packed, n, i);
  HQ_WITH_BITS(bits, HQH_UNPACK)
#undef HQH_UNPACK
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
        const hq_i32 a = hq_abs_bits(x[i]);
        best = a > best ? a : best;
      }
      if (cur >= 0 && best > mbits[cur]) mbits[cur] = best;
    }
  }
  for (hq_i64 kk = 0; kk < nb; ++kk) scales[kk] = hq_max_scale(mbits[kk], kind);
}

// kernels hq_encode_tile_*, a warp per unit (grid-stride); -1: no such specialisation
HQH int hqh_encode_tile(int mode, int norm, int bits, const float* x, hq_i64 units,
                        int log2_bucket, int s, int c, int M, int k, float am, float gnorm,
                        hq_u32 k0, hq_u32 k1, hq_u8* out, hq_i64 scales_off, hq_i64 codes_off) {
  const HqEnc e = hq_enc(norm, 2.0, s, c, M, k, am, gnorm, k0, k1);
  float* scales = reinterpret_cast<float*>(out + scales_off);
  HqHostEx ex;
  ex.nt = 32;
  std::vector<float> sx(2 * 512);  // one warp's shared memory (HqTileShared), the largest unit
  std::vector<double> slanes(32);
  std::vector<float> sscales(2 * 512 / 4);
  const HqTileShared sh = {sx.data(), slanes.data(), sscales.data()};
#define HQH_TILE(MN, MODE, SN, NORM, BITS)                                                \
  if (mode == MODE && norm == NORM && bits == BITS) {                                      \
    for (hq_i64 u = 0; u < units; ++u)                                                     \
      hq_encode_tile<MODE, NORM, BITS>(ex, e, x, log2_bucket, u, scales, out + codes_off, sh); \
    return 0;                                                                              \
  }
  HQ_TILE_ENCODES(HQH_TILE)
#undef HQH_TILE
  return -1;
}

// kernels hq_encode_block_*, grid = packing blocks first_block, ...
HQH int hqh_encode_block(int mode, int bits, const float* x, hq_i64 n, hq_i64 bucket,
                         int norm_kind, double p, int s, int c, int M, int k, float am,
                         float gnorm, hq_u32 k0, hq_u32 k1, hq_u8* out, hq_i64 scales_off,
                         hq_i64 codes_off, int fused, hq_i64 first_block, int nt) {
  const HqEnc e = hq_enc(norm_kind, p, s, c, M, k, am, gnorm, k0, k1);
  HqHostEx ex;
  ex.nt = nt;
  std::vector<float> sx(HQ_PACK_BLOCK);
  std::vector<hq_u8> sc(HQ_PACK_BLOCK);
  std::vector<double> sl(nt);
  HqEncShared sh;
  sh.x = sx.data();
  sh.codes = sc.data();
  sh.lanes = sl.data();
  float* scales = reinterpret_cast<float*>(out + scales_off);
#define HQH_BLOCK(MN, MODE, BITS)                                                         \
  if (mode == MODE && bits == BITS) {                                                    \
    for (hq_i64 blk = first_block; blk * HQ_PACK_BLOCK < n; ++blk)                       \
      hq_encode_block<MODE, BITS>(ex, e, x, n, bucket, blk, scales, fused != 0,          \
                                  out + codes_off, sh);                                  \
    return 0;                                                                            \
  }
  HQ_BLOCK_ENCODES(HQH_BLOCK)
#undef HQH_BLOCK
  return -1;
}

// kernel hq_codes
HQH void hqh_codes(const float* x, hq_i64 n, int mode, int bits, int s, int c, float gnorm,
                   hq_u32 k0, hq_u32 k1, hq_u8* codes) {
  const HqEnc e = hq_enc(HQ_NORM_L2, 2.0, s, c, 0, 0, 0.0f, gnorm, k0, k1);
  const hq_i32 smask = 1 << (bits - 1);
  auto run = [&](auto M) {
    constexpr int MODE = decltype(M)::value;
    const HqBucket b = hq_bucket_params<MODE>(e, 0.0f);
    for (hq_i64 i = 0; i < n; ++i)
      codes[i] = (hq_u8)hq_encode_code<MODE>(e, b, x[i], hq_hash32((hq_u64)i, k0, k1), smask);
  };
  if (mode == HQ_MODE_EXP)
    run(HqInt<HQ_MODE_EXP>());
  else
    run(HqInt<HQ_MODE_LINEAR_SM>());
}

// kernels hq_decode_words_* (words: elements [0, range) of full packing blocks) and
// hq_decode_groups_* (range: the first element); kind 0: levels (table), 1: dither (keys, M).
// -1: no such specialisation.
HQH int hqh_decode(int kind, int words, int bits, const hq_u64* pays, int npay,
                   hq_i64 scales_off, hq_i64 codes_off, float gscale, hq_i64 n, hq_i64 bucket,
                   int log2_bucket, float* out, int start, int has_post, float post,
                   hq_i64 range, const float* table, const hq_u64* keys, int M) {
  HqDecode d;
  for (int q = 0; q < HQ_MAX_PAYLOADS; ++q) d.pays[q] = reinterpret_cast<const hq_u8*>(pays[q]);
  d.npay = npay;
  d.scales_off = scales_off;
  d.codes_off = codes_off;
  d.gscale = gscale;
  d.n = n;
  d.bucket = bucket;
  d.log2_bucket = log2_bucket;
  d.out = out;
  d.start = start;
  d.has_post = has_post != 0;
  d.post = post;
  HqLevelValues levels = {table};
  HqDitherValues dither;
  for (int q = 0; q < HQ_MAX_PAYLOADS; ++q) {
    dither.k0[q] = (hq_u32)keys[q];
    dither.k1[q] = (hq_u32)(keys[q] >> 32);
  }
  dither.M = M;
  auto run = [&](auto B, const auto& vals) {
    constexpr int BITS = decltype(B)::value;
    if (words) {
      for (hq_i64 w = 0; w < range / 32 * BITS; ++w) hq_decode_word<BITS>(d, vals, w);
    } else {
      for (hq_i64 i0 = range; i0 < n; i0 += HQ_GROUP) hq_decode_group<BITS>(d, vals, i0);
    }
  };
  if (words && bits != 4 && bits != 8) return -1;
  if (bits < 2 || bits > 8) return -1;
#define HQH_DECODE(B)        \
  if (kind == 0)             \
    run(HqInt<B>(), levels); \
  else                       \
    run(HqInt<B>(), dither);
  HQ_WITH_BITS(bits, HQH_DECODE)
#undef HQH_DECODE
  return 0;
}

// kernels hq_decode_nested + hq_resid_sum
HQH void hqh_decode_nested(const hq_u8* d, hq_i64 scales_off, hq_i64 codes_off, hq_i64 n,
                           hq_i64 bucket, int M, int k, int bits, float am, float alpha,
                           const float* y, hq_u32 k0, hq_u32 k1, float* out, double* sum,
                           hq_i64* count) {
  std::vector<float> resid(n > 0 ? n : 1);
  for (hq_i64 i = 0; i < n; ++i) {
    float r;
#define HQH_NESTED(B)                                                                      \
  out[i] = hq_decode_nested_elem<B>(d, scales_off, codes_off, n, bucket, M, k, am, alpha, y[i], \
                                    k0, k1, out[i], &r, i);
    HQ_WITH_BITS(bits, HQH_NESTED)
#undef HQH_NESTED
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
                         int bits, hq_u32 k0, hq_u32 k1, hq_i64 first_block, int nt) {
  HqHostEx ex;
  ex.nt = nt;
  std::vector<hq_u8> sh(HQ_PACK_BLOCK);
#define HQH_COMBINE(B)                                           \
  for (hq_i64 blk = first_block; blk * HQ_PACK_BLOCK < n; ++blk) \
    hq_combine_block<B>(ex, a, b, out, n, first, k0, k1, blk, sh.data());
  HQ_WITH_BITS(bits, HQH_COMBINE)
#undef HQH_COMBINE
}

// kernels hq_exp_combine_words_<bits>b: the words of elements [0, end); -1: no such kernel
HQH int hqh_exp_combine_words(const hq_u8* a, const hq_u8* b, hq_u8* out, hq_i64 end,
                              hq_i64 first, int bits, hq_u32 k0, hq_u32 k1) {
  if (bits == 4) {
    for (hq_i64 w = 0; w < end / 32 * 4; ++w) hq_combine_word<4>(a, b, out, first, k0, k1, w);
  } else if (bits == 8) {
    for (hq_i64 w = 0; w < end / 32 * 8; ++w) hq_combine_word<8>(a, b, out, first, k0, k1, w);
  } else {
    return -1;
  }
  return 0;
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
#define HQH_SPARSE(B) \
  for (hq_i64 j = 0; j < cnt; ++j) hq_decode_sparse_elem<B>(data, cnt, table, scale, out, j);
  HQ_WITH_BITS(bits, HQH_SPARSE)
#undef HQH_SPARSE
}

// kernel hq_mean_parts (reduce.cu)
HQH void hqh_mean_parts(const float* const* parts, int nparts, hq_i64 n, float divisor,
                        float* out) {
  for (hq_i64 i = 0; i < n; ++i) out[i] = hq_mean_elem(parts, nparts, i, divisor);
}
