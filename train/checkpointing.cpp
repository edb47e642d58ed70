#include "train/checkpointing.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/util/error.h"

namespace primus::train {

namespace {
nlohmann::json moe_json(const MoeSpec& e) {
  nlohmann::json j = {{"num_experts", e.num_experts}, {"topk", e.topk}, {"ffn_hidden_size", e.ffn_hidden_size},
          {"shared_ffn_hidden_size", e.shared_ffn_hidden_size}, {"sigmoid", e.sigmoid}, {"pre_softmax", e.pre_softmax},
          {"topk_scaling_factor", e.topk_scaling_factor}, {"num_groups", e.num_groups}, {"group_topk", e.group_topk},
          {"expert_bias", e.expert_bias}, {"bias_update_rate", e.bias_update_rate}, {"aux_loss_coeff", e.aux_loss_coeff},
          {"z_loss_coeff", e.z_loss_coeff}, {"capacity_factor", e.capacity_factor},
          {"drop_by_position", e.drop_by_position}, {"moe_layers", e.moe_layers}};
  // Only when set, so that the records of batch-wise runs stay what they were. One type keeps the
  // record it always had (aux_loss_coeff is that type's coefficient); a list of types records each
  // listed type with its own coefficient.
  if (e.balance_types() == 1) {
    j["aux_loss_coeff"] = e.primary_coeff();
    if (e.seq_aux_loss) j["seq_aux_loss"] = true;
    if (e.global_aux_loss) j["global_aux_loss"] = true;
  } else {
    j["balance"] = nlohmann::json::object();
    if (e.batch_aux_loss) j["balance"]["aux_loss"] = e.aux_loss_coeff;
    if (e.seq_aux_loss) j["balance"]["seq_aux_loss"] = e.seq_aux_loss_coeff;
    if (e.global_aux_loss) j["balance"]["global_aux_loss"] = e.global_aux_loss_coeff;
  }
  if (e.force_load_balancing) j["force_load_balancing"] = true;
  return j;
}
MoeSpec moe_from_json(const nlohmann::json& j) {
  MoeSpec e;
  e.num_experts = j.at("num_experts");
  e.topk = j.at("topk");
  e.ffn_hidden_size = j.at("ffn_hidden_size");
  e.shared_ffn_hidden_size = j.at("shared_ffn_hidden_size");
  e.sigmoid = j.at("sigmoid");
  e.pre_softmax = j.at("pre_softmax");
  e.topk_scaling_factor = j.at("topk_scaling_factor");
  e.num_groups = j.at("num_groups");
  e.group_topk = j.at("group_topk");
  e.expert_bias = j.at("expert_bias");
  e.bias_update_rate = j.at("bias_update_rate");

  e.z_loss_coeff = j.at("z_loss_coeff");
  e.capacity_factor = j.at("capacity_factor");
  e.drop_by_position = j.at("drop_by_position");
  e.moe_layers = j.at("moe_layers").get<std::vector<bool>>();
  if (j.contains("balance")) {
    const nlohmann::json& b = j.at("balance");
    e.batch_aux_loss = b.contains("aux_loss");
    e.seq_aux_loss = b.contains("seq_aux_loss");
    e.global_aux_loss = b.contains("global_aux_loss");
    e.aux_loss_coeff = b.value("aux_loss", 0.0);
    e.seq_aux_loss_coeff = b.value("seq_aux_loss", 0.0);
    e.global_aux_loss_coeff = b.value("global_aux_loss", 0.0);
  } else {
    e.seq_aux_loss = j.value("seq_aux_loss", false);
    e.global_aux_loss = j.value("global_aux_loss", false);
    e.batch_aux_loss = !e.seq_aux_loss && !e.global_aux_loss;
    const double c = j.at("aux_loss_coeff");
    (e.seq_aux_loss ? e.seq_aux_loss_coeff : e.global_aux_loss ? e.global_aux_loss_coeff : e.aux_loss_coeff) = c;
  }
  e.force_load_balancing = j.value("force_load_balancing", false);
  return e;
}
}  // namespace

nlohmann::json spec_json(const ModelSpec& m) {
  // A dense model's spec has no "moe" key, so that checkpoints saved before MoE existed still
  // compare equal.
  nlohmann::json j = {{"model_type", m.model_type}, {"vocab_size", m.vocab_size}, {"padded_vocab_size", m.padded_vocab_size},
          {"seq_length", m.seq_length}, {"num_layers", m.num_layers}, {"hidden_size", m.hidden_size},
          {"num_attention_heads", m.num_attention_heads}, {"num_query_groups", m.num_query_groups},
          {"ffn_hidden_size", m.ffn_hidden_size}, {"layernorm", m.layernorm}, {"norm_epsilon", m.norm_epsilon},
          {"swiglu", m.swiglu}, {"rope", m.rope}, {"rotary_base", m.rotary_base}, {"untied", m.untied},
          {"bias", m.bias}, {"init_method_std", m.init_method_std}};
  if (m.moe.enabled()) j["moe"] = moe_json(m.moe);
  // Written only when they differ from what a checkpoint without them meant, so older
  // checkpoints and today's Llama / GPT-2 ones stay byte-identical.
  if (m.kv_channels > 0 && m.kv_channels * m.num_attention_heads != m.hidden_size) j["kv_channels"] = m.kv_channels;
  if (m.qk_layernorm) j["qk_layernorm"] = true;
  if (m.qk_norm_whole) j["qk_norm_whole"] = true;
  if (m.add_qkv_bias) j["add_qkv_bias"] = true;
  if (m.sliding_window > 0) j["sliding_window"] = m.sliding_window;
  if (m.rope_scaling.enabled) {
    j["rope_scaling"] = {{"factor", m.rope_scaling.factor},
                         {"low_freq_factor", m.rope_scaling.low_freq_factor},
                         {"high_freq_factor", m.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", m.rope_scaling.original_max_position}};
  }
  return j;
}

ModelSpec spec_from_json(const nlohmann::json& j) {
  ModelSpec m;
  m.model_type = j.at("model_type");
  m.vocab_size = j.at("vocab_size");
  m.padded_vocab_size = j.at("padded_vocab_size");
  m.seq_length = j.at("seq_length");
  m.num_layers = j.at("num_layers");
  m.hidden_size = j.at("hidden_size");
  m.num_attention_heads = j.at("num_attention_heads");
  m.num_query_groups = j.at("num_query_groups");
  m.ffn_hidden_size = j.at("ffn_hidden_size");
  m.layernorm = j.at("layernorm");
  m.norm_epsilon = j.at("norm_epsilon");
  m.swiglu = j.at("swiglu");
  m.rope = j.at("rope");
  m.rotary_base = j.at("rotary_base");
  m.untied = j.at("untied");
  m.bias = j.at("bias");
  m.init_method_std = j.at("init_method_std");
  if (j.contains("moe")) m.moe = moe_from_json(j.at("moe"));  // absent: a dense model's checkpoint
  m.kv_channels = j.value("kv_channels", m.hidden_size / std::max<int64_t>(1, m.num_attention_heads));
  m.qk_layernorm = j.value("qk_layernorm", false);
  m.qk_norm_whole = j.value("qk_norm_whole", false);
  m.add_qkv_bias = j.value("add_qkv_bias", false);
  m.sliding_window = j.value("sliding_window", int64_t{0});
  if (j.contains("rope_scaling")) {  // absent: the plain rotation
    const nlohmann::json& r = j.at("rope_scaling");
    m.rope_scaling.enabled = true;
    m.rope_scaling.factor = r.at("factor");
    m.rope_scaling.low_freq_factor = r.at("low_freq_factor");
    m.rope_scaling.high_freq_factor = r.at("high_freq_factor");
    m.rope_scaling.original_max_position = r.at("original_max_position_embeddings");
  }
  return m;
}

io::CheckpointData pack_checkpoint(const ModelSpec& spec, const ParamLayout& layout, const float* params,
                                   const float* m, const float* v, nlohmann::json state) {
  io::CheckpointData d;
  for (auto& t : layout.tensors) {
    for (auto& part : t.hf) {
      std::vector<float> buf;
      auto shape = to_hf(t, part, params, buf);
      d.model.emplace(part.name, io::TensorBlob::from_vector(shape, std::move(buf)));
    }
  }
  if (m && v) {
    size_t bytes = sizeof(float) * static_cast<size_t>(layout.total);
    d.optimizer.emplace("exp_avg", io::TensorBlob::borrow(io::DType::F32, {layout.total}, m, bytes));
    d.optimizer.emplace("exp_avg_sq", io::TensorBlob::borrow(io::DType::F32, {layout.total}, v, bytes));
  }
  state["model_spec"] = spec_json(spec);
  d.state = std::move(state);
  return d;
}

namespace {
// A spec record without what SpecMatch::Weights lets differ.
nlohmann::json weights_part(nlohmann::json j) {
  if (!j.is_object()) return j;
  if (j.value("rope", false)) j.erase("seq_length");
  for (const char* k : {"init_method_std", "rotary_base", "rope_scaling", "sliding_window"}) j.erase(k);
  if (j.contains("moe") && j["moe"].is_object()) {
    for (const char* k : {"bias_update_rate", "aux_loss_coeff", "z_loss_coeff", "capacity_factor", "drop_by_position",
                          "seq_aux_loss", "global_aux_loss", "balance", "force_load_balancing"})
      j["moe"].erase(k);
  }
  return j;
}
}  // namespace

void unpack_checkpoint(const io::CheckpointData& d, const std::filesystem::path& dir, const ModelSpec& spec,
                       const ParamLayout& layout, float* params, float* m, float* v, SpecMatch match) {
  const bool differs = d.state.contains("model_spec") &&
                       (match == SpecMatch::Run ? d.state["model_spec"] != spec_json(spec)
                                                : weights_part(d.state["model_spec"]) != weights_part(spec_json(spec)));
  if (differs) {
    throw FormatError(fmt::format("checkpoint {} was saved for another model: saved {}, configured {}", dir.string(),
                                  d.state["model_spec"].dump(), spec_json(spec).dump()));
  }
  for (auto& t : layout.tensors) {
    for (auto& part : t.hf) {
      auto it = d.model.find(part.name);
      if (it == d.model.end()) {
        throw FormatError(fmt::format("checkpoint {}: tensor '{}' is missing from {}", dir.string(), part.name,
                                      io::kModelFile));
      }
      if (it->second.dtype() != io::DType::F32) {
        throw FormatError(fmt::format("checkpoint {}: tensor '{}' is {}, expected F32", dir.string(), part.name,
                                      io::dtype_name(it->second.dtype())));
      }
      try {
        from_hf(t, part, it->second.as<float>().data(), it->second.shape(), params);
      } catch (const FormatError& e) {
        throw FormatError(fmt::format("checkpoint {}: {}", dir.string(), e.what()));
      }
    }
  }
  if (!m || !v) return;
  for (auto [name, dst] : {std::pair{"exp_avg", m}, std::pair{"exp_avg_sq", v}}) {
    auto it = d.optimizer.find(name);
    if (it == d.optimizer.end() || it->second.numel() != static_cast<uint64_t>(layout.total) ||
        it->second.dtype() != io::DType::F32) {
      throw FormatError(fmt::format("checkpoint {}: optimizer tensor '{}' is missing or has the wrong size",
                                    dir.string(), name));
    }
    std::memcpy(dst, it->second.data(), it->second.nbytes());
  }
}

}  // namespace primus::train
