// attention: flash attention forward and backward at the shapes of issue [attention], in TFLOP/s
// counted as 4*B*H*T^2*D for the forward (halved when causal) and 2.5x that for the backward.
// Every backend and kernel variant of a run sees the same inputs, so out, dq, dk and dv are
// cross-checked against the first backend's (CUDNN on a GPU).
#include <fmt/format.h>

#include <algorithm>
#include <initializer_list>

#include "core/util/error.h"
#include "turbo/bench/harness.h"
#include "turbo/ops/attention.h"

namespace primus::turbo::bench {
namespace {

// Heads [first, first + n) of a packed [B, T, width] tensor as a [B, T, n, D] view (the layout
// the models' one q|k|v GEMM writes and its backward reads).
TensorView heads_of(const TensorView& packed, int64_t first, int64_t n, int64_t D) {
  const int64_t B = packed.size(0), T = packed.size(1), width = packed.size(2);
  TensorView v = packed;
  v.data = static_cast<char*>(packed.data) + first * D * static_cast<int64_t>(dtype_size(packed.dtype));
  v.ndim = 4;
  v.shape = {B, T, n, D};
  v.strides = {T * width, width, D, 1};
  return v;
}

// packed: q, k, v (and dq, dk, dv) are column slices of one [B, T, (H + 2 KVH) D] tensor, as
// in training; else each is its own dense tensor.
// pad_mib: that many MiB of the arena left unused before the case's tensors, so one process can
// time the same product at other addresses (bench/attention/env_ab.sh's process-mode runs).
// window: AttentionOptions::window (causal; 0 none). The work counted is then the keys each query
// really sees, sum_t min(t + 1, window), so the rate stays comparable with the full causal case.
Case attention_case(const std::string& name, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D, bool causal,
                    bool packed = false, int64_t pad_mib = 0, int64_t window = 0) {
  return {name, [=](CaseEnv& e) {
            if (pad_mib > 0) e.empty(DType::F32, {pad_mib, 262144});
            // q, k, v (random) and dq, dk, dv (written): views of one packed tensor each, or dense.
            auto three = [&](bool random, TensorView& q, TensorView& k, TensorView& v) {
              auto make = [&](std::initializer_list<int64_t> shape) {
                return random ? e.rand(e.dtype, shape) : e.empty(e.dtype, shape);
              };
              if (packed) {
                const TensorView all = make({B, T, (H + 2 * KVH) * D});
                q = heads_of(all, 0, H, D), k = heads_of(all, H, KVH, D), v = heads_of(all, H + KVH, KVH, D);
              } else {
                q = make({B, T, H, D}), k = make({B, T, KVH, D}), v = make({B, T, KVH, D});
              }
            };
            AttentionForwardArgs f;
            three(true, f.q, f.k, f.v);
            f.out = e.empty(e.dtype, {B, T, H, D});
            f.lse = e.empty(DType::F32, {B, H, T});
            f.opt.causal = causal;
            f.opt.window = window;
            f.ctx = e.ctx;
            AttentionBackwardArgs bw;
            three(false, bw.dq, bw.dk, bw.dv);
            bw.dout = e.rand(e.dtype, {B, T, H, D});
            bw.q = f.q, bw.k = f.k, bw.v = f.v, bw.out = f.out, bw.lse = f.lse;
            bw.opt = f.opt;
            bw.ctx = f.ctx;
            attention_forward(f);  // the output and log-sum-exp the backward reads
            const double W = static_cast<double>(std::min(window, T)), Td = static_cast<double>(T);
            const double pairs = window > 0 ? W * (W + 1) / 2 + (Td - W) * W : Td * Td * (causal ? 0.5 : 1.0);
            const double fwd = 4.0 * static_cast<double>(B * H) * pairs * static_cast<double>(D);
            const std::string note =
                fmt::format("B={} T={} H={} KVH={} D={}{}{}{}", B, T, H, KVH, D, causal ? " causal" : "", packed ? " packed" : "",
                            window > 0 ? fmt::format(" window={}", window) : "");
            return std::vector<Timed>{
                {name + "/fwd", Metric::Flops, fwd, [f] { attention_forward(f); }, note, {{"out", f.out}}},
                {name + "/bwd", Metric::Flops, 2.5 * fwd, [bw] { attention_backward(bw); }, "",
                 {{"dq", bw.dq}, {"dk", bw.dk}, {"dv", bw.dv}}}};
          }};
}

}  // namespace

OpFamily attention_family() {
  OpFamily f;
  f.name = "attention";
  f.bench = "attention";
  f.dispatch_ops = {"attention"};
  f.backends = {BackendType::CUDNN, BackendType::TURBO, BackendType::CPU};
  // TURBO's other kernels (docs/attention.md, "TURBO kernels"); its default on compute capability
  // 9.0 is the warp-specialised pair (sm90ws), elsewhere sm80.
  f.variants = {{"TURBO_SM90_PIPE", BackendType::TURBO, {{"PRIMUS_TURBO_ATTN_KERNEL", "sm90pipe"}}},
                {"TURBO_SM90_SIMPLE", BackendType::TURBO, {{"PRIMUS_TURBO_ATTN_KERNEL", "sm90"}}},
                {"TURBO_BWD_SM90", BackendType::TURBO, {{"PRIMUS_TURBO_ATTN_BWD_KERNEL", "sm90"}}},
                {"TURBO_SM80", BackendType::TURBO,
                 {{"PRIMUS_TURBO_ATTN_KERNEL", "sm80"}, {"PRIMUS_TURBO_ATTN_BWD_KERNEL", "sm80"}}}};
  f.shape_syntax =
      "BxTxHxKVHxD[:full][:packed][:padN][:windowW] (batch x sequence x heads x kv heads x head dim; causal unless "
      ":full; packed: q, k, v and their gradients as column slices of one [B, T, (H + 2 KVH) D] tensor, as the models "
      "run it; padN: the tensors placed N MiB further into the device arena; windowW: a causal sliding window of W "
      "keys, FLOPs counted over the keys each query sees)";
  f.defaults = [](const Scale& s) {
    if (!s.gpu) return std::vector<Case>{attention_case("small_causal_d64_t256", 1, 256, 4, 4, 64, true)};
    // The names are bench/attention/torch_sdpa.py's, so both sides of a run join.
    return std::vector<Case>{attention_case("causal_d128_t2048", 8, 2048, 16, 16, 128, true),
                             attention_case("causal_d128_t8192", 2, 8192, 16, 16, 128, true),
                             attention_case("gpt2_causal_d64_t1024", 16, 1024, 12, 12, 64, true),
                             attention_case("gqa4_causal_d128_t4096", 4, 4096, 32, 8, 128, true)};
  };
  f.from_shape = [syntax = f.shape_syntax](const std::string& shape) {
    const size_t colon = shape.find(':');
    const std::string dims = shape.substr(0, colon);
    bool causal = true, packed = false;
    int64_t pad_mib = 0, window = 0;
    for (size_t at = colon; at != std::string::npos;) {
      const size_t next = shape.find(':', at + 1);
      const std::string mode = shape.substr(at + 1, next == std::string::npos ? std::string::npos : next - at - 1);
      if (mode == "full") causal = false;
      else if (mode == "causal") causal = true;
      else if (mode == "packed") packed = true;
      else if (mode.rfind("pad", 0) == 0 && mode.size() > 3 && mode.size() < 9 &&
               mode.find_first_not_of("0123456789", 3) == std::string::npos)
        pad_mib = std::stoll(mode.substr(3));
      else if (mode.rfind("window", 0) == 0 && mode.size() > 6 && mode.size() < 16 &&
               mode.find_first_not_of("0123456789", 6) == std::string::npos)
        window = std::stoll(mode.substr(6));
      else throw UsageError(fmt::format("attention: shape '{}': unknown mode '{}' (expected {})", shape, mode, syntax));
      at = next;
    }
    const auto d = parse_dims("attention", dims, 5, syntax);
    if (d[2] % d[3] != 0)
      throw UsageError(fmt::format("attention: shape '{}': {} heads is not a multiple of {} kv heads", shape, d[2], d[3]));
    if (window > 0 && !causal)
      throw UsageError(fmt::format("attention: shape '{}': a sliding window is causal (drop :full)", shape));
    return attention_case("attention/" + dims + (causal ? "" : "_full") + (packed ? "_packed" : "") +
                              (pad_mib > 0 ? "_pad" + std::to_string(pad_mib) : "") +
                              (window > 0 ? "_window" + std::to_string(window) : ""),
                          d[0], d[1], d[2], d[3], d[4], causal, packed, pad_mib, window);
  };
  return f;
}

}  // namespace primus::turbo::bench
