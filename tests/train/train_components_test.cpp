#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "core/util/error.h"
#include "train/checkpointing.h"
#include "train/lr_schedule.h"
#include "train/model_spec.h"
#include "train/param_layout.h"
#include "train/param_init.h"
#include "tests/common/tiny_models.h"
#include "turbo/kernels/cpu/rope.h"

using namespace primus;
using namespace primus::train;

TEST(LrSchedule, WarmupThenCosineToMin) {
  OptimizerArgs o;
  o.lr = 1.0;
  o.min_lr = 0.1;
  o.warmup_iters = 10;
  o.decay_iters = 110;
  o.decay_style = "cosine";
  EXPECT_DOUBLE_EQ(lr_at(o, 0), 0.1);   // (0+1)/10
  EXPECT_DOUBLE_EQ(lr_at(o, 9), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(o, 10), 1.0);  // decay starts at the peak
  EXPECT_NEAR(lr_at(o, 60), 0.55, 1e-12);  // halfway: min + 0.5 (max - min)
  EXPECT_DOUBLE_EQ(lr_at(o, 110), 0.1);
  EXPECT_DOUBLE_EQ(lr_at(o, 500), 0.1);
  for (int s = 11; s < 110; ++s) EXPECT_LE(lr_at(o, s), lr_at(o, s - 1));
}

TEST(LrSchedule, LinearAndConstant) {
  OptimizerArgs o;
  o.lr = 2.0;
  o.min_lr = 0.0;
  o.warmup_iters = 0;
  o.decay_iters = 100;
  o.decay_style = "linear";
  EXPECT_DOUBLE_EQ(lr_at(o, 0), 2.0);
  EXPECT_DOUBLE_EQ(lr_at(o, 25), 1.5);
  EXPECT_DOUBLE_EQ(lr_at(o, 100), 0.0);
  o.decay_style = "constant";
  EXPECT_DOUBLE_EQ(lr_at(o, 77), 2.0);
}

namespace {
ModelSpec llama_spec() { return primus::testing::tiny_llama(50, 64, 16); }
ModelSpec gpt2_spec() {
  ModelSpec m = primus::testing::tiny_gpt2(50, 50, 16);
  m.hidden_size = 32;
  m.ffn_hidden_size = 128;
  return m;
}
}  // namespace

TEST(ParamLayout, CountsMatchTheSpecAndNamesFollowHuggingFace) {
  for (auto spec : {gpt2_spec(), llama_spec()}) {
    ParamLayout L = make_param_layout(spec);
    EXPECT_EQ(L.total, spec.num_parameters());
    int64_t sum = 0;
    for (auto& t : L.tensors) sum += t.numel;
    EXPECT_EQ(sum, L.total);
  }
  ParamLayout g = make_param_layout(gpt2_spec());
  EXPECT_EQ(g.get("layers.1.attn.qkv.weight").hf[0].name, "transformer.h.1.attn.c_attn.weight");
  EXPECT_EQ(g.get("layers.0.mlp.proj.weight").hf[0].transform, HfTransform::Transpose);
  EXPECT_FALSE(g.get("layers.0.norm1.bias").decay);
  ParamLayout l = make_param_layout(llama_spec());
  auto& qkv = l.get("layers.0.attn.qkv.weight").hf;
  ASSERT_EQ(qkv.size(), 3u);
  EXPECT_EQ(qkv[1].name, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(qkv[1].rows, 2 * 4);  // 2 kv heads x head_dim 4
  EXPECT_EQ(l.get("layers.0.mlp.fc.weight").hf[1].name, "model.layers.0.mlp.up_proj.weight");
  EXPECT_NE(l.find("output_layer.weight"), nullptr);
  EXPECT_EQ(g.find("output_layer.weight"), nullptr);  // tied
}

TEST(ParamLayout, HfRoundTripIsExactAndRopeRowsMatchTheKernelPermutation) {
  auto spec = llama_spec();
  ParamLayout L = make_param_layout(spec);
  std::vector<float> ours(L.total), back(L.total, -1.f);
  std::mt19937 rng(5);
  std::normal_distribution<float> d;
  for (auto& x : ours) x = d(rng);
  for (auto& t : L.tensors) {
    for (auto& part : t.hf) {
      std::vector<float> hf;
      auto shape = to_hf(t, part, ours.data(), hf);
      from_hf(t, part, hf.data(), shape, back.data());
      if (part.transform == HfTransform::RopeRows) {
        // The turbo CPU kernel's own permutation must agree with ours.
        int64_t D = part.rows / part.heads, cols = t.shape[1];
        std::vector<float> expect(hf.size());
        turbo::cpu::rope_permute_rows(expect.data(), ours.data() + t.offset + part.row_begin * cols, part.heads, D,
                                      cols, false);
        EXPECT_EQ(hf, expect) << part.name;
      }
    }
  }
  EXPECT_EQ(ours, back);
  // A tensor of the wrong shape is refused, naming it.
  auto& t = L.get("layers.0.attn.proj.weight");
  std::vector<float> junk(10);
  try {
    from_hf(t, t.hf[0], junk.data(), {2, 5}, back.data());
    FAIL();
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("o_proj"), std::string::npos);
  }
}

TEST(Checkpointing, PackUnpackRoundTripAndModelMismatch) {
  auto spec = gpt2_spec();
  ParamLayout L = make_param_layout(spec);
  std::vector<float> p(L.total), m(L.total), v(L.total);
  for (int64_t i = 0; i < L.total; ++i) p[i] = std::sin(i * 0.1f), m[i] = i * 1e-3f, v[i] = 1.0f + i;
  auto data = pack_checkpoint(spec, L, p.data(), m.data(), v.data(), {{"step", 3}});
  EXPECT_EQ(data.state["step"], 3);
  std::vector<float> p2(L.total), m2(L.total), v2(L.total);
  unpack_checkpoint(data, "ck", spec, L, p2.data(), m2.data(), v2.data());
  EXPECT_EQ(p, p2);
  EXPECT_EQ(m, m2);
  EXPECT_EQ(v, v2);
  auto other = spec;
  other.num_layers = 3;
  EXPECT_THROW(unpack_checkpoint(data, "ck", other, make_param_layout(other), p2.data(), nullptr, nullptr), FormatError);
}

TEST(ModelSpec, ConsistencyErrorsNameTheKey) {
  config::Schema s;
  add_model_schema(s);
  config::Value v = config::Value::map();
  v.set("vocab_size", config::Value::integer(100));
  v.set("num_layers", config::Value::integer(2));
  v.set("hidden_size", config::Value::integer(30, {"m.yaml", 4, 14}));
  v.set("num_attention_heads", config::Value::integer(4));
  s.apply_defaults(v);
  try {
    ModelSpec::from_config(v);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("m.yaml:4:14: hidden_size 30 is not divisible by num_attention_heads 4"),
              std::string::npos)
        << e.what();
  }
  v.set("hidden_size", config::Value::integer(32));
  v.set("make_vocab_size_divisible_by", config::Value::integer(64));
  ModelSpec m = ModelSpec::from_config(v);
  EXPECT_EQ(m.padded_vocab_size, 128);
  EXPECT_EQ(m.ffn_hidden_size, 128);
  EXPECT_EQ(m.num_query_groups, 4);
}

// The shared initial weights: the same for any thread count (blocks with their own generators),
// with the distribution the spec asks for, in float and double alike.
TEST(ParamInit, SameForAnyThreadCountWithTheRequestedDistribution) {
  ModelSpec spec = primus::testing::tiny_gpt2(4000, 4096, 16);
  spec.hidden_size = 512;
  spec.num_attention_heads = 8;
  spec.num_query_groups = 8;
  spec.ffn_hidden_size = 2048;
  spec.num_layers = 2;
  spec.init_method_std = 0.02;
  const ParamLayout layout = make_param_layout(spec);
  const ParamTensor& emb = layout.get("embedding.weight");
  ASSERT_GE(emb.numel, 2 * kInitBlock) << "the embedding must span several blocks";
  std::vector<float> one(static_cast<size_t>(layout.total)), many(one.size());
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  init_params(spec, layout, 1234, one.data());
  omp_set_num_threads(std::max(threads, 4));
  init_params(spec, layout, 1234, many.data());
  omp_set_num_threads(threads);
  EXPECT_TRUE(one == many) << "the draw depends on the thread count";
  std::vector<double> dbl(one.size());
  init_params(spec, layout, 1234, dbl.data());
  for (size_t i = 0; i < one.size(); ++i) ASSERT_EQ(one[i], static_cast<float>(dbl[i])) << i;
  std::vector<float> other(one.size());
  init_params(spec, layout, 1235, other.data());
  EXPECT_NE(other, one);
  auto stats = [&](const ParamTensor& t, int64_t n) {
    double s = 0, s2 = 0;
    for (int64_t i = 0; i < n; ++i) s += one[size_t(t.offset + i)], s2 += double(one[size_t(t.offset + i)]) * one[size_t(t.offset + i)];
    return std::pair{s / double(n), std::sqrt(s2 / double(n) - (s / double(n)) * (s / double(n)))};
  };
  const int64_t real = spec.vocab_size * spec.hidden_size;
  auto [m, sd] = stats(emb, real);
  EXPECT_NEAR(m, 0.0, 1e-4);
  EXPECT_NEAR(sd, 0.02, 0.02 * 0.01);
  for (int64_t i = real; i < emb.numel; ++i) ASSERT_EQ(one[size_t(emb.offset + i)], 0.0f) << "padded vocabulary row";
  const ParamTensor& proj = layout.get("layers.0.attn.proj.weight");
  auto [pm, psd] = stats(proj, proj.numel);
  EXPECT_NEAR(psd, 0.02 / std::sqrt(2.0 * spec.num_layers), 0.02 * 0.03) << "residual projections are scaled";
  for (const auto& t : layout.tensors) {
    const bool bias = t.name.size() > 5 && t.name.compare(t.name.size() - 5, 5, ".bias") == 0;
    const bool norm = !bias && t.name.find("norm") != std::string::npos;
    if (!bias && !norm) continue;
    for (int64_t i = 0; i < t.numel; ++i) ASSERT_EQ(one[size_t(t.offset + i)], bias ? 0.0f : 1.0f) << t.name;
  }
  (void)pm;
}
