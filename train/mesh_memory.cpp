#include "train/mesh_memory.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/util/error.h"
#include "train/expert_parallel.h"
#include "train/tensor_parallel.h"

namespace primus::train {

namespace {

// Parameters of the rank's slice of the model and of its largest layer: the tensor-parallel split
// where the model has one, else an even cut; the routed experts then cut over the ep ranks.
void per_rank_parameters(const ModelSpec& m, int64_t tp, int64_t ep, int64_t* total, int64_t* largest_layer) {
  ParamLayout layout;
  if (tp == 1) {
    layout = make_param_layout(m);
  } else {
    try {
      layout = TpShardMap(m, static_cast<int>(tp), 0, false).local_layout();
    } catch (const ConfigError&) {
      layout = make_param_layout(m);
      for (auto& t : layout.tensors) t.numel = (t.numel + tp - 1) / tp;
    }
  }
  // Expert parallelism: each rank holds 1/ep of every MoE layer's routed experts.
  if (ep > 1) {
    for (auto& t : layout.tensors)
      if (is_routed_expert_tensor(t.name)) t.numel = (t.numel + ep - 1) / ep;
  }
  *total = 0;
  std::vector<int64_t> layer(static_cast<size_t>(m.num_layers), 0);
  for (const auto& t : layout.tensors) {
    *total += t.numel;
    if (t.name.rfind("layers.", 0) == 0) layer.at(static_cast<size_t>(std::stoll(t.name.substr(7)))) += t.numel;
  }
  *largest_layer = layer.empty() ? 0 : *std::max_element(layer.begin(), layer.end());
}

}  // namespace

MeshMemory mesh_memory_per_rank(const ModelSpec& m, const parallel::ParallelSizes& s, int64_t micro_batch,
                                int64_t seq_length) {
  using parallel::Dim;
  using parallel::DpSharding;
  const int64_t tp = s[Dim::TP], cp = s[Dim::CP], shards = s[Dim::DP] * cp;
  MeshMemory r;
  int64_t largest = 0;
  per_rank_parameters(m, tp, s[Dim::EP], &r.parameters_per_rank, &largest);
  const double P = static_cast<double>(r.parameters_per_rank), Lmax = static_cast<double>(largest);
  const bool optim = s.sharding != DpSharding::NoShard;
  const bool grads = parallel::shards_gradients(s.sharding);
  const bool params = s.sharding == DpSharding::OptimGradsParams;
  r.weights = params ? 2.0 * (P / shards + Lmax) : 2.0 * P;
  r.master = optim ? 4.0 * P / shards : 4.0 * P;
  r.gradients = grads ? 4.0 * (P / shards + Lmax) : 4.0 * P;
  r.optimizer = optim ? 8.0 * P / shards : 8.0 * P;

  // Saved per token and layer (bf16): hidden-sized tensors (layer input, the two norm outputs, the
  // residual after attention), q/k/v, the attention output, the MLP's input-side product and its
  // activation; the attention's log-sum-exp in fp32. MoE layers keep their chosen experts'.
  const double tokens = static_cast<double>(micro_batch) * static_cast<double>(seq_length) / static_cast<double>(cp);
  const double C = static_cast<double>(m.hidden_size);
  const double hidden = 4.0 * C / (s.sequence_parallel ? tp : 1);
  double acts = 0;
  for (int64_t l = 0; l < m.num_layers; ++l) {
    double fc = static_cast<double>(m.fc_dim()), act = static_cast<double>(m.ffn_hidden_size);
    if (m.is_moe_layer(l)) {
      const double per_token = static_cast<double>(m.moe.topk * m.moe.ffn_hidden_size + m.moe.shared_ffn_hidden_size);
      fc = 2.0 * per_token;
      act = per_token;
    }
    const double split = static_cast<double>(m.qkv_dim() + m.q_dim()) + fc + act;
    acts += tokens * (2.0 * (hidden + split / tp) + 4.0 * static_cast<double>(m.num_attention_heads) / tp);
  }
  r.activations = acts;
  r.logits = tokens * 2.0 * static_cast<double>(m.padded_vocab_size) / tp;  // bf16, overwritten by their gradient
  return r;
}

std::string describe_mesh_memory(const ModelSpec& m, const parallel::ParallelSizes& s, int64_t micro_batch,
                                  int64_t seq_length) {
  const MeshMemory r = mesh_memory_per_rank(m, s, micro_batch, seq_length);
  auto g = [](double b) { return b / double(size_t{1} << 30); };
  using parallel::Dim;
  return fmt::format(
      "  memory per rank (analytical: bf16 weights + fp32 master, gradients and AdamW moments, activations of a "
      "micro-batch of {} x {} tokens without recompute; not counted: CUDA context, workspaces, buffers): {:.2f}M "
      "parameters after tp {}{}; weights {:.2f} GiB, master {:.2f}, gradients {:.2f}, optimizer {:.2f}, activations "
      "{:.2f}{}, logits {:.2f}; total {:.2f} GiB\n",
      micro_batch, seq_length, r.parameters_per_rank / 1e6, s[Dim::TP],
      s[Dim::EP] > 1 ? fmt::format(" and ep {}", s[Dim::EP]) : "", g(r.weights), g(r.master), g(r.gradients),
      g(r.optimizer), g(r.activations),
      s[Dim::CP] > 1 || s.sequence_parallel
          ? fmt::format(" ({}{}{})", s[Dim::CP] > 1 ? fmt::format("/ cp {}", s[Dim::CP]) : "",
                        s[Dim::CP] > 1 && s.sequence_parallel ? ", " : "",
                        s.sequence_parallel ? "sequence parallel" : "")
          : "",
      g(r.logits), g(r.total()));
}

}  // namespace primus::train
