// Device building blocks of the flash-attention kernels (attention_fwd.cu, attention_bwd.cu):
// asynchronous global->shared copies, swizzled shared-memory tiles, ldmatrix fragment loads,
// the m16n8k16 tensor-core MMA for bf16 and f16, and the document lookup of packed sequences.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .row.col): lane l = 4*g + t (g = l/4, t = l%4)
//   A 16x16: a0 = (row g,   k 2t..2t+1)  a1 = (row g+8, k 2t..)  a2 = (row g, k 2t+8..)  a3 = (row g+8, k 2t+8..)
//   B 16x8:  b0 = (k 2t..2t+1, col g)    b1 = (k 2t+8.., col g)
//   C 16x8:  c0,c1 = (row g, cols 2t, 2t+1)   c2,c3 = (row g+8, cols 2t, 2t+1)
// Two C tiles side by side (cols 0-7 and 8-15) are, element for element, one A fragment of
// k = 16: that is how probabilities go from the score MMA into the next MMA without shared memory.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace primus::turbo::cuda::attn {

// ---- element types ----------------------------------------------------------------------------
template <class T> struct Mma;
template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ void mma(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  static __device__ __forceinline__ float2 unpack(uint32_t x) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&x));
  }
};
template <> struct Mma<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ void mma(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  static __device__ __forceinline__ float2 unpack(uint32_t x) {
    return __half22float2(*reinterpret_cast<__half2*>(&x));
  }
};

// ---- async copies ------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared; when !valid the destination is zero-filled and nothing is read.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ---- swizzled tiles ------------------------------------------------------------------------------
// A tile of ROWS x COLS 16-bit elements in shared memory, rows of COLS*2 bytes, cut into 16-byte
// chunks; chunk c of row r lives at chunk position c ^ (r % 8). Eight consecutive rows reading the
// same logical chunk (one ldmatrix 8x8 matrix) then hit eight different bank groups.
template <int COLS>
struct Swizzle {
  static constexpr int kChunks = COLS / 8;
  static_assert(kChunks >= 8 && kChunks % 8 == 0, "tile rows must be a multiple of 64 elements");
  // Byte offset of element (row, col) (col a multiple of 8 for whole chunks, or any col inside).
  static __device__ __forceinline__ uint32_t offset(int row, int col) {
    const int chunk = (col >> 3) ^ (row & 7);
    return static_cast<uint32_t>(row * COLS * 2 + chunk * 16 + (col & 7) * 2);
  }
};

// Copies rows [r0, r0 + ROWS) of one head of a [B, T, heads, D] tensor (row stride heads*D) into
// a swizzled ROWS x D tile at `dst`; rows outside [0, T) are zero-filled. All NT threads take part.
template <int ROWS, int D, int NT, class T>
__device__ __forceinline__ void load_tile(uint32_t dst, const T* head_base, int64_t row_stride, int r0, int T_len) {
  constexpr int kChunks = D / 8;
  constexpr int kTotal = ROWS * kChunks;
  static_assert(kTotal % NT == 0, "tile chunks must divide among the threads");
#pragma unroll
  for (int i = 0; i < kTotal / NT; ++i) {
    const int idx = i * NT + static_cast<int>(threadIdx.x);
    const int r = idx / kChunks, c = idx % kChunks;
    const int row = r0 + r;
    const bool ok = row >= 0 && row < T_len;
    const T* src = head_base + (ok ? static_cast<int64_t>(row) * row_stride : 0) + c * 8;
    cp_async16(dst + Swizzle<D>::offset(r, c * 8), src, ok);
  }
}

// ---- ldmatrix ----------------------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// The A fragment (16 rows x 16 k) at (row0, k0) of a row-major tile whose rows are the MMA's M
// dimension and columns its K dimension.
template <int COLS>
__device__ __forceinline__ void load_a(uint32_t* a, uint32_t tile, int row0, int k0) {
  const int l = threadIdx.x & 31;
  const int row = row0 + (l & 7) + ((l >> 3) & 1) * 8;
  const int col = k0 + (l >> 4) * 8;
  ldmatrix_x4(a, tile + Swizzle<COLS>::offset(row, col));
}
// The A fragment (16 rows x 16 k) at (m0, k0) of a tile stored transposed: its rows are the K
// dimension and its columns the M dimension.
template <int COLS>
__device__ __forceinline__ void load_a_trans(uint32_t* a, uint32_t tile, int m0, int k0) {
  const int l = threadIdx.x & 31;
  const int row = k0 + (l & 7) + (l >> 4) * 8;
  const int col = m0 + ((l >> 3) & 1) * 8;
  ldmatrix_x4_trans(a, tile + Swizzle<COLS>::offset(row, col));
}
// B fragments of two adjacent n-tiles (n0..n0+7 -> b[0..1], n0+8..n0+15 -> b[2..3]) for k0..k0+15,
// from a tile whose rows are the N dimension and columns the K dimension (e.g. K for Q K^T).
template <int COLS>
__device__ __forceinline__ void load_b_nk(uint32_t* b, uint32_t tile, int n0, int k0) {
  const int l = threadIdx.x & 31;
  const int row = n0 + (l & 7) + (l >> 4) * 8;
  const int col = k0 + ((l >> 3) & 1) * 8;
  ldmatrix_x4(b, tile + Swizzle<COLS>::offset(row, col));
}
// The same two B fragments from a tile whose rows are the K dimension and columns the N
// dimension (e.g. V for P V).
template <int COLS>
__device__ __forceinline__ void load_b_kn(uint32_t* b, uint32_t tile, int n0, int k0) {
  const int l = threadIdx.x & 31;
  const int row = k0 + (l & 7) + ((l >> 3) & 1) * 8;
  const int col = n0 + (l >> 4) * 8;
  ldmatrix_x4_trans(b, tile + Swizzle<COLS>::offset(row, col));
}

// ---- packed documents --------------------------------------------------------------------------
// The document of token t of batch row b, as [start, end) within the row. Without cu_seqlens the
// whole row is one document.
struct DocSpan {
  int start, end;
};
__device__ __forceinline__ DocSpan doc_of(const int32_t* cu, int num_docs, int b, int t, int T_len) {
  if (!cu) return {0, T_len};
  const int x = b * T_len + t;
  int lo = 0, hi = num_docs;  // find the last d with cu[d] <= x (skips empty documents)
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (__ldg(cu + mid) <= x) lo = mid; else hi = mid;
  }
  return {__ldg(cu + lo) - b * T_len, __ldg(cu + lo + 1) - b * T_len};
}

// 2^x on the special-function unit alone (ex2.approx.ftz: one MUFU.EX2). exp2f without fast math
// compiles to a compare, two multiplies and the MUFU (to return denormal results), which at head_dim
// 64 made the forward's FMULs 2.5x its exps (ncu, H200). Results below 2^-126 flush to
// zero: a probability that small adds nothing to a bf16 / f16 output. -inf gives +0, NaN stays NaN.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

}  // namespace primus::turbo::cuda::attn
