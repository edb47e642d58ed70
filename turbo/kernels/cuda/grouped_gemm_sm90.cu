// Turbo's grouped GEMM for mixture-of-experts layers on Hopper (sm_90a); contract in
// grouped_gemm_sm90.h. It is built from the dense GEMM's pieces (gemm_sm90_device.cuh): the same
// block (one TMA producer warpgroup, two wgmma consumer warpgroups), the same k-loop, the same
// epilogues and the same two schedules: cooperative (both consumer warpgroups on one 128 x 256
// tile) and ping-pong (each warpgroup a whole 128 x 128 tile, every other one of the block, its
// epilogue under the other's k-loop; the default, see pingpong_schedule).
// What differs is where a tile's operands and output lie, which every block works out from the
// group offsets in device memory, so the host never needs them (no synchronisation; a CUDA graph
// can capture the launch).
//
// Forward and dgrad ("rows" mode): each group's rows are cut into 128-row tiles, times the
// output's column tiles, numbered group after group. Persistent blocks take tiles
// blockIdx.x, + gridDim.x, ...; as a block's tile numbers only grow, it finds each tile's group by
// walking the offsets forward (O(G + tiles) reads per block, no table). A tile's A rows come from
// the whole [M, K] matrix through one tensor map: rows past the group's end belong to the next
// group (or to none) and reach only output rows the epilogue masks. The weights are one 3-D
// tensor map [G][N][K], so TMA reads zeros past N and K inside an expert: K-major boxes for the
// forward (inp @ W^T), [64 k][64 n] slabs for dgrad (dout @ W), all of a stage's slabs in one
// load where K allows it (dgrad_pair_map).
// Wgrad ("k" mode): every group has the same (N/128) x (K/BN) output tiles, numbered group after
// group; a tile's k-loop runs over its group's rows (ceil(m_g / 64) k-tiles) with A = dout^T and
// B = inp both read as [64 rows][64 columns] slabs of the token matrices, an operand's two slabs of
// a stage in one TMA load where N and K allow it (wgrad_pair_map: the producer's four loads a stage
// were what the k-loop waited for). When a group's end cuts its last k-tile, the consumers zero
// that stage's rows past the end before multiplying: they hold the next group's tokens, or rows no
// group owns (which may hold anything, NaN included).
// FP8 (T = Fp8Operands): rowwise scales multiply the accumulators before the epilogue; blockwise
// scales (BLK, the cooperative 128 x 128 tile) are applied to every k-tile's partial product
// (row_scales, promote, mainloop_block).
// Output: forward / dgrad through the staged 16-bit epilogue written by the threads themselves
// (each row masked at the group's end; a TMA store would clip only at M), wgrad's f32 tiles by the
// scalar path (beta 1 when accumulating), its bf16 tiles (d_bf16) through the staged epilogue.
#include "turbo/kernels/cuda/grouped_gemm_sm90.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <map>
#include <mutex>
#include <utility>

#include "core/util/error.h"
#include "turbo/core/cuda_check.h"
#include "turbo/kernels/cuda/gemm_sm90_device.cuh"
#include "turbo/kernels/cuda/swiglu_math.cuh"
#include "turbo/kernels/cuda/tma_encode.h"
#include "turbo/core/fp8_granularity.h"

namespace primus::turbo::cuda {
namespace ggemm90 {
namespace {

using namespace gemm90;

constexpr int kModeRows = 0, kModeK = 1;
// The epilogue of the ping-pong rows-mode kernels: the plain product, or SwiGLU fused into it
// (kGluForward: the up projection writes gate|up and act; kGluBackward: the down projection's input
// gradient, dact, becomes d(gate|up) before it is written).
constexpr int kGluNone = 0, kGluForward = 1, kGluBackward = 2;
constexpr int kGBN = 256;  // the cooperative schedule's tile width (ping-pong: 128)

struct GParams {
  const int32_t* offsets;
  int groups;
  int rows_max;   // M: offsets are clamped to [0, M], so a bad offset never leads outside the buffers
  int n;          // output columns
  int m_w;        // k mode: output rows per group (the weight's N)
  int kblocks;    // rows mode: k-tiles of every tile
  int tiles_n;    // output column tiles
  int tiles_m_w;  // k mode: output row tiles per group
  int tiles_k;    // k mode: tiles per group (tiles_m_w * tiles_n)
  void* d;
  int64_t ldd;
  int64_t d_group;  // k mode: elements from one group's output to the next
  float beta;       // k mode: 1 adds to D (accumulate)
  int d_vec16;      // rows mode: 16-byte aligned output rows (the staged 16-bit epilogue)
  // FP8 (rowwise scales, applied to the f32 accumulators before the epilogue): scale_a per output
  // row (rows mode: the token row, [M]; k mode: [G][m_w]), scale_b per output column ([G][n]).
  const float* scale_a;
  const float* scale_b;
  // Blockwise FP8 (the BLK kernels; scales applied per 128-element k-tile, see row_scales): A's
  // scale of row r in k-tile kb at scale_a[kb' * sa_k + r], B's at scale_b[g * sb_g + (n0 / 128) *
  // sb_n + kb' * sb_k] (rows mode, one per 128 x 128 weight block) or scale_b[kb' * sb_k + c] (k
  // mode, one per output column c), where kb' = kb (rows mode) or the token block row0 / 128 + kb.
  int64_t sa_k, sb_g, sb_n, sb_k;
  // Weight gradient (bf16): 1 when A's and B's maps are the [chunk][token][64 features] views
  // (wgrad_pair_map), so one TMA load brings both 64-column slabs of an operand's stage. Input
  // gradient: 1 when B's map is the [group][chunk][n][64] view (dgrad_pair_map), so one load brings
  // all the weights' slabs of a stage.
  int pairs;
  // SwiGLU epilogues (kGluForward, kGluBackward; grouped_gemm_sm90.h): the up half's first column
  // in D (and in aux for the backward), F; aux [M][ld_aux]: the forward's act (written) or the
  // backward's gate|up (read).
  int glu_up;
  void* aux;
  int64_t ld_aux;
};

// One tile: group g and its rows [row0, row0 + rows); tile row tm and column tn of the group's output.
struct GTile {
  int g, row0, rows, tm, tn;
};

__device__ __forceinline__ void group_rows(const GParams& p, int g, int& row0, int& rows) {
  const int a = min(max(__ldg(p.offsets + g), 0), p.rows_max);
  const int b = min(max(__ldg(p.offsets + g + 1), a), p.rows_max);
  row0 = a;
  rows = b - a;
}

// Tile r of a group's tiles_m x tiles_n: groups of kGroupM tile-rows, column by column inside one
// (as the dense GEMM's tile_coords), so the blocks running together share B's tiles in L2.
__device__ __forceinline__ void raster(int r, int tiles_m, int tiles_n, int& tm, int& tn) {
  const int per = kGroupM * tiles_n;
  const int gi = r / per;
  const int first_m = gi * kGroupM;
  const int rws = min(tiles_m - first_m, kGroupM);
  const int rr = r - gi * per;
  tm = first_m + rr % rws;
  tn = rr / rws;
}

// Rows mode: the group holding tile t, for t that never decrease from call to call.
struct RowsWalk {
  int g = -1, first = 0, tiles = 0, row0 = 0, rows = 0;
  __device__ __forceinline__ bool seek(const GParams& p, int t, GTile& out) {
    while (t >= first + tiles) {
      first += tiles;
      if (++g >= p.groups) return false;
      group_rows(p, g, row0, rows);
      tiles = (rows + kBM - 1) / kBM * p.tiles_n;
    }
    out.g = g, out.row0 = row0, out.rows = rows;
    raster(t - first, (rows + kBM - 1) / kBM, p.tiles_n, out.tm, out.tn);
    return true;
  }
};

template <int MODE>
__device__ __forceinline__ bool locate(const GParams& p, RowsWalk& walk, int t, GTile& out) {
  if constexpr (MODE == kModeRows) {
    return walk.seek(p, t, out);
  } else {
    if (t >= p.groups * p.tiles_k) return false;
    out.g = t / p.tiles_k;
    group_rows(p, out.g, out.row0, out.rows);
    raster(t - out.g * p.tiles_k, p.tiles_m_w, p.tiles_n, out.tm, out.tn);
    return true;
  }
}

__device__ __forceinline__ void st_shared_zero16(uint32_t addr) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0u) : "memory");
}

// The wgrad's cut of a group's last k-tile (see the file comment): rows [valid, 64) of A's and B's
// slabs of stage `st` zeroed by `nthreads` threads (tid of them), then made visible to the async
// proxy; the caller's barrier over the same threads follows.
template <class C>
__device__ __forceinline__ void zero_past_group(uint32_t base, int st, int valid, int tid, int nthreads) {
  const uint32_t s0 = base + static_cast<uint32_t>(st * C::kStageBytes);
  constexpr int kSlabs = 2 + C::kSlabsB;  // [64 k-rows][128 bytes] each, contiguous in the stage
  const int chunks = (kBK - valid) * 8;   // the swizzle permutes 16-byte chunks inside a row only
  for (int i = tid; i < kSlabs * chunks; i += nthreads) {
    const int slab = i / chunks, c = i - slab * chunks;
    st_shared_zero16(s0 + static_cast<uint32_t>(slab * kSlabBytes + (valid + c / 8) * 128 + (c % 8) * 16));
  }
  fence_proxy_async();
}
// The FP8 weight gradient's cut (K-major operands: the k-tile's tokens run along each 128-byte
// row): bytes [valid, 128) of every row of A's 128 rows and B's BN rows in stage `st` zeroed, then
// made visible to the async proxy. valid is a multiple of 16 (group offsets are: TMA starts a box
// only on a 16-byte boundary of the innermost dimension), so whole 16-byte chunks are cleared; the
// 128-byte swizzle moves a row's chunk c to c ^ (row % 8).
template <class C, int BN>
__device__ __forceinline__ void zero_past_group_kmajor(uint32_t base, int st, int valid, int tid, int nthreads) {
  const uint32_t s0 = base + static_cast<uint32_t>(st * C::kStageBytes);
  const int whole = valid / 16, chunks = 8 - whole;
  for (int i = tid; i < (kBM + BN) * chunks; i += nthreads) {
    const int r = i / chunks, c = whole + i % chunks;
    st_shared_zero16(s0 + static_cast<uint32_t>(r * 128 + ((c ^ (r & 7)) * 16)));
  }
  fence_proxy_async();
}
// FP8: the accumulators of one m64 row block (acc: BN / 2 floats; this thread's rows r and r + 8
// of the tile's output, r = row0 + lane / 4) times the row's and the column's scale. Rows past
// the output (masked by the epilogue) and columns past N read no scale.
template <int MODE, int BN>
__device__ __forceinline__ void scale_rows(float* acc, const GParams& p, const GTile& tl, int out_rows, int row0, int n0,
                                           int lane) {
  const int r0 = row0 + lane / 4;
  const float* sa = MODE == kModeRows ? p.scale_a + tl.row0 : p.scale_a + static_cast<int64_t>(tl.g) * p.m_w;
  const float* sb = p.scale_b + static_cast<int64_t>(tl.g) * p.n;
  const float a0 = r0 < out_rows ? __ldg(sa + r0) : 0.0f, a8 = r0 + 8 < out_rows ? __ldg(sa + r0 + 8) : 0.0f;
#pragma unroll
  for (int gi = 0; gi < BN / 8; ++gi) {
    const int c = n0 + 8 * gi + 2 * (lane % 4);
    float b0 = 0.0f, b1 = 0.0f;
    if (c + 1 < p.n) {
      const float2 b = __ldg(reinterpret_cast<const float2*>(sb + c));
      b0 = b.x, b1 = b.y;
    } else if (c < p.n) {
      b0 = __ldg(sb + c);
    }
    acc[4 * gi] *= a0 * b0, acc[4 * gi + 1] *= a0 * b1;
    acc[4 * gi + 2] *= a8 * b0, acc[4 * gi + 3] *= a8 * b1;
  }
}
// Blockwise FP8 (DeepSeek-V3's recipe): every 128-element k-tile carries its own scales, so its
// partial product is taken alone (wgmma's f32, in a buffer of its own) and added to the
// accumulators times them, as DeepGEMM promotes its block-scaled partial sums. A thread's
// accumulators cover output rows r0 and r0 + 8 (r0 = its m64 row block's row + lane / 4) and
// column pairs n0 + 8 gi + 2 (lane % 4).
// Rows mode (forward, dgrad): A's token rows have a scale per 128 columns of K ([K/128][M]), B's
// weight one per 128 x 128 block, so a k-tile scales each row by one factor (row_scales). K mode
// (wgrad): both token operands have a scale per feature and per 128 tokens ([M/128][N],
// [M/128][K]), each group's k-tiles starting on a 128-token block (offsets multiples of 128), so a
// k-tile scales by row and by column (read from the scale slots below). Rows past the output read
// no scale (0: their values are never stored).
// The weight gradient's blockwise scales travel with the operands: the producer copies each
// k-tile's 128 row scales and 128 column scales (the tile's rows of A's and columns of B's scales
// in that 128-token block) into a 1 KiB slot per stage, after the epilogue buffers, on the stage's
// full barrier; the consumers read them from there when they promote, so no thread holds the 32
// column scales it needs in registers. (Rows mode keeps two scales per thread and loads them
// itself.)
constexpr int kBlkSlotBytes = 1024;
template <class C>
constexpr int blk_smem() {
  static_assert(C::kSmem + C::kStages * kBlkSlotBytes <= 227 * 1024, "more shared memory than an sm_90 block may have");
  return C::kSmem + C::kStages * kBlkSlotBytes;
}
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// Rows mode: the factors of the thread's rows r0 and r0 + 8 in k-tile kb (A's row scale times the
// weight block's).
__device__ __forceinline__ float2 row_scales(const GParams& p, const GTile& tl, int out_rows, int r0, int n0, int kb) {
  const float* sa = p.scale_a + static_cast<int64_t>(kb) * p.sa_k + tl.row0;
  const float b = __ldg(p.scale_b + tl.g * p.sb_g + (n0 / 128) * p.sb_n + kb * p.sb_k);
  return make_float2(r0 < out_rows ? __ldg(sa + r0) * b : 0.0f, r0 + 8 < out_rows ? __ldg(sa + r0 + 8) * b : 0.0f);
}
// Rows mode: a = the thread's two rows' factors. K mode: slot = the k-tile's scales in shared
// memory (128 row scales, then 128 column scales), rl = the thread's first row in the tile.
template <int MODE, int BN>
__device__ __forceinline__ void promote(float* acc, const float* tmp, float2 a, const float* slot, int rl, int lane) {
  if constexpr (MODE == kModeK) a = make_float2(slot[rl], slot[rl + 8]);
#pragma unroll
  for (int gi = 0; gi < BN / 8; ++gi) {
    if constexpr (MODE == kModeRows) {
      acc[4 * gi] += tmp[4 * gi] * a.x, acc[4 * gi + 1] += tmp[4 * gi + 1] * a.x;
      acc[4 * gi + 2] += tmp[4 * gi + 2] * a.y, acc[4 * gi + 3] += tmp[4 * gi + 3] * a.y;
    } else {
      const float2 b = *reinterpret_cast<const float2*>(slot + 128 + 8 * gi + 2 * (lane % 4));
      acc[4 * gi] += tmp[4 * gi] * (a.x * b.x), acc[4 * gi + 1] += tmp[4 * gi + 1] * (a.x * b.y);
      acc[4 * gi + 2] += tmp[4 * gi + 2] * (a.y * b.x), acc[4 * gi + 3] += tmp[4 * gi + 3] * (a.y * b.y);
    }
  }
}
// The blockwise k-loop of one consumer warpgroup on its 64 rows of a cooperative tile (C::kHalves
// 1). Two partial-product buffers (t0, t1: even and odd k-tiles) let the promotion of k-tile kb - 1
// run while the tensor cores multiply k-tile kb: issue kb's wgmmas, wait for all but that group,
// promote kb - 1 and release its stage. Rows mode loads a k-tile's row scales before its stage is
// waited for; k mode reads them from the stage's scale slot (slots: the first stage's, 1 KiB
// apart; rl: the thread's first row in the tile). tail / before as in mainloop.
template <int MODE, class T, class C, int BN, class Tail, class Before, class Rows>
__device__ __forceinline__ void mainloop_block(float* acc, float* t0, float* t1, uint64_t da, uint64_t db, uint32_t bars,
                                               int kb_count, int& stage, uint32_t& phase, const Tail& tail,
                                               const Before& before, const Rows& rows, const float* slots, int rl,
                                               int lane) {
  static_assert(C::kHalves == 1, "blockwise FP8 runs the cooperative schedule");
  constexpr uint64_t kStep = 32 / 16;  // K-major: 32 bytes along a swizzled row per k32 step
  const bool leader = threadIdx.x % 32 == 0;
  const int tail_kb = max(kb_count - kTailAhead, 0);
  int prev = 0;  // the stage of the k-tile being promoted
  // k-tile kb into buffer t: its stage waited for, its wgmmas issued as one group.
  const auto issue = [&](float* t, int kb) {
    if (kb == tail_kb) tail();
    mbar_wait(bars + 8u * stage, phase);
    before(kb, stage);
    const uint64_t off = static_cast<uint64_t>(stage * C::kStageBytes) >> 4;
    fence_regs<C::kAcc>(t);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk)
      GemmWgmma<T, BN>::template mma<0, 0>(t, da + off + kk * kStep, db + off + kk * kStep, kk > 0 ? 1 : 0);
    wgmma_commit();
    prev = stage;
    if (++stage == C::kStages) {
      stage = 0;
      phase ^= 1u;
    }
  };
  // Promotes the k-tile in t (stage st) once its group is done (`last`: no younger group in
  // flight), then releases the stage (whose scale slot it has just read).
  const auto finish = [&](float* t, float2 a, int st, bool last) {
    if (last) wgmma_wait<0>();
    else wgmma_wait<1>();
    fence_regs<C::kAcc>(t);
    promote<MODE, BN>(acc, t, a, slots + st * (kBlkSlotBytes / 4), rl, lane);
    if (leader) mbar_arrive(bars + 8u * (C::kStages + st));
  };
  if (kb_count == 0) return;
  float2 a0 = rows(0), a1 = make_float2(0.0f, 0.0f);
  issue(t0, 0);
  int st0 = prev, st1 = 0;
  for (int kb = 1;; kb += 2) {
    if (kb < kb_count) {
      a1 = rows(kb);
      issue(t1, kb);
      st1 = prev;
      finish(t0, a0, st0, false);
    } else {
      finish(t0, a0, st0, true);
      break;
    }
    if (kb + 1 < kb_count) {
      a0 = rows(kb + 1);
      issue(t0, kb + 1);
      st0 = prev;
      finish(t1, a1, st1, false);
    } else {
      finish(t1, a1, st1, true);
      break;
    }
  }
}
// ---- the SwiGLU epilogues (ping-pong, rows mode, bf16) ---------------------------------------------
// A warp's 16 rows x 64 columns as 16 words in the accumulators' layout ([group][row, row + 8]: word
// 2g holds row r's columns 8g + 2q, + 1 and word 2g + 1 row r + 8's, r = lane / 4, q = lane % 4)
// go through the warp's 2 KiB buffer (16-byte chunks XOR-swizzled by row, as the staged epilogue's)
// so that global memory sees whole 128-byte row segments. Rows at or past `rows` are not stored
// (loads: read as zeros).
__device__ __forceinline__ uint32_t glu_buf_addr(uint32_t buf, int lane, int k) {
  const int mi = lane / 8, mr = lane % 8 + 8 * (mi & 1), g = 2 * k + (mi >> 1);
  return buf + static_cast<uint32_t>(mr * 128 + ((g ^ (mr & 7)) * 16));
}
__device__ __forceinline__ uint32_t glu_row_addr(uint32_t buf, int r, int c) {
  return buf + static_cast<uint32_t>(r * 128 + ((c ^ (r & 7)) * 16));
}
__device__ __forceinline__ void glu_store(const uint32_t (&w)[16], uint32_t buf, __nv_bfloat16* out, int64_t ld, int row0,
                                          int rows, int col, int lane) {
  __syncwarp();  // the buffer's previous readers are done
#pragma unroll
  for (int k = 0; k < 4; ++k)
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(glu_buf_addr(buf, lane, k)),
                 "r"(w[4 * k]), "r"(w[4 * k + 1]), "r"(w[4 * k + 2]), "r"(w[4 * k + 3])
                 : "memory");
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = 4 * i + lane / 8, c = lane % 8;
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(glu_row_addr(buf, r, c)));
    if (row0 + r < rows) *reinterpret_cast<uint4*>(out + static_cast<int64_t>(row0 + r) * ld + col + c * 8) = v;
  }
}
__device__ __forceinline__ void glu_load(uint32_t (&w)[16], uint32_t buf, const __nv_bfloat16* src, int64_t ld, int row0,
                                         int rows, int col, int lane) {
  uint4 v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = 4 * i + lane / 8, c = lane % 8;
    v[i] = row0 + r < rows ? *reinterpret_cast<const uint4*>(src + static_cast<int64_t>(row0 + r) * ld + col + c * 8)
                           : make_uint4(0u, 0u, 0u, 0u);
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = 4 * i + lane / 8, c = lane % 8;
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(glu_row_addr(buf, r, c)), "r"(v[i].x), "r"(v[i].y),
                 "r"(v[i].z), "r"(v[i].w)
                 : "memory");
  }
  __syncwarp();
#pragma unroll
  for (int k = 0; k < 4; ++k)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(w[4 * k]), "=r"(w[4 * k + 1]), "=r"(w[4 * k + 2]), "=r"(w[4 * k + 3])
                 : "r"(glu_buf_addr(buf, lane, k))
                 : "memory");
}
// 32 accumulators of one m64 row block's 8 column groups, rounded to bf16 words as the plain
// epilogue writes them.
__device__ __forceinline__ void glu_pack(uint32_t (&w)[16], const float* acc) {
#pragma unroll
  for (int g = 0; g < 8; ++g) {
    w[2 * g] = pack2<__nv_bfloat16>(acc[4 * g], acc[4 * g + 1]);
    w[2 * g + 1] = pack2<__nv_bfloat16>(acc[4 * g + 2], acc[4 * g + 3]);
  }
}
// The SwiGLU epilogues of one warp's 16 rows (row0.., of the group's `rows`) of one m64 row block
// (acc: its BN / 2 = 64 accumulators). Every value is computed from the bf16 values the unfused
// path would read back (the product rounded as it is stored), with activation.cu's arithmetic, so
// the fused outputs are the unfused ones bit for bit.
// Forward: the tile's columns are gate [col, col + 64) and up [F + col, ..) (the producer loads
// those weight rows); writes both to gate|up (d, [rows][2F]) and silu(gate) * up to act (aux, [rows][F]).
__device__ __forceinline__ void glu_forward_epilogue(const GParams& p, const GTile& tl, int row0, int col, int lane,
                                                     const float* acc, uint32_t buf) {
  __nv_bfloat16* h = static_cast<__nv_bfloat16*>(p.d) + static_cast<int64_t>(tl.row0) * p.ldd;
  __nv_bfloat16* act = static_cast<__nv_bfloat16*>(p.aux) + static_cast<int64_t>(tl.row0) * p.ld_aux;
  uint32_t wg[16], wu[16];
  glu_pack(wg, acc);
  glu_pack(wu, acc + 32);
  glu_store(wg, buf, h, p.ldd, row0, tl.rows, col, lane);
  glu_store(wu, buf, h, p.ldd, row0, tl.rows, p.glu_up + col, lane);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float2 x = unpack2<__nv_bfloat16>(wg[j]), u = unpack2<__nv_bfloat16>(wu[j]);
    wg[j] = pack2<__nv_bfloat16>(swiglu_f(x.x, u.x), swiglu_f(x.y, u.y));
  }
  glu_store(wg, buf, act, p.ld_aux, row0, tl.rows, col, lane);
}
// Backward: the tile's columns [col, col + 128) of dact in two chunks of 64; gate and up of each
// come from gate|up (aux, [rows][2F]); d(gate) and d(up) go to dgate|dup (d, [rows][2F]).
__device__ __forceinline__ void glu_backward_epilogue(const GParams& p, const GTile& tl, int row0, int col, int lane,
                                                      const float* acc, uint32_t buf) {
  __nv_bfloat16* dh = static_cast<__nv_bfloat16*>(p.d) + static_cast<int64_t>(tl.row0) * p.ldd;
  const __nv_bfloat16* h = static_cast<const __nv_bfloat16*>(p.aux) + static_cast<int64_t>(tl.row0) * p.ld_aux;
#pragma unroll
  for (int chunk = 0; chunk < 2; ++chunk) {
    const int c = col + 64 * chunk;
    uint32_t wd[16], xg[16], xu[16];
    glu_pack(wd, acc + 32 * chunk);
    glu_load(xg, buf, h, p.ld_aux, row0, tl.rows, c, lane);
    glu_load(xu, buf, h, p.ld_aux, row0, tl.rows, p.glu_up + c, lane);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float2 d = unpack2<__nv_bfloat16>(wd[j]), x = unpack2<__nv_bfloat16>(xg[j]), u = unpack2<__nv_bfloat16>(xu[j]);
      float g0, u0, g1, u1;
      swiglu_grad_f(x.x, u.x, d.x, g0, u0);
      swiglu_grad_f(x.y, u.y, d.y, g1, u1);
      xg[j] = pack2<__nv_bfloat16>(g0, g1);
      xu[j] = pack2<__nv_bfloat16>(u0, u1);
    }
    glu_store(xg, buf, dh, p.ldd, row0, tl.rows, c, lane);
    glu_store(xu, buf, dh, p.ldd, row0, tl.rows, p.glu_up + c, lane);
  }
}

// Named barrier 4 + wg over one consumer warpgroup (immediate ids: ptxas counts what is used).
__device__ __forceinline__ void warpgroup_barrier(int wg) {
  if (wg == 0) asm volatile("bar.sync 4, 128;\n" ::: "memory");
  else asm volatile("bar.sync 5, 128;\n" ::: "memory");
}

// T: the operands' type, __nv_bfloat16 or Fp8Operands<A, B> (FP8: every operand K-major, k-tiles
// of 128 elements, the same 128 bytes per row as bf16's 64, and the rowwise scales applied to the
// accumulators before the epilogue). TA / TB as in mainloop: 1 when A is M-major / B is N-major in
// shared memory. PP: the ping-pong schedule (BN 128; each consumer warpgroup owns every other tile
// of the block, whole, and its epilogue runs under the other's k-loop), else the cooperative one
// (both on one tile).
// BLK: blockwise FP8 scales (row_scales; the cooperative 128 x 128 tile only).
// GLU: kGluForward / kGluBackward, SwiGLU fused into the epilogue (bf16 ping-pong rows mode; the
// glu_*_epilogue functions above).
template <class T, class OutT, int MODE, int TA, int TB, int BN, bool PP, bool BLK = false, int GLU = kGluNone>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_sm90_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                             const GParams p, const __grid_constant__ EpiMaps em) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = Cfg<BN, PP>;
  constexpr bool kF8 = !std::is_same_v<T, __nv_bfloat16>;
  constexpr int kTK = kF8 ? 2 * kBK : kBK;  // elements per k-tile (128 bytes of a row)
  static_assert(!kF8 || (TA == 0 && TB == 0), "FP8 operands are K-major");
  static_assert(!BLK || (kF8 && !PP && BN == 128), "blockwise FP8: cooperative 128 x 128 tiles");
  static_assert(GLU == kGluNone || (PP && MODE == kModeRows && !kF8 && TA == 0 && TB == (GLU == kGluBackward ? 1 : 0)),
                "the SwiGLU epilogues: bf16 ping-pong forward (K-major weights) and input gradient");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
  const uint32_t bars = base + C::kBarOffset;                    // full[kStages], then empty[kStages]
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      mbar_init(bars + 8u * s, 1);
      mbar_init(bars + 8u * (C::kStages + s), C::kEmptyArrivals);
    }
    mbar_fence_init();
  }
  __syncthreads();

  if (threadIdx.x < 128) {  // producer warpgroup: one thread issues every TMA load
    attn::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      int stage = 0, it = 0;
      uint32_t phase = 0;
      RowsWalk walk;
      GTile tl;
      for (int t = static_cast<int>(blockIdx.x); locate<MODE>(p, walk, t, tl); t += static_cast<int>(gridDim.x)) {
        const int m0 = tl.tm * kBM, n0 = tl.tn * BN;
        const int kb_count = MODE == kModeRows ? p.kblocks : (tl.rows + kTK - 1) / kTK;
        // MN-major slabs wholly past the output's edge are not loaded (their stale shared memory
        // feeds only masked rows / columns), as in the dense kernel.
        // The paired loads bring both slabs whatever the edge (chunks past it read as zeros and
        // count in the transaction bytes).
        const int a_slabs = MODE == kModeK && TA ? (p.pairs || m0 + 64 < p.m_w ? 2 : 1) : 0;
        const int b_slabs = TB ? (p.pairs ? C::kSlabsB : min(C::kSlabsB, (p.n - n0 + 63) / 64)) : 0;
        const uint32_t tx = (TA ? a_slabs * kSlabBytes : C::kBytesA) + (TB ? b_slabs * kSlabBytes : C::kBytesB) +
                            (BLK && MODE == kModeK ? kBlkSlotBytes : 0);
        for (int kb = 0; kb < kb_count; ++kb, ++it) {
          if (it >= C::kStages) mbar_wait(bars + 8u * (C::kStages + stage), phase ^ 1u);
          const uint32_t full = bars + 8u * stage;
          mbar_expect_tx(full, tx);
          const uint32_t sa = base + stage * C::kStageBytes, sb = sa + C::kBytesA;
          const int k0 = kb * kTK;
          if constexpr (MODE == kModeRows) {
            tma_load_2d(sa, &tmap_a, full, k0, tl.row0 + m0);
            if constexpr (TB) {
              if (p.pairs) {
                attn::tma_load_bthd(sb, &tmap_b, full, 0, k0, n0 / 64, tl.g);
              } else {
                for (int j = 0; j < b_slabs; ++j) attn::tma_load_3d(sb + j * kSlabBytes, &tmap_b, full, n0 + 64 * j, k0, tl.g);
              }
            } else if constexpr (GLU == kGluForward) {  // gate rows n0 / 2.., then the same up rows
              attn::tma_load_3d(sb, &tmap_b, full, k0, n0 / 2, tl.g);
              attn::tma_load_3d(sb + kSlabBytes, &tmap_b, full, k0, p.glu_up + n0 / 2, tl.g);
            } else {
              attn::tma_load_3d(sb, &tmap_b, full, k0, n0, tl.g);
            }
          } else if constexpr (!TA) {  // FP8: dout^T [N][M] and inp^T [K][M], the tokens along k
            const int r = tl.row0 + k0;
            tma_load_2d(sa, &tmap_a, full, r, m0);
            tma_load_2d(sb, &tmap_b, full, r, n0);
            if constexpr (BLK) {  // the k-tile's 128-token block of scales: rows m0.., columns n0..
              const uint32_t slot = base + C::kEpiOffset + C::kEpiBytes + stage * kBlkSlotBytes;
              const int64_t tb = r / 128;
              bulk_g2s(slot, p.scale_a + tb * p.sa_k + m0, 512, full);
              bulk_g2s(slot + 512, p.scale_b + tb * p.sb_k + n0, 512, full);
            }
          } else if (p.pairs) {
            const int r = tl.row0 + k0;
            attn::tma_load_3d(sa, &tmap_a, full, 0, r, m0 / 64);
            attn::tma_load_3d(sb, &tmap_b, full, 0, r, n0 / 64);
          } else {
            const int r = tl.row0 + k0;
            tma_load_2d(sa, &tmap_a, full, m0, r);
            if (a_slabs == 2) tma_load_2d(sa + kSlabBytes, &tmap_a, full, m0 + 64, r);
            for (int j = 0; j < b_slabs; ++j) tma_load_2d(sb + j * kSlabBytes, &tmap_b, full, n0 + 64 * j, r);
          }
          if (++stage == C::kStages) {
            stage = 0;
            phase ^= 1u;
          }
        }
      }
    }
    return;
  }
  // Two consumer warpgroups.
  attn::setmaxnreg_inc<kConsumerRegs>();
  const int ctid = static_cast<int>(threadIdx.x) - 128;
  const int wg = ctid / 128, warp = (ctid % 128) / 32, lane = ctid % 32;
  int epi_nb = 0;  // the staged epilogue's passes so far
  // Descriptors as in the dense kernel: K-major SBO 1024 (8 rows of 128 B); MN-major LBO one slab.
  // Cooperative: warpgroup wg reads A rows 64 wg.. (8 KiB into the stage in both layouts);
  // ping-pong: both halves (mainloop steps over them).
  const uint64_t da = make_desc(base + (PP ? 0 : wg * kSlabBytes), TA ? kSlabBytes : 16, 1024);
  const uint64_t db = make_desc(base + C::kBytesA, TB ? kSlabBytes : 16, 1024);
  float acc[C::kAcc];
  float tmp0[BLK ? C::kAcc : 1], tmp1[BLK ? C::kAcc : 1];  // blockwise: two k-tiles' partial products
  int stage = 0;
  uint32_t phase = 0;
  int64_t it0 = 0;  // ping-pong: the k-iterations of the block's earlier tiles (the producer's count)
  RowsWalk walk;
  GTile tl;
  int i = 0;  // the block's tile count so far
  for (int t = static_cast<int>(blockIdx.x); locate<MODE>(p, walk, t, tl); t += static_cast<int>(gridDim.x), ++i) {
    const int kb_count = MODE == kModeRows ? p.kblocks : (tl.rows + kTK - 1) / kTK;
    bool has_next = false;
    if constexpr (PP) {
      // Tile i is warpgroup i % 2's, its k-iterations the producer's [it0, it0 + kb_count): the
      // stage and phase follow. The k-loops run in tile order (named barriers 2 and 3, as in the
      // dense kernel): tile i waits for tile i - 1's loop, and passes the turn only when the block
      // has a tile i + 1, so waits and passes pair up.
      if (i % 2 != wg) {
        it0 += kb_count;
        continue;
      }
      stage = static_cast<int>(it0 % C::kStages);
      phase = static_cast<uint32_t>((it0 / C::kStages) & 1);
      it0 += kb_count;
      RowsWalk peek = walk;
      GTile next;
      has_next = locate<MODE>(p, peek, t + static_cast<int>(gridDim.x), next);
    } else {
      if (MODE == kModeK && kb_count == 0 && p.beta != 0.0f) continue;  // an empty group adds nothing
    }
    // The tile's output as the dense epilogue sees it: the group's own rows (rows mode) or the
    // group's [N, K] weight gradient (k mode).
    Params q{};
    q.m = MODE == kModeRows ? tl.rows : p.m_w;
    q.n = p.n;
    q.d = static_cast<OutT*>(p.d) +
          (MODE == kModeRows ? static_cast<int64_t>(tl.row0) * p.ldd : static_cast<int64_t>(tl.g) * p.d_group);
    q.ldd = p.ldd;
    q.d_vec = 1;
    q.d_vec16 = p.d_vec16;
    q.alpha = 1.0f;
    q.beta = MODE == kModeK ? p.beta : 0.0f;
    q.staged = q.d_vec16;  // 1: the threads store the staged rows (masked), never TMA (2)
#pragma unroll
    for (int j = 0; j < C::kAcc; ++j) acc[j] = 0.0f;
    const int etid = PP ? ctid % 128 : ctid, ethreads = PP ? 128 : 256;  // the threads on this tile
    const auto tail = [&] {
      if (MODE == kModeK && q.beta != 0.0f)
        prefetch_epilogue<OutT, kEpiLinear>(q, tl.tm * kBM, tl.tn * BN, tl.tn * BN + BN, etid, ethreads);
    };
    if constexpr (PP) {
      if (i > 0) order_wait(wg);
    }
    const int valid = tl.rows - (kb_count - 1) * kTK;  // k mode: rows of the group in its last k-tile
    const auto cut = [&](int kb, int st) {
      if (kb != kb_count - 1 || valid >= kTK) return;
      if constexpr (kF8) zero_past_group_kmajor<C, BN>(base, st, valid, etid, ethreads);
      else zero_past_group<C>(base, st, valid, etid, ethreads);
      if constexpr (PP) warpgroup_barrier(wg);
      else consumer_barrier();
    };
    if constexpr (BLK) {
      const int r0 = tl.tm * kBM + wg * 64 + warp * 16 + lane / 4, n0 = tl.tn * BN;
      const float* slots = reinterpret_cast<const float*>(smem_raw + (base - smem_addr(smem_raw)) + C::kEpiOffset + C::kEpiBytes);
      const int rl = wg * 64 + warp * 16 + lane / 4;
      if constexpr (MODE == kModeK) {
        const auto rows = [](int) { return make_float2(0.0f, 0.0f); };  // from the slots
        mainloop_block<MODE, T, C, BN>(acc, tmp0, tmp1, da, db, bars, kb_count, stage, phase, tail, cut, rows, slots, rl, lane);
      } else {
        const auto rows = [&](int kb) { return row_scales(p, tl, q.m, r0, n0, kb); };
        mainloop_block<MODE, T, C, BN>(acc, tmp0, tmp1, da, db, bars, kb_count, stage, phase, tail, NoBefore{}, rows, slots, rl,
                                       lane);
      }
    } else if constexpr (MODE == kModeK) {
      // Only a tile whose last k-tile is cut runs the check in its k-loop (groups padded to the
      // k-tile, as training pads them, never do), so the other tiles' loops carry none of its
      // instructions.
      if (valid < kTK) mainloop<T, C, BN, TA, TB>(acc, da, db, bars, kb_count, stage, phase, tail, cut);
      else mainloop<T, C, BN, TA, TB>(acc, da, db, bars, kb_count, stage, phase, tail);
    } else {
      mainloop<T, C, BN, TA, TB>(acc, da, db, bars, kb_count, stage, phase, tail);
    }
    if constexpr (PP) {
      if (has_next) order_pass(wg);
      if (MODE == kModeK && kb_count == 0 && q.beta != 0.0f) continue;  // an empty group adds nothing
      if constexpr (GLU != kGluNone) {
        const uint32_t buf = base + C::kEpiOffset + (wg * 4 + warp) * 2048 * C::kEpiBufs;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row0 = tl.tm * kBM + h * 64 + warp * 16;
          if constexpr (GLU == kGluForward) glu_forward_epilogue(p, tl, row0, tl.tn * 64, lane, acc + h * (BN / 2), buf);
          else glu_backward_epilogue(p, tl, row0, tl.tn * BN, lane, acc + h * (BN / 2), buf);
        }
        continue;
      }
      if constexpr (kF8) {
#pragma unroll
        for (int h = 0; h < 2; ++h) scale_rows<MODE, BN>(acc + h * (BN / 2), p, tl, q.m, tl.tm * kBM + h * 64 + warp * 16, tl.tn * BN, lane);
      }
      const int col = tl.tn * BN + (lane % 4) * 2;
      const bool vec16 = tile_vec16<OutT, BN, kEpiLinear>(q, tl.tn * BN);  // uniform over the tile
      const bool staged = sizeof(OutT) == 2 && q.staged && vec16;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = tl.tm * kBM + h * 64 + warp * 16 + lane / 4;
        if (staged) {  // the warp's own buffer: the other warpgroup's epilogue may run meanwhile
          store_rows_staged<OutT, C::kGroups, kEpiLinear, C::kEpiBufs>(
              q, em, tl.tm * kBM + h * 64 + warp * 16, tl.tn * BN, lane, acc + h * (BN / 2),
              base + C::kEpiOffset + (wg * 4 + warp) * 2048 * C::kEpiBufs, epi_nb);
          continue;
        }
        if (vec16) {
          store_rows_vec16<OutT, C::kGroups, kEpiLinear, false>(q, row, tl.tn * BN, lane % 4, acc + h * (BN / 2));
          continue;
        }
#pragma unroll
        for (int g = 0; g < C::kGroups; g += 4) store_groups<OutT, kEpiLinear>(q, row, col + g * 8, 4, acc + h * (BN / 2) + 4 * g);
      }
    } else {
      if constexpr (kF8 && !BLK) scale_rows<MODE, BN>(acc, p, tl, q.m, tl.tm * kBM + wg * 64 + warp * 16, tl.tn * BN, lane);
      store_tile<OutT, C, BN, kEpiLinear>(q, em, tl.tm, tl.tn, wg, warp, lane, acc, base, epi_nb);
    }
  }
#else
  __trap();  // built without sm_90a: grouped_gemm_sm90_unsupported_reason keeps such devices away
#endif
}

// ---- host side ------------------------------------------------------------------------------------

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A tensor of `rank` dims (innermost first; strides in bytes of dims 1..rank-1) of bf16 (esize 2)
// or FP8 bytes (esize 1) in boxes of `box`, 128-byte swizzled; reads outside the tensor return zeros.
CUtensorMap grouped_map(const void* ptr, int rank, const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                        const char* what, int esize = 2) {
  CUtensorMap m;
  const cuuint32_t elem[5] = {1, 1, 1, 1, 1};
  const CUresult r = encode_tiled()(&m, esize == 2 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8,
                                    static_cast<cuuint32_t>(rank), const_cast<void*>(ptr),
                                    dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  PRIMUS_CHECK(r == CUDA_SUCCESS, "grouped_gemm_sm90: cuTensorMapEncodeTiled failed ({}) for {} ({}-d, dims {} x {} x {})",
               static_cast<int>(r), what, rank, dims[0], dims[1], rank > 2 ? dims[2] : 1);
  return m;
}
// [outer][inner] row-major.
CUtensorMap map_2d(const void* ptr, int64_t inner, int64_t outer, uint32_t box_inner, uint32_t box_outer, const char* what,
                   int esize = 2) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(inner * esize)};
  const cuuint32_t box[2] = {box_inner, box_outer};
  return grouped_map(ptr, 2, dims, strides, box, what, esize);
}
// [groups][outer][inner], boxes inside one group; rows `outer_stride` and groups `group_stride`
// elements apart (0: packed, inner and inner * outer).
CUtensorMap map_3d(const void* ptr, int64_t inner, int64_t outer, int64_t groups, uint32_t box_inner, uint32_t box_outer,
                   const char* what, int esize = 2, int64_t outer_stride = 0, int64_t group_stride = 0) {
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer), static_cast<cuuint64_t>(groups)};
  if (outer_stride == 0) outer_stride = inner;
  if (group_stride == 0) group_stride = inner * outer;
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(outer_stride * esize), static_cast<cuuint64_t>(group_stride * esize)};
  const cuuint32_t box[3] = {box_inner, box_outer, 1};
  return grouped_map(ptr, 3, dims, strides, box, what, esize);
}

// The weight gradient's token matrix [M][cols] (cols a multiple of 64) as [cols / 64][M][64]: chunk
// c of row r at (c * 64 + r * cols) elements, in boxes of [2][64 tokens][64 features], which land
// in shared memory as two consecutive [64][64] slabs (the MN-major stage layout). Every element
// the view addresses lies inside the matrix; chunks past cols / 64 read as zeros.
CUtensorMap wgrad_pair_map(const void* ptr, int64_t cols, int64_t rows, const char* what) {
  const cuuint64_t dims[3] = {64, static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(cols / 64)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(cols * 2), 128};
  const cuuint32_t box[3] = {64, 64, 2};
  return grouped_map(ptr, 3, dims, strides, box, what);
}

// The input gradient's weights [G][N][K] (K a multiple of 64) as [G][K / 64][N][64]: chunk c of
// row n of group g at (g * N * K + n * K + c * 64) elements, in boxes of [1][BN / 64][64 rows of
// N][64 columns of K], which land in shared memory as the stage's BN / 64 consecutive N-major
// slabs. Chunks past K / 64 read as zeros.
CUtensorMap dgrad_pair_map(const void* ptr, int64_t k, int64_t n, int64_t groups, int bn, const char* what) {
  const cuuint64_t dims[4] = {64, static_cast<cuuint64_t>(n), static_cast<cuuint64_t>(k / 64), static_cast<cuuint64_t>(groups)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(k * 2), 128, static_cast<cuuint64_t>(n * k * 2)};
  const cuuint32_t box[4] = {64, 64, static_cast<cuuint32_t>(bn / 64), 1};
  return grouped_map(ptr, 4, dims, strides, box, what);
}

// A switch read on every call (for A/B runs): unset or empty gives `dflt`, 0 or 1 the value,
// anything else an error.
bool env_switch(const char* name, bool dflt) {
  const char* e = std::getenv(name);
  const std::string v = e ? e : "";
  if (v.empty()) return dflt;
  if (v == "1") return true;
  if (v == "0") return false;
  throw RuntimeError(fmt::format("{}='{}': expected 0 or 1", name, v));
}
// PRIMUS_TURBO_GROUPED_GEMM_WGRAD_PAIRS = 0: the weight gradient loads each 64-column slab of its
// operands with a TMA load of its own (four a stage) instead of both slabs of an operand with one.
bool wgrad_pairs() { return env_switch("PRIMUS_TURBO_GROUPED_GEMM_WGRAD_PAIRS", true); }
// PRIMUS_TURBO_GROUPED_GEMM_DGRAD_PAIRS = 0: the input gradient loads each 64-column slab of the
// weights' stage with a TMA load of its own instead of all of them with one.
bool dgrad_pairs() { return env_switch("PRIMUS_TURBO_GROUPED_GEMM_DGRAD_PAIRS", true); }

struct GDevice {
  int cc = 0, sms = 0;
};
GDevice gdevice() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return {};
  static std::mutex mu;
  static std::map<int, GDevice> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(dev); it != cache.end()) return it->second;
  GDevice d;
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess)
    d.cc = major * 10 + minor;
  return cache.emplace(dev, d).first->second;
}

// This thread in relaxed stream-capture mode while it lives: the pointer queries of the check
// (run on every dispatch) can then never invalidate a graph capture in progress.
struct RelaxedCaptureScope {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  RelaxedCaptureScope() { (void)cudaThreadExchangeStreamCaptureMode(&mode); }
  ~RelaxedCaptureScope() { (void)cudaThreadExchangeStreamCaptureMode(&mode); }
  RelaxedCaptureScope(const RelaxedCaptureScope&) = delete;
  RelaxedCaptureScope& operator=(const RelaxedCaptureScope&) = delete;
};

// "" when every pointer is device (or managed) memory of the current device, else which is not.
// Call inside a RelaxedCaptureScope.
std::string device_pointers_problem(std::initializer_list<std::pair<const char*, const void*>> ptrs) {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) return "no current CUDA device";
  for (const auto& [name, ptr] : ptrs) {
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
      (void)cudaGetLastError();
      return fmt::format("{} ({}) is not a pointer the CUDA runtime knows", name, ptr);
    }
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
      return fmt::format("{} ({}) is not device memory", name, ptr);
    if (attr.device != current) return fmt::format("{} lives on device {}, the current device is {}", name, attr.device, current);
  }
  return "";
}

template <class T, class OutT, int MODE, int TA, int TB, int BN, bool PP, bool BLK = false, int GLU = kGluNone>
void launch(const CUtensorMap& ta, const CUtensorMap& tb, const GParams& p, int grid, cudaStream_t stream) {
  auto kernel = grouped_gemm_sm90_kernel<T, OutT, MODE, TA, TB, BN, PP, BLK, GLU>;
  constexpr int kSmem = [] {
    if constexpr (BLK) return blk_smem<Cfg<BN, PP>>();
    else return Cfg<BN, PP>::kSmem;
  }();
  static std::once_flag once;
  std::call_once(once, [&] { CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem)); });
  const EpiMaps em{ta, ta};  // never read: the epilogue stores with the threads (Params::staged 1)
  kernel<<<grid, kThreads, kSmem, stream>>>(ta, tb, p, em);
  CUDA_CHECK_LAST();
}

// A call with no rows at all (TMA takes no empty tensor): only a written (not accumulated) weight
// gradient has work, its `elems` zeros of `esize` bytes.
void without_rows(GroupedGemmKind kind, bool accumulate, void* d, int64_t elems, size_t esize, cudaStream_t stream) {
  if (kind == GroupedGemmKind::Wgrad && !accumulate) CUDA_CHECK(cudaMemsetAsync(d, 0, static_cast<size_t>(elems) * esize, stream));
}

// The schedule of one call: PRIMUS_TURBO_GROUPED_GEMM_SCHEDULE (read on every call, for A/B runs)
// = coop or pingpong; unset or empty: ping-pong. Measured on an H200 (2026-12-01, 8d3cf82, the 39
// products of `primus benchmark grouped_gemm`, three rounds interleaved with torch._grouped_mm):
// ping-pong was faster on 30, by up to 23% (the weight gradients of 768-1024-row groups, whose f32
// epilogue it hides under the other warpgroup's k-loop, and deepseek's 1408 columns, which its
// 128-wide tile fits); the cooperative 128 x 256 tile won olmoe's fc forward by 9%, olmoe's proj
// forward (router counts) by 4% and seven products by 1-2.5%. Anything else: an error.
bool pingpong_schedule() {
  const char* e = std::getenv("PRIMUS_TURBO_GROUPED_GEMM_SCHEDULE");
  const std::string v = e ? e : "";
  if (v == "coop") return false;
  if (v.empty() || v == "pingpong") return true;
  throw RuntimeError(fmt::format("PRIMUS_TURBO_GROUPED_GEMM_SCHEDULE='{}': expected coop or pingpong", v));
}

}  // namespace
}  // namespace ggemm90

bool grouped_gemm_sm90_device_ok() noexcept {
  try {
    return ggemm90::gdevice().cc == 90 && encode_tiled() != nullptr;
  } catch (...) {
    return false;
  }
}

std::string grouped_gemm_sm90_unsupported_reason(const GroupedGemmSm90Problem& p) noexcept {
  using namespace ggemm90;
  try {
    const int kind = static_cast<int>(p.kind);
    if (kind < 0 || kind > 2) return "unknown kind";
    if (p.groups < 1) return fmt::format("{} groups (at least 1)", p.groups);
    if (p.rows < 0 || p.n < 1 || p.k < 1) return fmt::format("sizes M={} N={} K={}", p.rows, p.n, p.k);
    if (p.d_bf16 && p.kind != GroupedGemmKind::Wgrad) return "d_bf16 applies to the weight gradient only";
    if (p.d_bf16 && p.accumulate) return "a bf16 dweight is written, never accumulated (each addition would round)";
    if (p.glu != GroupedGemmGlu::None) {
      if (p.kind == GroupedGemmKind::Wgrad) return "the SwiGLU epilogue applies to the forward and the input gradient";
      const bool fwd = p.kind == GroupedGemmKind::Forward;
      if ((fwd && p.n % 2 != 0) || (fwd ? p.n / 2 : p.k) % 128 != 0)
        return fmt::format("the SwiGLU epilogue needs the act width F a multiple of 128, got {}",
                           fwd ? fmt::format("gate|up N = {} (F = N / 2)", p.n) : fmt::format("F = K = {}", p.k));
      if (!p.aux || reinterpret_cast<uintptr_t>(p.aux) % 16 != 0) return "the SwiGLU epilogue's aux is null or not 16-byte aligned";
    }
    if (p.n % 8 != 0 || p.k % 8 != 0)
      return fmt::format("N={} and K={} must be multiples of 8 (TMA needs 16-byte aligned row strides)", p.n, p.k);
    if (p.rows > INT_MAX - 256 || p.n > INT_MAX - 256 || p.k > INT_MAX - 256 || p.groups > INT_MAX / 4)
      return fmt::format("sizes M={} N={} K={} G={} beyond the kernel's 32-bit coordinates", p.rows, p.n, p.k, p.groups);
    // Rows mode: at most (M/128 + G) tile rows; k mode: G x its tiles per group.
    const int64_t out_cols = p.kind == GroupedGemmKind::Dgrad ? p.k : p.n;
    if ((cdiv(p.rows, kBM) + p.groups) * cdiv(out_cols, 128) > INT_MAX || p.groups * cdiv(p.n, kBM) * cdiv(p.k, 128) > INT_MAX)
      return "more tiles than the kernel counts";
    const std::pair<const char*, const void*> ptrs[] = {{"offsets", p.offsets}, {"A", p.a}, {"B", p.b}, {"D", p.d}};
    for (const auto& [name, ptr] : ptrs) {
      if (!ptr) return fmt::format("{} has no data pointer", name);
      if (reinterpret_cast<uintptr_t>(ptr) % (std::string(name) == "offsets" ? 4 : 16) != 0)
        return fmt::format("{}'s base pointer {} is not 16-byte aligned (TMA)", name, ptr);
    }
    const GDevice dev = gdevice();
    if (dev.cc != 90)
      return dev.cc == 0 ? std::string("no CUDA device")
                         : fmt::format("the device is sm_{}; the kernel is sm_90a code (wgmma, TMA)", dev.cc);
    if (!encode_tiled()) return "the driver does not provide cuTensorMapEncodeTiled (TMA)";
    // A view that only claims to be on the device must not reach TMA: a fault there poisons the
    // whole CUDA context.
    const RelaxedCaptureScope relaxed;
    if (p.glu != GroupedGemmGlu::None) return device_pointers_problem({ptrs[0], ptrs[1], ptrs[2], ptrs[3], {"aux", p.aux}});
    return device_pointers_problem({ptrs[0], ptrs[1], ptrs[2], ptrs[3]});
  } catch (const std::exception& e) {
    return std::string("check failed: ") + e.what();
  } catch (...) {
    return "check failed";
  }
}

void grouped_gemm_sm90(const GroupedGemmSm90Problem& p, cudaStream_t stream) {
  using namespace ggemm90;
  if (auto w = grouped_gemm_sm90_unsupported_reason(p); !w.empty()) throw RuntimeError("grouped_gemm_sm90: " + w);
  const int64_t G = p.groups, M = p.rows, N = p.n, K = p.k;
  if (M == 0) return without_rows(p.kind, p.accumulate, p.d, G * N * K, p.d_bf16 ? 2 : 4, stream);
  const int sms = std::max(1, gdevice().sms);
  const bool pp = pingpong_schedule();
  const int bn = pp ? 128 : kGBN;
  GParams prm{};
  prm.offsets = p.offsets;
  prm.groups = static_cast<int>(G);
  prm.rows_max = static_cast<int>(M);
  prm.d = p.d;
  prm.d_vec16 = 1;  // bf16 D, 16-byte aligned base, rows of N or K (multiples of 8) elements
  // One instantiation per (kind, schedule): TA / TB from the kind, the tile from the schedule.
  auto run = [&](auto out, auto mode, auto ta_mn, auto tb_mn, const CUtensorMap& ta, const CUtensorMap& tb, int64_t tiles) {
    using OutT = decltype(out);
    constexpr int MODE = decltype(mode)::value, TA = decltype(ta_mn)::value, TB = decltype(tb_mn)::value;
    const int grid = static_cast<int>(std::min<int64_t>(sms, tiles));
    if (pp) launch<__nv_bfloat16, OutT, MODE, TA, TB, 128, true>(ta, tb, prm, grid, stream);
    else launch<__nv_bfloat16, OutT, MODE, TA, TB, kGBN, false>(ta, tb, prm, grid, stream);
  };
  using I0 = std::integral_constant<int, 0>;
  using I1 = std::integral_constant<int, 1>;
  switch (p.kind) {
    case GroupedGemmKind::Forward: {  // out [M,N] = inp [M,K] @ W[g]^T: A K-major, B K-major
      if (p.glu == GroupedGemmGlu::SwiGLU) {  // tile tn: gate columns [64 tn, +64) and the same up columns
        const int64_t F = N / 2;
        prm.n = static_cast<int>(F);
        prm.ldd = N;
        prm.glu_up = static_cast<int>(F);
        prm.aux = p.aux;
        prm.ld_aux = F;
        prm.kblocks = static_cast<int>(cdiv(K, kBK));
        prm.tiles_n = static_cast<int>(F / 64);
        const CUtensorMap ta = map_2d(p.a, K, M, 64, kBM, "inp [M,K]");
        const CUtensorMap tb = map_3d(p.b, K, N, G, 64, 64, "weight [G,2F,K]");
        const int grid = static_cast<int>(std::min<int64_t>(sms, (cdiv(M, kBM) + G) * prm.tiles_n));
        launch<__nv_bfloat16, __nv_bfloat16, kModeRows, 0, 0, 128, true, false, kGluForward>(ta, tb, prm, grid, stream);
        return;
      }
      prm.n = static_cast<int>(N);
      prm.ldd = N;
      prm.kblocks = static_cast<int>(cdiv(K, kBK));
      prm.tiles_n = static_cast<int>(cdiv(N, bn));
      const CUtensorMap ta = map_2d(p.a, K, M, 64, kBM, "inp [M,K]");
      const CUtensorMap tb = map_3d(p.b, K, N, G, 64, static_cast<uint32_t>(bn), "weight [G,N,K]");
      // At most M/128 + G tile rows (the count itself is on the device).
      run(__nv_bfloat16{}, std::integral_constant<int, kModeRows>{}, I0{}, I0{}, ta, tb, (cdiv(M, kBM) + G) * prm.tiles_n);
      return;
    }
    case GroupedGemmKind::Dgrad: {  // dinp [M,K] = dout [M,N] @ W[g]: A K-major, B N-major (k = N)
      const int tbn = p.glu == GroupedGemmGlu::SwiGLU ? 128 : bn;  // the SwiGLU epilogue's tiles are ping-pong's
      prm.n = static_cast<int>(K);
      prm.ldd = K;
      prm.kblocks = static_cast<int>(cdiv(N, kBK));
      prm.tiles_n = static_cast<int>(cdiv(K, tbn));
      prm.pairs = K % 64 == 0 && dgrad_pairs() ? 1 : 0;
      const CUtensorMap ta = map_2d(p.a, N, M, 64, kBM, "dout [M,N]");
      const CUtensorMap tb = prm.pairs ? dgrad_pair_map(p.b, K, N, G, tbn, "weight [G,N,K]")
                                       : map_3d(p.b, K, N, G, 64, 64, "weight [G,N,K]");
      if (p.glu == GroupedGemmGlu::SwiGLU) {  // d(gate)|d(up) [M, 2K] from dact's tiles and gate|up
        prm.ldd = 2 * K;
        prm.glu_up = static_cast<int>(K);
        prm.aux = p.aux;
        prm.ld_aux = 2 * K;
        const int grid = static_cast<int>(std::min<int64_t>(sms, (cdiv(M, kBM) + G) * prm.tiles_n));
        launch<__nv_bfloat16, __nv_bfloat16, kModeRows, 0, 1, 128, true, false, kGluBackward>(ta, tb, prm, grid, stream);
        return;
      }
      run(__nv_bfloat16{}, std::integral_constant<int, kModeRows>{}, I0{}, I1{}, ta, tb, (cdiv(M, kBM) + G) * prm.tiles_n);
      return;
    }
    case GroupedGemmKind::Wgrad: {  // dW[g] [N,K] = dout_g^T @ inp_g: A M-major, B N-major (k = rows)
      prm.n = static_cast<int>(K);
      prm.m_w = static_cast<int>(N);
      prm.ldd = K;
      prm.d_group = N * K;
      prm.beta = p.accumulate ? 1.0f : 0.0f;
      prm.d_vec16 = p.d_bf16 ? 1 : 0;  // bf16: the staged epilogue (rows of K, a multiple of 8, elements)
      prm.tiles_m_w = static_cast<int>(cdiv(N, kBM));
      prm.tiles_n = static_cast<int>(cdiv(K, bn));
      prm.tiles_k = prm.tiles_m_w * prm.tiles_n;
      prm.pairs = bn == 128 && N % 64 == 0 && K % 64 == 0 && wgrad_pairs() ? 1 : 0;
      const CUtensorMap ta = prm.pairs ? wgrad_pair_map(p.a, N, M, "dout [M,N]") : map_2d(p.a, N, M, 64, 64, "dout [M,N]");
      const CUtensorMap tb = prm.pairs ? wgrad_pair_map(p.b, K, M, "inp [M,K]") : map_2d(p.b, K, M, 64, 64, "inp [M,K]");
      if (p.d_bf16) run(__nv_bfloat16{}, std::integral_constant<int, kModeK>{}, I1{}, I1{}, ta, tb, G * prm.tiles_k);
      else run(float{}, std::integral_constant<int, kModeK>{}, I1{}, I1{}, ta, tb, G * prm.tiles_k);
      return;
    }
  }
}

// ---- FP8 ------------------------------------------------------------------------------------------

namespace {
// The bf16 problem with the same shapes and pointers: the checks both share.
GroupedGemmSm90Problem fp8_as_bf16(const GroupedGemmFp8Sm90Problem& p) {
  GroupedGemmSm90Problem q;
  q.kind = p.kind, q.groups = p.groups, q.rows = p.rows, q.n = p.n, q.k = p.k;
  q.offsets = p.offsets, q.a = p.a, q.b = p.b, q.d = p.d, q.accumulate = p.accumulate;
  return q;
}
}  // namespace

std::string grouped_gemm_fp8_sm90_unsupported_reason(const GroupedGemmFp8Sm90Problem& p) noexcept {
  try {
    if (p.n % 16 != 0 || p.k % 16 != 0)
      return fmt::format("N={} and K={} must be multiples of 16 (TMA's 16-byte row strides of FP8 rows)", p.n, p.k);
    if (p.kind == GroupedGemmKind::Wgrad && p.rows % 16 != 0)
      return fmt::format("M={} must be a multiple of 16 for the weight gradient (its operands are [N][M] and [K][M])",
                         p.rows);
    if (p.blockwise && (p.n % 128 != 0 || p.k % 128 != 0 || (p.kind == GroupedGemmKind::Wgrad && p.rows % 128 != 0)))
      return fmt::format("blockwise scales need N={} and K={}{} to be multiples of 128", p.n, p.k,
                         p.kind == GroupedGemmKind::Wgrad ? fmt::format(" and M={}", p.rows) : std::string());
    // Blockwise, the weight gradient's scales are copied to shared memory in 512-byte runs.
    const uintptr_t sal = p.blockwise ? 16 : 4, sbl = p.blockwise ? 16 : 8;
    if (!p.scale_a || reinterpret_cast<uintptr_t>(p.scale_a) % sal != 0)
      return fmt::format("scale_a is null or not {}-byte aligned", sal);
    if (!p.scale_b || reinterpret_cast<uintptr_t>(p.scale_b) % sbl != 0)
      return fmt::format("scale_b is null or not {}-byte aligned", sbl);
    std::string w = grouped_gemm_sm90_unsupported_reason(fp8_as_bf16(p));
    if (!w.empty()) return w;
    const ggemm90::RelaxedCaptureScope relaxed;
    return ggemm90::device_pointers_problem({{"scale_a", p.scale_a}, {"scale_b", p.scale_b}});
  } catch (const std::exception& e) {
    return std::string("check failed: ") + e.what();
  } catch (...) {
    return "check failed";
  }
}

void grouped_gemm_fp8_sm90(const GroupedGemmFp8Sm90Problem& p, cudaStream_t stream) {
  using namespace ggemm90;
  if (auto w = grouped_gemm_fp8_sm90_unsupported_reason(p); !w.empty()) throw RuntimeError("grouped_gemm_fp8_sm90: " + w);
  const int64_t G = p.groups, M = p.rows, N = p.n, K = p.k;
  if (M == 0) return without_rows(p.kind, p.accumulate, p.d, G * N * K, 4, stream);
  const int sms = std::max(1, gdevice().sms);
  const bool blk = p.blockwise;
  const bool pp = !blk && pingpong_schedule();
  const int bn = pp || blk ? 128 : kGBN;
  constexpr int kTK = 2 * kBK;  // FP8 k-tile: 128 elements
  GParams prm{};
  prm.offsets = p.offsets;
  prm.groups = static_cast<int>(G);
  prm.rows_max = static_cast<int>(M);
  prm.d = p.d;
  prm.d_vec16 = 1;
  prm.scale_a = p.scale_a;
  prm.scale_b = p.scale_b;
  auto run_t = [&](auto ops, auto out, auto mode, const CUtensorMap& ta, const CUtensorMap& tb, int64_t tiles) {
    using T = decltype(ops);
    using OutT = decltype(out);
    constexpr int MODE = decltype(mode)::value;
    const int grid = static_cast<int>(std::min<int64_t>(sms, tiles));
    if (blk) launch<T, OutT, MODE, 0, 0, 128, false, true>(ta, tb, prm, grid, stream);
    else if (pp) launch<T, OutT, MODE, 0, 0, 128, true>(ta, tb, prm, grid, stream);
    else launch<T, OutT, MODE, 0, 0, kGBN, false>(ta, tb, prm, grid, stream);
  };
  auto run = [&](auto out, auto mode, const CUtensorMap& ta, const CUtensorMap& tb, int64_t tiles) {
    if (p.a_e5m2) run_t(gemm90::Fp8Operands<__nv_fp8_e5m2, __nv_fp8_e4m3>{}, out, mode, ta, tb, tiles);
    else run_t(gemm90::Fp8Operands<__nv_fp8_e4m3, __nv_fp8_e4m3>{}, out, mode, ta, tb, tiles);
  };
  switch (p.kind) {
    case GroupedGemmKind::Forward: {  // out [M,N] = inp [M,K] @ W[g]^T
      prm.n = static_cast<int>(N);
      prm.ldd = N;
      prm.kblocks = static_cast<int>(cdiv(K, kTK));
      prm.tiles_n = static_cast<int>(cdiv(N, bn));
      prm.sa_k = M;
      prm.sb_n = fp8_pad4(K / kFp8BlockSize);  // Block128x128 of W [G*N, K]
      prm.sb_g = N / 128 * prm.sb_n;
      prm.sb_k = 1;
      const CUtensorMap ta = map_2d(p.a, K, M, kTK, kBM, "q(inp) [M,K]", 1);
      const CUtensorMap tb = map_3d(p.b, K, N, G, kTK, static_cast<uint32_t>(bn), "q(weight) [G,N,K]", 1);
      run(__nv_bfloat16{}, std::integral_constant<int, kModeRows>{}, ta, tb, (cdiv(M, kBM) + G) * prm.tiles_n);
      return;
    }
    case GroupedGemmKind::Dgrad: {  // dinp [M,K] = dout [M,N] @ W[g], W[g]^T read K-major from [K][G*N]
      prm.n = static_cast<int>(K);
      prm.ldd = K;
      prm.kblocks = static_cast<int>(cdiv(N, kTK));
      prm.tiles_n = static_cast<int>(cdiv(K, bn));
      prm.sa_k = M;
      prm.sb_n = fp8_pad4(G * N / kFp8BlockSize);  // Block128x128 of W^T [K, G*N]
      prm.sb_g = N / 128;
      prm.sb_k = 1;
      const CUtensorMap ta = map_2d(p.a, N, M, kTK, kBM, "q(dout) [M,N]", 1);
      const CUtensorMap tb =
          map_3d(p.b, N, K, G, kTK, static_cast<uint32_t>(bn), "q(weight)^T [K][G*N]", 1, G * N, N);
      run(__nv_bfloat16{}, std::integral_constant<int, kModeRows>{}, ta, tb, (cdiv(M, kBM) + G) * prm.tiles_n);
      return;
    }
    case GroupedGemmKind::Wgrad: {  // dW[g] [N,K] = dout_g^T @ inp_g from [N][M] and [K][M]
      prm.n = static_cast<int>(K);
      prm.m_w = static_cast<int>(N);
      prm.ldd = K;
      prm.d_group = N * K;
      prm.beta = p.accumulate ? 1.0f : 0.0f;
      prm.d_vec16 = 0;
      prm.tiles_m_w = static_cast<int>(cdiv(N, kBM));
      prm.tiles_n = static_cast<int>(cdiv(K, bn));
      prm.tiles_k = prm.tiles_m_w * prm.tiles_n;
      prm.sa_k = N;
      prm.sb_k = K;
      const CUtensorMap ta = map_2d(p.a, M, N, kTK, kBM, "q(dout)^T [N][M]", 1);
      const CUtensorMap tb = map_2d(p.b, M, K, kTK, static_cast<uint32_t>(bn), "q(inp)^T [K][M]", 1);
      run(float{}, std::integral_constant<int, kModeK>{}, ta, tb, G * prm.tiles_k);
      return;
    }
  }
}

}  // namespace primus::turbo::cuda
