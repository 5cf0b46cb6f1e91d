// reduce.cu: the float32 mean of a hierarchical exchange's host shards (CuPy RawModule entry
// point; element function in hq_reduce.cuh).
//
//   hq_mean_parts    out[i] = (parts[0][i] + ... + parts[nparts - 1][i]) / divisor, added in
//                    part (local rank) order, IEEE (_rn), subnormals kept
//
// Launch with blockDim.x = HQ_THREADS (grid-stride loop).
// Build options: -fmad=false -ftz=false (the arithmetic also uses the _rn intrinsics).
#include "hq_reduce.cuh"

#define HQ_THREADS 256

extern "C" __global__ void __launch_bounds__(HQ_THREADS)
hq_mean_parts(const float* const* parts, int nparts, long long n, float divisor, float* out) {
  const hq_i64 stride = (hq_i64)gridDim.x * blockDim.x;
  for (hq_i64 i = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = hq_mean_elem(parts, nparts, i, divisor);
}
