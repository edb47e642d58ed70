// primus_attention_bench: times turbo::attention forward and backward on each device backend
// (CUDNN, TURBO with its default forward, TURBO_SM80 with the mma.sync forward) at the shapes of issue [attention], and cross-checks the two backends' results
// on the same inputs. One JSON object per (case, backend) goes to --out; torch_sdpa.py times
// PyTorch's SDPA on the same cases in the same device call, and merge_attention.py joins both
// into bench/results/attention.jsonl.
//
// Work count (the issue's convention): forward 4*B*H*T^2*D flops, halved when causal; backward
// 2.5x the forward. Times are the median of --iters runs, each between two CUDA events, after
// warm-up runs (turbo/bench's device timer, the one `primus benchmark attention` uses; that
// command is the everyday path, this binary the lab for kernel variants and cross-checks).
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "turbo/bench/bench_device.h"
#include "turbo/bench/fill.h"
#include "turbo/core/cuda_arena.h"
#include "turbo/core/cuda_check.h"
#include "turbo/dispatch/backend_manager.h"
#ifdef PRIMUS_TURBO_WITH_CUDNN
#include "turbo/kernels/cudnn/sdpa_cudnn.h"
#endif
#include "turbo/ops/attention.h"

using namespace primus;
using namespace primus::turbo;

namespace {

struct Case {
  std::string name;
  int64_t B, T, H, KVH, D;
  bool causal;
};

const std::vector<Case> kCases = {
    {"causal_d128_t2048", 8, 2048, 16, 16, 128, true},
    {"causal_d128_t8192", 2, 8192, 16, 16, 128, true},
    {"gpt2_causal_d64_t1024", 16, 1024, 12, 12, 64, true},
    {"gqa4_causal_d128_t4096", 4, 4096, 32, 8, 128, true},
};

double flops_fwd(const Case& c) {
  return 4.0 * c.B * c.H * static_cast<double>(c.T) * c.T * c.D * (c.causal ? 0.5 : 1.0);
}

std::vector<float> to_host(const TensorView& t) {
  std::vector<char> raw(t.nbytes());
  CUDA_CHECK(cudaMemcpy(raw.data(), t.data, raw.size(), cudaMemcpyDeviceToHost));
  std::vector<float> v(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = load_as_float(raw.data(), t.dtype, i);
  return v;
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    num += (a[i] - b[i]) * double(a[i] - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path = "attention_ours.jsonl", only, variants;  // variants: ",A,B," or all
  int iters = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    else if (a == "--only" && i + 1 < argc) only = argv[++i];
    else if (a == "--iters" && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (a == "--variants" && i + 1 < argc) variants = std::string(",") + argv[++i] + ",";
    else {
      std::fprintf(stderr,
                   "usage: primus_attention_bench [--out FILE] [--only SUBSTRING] [--iters N] [--variants A,B,...]\n");
      return 2;
    }
  }
  if (cuda_device_count_or_zero() == 0) {
    std::fprintf(stderr, "primus_attention_bench: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::ofstream out(out_path, std::ios::app);
#ifdef PRIMUS_TURBO_WITH_CUDNN
  const size_t cudnn_version = cudnn::cudnn_runtime_version();
#else
  const size_t cudnn_version = 0;
#endif
  const std::string meta = fmt::format(R"({{"meta":1,"device":"{}","cudnn":{}}})", prop.name, cudnn_version);
  out << meta << "\n";
  std::printf("%s\n", meta.c_str());

  std::string no_device;
  auto dev = bench::make_cuda_bench_device(size_t{3} << 30, &no_device);  // operands 3 GiB, scratch 2 GiB
  if (!dev) {
    std::fprintf(stderr, "primus_attention_bench: %s\n", no_device.c_str());
    return 1;
  }
  Arena* arena = &dev->arena();
  Arena* scratch = &dev->scratch();
  const DType dt = DType::BF16;
  for (const Case& c : kCases) {
    if (!only.empty() && c.name.find(only) == std::string::npos) continue;
    arena->reset();
    auto q = arena->tensor(dt, {c.B, c.T, c.H, c.D}), k = arena->tensor(dt, {c.B, c.T, c.KVH, c.D});
    auto v = arena->tensor(dt, {c.B, c.T, c.KVH, c.D}), dout = arena->tensor(dt, {c.B, c.T, c.H, c.D});
    bench::fill_uniform_device(q.data, dt, q.numel(), 1, 1.0f);
    bench::fill_uniform_device(k.data, dt, k.numel(), 2, 1.0f);
    bench::fill_uniform_device(v.data, dt, v.numel(), 3, 1.0f);
    bench::fill_uniform_device(dout.data, dt, dout.numel(), 4, 1.0f);
    std::vector<std::vector<float>> first;  // out, dq, dk, dv of the first backend, for the cross-check
    // TURBO runs its default kernels (on sm_90: the TMA warp-specialised wgmma forward and
    // backward); as "TURBO_SM90_PIPE" the cp.async-fed pipelined wgmma forward; as
    // "TURBO_SM90_SIMPLE" the wgmma forward without the softmax/GEMM overlap; as "TURBO_BWD_SM90"
    // the default forward and the wgmma backward whose threads all load; as "TURBO_SM80" the
    // mma.sync kernels both ways.
    struct Variant {
      const char* name;
      BackendType be;
      const char* kernel;
    };
    for (const Variant& var : {Variant{"CUDNN", BackendType::CUDNN, ""}, Variant{"TURBO", BackendType::TURBO, ""},
                               Variant{"TURBO_SM90_PIPE", BackendType::TURBO, "sm90pipe"},
                               Variant{"TURBO_SM90_SIMPLE", BackendType::TURBO, "sm90"},
                               Variant{"TURBO_BWD_SM90", BackendType::TURBO, "bwdsm90"},
                               Variant{"TURBO_SM80", BackendType::TURBO, "sm80"}}) {
      // A variant left out is skipped, except CUDNN, which still runs once (untimed, unreported)
      // as the cross-check reference of the others.
      const bool report = variants.empty() || variants.find(std::string(",") + var.name + ",") != std::string::npos;
      if (!report && var.be != BackendType::CUDNN) continue;
      const BackendType be = var.be;
      unsetenv("PRIMUS_TURBO_ATTN_KERNEL");
      unsetenv("PRIMUS_TURBO_ATTN_BWD_KERNEL");
      if (std::strcmp(var.kernel, "bwdsm90") == 0) setenv("PRIMUS_TURBO_ATTN_BWD_KERNEL", "sm90", 1);
      else if (*var.kernel) setenv("PRIMUS_TURBO_ATTN_KERNEL", var.kernel, 1);
      if (std::strcmp(var.kernel, "sm80") == 0) setenv("PRIMUS_TURBO_ATTN_BWD_KERNEL", "sm80", 1);
      auto o = arena->tensor(dt, {c.B, c.T, c.H, c.D}), lse = arena->tensor(DType::F32, {c.B, c.H, c.T});
      auto dq = arena->tensor(dt, {c.B, c.T, c.H, c.D}), dk = arena->tensor(dt, {c.B, c.T, c.KVH, c.D});
      auto dv = arena->tensor(dt, {c.B, c.T, c.KVH, c.D});
      GlobalBackendManager::instance().set_backend("attention", be);
      AttentionForwardArgs f;
      f.out = o, f.lse = lse, f.q = q, f.k = k, f.v = v;
      f.opt.causal = c.causal;
      f.ctx.scratch = scratch;
      AttentionBackwardArgs bw;
      bw.dq = dq, bw.dk = dk, bw.dv = dv, bw.dout = dout, bw.q = q, bw.k = k, bw.v = v, bw.out = o, bw.lse = lse;
      bw.opt = f.opt;
      bw.ctx = f.ctx;
      std::string line;
      try {
        if (!report) {
          attention_forward(f);
          attention_backward(bw);
          CUDA_CHECK(cudaDeviceSynchronize());
          first = {to_host(o), to_host(dq), to_host(dk), to_host(dv)};
          continue;
        }
        const double fwd = dev->time_ms([&] { attention_forward(f); }, iters);
        const double bwd = dev->time_ms([&] { attention_backward(bw); }, iters);
        CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<std::vector<float>> res{to_host(o), to_host(dq), to_host(dk), to_host(dv)};
        std::string xcheck = "null";
        if (!first.empty())
          xcheck = fmt::format(R"({{"out":{:.3g},"dq":{:.3g},"dk":{:.3g},"dv":{:.3g}}})", rel_l2(res[0], first[0]),
                               rel_l2(res[1], first[1]), rel_l2(res[2], first[2]), rel_l2(res[3], first[3]));
        else
          first = std::move(res);
        const double ff = flops_fwd(c);
        line = fmt::format(
            R"({{"case":"{}","backend":"{}","B":{},"T":{},"H":{},"KVH":{},"D":{},"causal":{},"fwd_ms":{:.4f},"bwd_ms":{:.4f},"fwd_tflops":{:.2f},"bwd_tflops":{:.2f},"xcheck_vs_first":{}}})",
            c.name, var.name, c.B, c.T, c.H, c.KVH, c.D, c.causal, fwd, bwd, ff / fwd / 1e9,
            2.5 * ff / bwd / 1e9, xcheck);
      } catch (const std::exception& e) {
        std::string msg = e.what();
        std::replace(msg.begin(), msg.end(), '"', '\'');
        std::replace(msg.begin(), msg.end(), '\n', ' ');
        line = fmt::format(R"({{"case":"{}","backend":"{}","error":"{}"}})", c.name, var.name, msg.substr(0, 2000));
        cudaGetLastError();
      }
      out << line << "\n";
      out.flush();
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    }
    GlobalBackendManager::instance().reset();
  }
  return 0;
}
