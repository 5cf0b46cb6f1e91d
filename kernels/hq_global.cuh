// hq_global.cuh: Global-QSGD pieces that are not plain packed codes.
//
// Mirrors, bit for bit:
//   backends/numba/global_qsgd.py  encode_linear / decode_linear (summable uint64 words, WORD_BLOCK),
//                        _max_abs, _sum_squares (the norm statistics)
//   backends/numba/global_qsgd.py  _combine_lanes, _up_exact, exp_combine (Algorithm 2 on
//                        packed codes)
#ifndef HQ_GLOBAL_CUH
#define HQ_GLOBAL_CUH

#include "hq_codes.cuh"

// ------------------------------------------------------------------------------------------
// linear levels in uint64 words
// ------------------------------------------------------------------------------------------
// Word `w` of the linear layout: F = 64 / bits fields; in a block of m elements with
// L = ceil(m / F) words, word j holds elements e0 + j + f L (f < F) at bits f * bits, each as
// level + s. boost: 2^64 for norms below 2^-100 else 1; mult = s / (norm boost) when the norm
// is > 0 and finite, else 0 (then t = (|x| boost) * 0, NaN for an overflowing |x| boost,
// exactly as global_qsgd.encode_linear computes it).
HQ_HD float hq_norm_boost(float norm) { return norm < HQ_TINY_SCALE ? HQ_TINY_BOOST : 1.0f; }

HQ_HD hq_u64 hq_linear_word(const float* x, hq_i64 n, int bits, int s, float boost, float mult,
                            hq_u32 k0, hq_u32 k1, hq_i64 w) {
  const int per = 64 / bits;
  const hq_i64 w0 = (w / HQ_WORD_BLOCK) * HQ_WORD_BLOCK;
  const hq_i64 e0 = w0 * per;
  const hq_i64 rem = n - e0;
  const hq_i64 m = rem < (hq_i64)HQ_WORD_BLOCK * per ? rem : (hq_i64)HQ_WORD_BLOCK * per;
  const hq_i64 L = hq_div(m + per - 1, per);
  const hq_i64 j = w - w0;
  const float fs = (float)s;
  hq_u64 word = 0;
  for (int f = 0; f < per; ++f) {
    const hq_i64 idx = j + f * L;
    if (idx >= m) break;
    const hq_i64 i = e0 + idx;
    const hq_i32 q = hq_linear_level(x[i], boost, mult, fs, hq_hash32((hq_u64)i, k0, k1));
    word |= (hq_u64)(hq_u32)(q + s) << (f * bits);
  }
  return word;
}

// Element i of linear words: (field - offset) * scale
HQ_HD float hq_linear_value(const hq_u64* words, hq_i64 n, int bits, hq_i32 offset, float scale,
                            hq_i64 i) {
  const int per = 64 / bits;
  const hq_i64 epb = (hq_i64)HQ_WORD_BLOCK * per;
  const hq_i64 e0 = hq_div(i, epb) * epb;
  const hq_i64 rem = n - e0;
  const hq_i64 m = rem < epb ? rem : epb;
  const hq_i64 L = hq_div(m + per - 1, per);
  const hq_i64 idx = i - e0;
  const hq_i64 f = hq_div(idx, L);
  const hq_i64 j = idx - f * L;
  const hq_u64 mask = (bits == 64) ? ~0ull : ((1ull << bits) - 1ull);
  const hq_i32 field = (hq_i32)((words[hq_div(e0, per) + j] >> (f * bits)) & mask);
  return hq_fmul((float)(field - offset), scale);
}

// ------------------------------------------------------------------------------------------
// exponent combination (backends/numba/global_qsgd.py)
// ------------------------------------------------------------------------------------------
#define HQ_ZERO_KEY (1 << 20)
#define HQ_EXT0 0x632BE5ABu
#define HQ_EXT1 0x85157AF5u

// _combine_lanes: Algorithm 2 on one pair of codes with the first 32 digits h of p
HQ_HD hq_i32 hq_combine_codes(hq_i32 a, hq_i32 b, hq_u32 h, hq_i32 smask) {
  const hq_i32 emask = smask - 1;
  const hq_i32 e1 = a & emask, e2 = b & emask;
  const hq_i32 k1 = e1 == 0 ? HQ_ZERO_KEY : e1;
  const hq_i32 k2 = e2 == 0 ? HQ_ZERO_KEY : e2;
  const bool leq = k1 <= k2;
  const hq_i32 lo = leq ? k1 : k2;
  const hq_i32 hi = leq ? k2 : k1;
  const hq_i32 sign = (leq ? a : b) & smask;
  const bool opp = ((a ^ b) & smask) != 0;
  const hq_i32 opp_m = opp ? -1 : 0;
  const hq_i32 gap = hi - lo;
  const hq_i32 diff = gap + opp_m;
  hq_i32 d1 = diff - 1;
  d1 = (hq_u32)d1 < 31u ? d1 : 31;
  const hq_u32 thr = 0x7FFFFFFFu >> d1;
  const bool up = diff <= 0 || h <= thr;
  const hq_i32 up_m = up ? -1 : 0;
  const hq_i32 e = lo + ((up_m ^ opp_m) - opp_m);
  const bool zero = lo == HQ_ZERO_KEY || (opp && gap == 0);
  return (e | sign) & ~(zero ? -1 : 0);
}

// _up_exact: [p < 2^-diff] for an element whose first 32 digits of p are zero
HQ_HD bool hq_up_exact(hq_i32 a, hq_i32 b, hq_u64 index, int bits, hq_u32 k0, hq_u32 k1) {
  const hq_i32 emask = (1 << (bits - 1)) - 1;
  const hq_i32 e1 = a & emask, e2 = b & emask;
  if (e1 == 0 || e2 == 0) return false;
  const hq_i32 gap = e1 > e2 ? e1 - e2 : e2 - e1;
  hq_i32 left = gap - (((a ^ b) >> (bits - 1)) ? 1 : 0) - 32;
  hq_u32 t = 1;
  while (left > 0) {
    const hq_u32 kt0 = k0 ^ (t * HQ_EXT0);
    const hq_u32 kt1 = k1 ^ (t * HQ_EXT1);
    const hq_u32 g = hq_hash32(index, kt0, kt1);
    if (left < 32) return (g >> (32 - left)) == 0;
    if (g != 0) return false;
    left -= 32;
    t += 1;
  }
  return true;
}

// Combined code of element `index` (codes a, b; key halves of the combination)
HQ_HD hq_u32 hq_combine_elem(hq_u32 a, hq_u32 b, hq_u64 index, int bits, hq_u32 k0, hq_u32 k1) {
  const hq_i32 smask = 1 << (bits - 1);
  hq_u32 h = hq_hash32(index, k0, k1);
  if (h == 0) h = hq_up_exact((hq_i32)a, (hq_i32)b, index, bits, k0, k1) ? 0u : 0xFFFFFFFFu;
  return (hq_u32)hq_combine_codes((hq_i32)a, (hq_i32)b, h, smask);
}

// Fast program (4- and 8-bit codes, full packing blocks): code word w of two packed ranges
// combined into out, which may alias a or b (each word is read, then written, by one thread;
// plain loads, since out may be a). a, b and out 4-byte aligned. The codes of a word are
// those of hq_decode_word: 4 elements, or 4 + 4 elements 4096 apart at 4 bits.
template <int BITS>
HQ_HD void hq_combine_word(const hq_u8* a, const hq_u8* b, hq_u8* out, hq_i64 first, hq_u32 k0,
                           hq_u32 k1, hq_i64 w) {
  constexpr int PARTS = 8 / BITS;
  constexpr int WORDS = HQ_PACK_BLOCK * BITS / 32;
  constexpr int PART_STRIDE = HQ_PACK_BLOCK / PARTS;
  constexpr hq_u32 MASK = (1u << BITS) - 1u;
  const hq_i64 blk = w / WORDS;
  const int j = 4 * (int)(w - blk * WORDS);
  const hq_i64 byte = blk * (HQ_PACK_BLOCK * BITS / 8) + j;
  hq_u32 wa, wb;
#ifdef __CUDA_ARCH__
  wa = *reinterpret_cast<const unsigned int*>(a + byte);
  wb = *reinterpret_cast<const unsigned int*>(b + byte);
#else
  memcpy(&wa, a + byte, 4);
  memcpy(&wb, b + byte, 4);
#endif
  const hq_i64 e0 = first + blk * HQ_PACK_BLOCK + j;
  hq_u32 word = 0;
#pragma unroll
  for (int p = 0; p < PARTS; ++p) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int sh = 8 * k + p * BITS;
      const hq_u32 c = hq_combine_elem((wa >> sh) & MASK, (wb >> sh) & MASK,
                                       (hq_u64)(e0 + p * PART_STRIDE + k), BITS, k0, k1);
      word |= (c & MASK) << sh;  // as the block program's byte store and packing keep it
    }
  }
  hq_store_u32(out + byte, word);
}

// Block program: combine packing block `blk` of two packed ranges (elements first + ...)
// into out (which may alias a or b: the block reads all its codes before writing).
template <int BITS, class Ex>
HQ_HDT inline void hq_combine_block(Ex& ex, const hq_u8* a, const hq_u8* b, hq_u8* out,
                                    hq_i64 n, hq_i64 first, hq_u32 k0, hq_u32 k1, hq_i64 blk,
                                    hq_u8* sh_codes) {
  const hq_i64 b0 = blk * HQ_PACK_BLOCK;
  const int m = (int)(n - b0 < HQ_PACK_BLOCK ? n - b0 : HQ_PACK_BLOCK);
  const hq_i64 off = hq_block_offset(blk, BITS);
  ex.each([&](int tid) {
    for (int j = tid; j < m; j += ex.nt) {
      const hq_u32 ca = hq_unpack_code<BITS>(a + off, m, j);
      const hq_u32 cb = hq_unpack_code<BITS>(b + off, m, j);
      sh_codes[j] = (hq_u8)hq_combine_elem(ca, cb, (hq_u64)(first + b0 + j), BITS, k0, k1);
    }
  });
  ex.sync();
  hq_pack_phase<BITS>(ex, sh_codes, m, out + off);
}

#endif  // HQ_GLOBAL_CUH
