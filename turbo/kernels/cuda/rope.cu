// Rotary position embedding, interleaved pairs, forward and backward.
//
// The rotation needs cos/sin of pos * inv_freq[i] (base^(-2i/D), or Llama-3's scaled frequencies). Computing them per element in fp32 loses
// accuracy at large positions (the angle's rounding error grows with pos) and costs special-
// function throughput; instead a [max_pos, D/2] table of {cos, sin} is built once in double and
// read per token, shared by all heads (it stays in L2). The backward is the inverse rotation
// (the rotation is orthogonal), so nothing from the forward is saved. Each thread rotates one
// 128-bit vector (4 bf16 pairs / 2 f32 pairs).
#include <fmt/format.h>

#include "turbo/kernels/cuda/common.cuh"
#include "turbo/kernels/cuda/rope.h"

namespace primus::turbo::cuda {
namespace {

// The frequencies by value (2 KiB of kernel arguments): no device buffer to allocate for them.
struct InvFreq {
  double v[kRopeMaxPairs];
};

__global__ void rope_table_kernel(float2* table, int64_t max_pos, int64_t half, InvFreq f) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= max_pos * half) return;
  const int64_t pos = i / half, pair = i % half;
  double s, c;
  sincos(static_cast<double>(pos) * f.v[pair], &s, &c);
  table[i] = make_float2(static_cast<float>(c), static_cast<float>(s));
}

// kInverse: rotate by -angle (the backward). A work item is one 128-bit slice of the head dim
// for one token and kHeads heads: their cos/sin are the same, so each table entry loaded serves
// kHeads vectors (without that the table reads would outnumber the data reads two to one).
constexpr int kHeads = 4;

template <class T, bool kInverse>
__global__ void rope_kernel(T* out, const T* inp, const int32_t* positions, const float2* table,
                            int64_t items, int T_, int H, int D, int64_t in_row, int64_t out_row, int max_pos,
                            bool acc) {
  constexpr int W = Vec<T>::kSize;
  const int half = D / 2, dvecs = D / W, groups = (H + kHeads - 1) / kHeads;
  for (int64_t it = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; it < items;
       it += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int dv = static_cast<int>(it % dvecs);
    const int hg = static_cast<int>((it / dvecs) % groups);
    const int64_t token = it / (static_cast<int64_t>(dvecs) * groups);
    const int pos = positions ? positions[token] : static_cast<int>(token % T_);
    const bool ok = pos >= 0 && pos < max_pos;
    const float2* row = table + static_cast<int64_t>(ok ? pos : 0) * half + dv * (W / 2);
    float c[W / 2], sn[W / 2];
#pragma unroll
    for (int p = 0; p < W / 2; ++p) {
      const float2 cs = row[p];
      c[p] = cs.x;
      sn[p] = kInverse ? -cs.y : cs.y;
    }
    Vec<T> x[kHeads];
#pragma unroll
    for (int k = 0; k < kHeads; ++k) {
      const int h = hg * kHeads + k;
      if (h < H) x[k] = load_vec_cs(inp + token * in_row + h * D + dv * W);
    }
#pragma unroll
    for (int k = 0; k < kHeads; ++k) {
      const int h = hg * kHeads + k;
      if (h >= H) continue;
      T* dst = out + token * out_row + h * D + dv * W;
      Vec<T> y;
      if (acc) y = load_vec(dst);
#pragma unroll
      for (int p = 0; p < W / 2; ++p) {
        const float a = x[k].get(2 * p), b = x[k].get(2 * p + 1);
        float r0 = a * c[p] - b * sn[p], r1 = a * sn[p] + b * c[p];
        if (!ok) r0 = r1 = __int_as_float(0x7fc00000);  // NaN: the position was out of range
        y.set(2 * p, acc ? y.get(2 * p) + r0 : r0);
        y.set(2 * p + 1, acc ? y.get(2 * p + 1) + r1 : r1);
      }
      store_vec(dst, y);
    }
  }
}

template <bool kInverse>
void launch(const char* op, DType dtype, void* out, const void* inp, const int32_t* positions,
            const void* table, int64_t B, int64_t T, int64_t H, int64_t D, int64_t in_row, int64_t out_row,
            int64_t max_pos, bool acc, cudaStream_t stream) {
  if (D % 8 != 0) throw RuntimeError(fmt::format("{}: head dim D={} must be a multiple of 8", op, D));
  if (in_row == 0) in_row = H * D;
  if (out_row == 0) out_row = H * D;
  if (in_row < H * D || out_row < H * D || in_row % 8 != 0 || out_row % 8 != 0)
    throw RuntimeError(fmt::format("{}: token row strides {} / {} must be multiples of 8 and at least H*D={}", op,
                                   in_row, out_row, H * D));
  const int64_t n = B * T * H * D;
  if (n == 0) return;
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, op, [&] {
    const int64_t items = B * T * ((H + kHeads - 1) / kHeads) * (D / Vec<scalar_t>::kSize);
    const int threads = 256;
    const int64_t cap = static_cast<int64_t>(sm_count()) * 32;
    const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((items + threads - 1) / threads, cap)));
    rope_kernel<scalar_t, kInverse><<<grid, threads, 0, stream>>>(
        static_cast<scalar_t*>(out), static_cast<const scalar_t*>(inp), positions,
        static_cast<const float2*>(table), items, static_cast<int>(T), static_cast<int>(H),
        static_cast<int>(D), in_row, out_row, static_cast<int>(max_pos), acc);
    CUDA_CHECK_LAST();
  });
}

}  // namespace

void rope_build_table(void* table, int64_t max_pos, int64_t D, const double* inv_freq, cudaStream_t stream) {
  if (D % 2 != 0 || max_pos <= 0)
    throw RuntimeError(fmt::format("rope_build_table: D={} must be even and max_pos={} positive", D, max_pos));
  if (D / 2 > kRopeMaxPairs)
    throw RuntimeError(fmt::format("rope_build_table: head dim D={} exceeds the {} supported", D, 2 * kRopeMaxPairs));
  InvFreq f{};
  for (int64_t i = 0; i < D / 2; ++i) f.v[i] = inv_freq[i];
  const int64_t n = max_pos * (D / 2);
  rope_table_kernel<<<ceil_div(n, 256), 256, 0, stream>>>(static_cast<float2*>(table), max_pos, D / 2, f);
  CUDA_CHECK_LAST();
}

void rope_forward(DType dtype, void* out, const void* inp, const int32_t* positions, const void* table,
                  int64_t B, int64_t T, int64_t H, int64_t D, int64_t max_pos, cudaStream_t stream, int64_t in_row,
                  int64_t out_row) {
  launch<false>("rope_forward", dtype, out, inp, positions, table, B, T, H, D, in_row, out_row, max_pos, false,
                stream);
}

void rope_backward(DType dtype, void* dinp, const void* dout, const int32_t* positions,
                   const void* table, int64_t B, int64_t T, int64_t H, int64_t D, int64_t max_pos,
                   bool accumulate, cudaStream_t stream, int64_t in_row, int64_t out_row) {
  launch<true>("rope_backward", dtype, dinp, dout, positions, table, B, T, H, D, in_row, out_row, max_pos,
               accumulate, stream);
}

}  // namespace primus::turbo::cuda
