// MoE routing on the device: the fused router (scores, group limit, top-k, weights, probs, counts
// and the loss statistics in one pass over the logits), its backward, the row plan (each kept
// slot's row, stable within its expert, capacity dropping), and the token permutes.
//
// Why the router computes in fp64: routing is discrete, and the reference (turbo/kernels/cpu)
// chooses experts on fp64 scores. fp32 scores would round distinct fp64 scores to equal values
// (or swap near neighbours) and pick another expert now and then; in fp64 the two sides differ
// only in the last bits of exp/log, far below any real gap between scores, and exact ties
// (equal logits) stay exact ties on both. The router reads N*E floats once; fp64 arithmetic on
// them is cheap next to that on Hopper.
//
// Determinism: every sum over tokens (prob_sum, z_sum) is a fixed tree (per-warp sequential
// sums, per-block sums in warp order, then a second kernel summing the block partials in block
// order), independent of scheduling; counts use integer atomics, whose result is exact. The row
// plan ranks slots with per-warp bit masks and prefix sums, so a slot's row is a pure function
// of the routing.
//
// No host synchronisation: sizes are (N, K, E, C, capacity), known on the host; everything the
// routing decides (group sizes, offsets, which slots are dropped) stays in device memory.
#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <type_traits>
#include <vector>

#include "turbo/kernels/cuda/common.cuh"
#include "turbo/kernels/cuda/moe.h"

namespace primus::turbo::cuda {
namespace {

constexpr int kMoeWarps = 8;  // warps per block of every kernel here but the plan's scan and drop
constexpr int kMoeThreads = kMoeWarps * 32;

__device__ __forceinline__ double moe_warp_sum_d(double x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ double moe_warp_max_d(double x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
// The best (value, index) of the warp: larger value, ties to the lower index, as the reference's
// top-k orders them. Every lane gets the winner.
__device__ __forceinline__ void moe_warp_argmax(double& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const double ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) {
      v = ov;
      i = oi;
    }
  }
}
// a[j] for a run-time j, without moving the register array to local memory.
template <int N, class T>
__device__ __forceinline__ T moe_pick(const T (&a)[N], int j) {
  T r = a[0];
#pragma unroll
  for (int i = 1; i < N; ++i)
    if (i == j) r = a[i];
  return r;
}
template <int N, class T>
__device__ __forceinline__ void moe_add_at(T (&a)[N], int j, T v) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (i == j) a[i] += v;
}

// Megatron's epsilon in the sigmoid router's normalisations (the reference's kNormEps).
constexpr double kMoeNormEps = 1e-20;

// ---- router forward ----------------------------------------------------------------------------
// One warp per token; lane l holds experts l, l + 32, ... (EPL of them). A block takes a fixed
// run of kMoeRouterTokensPerBlock tokens, so its partial sums depend on N alone.
constexpr int kMoeRouterTokensPerWarp = 4;
constexpr int kMoeRouterTokensPerBlock = kMoeWarps * kMoeRouterTokensPerWarp;

struct MoeRouterFwdParams {
  int32_t* topk_idx;
  float* topk_weight;
  float* probs;
  int32_t* counts;
  double* partials;  // [blocks, E + 1]: per-block sums of p (E columns) and of lse^2
  const float* logits;
  const float* bias;
  int64_t N;
  int E, K, groups, group_topk;
  bool sigmoid, pre_softmax;
  double scaling;
};

template <int EPL>
__global__ void __launch_bounds__(kMoeThreads) moe_router_fwd_kernel(MoeRouterFwdParams p) {
  // Selection scores of each warp's current token (for the group scores), later the warps' sums of p.
  __shared__ double table_s[kMoeWarps][EPL * 32];
  __shared__ double z_s[kMoeWarps];
  __shared__ int cnt_s[EPL * 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, E = p.E, K = p.K;
  for (int e = threadIdx.x; e < EPL * 32; e += blockDim.x) cnt_s[e] = 0;
  __syncthreads();

  double psum[EPL];
#pragma unroll
  for (int j = 0; j < EPL; ++j) psum[j] = 0.0;
  double zacc = 0.0;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kMoeRouterTokensPerBlock + warp * kMoeRouterTokensPerWarp;
  for (int t = 0; t < kMoeRouterTokensPerWarp; ++t) {
    const int64_t n = first + t;
    if (n >= p.N) break;  // warp-uniform
    const float* row = p.logits + n * E;
    double x[EPL], soft[EPL], base[EPL], sel[EPL];
    double mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      const int e = lane + 32 * j;
      x[j] = e < E ? static_cast<double>(row[e]) : -INFINITY;
      mx = fmax(mx, x[j]);
    }
    mx = moe_warp_max_d(mx);
    double s = 0.0;
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      soft[j] = lane + 32 * j < E ? exp(x[j] - mx) : 0.0;
      s += soft[j];
    }
    s = moe_warp_sum_d(s);
    const double lse = mx + log(s);
    zacc += lse * lse;
#pragma unroll
    for (int j = 0; j < EPL; ++j) soft[j] /= s;
    // p (the aux loss's probabilities) and the selection basis.
    if (p.sigmoid) {
      double t_sum = 0.0;
#pragma unroll
      for (int j = 0; j < EPL; ++j) {
        base[j] = lane + 32 * j < E ? 1.0 / (1.0 + exp(-x[j])) : 0.0;
        t_sum += base[j];
      }
      t_sum = moe_warp_sum_d(t_sum) + kMoeNormEps;
#pragma unroll
      for (int j = 0; j < EPL; ++j) {
        const int e = lane + 32 * j;
        if (e < E) {
          const double pe = base[j] / t_sum;
          p.probs[n * E + e] = static_cast<float>(pe);
          psum[j] += pe;
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < EPL; ++j) {
        const int e = lane + 32 * j;
        base[j] = p.pre_softmax ? soft[j] : x[j];
        if (e < E) {
          p.probs[n * E + e] = static_cast<float>(soft[j]);
          psum[j] += soft[j];
        }
      }
    }
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      const int e = lane + 32 * j;
      sel[j] = e < E ? base[j] + (p.bias ? static_cast<double>(p.bias[e]) : 0.0) : -INFINITY;
    }

    // Group limit: a group's score is the sum of its best K / group_topk selection scores (summed
    // best first, as the reference does); only the group_topk best groups stay selectable.
    if (p.groups > 1) {
      const int per_group = E / p.groups, group_k = K / p.group_topk;
#pragma unroll
      for (int j = 0; j < EPL; ++j)
        if (lane + 32 * j < E) table_s[warp][lane + 32 * j] = sel[j];
      __syncwarp();
      double gv = -INFINITY;
      int gi = INT_MAX;
      if (lane < p.groups) {
        const double* g = &table_s[warp][lane * per_group];
        double sum = 0.0, pv = INFINITY;
        int pi = -1;
        for (int r = 0; r < group_k; ++r) {
          // The next element in (value descending, index ascending) order after (pv, pi).
          double bv = -INFINITY;
          int bi = INT_MAX;
          for (int i = 0; i < per_group; ++i) {
            const double v = g[i];
            const bool after = v < pv || (v == pv && i > pi);
            if (after && (v > bv || (v == bv && i < bi))) {
              bv = v;
              bi = i;
            }
          }
          sum += bv;
          pv = bv;
          pi = bi;
        }
        gv = sum;
        gi = lane;
      }
      __syncwarp();  // table_s is rewritten by the next token
      uint32_t allowed = 0;
      for (int r = 0; r < p.group_topk; ++r) {
        double v = gv;
        int i = gi;
        moe_warp_argmax(v, i);
        allowed |= 1u << i;
        if (lane == i) {
          gv = -INFINITY;
          gi = INT_MAX;
        }
      }
#pragma unroll
      for (int j = 0; j < EPL; ++j) {
        const int e = lane + 32 * j;
        if (e < E && !((allowed >> (e / per_group)) & 1u)) sel[j] = -INFINITY;
      }
    }

    // Top-k: K rounds of a warp argmax over the experts not yet taken. Lane k keeps the k-th
    // choice and its basis value.
    uint32_t taken = 0;
    int my_e = 0;
    double my_v = 0.0;
    for (int k = 0; k < K; ++k) {
      double bv = -INFINITY;
      int bi = INT_MAX;
#pragma unroll
      for (int j = 0; j < EPL; ++j) {
        const int e = lane + 32 * j;
        if (e < E && !((taken >> j) & 1u) && (sel[j] > bv || (sel[j] == bv && e < bi))) {
          bv = sel[j];
          bi = e;
        }
      }
      moe_warp_argmax(bv, bi);
      const int owner = bi % 32, jj = bi / 32;
      if (lane == owner) taken |= 1u << jj;
      const double v = __shfl_sync(0xffffffffu, moe_pick(base, jj), owner);
      if (lane == k) {
        my_e = bi;
        my_v = v;
      }
    }
    // Weights over the K chosen (lanes k < K).
    const bool mine = lane < K;
    double w = 0.0;
    if (!p.sigmoid && !p.pre_softmax) {
      const double m = moe_warp_max_d(mine ? my_v : -INFINITY);
      const double ex = mine ? exp(my_v - m) : 0.0;
      w = ex / moe_warp_sum_d(ex);
    } else if (!p.sigmoid) {
      w = my_v;
    } else {
      const double sum = moe_warp_sum_d(mine ? my_v : 0.0);
      w = K > 1 ? my_v / (sum + kMoeNormEps) : my_v;
    }
    if (mine) {
      p.topk_idx[n * K + lane] = my_e;
      p.topk_weight[n * K + lane] = static_cast<float>(w * p.scaling);
      atomicAdd(&cnt_s[my_e], 1);
    }
  }

  // Block partials in a fixed order: warps' sums of p, then the sum over warps in warp order.
  __syncthreads();
#pragma unroll
  for (int j = 0; j < EPL; ++j) table_s[warp][lane + 32 * j] = psum[j];
  if (lane == 0) z_s[warp] = zacc;
  __syncthreads();
  double* out = p.partials + static_cast<int64_t>(blockIdx.x) * (E + 1);
  for (int e = threadIdx.x; e <= E; e += blockDim.x) {
    double s = 0.0;
    for (int w = 0; w < kMoeWarps; ++w) s += e < E ? table_s[w][e] : z_s[w];
    out[e] = s;
  }
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    if (cnt_s[e]) atomicAdd(&p.counts[e], cnt_s[e]);
}

// prob_sum[e] and z_sum from the block partials [blocks, E + 1]: column c summed by one thread
// column of a 32 x 8 block, rows strided by 8, then the 8 partial sums in order.
__global__ void moe_router_reduce_kernel(float* prob_sum, float* z_sum, const double* partials, int64_t blocks,
                                         int E) {
  __shared__ double part_s[8][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  double s = 0.0;
  if (c <= E)
    for (int64_t b = threadIdx.y; b < blocks; b += 8) s += partials[b * (E + 1) + c];
  part_s[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c <= E) {
    double t = 0.0;
    for (int y = 0; y < 8; ++y) t += part_s[y][threadIdx.x];
    if (c < E) prob_sum[c] = static_cast<float>(t);
    else *z_sum = static_cast<float>(t);
  }
}

__global__ void moe_random_logits_kernel(float* logits, int64_t N, int E, uint64_t seed) {
  const int64_t total = N * E;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x)
    logits[i] = cpu::moe_random_logit(seed, i / E, i % E);
}

// ---- the sequence-wise aux loss's statistics ----------------------------------------------------
// Block (32, 32) per (sequence, 32 experts): column c summed over the sequence's runs in order,
// each run's rows strided by 32 into four independent fp64 accumulators a thread (four loads in
// flight: a micro-batch has few sequences, so few blocks), combined in order, then the 32 partials
// in order (a fixed tree); the sequence's slots counted in shared memory for the block's 32 experts.
__global__ void __launch_bounds__(1024) moe_sequence_stats_kernel(int32_t* counts, float* prob_sum,
                                                                  const int32_t* __restrict__ topk_idx,
                                                                  const float* __restrict__ probs, int64_t runs,
                                                                  int64_t run, int K, int E) {
  __shared__ double part_s[32][33];
  __shared__ int cnt_s[32];
  const int64_t s = blockIdx.x, S = gridDim.x;
  const int base = blockIdx.y * 32, c = base + threadIdx.x, tid = threadIdx.y * 32 + threadIdx.x;
  if (tid < 32) cnt_s[tid] = 0;
  __syncthreads();
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  for (int64_t r = s; r < runs; r += S) {
    if (c < E) {
      const int64_t end = (r + 1) * run;
      int64_t n = r * run + threadIdx.y;
      for (; n + 96 < end; n += 128) {
        const float v0 = probs[n * E + c], v1 = probs[(n + 32) * E + c], v2 = probs[(n + 64) * E + c],
                    v3 = probs[(n + 96) * E + c];
        acc[0] += v0, acc[1] += v1, acc[2] += v2, acc[3] += v3;
      }
      if (n < end) acc[0] += probs[n * E + c];
      if (n + 32 < end) acc[1] += probs[(n + 32) * E + c];
      if (n + 64 < end) acc[2] += probs[(n + 64) * E + c];
    }
    const int32_t* idx = topk_idx + r * run * K;
    for (int64_t i = tid; i < run * K; i += 1024) {
      const int e = idx[i] - base;
      if (e >= 0 && e < 32 && e + base < E) atomicAdd(&cnt_s[e], 1);
    }
  }
  part_s[threadIdx.y][threadIdx.x] = ((acc[0] + acc[1]) + acc[2]) + acc[3];
  __syncthreads();
  if (threadIdx.y == 0 && c < E) {
    double t = 0.0;
    for (int y = 0; y < 32; ++y) t += part_s[y][threadIdx.x];
    prob_sum[s * E + c] = static_cast<float>(t);
    counts[s * E + c] = cnt_s[threadIdx.x];
  }
}

// ---- router backward ---------------------------------------------------------------------------
// One balancing loss's statistics (moe_router_load_balancing_type may list several; their
// gradients add).
struct MoeAuxTermParams {
  const int32_t* counts;
  double coeff;
  int64_t seqs, run;  // seqs 0: the switch loss, counts [E]; else counts [seqs, E], token n's row (n / run) % seqs
  double len;         // the tokens a counts row spans (N, or a whole sequence's)
};
constexpr int kMoeMaxAuxTerms = 3;  // aux_loss, seq_aux_loss, global_aux_loss
struct MoeRouterBwdParams {
  float* dlogits;
  const float* dweight;
  const float* logits;
  const int32_t* topk_idx;
  int64_t N;
  int E, K;
  bool sigmoid, pre_softmax;
  double scaling, z_coeff;
  MoeAuxTermParams aux[kMoeMaxAuxTerms];
  int aux_terms;  // the entries of aux whose coefficient is not 0
};

// One warp per token, the same lane layout as the forward; everything recomputed from the logits
// in fp64 (the reference does too).
template <int EPL>
__global__ void __launch_bounds__(kMoeThreads) moe_router_bwd_kernel(MoeRouterBwdParams p) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, E = p.E, K = p.K;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kMoeWarps + warp;
  if (n >= p.N) return;
  // d aux / d p_e: the same for every token of the batch (of a sequence, with the sequence-wise loss).
  double gaux[EPL];
#pragma unroll
  for (int j = 0; j < EPL; ++j) gaux[j] = 0.0;
  for (int t = 0; t < p.aux_terms; ++t) {
    const MoeAuxTermParams& a = p.aux[t];
    const int32_t* cnt = a.counts + (a.seqs > 0 ? (n / a.run) % a.seqs : 0) * E;
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      const int e = lane + 32 * j;
      if (e < E) gaux[j] += a.coeff * E * cnt[e] / (a.len * K * a.len);
    }
  }
  const float* row = p.logits + n * E;
  double x[EPL], soft[EPL], sig[EPL], dl[EPL];
  double mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    const int e = lane + 32 * j;
    x[j] = e < E ? static_cast<double>(row[e]) : -INFINITY;
    mx = fmax(mx, x[j]);
    dl[j] = 0.0;
  }
  mx = moe_warp_max_d(mx);
  double s = 0.0;
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    soft[j] = lane + 32 * j < E ? exp(x[j] - mx) : 0.0;
    s += soft[j];
  }
  s = moe_warp_sum_d(s);
  const double lse = mx + log(s);
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    soft[j] /= s;
    sig[j] = p.sigmoid && lane + 32 * j < E ? 1.0 / (1.0 + exp(-x[j])) : 0.0;
  }

  // Lane k holds slot k: its expert, dweight and the basis value of its expert.
  const bool mine = lane < K;
  const int my_e = mine ? p.topk_idx[n * K + lane] : 0;
  const double my_dw = mine ? static_cast<double>(p.dweight[n * K + lane]) : 0.0;
  double my_v = 0.0;
  for (int k = 0; k < K; ++k) {
    const int e = __shfl_sync(0xffffffffu, my_e, k);
    const int jj = e / 32;
    const double basis = p.sigmoid ? moe_pick(sig, jj) : p.pre_softmax ? moe_pick(soft, jj) : moe_pick(x, jj);
    const double v = __shfl_sync(0xffffffffu, basis, e % 32);
    if (lane == k) my_v = v;
  }
  // Through the weights: c is what slot k adds to dlogits at its expert.
  double c = 0.0;
  if (!p.sigmoid && !p.pre_softmax) {
    const double m = moe_warp_max_d(mine ? my_v : -INFINITY);
    double w = mine ? exp(my_v - m) : 0.0;
    w /= moe_warp_sum_d(w);
    const double dot = moe_warp_sum_d(w * my_dw);
    c = p.scaling * w * (my_dw - dot);
  } else if (!p.sigmoid) {
    const double dot = moe_warp_sum_d(my_v * p.scaling * my_dw);
#pragma unroll
    for (int j = 0; j < EPL; ++j) dl[j] -= soft[j] * dot;
    c = my_v * p.scaling * my_dw;
  } else {
    const double sum = moe_warp_sum_d(my_v) + kMoeNormEps;
    const double dot = moe_warp_sum_d(my_dw * my_v);
    const double du = K > 1 ? p.scaling * (my_dw / sum - dot / (sum * sum)) : p.scaling * my_dw;
    c = du * my_v * (1.0 - my_v);
  }
  for (int k = 0; k < K; ++k) {
    const int e = __shfl_sync(0xffffffffu, my_e, k);
    const double ck = __shfl_sync(0xffffffffu, c, k);
    if (lane == e % 32) moe_add_at(dl, e / 32, ck);
  }
  // Through the aux losses' p.
  if (p.aux_terms > 0) {
    if (!p.sigmoid) {
      double dot = 0.0;
#pragma unroll
      for (int j = 0; j < EPL; ++j) dot += gaux[j] * soft[j];
      dot = moe_warp_sum_d(dot);
#pragma unroll
      for (int j = 0; j < EPL; ++j) dl[j] += soft[j] * (gaux[j] - dot);
    } else {
      double t_sum = 0.0, dot = 0.0;
#pragma unroll
      for (int j = 0; j < EPL; ++j) {
        t_sum += sig[j];
        dot += gaux[j] * sig[j];
      }
      t_sum = moe_warp_sum_d(t_sum) + kMoeNormEps;
      dot = moe_warp_sum_d(dot);
#pragma unroll
      for (int j = 0; j < EPL; ++j)
        dl[j] += (gaux[j] / t_sum - dot / (t_sum * t_sum)) * sig[j] * (1.0 - sig[j]);
    }
  }
  // Through the z loss: d mean_n lse_n^2 = 2 lse_n / N * softmax_n.
  if (p.z_coeff != 0.0) {
#pragma unroll
    for (int j = 0; j < EPL; ++j) dl[j] += p.z_coeff / p.N * 2 * lse * soft[j];
  }
#pragma unroll
  for (int j = 0; j < EPL; ++j)
    if (lane + 32 * j < E) p.dlogits[n * E + lane + 32 * j] = static_cast<float>(dl[j]);
}

// ---- the row plan ------------------------------------------------------------------------------
// Slots are taken in slot order (s = n * K + k, which is token order), kMoePlanSlotsPerBlock per
// block. 1) count: each block's slots per expert. 2) scan (one block): per expert, the exclusive
// prefix over blocks, the total, what is kept, and the padded offsets. 3) rows: each slot's rank
// within its expert (block prefix + warp prefix + its place in a 32-slot mask), hence its row;
// under the Probs policy an over-capacity expert's slots are listed (in token order) instead, and
// 4) drop: one block per such expert finds the capacity-th largest weight by radix selection and
// keeps the slots above it plus the earliest of those equal to it.
constexpr int kMoePlanGroupsPerWarp = 16;
constexpr int kMoePlanSlotsPerBlock = kMoeWarps * 32 * kMoePlanGroupsPerWarp;
constexpr int kMoePlanScanThreads = 512;  // >= kMoeMaxPlanExperts
constexpr int kMoePlanDropThreads = 1024;

struct MoePlanScratch {
  int32_t* hist;        // [blocks, E]: counts, then exclusive prefixes over blocks
  int32_t* total;       // [E] slots per expert
  int32_t* seg_start;   // [E] exclusive prefix of total (the Probs lists' starts)
  int32_t* list_slot;   // [N*K] over-capacity experts' slots, in token order (Probs only)
  uint32_t* list_key;   // [N*K] their weights as ordered keys
};

size_t moe_align256(size_t b) { return (b + 255) / 256 * 256; }

MoePlanScratch moe_plan_scratch(void* base, int64_t NK, int64_t E, bool lists) {
  const int64_t blocks = (NK + kMoePlanSlotsPerBlock - 1) / kMoePlanSlotsPerBlock;
  char* p = static_cast<char*>(base);
  MoePlanScratch s{};
  s.hist = reinterpret_cast<int32_t*>(p);
  p += moe_align256(sizeof(int32_t) * static_cast<size_t>(blocks * E));
  s.total = reinterpret_cast<int32_t*>(p);
  p += moe_align256(sizeof(int32_t) * static_cast<size_t>(E));
  s.seg_start = reinterpret_cast<int32_t*>(p);
  p += moe_align256(sizeof(int32_t) * static_cast<size_t>(E));
  if (lists) {
    s.list_slot = reinterpret_cast<int32_t*>(p);
    p += moe_align256(sizeof(int32_t) * static_cast<size_t>(NK));
    s.list_key = reinterpret_cast<uint32_t*>(p);
  }
  return s;
}

// A float's bits as an unsigned key with the same order (+0 and -0 one key, as they compare equal).
__device__ __forceinline__ uint32_t moe_order_key(float f) {
  if (f == 0.0f) f = 0.0f;
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum over the block (blockDim.x a multiple of 32, <= 1024); *total gets the sum.
// `smem` holds 33 ints; the call starts and ends with a barrier so it can run in a loop.
__device__ int moe_block_exclusive_scan(int v, int* smem, int* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += u;
  }
  __syncthreads();
  if (lane == 31) smem[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = lane < warps ? smem[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int u = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += u;
    }
    if (lane < warps) smem[lane] = w;  // inclusive prefix of the warp totals
    if (lane == 31) smem[32] = w;
  }
  __syncthreads();
  const int before = warp > 0 ? smem[warp - 1] : 0;
  *total = smem[32];
  __syncthreads();
  return before + incl - v;
}

__global__ void __launch_bounds__(kMoeThreads) moe_plan_count_kernel(int32_t* hist, const int32_t* topk_idx,
                                                                     int64_t NK, int E) {
  __shared__ int cnt_s[kMoeMaxPlanExperts];
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt_s[e] = 0;
  __syncthreads();
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kMoePlanSlotsPerBlock;
  const int64_t end = begin + kMoePlanSlotsPerBlock < NK ? begin + kMoePlanSlotsPerBlock : NK;
  for (int64_t s = begin + threadIdx.x; s < end; s += blockDim.x) {
    const int e = topk_idx[s];
    if (e >= 0 && e < E) atomicAdd(&cnt_s[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[static_cast<int64_t>(blockIdx.x) * E + e] = cnt_s[e];
}

__global__ void __launch_bounds__(kMoePlanScanThreads) moe_plan_scan_kernel(int32_t* offsets, int32_t* kept,
                                                                         MoePlanScratch s, int64_t blocks, int E,
                                                                         int64_t align, int64_t capacity) {
  __shared__ int scan_s[33];
  const int e = threadIdx.x;
  int total = 0;
  if (e < E) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int c = s.hist[b * E + e];
      s.hist[b * E + e] = total;
      total += c;
    }
  }
  const int keep = e >= E ? 0 : capacity < 0 ? total : static_cast<int>(total < capacity ? total : capacity);
  const int padded = static_cast<int>((keep + align - 1) / align * align);
  int sum_padded = 0, sum_total = 0;
  const int off = moe_block_exclusive_scan(padded, scan_s, &sum_padded);
  const int start = moe_block_exclusive_scan(total, scan_s, &sum_total);
  if (e < E) {
    offsets[e] = off;
    kept[e] = keep;
    s.total[e] = total;
    s.seg_start[e] = start;
  }
  if (e == 0) offsets[E] = sum_padded;
}

struct MoePlanRowsParams {
  int32_t* row_of_slot;
  const int32_t* topk_idx;
  const float* topk_weight;
  const int32_t* offsets;
  MoePlanScratch s;
  int64_t NK, capacity;
  int E;
  bool by_probs;
};

__global__ void __launch_bounds__(kMoeThreads) moe_plan_rows_kernel(MoePlanRowsParams p) {
  __shared__ uint32_t mask_s[kMoeWarps][kMoeMaxPlanExperts];  // lanes of the current 32 slots per expert
  __shared__ int wcnt_s[kMoeWarps][kMoeMaxPlanExperts];       // the warp's slots per expert so far
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, E = p.E;
  for (int i = threadIdx.x; i < kMoeWarps * E; i += blockDim.x) {
    mask_s[i / E][i % E] = 0;
    wcnt_s[i / E][i % E] = 0;
  }
  __syncthreads();
  const uint32_t lanes_below = (1u << lane) - 1u;
  const int64_t warp_first = static_cast<int64_t>(blockIdx.x) * kMoePlanSlotsPerBlock + warp * 32 * kMoePlanGroupsPerWarp;
  int e_of[kMoePlanGroupsPerWarp], rank_of[kMoePlanGroupsPerWarp];
#pragma unroll
  for (int g = 0; g < kMoePlanGroupsPerWarp; ++g) {
    const int64_t s = warp_first + g * 32 + lane;
    const int e = s < p.NK ? p.topk_idx[s] : -1;
    const bool valid = e >= 0 && e < E;
    if (valid) atomicOr(&mask_s[warp][e], 1u << lane);
    __syncwarp();
    int rank = 0;
    uint32_t m = 0;
    if (valid) {
      m = mask_s[warp][e];
      rank = wcnt_s[warp][e] + __popc(m & lanes_below);
    }
    __syncwarp();
    if (valid && __ffs(m) - 1 == lane) {  // the lowest lane of each expert updates its tables
      wcnt_s[warp][e] += __popc(m);
      mask_s[warp][e] = 0;
    }
    __syncwarp();
    e_of[g] = valid ? e : -1;
    rank_of[g] = rank;
  }
  __syncthreads();
  // The warps' counts become exclusive prefixes in warp order.
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int run = 0;
    for (int w = 0; w < kMoeWarps; ++w) {
      const int c = wcnt_s[w][e];
      wcnt_s[w][e] = run;
      run += c;
    }
  }
  __syncthreads();
  const int32_t* block_base = p.s.hist + static_cast<int64_t>(blockIdx.x) * E;
#pragma unroll
  for (int g = 0; g < kMoePlanGroupsPerWarp; ++g) {
    const int64_t s = warp_first + g * 32 + lane;
    if (s >= p.NK) continue;
    const int e = e_of[g];
    int row = -1;
    if (e >= 0) {
      const int r = block_base[e] + wcnt_s[warp][e] + rank_of[g];  // rank within the expert, token order
      const int total = p.s.total[e];
      if (p.capacity < 0 || total <= p.capacity) {
        row = p.offsets[e] + r;
      } else if (!p.by_probs) {
        if (r < p.capacity) row = p.offsets[e] + r;
      } else {
        const int at = p.s.seg_start[e] + r;
        p.s.list_slot[at] = static_cast<int32_t>(s);
        p.s.list_key[at] = moe_order_key(p.topk_weight[s]);
      }
    }
    p.row_of_slot[s] = row;
  }
}

// Probs policy, one block per expert: keep the `capacity` largest weights, ties to the earlier
// token, rows in token order. Experts within capacity were placed by the rows kernel.
__global__ void __launch_bounds__(kMoePlanDropThreads) moe_plan_drop_kernel(int32_t* row_of_slot,
                                                                         const int32_t* offsets, MoePlanScratch s,
                                                                         int64_t capacity) {
  __shared__ int hist_s[256];
  __shared__ int scan_s[33];
  __shared__ uint32_t digit_s;
  __shared__ int remaining_s;
  const int e = blockIdx.x;
  const int count = s.total[e];
  if (count <= capacity || capacity == 0) return;  // capacity 0: every slot stays dropped (-1)
  const uint32_t* keys = s.list_key + s.seg_start[e];
  const int32_t* slots = s.list_slot + s.seg_start[e];

  // Radix selection of the capacity-th largest key, 8 bits at a time from the top.
  uint32_t prefix = 0, prefix_mask = 0;
  int remaining = static_cast<int>(capacity);
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist_s[i] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
      const uint32_t k = keys[i];
      if ((k & prefix_mask) == prefix) atomicAdd(&hist_s[(k >> shift) & 255u], 1);
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane l covers digits 255 - 8l down to 248 - 8l: counts from the top digit down.
      const int lane = threadIdx.x;
      int mine = 0;
      for (int d = 0; d < 8; ++d) mine += hist_s[255 - 8 * lane - d];
      int incl = mine;
      for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += u;
      }
      const int before = incl - mine;
      if (before < remaining && incl >= remaining) {  // exactly one lane
        int acc = before;
        for (int d = 0; d < 8; ++d) {
          const int digit = 255 - 8 * lane - d, c = hist_s[digit];
          if (acc + c >= remaining) {
            digit_s = static_cast<uint32_t>(digit);
            remaining_s = remaining - acc;
            break;
          }
          acc += c;
        }
      }
    }
    __syncthreads();
    prefix |= digit_s << shift;
    prefix_mask |= 255u << shift;
    remaining = remaining_s;
    __syncthreads();
  }
  // `prefix` is the threshold key; capacity - remaining keys lie above it, and the first
  // `remaining` keys equal to it (in token order) are kept too.
  const uint32_t threshold = prefix;
  const int quota = remaining, first_row = offsets[e];
  int eq_before = 0, kept_before = 0;
  for (int base = 0; base < count; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const uint32_t k = i < count ? keys[i] : 0u;
    const bool eq = i < count && k == threshold, gt = i < count && k > threshold;
    int eq_total = 0, kept_total = 0;
    const int eq_rank = eq_before + moe_block_exclusive_scan(eq ? 1 : 0, scan_s, &eq_total);
    const bool keep = gt || (eq && eq_rank < quota);
    const int kept_rank = kept_before + moe_block_exclusive_scan(keep ? 1 : 0, scan_s, &kept_total);
    if (keep) row_of_slot[slots[i]] = first_row + kept_rank;
    eq_before += eq_total;
    kept_before += kept_total;
  }
}

// ---- permutes ----------------------------------------------------------------------------------
// One warp per token; rows and weights of the token's slots staged in shared memory (a row
// outside [0, rows) counts as dropped). Row data moves in units V: 16 bytes (int4) when every
// row start is 16-byte aligned, else one element.
template <class T, int W>
struct MoeUnit {
  using V = std::conditional_t<W == 1, T, int4>;
};

__device__ __forceinline__ int moe_stage_slots(int (&rows_s)[kMoeWarps][kMoeMaxTopK],
                                               float (&w_s)[kMoeWarps][kMoeMaxTopK], const int32_t* row_of_slot,
                                               const float* weight, int64_t n, int K, int64_t rows) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane < K) {
    const int r = row_of_slot[n * K + lane];
    rows_s[warp][lane] = r >= 0 && r < rows ? r : -1;
    w_s[warp][lane] = weight ? weight[n * K + lane] : 1.0f;
  }
  __syncwarp();
  return warp;
}

// Zeroes rows [offsets[e] + kept[e], min(offsets[e + 1], rows)) of buf (rows of cv units).
template <class V>
__device__ __forceinline__ void moe_zero_padding(V* buf, const int32_t* offsets, const int32_t* kept, int e,
                                                 int64_t cv, int64_t rows) {
  const int64_t begin = static_cast<int64_t>(offsets[e]) + kept[e];
  const int64_t end = offsets[e + 1] < rows ? offsets[e + 1] : rows;
  V zero;
  memset(&zero, 0, sizeof(V));
  for (int64_t i = threadIdx.x; i < (end - begin) * cv; i += blockDim.x) buf[begin * cv + i] = zero;
}

template <class V>
__global__ void __launch_bounds__(kMoeThreads) moe_permute_kernel(V* __restrict__ out, const V* __restrict__ inp,
                                                                  const int32_t* row_of_slot, const int32_t* offsets,
                                                                  const int32_t* kept, int64_t N, int K, int64_t cv,
                                                                  int64_t rows, int64_t token_blocks) {
  __shared__ int rows_s[kMoeWarps][kMoeMaxTopK];
  __shared__ float w_s[kMoeWarps][kMoeMaxTopK];
  if (blockIdx.x >= token_blocks) {
    moe_zero_padding(out, offsets, kept, static_cast<int>(blockIdx.x - token_blocks), cv, rows);
    return;
  }
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kMoeWarps + threadIdx.x / 32;
  if (n >= N) return;
  const int warp = moe_stage_slots(rows_s, w_s, row_of_slot, nullptr, n, K, rows);
  const V* src = inp + n * cv;
#pragma unroll 4
  for (int64_t v = threadIdx.x % 32; v < cv; v += 32) {
    const V x = src[v];
    for (int k = 0; k < K; ++k) {
      const int r = rows_s[warp][k];
      if (r >= 0) out[static_cast<int64_t>(r) * cv + v] = x;
    }
  }
}

template <class T, int W>
__device__ __forceinline__ void moe_load(float (&f)[W], const T* p) {
  if constexpr (W == 1) {
    f[0] = to_f32(p[0]);
  } else {
    const Vec<T> x = load_vec(p);
#pragma unroll
    for (int i = 0; i < W; ++i) f[i] = x.get(i);
  }
}
template <class T, int W>
__device__ __forceinline__ void moe_store(T* p, const float (&f)[W]) {
  if constexpr (W == 1) {
    p[0] = from_f32<T>(f[0]);
  } else {
    Vec<T> x;
#pragma unroll
    for (int i = 0; i < W; ++i) x.set(i, f[i]);
    store_vec(p, x);
  }
}

// A row chunk as loaded (16 bytes, or one element), converted to fp32 where it is used: holding
// the K rows' chunks raw takes half the registers (bf16) of holding them converted.
template <class T, int W>
using MoeRaw = std::conditional_t<W == 1, T, Vec<T>>;
template <class T, int W>
__device__ __forceinline__ MoeRaw<T, W> moe_load_raw(const T* p) {
  if constexpr (W == 1) return p[0];
  else return load_vec(p);
}
template <class T, int W>
__device__ __forceinline__ float moe_raw_get(const MoeRaw<T, W>& v, int i) {
  if constexpr (W == 1) return to_f32(v);
  else return v.get(i);
}

// out[n] = (accumulate ? out[n] : 0) + sum_k w_k * src[row_k], summed in k order in fp32 (w = 1
// for the permute's backward, which then adds exactly as the reference does).
//
// Loads: a loop over the K rows (four in flight per lane) measured faster here than loading all K
// rows' chunks before summing (H200, 2026-12-01, bf16, C 2048: permute_bwd 80-92% of the copy
// bandwidth against 41-46%, unpermute_fwd 68-75% against 41-45%).
template <class T, int W, bool kWeighted>
__global__ void __launch_bounds__(kMoeThreads) moe_gather_sum_kernel(T* __restrict__ out, const T* __restrict__ src,
                                                                     const float* weight, const int32_t* row_of_slot,
                                                                     int64_t N, int K, int64_t C, int64_t rows,
                                                                     bool accumulate) {
  __shared__ int rows_s[kMoeWarps][kMoeMaxTopK];
  __shared__ float w_s[kMoeWarps][kMoeMaxTopK];
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kMoeWarps + threadIdx.x / 32;
  if (n >= N) return;
  const int warp = moe_stage_slots(rows_s, w_s, row_of_slot, kWeighted ? weight : nullptr, n, K, rows);
  T* dst = out + n * C;
  for (int64_t c = static_cast<int64_t>(threadIdx.x % 32) * W; c < C; c += 32 * W) {
    float acc[W];
    if (accumulate) moe_load<T, W>(acc, dst + c);
    else {
#pragma unroll
      for (int i = 0; i < W; ++i) acc[i] = 0.0f;
    }
#pragma unroll 4
    for (int k = 0; k < K; ++k) {
      const int r = rows_s[warp][k];
      if (r < 0) continue;
      float x[W];
      moe_load<T, W>(x, src + static_cast<int64_t>(r) * C + c);
      if constexpr (kWeighted) {
        const float w = w_s[warp][k];
#pragma unroll
        for (int i = 0; i < W; ++i) acc[i] += w * x[i];
      } else {
#pragma unroll
        for (int i = 0; i < W; ++i) acc[i] += x[i];
      }
    }
    moe_store<T, W>(dst + c, acc);
  }
}

// dinp[row_k] = w_k * dout[n]; dweight[n, k] = <dout[n], inp[row_k]> (fp32: each lane's partial
// over its chunks in order, then a fixed butterfly); padding rows zeroed by the blocks past the
// token blocks. kMaxK > 0 (K <= kMaxK): columns outer, the chunks of all K rows loaded before
// any is used and K partial dots in registers; kMaxK == 0: one slot at a time, four chunks of its
// row in flight. Measured (H200, 2026-12-01, bf16, C 2048, 8192 tokens): K 8 and 6 at 88% and 85%
// of the copy bandwidth with the first against 66% and 67% with the second; K 2 at 59% against
// 72% (two rows in flight are fewer than the slot loop's four), hence the first from K >= 4.
template <class T, int W, int kMaxK>
__global__ void __launch_bounds__(kMoeThreads) moe_unpermute_bwd_kernel(
    T* __restrict__ dinp, float* dweight, const T* __restrict__ dout, const T* __restrict__ inp, const float* weight,
    const int32_t* row_of_slot, const int32_t* offsets, const int32_t* kept, int64_t N, int K, int64_t C,
    int64_t rows, int64_t token_blocks) {
  __shared__ int rows_s[kMoeWarps][kMoeMaxTopK];
  __shared__ float w_s[kMoeWarps][kMoeMaxTopK];
  using V = typename MoeUnit<T, W>::V;
  if (blockIdx.x >= token_blocks) {
    moe_zero_padding(reinterpret_cast<V*>(dinp), offsets, kept, static_cast<int>(blockIdx.x - token_blocks), C / W,
                     rows);
    return;
  }
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kMoeWarps + threadIdx.x / 32;
  if (n >= N) return;
  const int lane = threadIdx.x % 32;
  const int warp = moe_stage_slots(rows_s, w_s, row_of_slot, weight, n, K, rows);
  const T* d = dout + n * C;
  if constexpr (kMaxK > 0) {
    float dot[kMaxK];
#pragma unroll
    for (int k = 0; k < kMaxK; ++k) dot[k] = 0.0f;
    for (int64_t c = static_cast<int64_t>(lane) * W; c < C; c += 32 * W) {
      float g[W];
      moe_load<T, W>(g, d + c);
      MoeRaw<T, W> x[kMaxK];
#pragma unroll
      for (int k = 0; k < kMaxK; ++k) {
        const int r = k < K ? rows_s[warp][k] : -1;
        if (r >= 0) x[k] = moe_load_raw<T, W>(inp + static_cast<int64_t>(r) * C + c);
      }
#pragma unroll
      for (int k = 0; k < kMaxK; ++k) {
        const int r = k < K ? rows_s[warp][k] : -1;
        if (r < 0) continue;
        const float w = w_s[warp][k];
        float o[W];
#pragma unroll
        for (int i = 0; i < W; ++i) {
          dot[k] += g[i] * moe_raw_get<T, W>(x[k], i);
          o[i] = w * g[i];
        }
        moe_store<T, W>(dinp + static_cast<int64_t>(r) * C + c, o);
      }
    }
#pragma unroll
    for (int k = 0; k < kMaxK; ++k) {
      if (k >= K) break;  // warp-uniform
      const float total = warp_sum(dot[k]);
      if (lane == 0) dweight[n * K + k] = rows_s[warp][k] >= 0 ? total : 0.0f;
    }
  } else {
    for (int k = 0; k < K; ++k) {
      const int r = rows_s[warp][k];
      float dot = 0.0f;
      if (r >= 0) {
        const float w = w_s[warp][k];
        const T* x = inp + static_cast<int64_t>(r) * C;
        T* di = dinp + static_cast<int64_t>(r) * C;
#pragma unroll 4
        for (int64_t c = static_cast<int64_t>(lane) * W; c < C; c += 32 * W) {
          float g[W], xv[W], o[W];
          moe_load<T, W>(g, d + c);
          moe_load<T, W>(xv, x + c);
#pragma unroll
          for (int i = 0; i < W; ++i) {
            dot += g[i] * xv[i];
            o[i] = w * g[i];
          }
          moe_store<T, W>(di + c, o);
        }
        dot = warp_sum(dot);
      }
      if (lane == 0) dweight[n * K + k] = dot;
    }
  }
}

// ---- launch helpers ----------------------------------------------------------------------------
bool moe_aligned16(std::initializer_list<const void*> ptrs, int64_t row_bytes) {
  if (row_bytes % 16 != 0) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

int64_t moe_token_blocks(int64_t N) { return (N + kMoeWarps - 1) / kMoeWarps; }

// unpermute backward's kMaxK (see moe_unpermute_bwd_kernel).
constexpr int kMoeRowsInFlight = 8;

template <class T, int W, bool kWeighted>
void moe_launch_gather(bool vec, unsigned grid, cudaStream_t stream, T* out, const T* src, const float* weight,
                       const int32_t* row_of_slot, int64_t N, int64_t K, int64_t C, int64_t rows, bool accumulate) {
  const int k = static_cast<int>(K);
  if (vec)
    moe_gather_sum_kernel<T, W, kWeighted><<<grid, kMoeThreads, 0, stream>>>(out, src, weight, row_of_slot, N, k, C,
                                                                            rows, accumulate);
  else
    moe_gather_sum_kernel<T, 1, kWeighted><<<grid, kMoeThreads, 0, stream>>>(out, src, weight, row_of_slot, N, k, C,
                                                                            rows, accumulate);
  CUDA_CHECK_LAST();
}

void moe_check_limits(const char* op, int64_t K, int64_t E, int64_t max_e) {
  if (K < 1 || K > kMoeMaxTopK || E < 1 || E > max_e)
    throw RuntimeError(fmt::format("{}: K={} E={} outside this kernel's limits (1 <= K <= {}, 1 <= E <= {})", op, K, E,
                                   kMoeMaxTopK, max_e));
}

// Calls body with EPL, the experts per lane, bound to a compile-time constant.
template <class F>
void moe_with_epl(int64_t E, F&& body) {
  if (E <= 32) body(std::integral_constant<int, 1>{});
  else if (E <= 64) body(std::integral_constant<int, 2>{});
  else if (E <= 128) body(std::integral_constant<int, 4>{});
  else body(std::integral_constant<int, 8>{});
}

}  // namespace

size_t router_forward_scratch_bytes(int64_t N, int64_t E) {
  const int64_t blocks = (N + kMoeRouterTokensPerBlock - 1) / kMoeRouterTokensPerBlock;
  return sizeof(double) * static_cast<size_t>(blocks * (E + 1));
}

void router_forward(int32_t* topk_idx, float* topk_weight, float* probs, int32_t* counts, float* prob_sum,
                    float* z_sum, const float* logits, const float* bias, int64_t N, const cpu::RouterConfig& cfg,
                    void* scratch, cudaStream_t stream) {
  const int64_t E = cfg.num_experts, K = cfg.topk;
  moe_check_limits("router_forward", K, E, kMoeMaxRouterExperts);
  CUDA_CHECK(cudaMemsetAsync(counts, 0, sizeof(int32_t) * static_cast<size_t>(E), stream));
  if (N == 0) {
    CUDA_CHECK(cudaMemsetAsync(prob_sum, 0, sizeof(float) * static_cast<size_t>(E), stream));
    CUDA_CHECK(cudaMemsetAsync(z_sum, 0, sizeof(float), stream));
    return;
  }
  MoeRouterFwdParams p{topk_idx, topk_weight, probs, counts, static_cast<double*>(scratch), logits, bias, N,
                    static_cast<int>(E), static_cast<int>(K),
                    cfg.num_groups > 1 ? static_cast<int>(cfg.num_groups) : 1, static_cast<int>(cfg.group_topk),
                    cfg.score == cpu::RouterScore::Sigmoid, cfg.pre_softmax, cfg.scaling_factor};
  const int64_t blocks = (N + kMoeRouterTokensPerBlock - 1) / kMoeRouterTokensPerBlock;
  moe_with_epl(E, [&](auto epl) {
    moe_router_fwd_kernel<decltype(epl)::value><<<static_cast<unsigned>(blocks), kMoeThreads, 0, stream>>>(p);
    CUDA_CHECK_LAST();
  });
  moe_router_reduce_kernel<<<ceil_div(E + 1, 32), dim3(32, 8), 0, stream>>>(prob_sum, z_sum, p.partials, blocks,
                                                                          static_cast<int>(E));
  CUDA_CHECK_LAST();
}

void router_backward(float* dlogits, const float* dweight, const float* logits, const int32_t* topk_idx,
                     const int32_t* counts, int64_t N, const cpu::RouterConfig& cfg, double aux_coeff,
                     double z_coeff, const cpu::SequenceRuns& seq, cudaStream_t stream,
                     const cpu::AuxTerm* more, size_t n_more) {
  const int64_t E = cfg.num_experts, K = cfg.topk;
  moe_check_limits("router_backward", K, E, kMoeMaxRouterExperts);
  if (n_more + 1 > static_cast<size_t>(kMoeMaxAuxTerms))
    throw RuntimeError(fmt::format("router_backward: {} balancing losses (at most {})", n_more + 1, kMoeMaxAuxTerms));
  std::vector<cpu::AuxTerm> terms{{counts, aux_coeff, seq}};
  terms.insert(terms.end(), more, more + n_more);
  for (const cpu::AuxTerm& t : terms)
    if (t.seq.seqs > 0) cpu::check_sequence_runs("router_backward", t.seq, N);
  if (N == 0) return;
  MoeRouterBwdParams p{dlogits, dweight, logits, topk_idx, N, static_cast<int>(E), static_cast<int>(K),
                       cfg.score == cpu::RouterScore::Sigmoid, cfg.pre_softmax, cfg.scaling_factor, z_coeff, {}, 0};
  for (const cpu::AuxTerm& t : terms) {
    if (t.coeff == 0.0) continue;
    p.aux[p.aux_terms++] = {t.counts, t.coeff, t.seq.seqs, t.seq.seqs > 0 ? t.seq.run : 1,
                            static_cast<double>(t.seq.seqs > 0 ? t.seq.seq_len : N)};
  }
  moe_with_epl(E, [&](auto epl) {
    moe_router_bwd_kernel<decltype(epl)::value>
        <<<static_cast<unsigned>(moe_token_blocks(N)), kMoeThreads, 0, stream>>>(p);
    CUDA_CHECK_LAST();
  });
}

void moe_random_logits(float* logits, int64_t N, int64_t E, uint64_t seed, cudaStream_t stream) {
  if (N * E == 0) return;
  const int64_t blocks = std::min<int64_t>(ceil_div(N * E, 256), 4096);
  moe_random_logits_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(logits, N, static_cast<int>(E), seed);
  CUDA_CHECK_LAST();
}

void moe_sequence_stats(int32_t* counts, float* prob_sum, const int32_t* topk_idx, const float* probs, int64_t N,
                        const cpu::SequenceRuns& q, int64_t K, int64_t E, cudaStream_t stream) {
  cpu::check_sequence_runs("moe_sequence_stats", {q.seqs, q.run, 1}, N);
  if (N == 0) return;
  const dim3 grid(static_cast<unsigned>(q.seqs), static_cast<unsigned>(ceil_div(E, 32)));
  moe_sequence_stats_kernel<<<grid, dim3(32, 32), 0, stream>>>(counts, prob_sum, topk_idx, probs, N / q.run, q.run,
                                                               static_cast<int>(K), static_cast<int>(E));
  CUDA_CHECK_LAST();
}

size_t moe_plan_scratch_bytes(int64_t N, int64_t K, int64_t E, int64_t capacity, cpu::DropPolicy policy) {
  const int64_t NK = N * K, blocks = (NK + kMoePlanSlotsPerBlock - 1) / kMoePlanSlotsPerBlock;
  size_t b = moe_align256(sizeof(int32_t) * static_cast<size_t>(blocks * E)) +
             2 * moe_align256(sizeof(int32_t) * static_cast<size_t>(E));
  if (capacity >= 0 && policy == cpu::DropPolicy::Probs) b += 2 * moe_align256(sizeof(int32_t) * static_cast<size_t>(NK));
  return b;
}

void moe_plan_rows(int32_t* row_of_slot, int32_t* offsets, int32_t* kept, const int32_t* topk_idx,
                   const float* topk_weight, int64_t N, int64_t K, int64_t E, int64_t align, int64_t capacity,
                   cpu::DropPolicy policy, void* scratch, cudaStream_t stream) {
  moe_check_limits("moe_plan_rows", K, E, kMoeMaxPlanExperts);
  if (align < 1) throw RuntimeError(fmt::format("moe_plan_rows: align {} must be >= 1", align));
  const int64_t NK = N * K;
  if (NK > INT_MAX / 2) throw RuntimeError(fmt::format("moe_plan_rows: N*K = {} slots exceed the i32 rows", NK));
  const bool by_probs = capacity >= 0 && policy == cpu::DropPolicy::Probs;
  const MoePlanScratch s = moe_plan_scratch(scratch, NK, E, by_probs);
  const int64_t blocks = (NK + kMoePlanSlotsPerBlock - 1) / kMoePlanSlotsPerBlock;
  if (blocks > 0) {
    moe_plan_count_kernel<<<static_cast<unsigned>(blocks), kMoeThreads, 0, stream>>>(s.hist, topk_idx, NK,
                                                                                     static_cast<int>(E));
    CUDA_CHECK_LAST();
  }
  moe_plan_scan_kernel<<<1, kMoePlanScanThreads, 0, stream>>>(offsets, kept, s, blocks, static_cast<int>(E), align,
                                                           capacity);
  CUDA_CHECK_LAST();
  if (blocks == 0) return;
  MoePlanRowsParams p{row_of_slot, topk_idx, topk_weight, offsets, s, NK, capacity, static_cast<int>(E), by_probs};
  moe_plan_rows_kernel<<<static_cast<unsigned>(blocks), kMoeThreads, 0, stream>>>(p);
  CUDA_CHECK_LAST();
  if (by_probs) {
    moe_plan_drop_kernel<<<static_cast<unsigned>(E), kMoePlanDropThreads, 0, stream>>>(row_of_slot, offsets, s, capacity);
    CUDA_CHECK_LAST();
  }
}

void moe_permute(DType dtype, void* out, const void* inp, const int32_t* row_of_slot, const int32_t* offsets,
                 const int32_t* kept, int64_t N, int64_t K, int64_t E, int64_t C, int64_t rows, cudaStream_t stream) {
  moe_check_limits("moe_permute", K, E, INT_MAX);
  const int64_t token_blocks = moe_token_blocks(N), row_bytes = C * static_cast<int64_t>(dtype_size(dtype));
  const unsigned grid = static_cast<unsigned>(token_blocks + E);
  if (moe_aligned16({out, inp}, row_bytes)) {
    moe_permute_kernel<int4><<<grid, kMoeThreads, 0, stream>>>(static_cast<int4*>(out), static_cast<const int4*>(inp),
                                                               row_of_slot, offsets, kept, N, static_cast<int>(K),
                                                               row_bytes / 16, rows, token_blocks);
    CUDA_CHECK_LAST();
    return;
  }
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "moe_permute", [&] {
    moe_permute_kernel<scalar_t><<<grid, kMoeThreads, 0, stream>>>(
        static_cast<scalar_t*>(out), static_cast<const scalar_t*>(inp), row_of_slot, offsets, kept, N,
        static_cast<int>(K), C, rows, token_blocks);
    CUDA_CHECK_LAST();
  });
}

void moe_permute_backward(DType dtype, void* dinp, const void* dout, const int32_t* row_of_slot, int64_t N,
                          int64_t K, int64_t C, int64_t rows, bool accumulate, cudaStream_t stream) {
  moe_check_limits("moe_permute_backward", K, 1, 1);
  if (N == 0) return;
  const unsigned grid = static_cast<unsigned>(moe_token_blocks(N));
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "moe_permute_backward", [&] {
    constexpr int kW = Vec<scalar_t>::kSize;
    auto* o = static_cast<scalar_t*>(dinp);
    const auto* i = static_cast<const scalar_t*>(dout);
    moe_launch_gather<scalar_t, kW, false>(moe_aligned16({dinp, dout}, C * static_cast<int64_t>(sizeof(scalar_t))),
                                            grid, stream, o, i, nullptr, row_of_slot, N, K, C, rows, accumulate);
  });
}

void moe_unpermute(DType dtype, void* out, const void* inp, const float* weight, const int32_t* row_of_slot,
                   int64_t N, int64_t K, int64_t C, int64_t rows, bool accumulate, cudaStream_t stream) {
  moe_check_limits("moe_unpermute", K, 1, 1);
  if (N == 0) return;
  const unsigned grid = static_cast<unsigned>(moe_token_blocks(N));
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "moe_unpermute", [&] {
    constexpr int kW = Vec<scalar_t>::kSize;
    auto* o = static_cast<scalar_t*>(out);
    const auto* i = static_cast<const scalar_t*>(inp);
    moe_launch_gather<scalar_t, kW, true>(moe_aligned16({out, inp}, C * static_cast<int64_t>(sizeof(scalar_t))),
                                           grid, stream, o, i, weight, row_of_slot, N, K, C, rows, accumulate);
  });
}

void moe_unpermute_backward(DType dtype, void* dinp, float* dweight, const void* dout, const void* inp,
                            const float* weight, const int32_t* row_of_slot, const int32_t* offsets,
                            const int32_t* kept, int64_t N, int64_t K, int64_t E, int64_t C, int64_t rows,
                            cudaStream_t stream) {
  moe_check_limits("moe_unpermute_backward", K, E, INT_MAX);
  const int64_t token_blocks = moe_token_blocks(N);
  const unsigned grid = static_cast<unsigned>(token_blocks + E);
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "moe_unpermute_backward", [&] {
    constexpr int kW = Vec<scalar_t>::kSize;
    auto* di = static_cast<scalar_t*>(dinp);
    const auto* d = static_cast<const scalar_t*>(dout);
    const auto* x = static_cast<const scalar_t*>(inp);
    auto launch = [&](auto w, auto max_k) {
      moe_unpermute_bwd_kernel<scalar_t, decltype(w)::value, decltype(max_k)::value><<<grid, kMoeThreads, 0, stream>>>(
          di, dweight, d, x, weight, row_of_slot, offsets, kept, N, static_cast<int>(K), C, rows, token_blocks);
      CUDA_CHECK_LAST();
    };
    const bool vec = moe_aligned16({dinp, dout, inp}, C * static_cast<int64_t>(sizeof(scalar_t)));
    const bool in_flight = K >= 4 && K <= kMoeRowsInFlight;
    if (vec && in_flight) launch(std::integral_constant<int, kW>{}, std::integral_constant<int, kMoeRowsInFlight>{});
    else if (vec) launch(std::integral_constant<int, kW>{}, std::integral_constant<int, 0>{});
    else if (in_flight) launch(std::integral_constant<int, 1>{}, std::integral_constant<int, kMoeRowsInFlight>{});
    else launch(std::integral_constant<int, 1>{}, std::integral_constant<int, 0>{});
  });
}

}  // namespace primus::turbo::cuda
