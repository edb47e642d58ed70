// Where every parameter of a ModelSpec lives in one flat buffer, and how it maps to the
// Hugging Face state dict (names, layouts), so checkpoints carry HF names and `export hf`
// writes what transformers loads. Shared by every backend: the CUDA backend's fp32 master
// weights use the same layout as the reference backend's parameters.
//
// Our layouts: linear weights are [out, in] (nn.Linear); the fused QKV weight is rows
// [q; k; v] and the fused SwiGLU weight rows [gate; up]; RoPE uses interleaved pairs.
// Hugging Face differs in three ways, each a `HfTransform`: GPT-2's Conv1D weights are
// [in, out] (transpose), Llama's q/k rows follow the half-split RoPE convention (permute rows
// per head), and fused tensors are split into row ranges (q_proj, k_proj, v_proj; gate_proj,
// up_proj). Stacked MoE expert weights [E, out, in] are E * out rows of `in` columns; each
// expert's gate, up and down projection is a row range of its own HF tensor.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "train/model_spec.h"

namespace primus::train {

enum class HfTransform { None, Transpose, RopeRows };

struct HfPart {
  std::string name;         // Hugging Face tensor name
  int64_t row_begin = 0;    // rows [row_begin, row_begin + rows) of our tensor
  int64_t rows = 0;
  HfTransform transform = HfTransform::None;
  int64_t heads = 0;        // for RopeRows: heads in this part
};

struct ParamTensor {
  std::string name;                 // ours, e.g. "layers.3.attn.qkv.weight"
  std::vector<int64_t> shape;       // 1-D, 2-D, or 3-D for stacked experts [E, out, in]
  int64_t offset = 0;               // elements from the start of the flat buffer
  int64_t numel = 0;
  bool decay = true;                // weight decay applies (not on norms, biases)
  // false: a buffer, not a parameter (the MoE router's expert bias). It lives in the flat buffers
  // so that checkpoints, export and data-parallel copies carry it, but nothing writes its
  // gradient, so AdamW (no decay, zero moments) leaves it unchanged; its own update rule moves it.
  bool trainable = true;
  std::vector<HfPart> hf;           // empty: not exported (never the case today)
};

struct ParamLayout {
  std::vector<ParamTensor> tensors;
  int64_t total = 0;
  const ParamTensor& get(const std::string& name) const;  // throws naming the tensor
  const ParamTensor* find(const std::string& name) const;
};

ParamLayout make_param_layout(const ModelSpec& m);

// One HF tensor cut out of our buffer: `vocab_rows` (when > 0) trims padded vocabulary rows
// of the embedding and head. Returns the shape and fills `out`.
std::vector<int64_t> to_hf(const ParamTensor& t, const HfPart& part, const float* ours,
                           std::vector<float>& out, int64_t vocab_rows = 0);
// The inverse: writes HF tensor data (with its shape) into our buffer's rows.
void from_hf(const ParamTensor& t, const HfPart& part, const float* hf,
             const std::vector<int64_t>& hf_shape, float* ours);

// config.json for transformers: GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM (q/k/v-only
// biases), Qwen3ForCausalLM (per-head q/k norms), MistralForCausalLM, MixtralForCausalLM,
// Qwen3MoeForCausalLM or OlmoeForCausalLM; throws ConfigError naming what transformers' class lacks.
std::string hf_config_json(const ModelSpec& m, int eos_token_id);

}  // namespace primus::train
