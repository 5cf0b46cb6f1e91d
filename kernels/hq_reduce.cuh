// hq_reduce.cuh: the float32 mean of a host's shards in a hierarchical exchange, one element
// at a time, as a __host__ __device__ function (kernels/reduce.cu on the GPU, the host build of
// tests/cuda_parity on the CPU).
//
// Mirrors horovod_quant/backends/numba/reduce.py bit for bit: the parts added in the order
// given, then one IEEE division by the rank count (hq_fadd / hq_fdiv: the _rn intrinsics on
// the device, so no FMA and, with -ftz=false, no flushed subnormals; CuPy's own elementwise
// kernels flush them).
#ifndef HQ_REDUCE_CUH
#define HQ_REDUCE_CUH

#include "hq_common.cuh"

// (parts[0][i] + parts[1][i] + ... + parts[nparts - 1][i]) / divisor; 0 / divisor for none
HQ_HD float hq_mean_elem(const float* const* parts, int nparts, hq_i64 i, float divisor) {
  float acc = nparts > 0 ? parts[0][i] : 0.0f;
  for (int p = 1; p < nparts; ++p) acc = hq_fadd(acc, parts[p][i]);
  return hq_fdiv(acc, divisor);
}

#endif  // HQ_REDUCE_CUH
