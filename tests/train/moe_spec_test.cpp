// The MoE part of the model spec: Megatron's keys into MoeSpec, the errors a layout the router
// cannot take gets, the parameter layout (counts, Hugging Face names, the expert bias buffer),
// the checkpoint spec, and which exports are refused.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/config/schema.h"
#include "core/config/yaml_loader.h"
#include "core/util/error.h"
#include "tests/common/tiny_models.h"
#include "train/checkpointing.h"
#include "train/model_spec.h"
#include "train/param_layout.h"

using namespace primus;
using namespace primus::train;

namespace {

config::Value moe_config(int64_t layers = 4) {
  config::Value v = config::Value::map();
  v.set("vocab_size", config::Value::integer(100));
  v.set("num_layers", config::Value::integer(layers));
  v.set("hidden_size", config::Value::integer(32));
  v.set("num_attention_heads", config::Value::integer(4));
  v.set("activation", config::Value::string("swiglu"));
  v.set("add_bias_linear", config::Value::boolean(false));
  v.set("normalization", config::Value::string("RMSNorm"));
  v.set("position_embedding_type", config::Value::string("rope"));
  v.set("num_experts", config::Value::integer(8));
  v.set("moe_router_topk", config::Value::integer(2));
  return v;
}

ModelSpec parse(config::Value v) {
  config::Schema s;
  add_model_schema(s);
  s.validate(v);
  s.apply_defaults(v);
  return ModelSpec::from_config(v);
}

std::string error_of(config::Value v) {
  try {
    parse(std::move(v));
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(MoeSpec, KeysParseWithMegatronNames) {
  config::Value v = moe_config(5);
  v.set("moe_ffn_hidden_size", config::Value::integer(24));
  v.set("moe_shared_expert_intermediate_size", config::Value::integer(40));
  v.set("moe_router_score_function", config::Value::string("sigmoid"));
  v.set("moe_router_num_groups", config::Value::integer(4));
  v.set("moe_router_group_topk", config::Value::integer(2));
  v.set("moe_router_topk_scaling_factor", config::Value::floating(2.5));
  v.set("moe_router_enable_expert_bias", config::Value::boolean(true));
  v.set("moe_first_k_dense_replace", config::Value::integer(1));
  v.set("moe_layer_freq", config::Value::integer(2));
  v.set("moe_expert_capacity_factor", config::Value::floating(1.25));
  v.set("moe_token_drop_policy", config::Value::string("position"));
  ModelSpec m = parse(v);
  EXPECT_EQ(m.moe.num_experts, 8);
  EXPECT_EQ(m.moe.ffn_hidden_size, 24);
  EXPECT_EQ(m.moe.shared_ffn_hidden_size, 40);
  EXPECT_TRUE(m.moe.sigmoid);
  EXPECT_EQ(m.moe.num_groups, 4);
  EXPECT_DOUBLE_EQ(m.moe.topk_scaling_factor, 2.5);
  EXPECT_TRUE(m.moe.drop_by_position);
  // Every second layer from 0, the first dense: layers 2 and 4.
  EXPECT_EQ(m.moe.moe_layers, (std::vector<bool>{false, false, true, false, true}));
  EXPECT_EQ(m.num_moe_layers(), 2);
  // 10 tokens x top-2 / 8 experts x 1.25 = 3.125 -> 4 slots an expert.
  EXPECT_EQ(m.moe.capacity(10), 4);
  v.set("moe_layer_freq", config::Value::list({config::Value::integer(0), config::Value::integer(1),
                                                config::Value::integer(1), config::Value::integer(0),
                                                config::Value::integer(1)}));
  v.set("moe_first_k_dense_replace", config::Value::integer(0));
  EXPECT_EQ(parse(v).moe.moe_layers, (std::vector<bool>{false, true, true, false, true}));
  // Dropless by default; the expert width defaults to ffn_hidden_size.
  ModelSpec d = parse(moe_config());
  EXPECT_EQ(d.moe.capacity(1000), -1);
  EXPECT_EQ(d.moe.ffn_hidden_size, d.ffn_hidden_size);
  EXPECT_FALSE(parse([] {
                 config::Value x = moe_config();
                 x.set("num_experts", config::Value::integer(0));
                 return x;
               }())
                   .moe.enabled());
}

// moe_router_load_balancing_type: which tokens moe_aux_loss_coeff's loss balances. none drops the
// loss (a preset's coefficient included), as in Megatron-LM; Megatron's other types are refused
// by name.
TEST(MoeSpec, LoadBalancingTypeSelectsTheAuxLossOrRefusesByName) {
  config::Value v = moe_config();
  v.set("moe_aux_loss_coeff", config::Value::floating(0.01));
  ModelSpec d = parse(v);
  EXPECT_FALSE(d.moe.seq_aux_loss);
  EXPECT_DOUBLE_EQ(d.moe.aux_loss_coeff, 0.01);
  v.set("moe_router_load_balancing_type", config::Value::string("seq_aux_loss"));
  ModelSpec s = parse(v);
  EXPECT_TRUE(s.moe.seq_aux_loss);
  EXPECT_FALSE(s.moe.batch_aux_loss);
  EXPECT_DOUBLE_EQ(s.moe.seq_aux_loss_coeff, 0.01);
  EXPECT_DOUBLE_EQ(s.moe.aux_loss_coeff, 0.0);
  v.set("moe_router_load_balancing_type", config::Value::string("aux_loss"));
  EXPECT_FALSE(parse(v).moe.seq_aux_loss);
  v.set("moe_router_load_balancing_type", config::Value::string("none"));
  ModelSpec n = parse(v);
  EXPECT_FALSE(n.moe.seq_aux_loss);
  EXPECT_DOUBLE_EQ(n.moe.aux_loss_coeff, 0.0);
  v.set("moe_router_load_balancing_type", config::Value::string("global_aux_loss"));
  ModelSpec g = parse(v);
  EXPECT_TRUE(g.moe.global_aux_loss);
  EXPECT_FALSE(g.moe.seq_aux_loss);
  EXPECT_DOUBLE_EQ(g.moe.global_aux_loss_coeff, 0.01);
  EXPECT_EQ(g.moe.primary_balance(), MoeSpec::Balance::Global);
  EXPECT_FALSE(s.moe.global_aux_loss);
  v.set("moe_router_load_balancing_type", config::Value::string("sinkhorn"));
  const std::string e = error_of(v);
  EXPECT_NE(e.find("moe_router_load_balancing_type 'sinkhorn' is not implemented"), std::string::npos) << e;
  v.set("moe_router_load_balancing_type", config::Value::string("seq-aux"));
  EXPECT_NE(error_of(v).find("moe_router_load_balancing_type"), std::string::npos);
}

// Megatron-LM's list form: moe_router_load_balancing_type lists several types and
// moe_aux_loss_coeff gives one coefficient per type, in the same order. Anything else that mixes
// the two forms, repeats a type, or lists none or sinkhorn is refused by name.
TEST(MoeSpec, LoadBalancingTypeListsTakeOneCoefficientPerType) {
  auto strs = [](std::initializer_list<const char*> v) {
    std::vector<config::Value> out;
    for (const char* s : v) out.push_back(config::Value::string(s));
    return config::Value::list(out);
  };
  auto nums = [](std::initializer_list<double> v) {
    std::vector<config::Value> out;
    for (double d : v) out.push_back(config::Value::floating(d));
    return config::Value::list(out);
  };
  config::Value v = moe_config();
  v.set("moe_router_load_balancing_type", strs({"seq_aux_loss", "global_aux_loss"}));
  v.set("moe_aux_loss_coeff", nums({1e-4, 1e-3}));
  const MoeSpec a = parse(v).moe;
  EXPECT_FALSE(a.batch_aux_loss);
  EXPECT_TRUE(a.seq_aux_loss && a.global_aux_loss);
  EXPECT_DOUBLE_EQ(a.seq_aux_loss_coeff, 1e-4);
  EXPECT_DOUBLE_EQ(a.global_aux_loss_coeff, 1e-3);
  EXPECT_EQ(a.balance_types(), 2);
  EXPECT_EQ(a.primary_balance(), MoeSpec::Balance::Sequence);
  EXPECT_EQ(a.more_balances(), std::vector<MoeSpec::Balance>{MoeSpec::Balance::Global});
  // The order pairs types with coefficients; the logs' primary is the micro-batch's when listed.
  v.set("moe_router_load_balancing_type", strs({"global_aux_loss", "aux_loss", "seq_aux_loss"}));
  v.set("moe_aux_loss_coeff", nums({0.3, 0.1, 0.2}));
  const MoeSpec b = parse(v).moe;
  EXPECT_DOUBLE_EQ(b.aux_loss_coeff, 0.1);
  EXPECT_DOUBLE_EQ(b.seq_aux_loss_coeff, 0.2);
  EXPECT_DOUBLE_EQ(b.global_aux_loss_coeff, 0.3);
  EXPECT_EQ(b.primary_balance(), MoeSpec::Balance::Batch);
  EXPECT_EQ(b.more_balances(), (std::vector<MoeSpec::Balance>{MoeSpec::Balance::Sequence, MoeSpec::Balance::Global}));
  // A one-element list is the plain form.
  v.set("moe_router_load_balancing_type", strs({"seq_aux_loss"}));
  v.set("moe_aux_loss_coeff", nums({0.05}));
  const MoeSpec c = parse(v).moe;
  EXPECT_EQ(c.balance_types(), 1);
  EXPECT_DOUBLE_EQ(c.seq_aux_loss_coeff, 0.05);

  auto refused = [&](config::Value types, config::Value coeffs, const std::string& want) {
    config::Value w = moe_config();
    w.set("moe_router_load_balancing_type", std::move(types));
    w.set("moe_aux_loss_coeff", std::move(coeffs));
    const std::string e = error_of(w);
    EXPECT_NE(e.find(want), std::string::npos) << e;
  };
  refused(strs({"aux_loss", "seq_aux_loss"}), config::Value::floating(0.01),
          "lists 2 types and moe_aux_loss_coeff one number");
  refused(strs({"aux_loss", "seq_aux_loss"}), nums({0.01}), "lists 2 types and moe_aux_loss_coeff 1 numbers");
  refused(config::Value::string("aux_loss"), nums({0.01, 0.02}), "one type and moe_aux_loss_coeff 2 numbers");
  refused(strs({"aux_loss", "aux_loss"}), nums({0.01, 0.02}), "lists 'aux_loss' twice");
  refused(strs({"none", "aux_loss"}), nums({0.0, 0.02}), "'none' stands alone");
  refused(strs({"aux_loss", "sinkhorn"}), nums({0.01, 0.0}), "'sinkhorn' is not implemented");
  refused(strs({"aux_loss", "seq-aux"}), nums({0.01, 0.0}), "'seq-aux' is not one of");
  refused(strs({"aux_loss", "seq_aux_loss"}), nums({0.01, -1.0}), "must be a finite number >= 0");
  refused(config::Value::list({}), config::Value::list({}), "is an empty list");
  refused(config::Value::list({config::Value::integer(1)}), nums({0.01}),
          "lists a value of type integer, not a type name");

  // Unset, both keys take their schema defaults (what `primus config show` lists): the micro-batch
  // loss with coefficient 0.
  config::Value unset = moe_config();
  config::Schema schema;
  add_model_schema(schema);
  schema.apply_defaults(unset);
  ASSERT_NE(unset.find_path("moe_router_load_balancing_type"), nullptr);
  EXPECT_EQ(unset.find_path("moe_router_load_balancing_type")->as_string(), "aux_loss");
  EXPECT_EQ(unset.find_path("moe_aux_loss_coeff")->as_double(), 0.0);
  const MoeSpec d = parse(unset).moe;
  EXPECT_EQ(d.balance_types(), 1);
  EXPECT_EQ(d.primary_balance(), MoeSpec::Balance::Batch);
  EXPECT_EQ(d.primary_coeff(), 0.0);

  // A dense model ignores both keys, but their values are checked all the same.
  config::Value dense = moe_config();
  dense.set("num_experts", config::Value::integer(0));
  dense.set("moe_router_load_balancing_type", strs({"aux_loss", "seq_aux_loss"}));
  dense.set("moe_aux_loss_coeff", nums({0.01, 0.001}));
  EXPECT_EQ(parse(dense).moe.num_experts, 0);
  dense.set("moe_router_load_balancing_type", config::Value::string("seq-aux"));
  dense.set("moe_aux_loss_coeff", config::Value::floating(0.01));
  EXPECT_NE(error_of(dense).find("'seq-aux' is not one of"), std::string::npos) << error_of(dense);
  dense.set("moe_router_load_balancing_type", config::Value::string("aux_loss"));
  dense.set("moe_aux_loss_coeff", config::Value::floating(-1.0));
  EXPECT_NE(error_of(dense).find("must be a finite number >= 0"), std::string::npos) << error_of(dense);
}

// Megatron's moe_router_dtype and moe_token_dispatcher_type: what both backends do is accepted
// (fp32 routing; all-to-all dispatch, and allgather where it is marked for the expert-parallel
// check), the rest refused by name.
TEST(MoeSpec, RouterDtypeAndDispatcherTypeAcceptWhatRunsAndRefuseTheRest) {
  config::Value v = moe_config();
  EXPECT_FALSE(parse(v).moe.allgather_dispatcher);
  v.set("moe_router_dtype", config::Value::string("fp32"));
  v.set("moe_token_dispatcher_type", config::Value::string("alltoall"));
  EXPECT_FALSE(parse(v).moe.allgather_dispatcher);
  v.set("moe_token_dispatcher_type", config::Value::string("allgather"));
  EXPECT_TRUE(parse(v).moe.allgather_dispatcher);
  v.set("moe_token_dispatcher_type", config::Value::string("flex"));
  std::string e = error_of(v);
  EXPECT_NE(e.find("moe_token_dispatcher_type 'flex' (DeepEP / HybridEP) is not implemented"), std::string::npos) << e;
  v.set("moe_token_dispatcher_type", config::Value::string("alltoall"));
  v.set("moe_router_dtype", config::Value::string("fp64"));
  e = error_of(v);
  EXPECT_NE(e.find("moe_router_dtype 'fp64' is not implemented"), std::string::npos) << e;
  v.set("moe_router_dtype", config::Value::string("bf16"));
  EXPECT_NE(error_of(v).find("moe_router_dtype"), std::string::npos);
}

// moe_router_force_load_balancing: parsed, part of the record (it changes the routing), and
// refused where the model would be routed by its weights (a Hugging Face export).
TEST(MoeSpec, ForcedLoadBalancingIsRecordedAndRefusedForExport) {
  config::Value v = moe_config();
  EXPECT_FALSE(parse(v).moe.force_load_balancing);
  v.set("moe_router_force_load_balancing", config::Value::boolean(true));
  ModelSpec m = parse(v);
  EXPECT_TRUE(m.moe.force_load_balancing);
  const nlohmann::json j = spec_json(m);
  EXPECT_EQ(j["moe"]["force_load_balancing"], true);
  EXPECT_TRUE(spec_from_json(j).moe.force_load_balancing);
  ModelSpec mix = primus::testing::tiny_moe(false);
  mix.model_type = "mixtral";
  mix.moe.force_load_balancing = true;
  try {
    hf_config_json(mix, 0);
    ADD_FAILURE() << "exported a forced routing";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("moe_router_force_load_balancing"), std::string::npos) << e.what();
  }
}

TEST(MoeSpec, LayoutsTheRouterCannotTakeAreErrorsNamingTheKey) {
  auto with = [](const char* key, config::Value val) {
    config::Value v = moe_config();
    v.set(key, std::move(val));
    return v;
  };
  EXPECT_NE(error_of(with("moe_router_topk", config::Value::integer(9))).find("moe_router_topk 9 exceeds num_experts 8"),
            std::string::npos);
  config::Value g = with("moe_router_num_groups", config::Value::integer(3));
  EXPECT_NE(error_of(g).find("num_experts 8 is not divisible by moe_router_num_groups 3"), std::string::npos);
  g = with("moe_router_num_groups", config::Value::integer(4));
  g.set("moe_router_group_topk", config::Value::integer(5));
  EXPECT_NE(error_of(g).find("moe_router_group_topk 5 exceeds moe_router_num_groups 4"), std::string::npos);
  g.set("moe_router_group_topk", config::Value::integer(1));
  g.set("moe_router_topk", config::Value::integer(3));  // 3 from one group of 2 experts
  EXPECT_NE(error_of(g).find("exceeds the 2 experts of a group"), std::string::npos);
  EXPECT_NE(error_of(with("moe_router_group_topk", config::Value::integer(2))).find("needs moe_router_num_groups > 1"),
            std::string::npos);
  config::Value s = with("moe_router_score_function", config::Value::string("sigmoid"));
  s.set("moe_router_pre_softmax", config::Value::boolean(true));
  EXPECT_NE(error_of(s).find("softmax score function only"), std::string::npos);
  EXPECT_NE(error_of(with("activation", config::Value::string("gelu"))).find("SwiGLU experts"), std::string::npos);
  EXPECT_NE(error_of(with("moe_layer_freq", config::Value::list({config::Value::integer(1)})))
                .find("moe_layer_freq lists 1 layers, the model has 4"),
            std::string::npos);
  EXPECT_NE(error_of(with("moe_layer_freq", config::Value::list({config::Value::integer(1), config::Value::integer(2),
                                                                  config::Value::integer(1), config::Value::integer(1)})))
                .find("moe_layer_freq[1] is 2"),
            std::string::npos);
  // A typo is a schema error with a suggestion, not an ignored key.
  config::Value typo = moe_config();
  typo.set("moe_router_top_k", config::Value::integer(2));
  EXPECT_NE(error_of(typo).find("moe_router_topk"), std::string::npos);
}

TEST(MoeSpec, LayoutCountsNamesAndBuffer) {
  for (bool deepseek : {false, true}) {
    ModelSpec m = primus::testing::tiny_moe(deepseek);
    ParamLayout L = make_param_layout(m);
    EXPECT_EQ(L.total, m.num_parameters());
    EXPECT_EQ(L.find("layers.0.moe.router.weight"), nullptr);  // layer 0 is dense
    EXPECT_NE(L.find("layers.0.mlp.fc.weight"), nullptr);
    const ParamTensor& fc = L.get("layers.1.moe.experts.fc.weight");
    EXPECT_EQ(fc.shape, (std::vector<int64_t>{m.moe.num_experts, 2 * m.moe.ffn_hidden_size, m.hidden_size}));
    ASSERT_EQ(fc.hf.size(), static_cast<size_t>(2 * m.moe.num_experts));
    const std::string hm = deepseek ? "model.layers.1.mlp." : "model.layers.1.block_sparse_moe.";
    EXPECT_EQ(fc.hf[3].name, hm + (deepseek ? "experts.1.up_proj.weight" : "experts.1.w3.weight"));
    EXPECT_EQ(fc.hf[3].row_begin, 3 * m.moe.ffn_hidden_size);
    EXPECT_EQ(L.get("layers.1.moe.experts.proj.weight").hf[1].name,
              hm + (deepseek ? "experts.1.down_proj.weight" : "experts.1.w2.weight"));
    EXPECT_EQ(L.get("layers.1.moe.router.weight").hf[0].name, hm + "gate.weight");
    EXPECT_EQ(L.find("layers.1.moe.shared.fc.weight") != nullptr, deepseek);
    const ParamTensor* bias = L.find("layers.1.moe.router.expert_bias");
    ASSERT_EQ(bias != nullptr, deepseek);
    if (bias) {
      EXPECT_FALSE(bias->trainable);
      EXPECT_FALSE(bias->decay);
      EXPECT_EQ(bias->hf[0].name, "model.layers.1.mlp.gate.e_score_correction_bias");
    }
    // Expert rows round-trip through their HF tensors.
    std::vector<float> ours(L.total), back(L.total, 0.f), buf;
    for (size_t i = 0; i < ours.size(); ++i) ours[i] = static_cast<float>(i % 1009) * 0.5f;
    for (const auto& part : fc.hf) {
      auto shape = to_hf(fc, part, ours.data(), buf);
      EXPECT_EQ(shape, (std::vector<int64_t>{m.moe.ffn_hidden_size, m.hidden_size}));
      from_hf(fc, part, buf.data(), shape, back.data());
    }
    for (int64_t i = 0; i < fc.numel; ++i) ASSERT_EQ(back[fc.offset + i], ours[fc.offset + i]);
  }
}

TEST(MoeSpec, ActiveParametersAndFlops) {
  ModelSpec m = primus::testing::tiny_moe(false);
  const int64_t C = m.hidden_size, per_expert = 3 * m.moe.ffn_hidden_size * C;
  const int64_t idle = (m.moe.num_experts - m.moe.topk) * per_expert * m.num_moe_layers();
  EXPECT_EQ(m.num_active_parameters(), m.num_parameters() - idle - m.padded_vocab_size * C);
  ModelSpec dense = primus::testing::tiny_llama();
  dense.num_layers = 3;
  // Replacing the dense MLP by top-k experts changes the FLOPs by exactly the matmul difference.
  const double moe_mlp = m.moe.num_experts * C + 3.0 * m.moe.topk * m.moe.ffn_hidden_size * C;
  const double dense_mlp = C * dense.fc_dim() + dense.ffn_hidden_size * C;
  EXPECT_DOUBLE_EQ(m.flops_per_token() - dense.flops_per_token(), 6.0 * 2 * (moe_mlp - dense_mlp));
}

TEST(MoeSpec, CheckpointSpecAndExportRules) {
  ModelSpec m = primus::testing::tiny_moe(true);
  nlohmann::json j = spec_json(m);
  ASSERT_TRUE(j.contains("moe"));
  ModelSpec back = spec_from_json(j);
  EXPECT_EQ(spec_json(back), j);
  EXPECT_EQ(back.moe.moe_layers, m.moe.moe_layers);
  EXPECT_FALSE(spec_json(primus::testing::tiny_llama()).contains("moe"));  // dense checkpoints unchanged
  // The sequence-wise balance loss is part of the record (another objective), written only when set.
  EXPECT_FALSE(j["moe"].contains("seq_aux_loss"));
  // One type keeps the record it always had: aux_loss_coeff is that type's coefficient.
  m.moe.set_balance(MoeSpec::Balance::Sequence, 0.02);
  const nlohmann::json js = spec_json(m);
  EXPECT_EQ(js["moe"]["seq_aux_loss"], true);
  EXPECT_EQ(js["moe"]["aux_loss_coeff"], 0.02);
  EXPECT_FALSE(js["moe"].contains("balance"));
  const MoeSpec sb = spec_from_json(js).moe;
  EXPECT_TRUE(sb.seq_aux_loss);
  EXPECT_FALSE(sb.batch_aux_loss);
  EXPECT_DOUBLE_EQ(sb.seq_aux_loss_coeff, 0.02);
  EXPECT_DOUBLE_EQ(sb.aux_loss_coeff, 0.0);
  EXPECT_FALSE(j["moe"].contains("global_aux_loss"));
  m.moe.set_balance(MoeSpec::Balance::Global, 0.03);
  const nlohmann::json jg = spec_json(m);
  EXPECT_EQ(jg["moe"]["global_aux_loss"], true);
  EXPECT_EQ(jg["moe"]["aux_loss_coeff"], 0.03);
  EXPECT_TRUE(spec_from_json(jg).moe.global_aux_loss);
  EXPECT_DOUBLE_EQ(spec_from_json(jg).moe.global_aux_loss_coeff, 0.03);
  EXPECT_FALSE(back.moe.seq_aux_loss);
  EXPECT_TRUE(back.moe.batch_aux_loss);
  // A list records each listed type with its coefficient and reads back the same.
  m.moe.batch_aux_loss = m.moe.seq_aux_loss = true;
  m.moe.aux_loss_coeff = 0.01;
  m.moe.seq_aux_loss_coeff = 0.0001;
  const nlohmann::json jl = spec_json(m);
  EXPECT_EQ(jl["moe"]["balance"],
            (nlohmann::json{{"aux_loss", 0.01}, {"seq_aux_loss", 0.0001}, {"global_aux_loss", 0.03}}));
  const MoeSpec lb = spec_from_json(jl).moe;
  EXPECT_TRUE(lb.batch_aux_loss && lb.seq_aux_loss && lb.global_aux_loss);
  EXPECT_DOUBLE_EQ(lb.aux_loss_coeff, 0.01);
  EXPECT_DOUBLE_EQ(lb.seq_aux_loss_coeff, 0.0001);
  EXPECT_DOUBLE_EQ(lb.global_aux_loss_coeff, 0.03);
  EXPECT_EQ(spec_json(spec_from_json(jl)), jl);
  EXPECT_NE(jl, jg);
  // Mixtral exports; DeepSeek-style routing is refused with the reason.
  ModelSpec mix = primus::testing::tiny_moe(false);
  mix.moe.moe_layers = {true, true, true};
  nlohmann::json cfg = nlohmann::json::parse(hf_config_json(mix, 0));
  EXPECT_EQ(cfg["architectures"][0], "MixtralForCausalLM");
  EXPECT_EQ(cfg["num_local_experts"], 6);
  EXPECT_EQ(cfg["num_experts_per_tok"], 2);
  EXPECT_THROW(hf_config_json(primus::testing::tiny_moe(false), 0), ConfigError);  // a dense first layer
  try {
    hf_config_json(m, 0);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("deepseek_v3"), std::string::npos) << e.what();
  }
}

namespace {
// A model preset under configs/models/, resolved as the trainer resolves it (extends chain,
// schema defaults).
ModelSpec preset(const std::string& name) {
  config::Value v = config::load_yaml_file(std::string(PRIMUS_SOURCE_DIR) + "/configs/models/" + name + ".yaml");
  return parse(std::move(v));
}
}  // namespace

// Qwen3's attention keys, Megatron's names: kv_channels (the head dimension, apart from
// hidden_size) and qk_layernorm.
TEST(AttentionSpec, KvChannelsAndQkLayernormParse) {
  config::Value v = moe_config();
  v.set("num_experts", config::Value::integer(0));
  ModelSpec d = parse(v);
  EXPECT_EQ(d.head_dim(), 8);  // default: hidden / heads
  EXPECT_EQ(d.q_dim(), 32);
  EXPECT_FALSE(d.qk_layernorm);
  v.set("kv_channels", config::Value::integer(12));
  v.set("num_query_groups", config::Value::integer(2));
  v.set("qk_layernorm", config::Value::boolean(true));
  ModelSpec m = parse(v);
  EXPECT_EQ(m.head_dim(), 12);
  EXPECT_EQ(m.q_dim(), 48);
  EXPECT_EQ(m.kv_dim(), 24);
  EXPECT_EQ(m.qkv_dim(), 96);
  // hidden_size need not divide by the heads once the head dimension is given.
  v.set("num_attention_heads", config::Value::integer(6));
  v.set("num_query_groups", config::Value::integer(3));
  EXPECT_EQ(parse(v).q_dim(), 72);
  v.set("kv_channels", config::Value::integer(7));
  EXPECT_NE(error_of(v).find("RoPE needs an even head dimension, got 7"), std::string::npos) << error_of(v);
  config::Value ln = moe_config();
  ln.set("normalization", config::Value::string("LayerNorm"));
  ln.set("num_experts", config::Value::integer(0));
  ln.set("qk_layernorm", config::Value::boolean(true));
  EXPECT_NE(error_of(ln).find("qk_layernorm"), std::string::npos);
}

// DeepSeek-V3's Megatron-LM switches that Primus' experiments write: MLA and multi-token prediction
// off (or unset) parse, on is refused naming the key.
TEST(AttentionSpec, MlaAndMtpAreAcceptedOffAndRefusedOn) {
  config::Value v = moe_config();
  v.set("multi_latent_attention", config::Value::boolean(false));
  v.set("mtp_num_layers", config::Value::null());
  EXPECT_EQ(error_of(v), "");
  v.set("mtp_num_layers", config::Value::integer(0));
  EXPECT_EQ(error_of(v), "");
  v.set("mtp_num_layers", config::Value::integer(1));
  EXPECT_NE(error_of(v).find("mtp_num_layers 1: multi-token prediction is not implemented"), std::string::npos)
      << error_of(v);
  v.set("mtp_num_layers", config::Value::integer(0));
  v.set("multi_latent_attention", config::Value::boolean(true));
  EXPECT_NE(error_of(v).find("multi_latent_attention: true is not implemented"), std::string::npos) << error_of(v);
}

TEST(AttentionSpec, Qwen3LayoutCountsAndHfNames) {
  for (bool moe : {false, true}) {
    ModelSpec m = moe ? primus::testing::tiny_qwen3_moe() : primus::testing::tiny_qwen3();
    ParamLayout L = make_param_layout(m);
    EXPECT_EQ(L.total, m.num_parameters());
    EXPECT_EQ(L.get("layers.1.attn.qkv.weight").shape, (std::vector<int64_t>{24 + 12 + 12, 16}));
    EXPECT_EQ(L.get("layers.1.attn.proj.weight").shape, (std::vector<int64_t>{16, 24}));
    for (const char* n : {"q_norm", "k_norm"}) {
      const ParamTensor& t = L.get(fmt::format("layers.1.attn.{}.weight", n));
      EXPECT_EQ(t.shape, (std::vector<int64_t>{6}));
      EXPECT_FALSE(t.decay);
      ASSERT_EQ(t.hf.size(), 1u);
      EXPECT_EQ(t.hf[0].name, fmt::format("model.layers.1.self_attn.{}.weight", n));
      // The norm weight follows the q/k rows from our interleaved RoPE pairs to HF's halves:
      // our features 0,1,2,3,4,5 are HF's 0,3,1,4,2,5.
      std::vector<float> ours(L.total, 0.f), out, back(L.total, 0.f);
      for (int64_t i = 0; i < 6; ++i) ours[t.offset + i] = float(i);
      EXPECT_EQ(to_hf(t, t.hf[0], ours.data(), out), (std::vector<int64_t>{6}));
      EXPECT_EQ(out, (std::vector<float>{0, 2, 4, 1, 3, 5}));
      from_hf(t, t.hf[0], out.data(), {6}, back.data());
      for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(back[t.offset + i], float(i));
    }
    EXPECT_EQ(L.find("layers.1.attn.q_norm.weight") != nullptr, true);
    // 2 x head_dim per layer more than the same model without the norms.
    ModelSpec plain = m;
    plain.qk_layernorm = false;
    EXPECT_EQ(m.num_parameters() - plain.num_parameters(), 2 * 6 * m.num_layers);
    EXPECT_EQ(make_param_layout(plain).find("layers.0.attn.q_norm.weight"), nullptr);
    // Attention FLOPs follow the query width (24), not hidden_size (16): 6 x L x q_dim x T.
    ModelSpec narrow = plain;
    narrow.kv_channels = 4;  // q 16 wide = hidden
    const double matmul_diff = double(m.hidden_size) * (plain.qkv_dim() - narrow.qkv_dim()) +
                               double(plain.q_dim() - narrow.q_dim()) * m.hidden_size;
    EXPECT_DOUBLE_EQ(plain.flops_per_token() - narrow.flops_per_token(),
                     6.0 * m.num_layers * matmul_diff + 6.0 * m.num_layers * (24 - 16) * m.seq_length);
  }
  // The checkpoint spec carries both keys, and a Llama checkpoint stays as it was.
  ModelSpec q = primus::testing::tiny_qwen3();
  nlohmann::json j = spec_json(q);
  EXPECT_EQ(j.at("kv_channels"), 6);
  EXPECT_EQ(j.at("qk_layernorm"), true);
  EXPECT_EQ(spec_json(spec_from_json(j)), j);
  EXPECT_EQ(spec_from_json(j).q_dim(), 24);
  const nlohmann::json llama = spec_json(primus::testing::tiny_llama());
  EXPECT_FALSE(llama.contains("kv_channels"));
  EXPECT_FALSE(llama.contains("qk_layernorm"));
  EXPECT_EQ(spec_from_json(llama).head_dim(), 4);
}

// The full-size presets against the published counts, computed from each config.json:
// Qwen3-0.6B 596,049,920 (0.44B without the embedding), Qwen3-1.7B 1,720,574,976 (1.4B),
// Qwen3-30B-A3B 30,532,122,624 (30.5B total; 3.3B active counting the embedding and head:
// 3,041,867,776 in the layers and final norm + 2 x 151,936 x 2048).
TEST(AttentionSpec, Qwen3PresetsHaveThePublishedCounts) {
  ModelSpec s = preset("qwen3/qwen3-0.6B");
  EXPECT_EQ(s.model_type, "qwen3");
  EXPECT_EQ(s.head_dim(), 128);
  EXPECT_EQ(s.q_dim(), 2048);
  EXPECT_TRUE(s.qk_layernorm);
  EXPECT_FALSE(s.untied);
  EXPECT_EQ(s.num_parameters(), 596049920);
  EXPECT_EQ(s.num_parameters() - s.padded_vocab_size * s.hidden_size, 440467456);  // layers + final norm
  ModelSpec b = preset("qwen3/qwen3-1.7B");
  EXPECT_EQ(b.num_parameters(), 1720574976);
  EXPECT_FALSE(b.untied);
  ModelSpec t = preset("qwen3/tiny");
  EXPECT_EQ(t.q_dim(), 96);
  EXPECT_EQ(make_param_layout(t).total, t.num_parameters());
  ModelSpec e = preset("moe/qwen3-30B-A3B");
  EXPECT_EQ(e.model_type, "qwen3_moe");
  EXPECT_EQ(e.num_moe_layers(), 48);
  EXPECT_EQ(e.moe.num_experts, 128);
  EXPECT_EQ(e.moe.topk, 8);
  EXPECT_EQ(e.moe.shared_ffn_hidden_size, 0);
  EXPECT_FALSE(e.moe.pre_softmax);  // norm_topk_prob: renormalised over the chosen
  EXPECT_TRUE(e.untied);
  EXPECT_EQ(e.num_parameters(), 30532122624);
  EXPECT_EQ(e.num_active_parameters(), 3041867776);
  EXPECT_EQ(e.num_active_parameters() + e.padded_vocab_size * e.hidden_size, 3353032704);  // Qwen's 3.3B
  EXPECT_EQ(make_param_layout(e).total, e.num_parameters());
}
