// Turbo's Hopper GEMM (sm_90a): D = alpha * A @ B + beta * D (+ bias) on warpgroup MMA (wgmma)
// fed by the tensor memory accelerator (TMA). Contract in gemm_sm90.h; the device pieces this
// kernel shares with the grouped GEMM (pipeline, k-loop, epilogues) are in gemm_sm90_device.cuh.
//
// Block: 384 threads = 3 warpgroups, one block per SM (about 190 KiB of shared memory).
//   Warpgroup 0 produces: it gives most of its registers away (setmaxnreg) and one thread issues
//   the TMA copies of each k-tile (A: 128 x 64, B: bn x 64 elements) into a ring of shared-memory
//   stages in the 128-byte-swizzled layout wgmma reads (attention_sm90_common.cuh). Each stage has
//   a "full" mbarrier (the TMA bytes have landed) and an "empty" one (every consumer warp is done
//   reading it), so loads run up to `stages` k-tiles ahead, across tile boundaries too.
//   Warpgroups 1 and 2 consume: each owns 64 rows of the 128 x bn tile and accumulates them in
//   registers (bn/2 floats per thread) with wgmma m64 x bn x k16, four per k-tile, keeping one
//   k-tile's group in flight while it waits for the next stage. Its rows of D are written straight
//   from the registers: alpha, beta * D (read only when beta != 0), bias, the dtype conversion, and
//   masking at the matrix edges (TMA reads zeros outside A and B, so edge tiles need no care in
//   the main loop). With a 16-bit D, beta = 0 and 16-byte aligned rows, tiles wholly inside N are
//   stored 16 bytes per lane (8 columns): the epilogues (linear, bias, GELU aux, dGELU; both
//   schedules) through two 2 KiB shared-memory buffers per warp (stmatrix, which takes the
//   accumulators in their own layout; dGELU's aux comes in the other way, with ldmatrix;
//   store_rows_staged), each filled buffer written out by one TMA store (16 rows x 64 columns)
//   that the warp does not wait for, so D's writes drain under the next tile's main loop (or, with
//   PRIMUS_TURBO_GEMM_TMA_STORE=0, by the warp's own 128-byte row stores), the rest after a
//   transpose across each quad of lanes (shuffles). The staged form issues about half the
//   epilogue's instructions: products 2-11% faster on an H200.
// Schedules (splits == 1; gemm_sm90.h): the above is "coop". "pingpong": each consumer warpgroup
//   owns a whole 128 x 128 tile (two m64n128 wgmmas per k16 step, 128 accumulators per thread),
//   the block's tiles alternate between the two warpgroups, their k-loops strictly in tile order
//   (named barriers 2 and 3), so one warpgroup's epilogue runs under the other's MMAs; each stage
//   (6 of 32 KiB) feeds one warpgroup (4 empty arrivals). Its 16-bit epilogues are staged too.
// Layouts: a K-major operand is one TMA box of [rows][64] (one swizzled slab); an M/N-major one is
// [64 k-rows][64] boxes side by side, one per 64 columns, read by wgmma through its transpose bit.
// Grid: splits == 1: persistent, one block per SM walking tiles in groups of 8 tile-rows (L2
// reuse of B). splits = s > 1 (shapes with too few tiles to fill the GPU, e.g. weight gradients):
// a cluster of s blocks per tile, block r summing k-tiles [r*kt/s, (r+1)*kt/s); each block puts its
// fp32 partial tile in its shared memory and block r then adds everyone's share r of the columns,
// in rank order, through distributed shared memory: deterministic, no workspace, no atomics.
// Stream-K (its own instantiations, SK; gemm_sm90_streamk.h): persistent, every block the same
// share of the k-iterations; a tile shared by several blocks is summed by its first block from
// the others' fp32 partials in a global workspace, in block order (deterministic).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <string>
#include <atomic>
#include <climits>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

#include "core/util/error.h"
#include "turbo/core/cuda_check.h"
#include "turbo/core/env_switch.h"
#include "turbo/kernels/cuda/attention_sm90_common.cuh"
#include "turbo/kernels/cuda/gemm_sm90.h"
#include "turbo/kernels/cuda/gemm_sm90_device.cuh"
#include "turbo/kernels/cuda/gemm_sm90_streamk.h"
#include "turbo/kernels/cuda/gemm_sm90_wgmma.cuh"
#include "turbo/kernels/cuda/tma_encode.h"

namespace primus::turbo::cuda {
namespace gemm90 {
namespace {

// SK: the stream-K plan (cooperative schedule, splits 1; gemm_sm90_streamk.h): the block's
// data-parallel tiles, then its range of the remaining tiles' k-iterations.
template <class T, class OutT, int BN, bool PP, int EPI, bool SK>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_sm90_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b, const Params p,
                     const __grid_constant__ StreamKArgs<SK> sk, const __grid_constant__ EpiMaps em) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = Cfg<BN, PP>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
  const uint32_t bars = base + C::kBarOffset;  // full[kStages], then empty[kStages]
  const int S = p.splits;
  const int rank = S > 1 ? static_cast<int>(cluster_rank()) : 0;
  const int first = static_cast<int>(blockIdx.x) / S, stride = static_cast<int>(gridDim.x) / S;
  const int tiles = p.tiles_m * p.tiles_n;
  const int kb0 = rank * p.kblocks / S, kb1 = (rank + 1) * p.kblocks / S;

  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      mbar_init(bars + 8u * s, 1);                  // the producer's arrive.expect_tx
      mbar_init(bars + 8u * (C::kStages + s), C::kEmptyArrivals);  // one arrival per consumer warp reading it
    }
    mbar_fence_init();
  }
  __syncthreads();

  if (threadIdx.x < 128) {  // producer warpgroup
    attn::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      int stage = 0, it = 0;
      uint32_t phase = 0;
      // k-iterations [kbs, kbe) of tile t, in the consumers' order.
      const auto load_tile = [&](int t, int kbs, int kbe) {
        int tm, tn;
        tile_coords(p, t, tm, tn);
        const int m0 = tm * kBM, n0 = tn * BN;
        // MN-major slabs lying wholly past the matrix edge are not loaded (every box TMA is given
        // overlaps the matrix); their stale shared memory only feeds rows / columns of the tile
        // that the epilogue masks. K is never cut this way: past-K elements are TMA's zeros.
        const int a_slabs = p.a_mn ? (m0 + 64 < p.m ? 2 : 1) : 1;
        const int b_slabs = p.b_mn ? min(C::kSlabsB, (p.n - n0 + 63) / 64) : 1;
        const uint32_t tx = (p.a_mn ? a_slabs * kSlabBytes : C::kBytesA) + (p.b_mn ? b_slabs * kSlabBytes : C::kBytesB);
        for (int kb = kbs; kb < kbe; ++kb, ++it) {
          // Use u of a stage needs use u-1 released: the empty barrier's phase u-1 (parity (u-1)&1).
          if (it >= C::kStages) mbar_wait(bars + 8u * (C::kStages + stage), phase ^ 1u);
          const uint32_t full = bars + 8u * stage;
          mbar_expect_tx(full, tx);
          const uint32_t sa = base + stage * C::kStageBytes, sb = sa + C::kBytesA;
          const int k0 = kb * kBK;
          if (p.a_mn) {
            tma_load_2d(sa, &tmap_a, full, m0, k0);
            if (a_slabs == 2) tma_load_2d(sa + kSlabBytes, &tmap_a, full, m0 + 64, k0);
          } else {
            tma_load_2d(sa, &tmap_a, full, k0, m0);
          }
          if (p.b_mn) {
            for (int j = 0; j < b_slabs; ++j) tma_load_2d(sb + j * kSlabBytes, &tmap_b, full, n0 + 64 * j, k0);
          } else {
            tma_load_2d(sb, &tmap_b, full, k0, n0);
          }
          if (++stage == C::kStages) {
            stage = 0;
            phase ^= 1u;
          }
        }
      };
      if constexpr (SK) {
        const int b = static_cast<int>(blockIdx.x);
        for (int t = b; t < sk.split.tiles_dp; t += sk.split.grid) load_tile(t, 0, p.kblocks);
        for (int64_t u = sk.split.begin(b), u1 = sk.split.end(b); u < u1;) {
          const streamk::Segment g = streamk::segment_at(sk.split, b, u);
          load_tile(g.tile, g.kb_begin, g.kb_end);
          u += g.kb_end - g.kb_begin;
        }
      } else {
        for (int t = first; t < tiles; t += stride) load_tile(t, kb0, kb1);
      }
    }
    // Split-k: the consumers' two cluster barriers need every thread of the cluster. (Each role
    // ends inside its own branch: no code after setmaxnreg is shared between the two budgets.)
    if (S > 1) {
      cluster_sync();
      cluster_sync();
    }
  } else {  // two consumer warpgroups
    attn::setmaxnreg_inc<kConsumerRegs>();
    const int ctid = static_cast<int>(threadIdx.x) - 128;  // 0..255
    const int wg = ctid / 128, warp = (ctid % 128) / 32, lane = ctid % 32;
    int epi_nb = 0;  // the staged epilogue's passes so far (store_rows_staged)
    // The warp's TMA stores (staged epilogue) have finished reading shared memory and writing.
    const auto drain_stores = [&] {
      if (p.staged == 2 && lane == 0) bulk_wait<0>();
    };
    if constexpr (PP) {
      // Ping-pong (splits == 1 only): the block's i-th tile (the producer's order) belongs to
      // warpgroup i % 2, whose 128 x 128 accumulator takes the producer's k-iterations
      // [i * kb, (i + 1) * kb); their stages and phases follow from that count. While one
      // warpgroup writes a tile out the other multiplies the next one, and the producer keeps
      // loading ahead for both, so the epilogue no longer leaves the tensor cores idle.
      // The k-loops run strictly in tile order (named barriers, as CUTLASS's ordered sequence
      // barrier): besides keeping the tensor cores to one warpgroup at a time, this is what makes
      // the parity waits sound. A warpgroup starting tile i could otherwise reach a stage whose
      // previous fill (the other warpgroup's tile i-1) has not landed yet, two phases behind, and
      // a parity wait cannot tell that from "done". Tile i waits for tile i-1's k-loop to end;
      // a warpgroup passes the turn only when the block has a next tile, so waits and passes
      // pair up exactly.
      const uint64_t da = make_desc(base, p.a_mn ? kSlabBytes : 16, 1024);
      const uint64_t db = make_desc(base + C::kBytesA, p.b_mn ? kSlabBytes : 16, 1024);
      const int kb_count = kb1 - kb0;
      float acc[C::kAcc];
      int i = wg;
      for (int t = first + wg * stride; t < tiles; t += 2 * stride, i += 2) {
        const int64_t it0 = static_cast<int64_t>(i) * kb_count;
        int stage = static_cast<int>(it0 % C::kStages);
        uint32_t phase = static_cast<uint32_t>((it0 / C::kStages) & 1);
#pragma unroll
        for (int j = 0; j < C::kAcc; ++j) acc[j] = 0.0f;
        int tm, tn;
        tile_coords(p, t, tm, tn);
        const auto tail = [&] { prefetch_epilogue<OutT, EPI>(p, tm * kBM, tn * BN, tn * BN + BN, ctid % 128, 128); };
        if (i > 0) order_wait(wg);
        switch (p.a_mn * 2 + p.b_mn) {
          case 0: mainloop<T, C, BN, 0, 0>(acc, da, db, bars, kb_count, stage, phase, tail); break;
          case 1: mainloop<T, C, BN, 0, 1>(acc, da, db, bars, kb_count, stage, phase, tail); break;
          case 2: mainloop<T, C, BN, 1, 0>(acc, da, db, bars, kb_count, stage, phase, tail); break;
          default: mainloop<T, C, BN, 1, 1>(acc, da, db, bars, kb_count, stage, phase, tail); break;
        }
        if (t + stride < tiles) order_pass(wg);
        const int col = tn * BN + (lane % 4) * 2;
        const bool vec16 = tile_vec16<OutT, BN, EPI>(p, tn * BN);  // uniform over the tile
        const bool staged = sizeof(OutT) == 2 && p.staged && vec16;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = tm * kBM + h * 64 + warp * 16 + lane / 4;
          if (staged) {  // the warp's own buffer: the other warpgroup's epilogue may run meanwhile
            store_rows_staged<OutT, C::kGroups, EPI, C::kEpiBufs>(
                p, em, tm * kBM + h * 64 + warp * 16, tn * BN, lane, acc + h * (BN / 2),
                base + C::kEpiOffset + (wg * 4 + warp) * 2048 * C::kEpiBufs, epi_nb);
            continue;
          }
          if (vec16) {
            store_rows_vec16<OutT, C::kGroups, EPI, false>(p, row, tn * BN, lane % 4, acc + h * (BN / 2));
            continue;
          }
#pragma unroll
          for (int g = 0; g < C::kGroups; g += 4)
            store_groups<OutT, EPI>(p, row, col + g * 8, 4, acc + h * (BN / 2) + 4 * g);
        }
      }
      drain_stores();
      return;
    }
    // Warpgroup wg reads A rows 64*wg.. of the tile: 8 KiB into the stage in both layouts (64
    // rows of 128 bytes K-major; the second [64 k][64 m] slab M-major). Descriptor offsets (PTX
    // ISA, matrix descriptor; as in the attention kernels): K-major SBO = 1024 (8 rows of 128 B),
    // LBO unused; MN-major LBO = one [64][64] slab (next 64 columns), SBO = 1024 (next 8 k-rows).
    const uint64_t da = make_desc(base + wg * kSlabBytes, p.a_mn ? kSlabBytes : 16, 1024);
    const uint64_t db = make_desc(base + C::kBytesA, p.b_mn ? kSlabBytes : 16, 1024);
    const int kb_count = kb1 - kb0;
    float acc[C::kAcc];  // BN / 2 (this code is dead in the ping-pong instantiation)
    int stage = 0;
    uint32_t phase = 0;
    if constexpr (SK) {
      // The block's data-parallel tiles, then the segments of its stream-K range, in the order the
      // producer loads them. A segment that does not start at the tile's first k-iteration is a
      // partial for the tile's owner (an earlier block): published to this block's workspace
      // slot. The owner's segment (k from 0) ends the block's range when it does not end the tile:
      // it adds the partials of the blocks after it, in block order, then writes the tile.
      // One counter crosses the k-loops (registers are short; the rest is recomputed): w < 0
      // counts the data-parallel tiles left, then w is the offset into the stream-K range (32-bit:
      // the plan keeps stream-K to problems of fewer than 2^31 units).
      constexpr int kSlot = C::kGroups * 256;  // float4 per partial tile
      for (int w = -(sk.split.tiles_dp / sk.split.grid);;) {
        const int b = static_cast<int>(blockIdx.x);
        int t, kbs = 0, kbe = p.kblocks;
        if (w < 0) {
          t = b + (w + sk.split.tiles_dp / sk.split.grid) * sk.split.grid;
          ++w;
        } else {
          const int u = static_cast<int>(sk.split.begin(b)) + w;
          if (u >= static_cast<int>(sk.split.end(b))) break;
          const streamk::Segment g = streamk::segment_at(sk.split, b, u);
          t = g.tile, kbs = g.kb_begin, kbe = g.kb_end;
          w += kbe - kbs;
        }
        int tm, tn;
        tile_coords(p, t, tm, tn);
        const bool owner = kbs == 0;
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
        const auto tail = [&] {
          if (owner) prefetch_epilogue<OutT, EPI>(p, tm * kBM, tn * BN, tn * BN + BN, ctid, 256);
        };
        switch (p.a_mn * 2 + p.b_mn) {
          case 0: mainloop<T, C, BN, 0, 0>(acc, da, db, bars, kbe - kbs, stage, phase, tail); break;
          case 1: mainloop<T, C, BN, 0, 1>(acc, da, db, bars, kbe - kbs, stage, phase, tail); break;
          case 2: mainloop<T, C, BN, 1, 0>(acc, da, db, bars, kbe - kbs, stage, phase, tail); break;
          default: mainloop<T, C, BN, 1, 1>(acc, da, db, bars, kbe - kbs, stage, phase, tail); break;
        }
        if (!owner) {
          float4* slot = sk.tiles + static_cast<int64_t>(b) * kSlot + ctid;
#pragma unroll
          for (int i = 0; i < C::kGroups; ++i)
            __stcg(slot + i * 256, make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]));
          __threadfence();
          consumer_barrier();  // every consumer's part is out before the flag
          if (ctid == 0) st_release_gpu(sk.flags + b, 1u);
          continue;
        }
        if (kbe < p.kblocks) {
          const int last = streamk::last_block_of_tile(sk.split, t);
          for (int c = b + 1; c <= last; ++c) {
            if (ctid == 0) {
              while (ld_acquire_gpu(sk.flags + c) == 0u) __nanosleep(64);
              sk.flags[c] = 0u;  // consumed (the slot itself is not written again in this launch)
            }
            consumer_barrier();
            const float4* slot = sk.tiles + static_cast<int64_t>(c) * kSlot + ctid;
#pragma unroll
            for (int i = 0; i < C::kGroups; ++i) {
              const float4 r = __ldcg(slot + i * 256);
              acc[4 * i] += r.x, acc[4 * i + 1] += r.y, acc[4 * i + 2] += r.z, acc[4 * i + 3] += r.w;
            }
          }
        }
        store_tile<OutT, C, BN, EPI>(p, em, tm, tn, wg, warp, lane, acc, base, epi_nb);
      }
    } else {
      for (int t = first; t < tiles; t += stride) {
        int tm, tn;
        tile_coords(p, t, tm, tn);
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
        // The columns this block writes: the tile's, or with split-k its rank's share of them.
        const int c0 = tn * BN + (S > 1 ? 8 * (rank * C::kGroups / S) : 0);
        const int c1 = tn * BN + (S > 1 ? 8 * ((rank + 1) * C::kGroups / S) : BN);
        const auto tail = [&] { prefetch_epilogue<OutT, EPI>(p, tm * kBM, c0, c1, ctid, 256); };
        switch (p.a_mn * 2 + p.b_mn) {
          case 0: mainloop<T, C, BN, 0, 0>(acc, da, db, bars, kb_count, stage, phase, tail); break;
          case 1: mainloop<T, C, BN, 0, 1>(acc, da, db, bars, kb_count, stage, phase, tail); break;
          case 2: mainloop<T, C, BN, 1, 0>(acc, da, db, bars, kb_count, stage, phase, tail); break;
          default: mainloop<T, C, BN, 1, 1>(acc, da, db, bars, kb_count, stage, phase, tail); break;
        }
        if (S == 1) {
          store_tile<OutT, C, BN, EPI>(p, em, tm, tn, wg, warp, lane, acc, base, epi_nb);
        } else {
          // Split-k (one tile per cluster): the partial tile goes to this block's stage memory, which
          // both warpgroups' wgmmas have finished reading once they pass the barrier.
          consumer_barrier();
          fence_proxy_async();
#pragma unroll
          for (int i = 0; i < C::kGroups; ++i)
            st_shared_f4(base + (i * 256 + ctid) * 16, acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]);
        }
      }
      if (S > 1) {
        cluster_sync();  // every block's partial tile is in its shared memory
        if (first < tiles) {
          int tm, tn;
          tile_coords(p, first, tm, tn);
          const int row = tm * kBM + wg * 64 + warp * 16 + lane / 4;
          const int col = tn * BN + (lane % 4) * 2;
          // Block `rank` finishes column groups [rank*G/S, (rank+1)*G/S), summing the partial tiles
          // of ranks 0..S-1 in that order: a rerun of the same plan is bitwise identical.
          // Four groups at a time, so their distributed-shared-memory reads and epilogue loads overlap.
          const int g1 = (rank + 1) * C::kGroups / S;
          for (int i = rank * C::kGroups / S; i < g1; i += 4) {
            const int n = min(4, g1 - i);
            float v[16];
#pragma unroll
            for (int j = 0; j < 16; ++j) v[j] = 0.0f;
            for (int q = 0; q < S; ++q)
#pragma unroll
              for (int u = 0; u < 4; ++u) {
                if (u >= n) break;
                const float4 r = ld_cluster_f4(base + ((i + u) * 256 + ctid) * 16, static_cast<uint32_t>(q));
                v[4 * u] += r.x, v[4 * u + 1] += r.y, v[4 * u + 2] += r.z, v[4 * u + 3] += r.w;
              }
            store_groups<OutT, EPI>(p, row, col + i * 8, n, v);
          }
        }
        cluster_sync();  // no block leaves while another still reads its shared memory
      }
    }
    drain_stores();
  }
#else
  __trap();  // built without sm_90a: gemm_sm90_unsupported_reason keeps such devices away
#endif
}

// ---- host side ------------------------------------------------------------------------------------
// encode_tiled(): turbo/kernels/cuda/tma_encode.h

// A stored row-major matrix [outer][inner] (leading dimension ld) in boxes of box_inner x
// box_outer elements, 128-byte swizzled; reads outside the matrix return zeros.
CUtensorMap tensor_map(const void* ptr, DType dt, int64_t inner, int64_t outer, int64_t ld, uint32_t box_inner,
                       uint32_t box_outer) {
  CUtensorMap m;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld * 2)};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = encode_tiled()(&m, dt == DType::F16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
                                    const_cast<void*>(ptr), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                    CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  PRIMUS_CHECK(r == CUDA_SUCCESS, "gemm_sm90: cuTensorMapEncodeTiled failed ({}) for a [{}][{}] matrix, ld {}, box {}x{}",
               static_cast<int>(r), outer, inner, ld, box_outer, box_inner);
  return m;
}

struct DeviceInfo {
  int cc = 0, sms = 0;
};
DeviceInfo device_info() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return {};
  static std::mutex mu;
  static std::map<int, DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(dev);
  if (it != cache.end()) return it->second;
  DeviceInfo d;
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess)
    d.cc = major * 10 + minor;
  return cache.emplace(dev, d).first->second;
}

template <class T, class OutT, int BN, bool PP = false, int EPI = kEpiLinear, bool SK = false>
auto kernel_of() {
  auto k = gemm_sm90_kernel<T, OutT, BN, PP, EPI, SK>;
  static std::once_flag once;
  std::call_once(once, [&] { CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg<BN, PP>::kSmem)); });
  return k;
}

// Clusters of `splits` blocks that fit on the device at once (0 when none or on error). Every
// kernel of one tile width has the same shared memory and block size, so one stands for all.
int max_active_clusters(int bn, int splits) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, int> cache;  // (device * 512 + bn, splits)
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(dev * 512 + bn, splits);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(splits);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.gridDim = dim3(static_cast<unsigned>(splits));
  cfg.blockDim = dim3(kThreads);
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  cudaError_t e;
  if (bn == 256) {
    cfg.dynamicSmemBytes = Cfg<256>::kSmem;
    e = cudaOccupancyMaxActiveClusters(&n, kernel_of<__nv_bfloat16, __nv_bfloat16, 256>(), &cfg);
  } else if (bn == 160) {
    cfg.dynamicSmemBytes = Cfg<160>::kSmem;
    e = cudaOccupancyMaxActiveClusters(&n, kernel_of<__nv_bfloat16, __nv_bfloat16, 160>(), &cfg);
  } else {
    cfg.dynamicSmemBytes = Cfg<128>::kSmem;
    e = cudaOccupancyMaxActiveClusters(&n, kernel_of<__nv_bfloat16, __nv_bfloat16, 128>(), &cfg);
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky; leave no error behind for the next launch check
    n = 0;
  }
  return cache.emplace(key, n).first->second;
}

std::atomic<int> g_force_bn{0}, g_force_splits{0}, g_force_schedule{0};

// PRIMUS_TURBO_GEMM_VEC_EPILOGUE=0 turns the 16-byte epilogue stores off (read once): to
// separate that path from the rest when hunting a wrong result.
bool vec16_epilogue_enabled() {
  static const bool on = [] {
    return env_choice("PRIMUS_TURBO_GEMM_VEC_EPILOGUE", {"0", "1"}, "1") == "1";
  }();
  return on;
}

// PRIMUS_TURBO_GEMM_STAGED_EPILOGUE=0 (read on every call, for A/B runs) turns the cooperative
// schedule's staged epilogues (store_rows_staged) off: the shuffle-transposed 16-byte stores instead.
bool staged_epilogue_enabled() {
  return env_choice("PRIMUS_TURBO_GEMM_STAGED_EPILOGUE", {"0", "1"}, "1") == "1";
}

// PRIMUS_TURBO_GEMM_TMA_STORE=0 (read on every call, for A/B runs): the staged epilogue's buffers
// are written out by the warps' own 16-byte stores instead of TMA stores.
bool tma_store_enabled() { return env_choice("PRIMUS_TURBO_GEMM_TMA_STORE", {"0", "1"}, "1") == "1"; }

// PRIMUS_TURBO_GEMM_SCHEDULE, read once: coop / cooperative, pingpong / ping-pong; unset or empty:
// the default. Anything else is an error (a typo must not silently time the other schedule).
GemmSm90Schedule env_schedule() {
  static const GemmSm90Schedule s = [] {
    const char* e = std::getenv("PRIMUS_TURBO_GEMM_SCHEDULE");
    std::string v = e ? e : "";
    for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (v.empty()) return GemmSm90Schedule::Auto;
    if (v == "coop" || v == "cooperative") return GemmSm90Schedule::Coop;
    if (v == "pingpong" || v == "ping-pong") return GemmSm90Schedule::Pingpong;
    throw RuntimeError(fmt::format("PRIMUS_TURBO_GEMM_SCHEDULE='{}': expected coop or pingpong", e));
  }();
  return s;
}

// PRIMUS_TURBO_GEMM_PLAN, read once (gemm_sm90_parse_plan): what gemm_sm90_force_plan sets, from
// the environment, for plan sweeps (bench/ops/plan_sweep.sh).
std::pair<int, int> env_plan() {
  static const std::pair<int, int> plan = gemm_sm90_parse_plan(std::getenv("PRIMUS_TURBO_GEMM_PLAN"));
  return plan;
}

// PRIMUS_TURBO_GEMM_STREAMK=1 (read on every call, for A/B runs) lets the automatic plan choose
// stream-K; unset or 0: never (the default until it has been measured on a GPU). Anything else
// is an error.
bool streamk_enabled() {
  const char* e = std::getenv("PRIMUS_TURBO_GEMM_STREAMK");
  if (!e || !*e || std::string(e) == "0") return false;
  if (std::string(e) == "1") return true;
  throw RuntimeError(fmt::format("PRIMUS_TURBO_GEMM_STREAMK='{}': expected 0 or 1", e));
}

// The stream-K workspace of the current device: one fp32 partial tile (128 x 256) and one flag
// per CTA slot, allocated at the first stream-K launch and kept for the process (as cuBLASLt's
// workspace; like it, shared by every stream: two stream-K GEMMs must not run concurrently). The
// flags are zeroed on `stream` before that first launch; every launch leaves them zero. Not
// allocated inside a graph capture: false then, and the caller plans without stream-K.
struct StreamKWorkspace {
  float4* tiles = nullptr;
  unsigned int* flags = nullptr;
  int slots = 0;
};
bool streamk_workspace(int slots, cudaStream_t stream, StreamKWorkspace& out) {
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  static std::mutex mu;
  static std::map<int, StreamKWorkspace> spaces;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = spaces.find(dev); it != spaces.end()) {
    PRIMUS_CHECK(it->second.slots >= slots, "gemm_sm90: stream-K workspace of {} slots, {} asked", it->second.slots,
                 slots);
    out = it->second;
    return true;
  }
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &cs));
  if (cs != cudaStreamCaptureStatusNone) return false;
  StreamKWorkspace w;
  w.slots = slots;
  const size_t tile_bytes = static_cast<size_t>(Cfg<256>::kRedBytes);
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&w.tiles), tile_bytes * static_cast<size_t>(slots)));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&w.flags), sizeof(unsigned int) * static_cast<size_t>(slots)));
  CUDA_CHECK(cudaMemsetAsync(w.flags, 0, sizeof(unsigned int) * static_cast<size_t>(slots), stream));
  out = spaces.emplace(dev, w).first->second;
  return true;
}

// The stream-K plan's cost in the units of gemm_sm90_choose_plan's model: the data-parallel waves
// as whole tiles (k-tiles + 4 for the fill and the epilogue), then the longest stream-K range, +4
// for each of its segments (each ends in an epilogue or a partial's write while the tensor cores
// wait), + 1.25 for each partial the busiest owner adds (128 KiB read from L2) and 0.5 for the
// write of one. The 1.25 and 0.5 (and the 3% margin below) are estimates, not measured: the
// stream-K plan measured slower than the cluster plans wherever it ran (H100), so it stays off
// and the constants were never tuned.
double streamk_cost_uncached(const streamk::Split& s) {
  int reads = 0, segments = 0;
  for (int t = s.tiles_dp; t < s.tiles; ++t) {
    const int owner = s.block_of(static_cast<int64_t>(t - s.tiles_dp) * s.kblocks);
    reads = std::max(reads, streamk::last_block_of_tile(s, t) - owner);
  }
  for (int b = 0; b < s.grid; ++b) {
    int n = 0;
    for (int64_t u = s.begin(b); u < s.end(b); ++n) {
      const streamk::Segment g = streamk::segment_at(s, b, u);
      u += g.kb_end - g.kb_begin;
    }
    segments = std::max(segments, n);
  }
  const double waves_dp = static_cast<double>(s.tiles_dp / s.grid);
  return waves_dp * (s.kblocks + 4.0) + static_cast<double>((s.units + s.grid - 1) / s.grid) + 4.0 * segments +
         1.25 * reads + (reads > 0 ? 0.5 : 0.0);
}
// The same, remembered per (tiles, kblocks, grid): the plan is chosen on every call.
double streamk_cost(const streamk::Split& s) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int>, double> cache;
  const auto key = std::make_tuple(s.tiles, s.kblocks, s.grid);
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  if (cache.size() >= 4096) cache.clear();  // shapes in training are few; this is a guard
  return cache.emplace(key, streamk_cost_uncached(s)).first->second;
}

// This thread in relaxed stream-capture mode while it lives: runtime queries made during a graph
// capture (the check runs on every dispatch) can then never invalidate that capture.
struct RelaxedCapture {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  RelaxedCapture() { (void)cudaThreadExchangeStreamCaptureMode(&mode); }
  ~RelaxedCapture() { (void)cudaThreadExchangeStreamCaptureMode(&mode); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// An operand as TMA reads it: `outer` stored rows of `inner` contiguous elements, `ld` apart.
// A single stored row has no row stride to speak of; it gets one that satisfies TMA's rules.
struct Stored {
  int64_t inner, outer, ld;
};
Stored stored_a(const GemmSm90Problem& p) {
  Stored s = p.a.transposed ? Stored{p.m, p.k, p.a.ld} : Stored{p.k, p.m, p.a.ld};  // [k][m] or [m][k]
  if (s.outer == 1) s.ld = (s.inner + 7) / 8 * 8;
  return s;
}
Stored stored_b(const GemmSm90Problem& p) {
  Stored s = p.b.transposed ? Stored{p.k, p.n, p.b.ld} : Stored{p.n, p.k, p.b.ld};  // [n][k] or [k][n]
  if (s.outer == 1) s.ld = (s.inner + 7) / 8 * 8;
  return s;
}

template <class T, class OutT, int BN, bool PP, int EPI, bool SK = false>
void launch(const CUtensorMap& ta, const CUtensorMap& tb, const EpiMaps& em, const Params& prm, const StreamKArgs<SK>& sk,
            int grid, cudaStream_t stream) {
  auto kernel = kernel_of<T, OutT, BN, PP, EPI, SK>();
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(prm.splits);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = Cfg<BN, PP>::kSmem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = prm.splits > 1 ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, ta, tb, prm, sk, em));
  CUDA_CHECK_LAST();
}

}  // namespace
}  // namespace gemm90

std::string gemm_sm90_unsupported_reason(const GemmSm90Problem& p) noexcept {
  try {
    if (p.in_dtype != DType::BF16 && p.in_dtype != DType::F16)
      return fmt::format("A and B are {}; the sm90 kernel multiplies bf16 or f16", dtype_name(p.in_dtype));
    if (p.d_dtype != p.in_dtype && p.d_dtype != DType::F32)
      return fmt::format("D is {}; with {} inputs it must be {} or f32", dtype_name(p.d_dtype), dtype_name(p.in_dtype),
                         dtype_name(p.in_dtype));
    if (p.m < 0 || p.n < 0 || p.k < 0) return "negative sizes";
    if (p.k == 0) return "k = 0 (nothing to multiply; the TMA descriptors need k >= 1)";
    if (p.m > INT_MAX - 256 || p.n > INT_MAX - 256 || p.k > INT_MAX - 256)
      return fmt::format("sizes {}x{}x{} beyond the kernel's 32-bit coordinates", p.m, p.n, p.k);
    if (gemm90::ceil_div(p.m, gemm90::kBM) * gemm90::ceil_div(p.n, 128) > INT_MAX)
      return fmt::format("{}x{} has more tiles than the kernel counts", p.m, p.n);
    if (p.ldd < p.n) return fmt::format("D's leading dimension {} is below n = {}", p.ldd, p.n);
    if (p.epilogue != GemmSm90Epilogue::None) {
      if (p.d_dtype == DType::F32) return "the GELU epilogues write a 16-bit D (this D is f32)";
      if (!p.aux) return "the GELU epilogues need an aux matrix";
      if (p.ld_aux < p.n) return fmt::format("aux's leading dimension {} is below n = {}", p.ld_aux, p.n);
      if (p.epilogue == GemmSm90Epilogue::DGelu && p.bias) return "the dgelu epilogue takes no bias";
    }
    const gemm90::Stored sa = gemm90::stored_a(p), sb = gemm90::stored_b(p);
    const std::tuple<const char*, const void*, int64_t> ops[] = {{"A", p.a.ptr, sa.ld}, {"B", p.b.ptr, sb.ld}};
    for (const auto& [name, ptr, ld] : ops) {
      if (!ptr) return fmt::format("{} has no data pointer", name);
      if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
        return fmt::format("{}'s base pointer is not 16-byte aligned (TMA needs 16-byte alignment)", name);
      if (ld % 8 != 0 || ld <= 0)
        return fmt::format("{}'s leading dimension {} is not a multiple of 8 elements (TMA needs 16-byte aligned row strides)",
                           name, ld);
    }
    const gemm90::DeviceInfo dev = gemm90::device_info();
    if (dev.cc != 90)
      return dev.cc == 0 ? std::string("no CUDA device")
                         : fmt::format("the device is sm_{}; the kernel is sm_90a code (wgmma, TMA) and runs on "
                                       "compute capability 9.0 only",
                                       dev.cc);
    if (!encode_tiled()) return "the driver does not provide cuTensorMapEncodeTiled (TMA)";
    // A view that only claims to be on the device (tests fake them) must not reach TMA: a fault
    // there would poison the whole CUDA context. One driver look-up per pointer.
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess) return "no current CUDA device";
    const gemm90::RelaxedCapture relaxed;  // pure queries; legal, but keep a capture in progress safe
    const std::pair<const char*, const void*> ptrs[] = {
        {"A", p.a.ptr}, {"B", p.b.ptr}, {"D", p.d}, {"bias", p.bias}, {"aux", p.aux}};
    for (const auto& [name, ptr] : ptrs) {
      if (!ptr) {
        if (std::string(name) == "bias" || std::string(name) == "aux") continue;
        return fmt::format("{} has no data pointer", name);
      }
      cudaPointerAttributes attr{};
      if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
        (void)cudaGetLastError();
        return fmt::format("{} ({}) is not a pointer the CUDA runtime knows", name, ptr);
      }
      if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
        return fmt::format("{} ({}) is not device memory", name, ptr);
      if (attr.device != current)
        return fmt::format("{} lives on device {}, the current device is {}", name, attr.device, current);
    }
    return "";
  } catch (const std::exception& e) {
    return std::string("check failed: ") + e.what();
  } catch (...) {
    return "check failed";
  }
}

GemmSm90Plan gemm_sm90_choose_plan(const GemmSm90PlanQuery& q, GemmSm90ClusterSlots cluster_slots) {
  using namespace gemm90;
  const int sms = std::max(1, q.sms);
  const int64_t kblocks = ceil_div(std::max<int64_t>(q.k, 1), kBK);
  const int force_bn = q.force_bn, force_splits = q.force_splits;
  const bool pingpong = q.pingpong;
  // Cost in units of one 128 x 256 k-tile: waves of tiles x (k-tiles per split + the fill of the
  // pipeline and the epilogue, about 4 k-tiles' time, + about 2 for a split tile's reduction).
  // Ping-pong (splits 1, 128 x 128 tiles): the tiles of a block follow each other on the tensor
  // cores with their epilogues hidden, so only one fill + epilogue is paid per block. Under the
  // ping-pong schedule the cooperative persistent kernel is a candidate only when bn 256 is forced.
  GemmSm90Plan best;
  double best_cost = 1e300;
  for (int bn : {256, 160, 128}) {
    if (force_splits == kGemmSm90StreamK) break;
    if (force_bn ? bn != force_bn : bn != 128 && q.n <= 128) continue;
    if (bn == 160 && !q.bn160) continue;  // a GELU epilogue: no 160-wide kernels (forced: no plan, an error)
    const int64_t tiles = ceil_div(q.m, kBM) * ceil_div(q.n, bn);
    for (int s = 1; s <= kMaxSplits; ++s) {
      if (force_splits ? s != force_splits : (s > 1 && kblocks < 4 * s)) continue;
      if (bn == 160 && s > 1 && force_bn != 160) continue;  // measured slower than the other split plans
      const bool pp = pingpong && s == 1 && bn == 128;
      if (pingpong && s == 1 && bn != 128 && force_bn != bn) continue;
      const int64_t slots = s == 1 ? sms : cluster_slots(bn, s);
      if (slots <= 0) continue;
      // A 128-wide tile does half a 256-wide tile's MMAs but not at half its time: measured on an
      // H100 (bench/ops/plan_sweep.sh), 256 x 1 beat the 128-wide plans this model
      // preferred by 6-20% on lm_head fwd, Llama gate|up fwd, down dgrad and kv wgrad, so a
      // 128-wide tile counts 0.575 of a 256-wide one (0.5 x 1.15) instead of 0.5.
      // The 160-wide tile: 0.625 of the MMAs at an assumed 10% penalty (an estimate between the two
      // measured points).
      const double tile_cost = bn == 256 ? 1.0 : bn == 160 ? 0.69 : 0.575;
      // A split plan of several waves also pays 20 k-tiles per wave after the first: measured on an
      // H100 (bench/ops/plan_sweep.sh), GPT-2's fc weight gradient
      // ran at 0.59x cuBLASLt in 3 waves of 5-block clusters and 0.83x in 2 waves of 3, against
      // 0.83x for one wave of 160-wide tiles, where the model without it ranked them the other way
      // round (the later waves' blocks are out of k-phase with the rest: their operand slabs come
      // from DRAM again).
      const int64_t waves = ceil_div(tiles, slots);
      const double cost =
          pp ? (static_cast<double>(waves) * static_cast<double>(kblocks) + 4.0) * 0.5
             : (static_cast<double>(waves) * (static_cast<double>(ceil_div(kblocks, s)) + 4.0 + (s > 1 ? 2.0 : 0.0)) +
                (s > 1 ? 20.0 * static_cast<double>(waves - 1) : 0.0)) *
                   tile_cost;
      if (cost < best_cost) {
        best_cost = cost;
        best.bn = bn;
        best.splits = s;
        best.grid = static_cast<int>(s == 1 ? std::min<int64_t>(tiles, sms) : tiles * s);
        best.stages = pp          ? Cfg<128, true>::kStages
                      : bn == 256 ? Cfg<256>::kStages
                      : bn == 160 ? Cfg<160>::kStages
                                  : Cfg<128>::kStages;
        best.pingpong = pp;
      }
    }
  }
  // Stream-K (256-wide tiles): forced, or allowed and 3% below the best plan above (a margin for
  // what the model leaves out: L2 locality of the stream-K ranges, the owners' waits).
  const bool sk_forced = force_splits == kGemmSm90StreamK;
  const bool sk_allowed = sk_forced || (q.streamk && force_splits == 0 && !pingpong);
  const int64_t sk_tiles = ceil_div(q.m, kBM) * ceil_div(q.n, 256);
  // (The kernel counts units in 32 bits.)
  if (sk_allowed && (force_bn == 0 || force_bn == 256) && sk_tiles * kblocks < INT_MAX) {
    const streamk::Split split = streamk::make_split(static_cast<int>(sk_tiles), static_cast<int>(kblocks), sms);
    if (sk_forced || streamk_cost(split) < 0.97 * best_cost) {
      best = GemmSm90Plan{};
      best.bn = 256;
      best.splits = 1;
      best.grid = split.grid;
      best.stages = Cfg<256>::kStages;
      best.streamk = true;
    }
  }
  PRIMUS_CHECK(best.bn != 0, "gemm_sm90: no launch plan for {}x{}x{} (forced tile width {}, splits {}){}", q.m, q.n, q.k,
               force_bn, force_splits,
               force_bn == 160 && !q.bn160 ? "; the 160-wide tile has the linear and bias epilogues only" : "");
  return best;
}

namespace gemm90 {
namespace {
GemmSm90Plan plan_for(const GemmSm90Problem& p, bool allow_streamk) {
  GemmSm90PlanQuery q;
  q.m = p.m, q.n = p.n, q.k = p.k;
  q.sms = device_info().sms;
  q.pingpong = gemm_sm90_schedule() == GemmSm90Schedule::Pingpong;
  q.streamk = allow_streamk;
  q.bn160 = p.d_dtype == DType::F32 ||
            (p.epilogue != GemmSm90Epilogue::GeluAux && p.epilogue != GemmSm90Epilogue::DGelu);
  q.force_bn = g_force_bn.load(), q.force_splits = g_force_splits.load();
  if (q.force_bn == 0 && q.force_splits == 0) std::tie(q.force_bn, q.force_splits) = env_plan();
  return gemm_sm90_choose_plan(q, [](int bn, int s) { return max_active_clusters(bn, s); });
}
}  // namespace
}  // namespace gemm90

GemmSm90Plan gemm_sm90_plan(const GemmSm90Problem& p) { return gemm90::plan_for(p, gemm90::streamk_enabled()); }

GemmSm90Schedule gemm_sm90_schedule() {
  const auto forced = static_cast<GemmSm90Schedule>(gemm90::g_force_schedule.load());
  if (forced != GemmSm90Schedule::Auto) return forced;
  const GemmSm90Schedule env = gemm90::env_schedule();
  return env != GemmSm90Schedule::Auto ? env : GemmSm90Schedule::Coop;  // default until measured
}

const char* gemm_sm90_schedule_name(GemmSm90Schedule s) noexcept {
  switch (s) {
    case GemmSm90Schedule::Coop: return "coop";
    case GemmSm90Schedule::Pingpong: return "pingpong";
    default: return "auto";
  }
}

void gemm_sm90_force_schedule(GemmSm90Schedule s) { gemm90::g_force_schedule.store(static_cast<int>(s)); }

std::pair<int, int> gemm_sm90_parse_plan(const char* e) {
  if (!e || !*e) return {0, 0};
  int bn = -1, splits = -1;
  char tail = 0, s0 = 0, s1 = 0;
  if (std::sscanf(e, "%dx%c%c%c", &bn, &s0, &s1, &tail) == 3 && s0 == 's' && s1 == 'k' && (bn == 0 || bn == 256))
    return {bn, kGemmSm90StreamK};
  if (std::sscanf(e, "%dx%d%c", &bn, &splits, &tail) != 2 || !(bn == 0 || bn == 128 || bn == 160 || bn == 256) || splits < 0 ||
      splits > gemm90::kMaxSplits)
    throw RuntimeError(fmt::format("PRIMUS_TURBO_GEMM_PLAN='{}': expected <bn>x<splits> with bn 0, 128, 160 or 256 and "
                                   "splits 0..{} (e.g. 256x2), or 256xsk (stream-K)",
                                   e, gemm90::kMaxSplits));
  return {bn, splits};
}

void gemm_sm90_force_plan(int bn, int splits) {
  PRIMUS_CHECK(bn == 0 || bn == 128 || bn == 160 || bn == 256, "gemm_sm90_force_plan: tile width {} is not 0, 128, 160 or 256",
               bn);
  PRIMUS_CHECK(splits == kGemmSm90StreamK || (splits >= 0 && splits <= gemm90::kMaxSplits),
               "gemm_sm90_force_plan: splits {} is not in 0..{} or kGemmSm90StreamK", splits, gemm90::kMaxSplits);
  PRIMUS_CHECK(splits != kGemmSm90StreamK || bn == 0 || bn == 256,
               "gemm_sm90_force_plan: the stream-K plan runs 256-wide tiles");
  gemm90::g_force_bn.store(bn);
  gemm90::g_force_splits.store(splits);
}

void gemm_sm90(const GemmSm90Problem& p, cudaStream_t stream) {
  using namespace gemm90;
  if (auto w = gemm_sm90_unsupported_reason(p); !w.empty()) throw RuntimeError("gemm_sm90: " + w);
  if (p.m == 0 || p.n == 0) return;
  GemmSm90Plan plan = gemm_sm90_plan(p);
  StreamKWorkspace skw;
  if (plan.streamk && !streamk_workspace(std::max(1, device_info().sms), stream, skw)) {
    // Inside a graph capture before any stream-K launch on this device: no workspace yet.
    PRIMUS_CHECK(g_force_splits.load() != kGemmSm90StreamK && env_plan().second != kGemmSm90StreamK,
                 "gemm_sm90: the stream-K plan is forced, but its workspace is first needed inside a CUDA graph "
                 "capture; run one stream-K GEMM on this device before capturing");
    plan = plan_for(p, false);
  }
  Params prm{};
  prm.m = static_cast<int>(p.m);
  prm.n = static_cast<int>(p.n);
  prm.tiles_m = static_cast<int>(ceil_div(p.m, kBM));
  prm.tiles_n = static_cast<int>(ceil_div(p.n, plan.bn));
  prm.kblocks = static_cast<int>(ceil_div(p.k, kBK));
  prm.splits = plan.splits;
  prm.a_mn = p.a.transposed ? 1 : 0;   // logical A = stored^T: stored [k][m]
  prm.b_mn = p.b.transposed ? 0 : 1;   // B stored as is: [k][n]
  prm.d = p.d;
  prm.ldd = p.ldd;
  const size_t esize = p.d_dtype == DType::F32 ? 4 : 2;
  prm.d_vec = (reinterpret_cast<uintptr_t>(p.d) % (2 * esize) == 0 && p.ldd % 2 == 0) ? 1 : 0;
  prm.d_vec16 = (esize == 2 && p.beta == 0.0f && reinterpret_cast<uintptr_t>(p.d) % 16 == 0 && p.ldd % 8 == 0 &&
                 vec16_epilogue_enabled())
                    ? 1
                    : 0;
  prm.alpha = p.alpha;
  prm.beta = p.beta;
  prm.bias = p.bias;
  prm.bias_vec = reinterpret_cast<uintptr_t>(p.bias) % (2 * esize) == 0 ? 1 : 0;
  prm.aux = p.aux;
  prm.ld_aux = p.ld_aux;
  prm.aux_vec16 = (esize == 2 && reinterpret_cast<uintptr_t>(p.aux) % 16 == 0 && p.ld_aux % 8 == 0) ? 1 : 0;
  prm.staged = (prm.d_vec16 && (!p.bias || prm.bias_vec) && staged_epilogue_enabled()) ? 1 : 0;
  StreamKArgs<true> ska{};
  if (plan.streamk) {
    ska.split = streamk::make_split(prm.tiles_m * prm.tiles_n, prm.kblocks, plan.grid);
    PRIMUS_CHECK(ska.split.grid <= skw.slots, "gemm_sm90: stream-K grid {} beyond the workspace's {} slots",
                 ska.split.grid, skw.slots);
    ska.tiles = skw.tiles;
    ska.flags = skw.flags;
  }
  // Boxes: a K-major operand is read as [rows][64] (128 rows of A, bn rows of B), an MN-major one
  // as [64 k-rows][64] slabs.
  const Stored sa = stored_a(p), sb = stored_b(p);
  const CUtensorMap ta = tensor_map(p.a.ptr, p.in_dtype, sa.inner, sa.outer, sa.ld, 64, prm.a_mn ? 64 : kBM);
  const CUtensorMap tb = tensor_map(p.b.ptr, p.in_dtype, sb.inner, sb.outer, sb.ld, 64, prm.b_mn ? 64 : plan.bn);
  // The staged epilogue's TMA stores: D (and GeluAux's aux) in the per-warp buffers' boxes of 16
  // rows x 64 columns. d_vec16 / aux_vec16 already give what TMA needs (16-byte aligned base and
  // rows); staged tiles lie wholly inside N, and rows past M are clipped by the map.
  EpiMaps em{ta, ta};
  if (prm.staged && tma_store_enabled()) {
    prm.staged = 2;
    em.d = tensor_map(p.d, p.d_dtype, p.n, p.m, p.ldd, 64, 16);
    if (p.epilogue == GemmSm90Epilogue::GeluAux && prm.aux_vec16)
      em.aux = tensor_map(p.aux, p.d_dtype, p.n, p.m, p.ld_aux, 64, 16);
  }
  auto by_bn = [&](auto in, auto out, auto epi) {
    using T = decltype(in);
    using OutT = decltype(out);
    constexpr int EPI = decltype(epi)::value;
    if constexpr (EPI == kEpiLinear) {  // the 160-wide tile's only instantiations
      if (plan.bn == 160) return launch<T, OutT, 160, false, EPI>(ta, tb, em, prm, {}, plan.grid, stream);
    }
    PRIMUS_CHECK(plan.bn != 160, "gemm_sm90: a 160-wide plan for an epilogue without 160-wide kernels");
    if (plan.streamk) launch<T, OutT, 256, false, EPI, true>(ta, tb, em, prm, ska, ska.split.grid, stream);
    else if (plan.pingpong) launch<T, OutT, 128, true, EPI>(ta, tb, em, prm, {}, plan.grid, stream);
    else if (plan.bn == 256) launch<T, OutT, 256, false, EPI>(ta, tb, em, prm, {}, plan.grid, stream);
    else launch<T, OutT, 128, false, EPI>(ta, tb, em, prm, {}, plan.grid, stream);
  };
  // f32 D: the linear epilogue only (gemm_sm90_unsupported_reason turns the GELU ones away).
  auto by_epi = [&](auto in) {
    using T = decltype(in);
    if (p.d_dtype == DType::F32) return by_bn(T{}, float{}, std::integral_constant<int, kEpiLinear>{});
    switch (p.epilogue) {
      case GemmSm90Epilogue::GeluAux: return by_bn(T{}, T{}, std::integral_constant<int, kEpiGeluAux>{});
      case GemmSm90Epilogue::DGelu: return by_bn(T{}, T{}, std::integral_constant<int, kEpiDGelu>{});
      default: return by_bn(T{}, T{}, std::integral_constant<int, kEpiLinear>{});
    }
  };
  if (p.in_dtype == DType::BF16) by_epi(__nv_bfloat16{});
  else by_epi(__half{});
}

}  // namespace primus::turbo::cuda
