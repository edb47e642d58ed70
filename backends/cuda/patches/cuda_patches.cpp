// The CUDA backend's patches: the shared args patches (train/common_patches.cpp) under cuda.*
// ids, the MFU peak from the GPU model, and the fallback attention.
#include <spdlog/spdlog.h>

#include "backends/cuda/args.h"
#include "backends/cuda/attention_fallback.h"
#include "backends/cuda/device.h"
#include "backends/cuda/hooks.h"
#include "backends/cuda/register.h"
#include "core/patches/context.h"
#include "train/common_patches.h"

namespace primus::backends::cuda {

void register_patches(patches::PatchRegistry& reg) {
  train::register_common_args_patches(reg, kName);

  patches::Patch peak;
  peak.id = "cuda.runtime.peak_flops";
  peak.backend = kName;
  peak.phase = patches::Phase::BuildArgs;
  peak.description = "fills the MFU denominator (dense bf16 FLOP/s per GPU) from the GPU model when peak_flops is 0";
  peak.logic = "rewrites args: peak_flops = A100 312e12 | H100 SXM, H200, GH200 989e12 | H100 PCIe 756e12 | B200 2.25e15";
  peak.impl = "backends/cuda/device.cpp (peak_bf16_flops)";
  peak.porting = "MFU = model FLOPs per token (6N + attention) x tokens/s / this peak, as in the PaLM paper";
  peak.tags = {"runtime", "metrics"};
  peak.condition = [](patches::PatchContext& c) { return c.number("peak_flops") <= 0; };
  peak.apply = [](patches::PatchContext& c) {
    auto& a = c.args_as<CudaArgs>();
    a.peak_flops = peak_bf16_flops(a.device_name);
    if (a.peak_flops <= 0) {
      spdlog::warn("[cuda] no bf16 peak known for '{}': MFU is not reported (set peak_flops)", a.device_name);
    }
  };
  reg.add(peak);

  patches::Patch attn;
  attn.id = "cuda.attention.fallback";
  attn.backend = kName;
  attn.phase = patches::Phase::BuildArgs;
  attn.description = "runs attention as batched cuBLASLt GEMMs + a causal softmax kernel ([T,T] scores in scratch)";
  attn.slots = {kAttentionForward, kAttentionBackward};
  attn.impl = "backends/cuda/attention_fallback.cpp, backends/cuda/kernels/attention_fallback.cu";
  attn.porting = "llm.c's non-cuDNN attention: permute to head-major, S = QK^T, softmax, O = PV; the backward "
                 "recomputes P from the saved log-sum-exp";
  attn.tags = {"attention", "debug"};
  attn.condition = [](patches::PatchContext& c) { return c.text("attention_backend") == "fallback"; };
  attn.apply = [](patches::PatchContext& c) {
    c.replace<AttentionForwardFn>(kAttentionForward, fallback_attention_forward);
    c.replace<AttentionBackwardFn>(kAttentionBackward, fallback_attention_backward);
  };
  reg.add(attn);
  register_step_patches(reg);
}

}  // namespace primus::backends::cuda
