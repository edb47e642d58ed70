// grouped_gemm: the expert GEMMs of the MoE presets' layers (tokens = 4 x 2048, C = 2048), in
// TFLOP/s: fc [E, 2 Fe, C] (gate and up rows) and proj [E, C, Fe], each as forward, dgrad and
// wgrad (on the device also wgrad_bf16, the weight gradient written in bf16), for two routings of
// the 8192 tokens:
//   balanced  every expert gets T K / E rows;
//   router0   the counts of a softmax top-k router at initialisation (router_counts below): hidden
//             states N(0,1) normalised to unit RMS per row, router weight N(0, 0.02), a fixed seed
//             per preset. The skew of a real router at step 0.
// On the device the fc layers also time the forward with SwiGLU ("fwd_swiglu": act written by the
// product's epilogue where TURBO runs it, else the product then the activation) against the product
// then the activation kernel ("fwd_then_swiglu"), and the proj layers the input gradient through
// SwiGLU ("dgrad_swiglu": d(gate|up) from the epilogue) against the product then the activation's
// backward ("dgrad_then_swiglu"); their work is the product's FLOPs, so the rate says what the
// activation costs beside it.
// Groups are padded to kGroupedGemmAlign rows (the MoE row plan's padding) and the token buffers
// have moe_permuted_rows_max rows, as in training; the work counted is 2 x offsets[E] x N x K (the
// padded rows are multiplied too, by every backend).
// With PRIMUS_BENCH_GROUPED_GEMM_GROUPS=<file> every case appends its groups to that file as one
// JSON line {"case", "G", "M", "N", "K", "offsets"}: bench/ops/torch_grouped_mm.py times
// torch._grouped_mm on exactly those shapes and offsets, so the counts are generated here only.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <string_view>
#include <tuple>
#include <vector>

#include "core/util/error.h"
#include "turbo/bench/harness.h"
#include "turbo/kernels/cpu/matmul.h"
#include "turbo/ops/activation.h"
#include "turbo/ops/grouped_gemm.h"
#include "turbo/ops/grouped_gemm_fp8.h"
#include "turbo/ops/quantization.h"

#ifdef PRIMUS_TURBO_WITH_CUDA
#include <cuda_runtime_api.h>

#include "turbo/core/cuda_check.h"
#endif

namespace primus::turbo::bench {
namespace {

// Rows per expert of T tokens routed top-k over E experts by a randomly initialised softmax
// router (see the file comment). Deterministic for a seed (std::mt19937_64 and libstdc++'s
// normal distribution), and the same for every lane of a run.
std::vector<int64_t> router_counts(int64_t T, int64_t C, int64_t E, int64_t K, uint64_t seed) {
  static std::mutex mu;
  static std::map<std::tuple<int64_t, int64_t, int64_t, int64_t, uint64_t>, std::vector<int64_t>> cache;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(T, C, E, K, seed);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> unit(0.0f, 1.0f), router(0.0f, 0.02f);
  std::vector<float> w(static_cast<size_t>(E * C)), h(static_cast<size_t>(T * C)), logits(static_cast<size_t>(T * E));
  for (auto& x : w) x = router(rng);
  for (int64_t t = 0; t < T; ++t) {
    float* row = h.data() + t * C;
    double ss = 0.0;
    for (int64_t c = 0; c < C; ++c) row[c] = unit(rng), ss += static_cast<double>(row[c]) * row[c];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(C)));
    for (int64_t c = 0; c < C; ++c) row[c] *= inv;
  }
  cpu::matmul_forward<float>(logits.data(), h.data(), w.data(), nullptr, T, C, E);
  // Softmax keeps the order of the logits: the top-k of the probabilities is that of the logits
  // (ties to the lower expert, as the reference router).
  std::vector<int64_t> counts(static_cast<size_t>(E), 0);
  std::vector<int64_t> idx(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits.data() + t * E;
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + K, idx.end(),
                      [l](int64_t a, int64_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
    for (int64_t k = 0; k < K; ++k) ++counts[static_cast<size_t>(idx[static_cast<size_t>(k)])];
  }
  return cache.emplace(key, counts).first->second;
}

// offsets [E+1] of the counts padded to `align`.
std::vector<int32_t> padded_offsets(const std::vector<int64_t>& counts, int64_t align) {
  std::vector<int32_t> o(counts.size() + 1, 0);
  for (size_t g = 0; g < counts.size(); ++g) o[g + 1] = static_cast<int32_t>(o[g] + (counts[g] + align - 1) / align * align);
  return o;
}

void upload_i32(CaseEnv& e, const TensorView& t, const std::vector<int32_t>& v) {
  const size_t bytes = v.size() * sizeof(int32_t);
  if (!e.on_device()) {
    std::memcpy(t.data, v.data(), bytes);
    return;
  }
#ifdef PRIMUS_TURBO_WITH_CUDA
  CUDA_CHECK(cudaMemcpy(t.data, v.data(), bytes, cudaMemcpyHostToDevice));
#else
  throw RuntimeError("grouped_gemm benchmark: a device lane in a build without CUDA");
#endif
}

// The groups of one case, for the PyTorch side (see the file comment).
void export_groups(const std::string& name, int64_t G, int64_t M, int64_t N, int64_t K, const std::vector<int32_t>& o) {
  const char* path = std::getenv("PRIMUS_BENCH_GROUPED_GEMM_GROUPS");
  if (!path || !*path) return;
  std::FILE* f = std::fopen(path, "a");
  if (!f) throw RuntimeError(fmt::format("PRIMUS_BENCH_GROUPED_GEMM_GROUPS: cannot append to '{}'", path));
  std::fprintf(f, "{\"case\": \"grouped_gemm/%s\", \"G\": %lld, \"M\": %lld, \"N\": %lld, \"K\": %lld, \"offsets\": [",
               name.c_str(), static_cast<long long>(G), static_cast<long long>(M), static_cast<long long>(N),
               static_cast<long long>(K));
  for (size_t i = 0; i < o.size(); ++i) std::fprintf(f, "%s%d", i ? ", " : "", o[i]);
  std::fprintf(f, "]}\n");
  std::fclose(f);
}

enum class Glu { None, Fc, Proj };  // which SwiGLU pair a layer times on the device (file comment)

// One expert layer [E, N, K] over T tokens routed top-k, with the given rows per expert.
Case grouped_case(const std::string& name, int64_t T, int64_t E, int64_t topk, int64_t N, int64_t K,
                  std::vector<int64_t> counts, int64_t align, Glu glu = Glu::None) {
  return {name, [=](CaseEnv& e) {
            const std::vector<int32_t> o = padded_offsets(counts, align);
            const int64_t M = T * topk + E * (align - 1);  // moe_permuted_rows_max
            const int64_t used = o.back();
            export_groups(name, E, M, N, K, o);
            TensorView offsets = e.empty(DType::I32, {E + 1});
            upload_i32(e, offsets, o);
            TensorView x = e.rand(e.dtype, {M, K}), w = e.rand(e.dtype, {E, N, K}, 0.05f), dy = e.rand(e.dtype, {M, N});
            TensorView y = e.empty(e.dtype, {M, N}), dx = e.empty(e.dtype, {M, K}), dw = e.empty(DType::F32, {E, N, K});
            GroupedGemmForwardArgs f{y, x, w, offsets, align, e.ctx};
            GroupedGemmDgradArgs d{dx, dy, w, offsets, align, e.ctx};
            GroupedGemmWgradArgs g{dw, dy, x, offsets, align, false, e.ctx};
            const double flops = 2.0 * static_cast<double>(used) * static_cast<double>(N) * static_cast<double>(K);
            const std::string note = fmt::format("E={} top-{} [{}x{}] rows {} of {}", E, topk, N, K, used, M);
            std::vector<Timed> timed{
                {"grouped_gemm/" + name + "/fwd", Metric::Flops, flops, [f] { grouped_gemm_forward(f); }, note,
                 {{"out", y.slice0(0, used)}}},
                {"grouped_gemm/" + name + "/dgrad", Metric::Flops, flops, [d] { grouped_gemm_dgrad(d); }, "",
                 {{"dinp", dx.slice0(0, used)}}},
                {"grouped_gemm/" + name + "/wgrad", Metric::Flops, flops, [g] { grouped_gemm_wgrad(g); }, "",
                 {{"dweight", dw}}}};
            // The weight gradient written in bf16 (the trainer's moe_expert_grad_dtype: bf16), the
            // output torch._grouped_mm writes: on the device only (the host computes in f32).
            if (e.dtype == DType::BF16) {
              TensorView dwb = e.empty(DType::BF16, {E, N, K});
              GroupedGemmWgradArgs gb{dwb, dy, x, offsets, align, false, e.ctx};
              timed.push_back({"grouped_gemm/" + name + "/wgrad_bf16", Metric::Flops, flops, [gb] { grouped_gemm_wgrad(gb); },
                               "", {{"dweight", dwb}}});
            }
            const ExecContext ctx = e.ctx;
            if (e.dtype == DType::BF16 && glu == Glu::Fc && N % 2 == 0) {
              const int64_t F = N / 2;
              TensorView act = e.empty(DType::BF16, {M, F});
              GroupedGemmForwardArgs fs = f;
              fs.swiglu_out = act;
              const auto then = [f, act, y, ctx] {
                grouped_gemm_forward(f);
                activation_forward({Activation::SwiGLU, act, y, ctx});
              };
              // The lane's backend is set before the case is built: asked once, not in the timed loop.
              std::function<void()> fused = then;
              if (grouped_gemm_swiglu_available(Device::CUDA, F)) fused = [fs] { grouped_gemm_forward(fs); };
              timed.push_back({"grouped_gemm/" + name + "/fwd_swiglu", Metric::Flops, flops, fused, "",
                               {{"act", act.slice0(0, used)}}});
              timed.push_back({"grouped_gemm/" + name + "/fwd_then_swiglu", Metric::Flops, flops, then, "",
                               {{"act", act.slice0(0, used)}}});
            }
            if (e.dtype == DType::BF16 && glu == Glu::Proj) {
              TensorView h = e.rand(DType::BF16, {M, 2 * K}), dh = e.empty(DType::BF16, {M, 2 * K});
              GroupedGemmDgradArgs ds{dh, dy, w, offsets, align, ctx, h};
              const auto then = [d, dh, h, dx, ctx] {
                grouped_gemm_dgrad(d);
                activation_backward({Activation::SwiGLU, dh, h, dx, false, ctx});
              };
              std::function<void()> fused = then;
              if (grouped_gemm_swiglu_available(Device::CUDA, K)) fused = [ds] { grouped_gemm_dgrad(ds); };
              timed.push_back({"grouped_gemm/" + name + "/dgrad_swiglu", Metric::Flops, flops, fused, "",
                               {{"dgate_up", dh.slice0(0, used)}}});
              timed.push_back({"grouped_gemm/" + name + "/dgrad_then_swiglu", Metric::Flops, flops, then, "",
                               {{"dgate_up", dh.slice0(0, used)}}});
            }
            return timed;
          }};
}

struct MoePreset {
  const char* name;
  int64_t E, topk, Fe;
};

// The FP8 form of one expert layer (rowwise, hybrid: x and W E4M3, dy E5M2): the three FP8 GEMMs
// on operands quantized beforehand ("fp8/..."), the same products from bf16 operands with their
// quantization ("fp8q/...", what training runs), and each quantization alone ("quant/...", GB/s
// of bf16 read plus FP8 written).
Case grouped_fp8_case(const std::string& name, int64_t T, int64_t E, int64_t topk, int64_t N, int64_t K,
                      std::vector<int64_t> counts, int64_t align) {
  return {name, [=](CaseEnv& e) {
            const std::vector<int32_t> o = padded_offsets(counts, align);
            const int64_t M = (T * topk + E * (align - 1) + 15) / 16 * 16;
            const int64_t used = o.back();
            TensorView off = e.empty(DType::I32, {E + 1});
            upload_i32(e, off, o);
            const DType act = e.on_device() ? DType::BF16 : DType::F32, f8 = DType::F8E4M3, f5 = DType::F8E5M2;
            TensorView x = e.rand(act, {M, K}), w = e.rand(act, {E, N, K}, 0.05f), dy = e.rand(act, {M, N});
            TensorView y = e.empty(act, {M, N}), dx = e.empty(act, {M, K}), dw = e.empty(DType::F32, {E, N, K});
            // Quantized operands, made once here.
            TensorView qx = e.empty(f8, {M, K}), sx = e.empty(DType::F32, {M}), qw = e.empty(f8, {E, N, K}),
                       sw = e.empty(DType::F32, {E, N}), qwt = e.empty(f8, {K, E * N}), swt = e.empty(DType::F32, {E, K}),
                       qdy = e.empty(f5, {M, N}), sdy = e.empty(DType::F32, {M}), qdyt = e.empty(f5, {N, M}),
                       sdyt = e.empty(DType::F32, {E, N}), qxt = e.empty(f8, {K, M}), sxt = e.empty(DType::F32, {E, K});
            auto rows = [&](TensorView in, TensorView q, TensorView sc) {
              QuantizeFp8Args a;
              a.inp = in, a.out = q, a.scale_inv = sc, a.granularity = Fp8Granularity::Row, a.ctx = e.ctx;
              return a;
            };
            auto groups_t = [&](TensorView in, TensorView q, TensorView sc, TensorView offsets, int64_t group_rows) {
              QuantizeFp8Args a;
              a.inp = in, a.out_t = q, a.scale_inv_t = sc, a.granularity = Fp8Granularity::Row, a.ctx = e.ctx;
              a.offsets = offsets, a.group_rows = group_rows;
              return a;
            };
            const QuantizeFp8Args qa_x = rows(x, qx, sx), qa_w = rows(w.reshape({E * N, K}), qw.reshape({E * N, K}), sw),
                                  qa_wt = groups_t(w.reshape({E * N, K}), qwt, swt, {}, N), qa_dy = rows(dy, qdy, sdy),
                                  qa_dyt = groups_t(dy, qdyt, sdyt, off, 0), qa_xt = groups_t(x, qxt, sxt, off, 0);
            for (const QuantizeFp8Args* a : {&qa_x, &qa_w, &qa_wt, &qa_dy, &qa_dyt, &qa_xt}) quantize_fp8(*a);
            GroupedGemmFp8ForwardArgs f{y, qx, sx, qw, sw, off, e.ctx};
            GroupedGemmFp8DgradArgs d{dx, qdy, sdy, qwt, swt, off, e.ctx};
            GroupedGemmFp8WgradArgs g{dw, qdyt, sdyt, qxt, sxt, off, align, false, e.ctx};
            GroupedGemmForwardArgs bf{y, x, w, off, align, e.ctx};
            GroupedGemmDgradArgs bd{dx, dy, w, off, align, e.ctx};
            GroupedGemmWgradArgs bg{dw, dy, x, off, align, false, e.ctx};
            const double flops = 2.0 * static_cast<double>(used) * static_cast<double>(N) * static_cast<double>(K);
            const double tok_x = 3.0 * static_cast<double>(M * K), tok_dy = 3.0 * static_cast<double>(M * N),
                         wb = 3.0 * static_cast<double>(E * N * K);
            const std::string p = "grouped_gemm_fp8/" + name;
            const std::string note = fmt::format("E={} top-{} [{}x{}] rows {} of {}", E, topk, N, K, used, M);
            return std::vector<Timed>{
                {p + "/fp8/fwd", Metric::Flops, flops, [f] { grouped_gemm_fp8_forward(f); }, note},
                {p + "/fp8/dgrad", Metric::Flops, flops, [d] { grouped_gemm_fp8_dgrad(d); }, ""},
                {p + "/fp8/wgrad", Metric::Flops, flops, [g] { grouped_gemm_fp8_wgrad(g); }, ""},
                {p + "/fp8q/fwd", Metric::Flops, flops, [bf, f8] { grouped_gemm_forward_fp8(bf, f8); }, ""},
                {p + "/fp8q/dgrad", Metric::Flops, flops, [bd, f8, f5] { grouped_gemm_dgrad_fp8(bd, f8, f5); }, ""},
                {p + "/fp8q/wgrad", Metric::Flops, flops, [bg, f8, f5] { grouped_gemm_wgrad_fp8(bg, f8, f5); }, ""},
                {p + "/quant/x_rows", Metric::Bytes, tok_x, [qa_x] { quantize_fp8(qa_x); }, ""},
                {p + "/quant/x_t_groups", Metric::Bytes, tok_x, [qa_xt] { quantize_fp8(qa_xt); }, ""},
                {p + "/quant/dy_rows", Metric::Bytes, tok_dy, [qa_dy] { quantize_fp8(qa_dy); }, ""},
                {p + "/quant/dy_t_groups", Metric::Bytes, tok_dy, [qa_dyt] { quantize_fp8(qa_dyt); }, ""},
                {p + "/quant/w_rows", Metric::Bytes, wb, [qa_w] { quantize_fp8(qa_w); }, ""},
                {p + "/quant/w_t_groups", Metric::Bytes, wb, [qa_wt] { quantize_fp8(qa_wt); }, ""}};
          }};
}

// Blockwise FP8 (DeepSeek-V3: E4M3 throughout, 1x128 token tiles, 128 x 128 weight blocks) of one
// expert layer: the products on copies quantized beforehand ("fp8b/...") and from bf16 operands
// with their quantization ("fp8bq/...", what training runs); groups padded to 128 rows, as the
// model pads them for blockwise experts.
Case grouped_fp8_block_case(const std::string& name, int64_t T, int64_t E, int64_t topk, int64_t N, int64_t K,
                            std::vector<int64_t> counts) {
  return {name + "/block", [=](CaseEnv& e) {
            constexpr int64_t align = 128;
            const std::vector<int32_t> o = padded_offsets(counts, align);
            const int64_t M = (T * topk + E * (align - 1) + align - 1) / align * align;
            const int64_t used = o.back();
            TensorView off = e.empty(DType::I32, {E + 1});
            upload_i32(e, off, o);
            const DType act = e.on_device() ? DType::BF16 : DType::F32, f8 = DType::F8E4M3, f5 = f8;  // e4m3 throughout
            TensorView x = e.rand(act, {M, K}), w = e.rand(act, {E, N, K}, 0.05f), dy = e.rand(act, {M, N});
            TensorView y = e.empty(act, {M, N}), dx = e.empty(act, {M, K}), dw = e.empty(DType::F32, {E, N, K});
            GroupedGemmForwardArgs bf{y, x, w, off, align, e.ctx};
            GroupedGemmDgradArgs bd{dx, dy, w, off, align, e.ctx};
            GroupedGemmWgradArgs bg{dw, dy, x, off, align, false, e.ctx};
            const auto blk = GroupedFp8Scaling::Block;
            // The products alone ("fp8b/..."), on copies quantized here once.
            using FG = Fp8Granularity;
            const auto copy = [&](TensorView in, int64_t R, int64_t C, FG g, bool transposed) {
              std::pair<TensorView, TensorView> q{transposed ? e.empty(f8, {C, R}) : e.empty(f8, {R, C}),
                                                  e.empty(DType::F32, {fp8_scale_numel(g, transposed ? C : R, transposed ? R : C)})};
              QuantizeFp8Args a;
              a.inp = in.reshape({R, C}), a.granularity = g, a.ctx = e.ctx;
              (transposed ? a.out_t : a.out) = q.first;
              (transposed ? a.scale_inv_t : a.scale_inv) = q.second;
              quantize_fp8(a);
              return q;
            };
            const auto [qx, sx] = copy(x, M, K, FG::Block1x128, false);
            const auto [qw, sw] = copy(w, E * N, K, FG::Block128x128, false);
            const auto [qwt, swt] = copy(w, E * N, K, FG::Block128x128, true);
            const auto [qdy, sdy] = copy(dy, M, N, FG::Block1x128, false);
            const auto [qdyt, sdyt] = copy(dy, M, N, FG::Block1x128, true);
            const auto [qxt, sxt] = copy(x, M, K, FG::Block1x128, true);
            GroupedGemmFp8ForwardArgs f{y, qx, sx, qw.reshape({E, N, K}), sw, off, e.ctx, blk};
            GroupedGemmFp8DgradArgs d{dx, qdy, sdy, qwt, swt, off, e.ctx, blk};
            GroupedGemmFp8WgradArgs g{dw, qdyt, sdyt, qxt, sxt, off, align, false, e.ctx, blk};
            const double flops = 2.0 * static_cast<double>(used) * static_cast<double>(N) * static_cast<double>(K);
            const std::string p = "grouped_gemm_fp8/" + name;
            const std::string note = fmt::format("E={} top-{} [{}x{}] rows {} of {} (groups padded to 128)", E, topk, N, K, used, M);
            return std::vector<Timed>{
                {p + "/fp8b/fwd", Metric::Flops, flops, [f] { grouped_gemm_fp8_forward(f); }, note},
                {p + "/fp8b/dgrad", Metric::Flops, flops, [d] { grouped_gemm_fp8_dgrad(d); }, ""},
                {p + "/fp8b/wgrad", Metric::Flops, flops, [g] { grouped_gemm_fp8_wgrad(g); }, ""},
                {p + "/fp8bq/fwd", Metric::Flops, flops, [bf, f8, blk] { grouped_gemm_forward_fp8(bf, f8, blk); }, ""},
                {p + "/fp8bq/dgrad", Metric::Flops, flops, [bd, f8, f5, blk] { grouped_gemm_dgrad_fp8(bd, f8, f5, blk); }, ""},
                {p + "/fp8bq/wgrad", Metric::Flops, flops, [bg, f8, f5, blk] { grouped_gemm_wgrad_fp8(bg, f8, f5, blk); },
                 ""}};
          }};
}

}  // namespace

OpFamily grouped_gemm_fp8_family() {
  OpFamily f;
  f.name = "grouped_gemm_fp8";
  f.bench = "grouped_gemm";
  f.dispatch_ops = {"grouped_gemm_fp8", "quantize"};
  f.backends = {BackendType::TURBO, BackendType::CPU};
  f.shape_syntax = "TxExKxNxC[/block] (tokens x experts x top-k x out features x in features): one expert layer "
                   "[E, N, C] under a random-init router's counts, rowwise FP8, or blockwise with '/block' (groups "
                   "padded to 128 rows; N and C multiples of 128). Ex1x1 is a dense linear layer's three GEMMs";
  f.defaults = [](const Scale& s) {
    std::vector<Case> cases;
    const int64_t align = kGroupedGemmAlign;
    if (!s.gpu) {
      const int64_t T = s.tokens, C = 64, E = 4, topk = 2, Fe = 96;
      const auto counts = router_counts(T, C, E, topk, 7);
      cases.push_back(grouped_fp8_case("tiny/fc/router0", T, E, topk, 2 * Fe, C, counts, 16));
      cases.push_back(grouped_fp8_block_case("tiny128/fc/router0", T, E, topk, 256, 128, router_counts(T, 128, E, topk, 7)));
      return cases;
    }
    static const MoePreset kPresets[] = {{"olmoe", 64, 8, 1024}, {"mixtral", 8, 2, 5632}, {"deepseek", 64, 6, 1408}};
    const int64_t T = 4 * 2048, C = 2048;
    for (const MoePreset& p : kPresets) {
      const std::vector<int64_t> router0 = router_counts(T, C, p.E, p.topk, 1000 + static_cast<uint64_t>(p.E * 16 + p.topk));
      cases.push_back(grouped_fp8_case(fmt::format("{}/fc/router0", p.name), T, p.E, p.topk, 2 * p.Fe, C, router0, align));
      cases.push_back(grouped_fp8_case(fmt::format("{}/proj/router0", p.name), T, p.E, p.topk, C, p.Fe, router0, align));
      cases.push_back(grouped_fp8_block_case(fmt::format("{}/fc/router0", p.name), T, p.E, p.topk, 2 * p.Fe, C, router0));
      cases.push_back(grouped_fp8_block_case(fmt::format("{}/proj/router0", p.name), T, p.E, p.topk, C, p.Fe, router0));
    }
    return cases;
  };
  f.from_shape = [syntax = f.shape_syntax](const std::string& shape) {
    constexpr std::string_view kBlock = "/block";
    const bool block = shape.size() > kBlock.size() && shape.compare(shape.size() - kBlock.size(), kBlock.size(), kBlock) == 0;
    const std::string dims = block ? shape.substr(0, shape.size() - kBlock.size()) : shape;
    const auto d = parse_dims("grouped_gemm_fp8", dims, 5, syntax);
    const int64_t T = d[0], E = d[1], topk = d[2], N = d[3], C = d[4];
    if (topk > E) throw UsageError(fmt::format("grouped_gemm_fp8 shape '{}': top-k {} above {} experts", shape, topk, E));
    if (block && (N % kFp8BlockSize != 0 || C % kFp8BlockSize != 0))
      throw UsageError(fmt::format("grouped_gemm_fp8 shape '{}': blockwise needs N and C multiples of {}", shape, kFp8BlockSize));
    const std::vector<int64_t> counts = router_counts(T, C, E, topk, 1000 + static_cast<uint64_t>(E * 16 + topk));
    if (block) return grouped_fp8_block_case(dims, T, E, topk, N, C, counts);
    return grouped_fp8_case(shape, T, E, topk, N, C, counts, kGroupedGemmAlign);
  };
  return f;
}

OpFamily grouped_gemm_family() {
  OpFamily f;
  f.name = "grouped_gemm";
  f.bench = "grouped_gemm";
  f.dispatch_ops = {"grouped_gemm"};
  f.backends = {BackendType::TURBO, BackendType::CUBLASLT, BackendType::CPU};
  f.compare = {{BackendType::TURBO, BackendType::CUBLASLT}};
  f.shape_syntax =
      "TxExKxNxC[xA] (tokens x experts x top-k x out features x in features [x group alignment]): one expert "
      "layer [E, N, C] under a random-init router's counts";
  f.defaults = [](const Scale& s) {
    std::vector<Case> cases;
    const int64_t align = kGroupedGemmAlign;
    if (!s.gpu) {  // a small host version: the reference's own speed
      const int64_t T = s.tokens, C = 64, E = 4, topk = 2, Fe = 96;
      const auto counts = router_counts(T, C, E, topk, 7);
      cases.push_back(grouped_case("tiny/fc/router0", T, E, topk, 2 * Fe, C, counts, 8));
      cases.push_back(grouped_case("tiny/proj/router0", T, E, topk, C, Fe, counts, 8));
      return cases;
    }
    static const MoePreset kPresets[] = {{"olmoe", 64, 8, 1024}, {"mixtral", 8, 2, 5632}, {"deepseek", 64, 6, 1408}};
    const int64_t T = 4 * 2048, C = 2048;
    for (const MoePreset& p : kPresets) {
      const std::vector<int64_t> balanced(static_cast<size_t>(p.E), T * p.topk / p.E);
      const std::vector<int64_t> router0 = router_counts(T, C, p.E, p.topk, 1000 + static_cast<uint64_t>(p.E * 16 + p.topk));
      for (const auto& [routing, counts] : {std::pair{"balanced", balanced}, std::pair{"router0", router0}}) {
        cases.push_back(
            grouped_case(fmt::format("{}/fc/{}", p.name, routing), T, p.E, p.topk, 2 * p.Fe, C, counts, align, Glu::Fc));
        cases.push_back(
            grouped_case(fmt::format("{}/proj/{}", p.name, routing), T, p.E, p.topk, C, p.Fe, counts, align, Glu::Proj));
      }
    }
    // The wgrad's cut of a group's last k-tile: olmoe's fc under the router at alignment 16.
    cases.push_back(grouped_case("olmoe/fc/router0_align16", T, 64, 8, 2048, C,
                                 router_counts(T, C, 64, 8, 1000 + 64 * 16 + 8), 16));
    return cases;
  };
  f.from_shape = [syntax = f.shape_syntax](const std::string& shape) {
    const size_t n = static_cast<size_t>(std::count(shape.begin(), shape.end(), 'x')) + 1;
    if (n != 5 && n != 6)
      throw UsageError(fmt::format("grouped_gemm shape '{}': expected {}", shape, syntax));
    const auto d = parse_dims("grouped_gemm", shape, n, syntax);
    const int64_t T = d[0], E = d[1], topk = d[2], N = d[3], C = d[4], align = n == 6 ? d[5] : kGroupedGemmAlign;
    if (topk > E) throw UsageError(fmt::format("grouped_gemm shape '{}': top-k {} above {} experts", shape, topk, E));
    return grouped_case(shape, T, E, topk, N, C, router_counts(T, C, E, topk, 1000 + static_cast<uint64_t>(E * 16 + topk)),
                        align);
  };
  return f;
}

}  // namespace primus::turbo::bench
