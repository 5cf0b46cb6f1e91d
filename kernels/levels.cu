// levels.cu: fused encode / decode of the packed-code codecs (CuPy RawModule entry points).
//
//   hq_encode        one block per packing block (8192 elements): stage x, per-bucket scales
//                    (when every bucket lies inside the block), counter-based rounding, bit
//                    planes. Modes: level quantizers (uniform / geometric), Global-QSGD
//                    exponential codes, DQSG / NDQSG codes (hq_codes.cuh).
//   hq_scales        scales of buckets that straddle packing blocks (norms in 8 float64 lanes
//                    combined in lane order; one thread per lane)
//   hq_max_bits      max |x| bit pattern per bucket by atomicMax (max / pow2 scales of large
//   hq_scales_from_bits   or straddling buckets: the max does not depend on the order)
//   hq_decode_levels table[code] * scale of n payloads summed in payload order (gather
//                    exchanges decode every peer in one pass), optional final multiply
//   hq_codes         unpacked codes (Global-QSGD sparse mode compacts them afterwards)
//   hq_pack          pack an array of codes
//   hq_scale         dst = src * f (float32, IEEE: CuPy's own elementwise ops flush subnormals)
//   hq_to_f32        float64 -> float32 (round to nearest, subnormals kept)
//
// Launch with blockDim.x = HQ_THREADS (a multiple of 8, at most 256).
// Build options: -fmad=false (the arithmetic also uses the _rn intrinsics).
#include "hq_codes.cuh"

#define HQ_THREADS 256

extern "C" __global__ void __launch_bounds__(HQ_THREADS)
hq_encode(const float* x, long long n, long long bucket, int mode, int bits, int norm_kind,
          double p, int s, int c, int M, int k, float am, float gnorm, unsigned int k0,
          unsigned int k1, unsigned char* out, long long scales_off, long long codes_off,
          int fused) {
  __shared__ __align__(16) float sx[HQ_PACK_BLOCK];  // float4 stores
  __shared__ hq_u8 scodes[HQ_PACK_BLOCK];
  __shared__ double slanes[HQ_THREADS];
  HqDevEx ex;
  ex.nt = (int)blockDim.x;
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
  HqEncShared sh;
  sh.x = sx;
  sh.codes = scodes;
  sh.lanes = slanes;
  float* scales = reinterpret_cast<float*>(out + scales_off);
  hq_encode_block(ex, e, x, n, bucket, (hq_i64)blockIdx.x, scales, fused != 0, out + codes_off, sh);
}

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
    const hq_i32 a = (hq_i32)(hq_f2u(x[i]) & 0x7FFFFFFFu);
    best = a > best ? a : best;
  }
  if (cur >= 0) atomicMax(mbits + cur, best);
}

extern "C" __global__ void hq_scales_from_bits(const int* mbits, long long nb, int kind,
                                               float* scales) {
  const hq_i64 kk = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (kk >= nb) return;
  double lanes[HQ_LANES] = {(double)mbits[kk], 0, 0, 0, 0, 0, 0, 0};
  scales[kk] = hq_lanes_scale(lanes, kind, 0.0);
}

extern "C" __global__ void __launch_bounds__(HQ_THREADS, 4)  // <= 64 registers: occupancy
hq_decode_levels(const unsigned long long* ptrs, int npay, long long scales_off,
                 long long codes_off, const float* gscale, long long n, long long bucket,
                 int bits, const float* table, float* out, int accumulate, int has_post,
                 float post) {
  __shared__ float stable[256];
  for (int t = threadIdx.x; t < (1 << bits); t += blockDim.x) stable[t] = table[t];
  __syncthreads();
  const hq_u8* const* pays = reinterpret_cast<const hq_u8* const*>(ptrs);
  const hq_i64 groups = (n + HQ_GROUP - 1) / HQ_GROUP;
  const bool vec = ((hq_u64)(void*)out & 15u) == 0;
  const hq_i64 stride = (hq_i64)gridDim.x * blockDim.x;
  for (hq_i64 gi = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x; gi < groups; gi += stride) {
    const hq_i64 i0 = gi * HQ_GROUP;
    const int cnt = (int)(n - i0 < HQ_GROUP ? n - i0 : HQ_GROUP);
    float acc[HQ_GROUP] = {0.0f, 0.0f, 0.0f, 0.0f};
    const bool v4 = vec && cnt == HQ_GROUP;
    if (accumulate) {
      if (v4) {
        const float4 o = *reinterpret_cast<const float4*>(out + i0);
        acc[0] = o.x; acc[1] = o.y; acc[2] = o.z; acc[3] = o.w;
      } else {
#pragma unroll
        for (int e = 0; e < HQ_GROUP; ++e)
          if (e < cnt) acc[e] = out[i0 + e];
      }
    }
    hq_decode_levels_group(pays, npay, scales_off, codes_off, gscale, n, bucket, bits, stable,
                           acc, accumulate != 0, i0, cnt);
    if (has_post) {
#pragma unroll
      for (int e = 0; e < HQ_GROUP; ++e) acc[e] = hq_fmul(acc[e], post);
    }
    if (v4) {
      *reinterpret_cast<float4*>(out + i0) = make_float4(acc[0], acc[1], acc[2], acc[3]);
    } else {
#pragma unroll
      for (int e = 0; e < HQ_GROUP; ++e)
        if (e < cnt) out[i0 + e] = acc[e];
    }
  }
}

// unpacked codes of the global-norm modes (EXP, LINEAR_SM)
extern "C" __global__ void __launch_bounds__(HQ_THREADS)
hq_codes(const float* x, long long n, int mode, int bits, int s, int c, float gnorm,
         unsigned int k0, unsigned int k1, unsigned char* codes) {
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
  const hq_i64 stride = (hq_i64)gridDim.x * blockDim.x;
  for (hq_i64 i = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    codes[i] = (hq_u8)hq_encode_code(e, b, x[i], hq_hash32((hq_u64)i, k0, k1));
}

extern "C" __global__ void __launch_bounds__(HQ_THREADS)
hq_pack(const unsigned char* codes, long long n, int bits, unsigned char* out) {
  __shared__ hq_u8 scodes[HQ_PACK_BLOCK];
  HqDevEx ex;
  ex.nt = (int)blockDim.x;
  hq_pack_block(ex, codes, n, bits, (hq_i64)blockIdx.x, out, scodes);
}

// codes of n packed elements (tests / debugging)
extern "C" __global__ void hq_unpack(const unsigned char* packed, long long n, int bits,
                                     unsigned char* codes) {
  const hq_i64 stride = (hq_i64)gridDim.x * blockDim.x;
  for (hq_i64 i = (hq_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    codes[i] = (hq_u8)hq_packed_code(packed, n, bits, i);
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
