// levels.cu: encode / decode of the packed-code codecs (CuPy RawModule entry points).
//
//   hq_encode_tile_<mode>_<scale>_<bits>b   the fast encode (bits 4, 8; buckets of 4 .. 512
//                    elements with max / power-of-two / L2 scales, or the global norm): a warp
//                    per unit of 512 (8 bits) or 2 x 512 (4 bits) elements held in registers,
//                    no block barrier; shared memory only for L2's ordered sums
//                    (hq_encode_tile). Full packing blocks only.
//   hq_encode_block_<mode>_<bits>b   every other encode: one block per packing block (8192
//                    elements), x staged in shared memory, per-bucket scales when every bucket
//                    lies inside the block (norms in 8 float64 lanes combined in lane order),
//                    counter-based rounding, bit planes (hq_encode_block)
//   hq_scales        scales of buckets that straddle packing blocks (lane-ordered norms)
//   hq_max_bits      max |x| bit pattern per bucket by atomicMax (max / pow2 scales of large
//   hq_scales_from_bits   or straddling buckets: the max does not depend on the order)
//   hq_decode_words_levels_<bits>b   the fast decode (bits 4, 8; full packing blocks; power
//                    of two buckets >= 4 or one global scale): one 32-bit code word per thread
//   hq_decode_groups_levels_<bits>b  every other decode: 4 elements per thread
//                    Both: table[code] * scale of up to HQ_MAX_PAYLOADS payloads (pointers passed
//                    as arguments) summed in payload order, onto out / zero / nothing, optional
//                    final multiply (gather exchanges decode every peer in one pass).
//   hq_codes         unpacked codes (Global-QSGD sparse mode compacts them afterwards)
//   hq_pack / hq_unpack   pack / unpack an array of codes
//   hq_scale         dst = src * f (float32, IEEE: CuPy's own elementwise ops flush subnormals)
//   hq_to_f32        float64 -> float32 (round to nearest, subnormals kept)
//
// Launch with blockDim.x = HQ_THREADS. Build options: -fmad=false (the arithmetic also uses
// the _rn intrinsics).
#include "hq_codes.cuh"

#define HQ_THREADS 256

// units: HqTileShape<bits>::UNITS per full packing block; a warp per unit (grid-stride)
#define HQ_TILE_ENCODE_KERNEL(MNAME, MODE, SNAME, NORM, BITS)                               \
  extern "C" __global__ void __launch_bounds__(HQ_THREADS, 4)                                \
      hq_encode_tile_##MNAME##_##SNAME##_##BITS##b(                                          \
          const float* x, long long units, int log2_bucket, int s, int c, int M, int k,      \
          float am, float gnorm, unsigned int k0, unsigned int k1, unsigned char* out,       \
          long long scales_off, long long codes_off) {                                       \
    using S = HqTileShape<BITS>;                                                             \
    constexpr bool SUMS = NORM == HQ_NORM_L2; /* shared memory only for L2 scales */        \
    constexpr int WARPS = HQ_THREADS / 32;                                                   \
    __shared__ __align__(16) float sx[SUMS ? WARPS * S::PARTS * S::PART : 4];               \
    __shared__ double slanes[SUMS ? WARPS * 32 : 1];                                        \
    __shared__ float sscales[SUMS ? WARPS * S::PARTS * S::PART / 4 : 1];                    \
    HqDevWarpEx ex;                                                                          \
    const int warp = threadIdx.x / 32;                                                       \
    HqTileShared sh;                                                                         \
    sh.x = SUMS ? sx + warp * S::PARTS * S::PART : sx;                                       \
    sh.lanes = SUMS ? slanes + warp * 32 : slanes;                                           \
    sh.scales = SUMS ? sscales + warp * S::PARTS * S::PART / 4 : sscales;                    \
    const HqEnc e = hq_enc(NORM, 2.0, s, c, M, k, am, gnorm, k0, k1);                        \
    const hq_i64 warps = (hq_i64)gridDim.x * WARPS;                                          \
    for (hq_i64 u = (hq_i64)blockIdx.x * WARPS + warp; u < units; u += warps)               \
      hq_encode_tile<MODE, NORM, BITS>(ex, e, x, log2_bucket, u,                             \
                                       reinterpret_cast<float*>(out + scales_off),           \
                                       out + codes_off, sh);                                 \
  }
HQ_TILE_ENCODES(HQ_TILE_ENCODE_KERNEL)

// one block per packing block, blocks first_block, first_block + 1, ...
#define HQ_BLOCK_ENCODE_KERNEL(MNAME, MODE, BITS)                                            \
  extern "C" __global__ void __launch_bounds__(HQ_THREADS) hq_encode_block_##MNAME##_##BITS##b( \
      const float* x, long long n, long long bucket, int norm_kind, double p, int s, int c,  \
      int M, int k, float am, float gnorm, unsigned int k0, unsigned int k1,                 \
      unsigned char* out, long long scales_off, long long codes_off, int fused,              \
      long long first_block) {                                                               \
    __shared__ __align__(16) float sx[HQ_PACK_BLOCK]; /* float4 stores */                   \
    __shared__ hq_u8 scodes[HQ_PACK_BLOCK];                                                  \
    __shared__ double slanes[HQ_THREADS];                                                    \
    HqDevEx ex;                                                                              \
    ex.nt = (int)blockDim.x;                                                                 \
    HqEncShared sh;                                                                          \
    sh.x = sx;                                                                               \
    sh.codes = scodes;                                                                       \
    sh.lanes = slanes;                                                                       \
    hq_encode_block<MODE, BITS>(ex, hq_enc(norm_kind, p, s, c, M, k, am, gnorm, k0, k1), x, \
                                n, bucket, first_block + (hq_i64)blockIdx.x,                 \
                                reinterpret_cast<float*>(out + scales_off), fused != 0,      \
                                out + codes_off, sh);                                        \
  }
HQ_BLOCK_ENCODES(HQ_BLOCK_ENCODE_KERNEL)

// scales of buckets [blockIdx.x * nt/8, ...): 8 threads per bucket
extern "C" __global__ void __launch_bounds__(HQ_THREADS)
hq_scales(const float* x, long long n, long long bucket, int kind, double p, float* scales) {
  __shared__ double slanes[HQ_THREADS];
  HqDevEx ex;
  ex.nt = (int)blockDim.x;
  const hq_i64 nb = (n + bucket - 1) / bucket;
  const hq_i64 kb0 = (hq_i64)blockIdx.x * (ex.nt / HQ_LANES);
  const hq_i64 kb1 = kb0 + ex.nt / HQ_LANES < nb ? kb0 + ex.nt / HQ_LANES : nb;
  hq_scales_phase(ex, x, 0, n, bucket, kb0, kb1, kind, p, slanes, scales);
}

// mbits[k] = max over bucket k of the bit pattern of |x| (mbits zero-initialised)
extern "C" __global__ void __launch_bounds__(HQ_THREADS)
hq_max_bits(const float* x, long long n, long long bucket, int* mbits) {
  const hq_i64 tile = (hq_i64)blockIdx.x * HQ_PACK_BLOCK;
  hq_i64 cur = -1;
  hq_i32 best = 0;
  for (hq_i64 i = tile + threadIdx.x; i < n && i < tile + HQ_PACK_BLOCK; i += blockDim.x) {
    const hq_i64 kk = i / bucket;
    if (kk != cur) {
      if (cur >= 0) atomicMax(mbits + cur, best);
      cur = kk;
      best = 0;
    }
    const hq_i32 a = hq_abs_bits(x[i]);
    best = a > best ? a : best;
  }
  if (cur >= 0) atomicMax(mbits + cur, best);
}

extern "C" __global__ void hq_scales_from_bits(const int* mbits, long long nb, int kind,
                                               float* scales) {
  const hq_i64 kk = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (kk >= nb) return;
  scales[kk] = hq_max_scale(mbits[kk], kind);
}


// words of the full packing blocks: w in [0, nwords)
#define HQ_DECODE_WORDS_LEVELS_KERNEL(NAME, VALS, BITS)                                       \
  extern "C" __global__ void __launch_bounds__(HQ_THREADS) hq_decode_words_##NAME##_##BITS##b( \
      HQ_DECODE_PARAMS, const float* table, long long nwords) {                              \
    __shared__ float stable[1 << BITS];                                                      \
    for (int t = threadIdx.x; t < (1 << BITS); t += blockDim.x) stable[t] = table[t];        \
    __syncthreads();                                                                         \
    const HqDecode d = HQ_DECODE_ARGS;                                                       \
    const VALS vals = {stable};                                                              \
    const hq_i64 stride = (hq_i64)gridDim.x * blockDim.x;                                    \
    for (hq_i64 w = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x; w < nwords; w += stride)  \
      hq_decode_word<BITS>(d, vals, w);                                                      \
  }
HQ_WORD_DECODES(HQ_DECODE_WORDS_LEVELS_KERNEL, levels, HqLevelValues)

// groups of 4 elements from element `first` (a multiple of 4) to n
#define HQ_DECODE_GROUPS_LEVELS_KERNEL(NAME, VALS, BITS)                                      \
  extern "C" __global__ void __launch_bounds__(HQ_THREADS) hq_decode_groups_##NAME##_##BITS##b( \
      HQ_DECODE_PARAMS, const float* table, long long first) {                               \
    __shared__ float stable[1 << BITS];                                                      \
    for (int t = threadIdx.x; t < (1 << BITS); t += blockDim.x) stable[t] = table[t];        \
    __syncthreads();                                                                         \
    const HqDecode d = HQ_DECODE_ARGS;                                                       \
    const VALS vals = {stable};                                                              \
    const hq_i64 groups = (n - first + HQ_GROUP - 1) / HQ_GROUP;                             \
    const hq_i64 stride = (hq_i64)gridDim.x * blockDim.x;                                    \
    for (hq_i64 g = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride)  \
      hq_decode_group<BITS>(d, vals, first + g * HQ_GROUP);                                  \
  }
HQ_GROUP_DECODES(HQ_DECODE_GROUPS_LEVELS_KERNEL, levels, HqLevelValues)

// unpacked codes of the global-norm modes (EXP, LINEAR_SM)
template <int MODE>
__device__ void hq_codes_of(const float* x, long long n, int bits, int s, int c, float gnorm,
                            unsigned int k0, unsigned int k1, unsigned char* codes) {
  const HqEnc e = hq_enc(HQ_NORM_L2, 2.0, s, c, 0, 0, 0.0f, gnorm, k0, k1);
  const HqBucket b = hq_bucket_params<MODE>(e, 0.0f);
  const hq_i32 smask = 1 << (bits - 1);
  const hq_i64 stride = (hq_i64)gridDim.x * blockDim.x;
  for (hq_i64 i = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    codes[i] = (hq_u8)hq_encode_code<MODE>(e, b, x[i], hq_hash32((hq_u64)i, k0, k1), smask);
}

extern "C" __global__ void __launch_bounds__(HQ_THREADS)
hq_codes(const float* x, long long n, int mode, int bits, int s, int c, float gnorm,
         unsigned int k0, unsigned int k1, unsigned char* codes) {
  if (mode == HQ_MODE_EXP)
    hq_codes_of<HQ_MODE_EXP>(x, n, bits, s, c, gnorm, k0, k1, codes);
  else
    hq_codes_of<HQ_MODE_LINEAR_SM>(x, n, bits, s, c, gnorm, k0, k1, codes);
}

extern "C" __global__ void __launch_bounds__(HQ_THREADS)
hq_pack(const unsigned char* codes, long long n, int bits, unsigned char* out) {
  __shared__ hq_u8 scodes[HQ_PACK_BLOCK];
  HqDevEx ex;
  ex.nt = (int)blockDim.x;
#define HQ_PACK(B) hq_pack_block<B>(ex, codes, n, (hq_i64)blockIdx.x, out, scodes)
  HQ_WITH_BITS(bits, HQ_PACK)
#undef HQ_PACK
}

// codes of n packed elements (tests / debugging)
extern "C" __global__ void hq_unpack(const unsigned char* packed, long long n, int bits,
                                     unsigned char* codes) {
  const hq_i64 stride = (hq_i64)gridDim.x * blockDim.x;
#define HQ_UNPACK(B)                                                                    \
  for (hq_i64 i = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) \
    codes[i] = (hq_u8)hq_packed_code<B>(packed, n, i);
  HQ_WITH_BITS(bits, HQ_UNPACK)
#undef HQ_UNPACK
}

extern "C" __global__ void __launch_bounds__(HQ_THREADS)
hq_scale(const float* src, long long n, float f, float* dst) {
  const hq_i64 stride = (hq_i64)gridDim.x * blockDim.x;
  for (hq_i64 i = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] = hq_fmul(src[i], f);
}

extern "C" __global__ void __launch_bounds__(HQ_THREADS)
hq_to_f32(const double* src, long long n, float* dst) {
  const hq_i64 stride = (hq_i64)gridDim.x * blockDim.x;
  for (hq_i64 i = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] = __double2float_rn(src[i]);
}
