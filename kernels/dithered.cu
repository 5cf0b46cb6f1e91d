// dithered.cu: DQSG / NDQSG decoding (CuPy RawModule entry points). Encoding is hq_encode of
// levels.cu (modes HQ_MODE_DITHER / HQ_MODE_NESTED); the receiver regenerates each sender's
// dither from its key in the kernel (backends/numba/dithered.py).
//
//   hq_decode_dither   x_hat of n P1 payloads summed in payload order (decode / decode_add)
//   hq_decode_nested   out += x_hat of one P2 payload with side information y; writes the
//                      residuals (r - Q2(r)) / Delta1 for the sigma_z^2 estimate
//   hq_resid_sum       their sum of squares in decode_nested's lane order (8 threads) and count
#include "hq_codes.cuh"

#define HQ_THREADS 256

extern "C" __global__ void __launch_bounds__(HQ_THREADS)
hq_decode_dither(const unsigned long long* ptrs, int npay, long long scales_off,
                 long long codes_off, const unsigned int* keys, long long n, long long bucket,
                 int bits, int M, float* out, int accumulate, int has_post, float post) {
  const hq_u8* const* pays = reinterpret_cast<const hq_u8* const*>(ptrs);
  const hq_i64 stride = (hq_i64)gridDim.x * blockDim.x;
  for (hq_i64 i = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    float acc = accumulate ? out[i] : 0.0f;
    acc = hq_decode_dither_elem(pays, npay, scales_off, codes_off, keys, n, bucket, bits, M, acc,
                                accumulate != 0, i);
    if (has_post) acc = hq_fmul(acc, post);
    out[i] = acc;
  }
}

extern "C" __global__ void __launch_bounds__(HQ_THREADS)
hq_decode_nested(const unsigned char* d, long long scales_off, long long codes_off, long long n,
                 long long bucket, int M, int k, int bits, float am, float alpha, const float* y,
                 unsigned int k0, unsigned int k1, float* out, float* resid) {
  const hq_i64 stride = (hq_i64)gridDim.x * blockDim.x;
  for (hq_i64 i = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    float r;
    out[i] = hq_decode_nested_elem(d, scales_off, codes_off, n, bucket, M, k, bits, am, alpha,
                                   y[i], k0, k1, out[i], &r, i);
    resid[i] = r;
  }
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
