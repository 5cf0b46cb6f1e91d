// global_qsgd.cu: Global-QSGD kernels that are not plain packed codes (CuPy RawModule entry
// points). The exponential and sparse codes use the encodes / hq_codes of levels.cu.
//
//   hq_linear_encode   summable uint64 words (global_qsgd.encode_linear), one thread per word
//   hq_linear_decode   (field - offset) * scale, optional accumulate (decode_linear)
//   hq_exp_combine     Algorithm 2 on two packed exponent-code ranges, one block per packing
//                      block, randomness drawn in the kernel (global_qsgd.exp_combine)
//   hq_exp_combine_words_<bits>b   the same on the full packing blocks of 4- and 8-bit codes,
//                      one 32-bit code word per thread (no shared memory, no byte stores)
//   hq_max_abs_bits    max |x| bit pattern (atomicMax; _max_abs, NaN when >= 0x7F800000)
//   hq_decode_sparse   out[pos] += table[code] * scale for each entry of a sparse payload
//   hq_sum_squares     sum x^2 in 8 float64 lanes combined in lane order (_sum_squares); the
//                      lanes are sequential by definition, so this is 8 threads long
#include "hq_global.cuh"

#define HQ_THREADS 256

extern "C" __global__ void __launch_bounds__(HQ_THREADS)
hq_linear_encode(const float* x, long long n, int bits, int s, float norm, unsigned int k0,
                 unsigned int k1, unsigned long long* words, long long nwords) {
  const bool ok = norm > 0.0f && hq_isfinite(norm);
  const float boost = hq_norm_boost(norm);
  const float mult = ok ? hq_fdiv((float)s, hq_fmul(norm, boost)) : 0.0f;
  const hq_i64 stride = (hq_i64)gridDim.x * blockDim.x;
  for (hq_i64 w = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x; w < nwords; w += stride)
    words[w] = hq_linear_word(x, n, bits, s, boost, mult, k0, k1, w);
}

extern "C" __global__ void __launch_bounds__(HQ_THREADS)
hq_linear_decode(const unsigned long long* words, long long n, int bits, int offset, float scale,
                 float* out, int accumulate) {
  const hq_i64 stride = (hq_i64)gridDim.x * blockDim.x;
  for (hq_i64 i = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = hq_linear_value(words, n, bits, offset, scale, i);
    out[i] = accumulate ? hq_fadd(out[i], v) : v;
  }
}

extern "C" __global__ void __launch_bounds__(HQ_THREADS)
hq_exp_combine(const unsigned char* a, const unsigned char* b, unsigned char* out, long long n,
               long long first, int bits, unsigned int k0, unsigned int k1,
               long long first_block) {
  __shared__ hq_u8 scodes[HQ_PACK_BLOCK];
  HqDevEx ex;
  ex.nt = (int)blockDim.x;
  const hq_i64 blk = first_block + (hq_i64)blockIdx.x;
#define HQ_COMBINE(B) hq_combine_block<B>(ex, a, b, out, n, first, k0, k1, blk, scodes)
  HQ_WITH_BITS(bits, HQ_COMBINE)
#undef HQ_COMBINE
}

// words of the full packing blocks, w in [0, nwords)
#define HQ_EXP_COMBINE_WORDS_KERNEL(BITS)                                                    \
  extern "C" __global__ void __launch_bounds__(HQ_THREADS) hq_exp_combine_words_##BITS##b(  \
      const unsigned char* a, const unsigned char* b, unsigned char* out, long long first,  \
      unsigned int k0, unsigned int k1, long long nwords) {                                 \
    const hq_i64 stride = (hq_i64)gridDim.x * blockDim.x;                                   \
    for (hq_i64 w = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x; w < nwords; w += stride) \
      hq_combine_word<BITS>(a, b, out, first, k0, k1, w);                                   \
  }
HQ_EXP_COMBINE_WORDS_KERNEL(4)
HQ_EXP_COMBINE_WORDS_KERNEL(8)

// *result (zero-initialised) = max over x of the bit pattern of |x|
extern "C" __global__ void __launch_bounds__(HQ_THREADS)
hq_max_abs_bits(const float* x, long long n, int* result) {
  hq_i32 best = 0;
  const hq_i64 stride = (hq_i64)gridDim.x * blockDim.x;
  for (hq_i64 i = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const hq_i32 a = hq_abs_bits(x[i]);
    best = a > best ? a : best;
  }
  for (int o = 16; o > 0; o >>= 1) {
    const hq_i32 t = __shfl_down_sync(0xFFFFFFFFu, best, o);
    best = t > best ? t : best;
  }
  if ((threadIdx.x & 31) == 0) atomicMax(result, best);
}

// launch with one block of 8 threads: result[0] = sum x^2 (float64, lane order)
extern "C" __global__ void hq_sum_squares(const float* x, long long n, double* result) {
  __shared__ double lanes[HQ_LANES];
  if (threadIdx.x < HQ_LANES) lanes[threadIdx.x] = hq_lane_value(x, n, threadIdx.x, HQ_NORM_L2, 2.0);
  __syncthreads();
  if (threadIdx.x == 0) {
    double acc = 0.0;
    for (int j = 0; j < HQ_LANES; ++j) acc = hq_dadd(acc, lanes[j]);
    result[0] = acc;
  }
}

extern "C" __global__ void __launch_bounds__(HQ_THREADS)
hq_decode_sparse(const unsigned char* data, long long cnt, int bits, const float* table,
                 float scale, float* out) {
  const hq_i64 stride = (hq_i64)gridDim.x * blockDim.x;
#define HQ_SPARSE(B)                                                                      \
  for (hq_i64 j = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x; j < cnt; j += stride) \
    hq_decode_sparse_elem<B>(data, cnt, table, scale, out, j);
  HQ_WITH_BITS(bits, HQ_SPARSE)
#undef HQ_SPARSE
}
