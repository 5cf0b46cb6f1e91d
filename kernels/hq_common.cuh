// hq_common.cuh: the pieces every horovod_quant kernel shares, written once as
// __host__ __device__ functions so that the same source runs on the GPU (CuPy RawModule /
// NVRTC) and on the CPU (nvcc host compilation in tests/cuda_parity, compared against numba).
//
// Mirrors, bit for bit:
//   horovod_quant/core/rng.py            splitmix64 / derive_key
//   horovod_quant/backends/numba/rng.py  hash32 (keyed lowbias32), block_key, u24_float
//   horovod_quant/backends/numba/packing.py  PACK_BLOCK, bit planes of width 1/2/4/8,
//                                        segment-strided
//
// Floating point: every float operation whose rounding matters goes through hq_fmul / hq_fadd /
// ... which are the _rn intrinsics on the device (never contracted into an FMA) and plain
// operators on the host (compile with -ffp-contract=off; x86-64 SSE has no excess precision).
// Compile device code with -fmad=false as a second line of defence.
//
// Execution model. A "block program" (hq_codes.cuh, ...) is a __host__ __device__ template
// over an executor: ex.each(f) runs f(tid) for the calling thread on the GPU and for every tid
// in turn on the host; ex.sync() is __syncthreads() (__syncwarp() for a warp executor) on the
// GPU and nothing on the host. Values a thread keeps from one phase to the next live in
// ex.Reg<T> (registers on the GPU, one slot per tid on the host), and warp collectives
// (ex.warp_max) are phases of their own. A block program may share data between threads only
// through the "shared" buffers it is given, across a sync, or through a collective; it is then
// the same computation on both, which is what the host parity tests exercise.
#ifndef HQ_COMMON_CUH
#define HQ_COMMON_CUH

#if defined(__CUDACC__)
#define HQ_HD __host__ __device__ __forceinline__
#define HQ_HDT __host__ __device__
#else
#define HQ_HD static inline
#define HQ_HDT
#endif

#if !defined(__CUDACC_RTC__)
#include <math.h>
#include <string.h>
#endif

typedef unsigned char hq_u8;
typedef int hq_i32;
typedef unsigned int hq_u32;
typedef long long hq_i64;
typedef unsigned long long hq_u64;

// ------------------------------------------------------------------------------------------
// constants (part of the wire format)
// ------------------------------------------------------------------------------------------
#define HQ_PACK_BLOCK 8192          // packing.PACK_BLOCK
#define HQ_WORD_BLOCK 1024          // global_qsgd.WORD_BLOCK
#define HQ_LANES 8                  // interleaved float64 lanes of the norms

// backends/numba/levels.py
#define HQ_NORM_L2 0
#define HQ_NORM_MAX 1
#define HQ_NORM_P 2
#define HQ_NORM_POW2 3
#define HQ_GRID_UNIFORM 0
#define HQ_GRID_GEOMETRIC 1

// ------------------------------------------------------------------------------------------
// IEEE float helpers: exactly rounded, never contracted
// ------------------------------------------------------------------------------------------
HQ_HD float hq_fmul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
HQ_HD float hq_fadd(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
HQ_HD float hq_fsub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
HQ_HD float hq_fdiv(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
HQ_HD double hq_dmul(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
HQ_HD double hq_dadd(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
HQ_HD double hq_dsqrt(double a) {
#ifdef __CUDA_ARCH__
  return __dsqrt_rn(a);
#else
  return sqrt(a);
#endif
}

HQ_HD hq_u32 hq_f2u(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  hq_u32 u;
  memcpy(&u, &f, 4);
  return u;
#endif
}
HQ_HD float hq_u2f(hq_u32 u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}
// np.isfinite on float32
HQ_HD bool hq_isfinite(float f) { return (hq_f2u(f) & 0x7F800000u) != 0x7F800000u; }
// The NaN the kernels store for a bucket with a non-finite value (the CPU's NaN payload bits
// depend on the platform; both decode to non-finite values).
HQ_HD float hq_nan() { return hq_u2f(0x7FC00000u); }

// Unaligned little-endian 32-bit loads (payload views may sit at any byte offset).
HQ_HD hq_u32 hq_load_u32_bytes(const hq_u8* p) {
  return (hq_u32)p[0] | ((hq_u32)p[1] << 8) | ((hq_u32)p[2] << 16) | ((hq_u32)p[3] << 24);
}
HQ_HD float hq_load_f32(const hq_u8* p) { return hq_u2f(hq_load_u32_bytes(p)); }

// Loads of data that no thread writes during the kernel (payloads, inputs): one aligned
// read-only load (ld.global.nc) where the address allows it, bytes otherwise. Gathered
// payloads can start at any byte, but a payload's alignment is the same for all its words, so
// the branch does not diverge.
HQ_HD hq_u32 hq_ldg_u32(const hq_u8* p) {
  if (((hq_u64)(const void*)p & 3u) != 0) return hq_load_u32_bytes(p);
#ifdef __CUDA_ARCH__
  return __ldg(reinterpret_cast<const unsigned int*>(p));
#else
  hq_u32 u;
  memcpy(&u, p, 4);
  return u;
#endif
}
HQ_HD float hq_ldg_f32(const hq_u8* p) { return hq_u2f(hq_ldg_u32(p)); }

// 16-byte read-only load of x[0:4]; x must be 16-byte aligned.
HQ_HD float4 hq_ldg_f4(const float* x) {
#ifdef __CUDA_ARCH__
  return __ldg(reinterpret_cast<const float4*>(x));
#else
  float4 v;
  memcpy(&v, x, sizeof v);
  return v;
#endif
}

// Component k (0..3) of a float4; k must be a compile-time constant after unrolling, or the
// vector would leave registers.
HQ_HD float hq_f4_get(const float4& v, int k) {
  return k == 0 ? v.x : (k == 1 ? v.y : (k == 2 ? v.z : v.w));
}

// 32-bit store; p must be 4-byte aligned.
HQ_HD void hq_store_u32(hq_u8* p, hq_u32 v) {
#ifdef __CUDA_ARCH__
  *reinterpret_cast<unsigned int*>(p) = v;
#else
  memcpy(p, &v, 4);
#endif
}

// a / b for a >= 0, b > 0: a 32-bit division when both fit (the common case), since a 64-bit
// one is a subroutine call.
HQ_HD hq_i64 hq_div(hq_i64 a, hq_i64 b) {
  return ((hq_u64)(a | b) >> 32) == 0 ? (hq_i64)((hq_u32)a / (hq_u32)b) : a / b;
}

// floor(t) for |t| < 2^22 as (int, float), exactly, in three instructions and without the
// conversion instructions (F2I / I2F / FRND share a quarter-rate pipe on current GPUs and would
// bound the encode): t + 1.5 * 2^23 lies in [2^23, 2^24), where the float grid is the integers,
// so the sum rounded toward zero is 1.5 * 2^23 + floor(t). The host computes the same value as
// floorf(t) + 1.5 * 2^23 (both terms and the sum exact in that range). NaN gives garbage
// (callers discard it); integer arithmetic on the bits is unsigned, so it never overflows.
HQ_HD void hq_floor_split(float t, hq_i32* it, float* ft) {
  const float magic = 12582912.0f;  // 1.5 * 2^23
#ifdef __CUDA_ARCH__
  const float r = __fadd_rz(t, magic);
#else
  const float r = floorf(t) + magic;
#endif
  *ft = hq_fsub(r, magic);
  *it = (hq_i32)(hq_f2u(r) - 0x4B400000u);
}

// 2^k as float32 for -126 <= k <= 127 (np.float32(2.0) ** np.float32(k): exact)
HQ_HD float hq_pow2f(int k) { return hq_u2f((hq_u32)(k + 127) << 23); }

// ------------------------------------------------------------------------------------------
// counter-based randomness (rng.py)
// ------------------------------------------------------------------------------------------
HQ_HD hq_u64 hq_splitmix64(hq_u64 x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// derive_key(seed, *fields) with the fields given as 64-bit two's complement words
HQ_HD hq_u64 hq_derive_key(hq_u64 seed, const hq_u64* fields, int nfields) {
  hq_u64 key = hq_splitmix64(seed);
  for (int i = 0; i < nfields; ++i) key = hq_splitmix64(key ^ fields[i]);
  return key;
}

HQ_HD hq_u32 hq_mix32(hq_u32 x) {  // lowbias32
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0xD35A2D97u;
  x ^= x >> 15;
  return x;
}

// block_key(start, k0): fold the high index word into the first key half
HQ_HD hq_u32 hq_block_key(hq_u64 start, hq_u32 k0) {
  return k0 ^ (hq_u32)((start >> 32) * 0x85EBCA6Bull);
}

// hash32_lo(lo, kb, k1) = mix(mix(lo * 0x9E3779B9 + kb) ^ k1)
HQ_HD hq_u32 hq_hash32_lo(hq_u32 lo, hq_u32 kb, hq_u32 k1) {
  return hq_mix32(hq_mix32(lo * 0x9E3779B9u + kb) ^ k1);
}

// hash32(index, k0, k1): 32 random bits of element `index`
HQ_HD hq_u32 hq_hash32(hq_u64 index, hq_u32 k0, hq_u32 k1) {
  return hq_hash32_lo((hq_u32)index, hq_block_key(index, k0), k1);
}

// u24_float(h) = (h >> 8) * 2^-24, exact
HQ_HD float hq_u24(hq_u32 h) { return hq_fmul((float)(hq_i32)(h >> 8), 5.9604644775390625e-08f); }

// ------------------------------------------------------------------------------------------
// bit planes (packing.py)
// ------------------------------------------------------------------------------------------
// Width and shift of the plane-th field of a bits-wide code (width 0 past the last plane).
// constexpr: with a compile-time `bits` every plane loop below unrolls into constants.
HQ_HDT constexpr int hq_plane_width(int bits, int plane) {
  if (bits == 8) return plane == 0 ? 8 : 0;
  int k = 0;
  for (int w = 1; w <= 4; w <<= 1) {
    if (bits & w) {
      if (k == plane) return w;
      ++k;
    }
  }
  return 0;
}
HQ_HDT constexpr int hq_plane_shift(int bits, int plane) {
  int sh = 0, k = 0;
  for (int w = 1; w <= 4; w <<= 1) {
    if (bits & w) {
      if (k == plane) return sh;
      ++k;
      sh += w;
    }
  }
  return 0;
}

HQ_HD hq_i64 hq_block_nbytes(hq_i64 m, int bits) {
  hq_i64 total = 0;
  for (int plane = 0; plane < 3; ++plane) {
    const int w = hq_plane_width(bits, plane);
    if (w == 0) break;
    total += (m * w + 7) / 8;
  }
  return total;
}

HQ_HD hq_i64 hq_packed_nbytes(hq_i64 n, int bits) {
  hq_i64 full = n / HQ_PACK_BLOCK;
  return full * (HQ_PACK_BLOCK * bits / 8) + hq_block_nbytes(n - full * HQ_PACK_BLOCK, bits);
}

// byte offset of packing block `blk` from the start of the packed codes
HQ_HD hq_i64 hq_block_offset(hq_i64 blk, int bits) { return blk * (HQ_PACK_BLOCK * bits / 8); }

// Expands F(b) for the runtime bit width `bits` (1..8): kernels whose bit width is not a
// template parameter (pack, unpack, exponent combination, sparse and nested decodes) branch
// once, uniformly, into code specialised for it. A macro, not a generic lambda: NVRTC rejects
// the unannotated call operator of a generic lambda in device code.
#define HQ_WITH_BITS(bits, F) \
  switch (bits) {             \
    case 1: F(1); break;      \
    case 2: F(2); break;      \
    case 3: F(3); break;      \
    case 4: F(4); break;      \
    case 5: F(5); break;      \
    case 6: F(6); break;      \
    case 7: F(7); break;      \
    default: F(8); break;     \
  }

// Byte j of plane `plane` of a block of m codes: fields of codes j, j + L, j + 2L, ...
// (codes past m count as zero). codes[] holds the block's codes.
template <int BITS>
HQ_HD hq_u8 hq_pack_byte(const hq_u8* codes, int m, int plane, int L, int j) {
  const int w = hq_plane_width(BITS, plane), shift = hq_plane_shift(BITS, plane);
  if (w == 8) return codes[j];
  const int per = 8 / w;
  const hq_u32 mask = (1u << w) - 1u;
  hq_u32 v = 0;
  for (int t = 0; t < per; ++t) {
    int idx = j + t * L;
    hq_u32 c = idx < m ? (hq_u32)codes[idx] : 0u;
    v |= ((c >> shift) & mask) << (t * w);
  }
  return (hq_u8)v;
}

// Block program piece: pack codes[0:m] into out[0:hq_block_nbytes(m, BITS)], bytes split
// over threads (coalesced writes). codes must not change during the call.
template <int BITS, class Ex>
HQ_HDT inline void hq_pack_phase(Ex& ex, const hq_u8* codes, int m, hq_u8* out) {
  int o = 0;
#pragma unroll
  for (int plane = 0; plane < 3; ++plane) {
    const int w = hq_plane_width(BITS, plane);
    if (w == 0) break;
    const int per = 8 / w;
    const int L = (m + per - 1) / per;
    hq_u8* dst = out + o;
    ex.each([&](int tid) {
      for (int j = tid; j < L; j += ex.nt) dst[j] = hq_pack_byte<BITS>(codes, m, plane, L, j);
    });
    o += L;
  }
}

// Code of element p (0 <= p < m) of a packed block of m codes starting at blk. In a full
// block a plane of width w has L = 1024 w bytes, so the field index is a shift.
template <int BITS>
HQ_HD hq_u32 hq_unpack_code(const hq_u8* blk, int m, int p) {
  if (BITS == 8) return blk[p];
  hq_u32 code = 0;
  int o = 0;
  const bool full = (m == HQ_PACK_BLOCK);
#pragma unroll
  for (int plane = 0; plane < 3; ++plane) {
    const int w = hq_plane_width(BITS, plane);
    if (w == 0) break;
    const int per = 8 / w;
    const int L = full ? (HQ_PACK_BLOCK / 8) * w : (m + per - 1) / per;
    const int t = full ? p >> (w == 1 ? 10 : (w == 2 ? 11 : 12)) : p / L;
    const int j = p - t * L;
    code |= (((hq_u32)blk[o + j] >> (t * w)) & ((1u << w) - 1u)) << hq_plane_shift(BITS, plane);
    o += L;
  }
  return code;
}

// Code of element i of the packed codes of an n-element vector.
template <int BITS>
HQ_HD hq_u32 hq_packed_code(const hq_u8* packed, hq_i64 n, hq_i64 i) {
  const hq_i64 blk = i / HQ_PACK_BLOCK;
  const hq_i64 b0 = blk * HQ_PACK_BLOCK;
  const int m = (int)(n - b0 < HQ_PACK_BLOCK ? n - b0 : HQ_PACK_BLOCK);
  return hq_unpack_code<BITS>(packed + hq_block_offset(blk, BITS), m, (int)(i - b0));
}

// ------------------------------------------------------------------------------------------
// executors
// ------------------------------------------------------------------------------------------
// A fixed-size array as one value (per-thread register storage of a block program). Index it
// only with compile-time constants (unrolled loops): a runtime index sends it to local memory.
template <class T, int N>
struct HqArr {
  T v[N];
};

#define HQ_HOST_MAX_THREADS 256  // threads per block the host executor can replay

// Per-thread storage that outlives a phase: r[tid] is the thread's value. On the GPU each
// thread holds its own copy (registers) and the index is ignored; on the host, where the
// threads of a phase run one after the other, every thread has its slot.
template <class T>
struct HqDevReg {
  T v;
  HQ_HDT inline T& operator[](int) { return v; }
};
template <class T>
struct HqHostReg {
  T v[HQ_HOST_MAX_THREADS];
  HQ_HDT inline T& operator[](int tid) { return v[tid]; }
};

// GPU: one CUDA thread block runs the block program, each thread its own tid.
struct HqDevEx {
  int nt;
  template <class T>
  using Reg = HqDevReg<T>;
  template <class F>
  HQ_HDT inline void each(F f) {
#ifdef __CUDA_ARCH__
    f((int)threadIdx.x);
#endif
  }
  HQ_HDT inline void sync() {
#ifdef __CUDA_ARCH__
    __syncthreads();
#endif
  }
};

// GPU: one warp runs the program (warps of a block are independent), tid = lane.
struct HqDevWarpEx {
  static constexpr int nt = 32;
  template <class T>
  using Reg = HqDevReg<T>;
  template <class F>
  HQ_HDT inline void each(F f) {
#ifdef __CUDA_ARCH__
    f((int)(threadIdx.x & 31u));
#endif
  }
  HQ_HDT inline void sync() {
#ifdef __CUDA_ARCH__
    __syncwarp();
#endif
  }
  // Every entry of r becomes the max over its aligned group of `width` lanes (a power of two
  // <= 32): xor butterflies, which never leave the group. Integer max: order-free, exact.
  template <int N>
  HQ_HDT inline void warp_max(Reg<HqArr<hq_i32, N>>& r, int width) {
#ifdef __CUDA_ARCH__
    for (int o = 1; o < width; o <<= 1) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const hq_i32 t = __shfl_xor_sync(0xFFFFFFFFu, r.v.v[i], o);
        r.v.v[i] = t > r.v.v[i] ? t : r.v.v[i];
      }
    }
#endif
  }
};

// Host: every thread of the block in turn; a sync is the end of a phase; a warp collective
// runs over each warp's lanes once every thread has finished the phase before it.
struct HqHostEx {
  int nt;
  template <class T>
  using Reg = HqHostReg<T>;
  template <class F>
  HQ_HDT inline void each(F f) {
    for (int t = 0; t < nt; ++t) f(t);
  }
  HQ_HDT inline void sync() {}
  template <int N>
  HQ_HDT inline void warp_max(Reg<HqArr<hq_i32, N>>& r, int width) {
    for (int g = 0; g < nt; g += width) {
      for (int i = 0; i < N; ++i) {
        hq_i32 m = r[g].v[i];
        for (int l = g + 1; l < g + width; ++l) m = r[l].v[i] > m ? r[l].v[i] : m;
        for (int l = g; l < g + width; ++l) r[l].v[i] = m;
      }
    }
  }
};

// ------------------------------------------------------------------------------------------
// bucket scales (backends/numba/levels.py _bucket_scale)
// ------------------------------------------------------------------------------------------
// Smallest power of two >= m for finite m >= 0 (backends/numba/levels.py _pow2_ceil)
HQ_HD float hq_pow2_ceil(float m) {
  if (m > 0.0f) {
    hq_u32 b = hq_f2u(m);
    hq_u32 ex = b >> 23;
    if (ex == 0)
      ex = 1;
    else if (b & 0x7FFFFFu)
      ex += 1;
    m = hq_u2f(ex << 23);
  }
  return m;
}

// Max / power-of-two scale from the largest bit pattern of |x| in the bucket (NaN when the
// bucket holds Inf or NaN).
HQ_HD float hq_max_scale(hq_i32 max_bits, int kind) {
  if (max_bits >= 0x7F800000) return hq_nan();
  const float m = hq_u2f((hq_u32)max_bits);
  return kind == HQ_NORM_POW2 ? hq_pow2_ceil(m) : m;
}

// |x| as its int32 bit pattern: ordered like |x| for finite values, above 0x7F800000 - 1 for
// Inf / NaN.
HQ_HD hq_i32 hq_abs_bits(float v) { return (hq_i32)(hq_f2u(v) & 0x7FFFFFFFu); }

// |v| ** p in float64 (backends/numba/levels.py _abs_pow)
HQ_HD double hq_abs_pow(double v, double p) {
  double a = v < 0 ? -v : v;
  return p == 1.0 ? a : pow(a, p);
}

// Lane `lane` of the bucket xs[0:cnt]: elements lane, lane + 8, ... in order.
//   L2: float64 sum of squares, left to right (0.0 + first term).
//   P:  float64 sum of |x|^p.
//   MAX / POW2: max of the int32 bit patterns of |x| (returned as a double; exact).
HQ_HD double hq_lane_value(const float* xs, hq_i64 cnt, int lane, int kind, double p) {
  if (kind == HQ_NORM_MAX || kind == HQ_NORM_POW2) {
    hq_i32 mb = 0;
    for (hq_i64 i = lane; i < cnt; i += HQ_LANES) {
      const hq_i32 a = hq_abs_bits(xs[i]);
      mb = a > mb ? a : mb;
    }
    return (double)mb;
  }
  double acc = 0.0;
  if (kind == HQ_NORM_L2) {
    for (hq_i64 i = lane; i < cnt; i += HQ_LANES) {
      double v = (double)xs[i];
      acc = hq_dadd(acc, hq_dmul(v, v));
    }
  } else {
    for (hq_i64 i = lane; i < cnt; i += HQ_LANES) acc = hq_dadd(acc, hq_abs_pow((double)xs[i], p));
  }
  return acc;
}

// The bucket's scale from its 8 lane values (combined in lane order).
HQ_HD float hq_lanes_scale(const double* lanes, int kind, double p) {
  if (kind == HQ_NORM_MAX || kind == HQ_NORM_POW2) {
    hq_i32 mb = 0;
    for (int j = 0; j < HQ_LANES; ++j) {
      hq_i32 a = (hq_i32)lanes[j];
      mb = a > mb ? a : mb;
    }
    return hq_max_scale(mb, kind);
  }
  double acc = 0.0;
  for (int j = 0; j < HQ_LANES; ++j) acc = hq_dadd(acc, lanes[j]);
  if (kind == HQ_NORM_L2) return (float)hq_dsqrt(acc);
  // pow(acc, 1.0) is not exact in CUDA's libdevice, and an L1 sum rounded to float32 often
  // sits on a tie: the identity is taken literally, as on the CPU
  return p == 1.0 ? (float)acc : (float)pow(acc, 1.0 / p);
}

// Block program piece: the scales of buckets [kb0, kb1) (bucket k = xs[k*bucket - base, ...)),
// written to scales[k]. 8 threads per bucket (one per lane), rounds of ex.nt lanes.
// lane_buf: ex.nt doubles of shared memory. xs is indexed by element - base.
template <class Ex>
HQ_HDT inline void hq_scales_phase(Ex& ex, const float* xs, hq_i64 base, hq_i64 n, hq_i64 bucket,
                                   hq_i64 kb0, hq_i64 kb1, int kind, double p, double* lane_buf,
                                   float* scales) {
  const int per_round = ex.nt / HQ_LANES;  // buckets per round
  for (hq_i64 r0 = kb0; r0 < kb1; r0 += per_round) {
    ex.each([&](int tid) {
      hq_i64 k = r0 + tid / HQ_LANES;
      double v = 0.0;
      if (tid < per_round * HQ_LANES && k < kb1) {
        hq_i64 lo = k * bucket;
        hq_i64 hi = lo + bucket < n ? lo + bucket : n;
        v = hq_lane_value(xs + (lo - base), hi - lo, tid % HQ_LANES, kind, p);
      }
      lane_buf[tid] = v;
    });
    ex.sync();
    ex.each([&](int tid) {
      hq_i64 k = r0 + tid;
      if (tid < per_round && k < kb1) scales[k] = hq_lanes_scale(lane_buf + tid * HQ_LANES, kind, p);
    });
    ex.sync();
  }
}

#endif  // HQ_COMMON_CUH
