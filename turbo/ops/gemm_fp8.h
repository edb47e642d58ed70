// FP8 linear layers: the three GEMMs of a linear layer (forward, input gradient, weight
// gradient) with FP8 operands, quantized right before each GEMM ("current scaling": scale =
// fp8_max / amax of the data it scales), accumulated in fp32, written in the output's type.
//
// The scaling granularity (Fp8Recipe::scaling):
//   tensorwise  one scale per tensor (Transformer Engine's current scaling, torchao tensorwise);
//   rowwise     one per row of each GEMM operand along K: x and dy per token, w per output
//               feature in the forward and per input feature (its columns) in the input
//               gradient, dy^T and x^T per feature over the tokens in the weight gradient
//               (torchao's rowwise recipe; cuBLASLt's outer-vector scales);
//   blockwise   DeepSeek-V3's: 1x128 tiles along K for activations and gradients (x, dy, and
//               dy^T, x^T along the tokens), 128x128 blocks for weights (cuBLASLt's 128-element
//               and 128x128 block scales). Needs E4M3 operands and every dimension a multiple
//               of 128.
//   delayed     one scale per tensor, taken from earlier steps' amax history instead of the
//               tensor's own amax (Transformer Engine's DelayedScaling): one pass per
//               quantization. The state (each layer's x, w and dy histories and scales, found by
//               the weight's address) is Fp8Recipe::delayed (turbo/ops/fp8_delayed.h).
//
// The default recipe is "hybrid": activations and weights in E4M3 (more mantissa), output
// gradients in E5M2 (more range). Forward GEMMs use cuBLASLt's fast FP8 accumulation, the
// backward GEMMs the precise one (as Transformer Engine does). Hopper's FP8 tensor cores read
// both operands K-contiguous, so each GEMM quantizes into the layout it needs: x and w as they
// are for the forward; dy as it is and w transposed for the input gradient; dy and x transposed
// for the weight gradient (dy quantized once into both layouts when both gradients are asked
// for). Quantized copies live in ctx.scratch for the GEMMs' duration only;
// linear_fp8_scratch_bytes says how much a layer borrows at most.
//
// Same shapes and conventions as turbo::linear_forward / linear_backward (gemm.h); the bias
// gradient is turbo::bias_grad's deterministic column sum of dout. Host f32 tensors run the same
// arithmetic on the CPU (quantize, dequantize, f32 GEMM): the reference for the device path.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>

#include "turbo/core/fp8_granularity.h"
#include "turbo/core/tensor_view.h"
#include "turbo/ops/exec_context.h"
#include "turbo/ops/quantization.h"

namespace primus::turbo {

enum class Fp8Scaling : uint8_t { Tensorwise, Rowwise, Blockwise, Delayed };
const char* fp8_scaling_name(Fp8Scaling s);  // "tensorwise" | "rowwise" | "blockwise" | "delayed"

class Fp8DelayedScaling;  // turbo/ops/fp8_delayed.h

// Inputs saved for the backward in FP8: for a registered linear layer (found by its weight's
// address) the forward quantizes x into both layouts in one pass, q(x) for its own GEMM and
// q(x)^T into the layer's slot, which the weight-gradient GEMM then reads instead of quantizing
// the bf16 x again; so x itself need not be kept for the backward (the caller's memory plan drops
// it). The slot is the caller's memory: q_t holds at least C * N FP8 bytes for the largest N, scale
// at least fp8_saved_scale_numel(recipe, C, N) f32. A layer's backward must follow its own forward
// (no other forward of that layer in between); evaluation forwards write the slot too.
class Fp8SavedInputs {
 public:
  // The granularity of the saved copies' scales: the recipe's for activations.
  explicit Fp8SavedInputs(Fp8Granularity g = Fp8Granularity::Tensor) : g_(g) {}
  Fp8Granularity granularity() const { return g_; }
  struct Slot {
    TensorView q_t;    // FP8 bytes (any dtype view; used as [C, N])
    TensorView scale;  // f32
  };
  void add(const void* weight, Slot slot);
  const Slot* find(const void* weight) const;  // nullptr: not registered
  void clear() { slots_.clear(); }
  size_t size() const { return slots_.size(); }

 private:
  Fp8Granularity g_;
  std::unordered_map<const void*, Slot> slots_;
};

// Weights quantized once per optimizer step, not once per micro-batch (Transformer Engine's FP8
// weight caching under gradient accumulation): for a registered layer the first training forward
// after invalidate() quantizes w into both layouts in one pass, q(w) and q(w)^T with their scales,
// into the slot, and every later forward and input-gradient GEMM of the step reads them. The
// caller invalidates at each step's start (the weights change only in the optimizer update) and
// switches `enabled` off for evaluation forwards (they quantize into scratch as without a cache).
// Slots are the caller's memory: q and q_t OC * C FP8 bytes each, scale / scale_t the weight
// granularity's scales of [OC, C] and [C, OC] (one shared tensor at Tensor granularity is fine).
// keep_transpose = false (Transformer Engine's keep_fp8_weight_transpose_cache=False, Primus'
// no_fp8_weight_transpose_cache): slots hold q(w) alone (q_t and scale_t may be undefined) and each
// input-gradient GEMM quantizes w^T into scratch as without a cache: the same bytes and scales (the
// same weight, the same recipe), half the slots' memory, one more quantization per micro-batch.
class Fp8WeightCache {
 public:
  // The granularity of the copies' scales: the recipe's for weights.
  explicit Fp8WeightCache(Fp8Granularity g = Fp8Granularity::Tensor) : g_(g) {}
  Fp8Granularity granularity() const { return g_; }
  struct Slot {
    TensorView q, scale, q_t, scale_t;
    bool valid = false;
  };
  void add(const void* weight, const Slot& slot);
  Slot* find(const void* weight);
  void invalidate();
  void clear() { slots_.clear(); }
  size_t size() const { return slots_.size(); }
  bool enabled = true;
  bool keep_transpose = true;
  int64_t fills = 0, hits = 0;  // quantizations into the slots, and GEMMs that read a filled slot

 private:
  Fp8Granularity g_;
  std::unordered_map<const void*, Slot> slots_;
};

// Which matrix a handoff entry (Fp8Maxima, Fp8Producers) is for: its memory, shape and row stride.
struct Fp8HandoffKey {
  const void* data = nullptr;
  int64_t rows = 0, cols = 0, ld = 0;
  static Fp8HandoffKey of(const TensorView& t);  // t 2-D
  bool operator==(const Fp8HandoffKey&) const = default;
};

// Maxima handed from the op that wrote a tensor to the FP8 linear layer that quantizes it next
// (rowwise and tensorwise current scaling): the SwiGLU forward's output feeds the MLP
// down-projection, its backward's dgate_up the up-projection's gradients. Current scaling needs
// the tensor's max |x| (rowwise: every row's and every column's, for the column-scaled copy)
// before it writes a byte, i.e. a pass of its own over the tensor; with the producer's maxima
// (ActivationBackwardArgs::maxima) it reads the tensor once (QuantizeFp8Args::maxima). One entry:
// put() replaces it; the next FP8 linear call takes it for its input (forward) or output gradient
// (backward) when that is the same tensor (data, shape and row stride) and drops it either way, so
// an entry never outlives the call it was put for.
class Fp8Maxima {
 public:
  // The granularity of the recipe it serves: Row or Tensor.
  explicit Fp8Maxima(Fp8Granularity g = Fp8Granularity::Row);
  Fp8Granularity granularity() const { return g_; }
  // maxima: f32 [rows + cols + 1] of t, as ActivationForwardArgs::maxima lays them out.
  void put(const TensorView& t, const TensorView& maxima);
  // The maxima of t when t is the tensor of the last put(), else undefined; the entry stays.
  TensorView find(const TensorView& t) const;
  void clear() { maxima_ = TensorView(); }
  int64_t puts = 0, uses = 0;  // entries put, and linear calls that found theirs

 private:
  Fp8Granularity g_;
  Fp8HandoffKey key_;
  TensorView maxima_;
};

// Operands of an FP8 linear layer that no kernel wrote (delayed scaling): the MLP activation
// act = silu(gate) * up, read by the down-projection's forward (and its weight gradient where its
// input is not saved in FP8), and the SwiGLU backward's dgate_up, read by the up-projection's
// gradients. The quantizer computes their values as it reads gate_up (QuantizeFp8Args::prologue):
// one read of gate_up (and dy) instead of the activation kernel's read and write and then the
// quantizer's read, and the same bytes. One entry, as Fp8Maxima: put() replaces it; the next FP8
// linear call takes it for its input or output gradient when that is the same tensor (data, shape
// and row stride) and drops it either way. Where the quantizer cannot fold it in (no delayed scale
// before the first recorded step, a layout the device kernel does not take, a bias gradient that
// reads the tensor), the linear call runs the activation into the tensor's own memory first, so the
// tensor given to put() must be the memory the activation would have written.
class Fp8Producers {
 public:
  struct Entry {
    QuantizePrologue kind = QuantizePrologue::None;
    TensorView inp;      // SwiGLU: gate_up [R, 2F]; SwiGLUBackward: dL/d(act) [R, F]
    TensorView gate_up;  // SwiGLUBackward: gate_up [R, 2F]
  };
  // t: act [R, F] (kind SwiGLU) or dgate_up [R, 2F] (SwiGLUBackward), not written yet.
  void put(const TensorView& t, const Entry& e);
  // The entry of t when t is the tensor of the last put(), else nullptr; the entry stays.
  const Entry* find(const TensorView& t) const;
  void clear() { entry_ = Entry(); }
  int64_t puts = 0, folded = 0, written = 0;  // entries put; quantizations that folded one in; activations run instead

 private:
  Fp8HandoffKey key_;
  Entry entry_;
};

struct Fp8Recipe {
  DType fwd = DType::F8E4M3;   // x and w
  DType grad = DType::F8E5M2;  // dy ("hybrid"); F8E4M3 for an all-E4M3 recipe
  bool fast_accum_fwd = true;  // cuBLASLt fast accumulation in the forward GEMM (not blockwise)
  Fp8Scaling scaling = Fp8Scaling::Tensorwise;
  // Delayed: the histories and scales of the layers this recipe serves (shared by the copies of
  // the recipe that the linear slots hold and by the model that owns the memory); a delayed
  // recipe without it is refused at its first call.
  std::shared_ptr<Fp8DelayedScaling> delayed;
  // The layers whose inputs are kept in FP8 for the backward (null or empty: none).
  std::shared_ptr<Fp8SavedInputs> saved;
  // The layers whose weights are quantized once per optimizer step (null or empty: none).
  std::shared_ptr<Fp8WeightCache> weights;
  // Producers' maxima for the next linear call's rowwise quantization (null: none).
  std::shared_ptr<Fp8Maxima> maxima;
  // Delayed scaling: operands the quantizer computes from the producer's inputs (null: none).
  std::shared_ptr<Fp8Producers> producers;
  std::string name() const;    // the format: "hybrid" | "e4m3" (| "custom")
  // The granularity of activations / gradients, and of weights, under this recipe.
  Fp8Granularity act_granularity() const;
  Fp8Granularity weight_granularity() const;
  // Whether its quantizers take a producer's maxima (Fp8Maxima): current scaling per row or per
  // tensor, which needs an amax pass; blockwise's groups lie inside one tile (one pass already),
  // delayed scaling knows its scale before the tensor.
  bool takes_maxima() const { return scaling == Fp8Scaling::Rowwise || scaling == Fp8Scaling::Tensorwise; }
};
// "hybrid" (E4M3 forward, E5M2 gradients) or "e4m3" (E4M3 everywhere); throws ConfigError
// naming `where` for anything else.
Fp8Recipe parse_fp8_recipe(const std::string& text, const std::string& where);
// The format as above with a scaling: "tensorwise" | "rowwise" | "blockwise" (blockwise needs
// "e4m3") | "delayed" (Fp8Recipe::delayed left for the caller to set); throws ConfigError naming
// `where` and the key `scaling_key` otherwise.
Fp8Recipe parse_fp8_recipe(const std::string& format, const std::string& scaling, const std::string& where,
                           const std::string& scaling_key);

// out [N,OC] = dequant(q(inp) @ q(weight)^T) (+ bias); with aux defined, aux = that and out =
// gelu_tanh(aux) (GPT-2's MLP up-projection). N, C, OC multiples of 16 on the device.
void linear_forward_fp8(const TensorView& out, const TensorView& inp, const TensorView& weight,
                        const TensorView& bias, const TensorView& aux, const ExecContext& ctx,
                        const Fp8Recipe& recipe = {});

// dinp [N,C] = q(dout) @ q(weight) (+= when accumulate_dinp; skipped if undefined);
// dweight [OC,C] += q(dout)^T @ q(inp) (f32, = when !accumulate_dweight; skipped if undefined);
// dbias [OC] f32 += column sums of dout (skipped if undefined).
void linear_backward_fp8(const TensorView& dinp, const TensorView& dweight, const TensorView& dbias,
                         const TensorView& dout, const TensorView& inp, const TensorView& weight,
                         bool accumulate_dinp, const ExecContext& ctx, const Fp8Recipe& recipe = {},
                         bool accumulate_dweight = true);

// dpre [N,C] = (q(dout) @ q(weight)) * gelu_tanh'(pre_aux); dbias [C] = column sums of dpre
// (overwritten) when defined.
void linear_backward_input_dgelu_fp8(const TensorView& dpre, const TensorView& dbias, const TensorView& dout,
                                     const TensorView& weight, const TensorView& pre_aux, const ExecContext& ctx,
                                     const Fp8Recipe& recipe = {});

// f32 scales a saved q(x)^T of an [N, C] input needs under `recipe` (Fp8SavedInputs): one
// (tensorwise, delayed), C (rowwise: per feature), C * N / 128 (blockwise: 1x128 along the tokens).
int64_t fp8_saved_scale_numel(const Fp8Recipe& recipe, int64_t N, int64_t C);

// The most scratch one call above borrows for a layer with n rows, in_features C and
// out_features OC (quantized copies, scales and the quantizer's partials), in bytes.
size_t linear_fp8_scratch_bytes(int64_t n, int64_t in_features, int64_t out_features);
// What the token count and both feature sizes of a linear layer must be multiples of under
// `recipe`: 16 (Hopper's FP8 GEMMs), 128 for blockwise (its 1x128 / 128x128 scale blocks).
int64_t linear_fp8_multiple(const Fp8Recipe& recipe);

}  // namespace primus::turbo
