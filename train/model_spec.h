// The architecture every backend trains, from the Megatron-style model keys. GPT-2 (LayerNorm,
// GELU, learned positions, tied head, biases) and Llama (RMSNorm, RoPE, GQA, SwiGLU, untied,
// no biases) are two settings of the same decoder.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/config/schema.h"
#include "core/config/value.h"
#include "core/util/rope_scaling.h"

namespace primus::train {

// Mixture-of-experts feed-forward layers, with Megatron-LM's key names (in comments). A MoE
// layer replaces the dense SwiGLU MLP by a router (a linear layer to num_experts logits, no
// bias), `topk` routed SwiGLU experts of width ffn_hidden_size each, and optionally a shared
// SwiGLU expert that every token goes through. The routing semantics (score function, group
// limit, normalisation, aux/z losses, dropping) are turbo/kernels/cpu/moe.h's.
struct MoeSpec {
  int64_t num_experts = 0;               // num_experts; 0: every layer dense
  // The experts whose weights this process holds (the first of them: first_expert): all of them,
  // except on an expert-parallel rank's local spec (train/expert_parallel.h), where num_experts / ep.
  // 0 means num_experts. The router still scores every expert.
  int64_t local_experts = 0;
  int64_t first_expert = 0;
  int64_t topk = 2;                      // moe_router_topk
  int64_t ffn_hidden_size = 0;           // moe_ffn_hidden_size (per expert)
  int64_t shared_ffn_hidden_size = 0;    // moe_shared_expert_intermediate_size; 0: none
  bool sigmoid = false;                  // moe_router_score_function: softmax | sigmoid
  bool pre_softmax = false;              // moe_router_pre_softmax
  double topk_scaling_factor = 1.0;      // moe_router_topk_scaling_factor
  int64_t num_groups = 1;                // moe_router_num_groups (1: no group limit)
  int64_t group_topk = 1;                // moe_router_group_topk
  bool expert_bias = false;              // moe_router_enable_expert_bias
  double bias_update_rate = 1e-3;        // moe_router_bias_update_rate
  // moe_router_load_balancing_type names one balancing loss or lists several (Megatron-LM's list
  // form, with moe_aux_loss_coeff then one coefficient per type); each listed loss is added to the
  // objective with its own coefficient, and their gradients add.
  // aux_loss: the switch loss over the micro-batch's tokens (also what none and an unset type keep
  // computing and logging, at coefficient 0 for none).
  bool batch_aux_loss = true;
  double aux_loss_coeff = 0.0;
  // seq_aux_loss: the aux loss over each sequence's tokens, averaged over the sequences (DeepSeek-V3's
  // sequence-wise balance loss).
  bool seq_aux_loss = false;
  double seq_aux_loss_coeff = 0.0;
  // global_aux_loss: the switch loss with each expert's load taken over the global batch (Megatron's
  // global_aux_loss, the global-batch balance loss Qwen3-MoE trained with): the token counts summed
  // over every rank that holds other tokens (data, context and expert parallel: the ranks the
  // router's gradient is averaged over) and over the optimizer step's micro-batches so far, whose
  // running mean is the load; the router probabilities are this micro-batch's. Its gradient is that
  // of the loss over the whole global micro-batch.
  bool global_aux_loss = false;
  double global_aux_loss_coeff = 0.0;
  double z_loss_coeff = 0.0;             // moe_z_loss_coeff
  double capacity_factor = 0.0;          // moe_expert_capacity_factor; <= 0: dropless
  bool drop_by_position = false;         // moe_token_drop_policy: probs | position
  // moe_token_dispatcher_type: allgather names Megatron's exchange, which no backend implements;
  // both move tokens all-to-all, and on one expert-parallel rank none move (EpShardMap refuses
  // allgather beside expert parallelism). Not part of the model's record: it changes no value.
  bool allgather_dispatcher = false;
  // moe_router_force_load_balancing (a benchmark setting): every MoE layer's router logits are a
  // pseudo-random draw (turbo::cpu::moe_random_logit with moe_random_seed(layer)), so the experts
  // get near-equal loads whatever the weights; gradients pass straight through to the router.
  bool force_load_balancing = false;
  std::vector<bool> moe_layers;          // from moe_layer_freq and moe_first_k_dense_replace

  bool enabled() const { return num_experts > 0; }
  // The balancing losses listed (1 for a single type, none or the default).
  int balance_types() const { return int(batch_aux_loss) + int(seq_aux_loss) + int(global_aux_loss); }
  // The loss whose statistic the logs call aux_loss (moe/layer<l>/aux_loss, moe_aux): the
  // micro-batch's when listed, else the sequences', else the global batch's. A list's others are
  // logged under their own type's name.
  enum class Balance { Batch, Sequence, Global };
  static constexpr std::array<Balance, 3> kBalances{Balance::Batch, Balance::Sequence, Balance::Global};
  Balance primary_balance() const {
    return batch_aux_loss ? Balance::Batch : seq_aux_loss ? Balance::Sequence : Balance::Global;
  }
  // A type's flag and coefficient (S: MoeSpec or const MoeSpec).
  template <class S>
  static auto& listed_of(S& s, Balance b) {
    return b == Balance::Batch ? s.batch_aux_loss : b == Balance::Sequence ? s.seq_aux_loss : s.global_aux_loss;
  }
  template <class S>
  static auto& coeff_of(S& s, Balance b) {
    return b == Balance::Batch ? s.aux_loss_coeff : b == Balance::Sequence ? s.seq_aux_loss_coeff : s.global_aux_loss_coeff;
  }
  double balance_coeff(Balance b) const { return coeff_of(*this, b); }
  double primary_coeff() const { return balance_coeff(primary_balance()); }
  // The listed types other than the primary, in the order Batch, Sequence, Global.
  std::vector<Balance> more_balances() const {
    std::vector<Balance> v;
    for (const Balance b : kBalances)
      if (listed_of(*this, b) && b != primary_balance()) v.push_back(b);
    return v;
  }
  // One balancing type alone, at `coeff` (what moe_router_load_balancing_type: <type> gives).
  void set_balance(Balance b, double coeff) {
    batch_aux_loss = seq_aux_loss = global_aux_loss = false;
    aux_loss_coeff = seq_aux_loss_coeff = global_aux_loss_coeff = 0.0;
    listed_of(*this, b) = true;
    coeff_of(*this, b) = coeff;
  }
  static const char* balance_name(Balance b) {
    return b == Balance::Batch ? "aux_loss" : b == Balance::Sequence ? "seq_aux_loss" : "global_aux_loss";
  }
  int64_t held_experts() const { return local_experts > 0 ? local_experts : num_experts; }
  // Slots an expert keeps per micro-batch of `tokens` tokens (ceil(tokens * topk / E * factor));
  // -1 when dropless.
  int64_t capacity(int64_t tokens) const;
};
// The seed of layer `layer`'s draw under force_load_balancing (the same on both backends).
inline uint64_t moe_random_seed(int64_t layer) { return 0x5EEDB1A5ull + static_cast<uint64_t>(layer); }


struct ModelSpec {
  std::string model_type = "gpt2";  // gpt2 | llama | qwen3 | mixtral | qwen3_moe | ...: Hugging Face names and export
  int64_t vocab_size = 0;           // tokenizer's vocabulary
  int64_t padded_vocab_size = 0;    // rounded up to make_vocab_size_divisible_by
  int64_t seq_length = 0;
  int64_t num_layers = 0;
  int64_t hidden_size = 0;
  int64_t num_attention_heads = 0;
  int64_t num_query_groups = 0;     // kv heads; == heads for multi-head attention
  // kv_channels: the head dimension. Megatron's default is hidden_size / heads; Qwen3 sets it
  // apart from the width (Qwen3-0.6B: hidden 1024, 16 heads of 128), so the query and the
  // attention output are heads x kv_channels wide, not hidden_size.
  int64_t kv_channels = 0;
  // qk_layernorm: RMSNorm (one learnable weight of kv_channels, shared by the heads) over each
  // head of q and of k, after the qkv projection and before RoPE (Qwen3, Megatron).
  bool qk_layernorm = false;
  // qk_layernorm_scope: projection: one RMSNorm over the whole q projection (weight of q_dim())
  // and one over the whole k projection (weight of kv_dim()) instead of per head (OLMoE).
  bool qk_norm_whole = false;
  int64_t ffn_hidden_size = 0;
  bool layernorm = true;            // false: RMSNorm
  double norm_epsilon = 1e-5;
  bool swiglu = false;              // false: GELU (tanh)
  bool rope = false;                // false: learned absolute positions
  double rotary_base = 10000;
  // use_rope_scaling and rope_scaling_*: Llama-3.1/3.2's frequency scaling (core/util/rope_scaling.h).
  RopeScaling rope_scaling;
  // sliding_window (Mistral): query t attends to keys j with t - sliding_window < j <= t, i.e.
  // itself and the sliding_window - 1 tokens before it (transformers' sliding_window_overlay:
  // kv_idx > q_idx - sliding_window). 0: full causal attention.
  int64_t sliding_window = 0;
  bool untied = false;              // separate output head
  bool bias = true;                 // biases in linear layers
  // add_qkv_bias: a bias on the q, k and v projections only (Qwen2); implied by `bias`.
  bool add_qkv_bias = false;
  double init_method_std = 0.02;
  MoeSpec moe;

  int64_t head_dim() const { return kv_channels > 0 ? kv_channels : hidden_size / num_attention_heads; }
  int64_t q_dim() const { return num_attention_heads * head_dim(); }  // == hidden_size unless kv_channels is set
  int64_t kv_dim() const { return num_query_groups * head_dim(); }
  int64_t qkv_dim() const { return q_dim() + 2 * kv_dim(); }
  bool qkv_bias() const { return bias || add_qkv_bias; }
  // Widths of the q and k norm weights (qk_layernorm): a head, or the whole projection.
  int64_t q_norm_dim() const { return qk_norm_whole ? q_dim() : head_dim(); }
  int64_t k_norm_dim() const { return qk_norm_whole ? kv_dim() : head_dim(); }
  int64_t fc_dim() const { return swiglu ? 2 * ffn_hidden_size : ffn_hidden_size; }
  bool is_moe_layer(int64_t l) const { return moe.enabled() && moe.moe_layers.at(static_cast<size_t>(l)); }
  int64_t num_moe_layers() const;
  // Parameter count (with the padded vocabulary).
  int64_t num_parameters() const;
  // Parameters a token goes through: the routed experts it does not choose left out (and the
  // embedding table, as the MoE literature counts "active" parameters).
  int64_t num_active_parameters() const;
  // Training FLOPs per token (forward + backward): 6 * matmul params + attention, as in the
  // PaLM paper's MFU accounting (attention counted causal-full: 6 * L * C * T). MoE layers count
  // the router, the top-k experts and the shared expert (the active matmul parameters). A sliding
  // window counts the keys each query sees instead of T.
  double flops_per_token() const;

  static ModelSpec from_config(const config::Value& params);  // checks consistency
  // One line for --dry-run and logs, e.g. "llama 16 layers, hidden 2048, heads 32/8, 1498482688
  // parameters"; MoE models add experts, top-k, MoE layers and active parameters.
  std::string summary() const;
};

// Adds every model key (type, default, range, doc) to a backend's schema.
void add_model_schema(config::Schema& s);

}  // namespace primus::train
