// Per-tensor FP8 quantisation with current scaling (the recipe: turbo/kernels/cpu/quantize.h),
// writing the row-major FP8 copy, its transpose, or both from the same read of the input.
//
// The scale depends on max|x| over the whole tensor, so no byte can be written before the input
// has been read once: two launches, no atomics, nothing zeroed beforehand.
//   1. amax_partials: at most 1024 blocks (2 per SM), grid-stride over the input in 16-byte
//      vectors, 4 loads in flight per thread; block b writes max|x| of its share to partials[b].
//      |x| is kept as its f32 bit pattern and reduced with integer max: for non-negative floats
//      the bits order like the values, a NaN's bits lie above inf's (so a NaN is never lost, as
//      it would be with fmaxf), and an integer max is exact in any order (deterministic).
//   2. quantize: every block first reduces the partials itself (a few KiB, L2-resident), so no
//      third launch or grid-wide sync is needed; block 0 writes scale_inv. Blocks then walk
//      128 x 128 tiles of the input (persistent grid-stride): each thread loads four 16-element
//      chunks (32 or 64 bytes each) at once, converts them with cvt.rn.satfinite (two values per
//      instruction) and stores 16 bytes to `out`; for `out_t` the bytes go through a 16 KiB
//      shared tile (XOR-swizzled: conflict-free 16-byte stores and 4-byte loads), each thread
//      gathers 16 rows x 4 columns, transposes them in registers with byte permutes and writes
//      4 x 16 bytes of out_t (64 contiguous bytes per column from each 4 lanes).
// Shapes or alignments the tile kernel cannot take run a plain element-wise 32 x 32 tiled kernel.
// Traffic: the input is read twice (once per launch), each output written once.
#include <cuda_fp8.h>
#include <fmt/format.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <type_traits>

#include "turbo/core/env_switch.h"
#include "turbo/kernels/cuda/common.cuh"
#include "turbo/kernels/cuda/quantize.h"
#include "turbo/kernels/cuda/swiglu_math.cuh"

namespace primus::turbo::cuda {
namespace {

constexpr int kMaxPartials = 1024;
constexpr int kAmaxThreads = 512;
constexpr int kAmaxUnroll = 4;  // 16-byte loads in flight per thread
constexpr int kThreads = 256;   // quantize kernels
constexpr int kTile = 128;      // tile kernel: kTile x kTile elements
constexpr int kChunk = 16;      // elements per thread-chunk: one 16-byte FP8 store
constexpr int kGeneric = 32;    // generic kernel: kGeneric x kGeneric tiles
constexpr uint32_t kPoison4 = 0x7f7f7f7fu;  // 0x7f: NaN in e4m3 and in e5m2 (cpu::kFp8PoisonByte)
constexpr uint32_t kNanBits = 0x7fc00000u;  // the reference's quiet NaN for scale_inv

// The largest finite value of an FP8 dtype (cpu::fp8_max).
float fp8_max_of(DType fp8) { return fp8 == DType::F8E4M3 ? 448.0f : 57344.0f; }

// ---- |x| as f32 bits ---------------------------------------------------------------------------
__device__ __forceinline__ uint32_t abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }
__device__ __forceinline__ uint32_t abs_bits(bf16 x) {
  return (static_cast<uint32_t>(__bfloat16_as_ushort(x)) & 0x7fffu) << 16;
}
// Of the values packed in one 32-bit word.
template <class T>
__device__ __forceinline__ uint32_t word_abs_bits(uint32_t w) {
  if constexpr (sizeof(T) == 4) return w & 0x7fffffffu;
  else return max((w << 16) & 0x7fff0000u, w & 0x7fff0000u);
}
template <class T>
__device__ __forceinline__ uint32_t vec_abs_bits(const int4& v) {
  return max(max(word_abs_bits<T>(static_cast<uint32_t>(v.x)), word_abs_bits<T>(static_cast<uint32_t>(v.y))),
             max(word_abs_bits<T>(static_cast<uint32_t>(v.z)), word_abs_bits<T>(static_cast<uint32_t>(v.w))));
}

// Max over the block; every thread gets it. blockDim.x is a multiple of 32; smem >= 32 words.
__device__ __forceinline__ uint32_t block_max_u32(uint32_t x, uint32_t* smem) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  x = __reduce_max_sync(0xffffffffu, x);
  __syncthreads();
  if (lane == 0) smem[warp] = x;
  __syncthreads();
  return __reduce_max_sync(0xffffffffu, lane < warps ? smem[lane] : 0u);
}

// ---- launch 1: amax partials --------------------------------------------------------------------
// Units: 16-byte vectors (kVec) or single elements; kContig: rows back to back (ld == C), so a
// unit's address needs no division.
template <class T, bool kVec, bool kContig>
__global__ void __launch_bounds__(kAmaxThreads) amax_partials_kernel(const T* __restrict__ inp, int64_t R, int64_t C,
                                                                    int64_t ld, uint32_t* __restrict__ partials,
                                                                    const int32_t* __restrict__ rows_in_use) {
  constexpr int W = kVec ? 16 / static_cast<int>(sizeof(T)) : 1;
  if (rows_in_use) R = min(R, static_cast<int64_t>(max(0, __ldg(rows_in_use))));
  const int64_t per_row = C / W, units = R * per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  auto at = [&](int64_t u) {
    if constexpr (kContig) return inp + u * W;
    else {
      const int64_t r = u / per_row;
      return inp + r * ld + (u - r * per_row) * W;
    }
  };
  uint32_t m = 0;
#pragma unroll 1  // the loads are unrolled inside; unrolling this too only spends registers
  for (int64_t u0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u0 < units;
       u0 += kAmaxUnroll * stride) {
    if constexpr (kVec) {
      int4 v[kAmaxUnroll];
#pragma unroll
      for (int k = 0; k < kAmaxUnroll; ++k) {
        const int64_t u = u0 + k * stride;
        v[k] = u < units ? __ldg(reinterpret_cast<const int4*>(at(u))) : make_int4(0, 0, 0, 0);
      }
#pragma unroll
      for (int k = 0; k < kAmaxUnroll; ++k) m = max(m, vec_abs_bits<T>(v[k]));
    } else {
      T v[kAmaxUnroll];
#pragma unroll
      for (int k = 0; k < kAmaxUnroll; ++k) {
        const int64_t u = u0 + k * stride;
        v[k] = u < units ? at(u)[0] : T(0.0f);
      }
#pragma unroll
      for (int k = 0; k < kAmaxUnroll; ++k) m = max(m, abs_bits(v[k]));
    }
  }
  __shared__ uint32_t smem[32];
  m = block_max_u32(m, smem);
  if (threadIdx.x == 0) partials[blockIdx.x] = m;  // every block writes its slot: nothing to zero
}

// ---- the scale, as the reference computes it (cpu::fp8_tensorwise_scaling) ---------------------
struct Scaling {
  float scale;
  bool finite;
};
// The reference's scaling (cpu::fp8_tensorwise_scaling) of a tensor or group whose max |x| has
// bits m; *inv gets scale_inv.
__device__ __forceinline__ Scaling group_scaling(uint32_t m, float fp8max, float* inv) {
  Scaling s{1.0f, m < 0x7f800000u};
  *inv = 1.0f;
  if (!s.finite) {
    s.scale = *inv = __uint_as_float(kNanBits);
  } else if (m != 0) {
    s.scale = __fdiv_rn(fp8max, __uint_as_float(m));
    if (isinf(s.scale)) s.scale = FLT_MAX;
    *inv = __fdiv_rn(1.0f, s.scale);
  }
  return s;
}

// Every thread of every block calls this and gets the same answer; block 0 writes scale_inv and,
// when amax_out is set, folds the amax into it (delayed scaling's history, recorded while a step
// without one runs on current scaling).
__device__ __forceinline__ Scaling reduce_scaling(const uint32_t* partials, int nparts, float fp8max,
                                                  float* scale_inv, uint32_t* amax_out, uint32_t* smem) {
  uint32_t m = 0;
  for (int i = threadIdx.x; i < nparts; i += blockDim.x) m = max(m, partials[i]);
  float inv;
  m = block_max_u32(m, smem);
  const Scaling s = group_scaling(m, fp8max, &inv);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *scale_inv = inv;
    if (amax_out) atomicMax(amax_out, m);
  }
  return s;
}

// Delayed scaling: the given scale (positive and finite, from the amax history); block 0 writes
// its inverse. The elements' own finiteness is checked one by one (poison_nonfinite).
__device__ __forceinline__ Scaling given_scaling(const float* scale_in, float* scale_inv) {
  const Scaling s{__ldg(scale_in), true};
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = __fdiv_rn(1.0f, s.scale);
  return s;
}

// ---- conversion --------------------------------------------------------------------------------
// fp8(a * scale) in the low byte, fp8(b * scale) in the next: x * scale rounded to f32, then to
// the FP8 format to nearest even with saturation, exactly the reference's two roundings.
template <bool kE4M3>
__device__ __forceinline__ uint32_t cvt2(float a, float b, float scale_a, float scale_b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(a, scale_a), __fmul_rn(b, scale_b)), __NV_SATFINITE,
                                  kE4M3 ? __NV_E4M3 : __NV_E5M2);
}
template <bool kE4M3>
__device__ __forceinline__ uint32_t cvt2(float a, float b, float scale) {
  return cvt2<kE4M3>(a, b, scale, scale);
}
// Two values of a 32-bit word of T: (lo, hi) as floats.
__device__ __forceinline__ float2 bf16_pair(uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
// 16 consecutive elements of T, as loaded (kRaw 16-byte words), to 16 FP8 bytes.
template <class T, bool kE4M3>
__device__ __forceinline__ uint4 quantize_chunk(const int4* raw, float scale, bool finite) {
  uint32_t w[4];
  if constexpr (sizeof(T) == 4) {
    const float* x = reinterpret_cast<const float*>(raw);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      w[j] = cvt2<kE4M3>(x[4 * j], x[4 * j + 1], scale) | (cvt2<kE4M3>(x[4 * j + 2], x[4 * j + 3], scale) << 16);
  } else {
    const uint32_t* u = reinterpret_cast<const uint32_t*>(raw);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 a = bf16_pair(u[2 * j]), b = bf16_pair(u[2 * j + 1]);
      w[j] = cvt2<kE4M3>(a.x, a.y, scale) | (cvt2<kE4M3>(b.x, b.y, scale) << 16);
    }
  }
  if (!finite) w[0] = w[1] = w[2] = w[3] = kPoison4;
  return make_uint4(w[0], w[1], w[2], w[3]);
}
// max |x| bits of a chunk as loaded.
template <class T>
__device__ __forceinline__ uint32_t chunk_abs_bits(const int4* raw) {
  constexpr int kRaw = 16 * static_cast<int>(sizeof(T)) / 16;
  uint32_t m = 0;
#pragma unroll
  for (int k = 0; k < kRaw; ++k) m = max(m, vec_abs_bits<T>(raw[k]));
  return m;
}
// A chunk's 16 elements as loaded, by value.
template <class T>
struct RawChunk {
  int4 v[16 * sizeof(T) / 16];
};
template <class T>
__device__ __forceinline__ RawChunk<T> raw_chunk(const int4* raw) {
  RawChunk<T> r;
#pragma unroll
  for (int k = 0; k < 16 * static_cast<int>(sizeof(T)) / 16; ++k) r.v[k] = raw[k];
  return r;
}
// Delayed scaling, for a chunk holding an inf or NaN (rare): each such element's byte becomes the
// poison byte, as the reference (cpu::quantize_fp8_with_scale) does element by element. The chunk
// comes by value: a pointer into the caller's registers would make the caller keep every chunk it
// loads in local memory, for this call that almost never happens (measured: the tile kernels'
// inputs written out to L1 and L2 a second time).
template <class T>
__device__ __noinline__ uint4 poison_nonfinite(uint4 q, RawChunk<T> raw) {
  uint8_t b[16];
  memcpy(b, &q, 16);
  for (int e = 0; e < 16; ++e) {
    uint32_t bits;
    if constexpr (sizeof(T) == 4) {
      memcpy(&bits, reinterpret_cast<const char*>(raw.v) + 4 * e, 4);
      bits &= 0x7fffffffu;
    } else {
      uint16_t h;
      memcpy(&h, reinterpret_cast<const char*>(raw.v) + 2 * e, 2);
      bits = static_cast<uint32_t>(h & 0x7fffu) << 16;
    }
    if (bits >= 0x7f800000u) b[e] = static_cast<uint8_t>(kPoison4);
  }
  memcpy(&q, b, 16);
  return q;
}

// ---- launch 2, fast path: 128 x 128 tiles --------------------------------------------------------
// Shared tile: kTile rows of kTile bytes (32 words). Word w of row r lives at w ^ swz(r): a warp
// of the transpose phase reads rows 16 apart (4 row groups x 8 column words), which without the
// swizzle would all hit the same 8 banks.
__device__ __forceinline__ int swz(int row) { return ((row >> 4) & 3) << 3; }

// Bytes (a.j, b.j, c.j, d.j) for j = 0..3: the 4 x 4 byte transpose of four rows' words.
__device__ __forceinline__ void transpose4x4(uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t* col) {
  const uint32_t ab_lo = __byte_perm(a, b, 0x5140), ab_hi = __byte_perm(a, b, 0x7362);  // a0 b0 a1 b1 | a2 b2 a3 b3
  const uint32_t cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
  col[0] = __byte_perm(ab_lo, cd_lo, 0x5410);
  col[1] = __byte_perm(ab_lo, cd_lo, 0x7632);
  col[2] = __byte_perm(ab_hi, cd_hi, 0x5410);
  col[3] = __byte_perm(ab_hi, cd_hi, 0x7632);
}

// The 16 x 4 byte patch of a swizzled tile at row group rg (rows 16 rg ..) and word column cg, as
// four columns of 16 bytes: col[g][j] holds rows 4g .. 4g + 3 of byte column j.
template <int kWords>
__device__ __forceinline__ void tile_patch_columns(const uint32_t (*tile)[kWords], int rg, int cg, uint32_t (&col)[4][4]) {
  uint32_t w[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int row = rg * 16 + i;
    w[i] = tile[row][cg ^ swz(row)];
  }
#pragma unroll
  for (int g = 0; g < 4; ++g) transpose4x4(w[4 * g], w[4 * g + 1], w[4 * g + 2], w[4 * g + 3], col[g]);
}

struct QuantArgs {
  const void* inp;
  int64_t R, C, ld;
  uint8_t* out;
  uint8_t* out_t;
  const uint32_t* partials;
  int nparts;
  float fp8max;
  float* scale_inv;
  const float* scale_in;  // delayed scaling: quantize with this scale (no amax launch); nullptr: current
  uint32_t* amax_out;     // when set: max |x|'s f32 bits are folded in with atomicMax (order-free)
  const int32_t* rows_in_use;  // delayed: only rows below *rows_in_use fold into amax_out (null: all)
};

// Delayed scaling: the rows whose amax is recorded (QuantizeFp8Args::rows_in_use), read once.
__device__ __forceinline__ int64_t recorded_rows(const int32_t* rows_in_use, int64_t R) {
  return rows_in_use ? min(R, static_cast<int64_t>(max(0, __ldg(rows_in_use)))) : R;
}

// Preconditions (checked by the launcher): C % 16 == 0, inp rows 16-byte aligned, outputs 16-byte
// aligned, R % 16 == 0 when kOutT. Edge tiles then hold whole 16-element chunks and 16-row groups.
// Blocks per SM asked of the register allocator: 4 x 256 threads (bf16: 32 KiB of loads in
// flight per block) fit in 64 registers; f32 chunks are twice the registers, 2 blocks.
template <class T, bool kE4M3, bool kOut, bool kOutT>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 2 ? 4 : 2) quantize_tiles_kernel(QuantArgs a) {
  constexpr int kChunksPerRow = kTile / kChunk;                    // 8
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;           // 32
  constexpr int kIters = kTile / kRowsPerPass;                     // 4 chunks per thread
  constexpr int kRaw = kChunk * static_cast<int>(sizeof(T)) / 16;  // 16-byte loads per chunk
  __shared__ uint32_t red[32];
  __shared__ __align__(16) uint32_t tile[kOutT ? kTile : 1][kTile / 4];

  const bool delayed = a.scale_in != nullptr;
  const Scaling s = delayed ? given_scaling(a.scale_in, a.scale_inv)
                            : reduce_scaling(a.partials, a.nparts, a.fp8max, a.scale_inv, a.amax_out, red);
  uint32_t seen = 0;  // delayed: max |x| bits of this thread's chunks
  const int64_t recorded = delayed ? recorded_rows(a.rows_in_use, a.R) : a.R;
  const T* inp = static_cast<const T*>(a.inp);
  const int64_t tiles_c = (a.C + kTile - 1) / kTile, tiles = (a.R + kTile - 1) / kTile * tiles_c;
  const int cc = threadIdx.x % kChunksPerRow, row0 = threadIdx.x / kChunksPerRow;
  // Transpose phase: this thread's 4-column group (of 32) and 16-row group (of 8).
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int cg = (warp % 4) * 8 + lane % 8, rg = (warp / 4) * 4 + lane / 8;

  for (int64_t n = blockIdx.x; n < tiles; n += gridDim.x) {
    // Last tile first: the amax launch read the tensor front to back, so its tail may still be
    // in L2; reading that first gets it before this launch's own traffic evicts it.
    const int64_t t = tiles - 1 - n;
    const int64_t r0 = t / tiles_c * kTile, c0 = t % tiles_c * kTile;
    const int rows = a.R - r0 < kTile ? static_cast<int>(a.R - r0) : kTile;
    const int cols = a.C - c0 < kTile ? static_cast<int>(a.C - c0) : kTile;
    const bool col_ok = cc * kChunk < cols;
    int4 raw[kIters][kRaw];
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const int row = row0 + j * kRowsPerPass;
      if (col_ok && row < rows) {
        const int4* p = reinterpret_cast<const int4*>(inp + (r0 + row) * a.ld + c0 + cc * kChunk);
#pragma unroll
        for (int k = 0; k < kRaw; ++k) raw[j][k] = __ldcs(p + k);  // read once more: do not keep in L2
      }
    }
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const int row = row0 + j * kRowsPerPass;
      if (col_ok && row < rows) {
        uint4 q = quantize_chunk<T, kE4M3>(raw[j], s.scale, s.finite);
        if (delayed) {
          const uint32_t m = chunk_abs_bits<T>(raw[j]);
          if (r0 + row < recorded) seen = max(seen, m);
          if (m >= 0x7f800000u) q = poison_nonfinite<T>(q, raw_chunk<T>(raw[j]));
        }
        if constexpr (kOut) *reinterpret_cast<uint4*>(a.out + (r0 + row) * a.C + c0 + cc * kChunk) = q;
        if constexpr (kOutT) *reinterpret_cast<uint4*>(&tile[row][(cc * 4) ^ swz(row)]) = q;
      }
    }
    if constexpr (kOutT) {
      __syncthreads();
      if (rg * 16 < rows && cg * 4 < cols) {
        uint32_t col[4][4];  // [group of 4 rows][column]
        tile_patch_columns(tile, rg, cg, col);
#pragma unroll
        for (int j = 0; j < 4; ++j)
          *reinterpret_cast<uint4*>(a.out_t + (c0 + cg * 4 + j) * a.R + r0 + rg * 16) =
              make_uint4(col[0][j], col[1][j], col[2][j], col[3][j]);
      }
      __syncthreads();  // the tile is refilled by the next iteration
    }
  }
  if (delayed && a.amax_out) {
    seen = block_max_u32(seen, red);
    if (threadIdx.x == 0) atomicMax(a.amax_out, seen);
  }
}

// ---- launch 2, generic path: any shape, pitch and alignment -------------------------------------
template <class T, bool kE4M3>
__global__ void __launch_bounds__(kThreads) quantize_generic_kernel(QuantArgs a) {
  constexpr int kRowsPerPass = kThreads / kGeneric;  // 8
  __shared__ uint32_t red[32];
  __shared__ uint8_t tile[kGeneric][kGeneric + 1];
  const bool delayed = a.scale_in != nullptr;
  const Scaling s = delayed ? given_scaling(a.scale_in, a.scale_inv)
                            : reduce_scaling(a.partials, a.nparts, a.fp8max, a.scale_inv, a.amax_out, red);
  uint32_t seen = 0;
  const int64_t recorded = delayed ? recorded_rows(a.rows_in_use, a.R) : a.R;
  const T* inp = static_cast<const T*>(a.inp);
  const int tx = threadIdx.x % kGeneric, ty = threadIdx.x / kGeneric;
  const int64_t tiles_c = (a.C + kGeneric - 1) / kGeneric, tiles = (a.R + kGeneric - 1) / kGeneric * tiles_c;
  for (int64_t n = blockIdx.x; n < tiles; n += gridDim.x) {
    const int64_t t = tiles - 1 - n;  // last tile first, as in the tile kernel
    const int64_t r0 = t / tiles_c * kGeneric, c0 = t % tiles_c * kGeneric;
#pragma unroll
    for (int i = 0; i < kGeneric / kRowsPerPass; ++i) {
      const int64_t r = r0 + ty + i * kRowsPerPass, c = c0 + tx;
      if (r < a.R && c < a.C) {
        const T x = inp[r * a.ld + c];
        const uint32_t ab = abs_bits(x);
        if (r < recorded) seen = max(seen, ab);
        const bool ok = s.finite && (!delayed || ab < 0x7f800000u);
        const uint8_t q = ok ? static_cast<uint8_t>(cvt2<kE4M3>(to_f32(x), 0.0f, s.scale)) : static_cast<uint8_t>(kPoison4);
        if (a.out) a.out[r * a.C + c] = q;
        tile[ty + i * kRowsPerPass][tx] = q;
      }
    }
    if (a.out_t) {
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kGeneric / kRowsPerPass; ++i) {
        const int64_t c = c0 + ty + i * kRowsPerPass, r = r0 + tx;
        if (r < a.R && c < a.C) a.out_t[c * a.R + r] = tile[tx][ty + i * kRowsPerPass];
      }
      __syncthreads();
    }
  }
  if (delayed && a.amax_out) {
    seen = block_max_u32(seen, red);
    if (threadIdx.x == 0) atomicMax(a.amax_out, seen);
  }
}

// ---- launchers ---------------------------------------------------------------------------------
bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <class Kernel>
int resident_blocks(Kernel kernel, int threads) {
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  return std::max(1, per_sm) * sm_count();
}

// A persistent grid: as many blocks as fit on the device at once (each one reduces the partials
// once), at least one (block 0 writes scale_inv even for an empty tensor).
template <auto kKernel, class Args>
void launch_quantize(int64_t tiles, const Args& a, cudaStream_t stream) {
  static const int resident = resident_blocks(kKernel, kThreads);  // one value per kernel
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(tiles, resident)));
  kKernel<<<grid, kThreads, 0, stream>>>(a);
  CUDA_CHECK_LAST();
}

template <class T, bool kE4M3>
void run(const T* inp, int64_t R, int64_t C, int64_t ld, uint8_t* out, uint8_t* out_t, float fp8max,
         float* scale_inv, uint32_t* partials, const float* scale_in, uint32_t* amax_out, cudaStream_t stream,
         const uint32_t* amax_in = nullptr, const int32_t* rows_in_use = nullptr) {
  constexpr int W = 16 / static_cast<int>(sizeof(T));
  const bool vec = aligned16(inp) && (ld * static_cast<int64_t>(sizeof(T))) % 16 == 0 && C % W == 0;
  const bool contig = ld == C || R <= 1;
  int nparts = 0;
  const uint32_t* parts = partials;
  if (!scale_in && amax_in) {  // current scaling with the amax known: it is the one partial
    parts = amax_in;
    nparts = 1;
  } else if (!scale_in) {  // current scaling: the amax first
    const int64_t units = vec ? R * (C / W) : R * C;
    const int64_t want = (units + kAmaxThreads * kAmaxUnroll - 1) / (kAmaxThreads * kAmaxUnroll);
    nparts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, std::min(kMaxPartials, 2 * sm_count()))));
    const int32_t* used = rows_in_use;
    if (vec && contig) amax_partials_kernel<T, true, true><<<nparts, kAmaxThreads, 0, stream>>>(inp, R, C, ld, partials, used);
    else if (vec) amax_partials_kernel<T, true, false><<<nparts, kAmaxThreads, 0, stream>>>(inp, R, C, ld, partials, used);
    else if (contig)
      amax_partials_kernel<T, false, true><<<nparts, kAmaxThreads, 0, stream>>>(inp, R, C, ld, partials, used);
    else amax_partials_kernel<T, false, false><<<nparts, kAmaxThreads, 0, stream>>>(inp, R, C, ld, partials, used);
    CUDA_CHECK_LAST();
  }

  const QuantArgs a{inp, R, C, ld, out, out_t, parts, nparts, fp8max, scale_inv, scale_in, amax_out, rows_in_use};
  const bool fast = vec && C % kChunk == 0 && (!out || aligned16(out)) && (!out_t || (aligned16(out_t) && R % 16 == 0));
  if (fast) {
    const int64_t tiles = (R + kTile - 1) / kTile * ((C + kTile - 1) / kTile);
    if (out && out_t) launch_quantize<quantize_tiles_kernel<T, kE4M3, true, true>>(tiles, a, stream);
    else if (out) launch_quantize<quantize_tiles_kernel<T, kE4M3, true, false>>(tiles, a, stream);
    else launch_quantize<quantize_tiles_kernel<T, kE4M3, false, true>>(tiles, a, stream);
  } else {
    const int64_t tiles = (R + kGeneric - 1) / kGeneric * ((C + kGeneric - 1) / kGeneric);
    launch_quantize<quantize_generic_kernel<T, kE4M3>>(tiles, a, stream);
  }
}

// ---- per-group scaling inside a tile (1x128 tiles, 128x128 blocks) -------------------------------
// One launch over 128 x 128 tiles of the input (256 threads); the groups lie inside the tile.
// Warp w owns the 16 consecutive rows 16w..16w+15 of the tile, lane l its columns 4l..4l+3, so a
// thread holds a 16 x 4 patch in registers after one read of the input (16 loads of 4 elements in
// flight); a bf16 patch stays as the 32 words it is loaded as (Bf16Patch: half the registers of
// f32 values, 80 registers in all instead of 121, so three blocks fit an SM instead of two). Row
// maxima come from warp reductions, column maxima from the threads' patch maxima reduced over the
// 8 warps through 4 KiB of shared memory. The row-scaled copy is written from the patch, 4 bytes a
// lane (128 contiguous bytes a row); the column-scaled transpose too: a patch column is 16
// consecutive rows, i.e. 16 contiguous bytes of out_t, one 16-byte store; no shared transpose is
// needed. Row scaling (a row's group spans the whole row) goes through quantize_rows_kernel (out
// alone) or the row-groups kernels with one group (with the column-scaled copy;
// quantize_fp8_grouped).
enum class GroupMode : int { Block1x128, Block128x128 };

struct GroupArgs {
  const void* inp;
  int64_t R, C, ld;
  uint8_t* out;
  float* scale_inv;
  uint8_t* out_t;
  float* scale_inv_t;
  float fp8max;
};

// Four FP8 bytes of x[0..3] under scaling s, x[0] in the low byte.
template <bool kE4M3>
__device__ __forceinline__ uint32_t cvt4(const float* x, const Scaling& s) {
  if (!s.finite) return kPoison4;
  return cvt2<kE4M3>(x[0], x[1], s.scale) | (cvt2<kE4M3>(x[2], x[3], s.scale) << 16);
}
// One FP8 byte of x under scaling s (the poison byte when the group is not finite).
template <bool kE4M3>
__device__ __forceinline__ uint32_t cvt1(float x, const Scaling& s) {
  return s.finite ? (cvt2<kE4M3>(x, 0.0f, s.scale) & 0xffu) : 0x7fu;
}

constexpr int kGTile = 128;
constexpr int kGRows = kGTile / (kThreads / 32);  // 16 rows a warp

// A thread's 16 x 4 patch: f32 values, or bf16 values kept as the words they are loaded as.
// at(i, j): row i, column j as f32; bits(i, j): that value's |x| as f32 bits.
struct F32Patch {
  float v[kGRows][4];
  __device__ __forceinline__ float at(int i, int j) const { return v[i][j]; }
  __device__ __forceinline__ uint32_t bits(int i, int j) const { return __float_as_uint(v[i][j]) & 0x7fffffffu; }
};
struct Bf16Patch {
  uint32_t w[kGRows][2];  // row i: columns 2k (low half) and 2k + 1 (high half) in word k
  __device__ __forceinline__ float at(int i, int j) const {
    const float2 p = bf16_pair(w[i][j / 2]);
    return j % 2 == 0 ? p.x : p.y;
  }
  __device__ __forceinline__ uint32_t bits(int i, int j) const { return __float_as_uint(at(i, j)) & 0x7fffffffu; }
};

// Preconditions (checked by the launcher): C % 16 == 0 and R % 16 == 0, inp rows 16-byte aligned
// (ld * sizeof(T) % 16 == 0), outputs 16-byte aligned; block modes: R, C multiples of 128.
template <class T, bool kE4M3, GroupMode kMode>
__global__ void __launch_bounds__(kThreads, 2) quantize_groups_kernel(GroupArgs a) {
  __shared__ uint32_t colpart[kThreads / 32][kGTile];
  __shared__ uint32_t red[32];
  const T* inp = static_cast<const T*>(a.inp);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kGTile + warp * kGRows;  // this warp's first row
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kGTile;
  const int c = 4 * lane;
  const bool col_ok = c0 + c < a.C;    // C % 16 == 0: a lane's 4 columns are all in or all out
  const bool rows_ok = r0 < a.R;       // R % 16 == 0: a warp's 16 rows are all in or all out
  std::conditional_t<sizeof(T) == 4, F32Patch, Bf16Patch> v;
  uint32_t cmax[4] = {0, 0, 0, 0};
  const bool in = rows_ok && col_ok;
#pragma unroll
  for (int i = 0; i < kGRows; ++i) {
    const T* src = inp + (r0 + i) * a.ld + c0 + c;
    if constexpr (sizeof(T) == 4) {
      const float4 f = in ? __ldg(reinterpret_cast<const float4*>(src)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      v.v[i][0] = f.x, v.v[i][1] = f.y, v.v[i][2] = f.z, v.v[i][3] = f.w;
    } else {
      const uint2 w = in ? __ldg(reinterpret_cast<const uint2*>(src)) : make_uint2(0u, 0u);
      v.w[i][0] = w.x, v.w[i][1] = w.y;
    }
  }
  uint32_t rmax[kGRows];
#pragma unroll
  for (int i = 0; i < kGRows; ++i) {
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t b = v.bits(i, j);
      m = max(m, b);
      cmax[j] = max(cmax[j], b);
    }
    rmax[i] = __reduce_max_sync(0xffffffffu, m);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) colpart[warp][c + j] = cmax[j];
  __syncthreads();
  // The tile's column maxima for this lane's 4 columns (every warp reads the same 128 words).
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t m = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) m = max(m, colpart[w][c + j]);
    cmax[j] = m;
  }
  uint32_t block_max = 0;
  if constexpr (kMode == GroupMode::Block128x128) {
    block_max = block_max_u32(max(max(cmax[0], cmax[1]), max(cmax[2], cmax[3])), red);
  }
  const int64_t nb_c = a.C / kGTile, nb_r = a.R / kGTile;  // block modes only
  if (!rows_ok) return;
  // ---- out: row-scaled copy, 4 bytes a lane per row
  if (a.out) {
#pragma unroll
    for (int i = 0; i < kGRows; ++i) {
      const int64_t r = r0 + i;
      const uint32_t m = kMode == GroupMode::Block1x128 ? rmax[i] : block_max;
      float inv;
      const Scaling s = group_scaling(m, a.fp8max, &inv);
      if (col_ok) {
        const float x[4] = {v.at(i, 0), v.at(i, 1), v.at(i, 2), v.at(i, 3)};
        *reinterpret_cast<uint32_t*>(a.out + r * a.C + c0 + c) = cvt4<kE4M3>(x, s);
      }
      if (lane == 0) {
        if constexpr (kMode == GroupMode::Block1x128) {
          a.scale_inv[blockIdx.x * a.R + r] = inv;
        } else if (i == 0 && warp == 0) {
          const int64_t pad = (nb_c + 3) / 4 * 4;
          a.scale_inv[blockIdx.y * pad + blockIdx.x] = inv;
          if (blockIdx.x == nb_c - 1)
            for (int64_t k = nb_c; k < pad; ++k) a.scale_inv[blockIdx.y * pad + k] = 1.0f;
        }
      }
    }
  }
  // ---- out_t: column-scaled transpose, one 16-byte store per patch column (its 16 rows)
  if (a.out_t && col_ok) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t col = c0 + c + j;
      const uint32_t m = kMode == GroupMode::Block1x128 ? cmax[j] : block_max;
      float inv;
      const Scaling s = group_scaling(m, a.fp8max, &inv);
      uint32_t w[4];
#pragma unroll
      for (int q = 0; q < 4; ++q)
        w[q] = cvt1<kE4M3>(v.at(4 * q, j), s) | (cvt1<kE4M3>(v.at(4 * q + 1, j), s) << 8) |
               (cvt1<kE4M3>(v.at(4 * q + 2, j), s) << 16) | (cvt1<kE4M3>(v.at(4 * q + 3, j), s) << 24);
      *reinterpret_cast<uint4*>(a.out_t + col * a.R + r0) = make_uint4(w[0], w[1], w[2], w[3]);
      if constexpr (kMode == GroupMode::Block1x128) {
        if (warp == 0) a.scale_inv_t[blockIdx.y * a.C + col] = inv;
      } else if (warp == 0 && lane == 0 && j == 0) {
        const int64_t pad = (nb_r + 3) / 4 * 4;
        a.scale_inv_t[blockIdx.x * pad + blockIdx.y] = inv;
        if (blockIdx.y == nb_r - 1)
          for (int64_t k = nb_r; k < pad; ++k) a.scale_inv_t[blockIdx.x * pad + k] = 1.0f;
      }
    }
  }
}

// The same groups from 8 x 8 patches (bf16, R and C multiples of 128, rows 16-byte aligned): thread
// t holds rows 8 (t / 16) .. + 7 and columns 8 (t % 16) .. + 7 of the tile, one 16-byte load a row
// (a warp reads two whole rows an instruction), the patch kept as the 32 words it loads. A row's
// maximum is a reduction over the 16 lanes of a half-warp (4 shuffles), a column's over the two
// half-warps of a warp (1 shuffle) and then the 8 warps through shared memory. Both copies are
// written 8 bytes at a time: a row's 8 columns into out, a column's 8 rows into out_t. Fewer
// instructions than the 16 x 4 patches (8 loads instead of 16, 32 row shuffles instead of 80).
template <bool kE4M3, GroupMode kMode>
__global__ void __launch_bounds__(kThreads, 3) quantize_groups8_kernel(GroupArgs a) {
  __shared__ __align__(16) uint32_t colpart[kThreads / 32][kGTile];
  __shared__ uint32_t red[32];
  const bf16* inp = static_cast<const bf16*>(a.inp);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rg = threadIdx.x / 16, cs = threadIdx.x % 16;
  const int64_t bx = blockIdx.x, by = blockIdx.y;
  const int64_t r0 = by * kGTile + rg * 8, c0 = bx * kGTile + cs * 8;
  uint4 w[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = __ldg(reinterpret_cast<const uint4*>(inp + (r0 + i) * a.ld + c0));
  // Column j of row i: half j % 2 of word j / 2; |x| as f32 bits.
  const auto word = [&](int i, int k) -> uint32_t { return reinterpret_cast<const uint32_t*>(&w[i])[k]; };
  const auto value = [&](int i, int j) -> float {
    const uint32_t x = word(i, j / 2);
    return __uint_as_float(j % 2 == 0 ? x << 16 : x & 0xffff0000u);
  };
  uint32_t rmax[8], cmax[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t x = word(i, k), lo = (x & 0x7fffu) << 16, hi = x & 0x7fff0000u;
      cmax[2 * k] = max(cmax[2 * k], lo);
      cmax[2 * k + 1] = max(cmax[2 * k + 1], hi);
      m = max(m, max(lo, hi));
    }
#pragma unroll
    for (int d = 1; d < 16; d *= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, d));
    rmax[i] = m;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) cmax[j] = max(cmax[j], __shfl_xor_sync(0xffffffffu, cmax[j], 16));
  if (lane < 16) {
    *reinterpret_cast<uint4*>(&colpart[warp][cs * 8]) = make_uint4(cmax[0], cmax[1], cmax[2], cmax[3]);
    *reinterpret_cast<uint4*>(&colpart[warp][cs * 8 + 4]) = make_uint4(cmax[4], cmax[5], cmax[6], cmax[7]);
  }
  __syncthreads();
#pragma unroll
  for (int v = 0; v < kThreads / 32; ++v) {
    const uint4 p = *reinterpret_cast<const uint4*>(&colpart[v][cs * 8]);
    const uint4 q = *reinterpret_cast<const uint4*>(&colpart[v][cs * 8 + 4]);
    cmax[0] = max(cmax[0], p.x), cmax[1] = max(cmax[1], p.y), cmax[2] = max(cmax[2], p.z), cmax[3] = max(cmax[3], p.w);
    cmax[4] = max(cmax[4], q.x), cmax[5] = max(cmax[5], q.y), cmax[6] = max(cmax[6], q.z), cmax[7] = max(cmax[7], q.w);
  }
  uint32_t block_max = 0;
  if constexpr (kMode == GroupMode::Block128x128) {
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) m = max(m, cmax[j]);
    block_max = block_max_u32(m, red);
  }
  const int64_t nb_c = a.C / kGTile, nb_r = a.R / kGTile;
  // ---- out: row-scaled copy, 8 bytes a thread per row
  if (a.out) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      float inv;
      const Scaling s = group_scaling(kMode == GroupMode::Block1x128 ? rmax[i] : block_max, a.fp8max, &inv);
      uint32_t b[2];
#pragma unroll
      for (int h = 0; h < 2; ++h)
        b[h] = s.finite ? cvt2<kE4M3>(value(i, 4 * h), value(i, 4 * h + 1), s.scale) |
                              (cvt2<kE4M3>(value(i, 4 * h + 2), value(i, 4 * h + 3), s.scale) << 16)
                        : kPoison4;
      *reinterpret_cast<uint2*>(a.out + (r0 + i) * a.C + c0) = make_uint2(b[0], b[1]);
      if constexpr (kMode == GroupMode::Block1x128) {
        if (cs == 0) a.scale_inv[bx * a.R + r0 + i] = inv;
      } else if (threadIdx.x == 0 && i == 0) {
        const int64_t pad = (nb_c + 3) / 4 * 4;
        a.scale_inv[by * pad + bx] = inv;
        if (bx == nb_c - 1)
          for (int64_t k = nb_c; k < pad; ++k) a.scale_inv[by * pad + k] = 1.0f;
      }
    }
  }
  // ---- out_t: column-scaled transpose, 8 bytes (this thread's rows) a column
  if (a.out_t) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float inv;
      const Scaling s = group_scaling(kMode == GroupMode::Block1x128 ? cmax[j] : block_max, a.fp8max, &inv);
      uint32_t b[2];
#pragma unroll
      for (int h = 0; h < 2; ++h)
        b[h] = s.finite ? cvt2<kE4M3>(value(4 * h, j), value(4 * h + 1, j), s.scale) |
                              (cvt2<kE4M3>(value(4 * h + 2, j), value(4 * h + 3, j), s.scale) << 16)
                        : kPoison4;
      *reinterpret_cast<uint2*>(a.out_t + (c0 + j) * a.R + r0) = make_uint2(b[0], b[1]);
      if constexpr (kMode == GroupMode::Block1x128) {
        if (rg == 0) a.scale_inv_t[by * a.C + c0 + j] = inv;
      } else if (threadIdx.x == 0 && j == 0) {
        const int64_t pad = (nb_r + 3) / 4 * 4;
        a.scale_inv_t[bx * pad + by] = inv;
        if (by == nb_r - 1)
          for (int64_t k = nb_r; k < pad; ++k) a.scale_inv_t[bx * pad + k] = 1.0f;
      }
    }
  }
}

// PRIMUS_TURBO_QUANT_GROUPS_KERNEL: patch8 (the default where it applies: bf16, both dimensions
// multiples of 128, 16-byte aligned rows; 8-9% faster than the 16 x 4 patches at [16384, 8192] on an
// H200) or patch16 (the 16 x 4 patches everywhere).
template <class T, bool kE4M3, GroupMode kMode>
void launch_groups(const GroupArgs& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((a.C + kGTile - 1) / kGTile), static_cast<unsigned>((a.R + kGTile - 1) / kGTile));
  const bool patch8 = env_choice("PRIMUS_TURBO_QUANT_GROUPS_KERNEL", {"patch8", "patch16"}, "patch8") == "patch8";
  if constexpr (sizeof(T) == 2) {
    if (patch8 && a.R % kGTile == 0 && a.C % kGTile == 0 && (a.ld * 2) % 16 == 0 &&
        reinterpret_cast<uintptr_t>(a.inp) % 16 == 0) {
      quantize_groups8_kernel<kE4M3, kMode><<<grid, kThreads, 0, stream>>>(a);
      CUDA_CHECK(cudaGetLastError());
      return;
    }
  }
  quantize_groups_kernel<T, kE4M3, kMode><<<grid, kThreads, 0, stream>>>(a);
  CUDA_CHECK(cudaGetLastError());
}

template <class T, bool kE4M3>
void run_groups(const GroupArgs& a, Fp8Granularity g, cudaStream_t stream) {
  switch (g) {
    case Fp8Granularity::Block1x128: launch_groups<T, kE4M3, GroupMode::Block1x128>(a, stream); return;
    case Fp8Granularity::Block128x128: launch_groups<T, kE4M3, GroupMode::Block128x128>(a, stream); return;
    case Fp8Granularity::Row: break;
    case Fp8Granularity::Tensor: break;
  }
  throw RuntimeError(fmt::format("quantize_fp8_grouped: {} granularity does not go through the groups kernel",
                                 fp8_granularity_name(g)));
}

// ---- Row granularity with row groups for out_t (cpu::quantize_fp8_row_groups_t) ----------------
// Launches 1 and 3 walk 128 x 128 tiles of the input (launch 1 one block a tile, launch 3 a
// persistent grid) and first find the group of each of the tile's rows (tile_groups).
//   1. Column maxima per group: a thread reads 8 columns of 8 consecutive rows (usually all of one
//      group), folds each run of rows of one group into a shared maximum for the tile's first
//      kRgSegs groups (integer atomicMax: order-free) and those go to global memory once a tile,
//      so a tile inside one group costs 128 global atomics rather than one per row and column; a
//      tile crossing more groups (groups of a few rows) sends the later ones straight to global
//      memory. With out, the row maxima too (shuffles over the 16 threads of a row, one atomic a
//      row and tile).
//   2. Maxima to scales, in place, and scale_inv / scale_inv_t: one thread an entry, so the
//      quantising launch multiplies instead of dividing.
//   3. The tensorwise tile kernel's layout with a scale per column: a thread's 16-element chunk of
//      a row takes the 16 scales of the row's group (loaded again only when the group changes
//      between its rows), bytes go through the swizzled shared tile, and 16 rows x 4 columns are
//      written back transposed: one 16-byte store a column when all 16 rows belong to a group,
//      byte by byte otherwise (rows of no group keep what out_t held). Persistent, with the next
//      tile's loads issued before this tile's transposed stores.
// Measured on an H200 ([65536, 2048] bf16, 64 groups): out_t alone 200 us, with out 260 us, i.e.
// 3.4 and 3.1 TB/s counting both reads of the input (launch 1 alone reads at 3.7 TB/s); faster
// than the plain Row path above on the same shape (230 / 311 us).
struct RowGroupArgs {
  const void* inp;
  int64_t R, C, ld;
  const int32_t* offsets;  // [G + 1]; null: groups of group_rows rows
  int64_t group_rows;
  int G;
  uint8_t* out;  // may be null
  float* scale_inv;
  uint8_t* out_t;
  float* scale_inv_t;
  uint32_t* col_amax;  // [G, C]: max |x| bits after launch 1, the scale (f32 bits) after launch 2
  uint32_t* row_amax;  // [R] with out, likewise
  float fp8max;
};

constexpr int kRgTile = 128;
constexpr int kRgSegs = 4;  // launch 1: groups of a tile folded in shared memory

// gid[i] = the group of row r0 + i (i < kRgTile): #{k in 1..G : offsets[k] <= r0 + i}, and G (no
// group) past R. Counted, not searched: one pass over the offsets with no chain of dependent
// loads, and a count lies in [0, G] whatever the array holds (comparing with a row in [0, R) gives
// the same answers as offsets clamped into [0, R]). gid: kRgTile + 1 shared ints. Ends with
// __syncthreads.
__device__ __forceinline__ void tile_groups(const RowGroupArgs& a, int64_t r0, int* gid) {
  if (a.offsets == nullptr) {
    for (int i = threadIdx.x; i < kRgTile; i += blockDim.x) {
      const int64_t r = r0 + i;
      gid[i] = r < a.R ? static_cast<int>(r / a.group_rows) : a.G;
    }
    __syncthreads();
    return;
  }
  for (int i = threadIdx.x; i <= kRgTile; i += blockDim.x) gid[i] = 0;
  __syncthreads();
  // gid[kRgTile]: offsets at or before the tile; gid[i]: offsets that start a group at row r0 + i.
  for (int k = 1 + static_cast<int>(threadIdx.x); k <= a.G; k += blockDim.x) {  // G < 2^31 - 1024: no overflow
    const int64_t o = __ldg(a.offsets + k);
    if (o <= r0) atomicAdd(&gid[kRgTile], 1);
    else if (o < r0 + kRgTile) atomicAdd(&gid[o - r0], 1);
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // inclusive prefix sum by warp 0, kPer consecutive entries a lane
    constexpr int kPer = kRgTile / 32;
    const int lane = threadIdx.x;
    int v[kPer], sum = 0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) v[j] = sum += gid[lane * kPer + j];
    int incl = sum;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int t = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += t;
    }
    const int before = gid[kRgTile] + incl - sum;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int i = lane * kPer + j;
      gid[i] = r0 + i < a.R ? before + v[j] : a.G;
    }
  }
  __syncthreads();
}

// kN consecutive elements of T from p, the first `valid` of them real (none when valid <= 0,
// zeros for the rest), as kN * sizeof(T) / 16 words of 16 bytes: 16-byte loads (kVec: valid is
// then 0 or >= kN and p 16-byte aligned; kStream: not kept in L2) or element by element.
template <class T, bool kVec, bool kStream, int kN>
__device__ __forceinline__ void load_chunk(const T* p, int64_t valid, int4 (&raw)[kN * sizeof(T) / 16]) {
  constexpr int kRaw = kN * static_cast<int>(sizeof(T)) / 16;
  if constexpr (kVec) {
#pragma unroll
    for (int k = 0; k < kRaw; ++k) {
      const int4* q = reinterpret_cast<const int4*>(p) + k;
      raw[k] = valid <= 0 ? make_int4(0, 0, 0, 0) : kStream ? __ldcs(q) : __ldg(q);
    }
  } else {
    uint32_t w[4 * kRaw];
    if constexpr (sizeof(T) == 4) {
      const uint32_t* q = reinterpret_cast<const uint32_t*>(p);
#pragma unroll
      for (int e = 0; e < kN; ++e) w[e] = e < valid ? q[e] : 0u;
    } else {
      const uint16_t* q = reinterpret_cast<const uint16_t*>(p);
#pragma unroll
      for (int e = 0; e < kN; e += 2)
        w[e / 2] = (e < valid ? q[e] : 0u) | (e + 1 < valid ? static_cast<uint32_t>(q[e + 1]) << 16 : 0u);
    }
#pragma unroll
    for (int k = 0; k < kRaw; ++k) raw[k] = make_int4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
  }
}
// Element e of a chunk as loaded: |x| as f32 bits, and x.
template <class T>
__device__ __forceinline__ uint32_t elem_abs_bits(const int4* raw, int e) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(raw);
  if constexpr (sizeof(T) == 4) return w[e] & 0x7fffffffu;
  else return (e % 2 ? w[e / 2] : w[e / 2] << 16) & 0x7fff0000u;
}
template <class T>
__device__ __forceinline__ float elem_value(const int4* raw, int e) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(raw);
  if constexpr (sizeof(T) == 4) return __uint_as_float(w[e]);
  else return __uint_as_float(e % 2 ? w[e / 2] & 0xffff0000u : w[e / 2] << 16);
}
// Byte e of 16 FP8 bytes.
__device__ __forceinline__ uint32_t chunk_byte(const uint4& q, int e) {
  const uint32_t w = e < 4 ? q.x : e < 8 ? q.y : e < 12 ? q.z : q.w;
  return (w >> (8 * (e % 4))) & 0xffu;
}
// 16 FP8 bytes to dst, the first `valid` of them (kVec: all 16, one store; dst 16-byte aligned).
template <bool kVec>
__device__ __forceinline__ void store_chunk(uint8_t* dst, const uint4& q, int64_t valid) {
  if constexpr (kVec) {
    *reinterpret_cast<uint4*>(dst) = q;
  } else {
#pragma unroll
    for (int e = 0; e < 16; ++e)
      if (e < valid) dst[e] = static_cast<uint8_t>(chunk_byte(q, e));
  }
}

// Blocks per SM asked of the register allocator: bf16 on the 16-byte path fits 4 (3 with the row
// maxima) without spilling; f32 chunks and the element-wise path take twice the registers.
template <class T, bool kVec, bool kOut>
__global__ void __launch_bounds__(kThreads, kVec && sizeof(T) == 2 ? (kOut ? 3 : 4) : 2)
    row_groups_amax_kernel(RowGroupArgs a) {
  constexpr int kN = 8;                              // elements a thread reads of a row
  constexpr int kTx = kRgTile / kN;                  // 16 threads across the tile
  constexpr int kRpt = kRgTile / (kThreads / kTx);   // 8 consecutive rows a thread
  constexpr int kRaw = kN * static_cast<int>(sizeof(T)) / 16;
  __shared__ int gid[kRgTile + 1];
  __shared__ uint32_t seg[kRgSegs][kRgTile];
  const int64_t tiles_c = (a.C + kRgTile - 1) / kRgTile;
  const int64_t r0 = blockIdx.x / tiles_c * kRgTile, c0 = blockIdx.x % tiles_c * kRgTile;
  const int tx = threadIdx.x % kTx, ty = threadIdx.x / kTx;
  const int64_t c = c0 + tx * kN;
  const T* inp = static_cast<const T*>(a.inp);
  int4 raw[kRpt][kRaw];
#pragma unroll
  for (int i = 0; i < kRpt; ++i) {
    const int64_t r = r0 + ty * kRpt + i;
    load_chunk<T, kVec, false, kN>(inp + r * a.ld + c, r < a.R ? a.C - c : 0, raw[i]);
  }
  for (int i = threadIdx.x; i < kRgSegs * kRgTile; i += blockDim.x) seg[i / kRgTile][i % kRgTile] = 0;
  tile_groups(a, r0, gid);  // synchronises: seg is zeroed
  const int g0 = gid[0];
  uint32_t cm[kN], rm[kRpt];
#pragma unroll
  for (int e = 0; e < kN; ++e) cm[e] = 0;
  // cm (a run of rows of group g) into the group's maxima; rows of no group count for nothing.
  const auto flush = [&](int g) {
    if (g >= a.G) return;
    const int s = g - g0;
    if (s >= 0 && s < kRgSegs) {
#pragma unroll
      for (int e = 0; e < kN; ++e)
        if (cm[e] != 0) atomicMax(&seg[s][tx * kN + e], cm[e]);
    } else {
#pragma unroll
      for (int e = 0; e < kN; ++e)
        if (cm[e] != 0) atomicMax(a.col_amax + static_cast<int64_t>(g) * a.C + c + e, cm[e]);
    }
  };
  int cur = gid[ty * kRpt];
#pragma unroll
  for (int i = 0; i < kRpt; ++i) {
    const int g = gid[ty * kRpt + i];
    if (g != cur) {
      flush(cur);
#pragma unroll
      for (int e = 0; e < kN; ++e) cm[e] = 0;
      cur = g;
    }
    uint32_t m = 0;
#pragma unroll
    for (int e = 0; e < kN; ++e) {
      const uint32_t b = elem_abs_bits<T>(raw[i], e);
      cm[e] = max(cm[e], b);
      m = max(m, b);
    }
    rm[i] = m;
  }
  flush(cur);
  if constexpr (kOut) {
    // The maxima of the kRpt rows over the 16 threads of a row (lanes 0-15 or 16-31 of one warp),
    // halving the rows at each step: a thread with tx & 8 keeps rows 4-7 and sends 0-3 to its
    // partner, and so on, so 4 + 2 + 1 shuffles leave row (bits 8, 4, 2 of tx) in each pair of
    // lanes, and one more completes it.
    static_assert(kRpt == 8 && kTx == 16);
    uint32_t h[4], q[2];
    const bool b8 = tx & 8, b4 = tx & 4, b2 = tx & 2;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      h[i] = max(b8 ? rm[i + 4] : rm[i], __shfl_xor_sync(0xffffffffu, b8 ? rm[i] : rm[i + 4], 8));
#pragma unroll
    for (int i = 0; i < 2; ++i)
      q[i] = max(b4 ? h[i + 2] : h[i], __shfl_xor_sync(0xffffffffu, b4 ? h[i] : h[i + 2], 4));
    uint32_t m = max(b2 ? q[1] : q[0], __shfl_xor_sync(0xffffffffu, b2 ? q[0] : q[1], 2));
    m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
    const int64_t r = r0 + ty * kRpt + (b8 ? 4 : 0) + (b4 ? 2 : 0) + (b2 ? 1 : 0);
    if ((tx & 1) == 0 && r < a.R && m != 0) atomicMax(a.row_amax + r, m);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kRgSegs * kRgTile; i += blockDim.x) {
    const int s = i / kRgTile, col = i % kRgTile;
    const uint32_t m = seg[s][col];
    if (m != 0 && g0 + s < a.G) atomicMax(a.col_amax + static_cast<int64_t>(g0 + s) * a.C + c0 + col, m);
  }
}

__global__ void __launch_bounds__(kThreads) row_groups_scales_kernel(RowGroupArgs a) {
  const int64_t ncol = static_cast<int64_t>(a.G) * a.C, n = ncol + (a.out ? a.R : 0);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t* slot = i < ncol ? a.col_amax + i : a.row_amax + (i - ncol);
    float inv;
    const Scaling s = group_scaling(*slot, a.fp8max, &inv);  // scale NaN: not finite
    *slot = __float_as_uint(s.scale);
    if (i < ncol) a.scale_inv_t[i] = inv;
    else a.scale_inv[i - ncol] = inv;
  }
}

// 16 FP8 bytes of a chunk with a scale per element (NaN: the poison byte).
template <class T, bool kE4M3>
__device__ __forceinline__ uint4 quantize_chunk_cols(const int4* raw, const float (&sc)[kChunk],
                                                     uint32_t nan_cols) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int e = 4 * j;
    w[j] = cvt2<kE4M3>(elem_value<T>(raw, e), elem_value<T>(raw, e + 1), sc[e], sc[e + 1]) |
           (cvt2<kE4M3>(elem_value<T>(raw, e + 2), elem_value<T>(raw, e + 3), sc[e + 2], sc[e + 3]) << 16);
  }
  if (nan_cols != 0) {  // rare: a group whose column holds an inf or NaN
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t bm = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) bm |= (nan_cols >> (4 * j + b) & 1u) ? 0xffu << (8 * b) : 0u;
      w[j] = (w[j] & ~bm) | (kPoison4 & bm);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// A tile of launch 3: its first row and column, and its extent (edge tiles are smaller).
struct RgTile {
  int64_t r0, c0;
  int rows, cols;
};
__device__ __forceinline__ RgTile rg_tile(const RowGroupArgs& a, int64_t n, int64_t tiles) {
  const int64_t tiles_c = (a.C + kRgTile - 1) / kRgTile;
  const int64_t t = tiles - 1 - n;  // last tile first: launch 1 read front to back, so its tail may
                                    // still be in L2
  RgTile u;
  u.r0 = t / tiles_c * kRgTile, u.c0 = t % tiles_c * kRgTile;
  u.rows = a.R - u.r0 < kRgTile ? static_cast<int>(a.R - u.r0) : kRgTile;
  u.cols = a.C - u.c0 < kRgTile ? static_cast<int>(a.C - u.c0) : kRgTile;
  return u;
}

// Persistent: a block walks tiles n = blockIdx.x, + gridDim.x, ..., and issues the next tile's
// loads as soon as this tile's values are in the shared tile, so they are in flight while the
// transposed bytes are written (registers allow one tile of loads, not two). 3 blocks per SM for
// bf16 on the 16-byte path; with out the row-scaled bytes need more registers than that leaves,
// and 2 blocks without spilling measured faster than 3 with.
template <class T, bool kE4M3, bool kVec, bool kOut>
__global__ void __launch_bounds__(kThreads, kVec && sizeof(T) == 2 && !kOut ? 3 : 2)
    row_groups_quantize_kernel(RowGroupArgs a) {
  constexpr int kChunksPerRow = kRgTile / kChunk;                  // 8
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;           // 32
  constexpr int kIters = kRgTile / kRowsPerPass;                   // 4 chunks per thread
  constexpr int kRaw = kChunk * static_cast<int>(sizeof(T)) / 16;  // 16-byte words per chunk
  __shared__ int gid[kRgTile + 1];
  __shared__ __align__(16) uint32_t tile[kRgTile][kRgTile / 4];
  const int64_t tiles = (a.R + kRgTile - 1) / kRgTile * ((a.C + kRgTile - 1) / kRgTile);
  const int cc = threadIdx.x % kChunksPerRow, row0 = threadIdx.x / kChunksPerRow;
  // Transpose phase: this thread's 4-column group (of 32) and 16-row group (of 8).
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int cg = (warp % 4) * 8 + lane % 8, rg = (warp / 4) * 4 + lane / 8;
  const T* inp = static_cast<const T*>(a.inp);
  const float* col_scale = reinterpret_cast<const float*>(a.col_amax);
  int4 raw[kIters][kRaw];
  const auto load = [&](const RgTile& u) {
    const int64_t c = u.c0 + cc * kChunk;
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const int row = row0 + j * kRowsPerPass;
      load_chunk<T, kVec, true, kChunk>(inp + (u.r0 + row) * a.ld + c, row < u.rows ? a.C - c : 0, raw[j]);
    }
  };
  if (blockIdx.x < tiles) load(rg_tile(a, blockIdx.x, tiles));
  for (int64_t n = blockIdx.x; n < tiles; n += gridDim.x) {
    const RgTile u = rg_tile(a, n, tiles);
    const int64_t c = u.c0 + cc * kChunk;
    tile_groups(a, u.r0, gid);
    float sc[kChunk];
    uint32_t nan_cols = 0;
    int cur = -1;
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const int row = row0 + j * kRowsPerPass;
      if (row >= u.rows || c >= a.C) continue;
      const int64_t r = u.r0 + row;
      if constexpr (kOut) {
        const float s = __ldg(reinterpret_cast<const float*>(a.row_amax) + r);
        store_chunk<kVec>(a.out + r * a.C + c, quantize_chunk<T, kE4M3>(raw[j], s, !isnan(s)), a.C - c);
      }
      const int g = gid[row];
      if (g >= a.G) continue;  // no group: its tile row is never read back
      if (g != cur) {          // the thread's rows are 32 apart: mostly of one group
        cur = g;
        const float* p = col_scale + static_cast<int64_t>(g) * a.C + c;
        if constexpr (kVec) {
#pragma unroll
          for (int k = 0; k < kChunk / 4; ++k) {
            const float4 f = __ldg(reinterpret_cast<const float4*>(p) + k);
            sc[4 * k] = f.x, sc[4 * k + 1] = f.y, sc[4 * k + 2] = f.z, sc[4 * k + 3] = f.w;
          }
        } else {
#pragma unroll
          for (int e = 0; e < kChunk; ++e) sc[e] = c + e < a.C ? __ldg(p + e) : 1.0f;
        }
        nan_cols = 0;
#pragma unroll
        for (int e = 0; e < kChunk; ++e) nan_cols |= isnan(sc[e]) ? 1u << e : 0u;
      }
      *reinterpret_cast<uint4*>(&tile[row][(cc * 4) ^ swz(row)]) =
          quantize_chunk_cols<T, kE4M3>(raw[j], sc, nan_cols);
    }
    if (n + gridDim.x < tiles) load(rg_tile(a, n + gridDim.x, tiles));
    __syncthreads();
    // Transpose phase, as in quantize_tiles_kernel: 16 rows x 4 columns a thread.
    uint32_t valid = 0;  // bit i: row rg * 16 + i is in the tensor and in a group
    if (rg * 16 < u.rows && cg * 4 < u.cols) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int row = rg * 16 + i;
        valid |= row < u.rows && gid[row] < a.G ? 1u << i : 0u;
      }
    }
    if (valid != 0) {
      uint32_t col[4][4];  // [group of 4 rows][column]
      tile_patch_columns(tile, rg, cg, col);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t cj = u.c0 + cg * 4 + j;
        if (!kVec && cj >= a.C) break;
        uint8_t* dst = a.out_t + cj * a.R + u.r0 + rg * 16;
        const uint4 q = make_uint4(col[0][j], col[1][j], col[2][j], col[3][j]);
        if (kVec && valid == 0xffffu) {
          *reinterpret_cast<uint4*>(dst) = q;
        } else {
#pragma unroll
          for (int i = 0; i < 16; ++i)
            if (valid >> i & 1u) dst[i] = static_cast<uint8_t>(chunk_byte(q, i));
        }
      }
    }
    __syncthreads();  // gid and the shared tile are refilled by the next tile
  }
}

// A persistent grid: as many blocks as fit on the device at once, at most one a tile.
template <auto kKernel>
void launch_persistent(int64_t tiles, const RowGroupArgs& a, cudaStream_t stream) {
  static const int resident = resident_blocks(kKernel, kThreads);  // one value per kernel
  kKernel<<<static_cast<unsigned>(std::min<int64_t>(tiles, resident)), kThreads, 0, stream>>>(a);
  CUDA_CHECK_LAST();
}

// amax_known: col_amax (and row_amax) already hold the maxima; launch 1 is skipped.
template <class T, bool kVec, bool kOut>
void run_row_groups(const RowGroupArgs& a, bool e4m3, cudaStream_t stream, bool amax_known = false) {
  const int64_t tiles = (a.R + kRgTile - 1) / kRgTile * ((a.C + kRgTile - 1) / kRgTile);
  const int64_t scales = static_cast<int64_t>(a.G) * a.C + (kOut ? a.R : 0);
  if (tiles > 0 && !amax_known) {
    row_groups_amax_kernel<T, kVec, kOut><<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(a);
    CUDA_CHECK_LAST();
  }
  if (scales > 0) {
    const int64_t grid = std::min<int64_t>((scales + kThreads - 1) / kThreads, 8 * sm_count());
    row_groups_scales_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(a);
    CUDA_CHECK_LAST();
  }
  if (tiles > 0) {
    if (e4m3) launch_persistent<row_groups_quantize_kernel<T, true, kVec, kOut>>(tiles, a, stream);
    else launch_persistent<row_groups_quantize_kernel<T, false, kVec, kOut>>(tiles, a, stream);
  }
}

// ---- Row scaling of out alone (no transposed copy): one launch ----------------------------------
// One warp per row: the row's 16-element chunks are read from device memory once, kept in
// registers (kRowRegChunks per lane: rows of up to 4096 bf16 or 2048 f32 elements; a longer row
// reads the rest of itself again, from L2), the amax is a warp reduction, and the same registers
// are cast and stored. So the tensor is read once (the two-launch path reads it twice: row maxima,
// then the cast), no scratch and no memset. Lane l takes chunks l, l + 32, ...: a warp's loads of
// one step are 32 consecutive chunks of the row.
template <class T>
constexpr int kRowRegChunks = sizeof(T) == 2 ? 8 : 4;
template <class T, bool kE4M3>
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(const T* __restrict__ inp, int64_t R, int64_t C,
                                                                 int64_t ld, uint8_t* __restrict__ out,
                                                                 float* __restrict__ scale_inv, float fp8max) {
  constexpr int kRaw = kChunk * static_cast<int>(sizeof(T)) / 16;  // 16-byte loads per chunk
  constexpr int kRegs = kRowRegChunks<T>;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  const int64_t chunks = C / kChunk;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32; r < R; r += warps) {
    const int4* row = reinterpret_cast<const int4*>(inp + r * ld);
    int4 raw[kRegs][kRaw];
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      const int64_t c = lane + 32 * i;
      if (c < chunks) {
#pragma unroll
        for (int k = 0; k < kRaw; ++k) raw[i][k] = __ldg(row + c * kRaw + k);
        m = max(m, chunk_abs_bits<T>(raw[i]));
      }
    }
    for (int64_t c = lane + 32 * kRegs; c < chunks; c += 32) {
      int4 v[kRaw];
#pragma unroll
      for (int k = 0; k < kRaw; ++k) v[k] = __ldg(row + c * kRaw + k);
      m = max(m, chunk_abs_bits<T>(v));
    }
    m = __reduce_max_sync(0xffffffffu, m);
    float inv;
    const Scaling sc = group_scaling(m, fp8max, &inv);
    if (lane == 0) scale_inv[r] = inv;
    uint4* orow = reinterpret_cast<uint4*>(out + r * C);
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      const int64_t c = lane + 32 * i;
      if (c < chunks) orow[c] = quantize_chunk<T, kE4M3>(raw[i], sc.scale, sc.finite);
    }
    for (int64_t c = lane + 32 * kRegs; c < chunks; c += 32) {
      int4 v[kRaw];
#pragma unroll
      for (int k = 0; k < kRaw; ++k) v[k] = __ldg(row + c * kRaw + k);
      orow[c] = quantize_chunk<T, kE4M3>(v, sc.scale, sc.finite);
    }
  }
}
int device_sms() {
  static const int sms = [] {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
      n = 132;
    return std::max(1, n);
  }();
  return sms;
}
template <class T, bool kE4M3>
void run_rows(const T* inp, int64_t R, int64_t C, int64_t ld, uint8_t* out, float* scale_inv, float fp8max,
              cudaStream_t stream) {
  const int64_t rows_per_block = kThreads / 32;
  const int64_t blocks = std::min<int64_t>((R + rows_per_block - 1) / rows_per_block, int64_t{device_sms()} * 8);
  quantize_rows_kernel<T, kE4M3><<<static_cast<unsigned>(std::max<int64_t>(blocks, 1)), kThreads, 0, stream>>>(
      inp, R, C, ld, out, scale_inv, fp8max);
  CUDA_CHECK_LAST();
}

// ---- delayed scaling's bookkeeping (cpu::fp8_delayed_update) ------------------------------------
// One block per tensor; its history row goes through shared memory so that the move by one
// entry reads every old entry before any is overwritten.
constexpr int kUpdateThreads = 256;
__global__ void __launch_bounds__(kUpdateThreads) delayed_update_kernel(float* history, float* scale,
                                                                        const float* fp8_max, int64_t len, bool use_max,
                                                                        float factor) {
  extern __shared__ float row[];
  __shared__ uint32_t red[32];
  float* h = history + static_cast<int64_t>(blockIdx.x) * len;
  uint32_t m = 0;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    float v = h[i];
    if (i == 0 && !isfinite(v)) v = 0.0f;
    row[i] = v;
    if (i == 0 || use_max) m = max(m, __float_as_uint(v));  // v >= 0: its bits order like its value
  }
  m = block_max_u32(m, red);  // synchronises: row is complete
  if (threadIdx.x == 0 && m != 0) {
    float s = __fdiv_rn(fp8_max[blockIdx.x], __uint_as_float(m));
    if (isinf(s)) s = FLT_MAX;
    scale[blockIdx.x] = __fmul_rn(s, factor);
  }
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) h[i] = i == 0 ? 0.0f : row[i - 1];
}

// ---- SwiGLU folded into the delayed quantizer ----------------------------------------------------
// The tile kernel's layout (128 x 128 tiles of the output, 16-element chunks, the shared-memory
// transpose), with each chunk computed from gate_up (and dout) as it is read instead of loaded from
// a tensor the activation kernel wrote: forward y = silu(gate) * up [R, F]; backward
// dgate_up = [dgate | dup] [R, 2F], where one block computes a tile of dgate and the tile of dup at
// the same rows and columns from one read of gate, up and dout. Each value is rounded to bf16 first,
// as the activation kernels store it, so the bytes are those of the activation then the quantizer.
struct SwigluQuantArgs {
  const bf16* gate_up;  // [R, 2F]
  const bf16* dout;     // backward: [R, F]
  int64_t R, F;
  uint8_t* out;    // [R, C], C = F (forward) or 2F (backward); may be null
  uint8_t* out_t;  // [C, R]; may be null
  const float* scale_in;
  float* scale_inv;
  uint32_t* amax_out;
};

// 16 bf16 values as two 16-byte words; element e is half e % 2 of 32-bit word e / 2. Read and
// written a whole word at a time, so the chunk stays in registers.
struct Chunk16 {
  int4 w[2];
};
__device__ __forceinline__ Chunk16 load_chunk_cs(const bf16* p) {
  Chunk16 c;
  c.w[0] = __ldcs(reinterpret_cast<const int4*>(p));
  c.w[1] = __ldcs(reinterpret_cast<const int4*>(p) + 1);
  return c;
}
__device__ __forceinline__ uint32_t chunk_word(const Chunk16& c, int i) {
  return reinterpret_cast<const uint32_t*>(c.w)[i];
}
__device__ __forceinline__ void chunk_set_word(Chunk16& c, int i, uint32_t x) { reinterpret_cast<uint32_t*>(c.w)[i] = x; }
// Two floats rounded to bf16 as one word, the first in the low half.
__device__ __forceinline__ uint32_t bf16_word(float lo, float hi) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
         static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16;
}

// One chunk's loads in flight per thread at a time, four blocks of 256 threads per SM: measured
// against two and three loads at two and three blocks, and against loading the next chunk before
// computing the current one (docs/performance.md, "FP8"), on H200 at [16384, 8192].
template <bool kE4M3, bool kBwd, bool kOut, bool kOutT>
__global__ void __launch_bounds__(kThreads, 4) swiglu_quantize_kernel(SwigluQuantArgs a) {
  constexpr int kChunksPerRow = kTile / kChunk;           // 8
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;  // 32
  constexpr int kIters = kTile / kRowsPerPass;            // 4 chunks per thread and tile
  constexpr int kHalves = kBwd ? 2 : 1;                   // output tiles per input tile
  __shared__ uint32_t red[32];
  __shared__ __align__(16) uint32_t tile[kOutT ? kHalves : 1][kOutT ? kTile : 1][kTile / 4];

  const Scaling s = given_scaling(a.scale_in, a.scale_inv);
  uint32_t seen = 0;
  const int64_t F = a.F, C = kBwd ? 2 * F : F;
  const int64_t tiles_c = (F + kTile - 1) / kTile, tiles = (a.R + kTile - 1) / kTile * tiles_c;
  const int cc = threadIdx.x % kChunksPerRow, row0 = threadIdx.x / kChunksPerRow;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int cg = (warp % 4) * 8 + lane % 8, rg = (warp / 4) * 4 + lane / 8;

  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = t / tiles_c * kTile, c0 = t % tiles_c * kTile;
    const int rows = a.R - r0 < kTile ? static_cast<int>(a.R - r0) : kTile;
    const int cols = F - c0 < kTile ? static_cast<int>(F - c0) : kTile;
    const bool col_ok = cc * kChunk < cols;
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const int row = row0 + j * kRowsPerPass;
      if (!col_ok || row >= rows) continue;
      const bf16* p = a.gate_up + (r0 + row) * 2 * F + c0 + cc * kChunk;
      const Chunk16 g = load_chunk_cs(p), u = load_chunk_cs(p + F);
      Chunk16 d;
      if constexpr (kBwd) d = load_chunk_cs(a.dout + (r0 + row) * F + c0 + cc * kChunk);
      Chunk16 y[kHalves];
#pragma unroll
      for (int i = 0; i < kChunk / 2; ++i) {
        const float2 x = bf16_pair(chunk_word(g, i)), v = bf16_pair(chunk_word(u, i));
        if constexpr (kBwd) {
          const float2 dd = bf16_pair(chunk_word(d, i));
          float g0, u0, g1, u1;
          swiglu_grad_f(x.x, v.x, dd.x, g0, u0);
          swiglu_grad_f(x.y, v.y, dd.y, g1, u1);
          chunk_set_word(y[0], i, bf16_word(g0, g1));
          chunk_set_word(y[kHalves - 1], i, bf16_word(u0, u1));
        } else {
          chunk_set_word(y[0], i, bf16_word(swiglu_f(x.x, v.x), swiglu_f(x.y, v.y)));
        }
      }
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        uint4 q = quantize_chunk<bf16, kE4M3>(y[h].w, s.scale, true);
        const uint32_t m = chunk_abs_bits<bf16>(y[h].w);
        seen = max(seen, m);
        if (m >= 0x7f800000u) q = poison_nonfinite<bf16>(q, raw_chunk<bf16>(y[h].w));
        if constexpr (kOut) *reinterpret_cast<uint4*>(a.out + (r0 + row) * C + h * F + c0 + cc * kChunk) = q;
        if constexpr (kOutT) *reinterpret_cast<uint4*>(&tile[h][row][(cc * 4) ^ swz(row)]) = q;
      }
    }
    if constexpr (kOutT) {
      __syncthreads();
      if (rg * 16 < rows && cg * 4 < cols) {
#pragma unroll
        for (int h = 0; h < kHalves; ++h) {
          uint32_t col[4][4];
          tile_patch_columns(tile[h], rg, cg, col);
#pragma unroll
          for (int j = 0; j < 4; ++j)
            *reinterpret_cast<uint4*>(a.out_t + (h * F + c0 + cg * 4 + j) * a.R + r0 + rg * 16) =
                make_uint4(col[0][j], col[1][j], col[2][j], col[3][j]);
        }
      }
      __syncthreads();
    }
  }
  if (a.amax_out) {
    seen = block_max_u32(seen, red);
    if (threadIdx.x == 0) atomicMax(a.amax_out, seen);
  }
}

template <bool kE4M3, bool kBwd>
void launch_swiglu_quantize(const SwigluQuantArgs& a, cudaStream_t stream) {
  const int64_t tiles = (a.R + kTile - 1) / kTile * ((a.F + kTile - 1) / kTile);
  if (a.out && a.out_t) launch_quantize<swiglu_quantize_kernel<kE4M3, kBwd, true, true>>(tiles, a, stream);
  else if (a.out) launch_quantize<swiglu_quantize_kernel<kE4M3, kBwd, true, false>>(tiles, a, stream);
  else launch_quantize<swiglu_quantize_kernel<kE4M3, kBwd, false, true>>(tiles, a, stream);
}

}  // namespace

void fp8_delayed_update(float* history, float* scale, const float* fp8_max, int64_t T, int64_t len, bool use_max,
                        int margin, cudaStream_t stream) {
  if (T <= 0) return;
  if (len < 1 || len > kMaxDelayedHistory)
    throw RuntimeError(fmt::format("fp8_delayed_update: history length {} (1..{})", len, kMaxDelayedHistory));
  const size_t smem = sizeof(float) * static_cast<size_t>(len);
  delayed_update_kernel<<<static_cast<unsigned>(T), kUpdateThreads, smem, stream>>>(history, scale, fp8_max, len,
                                                                                      use_max, std::ldexp(1.0f, -margin));
  CUDA_CHECK_LAST();
}

size_t quantize_fp8_scratch_bytes() { return kMaxPartials * sizeof(uint32_t); }

void quantize_fp8_tensorwise(DType in_dtype, DType fp8, const void* inp, int64_t R, int64_t C, int64_t ld,
                             void* out, void* out_t, float* scale_inv, void* scratch, cudaStream_t stream,
                             const float* scale_in, float* amax_out, const float* amax_in,
                             const int32_t* rows_in_use) {
  const char* op = "quantize_fp8_tensorwise";
  if (rows_in_use && amax_in)
    throw RuntimeError(fmt::format("{}: rows_in_use limits the amax pass, which given maxima skip", op));
  if (!dtype_is_fp8(fp8))
    throw RuntimeError(fmt::format("{}: output dtype {} is not an FP8 format (f8e4m3, f8e5m2)", op, dtype_name(fp8)));
  if (!out && !out_t) throw RuntimeError(fmt::format("{}: neither out nor out_t given", op));
  if (R < 0 || C < 0 || (R > 1 && ld < C))
    throw RuntimeError(fmt::format("{}: bad shape [{}, {}] with row pitch {}", op, R, C, ld));
  if (!scale_inv || (!scratch && !scale_in && !amax_in))
    throw RuntimeError(fmt::format("{}: scale_inv and scratch are required", op));
  const float fp8max = fp8_max_of(fp8);
  auto* o = static_cast<uint8_t*>(out);
  auto* ot = static_cast<uint8_t*>(out_t);
  auto* partials = static_cast<uint32_t*>(scratch);
  PRIMUS_DISPATCH_FLOAT_BF16(in_dtype, op, [&] {
    const auto* x = static_cast<const scalar_t*>(inp);
    auto* am = reinterpret_cast<uint32_t*>(amax_out);  // non-negative floats order as their bits
    const auto* given = reinterpret_cast<const uint32_t*>(amax_in);
    if (fp8 == DType::F8E4M3)
      run<scalar_t, true>(x, R, C, ld, o, ot, fp8max, scale_inv, partials, scale_in, am, stream, given, rows_in_use);
    else
      run<scalar_t, false>(x, R, C, ld, o, ot, fp8max, scale_inv, partials, scale_in, am, stream, given, rows_in_use);
  });
}

size_t quantize_fp8_grouped_scratch_bytes(int64_t R, int64_t C, Fp8Granularity g) {
  return g == Fp8Granularity::Row ? sizeof(uint32_t) * static_cast<size_t>(R + C) : 16;
}

// The row-groups launches for a, with 16-byte loads where its shape and pointers allow.
void dispatch_row_groups(DType in_dtype, DType fp8, const RowGroupArgs& a, bool amax_known, cudaStream_t stream,
                         const char* op) {
  const int64_t es = static_cast<int64_t>(dtype_size(in_dtype));
  const bool vec = a.R % 16 == 0 && a.C % 16 == 0 && (a.ld * es) % 16 == 0 && aligned16(a.inp) && aligned16(a.out_t) &&
                   (!a.out || aligned16(a.out)) && aligned16(a.col_amax);
  const bool e4m3 = fp8 == DType::F8E4M3, out = a.out != nullptr;
  PRIMUS_DISPATCH_FLOAT_BF16(in_dtype, op, [&] {
    if (vec && out) run_row_groups<scalar_t, true, true>(a, e4m3, stream, amax_known);
    else if (vec) run_row_groups<scalar_t, true, false>(a, e4m3, stream, amax_known);
    else if (out) run_row_groups<scalar_t, false, true>(a, e4m3, stream, amax_known);
    else run_row_groups<scalar_t, false, false>(a, e4m3, stream, amax_known);
  });
}

void quantize_fp8_grouped(DType in_dtype, DType fp8, const void* inp, int64_t R, int64_t C, int64_t ld,
                          Fp8Granularity g, void* out, float* scale_inv, void* out_t, float* scale_inv_t, void* scratch,
                          cudaStream_t stream, const float* maxima) {
  const size_t es = dtype_size(in_dtype);
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (g == Fp8Granularity::Row && !out_t && out && C % 16 == 0 && (ld * es) % 16 == 0 && aligned(inp) && aligned(out)) {
    if (R == 0) return;
    PRIMUS_DISPATCH_FLOAT_BF16(in_dtype, "quantize_fp8_grouped", [&] {
      const auto* x = static_cast<const scalar_t*>(inp);
      auto* o = static_cast<uint8_t*>(out);
      if (fp8 == DType::F8E4M3) run_rows<scalar_t, true>(x, R, C, ld, o, scale_inv, fp8_max_of(fp8), stream);
      else run_rows<scalar_t, false>(x, R, C, ld, o, scale_inv, fp8_max_of(fp8), stream);
    });
    return;
  }
  if (R % 16 != 0 || C % 16 != 0 || (ld * es) % 16 != 0 || !aligned(inp) || (out && !aligned(out)) ||
      (out_t && !aligned(out_t)))
    throw RuntimeError(fmt::format("quantize_fp8_grouped: [{}, {}] (row pitch {}): {} scaling on the GPU needs both "
                                   "dimensions multiples of 16 and 16-byte aligned rows and outputs",
                                   R, C, ld, fp8_granularity_name(g)));
  if (g == Fp8Granularity::Row) {
    // With the column-scaled copy: one group of R rows of the row-groups kernels, whose quantizing
    // launch (the tile kernel's layout with a scale per column: 16-byte loads of whole rows, the
    // transpose through shared memory, a persistent grid) ran 1.17-1.25x the rate of a 16 x 4
    // patch a thread with no shared transpose (the groups kernel's layout) on the Llama shapes
    // (docs/performance.md, "FP8").
    // Scratch: the column maxima [C], then the row maxima [R] (with out); launch 2 turns them into
    // scales in place, so given maxima ([R] rows, then [C] columns) are copied in first.
    if (!out_t) throw RuntimeError("quantize_fp8_grouped: row scaling with neither out nor out_t");
    if (!scratch)
      throw RuntimeError(fmt::format("quantize_fp8_grouped: [{}, {}] row scaling with out_t needs its scratch "
                                     "(quantize_fp8_grouped_scratch_bytes)",
                                     R, C));
    if (R == 0 || C == 0) return;
    RowGroupArgs rg{inp, R, C, ld, nullptr, R, 1, static_cast<uint8_t*>(out), scale_inv,
                    static_cast<uint8_t*>(out_t), scale_inv_t, static_cast<uint32_t*>(scratch), nullptr,
                    fp8_max_of(fp8)};
    if (out) rg.row_amax = rg.col_amax + C;
    if (maxima) {
      const auto* m = reinterpret_cast<const uint32_t*>(maxima);
      CUDA_CHECK(cudaMemcpyAsync(rg.col_amax, m + R, sizeof(uint32_t) * static_cast<size_t>(C),
                                 cudaMemcpyDeviceToDevice, stream));
      if (out)
        CUDA_CHECK(cudaMemcpyAsync(rg.row_amax, m, sizeof(uint32_t) * static_cast<size_t>(R),
                                   cudaMemcpyDeviceToDevice, stream));
    } else {
      CUDA_CHECK(cudaMemsetAsync(scratch, 0, sizeof(uint32_t) * static_cast<size_t>(C + (out ? R : 0)), stream));
    }
    dispatch_row_groups(in_dtype, fp8, rg, maxima != nullptr, stream, "quantize_fp8_grouped");
    return;
  }
  GroupArgs a{inp, R, C, ld, static_cast<uint8_t*>(out), scale_inv, static_cast<uint8_t*>(out_t), scale_inv_t,
              fp8_max_of(fp8)};
  PRIMUS_DISPATCH_FLOAT_BF16(in_dtype, "quantize_fp8_grouped", [&] {
    if (fp8 == DType::F8E4M3) run_groups<scalar_t, true>(a, g, stream);
    else run_groups<scalar_t, false>(a, g, stream);
  });
}

size_t quantize_fp8_row_groups_scratch_bytes(int64_t R, int64_t C, int64_t G, bool with_out) {
  return sizeof(uint32_t) * static_cast<size_t>(std::max<int64_t>(4, G * C + (with_out ? R : 0)));
}

void quantize_fp8_row_groups(DType in_dtype, DType fp8, const void* inp, int64_t R, int64_t C, int64_t ld,
                             const int32_t* offsets, int64_t group_rows, int64_t G, void* out, float* scale_inv,
                             void* out_t, float* scale_inv_t, void* scratch, cudaStream_t stream) {
  const char* op = "quantize_fp8_row_groups";
  if (!dtype_is_fp8(fp8))
    throw RuntimeError(fmt::format("{}: output dtype {} is not an FP8 format (f8e4m3, f8e5m2)", op, dtype_name(fp8)));
  if (!out_t || !scale_inv_t || !scratch || (out && !scale_inv))
    throw RuntimeError(fmt::format("{}: out_t, scale_inv_t, scratch (and scale_inv with out) are required", op));
  if (R < 0 || C < 0 || (R > 1 && ld < C) || R > INT32_MAX || G < 0 || G > INT32_MAX - 1024)
    throw RuntimeError(fmt::format("{}: bad shape [{}, {}] with row pitch {} in {} groups", op, R, C, ld, G));
  if (offsets ? group_rows != 0 : group_rows <= 0 || G * group_rows != R)
    throw RuntimeError(fmt::format("{}: {} groups: expected device offsets or group_rows * G = R, got group_rows {} "
                                   "for {} rows{}",
                                   op, G, group_rows, R, offsets ? " with offsets" : ""));
  RowGroupArgs a{inp, R, C, ld, offsets, group_rows, static_cast<int>(G), static_cast<uint8_t*>(out), scale_inv,
                 static_cast<uint8_t*>(out_t), scale_inv_t, static_cast<uint32_t*>(scratch), nullptr,
                 fp8_max_of(fp8)};
  if (out) a.row_amax = a.col_amax + G * C;
  const int64_t entries = G * C + (out ? R : 0);
  if (entries > 0) CUDA_CHECK(cudaMemsetAsync(scratch, 0, sizeof(uint32_t) * static_cast<size_t>(entries), stream));
  dispatch_row_groups(in_dtype, fp8, a, false, stream, op);
}

std::string quantize_fp8_swiglu_unsupported_reason(DType in_dtype, DType fp8, const void* gate_up, const void* dout,
                                                   int64_t R, int64_t F, const void* out, const void* out_t) noexcept {
  const auto aligned = [](const void* p) { return p == nullptr || (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  if (in_dtype != DType::BF16) return fmt::format("{} input (the folded SwiGLU reads bf16)", dtype_name(in_dtype));
  if (!dtype_is_fp8(fp8)) return fmt::format("output dtype {} is not an FP8 format", dtype_name(fp8));
  if (R < 0 || F <= 0 || F % kChunk != 0) return fmt::format("F = {} is not a positive multiple of {}", F, kChunk);
  if (out_t && R % 16 != 0) return fmt::format("R = {} is not a multiple of 16 (the transposed copy's 16-row stores)", R);
  if (!aligned(gate_up) || !aligned(dout) || !aligned(out) || !aligned(out_t)) return "a base is not 16-byte aligned";
  if (!out && !out_t) return "neither out nor out_t given";
  return "";
}

void quantize_fp8_swiglu(bool backward, DType in_dtype, DType fp8, const void* gate_up, const void* dout, int64_t R,
                         int64_t F, void* out, void* out_t, const float* scale_in, float* scale_inv, float* amax_out,
                         cudaStream_t stream) {
  if (auto w = quantize_fp8_swiglu_unsupported_reason(in_dtype, fp8, gate_up, backward ? dout : nullptr, R, F, out, out_t);
      !w.empty())
    throw RuntimeError("quantize_fp8_swiglu: " + w);
  if (!scale_in || !scale_inv) throw RuntimeError("quantize_fp8_swiglu: the delayed scale and scale_inv are required");
  if (backward && !dout) throw RuntimeError("quantize_fp8_swiglu: the backward needs dout");
  const SwigluQuantArgs a{static_cast<const bf16*>(gate_up), static_cast<const bf16*>(dout), R, F,
                          static_cast<uint8_t*>(out), static_cast<uint8_t*>(out_t), scale_in, scale_inv,
                          reinterpret_cast<uint32_t*>(amax_out)};
  const bool e4m3 = fp8 == DType::F8E4M3;
  if (backward) {
    if (e4m3) launch_swiglu_quantize<true, true>(a, stream);
    else launch_swiglu_quantize<false, true>(a, stream);
  } else {
    if (e4m3) launch_swiglu_quantize<true, false>(a, stream);
    else launch_swiglu_quantize<false, false>(a, stream);
  }
}

}  // namespace primus::turbo::cuda
