#include "train/tensor_parallel.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/util/error.h"

namespace primus::train {

namespace {

// How one global tensor is cut. Row parts: the tensor's rows are consecutive parts (q, k, v of the
// fused QKV; gate, up of SwiGLU), each split evenly over the ranks; a rank's rows are its slice of
// every part, in part order. Columns: every row's columns split evenly.
struct Cut {
  enum Kind { Replicated, RowParts, Columns } kind = Replicated;
  std::vector<int64_t> parts;  // RowParts: rows of each part
  int64_t kv_first = -1;       // RowParts: the first key/value part (q|k|v: 1), -1: none
  int64_t row_len = 1;         // elements per row
  bool partial = false;        // Replicated: gradients summed over the group
};

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

Cut cut_of(const ParamTensor& t, const ModelSpec& m, bool sp) {
  const int64_t C = m.hidden_size, QD = m.q_dim(), KVD = m.kv_dim(), F = m.ffn_hidden_size;
  const std::vector<int64_t> fc_parts = m.swiglu ? std::vector<int64_t>{F, F} : std::vector<int64_t>{F};
  Cut c;
  const std::string& n = t.name;
  if (ends_with(n, "moe.router.weight")) {
    // Every rank routes the whole batch alike; the logits' gradient comes from each rank's part of
    // the experts' outputs (partial), the aux and z terms counted once over the group.
    c.kind = Cut::Replicated, c.partial = true;
  } else if (ends_with(n, "moe.router.expert_bias")) {
    c.kind = Cut::Replicated;
  } else if (ends_with(n, "moe.experts.fc.weight")) {
    // [E, 2 Fe, C]: every expert's gate and up rows split as the dense MLP's.
    const int64_t E = t.shape.at(0), Fe = t.shape.at(1) / 2;
    c.kind = Cut::RowParts, c.parts.assign(size_t(2 * E), Fe), c.row_len = C;
  } else if (ends_with(n, "moe.shared.fc.weight")) {
    const int64_t Fs = t.shape.at(0) / 2;
    c.kind = Cut::RowParts, c.parts = {Fs, Fs}, c.row_len = C;
  } else if (ends_with(n, "moe.experts.proj.weight") || ends_with(n, "moe.shared.proj.weight")) {
    c.kind = Cut::Columns, c.row_len = t.shape.back();  // every expert's down projection, row-parallel
  } else if (n == "embedding.weight" || n == "output_layer.weight") {
    c.kind = Cut::RowParts, c.parts = {m.padded_vocab_size}, c.row_len = C;
  } else if (n == "position_embedding.weight" || ends_with(n, "attn.proj.bias") || ends_with(n, "mlp.proj.bias")) {
    // Added once after the row-parallel sum; their gradients come from the whole (gathered)
    // output gradient, so every rank computes the same one.
    c.kind = Cut::Replicated;
  } else if (n.rfind("final_norm.", 0) == 0 || ends_with(n, "norm1.weight") || ends_with(n, "norm1.bias") ||
             ends_with(n, "norm2.weight") || ends_with(n, "norm2.bias")) {
    c.kind = Cut::Replicated, c.partial = sp;
  } else if (ends_with(n, "attn.q_norm.weight") || ends_with(n, "attn.k_norm.weight")) {
    c.kind = Cut::Replicated, c.partial = true;  // one weight shared by the heads of every rank
  } else if (ends_with(n, "attn.qkv.weight")) {
    c.kind = Cut::RowParts, c.parts = {QD, KVD, KVD}, c.row_len = C, c.kv_first = 1;
  } else if (ends_with(n, "attn.qkv.bias")) {
    c.kind = Cut::RowParts, c.parts = {QD, KVD, KVD}, c.kv_first = 1;
  } else if (ends_with(n, "mlp.fc.weight")) {
    c.kind = Cut::RowParts, c.parts = fc_parts, c.row_len = C;
  } else if (ends_with(n, "mlp.fc.bias")) {
    c.kind = Cut::RowParts, c.parts = fc_parts;
  } else if (ends_with(n, "attn.proj.weight") || ends_with(n, "mlp.proj.weight")) {
    c.kind = Cut::Columns, c.row_len = t.shape.at(1);
  } else {
    throw RuntimeError(fmt::format("tensor parallelism: no split is defined for parameter '{}'", n));
  }
  return c;
}

void check_divides(int tp, int64_t n, const char* what, const char* key) {
  if (n % tp != 0) {
    throw ConfigError(fmt::format("tensor_model_parallel_size {} does not divide {} {} ({})", tp, what, n, key));
  }
}

}  // namespace

TpShardMap::TpShardMap(const ModelSpec& global, int tp, int rank, bool sequence_parallel)
    : ModelShardMap(global, tp, rank), sp_(sequence_parallel) {
  if (tp < 1 || rank < 0 || rank >= tp) throw RuntimeError(fmt::format("tensor-parallel rank {} of {}", rank, tp));
  if (global.qk_layernorm && global.qk_norm_whole && tp > 1) {
    throw ConfigError("tensor_model_parallel_size > 1 with qk_layernorm_scope: projection is not implemented yet (the "
                      "norm spans the heads of every rank)");
  }
  check_divides(tp, global.num_attention_heads, "num_attention_heads", "each rank takes whole heads");
  const int64_t KV = global.num_query_groups;
  if (tp > KV) {  // Megatron's replication: tp / KV consecutive ranks share one key/value group
    if (tp % KV != 0) {
      throw ConfigError(fmt::format("tensor_model_parallel_size {} is above num_query_groups {} but not a multiple of "
                                    "it (each key/value group is replicated on tp / num_query_groups ranks)",
                                    tp, KV));
    }
    kv_replicas_ = static_cast<int>(tp / KV);
  } else {
    check_divides(tp, KV, "num_query_groups", "each rank takes whole key/value groups");
  }
  check_divides(tp, global.ffn_hidden_size, "ffn_hidden_size", "each rank takes a slice of the MLP");
  if (global.moe.enabled()) {
    check_divides(tp, global.moe.ffn_hidden_size, "moe_ffn_hidden_size", "each rank takes a slice of every expert");
    check_divides(tp, global.moe.shared_ffn_hidden_size, "moe_shared_expert_intermediate_size",
                  "each rank takes a slice of the shared expert");
  }
  if (global.padded_vocab_size % tp != 0) {
    throw ConfigError(fmt::format("tensor_model_parallel_size {} does not divide the padded vocabulary {} (vocab_size "
                                  "{} rounded up by make_vocab_size_divisible_by): set make_vocab_size_divisible_by "
                                  "to a multiple of {}",
                                  tp, global.padded_vocab_size, global.vocab_size, tp));
  }
  local_ = global;
  local_.kv_channels = global.head_dim();
  local_.num_attention_heads = global.num_attention_heads / tp;
  local_.num_query_groups = kv_replicas_ > 1 ? 1 : global.num_query_groups / tp;
  local_.ffn_hidden_size = global.ffn_hidden_size / tp;
  local_.moe.ffn_hidden_size = global.moe.ffn_hidden_size / tp;
  local_.moe.shared_ffn_hidden_size = global.moe.shared_ffn_hidden_size / tp;
  local_.padded_vocab_size = global.padded_vocab_size / tp;
  vocab_begin_ = rank * local_.padded_vocab_size;
  // The real classes among this rank's rows: the softmax runs over real tokens only.
  local_.vocab_size = std::clamp<int64_t>(global.vocab_size - vocab_begin_, 0, local_.padded_vocab_size);

  global_layout_ = make_param_layout(global_);
  local_layout_ = make_param_layout(local_);
  if (global_layout_.tensors.size() != local_layout_.tensors.size()) {
    throw RuntimeError("tensor parallelism: the local layout has other tensors than the global one");
  }
  for (size_t i = 0; i < global_layout_.tensors.size(); ++i) {
    const ParamTensor& g = global_layout_.tensors[i];
    const ParamTensor& l = local_layout_.tensors[i];
    if (g.name != l.name) throw RuntimeError(fmt::format("tensor parallelism: '{}' vs '{}'", g.name, l.name));
    const Cut c = cut_of(g, global_, sequence_parallel);
    replicated_.push_back(c.kind == Cut::Replicated);
    partial_.push_back(c.partial);
    int64_t at = l.offset;
    const size_t first = pieces_.size();
    auto add = [&](int64_t global_off, int64_t count, bool shared = false) {
      // Runs that continue each other merge, within one tensor (a piece never spans two) and of
      // one kind (shared or not).
      if (pieces_.size() > first && pieces_.back().local + pieces_.back().count == at &&
          pieces_.back().global + pieces_.back().count == global_off && pieces_.back().shared == shared) {
        pieces_.back().count += count;
      } else {
        pieces_.push_back({at, global_off, count, shared});
      }
      at += count;
    };
    if (c.kind == Cut::Replicated) {
      add(g.offset, g.numel);
    } else if (c.kind == Cut::RowParts) {
      int64_t part_begin = 0;
      for (size_t k = 0; k < c.parts.size(); ++k) {
        const int64_t rows = c.parts[k];
        const bool kv = c.kv_first >= 0 && int64_t(k) >= c.kv_first;
        if (kv && kv_replicas_ > 1) {  // one whole group: the (rank / replicas)-th
          const int64_t mine = rows / KV, group = rank / kv_replicas_;
          add(g.offset + (part_begin + group * mine) * c.row_len, mine * c.row_len, true);
        } else {
          const int64_t mine = rows / tp;
          add(g.offset + (part_begin + rank * mine) * c.row_len, mine * c.row_len);
        }
        part_begin += rows;
      }
      if (kv_replicas_ > 1 && c.kv_first >= 0) {
        TpKvExchange x;
        x.tensor = i;
        int64_t before = 0;
        for (int64_t k = 0; k < c.kv_first; ++k) before += c.parts[size_t(k)];
        x.global_begin = g.offset + before * c.row_len;
        x.elems = g.offset + g.numel - x.global_begin;
        for (size_t q = first; q < pieces_.size(); ++q)
          if (pieces_[q].shared) x.pieces.push_back(pieces_[q]);
        kv_exchanges_.push_back(std::move(x));
      }
    } else {
      const int64_t rows = g.numel / c.row_len, mine = c.row_len / tp;
      for (int64_t r = 0; r < rows; ++r) add(g.offset + r * c.row_len + rank * mine, mine);
    }
    if (at != l.offset + l.numel) {
      throw RuntimeError(fmt::format("tensor parallelism: '{}' maps {} of its {} local elements", g.name,
                                     at - l.offset, l.numel));
    }
  }
}

std::vector<TpPiece> TpShardMap::owned_pieces() const {
  if (rank_ == 0) return pieces_;  // the first replica of the first key/value group too
  std::vector<TpPiece> owned;
  size_t t = 0;  // the tensor of the piece (pieces run in tensor order)
  for (const TpPiece& p : pieces_) {
    while (p.local >= local_layout_.tensors[t].offset + local_layout_.tensors[t].numel) ++t;
    if (!replicated_[t] && (!p.shared || counts_kv())) owned.push_back(p);
  }
  return owned;
}

std::vector<TpPiece> TpShardMap::owned_pieces_of(int k) const {
  return k == rank_ ? owned_pieces() : TpShardMap(global_, size_, k, sp_).owned_pieces();
}

}  // namespace primus::train
