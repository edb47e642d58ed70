// Hopper building blocks of the wgmma attention kernels (attention_fwd_sm90.cu,
// attention_bwd_sm90.cu): 128-byte-swizzled shared-memory tiles in the layout wgmma reads,
// matrix descriptors, the wgmma fence / commit / wait instructions and the proxy fence.
//
// Layout: a ROWS x COLS tile of 16-bit elements is stored as COLS/64 slabs of [ROWS][64]; each
// slab row is 128 bytes and 16-byte chunk c of row r sits at chunk c ^ (r % 8) (the hardware's
// 128-byte swizzle, which XORs address bits 4-6 with bits 7-9, so slabs start 1024-byte aligned).
// Descriptors (PTX ISA, "matrix descriptor"): K-major operands use SBO = 1024 (8 rows of 128 B)
// and step along K by 32 bytes per 16 elements inside a slab; MN-major operands use LBO = the
// slab size (next 64 elements along M/N) and SBO = 1024 (next 8 rows along K), stepping along K
// by 2048 bytes per 16 rows.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "turbo/kernels/cuda/attention_mma.cuh"

namespace primus::turbo::cuda::attn {

template <int ROWS>
struct Sw128 {
  static constexpr uint32_t kSlab = ROWS * 128;  // bytes of one [ROWS][64] column slab
  static __device__ __forceinline__ uint32_t offset(int row, int col) {
    return static_cast<uint32_t>((col >> 6) * kSlab + row * 128 + ((((col & 63) >> 3) ^ (row & 7)) << 4) + (col & 7) * 2);
  }
};

template <int ROWS, int D, int NT, class T>
__device__ __forceinline__ void load_tile_sw128(uint32_t dst, const T* head_base, int64_t row_stride, int r0, int T_len) {
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
    cp_async16(dst + Sw128<ROWS>::offset(r, c * 8), src, ok);
  }
}

// Matrix descriptor, 128-byte swizzle (mode 1 in bits 62-63); addresses and offsets in bytes.
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (uint64_t{1} << 62);
}

// The descriptor of the operand `bytes` further on in shared memory: the start address is the low
// 14 bits (in 16-byte units) and shared-memory offsets never carry out of them, so one add on a base
// descriptor replaces rebuilding it for every k-step.
__device__ __forceinline__ uint64_t desc_plus(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Pins accumulator registers around asynchronous wgmma (no moves across the issue/wait pair).
template <int N>
__device__ __forceinline__ void fence_regs(float* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(uint32_t* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
// Persistent blocks' share of works 0 .. count - 1: one of each round of gridDim.x works, number
// blockIdx.x of even rounds and gridDim.x - 1 - blockIdx.x of odd ones (a snake: with a fixed
// position the first blocks would take the heaviest work of every round of a heaviest-first
// order). This block's work of round k; >= count once the block is done. With a block per work
// it is one round.
__device__ __forceinline__ int snake_work(int k) {
  const int g = static_cast<int>(gridDim.x), i = static_cast<int>(blockIdx.x);
  return k * g + ((k & 1) ? g - 1 - i : i);
}
// Named barrier `id` (1-15; 0 is __syncthreads) over `count` threads (a multiple of 32).
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// Arrives at named barrier `id` without waiting (the other `count` - 32 * warps threads sync on it).
__device__ __forceinline__ void named_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// Shared memory written by the generic proxy (cp.async) and next read by wgmma (async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- mbarriers and the tensor memory accelerator (TMA) ----------------------------------------
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes barrier initialisation visible to the other threads and to the async proxy (TMA).
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// A TMA ring's barriers at `bars` (8 bytes each): one load barrier (count 1), then `stages` "full"
// barriers (count 1: the producer's expect_tx arrival) and `stages` "empty" barriers (one arrival
// per consumer warp). Thread 0 of the block calls it before the block's first barrier.
__device__ __forceinline__ void mbar_init_ring(uint32_t bars, int stages, int consumer_warps) {
  mbar_init(bars, 1);
  for (int st = 0; st < stages; ++st) {
    mbar_init(bars + 8u * (1 + st), 1);
    mbar_init(bars + 8u * (1 + stages + st), consumer_warps);
  }
  mbar_fence_init();
}
// Arrives and announces `bytes` of TMA traffic that will complete this phase.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Spins until the phase with the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred P1;\nLAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// One 3-D box of a tensor map into shared memory, completing on `bar`; c0 is the innermost
// coordinate (elements).
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* tmap, uint32_t bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
// One box of an attention_map (tma_encode.h): head_dim offset d, head h, token t of batch row b.
__device__ __forceinline__ void tma_load_bthd(uint32_t dst, const void* tmap, uint32_t bar, int d, int h, int t, int b) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(d), "r"(h), "r"(t), "r"(b), "r"(bar)
      : "memory");
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }

// Bulk async-groups of this thread's TMA stores / reduces (cp.async.bulk ... .bulk_group): close
// the current group; wait until at most N groups still read their shared memory (the source may be
// written again) / are incomplete (their writes are done).
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
}  // namespace primus::turbo::cuda::attn
