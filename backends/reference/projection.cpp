// The reference backend's side of `primus projection`: an analytical count of the buffers its
// model (model.cpp, moe_layer.cpp) and trainer (trainer.cpp) allocate, all fp32 host memory. The
// reference keeps every activation (it has no recompute policy) and computes on the master
// weights themselves (no separate compute copy).
#include "backends/reference/projection.h"

#include <fmt/format.h>

#include <algorithm>

#include "backends/reference/args.h"
#include "backends/reference/register.h"
#include "parallel/data_parallel.h"
#include "train/param_layout.h"
#include "turbo/kernels/cpu/moe.h"

namespace primus::backends::reference {

namespace {
// The process beside its buffers: the primus binary's resident code and data, the C++ and OpenMP
// runtimes, the data loader (rank 0, which tokenizes a text input, holds a few MiB more), and
// with several ranks the Gloo plugin, its library and threads. Measured as the peak resident set
// (VmHWM, the `mem_gib` the trainer records) through the last step of a run whose buffers are under
// 1 MiB (1 layer, width 32, bytes of tinyshakespeare), less those buffers: 17.3 MiB in one process,
// 20.2 MiB on the largest rank of 2 (Debian 12, glibc 2.36, 2 cores; docs/projection.md "CPU
// processes" has the command). More cores add OpenMP threads and malloc arenas, a little each.
constexpr double kReferenceProcessMiB = 17.3;
constexpr double kReferenceRankMiB = 20.2;
}  // namespace

train::MemoryProjection project_reference_memory(const ReferenceArgs& a, const train::ProjectionLayout& lay) {
  const train::ModelSpec& s = a.model;
  const double f = 4;  // fp32
  const double N = double(lay.micro_batch) * double(s.seq_length), C = double(s.hidden_size);
  const double KVD = double(s.kv_dim()), H = double(s.num_attention_heads), QD = double(s.q_dim());
  const double P = double(train::make_param_layout(s).total);
  train::MemoryProjection m;
  m.source = "analytical count of the reference backend's fp32 buffers";
  m.add("master_weights", "fp32 weights (the reference computes on them)", P * f);
  m.add("gradients", "fp32 gradients", P * f);
  const bool zero1 = lay.zero1 && lay.gpus > 1;
  const parallel::ShardLayout shards = parallel::shard_layout(int64_t(P), int(std::max<int64_t>(1, lay.gpus)));
  const double owned = zero1 ? double(shards.shard) : P;
  m.add("optimizer_state", zero1 ? fmt::format("AdamW m, v: this rank's 1/{} shard (ZeRO-1)", lay.gpus)
                                 : std::string("AdamW m, v (fp32)"),
        2 * owned * f);
  // Per layer: what model.cpp sizes for the backward.
  double layers = 0, moe = 0;
  for (int64_t l = 0; l < s.num_layers; ++l) {
    double e = N * (C /*x_in*/ + C /*ln1*/ + 2 /*mean, rstd*/ + QD + 2 * KVD /*q, k, v*/ + QD /*att*/ + H /*lse*/ +
                    C /*x2*/ + C /*ln2*/ + 2);
    if (s.rope) e += N * (QD + KVD);  // rotated q, k
    if (s.qk_layernorm) e += N * (QD + KVD + H + double(s.num_query_groups));  // q, k before the norms; rstd per head
    if (s.is_moe_layer(l)) {
      const train::MoeSpec& x = s.moe;
      const double E = double(x.num_experts), K = double(x.topk), F = double(x.ffn_hidden_size);
      const double Fs = double(x.shared_ffn_hidden_size);
      const double M = double(turbo::cpu::moe_permuted_rows_max(int64_t(N), x.topk, x.num_experts, 1));
      // logits, probs, dlogits [N,E]; weight, idx, rows, dweight [N,K]; counts, offsets; the
      // permuted rows xp, h, a, yp and their gradients; the shared expert's buffers.
      moe += f * (3 * N * E + 4 * N * K + 4 * E + M * (C + 2 * F + F + C) * 2 +
                  (Fs > 0 ? N * (2 * Fs + Fs + C + Fs + 2 * Fs) : 0));
    } else {
      e += N * (double(s.fc_dim()) + double(s.ffn_hidden_size));  // fc, act
    }
    layers += e * f;
  }
  m.add("activations", "saved for the backward, per layer (the reference recomputes nothing)", layers);
  m.add("activations", "MoE routing and expert buffers", moe);
  const double V = double(s.padded_vocab_size);
  const double FC = double(s.fc_dim()), F = double(s.ffn_hidden_size);
  m.add("activations", "LM head logits and losses (all rows), final norm", f * N * (V + 1 + 2 * C + 2) + 4 * N);
  m.add("activations", "the backward's working gradients",
        f * N * (2 * C + 2 * QD + 2 * KVD + (s.rope ? QD + KVD : 0) + (s.qk_layernorm ? QD + KVD : 0) + FC + F));
  if (zero1) {
    const int64_t be = std::min(a.dp.bucket_elems(sizeof(float)), shards.shard);
    m.add("comm", "ZeRO-1: the averaged gradient shard", double(shards.shard) * f);
    m.add("comm", "ZeRO-1: one bucket from every rank (reduce-scatter / all-gather staging)",
          double(lay.gpus) * double(be) * f);
    // The process group's own: Gloo's reduce-scatter receives every rank's piece of the bucket
    // into a buffer it keeps, and sums it in rank order into one more bucket (the socket ring keeps
    // the same: a copy of its input and a chunk to receive into).
    m.add("comm", "ZeRO-1: the process group's receive buffer, one bucket from every rank",
          double(lay.gpus) * double(be) * f);
    m.add("comm", "ZeRO-1: the process group's sum of one bucket", double(be) * f);
  }
  m.notes.push_back("the reference backend runs on the CPU: these are host bytes per process (resident set)");
  return m;
}

void register_reference_projection() {
  train::BackendProjector p;
  p.spec = [](const BackendArgs& args) -> const train::ModelSpec& {
    return dynamic_cast<const ReferenceArgs&>(args).model;
  };
  p.layout = [](const BackendArgs& args) {
    const auto& a = dynamic_cast<const ReferenceArgs&>(args);
    train::ProjectionLayout l = train::batch_layout(a.train, a.model.seq_length);
    l.zero1 = a.dp.distributed_optimizer && l.gpus > 1;
    l.overlap_grad_reduce = false;  // the reference reduces after the backward
    return l;
  };
  p.memory = [](const BackendArgs& args, const patches::HookTable&, const train::ProjectionLayout& l,
                const train::MemoryProjectionOptions& o) {
    train::MemoryProjection m = project_reference_memory(dynamic_cast<const ReferenceArgs&>(args), l);
    if (o.runtime_gib >= 0) {
      m.add("runtime", "the process beside its buffers (stated)", o.runtime_gib * double(size_t{1} << 30));
    } else {
      const bool ranks = l.gpus > 1;
      const double mib = ranks ? kReferenceRankMiB : kReferenceProcessMiB;
      m.add("runtime",
            fmt::format("the process beside its buffers: code, libraries, the data loader{} (a tiny run's peak "
                        "resident set on 2 cores; --runtime-gib states another)",
                        ranks ? ", the Gloo engine" : ""),
            mib * double(size_t{1} << 20));
    }
    return m;
  };
  p.cost.act_bytes = 4;
  p.cost.weight_bytes = 4;
  p.cost.optimizer_bytes_per_param = 36;  // AdamW 28 (no bf16 copy), grad norm 4, zero_grad 4 (every gradient)
  train::register_backend_projector(kName, std::move(p));
}

}  // namespace primus::backends::reference
