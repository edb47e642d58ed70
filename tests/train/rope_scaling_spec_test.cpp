// Llama-3's RoPE frequency scaling in the model spec: Megatron's use_rope_scaling /
// rope_scaling_factor and Primus' rope_scaling_low_freq_factor, rope_scaling_high_freq_factor,
// rope_scaling_original_max_position_embeddings into ModelSpec::rope_scaling, the errors, the
// checkpoint's spec JSON (the key only when set, so older checkpoints stay byte-identical), the
// summary, and parameter count / FLOPs unchanged by it.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/config/schema.h"
#include "core/util/error.h"
#include "tests/common/tiny_models.h"
#include "train/checkpointing.h"
#include "train/model_spec.h"

namespace primus::train {
namespace {

config::Value llama_config() {
  config::Value v = config::Value::map();
  v.set("vocab_size", config::Value::integer(100));
  v.set("num_layers", config::Value::integer(2));
  v.set("hidden_size", config::Value::integer(32));
  v.set("num_attention_heads", config::Value::integer(4));
  v.set("activation", config::Value::string("swiglu"));
  v.set("add_bias_linear", config::Value::boolean(false));
  v.set("normalization", config::Value::string("RMSNorm"));
  v.set("position_embedding_type", config::Value::string("rope"));
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
  return "(no error)";
}

TEST(RopeScalingSpec, KeysAndMegatronDefaults) {
  config::Value v = llama_config();
  EXPECT_FALSE(parse(v).rope_scaling.enabled);
  v.set("use_rope_scaling", config::Value::boolean(true));
  ModelSpec m = parse(v);
  // Megatron's default factor 8 (Llama-3.1), and Meta's low 1, high 4, original 8192.
  EXPECT_TRUE(m.rope_scaling == (RopeScaling{true, 8.0, 1.0, 4.0, 8192.0}));
  v.set("rope_scaling_factor", config::Value::floating(32.0));
  v.set("rope_scaling_low_freq_factor", config::Value::floating(2.0));
  v.set("rope_scaling_high_freq_factor", config::Value::floating(8.0));
  v.set("rope_scaling_original_max_position_embeddings", config::Value::integer(4096));
  m = parse(v);
  EXPECT_TRUE(m.rope_scaling == (RopeScaling{true, 32.0, 2.0, 8.0, 4096.0}));
  EXPECT_NE(m.summary().find("rope scaling x32 (low 2, high 8, original 4096)"), std::string::npos) << m.summary();
}

TEST(RopeScalingSpec, ErrorsNameTheKey) {
  config::Value v = llama_config();
  v.set("use_rope_scaling", config::Value::boolean(true));
  v.set("rope_scaling_high_freq_factor", config::Value::floating(1.0));
  std::string e = error_of(v);
  EXPECT_NE(e.find("rope_scaling_high_freq_factor"), std::string::npos) << e;
  config::Value g = llama_config();
  g.set("position_embedding_type", config::Value::string("learned_absolute"));
  g.set("use_rope_scaling", config::Value::boolean(true));
  e = error_of(g);
  EXPECT_NE(e.find("use_rope_scaling"), std::string::npos) << e;
  EXPECT_NE(e.find("position_embedding_type: rope"), std::string::npos) << e;
}

TEST(RopeScalingSpec, CheckpointSpecCarriesItOnlyWhenSet) {
  ModelSpec m = primus::testing::tiny_llama();
  const nlohmann::json plain = spec_json(m);
  EXPECT_FALSE(plain.contains("rope_scaling"));
  EXPECT_FALSE(spec_from_json(plain).rope_scaling.enabled);
  const int64_t params = m.num_parameters();
  const double flops = m.flops_per_token();
  m.rope_scaling = {true, 32.0, 1.0, 4.0, 8192.0};
  const nlohmann::json j = spec_json(m);
  EXPECT_EQ(j.at("rope_scaling").at("factor"), 32.0);
  EXPECT_EQ(j.at("rope_scaling").at("original_max_position_embeddings"), 8192.0);
  EXPECT_TRUE(spec_from_json(j).rope_scaling == m.rope_scaling);
  EXPECT_NE(j, plain);  // a checkpoint of the other rotation is refused (unpack compares the specs)
  EXPECT_EQ(m.num_parameters(), params);
  EXPECT_EQ(m.flops_per_token(), flops);
}

}  // namespace
}  // namespace primus::train
