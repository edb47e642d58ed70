// Delayed FP8 scaling (Transformer Engine's DelayedScaling, Megatron's --fp8-recipe delayed): each
// FP8 tensor of a linear layer (its input x, its weight w, its output gradient dy) is quantized
// with a scale taken from the amaxes of earlier steps instead of its own, so the quantization is
// one pass over the data (no amax pass first), and this step's amax is recorded for later steps.
//
// Per tensor t: a history of `history_len` amaxes (entry 0 is the one being recorded: every
// quantization of t this step folds its max |x| in) and a scale. Once per optimizer step,
// fp8_delayed_update turns the history into the next scale (fp8_max / amax, amax the largest
// entry or the newest, divided by 2^margin) and moves it one entry along. A step whose amax is
// not finite (an inf or NaN, a step training skips) leaves no entry. Until one step has been
// recorded there is no scale: those steps run current scaling (the tensor's own amax) and record.
//
// Fp8DelayedScaling holds the tensors' registry and host switches; the memory (history, scales,
// the formats' largest values) belongs to the caller, e.g. a model's state arena, so the state
// lives on the device with everything else, is captured in a CUDA graph and goes into checkpoints.
// The linear layers find their three tensors by the address of their weight (turbo/ops/gemm_fp8.h).
#pragma once
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "turbo/core/tensor_view.h"
#include "turbo/dispatch/backend_type.h"
#include "turbo/ops/exec_context.h"

namespace primus::turbo {

// How the amax is taken from a history (Megatron's --fp8-amax-compute-algo).
enum class Fp8AmaxAlgo : uint8_t { MostRecent, Max };
const char* fp8_amax_algo_name(Fp8AmaxAlgo a);  // "most_recent" | "max"

// The longest history (the device update stages a history row in shared memory) and the largest margin.
inline constexpr int64_t kFp8MaxAmaxHistory = 8192;
inline constexpr int kFp8MaxMargin = 64;

struct Fp8DelayedOptions {
  int64_t history_len = 1;                      // Megatron's default (--fp8-amax-history-len)
  Fp8AmaxAlgo algo = Fp8AmaxAlgo::MostRecent;   // Megatron's default
  int margin = 0;                               // scale = fp8_max / amax / 2^margin
  DType fwd = DType::F8E4M3;                    // the formats of x and w, and of dy (Fp8Recipe)
  DType grad = DType::F8E5M2;
};

class Fp8DelayedScaling {
 public:
  enum Role : int { kInput = 0, kWeight = 1, kGrad = 2 };
  static constexpr int kRoles = 3;

  explicit Fp8DelayedScaling(Fp8DelayedOptions o);
  const Fp8DelayedOptions& options() const { return opt_; }

  // Registers a linear layer by its weight's data pointer (three tensors: x, w, dy). Before bind().
  void add_layer(const void* weight, std::string name);
  // Forgets the layers and the memory (a model that is rebuilt registers its layers again).
  void clear();
  int64_t layers() const { return static_cast<int64_t>(names_.size()); }
  int64_t tensors() const { return kRoles * layers(); }
  const std::string& layer_name(int64_t i) const { return names_[static_cast<size_t>(i)]; }
  // The largest value of tensor t's FP8 format (t = layer * kRoles + role).
  float fp8_max_of_tensor(int64_t t) const;

  // The state's memory, f32 on one device: history [tensors(), history_len], scale [tensors()],
  // fp8_max [tensors()] (the largest value of each tensor's FP8 format). Their contents are the
  // caller's to initialise (reset(): empty histories, scale 1).
  void bind(const TensorView& history, const TensorView& scale, const TensorView& fp8_max);
  const TensorView& history() const { return history_; }
  const TensorView& scale() const { return scale_; }
  const TensorView& fp8_max() const { return fp8_max_; }

  // Layer `weight`'s scale and amax entry for `role` ([1] views into scale() and history()).
  // Throws RuntimeError naming `op` when the weight was not registered.
  struct Tensor {
    TensorView scale, amax;
  };
  Tensor tensor(const void* weight, Role role, const char* op) const;
  // What a quantization of that tensor passes on (QuantizeFp8Args::scale and amax): the scale once
  // use_history is on, the amax entry while record is on; each undefined otherwise.
  Tensor quantizer_views(const void* weight, Role role, const char* op) const;

  // Host switches, read when an op is enqueued (a captured graph keeps those of its capture):
  // use_history: quantize with the scales (false until one step has been recorded: current
  // scaling); record: fold the amaxes into the histories (false for evaluation forwards, which
  // must not change what training does next).
  bool use_history = false;
  bool record = true;

 private:
  Fp8DelayedOptions opt_;
  std::vector<std::string> names_;
  std::unordered_map<const void*, int64_t> index_;
  TensorView history_, scale_, fp8_max_;
};

// Once per optimizer step: each tensor's history becomes its next scale and moves one entry along
// (cpu::fp8_delayed_update says exactly how). history [T, len], scale [T], fp8_max [T], f32 on one
// device. Backends: TURBO (one launch, graph-capturable) and CPU; the same results bit for bit.
struct Fp8DelayedUpdateArgs {
  TensorView history, scale, fp8_max;
  Fp8AmaxAlgo algo = Fp8AmaxAlgo::MostRecent;
  int margin = 0;
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return Precision::FP32; }
};
BackendType fp8_delayed_update(const Fp8DelayedUpdateArgs& args);
inline void fp8_delayed_update(const Fp8DelayedScaling& d, const ExecContext& ctx) {
  fp8_delayed_update({d.history(), d.scale(), d.fp8_max(), d.options().algo, d.options().margin, ctx});
}

}  // namespace primus::turbo
