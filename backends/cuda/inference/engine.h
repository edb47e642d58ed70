// Inference on the GPU: a decoder with a key/value cache, for `primus generate --backend cuda`
// and the cuda trainer's end-of-training sample. Separate from the training decoder
// (backends/cuda/model/), whose buffers are laid out for forward + backward of whole batches;
// this one keeps only what generation needs: bf16 weights, the per-layer KV cache and the
// activations of one prefill (a prompt) or one decode step (a token per sequence).
//
// Prefill runs a prompt of one sequence through every layer in one pass (causal flash attention,
// turbo/ops/attention.h) and writes each layer's keys and values (after the q/k norms and RoPE,
// exactly what attention reads) into that sequence's cache slot. Decode then runs one token per
// sequence for several sequences at once: the projections as [n, C] GEMMs (turbo/ops/gemm.h),
// the new keys appended to the cache and single-query attention over it
// (turbo/ops/decode_attention.h), RoPE / learned positions at each sequence's own position.
// Sequences keep their own lengths (no padding): slot s holds length(s) positions.
//
// Families: GPT-2 (learned positions, LayerNorm, GELU, biases, tied head), Llama (RMSNorm, RoPE,
// GQA, SwiGLU, untied), Qwen3 (per-head q/k RMSNorm, kv_channels apart from the width), Qwen2
// (qkv bias: wherever the parameter layout has one), OLMoE-style whole-width q/k norms
// (qk_norm_whole), Mistral (sliding_window: prefill and decode attend to the last window keys;
// the cache keeps every position) and every combination of those ModelSpec fields; MoE layers
// (router, grouped expert GEMMs, shared expert; the turbo MoE ops, as the training decoder)
// route dropless: a capacity factor is refused (ConfigError naming the key).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "train/model_spec.h"
#include "train/param_layout.h"
#include "train/sampling.h"
#include "turbo/core/arena.h"
#include "turbo/core/tensor_view.h"
#include "turbo/ops/moe.h"

namespace primus::backends::cuda {

class InferenceEngine {
 public:
  // host_params: the flat fp32 buffer of train::make_param_layout(spec) (a checkpoint's master
  // weights); each tensor is rounded to bf16 on the device. max_batch: cache slots (sequences
  // generated at once); each slot holds spec.seq_length positions (the positions the model was
  // trained for). Allocates everything here; prefill and decode allocate nothing but the
  // all-rows logits of a prefill that asks for them.
  // device CPU: host mode, the same code in fp32 on host memory with every op on Turbo's CPU
  // backends (the reference kernels): the engine's wiring checked without a GPU.
  InferenceEngine(const train::ModelSpec& spec, const float* host_params, int64_t max_batch,
                  turbo::Device device = turbo::Device::CUDA);
  ~InferenceEngine();
  InferenceEngine(const InferenceEngine&) = delete;
  InferenceEngine& operator=(const InferenceEngine&) = delete;

  const train::ModelSpec& spec() const { return spec_; }
  int64_t max_batch() const { return max_batch_; }
  int64_t capacity() const { return spec_.seq_length; }  // positions per slot
  int64_t rows() const { return rows_; }  // tokens one prefill_batch call may hold (B x T)
  int64_t length(int64_t slot) const { return len_.at(static_cast<size_t>(slot)); }
  size_t device_bytes() const;  // weights + cache + activations + scratch

  // Runs tokens[0..n) (1 <= n <= capacity) at positions 0..n-1 in cache slot `slot`, replacing
  // what it held, and returns the logits (host f32) of the last token, [padded_vocab_size]
  // (or of every token, [n, padded_vocab_size], with all_rows). Valid until the next call.
  const float* prefill(int64_t slot, const int32_t* tokens, int64_t n, bool all_rows = false);
  // Several sequences of T tokens each (tokens [B, T] row-major, B x T <= rows()) into the listed
  // distinct slots at positions 0..T-1; returns each one's last-token logits, [B, padded_vocab_size]
  // host f32.
  const float* prefill_batch(const int32_t* slots, const int32_t* tokens, int64_t B, int64_t T);
  // One token per listed slot (distinct slots, each with length < capacity), at position
  // length(slot), which then grows by one. Returns the logits, [n, padded_vocab_size] host f32.
  const float* decode(const int32_t* slots, const int32_t* tokens, int64_t n);
  // Decode steps as CUDA graphs (default; PRIMUS_INFERENCE_GRAPHS=0 turns them off) or launched
  // op by op; the results are the same.
  void set_graphs(bool on) { use_graphs_ = on; }
  bool graphs() const { return use_graphs_ && !host(); }
  // Device time of the logits' copies to the host so far (ms; 0 in host mode).
  double logits_copy_ms() const { return logits_copy_ms_; }

 private:
  struct LayerWeights {
    turbo::TensorView norm1_w, norm1_b, qkv_w, qkv_b, q_norm, k_norm, proj_w, proj_b, norm2_w, norm2_b, fc_w, fc_b,
        out_w, out_b;
    turbo::TensorView k_cache, v_cache;  // [max_batch, capacity, KV, D]
    // MoE layers: router [E, C], expert bias [E] f32, experts [E, 2F, C] and [E, C, F], shared expert.
    turbo::TensorView router_w, expert_bias, experts_fc, experts_proj, shared_fc, shared_proj;
  };
  // One MoE layer's routing and expert activations, shared by the layers (nothing is kept).
  struct MoeBuffers {
    turbo::TensorView logits, probs, topk_idx, topk_weight, rows, offsets, counts, kept, prob_sum, z_sum;
    turbo::TensorView xp, h, act, yp, sfc, sact;
  };
  void moe_forward(const LayerWeights& w, int64_t N);
  // The layers and the head over N = B x T tokens: decode (T = 1, positions staged)
  // or pos = t (prefill: B sequences of T); the head's logits (every row when decoding or
  // all_rows, else each sequence's last) into logits_dev and then the host buffer.
  const float* run(int64_t B, int64_t T, bool decoding, bool all_rows, float* logits_dev);
  int64_t enqueue(int64_t B, int64_t T, bool decoding, bool all_rows, float* logits_dev);  // returns head rows
  const float* fetch(int64_t head_rows, float* logits_dev);  // the logits to the host (waits)
  struct Graph {
    int plain_runs = 0;
    cudaGraphExec_t exec = nullptr;
  };
  void capture(Graph& g, int64_t n);
  bool host() const { return device_ == turbo::Device::CPU; }
  void upload(void* dst, const void* src, size_t bytes);  // host -> engine memory, in stream order
  // rows x width bytes between strided rows of engine memory (cudaMemcpy2D's arguments)
  void copy_rows(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, int64_t rows);
  void stage_prefill(const int32_t* slots, const int32_t* tokens, int64_t B, int64_t T);  // ids, slots, lengths
  void norm(const turbo::TensorView& out, const turbo::TensorView& resid_out, const turbo::TensorView& inp,
            const turbo::TensorView& resid, const turbo::TensorView& w, const turbo::TensorView& b, int64_t N);

  train::ModelSpec spec_;
  train::ParamLayout layout_;
  int64_t max_batch_, rows_;
  turbo::Device device_;
  turbo::DType act_dtype_;  // bf16 on the GPU, f32 in host mode  // rows_: activation rows (max_batch x capacity)
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<turbo::Arena> weights_, state_, scratch_;
  turbo::TensorView wte_, wpe_, lnf_w_, lnf_b_, head_w_, rope_table_;
  std::vector<LayerWeights> layers_;
  MoeBuffers moe_;
  turbo::RouterConfig router_;
  // Activations [rows_, ...]: two residual streams, the normalised input, q|k|v, attention
  // output, MLP (fc, act), a branch output; statistics f32; head-norm saves.
  turbo::TensorView h_[2], ln_, qkv_, att_, fc_, act_, tmp_, mean_, rstd_, lse_, qk_saved_, qk_rstd_, qk_dense_;
  turbo::TensorView tokens_, positions_, slot_, len_dev_, logits_;  // logits_ f32 [max_batch, Vp]
  turbo::TensorView decode_ws_;  // decode attention's split-KV partials (undefined: none needed / host)
  int cur_ = 0;  // which h_ holds the residual stream
  std::vector<int32_t> len_;
  std::map<int64_t, Graph> graphs_;  // decode steps by sequence count (PRIMUS_INFERENCE_GRAPHS=0: none)
  bool use_graphs_ = true;
  float* pinned_logits_ = nullptr;  // [max_batch, Vp] page-locked
  cudaEvent_t copy_events_[2] = {nullptr, nullptr};
  double logits_copy_ms_ = 0;
  size_t pinned_count_ = 0;
  std::vector<float> host_logits_;
};

struct GenerateStats {
  int64_t prompt_tokens = 0, new_tokens = 0, decode_steps = 0;  // decode_steps: batched forward calls after prefill
  double prefill_ms = 0, decode_ms = 0;  // wall time (host + device, synchronised)
  // Parts of decode_ms: the logits' device -> host copies (CUDA events) and sampling on the host.
  double decode_copy_ms = 0, decode_sample_ms = 0;
};

// Generates for every prompt at once (prompts.size() <= engine.max_batch(), each non-empty):
// prefill each prompt, then decode all unfinished sequences together, sampling on the host with
// train::Sampler in prompt order from one generator (so one prompt gives the reference's tokens
// for the same logits and seed). A sequence stops after max_new_tokens, or after emitting the
// end-of-text id when stop_at_eod (the id is kept in its output). When a sequence fills the
// model's seq_length, each further token recomputes the window of its last seq_length tokens,
// as the reference model does. use_cache = false recomputes the whole window for every token
// (a prefill of all tokens so far, sequences of one length batched together): the baseline the
// cache is measured against. Returns the new tokens of each prompt.
std::vector<std::vector<int32_t>> generate(InferenceEngine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                           const train::SampleOptions& o, std::mt19937_64& rng, bool use_cache = true,
                                           GenerateStats* stats = nullptr);

}  // namespace primus::backends::cuda
