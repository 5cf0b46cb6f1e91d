// dithered.cu: DQSG / NDQSG decoding (CuPy RawModule entry points). Encoding is the encode of
// levels.cu (modes HQ_MODE_DITHER / HQ_MODE_NESTED); the receiver regenerates each sender's
// dither from its key in the kernel (backends/numba/dithered.py).
//
//   hq_decode_words_dither_<bits>b   x_hat of up to HQ_MAX_PAYLOADS P1 payloads summed in
//   hq_decode_groups_dither_<bits>b  payload order (decode / decode_add / the gather mean):
//                      the word and group programs of levels.cu's decodes, with the keys of
//                      the senders as arguments
//   hq_decode_nested   out += x_hat of one P2 payload with side information y; writes the
//                      residuals (r - Q2(r)) / Delta1 for the sigma_z^2 estimate
//   hq_resid_sum       their sum of squares in decode_nested's lane order (8 threads) and count
#include "hq_codes.cuh"

#define HQ_THREADS 256


// sender keys: k0 | k1 << 32 per payload
#define HQ_KEY_PARAMS                                                                        \
  unsigned long long key0, unsigned long long key1, unsigned long long key2,                 \
      unsigned long long key3, unsigned long long key4, unsigned long long key5,             \
      unsigned long long key6, unsigned long long key7, int M

#define HQ_DITHER_VALUES                                                                     \
  {{(hq_u32)key0, (hq_u32)key1, (hq_u32)key2, (hq_u32)key3, (hq_u32)key4, (hq_u32)key5,      \
    (hq_u32)key6, (hq_u32)key7},                                                             \
   {(hq_u32)(key0 >> 32), (hq_u32)(key1 >> 32), (hq_u32)(key2 >> 32), (hq_u32)(key3 >> 32),  \
    (hq_u32)(key4 >> 32), (hq_u32)(key5 >> 32), (hq_u32)(key6 >> 32), (hq_u32)(key7 >> 32)}, \
   M}

#define HQ_DECODE_WORDS_DITHER_KERNEL(NAME, VALS, BITS)                                       \
  extern "C" __global__ void __launch_bounds__(HQ_THREADS) hq_decode_words_##NAME##_##BITS##b( \
      HQ_DECODE_PARAMS, HQ_KEY_PARAMS, long long nwords) {                                   \
    const HqDecode d = HQ_DECODE_ARGS;                                                       \
    const VALS vals = HQ_DITHER_VALUES;                                                      \
    const hq_i64 stride = (hq_i64)gridDim.x * blockDim.x;                                    \
    for (hq_i64 w = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x; w < nwords; w += stride)  \
      hq_decode_word<BITS>(d, vals, w);                                                      \
  }
HQ_WORD_DECODES(HQ_DECODE_WORDS_DITHER_KERNEL, dither, HqDitherValues)

#define HQ_DECODE_GROUPS_DITHER_KERNEL(NAME, VALS, BITS)                                      \
  extern "C" __global__ void __launch_bounds__(HQ_THREADS) hq_decode_groups_##NAME##_##BITS##b( \
      HQ_DECODE_PARAMS, HQ_KEY_PARAMS, long long first) {                                    \
    const HqDecode d = HQ_DECODE_ARGS;                                                       \
    const VALS vals = HQ_DITHER_VALUES;                                                      \
    const hq_i64 groups = (n - first + HQ_GROUP - 1) / HQ_GROUP;                             \
    const hq_i64 stride = (hq_i64)gridDim.x * blockDim.x;                                    \
    for (hq_i64 g = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride)  \
      hq_decode_group<BITS>(d, vals, first + g * HQ_GROUP);                                  \
  }
HQ_GROUP_DECODES(HQ_DECODE_GROUPS_DITHER_KERNEL, dither, HqDitherValues)

extern "C" __global__ void __launch_bounds__(HQ_THREADS)
hq_decode_nested(const unsigned char* d, long long scales_off, long long codes_off, long long n,
                 long long bucket, int M, int k, int bits, float am, float alpha, const float* y,
                 unsigned int k0, unsigned int k1, float* out, float* resid) {
  const hq_i64 stride = (hq_i64)gridDim.x * blockDim.x;
#define HQ_NESTED(B)                                                                     \
  for (hq_i64 i = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {    \
    float r;                                                                              \
    out[i] = hq_decode_nested_elem<B>(d, scales_off, codes_off, n, bucket, M, k, am, alpha, \
                                      y[i], k0, k1, out[i], &r, i);                       \
    resid[i] = r;                                                                         \
  }
  HQ_WITH_BITS(bits, HQ_NESTED)
#undef HQ_NESTED
}

// one block of 8 threads: sum[0] = sum of squared residuals, count[0] = elements counted
extern "C" __global__ void hq_resid_sum(const float* resid, const unsigned char* d,
                                        long long scales_off, long long n, long long bucket,
                                        double* sum, long long* count) {
  __shared__ double lanes[HQ_LANES];
  if (threadIdx.x < HQ_LANES)
    lanes[threadIdx.x] = hq_resid_lane(resid, d, scales_off, n, bucket, threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) {
    double acc = 0.0;
    for (int j = 0; j < HQ_LANES; ++j) acc = hq_dadd(acc, lanes[j]);
    sum[0] = acc;
    hq_i64 cnt = 0;
    const hq_i64 nb = (n + bucket - 1) / bucket;
    for (hq_i64 kk = 0; kk < nb; ++kk) {
      const float kap = hq_load_f32(d + scales_off + 4 * kk);
      if (kap > 0.0f && hq_isfinite(kap)) {
        const hq_i64 lo = kk * bucket;
        cnt += (lo + bucket < n ? lo + bucket : n) - lo;
      }
    }
    count[0] = cnt;
  }
}
