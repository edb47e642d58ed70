// Shared pieces of the CUDA backend's tests: the tiny GPT-2 and Llama both backends train, the
// two comparisons with the reference backend (step 0: loss and every gradient; N training
// steps: the loss curve), run on the device (bf16) or in the model's host mode (fp32 on Turbo's
// CPU backends, no GPU needed), and a fixture that skips without a device.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backends/cuda/device.h"
#include "backends/cuda/hooks.h"
#include "turbo/ops/fp8_delayed.h"
#include "backends/cuda/model.h"
#include "train/model_spec.h"
#include "turbo/core/cuda_check.h"
#include "turbo/core/dtype.h"
#include "turbo/core/tensor_view.h"

namespace primus::backends::cuda::testing {

// Tiny but not degenerate: head_dim 64 (what every attention kernel serves), two layers, the
// Llama one with grouped-query attention (2 query heads per kv head), RoPE, SwiGLU, untied head.
train::ModelSpec tiny_spec(bool llama);
// The tiny Llama with MoE layers. Mixtral style: both layers MoE, 8 experts of width 64, softmax
// top-2. DeepSeek style: the first layer dense, 16 experts in 4 groups (2 chosen), sigmoid top-4
// with the expert bias and scaling 2.5, a shared expert of width 96. Both with aux and z losses.
train::ModelSpec tiny_moe_spec(bool deepseek);
// tiny_moe_spec with every linear and expert width a multiple of 128 (blockwise FP8).
train::ModelSpec tiny_moe_spec_128(bool deepseek);
// Qwen3's attention on the tiny Llama: 4 query / 2 kv heads of 64 (kv_channels) over a width of
// 128, so q and the attention output are 256 wide, with per-head query/key norms (qk_layernorm).
// moe: the Mixtral-style tiny MoE with that attention, every layer MoE (Qwen3-MoE).
train::ModelSpec tiny_qwen3_spec(bool moe);
// Qwen2: the tiny Llama with biases on q, k and v only (add_qkv_bias).
train::ModelSpec tiny_qwen2_spec();
// OLMoE's attention: RMSNorms over the whole q (256 wide: 4 heads of 64) and k (2 x 64) projections
// (qk_layernorm_scope: projection). moe: the Mixtral-style tiny MoE with it, every layer MoE, the
// router's softmax over all experts before the top-2 and no renormalisation (OLMoE's).
train::ModelSpec tiny_olmoe_spec(bool moe);

inline float round_bf16(float x) { return turbo::bf16_bits_to_float(turbo::float_to_bf16_bits(x)); }

// ||got - ref|| / ||ref||; infinite when got holds a NaN or inf.
double rel_l2(const float* got, const float* ref, int64_t n);

// Model options for batches up to B x spec.seq_length (scratch for the fallback attention).
CudaModelOptions options(const train::ModelSpec& spec, int64_t B, turbo::Device device);
// The tiny models' shared initial weights: the reference init (seed 1234) rounded to bf16.
std::vector<float> initial_params(const train::ModelSpec& spec);
// Training batches: step s is kTrainBatch windows of T + 1 bytes of tinyshakespeare at offsets
// from a fixed seed ($PRIMUS_SOURCE_DIR, else the source tree, holds the text).
inline constexpr int64_t kTrainBatch = 8;
struct Batches {
  Batches(int64_t T, int steps);
  std::vector<std::vector<int32_t>> inputs, targets;
};

// The attention implementations a model can run with: the slot's default and the fallback.
enum class Attn { Default, Fallback };
inline std::string attn_name(Attn a) { return a == Attn::Default ? default_attention_name() : "fallback"; }
CudaOps ops_for(Attn a);

// Step 0 of CudaModel against reference::GptModel<float> on the same weights (the reference's
// init with init_method_std 0.1, norm weights and biases jittered so their gradients are
// generic, all rounded to bf16 so both sides compute with identical weights) and the same
// random batch (B = 4, T = 64). errors: ||g_cuda - g_ref|| / ||g_ref|| per parameter tensor.
//
// Dump mode (for the outside oracle tests/cuda_gpu/bf16_noise_floor.py, which runs the same
// weights and batch through PyTorch/transformers in fp32 and bf16): with a dump root (the
// argument, else $PRIMUS_PARITY_DUMP) every call also writes the folder
//   <root>/<gpt2|llama>-<default|fallback>-<cuda|host>-seed<N>/
//     hf/config.json, hf/model.safetensors   the bf16-rounded weights as fp32, Hugging Face names
//                                            and layouts (train::to_hf, what `export hf` writes)
//     batch.safetensors                      tokens, targets: I32 [B, T]
//     grads_ref.safetensors                  the reference's fp32 gradients, same names/layouts
//     grads_ours.safetensors                 CudaModel's gradients, same names/layouts
//     parity.json                            model, attention, device, seed, B, T, both losses,
//                                            and per parameter tensor of ours (the test's list):
//                                            its HF parts and the test's relative L2
// The loss is the mean cross-entropy over the B*T (token, target) pairs; targets are not the
// shifted tokens, so HF's labels= loss does not apply.
struct Step0 {
  double loss = 0, ref_loss = 0, eval_loss = 0;
  bool eval_kept_grads = false;  // a forward without gradient left the gradients untouched
  std::vector<std::pair<std::string, double>> errors;  // per trainable tensor
  std::string dump_dir;  // the folder written in dump mode, else empty
  // MoE: slots per expert of every layer ([layer][expert], empty for dense layers), ours and the
  // reference's own choice. Where the two chose differently for some tokens (a near-tie that
  // bf16 rounding breaks the other way), the gradients above are against the reference run again
  // on our routing (teacher forcing, see router_forward's forced_idx), so they measure arithmetic,
  // not a different discrete choice. rerouted_tokens counts those tokens over all layers,
  // rerouted_first_layer in the first MoE layer, whose input differs by bf16 arithmetic alone (a
  // rerouted token changes its own later inputs and, through attention, those of the tokens after
  // it), and max_gap is the largest score gap the reference saw there between the experts that
  // swapped (between the groups, where group-limited routing chose other groups).
  std::vector<std::vector<int64_t>> expert_load, ref_expert_load;
  // MoE: every layer's aux and z loss values as the trainer logs them ("moe/layer<l>/aux_loss",
  // ".../z_loss"): ours from the step status, the reference's from its layers (on the routing
  // the gradients above were compared on).
  std::vector<std::pair<std::string, double>> moe_losses, ref_moe_losses;
  int64_t rerouted_tokens = 0, rerouted_first_layer = 0;
  double max_gap = 0;
};
// $PRIMUS_PARITY_DUMP, or "" when unset.
std::string parity_dump_root();
Step0 step0_parity(bool llama, Attn attn, turbo::Device device, unsigned seed,
                   const std::string& dump_root = parity_dump_root());
Step0 step0_parity(train::ModelSpec spec, Attn attn, turbo::Device device, unsigned seed,
                   const std::string& dump_root = parity_dump_root());

// `steps` training steps of both backends from the same bf16-representable init (seed 1234) on
// the same tinyshakespeare batches (B = 8, T = 64, bytes) with the trainers' recipe: global-norm
// clip 1.0, AdamW (lr 2e-3, betas 0.9/0.99, decay 0.1 on decayed tensors). Returns
// {cuda losses, reference losses}; the reference curve is computed once per (model, steps).
// With `fp8`, the model's linear slots run that FP8 recipe (patch cuda.linear.fp8). at_end runs
// after the last step, while the model and the buffers it lends the recipe's state still exist.
// `steps` steps of the reference's recipe (AdamW with its hyperparameters, clipping at kClip) over
// data's batches, from the model's current weights: the losses.
std::vector<double> train_reference_steps(CudaModel& model, Batches& data, int64_t steps);
std::pair<std::vector<double>, std::vector<double>> training_curves(bool llama, Attn attn, turbo::Device device,
                                                                    int steps, const turbo::Fp8Recipe* fp8 = nullptr,
                                                                    const std::function<void(CudaModel&)>& at_end = {});
std::pair<std::vector<double>, std::vector<double>> training_curves(const train::ModelSpec& spec, Attn attn,
                                                                    turbo::Device device, int steps,
                                                                    const turbo::Fp8Recipe* fp8 = nullptr,
                                                                    const std::function<void(CudaModel&)>& at_end = {});

// An FP8 recipe (format, scaling) with the state the trainer's configure_fp8 gives it: for
// fp8_recipe delayed an amax history of `delayed`'s length and algorithm, and, when asked for, the
// saved-input and weight-cache registries (the model fills them when built with the recipe).
struct Fp8TestState {
  bool saved = false, weights = false;
  bool maxima = false;  // rowwise, tensorwise: the SwiGLU kernels' maxima handed to the quantizer (turbo::Fp8Maxima)
  bool producers = false;  // delayed: the SwiGLU folded into the quantizers (turbo::Fp8Producers)
  turbo::Fp8DelayedOptions delayed{2};
};
turbo::Fp8Recipe fp8_test_recipe(const char* format, const char* scaling, const Fp8TestState& state = {});
// What patch cuda.linear.fp8 and model_options_for make of recipe `r` for a model of `spec`: its
// linear slots (and the experts' with num_experts > 0) and the model options its state needs.
void use_fp8_recipe(const train::ModelSpec& spec, const turbo::Fp8Recipe& r, CudaOps& ops, CudaModelOptions& mo);

class CudaGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (turbo::cuda_device_count_or_zero() == 0) GTEST_SKIP() << "no CUDA device";
    select_device(0);
  }
};

}  // namespace primus::backends::cuda::testing
