// Which tensors Muon takes and how the fused ones split, on the tiny families: every block is one
// Hugging Face matrix (q_proj, k_proj, v_proj, gate_proj, up_proj, each expert's), the rest stays
// on AdamW, and ZeRO-1 ownership is whole tensors, balanced.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "tests/common/tiny_models.h"
#include "train/muon_layout.h"

using namespace primus::train;

namespace {
// name -> blocks as (rows, cols), checking the blocks tile the tensor in order.
std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> blocks_by_name(const ModelSpec& m) {
  const ParamLayout L = make_param_layout(m);
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> out;
  for (const MuonTensor& mt : muon_tensors(m, L)) {
    const ParamTensor& t = L.tensors[mt.index];
    int64_t off = t.offset;
    for (const MuonBlock& b : mt.blocks) {
      EXPECT_EQ(b.offset, off) << t.name;
      off += b.rows * b.cols;
      out[t.name].emplace_back(b.rows, b.cols);
    }
    EXPECT_EQ(off, t.offset + t.numel) << t.name;
  }
  return out;
}
}  // namespace

TEST(MuonLayout, LlamaSplitsQkvAndGateUpAndLeavesTheRestToAdamW) {
  const ModelSpec m = primus::testing::tiny_llama();  // hidden 16, 4 heads of 4, 2 kv groups, ffn 24
  auto b = blocks_by_name(m);
  using V = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(b.at("layers.0.attn.qkv.weight"), (V{{16, 16}, {8, 16}, {8, 16}}));
  EXPECT_EQ(b.at("layers.0.attn.proj.weight"), (V{{16, 16}}));
  EXPECT_EQ(b.at("layers.0.mlp.fc.weight"), (V{{24, 16}, {24, 16}}));
  EXPECT_EQ(b.at("layers.0.mlp.proj.weight"), (V{{16, 24}}));
  EXPECT_EQ(b.size(), static_cast<size_t>(4 * m.num_layers));
  for (const char* adamw : {"embedding.weight", "output_layer.weight", "final_norm.weight", "layers.0.norm1.weight"})
    EXPECT_EQ(b.count(adamw), 0u) << adamw;
}

TEST(MuonLayout, Gpt2FusedQkvSplitsButItsPlainMlpDoesNot) {
  const ModelSpec m = primus::testing::tiny_gpt2();
  auto b = blocks_by_name(m);
  const int64_t C = m.hidden_size;
  using V = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(b.at("layers.0.attn.qkv.weight"), (V{{C, C}, {C, C}, {C, C}}));
  EXPECT_EQ(b.at("layers.0.mlp.fc.weight"), (V{{m.ffn_hidden_size, C}}));
  EXPECT_EQ(b.count("position_embedding.weight"), 0u);
  EXPECT_EQ(b.count("layers.0.attn.qkv.bias"), 0u);
}

TEST(MuonLayout, MoeExpertsPerExpertAndPartRouterOnAdamW) {
  const ModelSpec m = primus::testing::tiny_moe(/*deepseek=*/true);  // 8 experts of 10, shared 14
  auto b = blocks_by_name(m);
  const int64_t C = m.hidden_size, E = m.moe.num_experts, Fe = m.moe.ffn_hidden_size, Fs = m.moe.shared_ffn_hidden_size;
  const auto& fc = b.at("layers.1.moe.experts.fc.weight");
  ASSERT_EQ(fc.size(), static_cast<size_t>(2 * E));  // gate and up of every expert
  for (auto& rc : fc) EXPECT_EQ(rc, std::make_pair(Fe, C));
  const auto& proj = b.at("layers.1.moe.experts.proj.weight");
  ASSERT_EQ(proj.size(), static_cast<size_t>(E));
  for (auto& rc : proj) EXPECT_EQ(rc, std::make_pair(C, Fe));
  using V = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(b.at("layers.1.moe.shared.fc.weight"), (V{{Fs, C}, {Fs, C}}));
  EXPECT_EQ(b.count("layers.1.moe.router.weight"), 0u);
  EXPECT_EQ(b.count("layers.1.moe.router.expert_bias"), 0u);
}

TEST(MuonLayout, Zero1OwnersAreWholeTensorsBalancedBySize) {
  const ModelSpec m = primus::testing::tiny_moe(false);
  const ParamLayout L = make_param_layout(m);
  for (int world : {1, 2, 3, 5}) {
    auto ts = muon_tensors(m, L);
    assign_muon_owners(ts, L, world);
    std::vector<int64_t> load(static_cast<size_t>(world), 0);
    int64_t biggest = 0;
    for (auto& t : ts) {
      ASSERT_GE(t.owner, 0);
      ASSERT_LT(t.owner, world);
      load[static_cast<size_t>(t.owner)] += L.tensors[t.index].numel;
      biggest = std::max(biggest, L.tensors[t.index].numel);
    }
    const auto [lo, hi] = std::minmax_element(load.begin(), load.end());
    EXPECT_LE(*hi - *lo, biggest) << "world " << world;  // greedy largest-first: within one tensor
    auto again = muon_tensors(m, L);
    assign_muon_owners(again, L, world);
    for (size_t k = 0; k < ts.size(); ++k) EXPECT_EQ(ts[k].owner, again[k].owner);  // every rank agrees
  }
}
