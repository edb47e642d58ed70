// The tensor-parallel split of the tiny families: each rank's pieces tile its local buffer, the
// ranks' pieces together (replicated tensors from rank 0, replicated key/value groups from their
// first rank) tile the global buffer exactly once, a
// global buffer cut and put back is unchanged, the slices are where Megatron puts them (whole
// heads of q, k and v, gate and up halves, the output projections' input columns, vocabulary
// rows), and layouts that cannot be split are ConfigErrors naming the key.
#include <gtest/gtest.h>

#include <numeric>

#include "core/util/error.h"
#include "tests/common/tiny_models.h"
#include "tests/core/test_util.h"
#include "tests/train/shard_map_checks.h"
#include "train/tensor_parallel.h"

using namespace primus::train;
using primus::ConfigError;
using primus::testing::expect_error;

namespace {

void expect_tiles(const ModelSpec& m, int tp, bool sp) {
  primus::testing::expect_pieces_tile(
      tp, [&](int r) { return std::make_unique<TpShardMap>(m, tp, r, sp); },
      m.model_type + " tp" + std::to_string(tp) + (sp ? "+sp" : ""));
}

const float* tensor(const ParamLayout& L, const std::vector<float>& buf, const std::string& name) {
  return buf.data() + L.get(name).offset;
}

// A global buffer of distinct values (each element its index) and the map's rank's cut of it.
struct Buffers {
  std::vector<float> global, local;
};
Buffers cut_iota(const TpShardMap& map) {
  Buffers b;
  b.global.resize(static_cast<size_t>(map.global_layout().total));
  std::iota(b.global.begin(), b.global.end(), 0.f);
  b.local.resize(static_cast<size_t>(map.local_layout().total));
  map.to_local(b.global.data(), b.local.data());
  return b;
}

}  // namespace

TEST(TensorParallelMap, PiecesTileTheLocalAndTheGlobalBuffers) {
  for (bool sp : {false, true}) {
    expect_tiles(primus::testing::tiny_gpt2(), 2, sp);
    expect_tiles(primus::testing::tiny_gpt2(), 4, sp);
    expect_tiles(primus::testing::tiny_llama(), 2, sp);
    expect_tiles(primus::testing::tiny_qwen3(), 2, sp);
    // More ranks than key/value groups: each group replicated on two ranks, owned by the first.
    expect_tiles(primus::testing::tiny_llama(), 4, sp);
    expect_tiles(primus::testing::tiny_qwen3(), 4, sp);
  }
}

// MoE layers: every expert's gate and up rows and down-projection columns split like the dense
// MLP's (the shared expert too), the router and its expert bias replicated, the router's gradient
// partial.
TEST(TensorParallelMap, ExpertsSplitLikeTheMlpAndTheRouterIsReplicated) {
  ModelSpec m = primus::testing::tiny_moe();
  m.moe.shared_ffn_hidden_size = 2 * m.moe.ffn_hidden_size;
  m.moe.expert_bias = true;
  for (bool sp : {false, true}) {
    expect_tiles(m, 2, sp);
    if (m.moe.ffn_hidden_size % 4 == 0) expect_tiles(m, 4, sp);
  }
  const int64_t C = m.hidden_size, E = m.moe.num_experts, Fe = m.moe.ffn_hidden_size, Fs = m.moe.shared_ffn_hidden_size;
  const TpShardMap map(m, 2, 1, false);
  EXPECT_EQ(map.local_spec().moe.ffn_hidden_size, Fe / 2);
  EXPECT_EQ(map.local_spec().moe.shared_ffn_hidden_size, Fs / 2);
  const ParamLayout& G = map.global_layout();
  const ParamLayout& L = map.local_layout();
  const auto [global, local] = cut_iota(map);
  const int64_t l = m.is_moe_layer(0) ? 0 : 1;
  const std::string p = "layers." + std::to_string(l) + ".moe.";
  const float* gf = tensor(G, global, p + "experts.fc.weight");  // [E, 2 Fe, C]
  const float* lf = tensor(L, local, p + "experts.fc.weight");   // [E, Fe, C]: gate half, up half
  const int64_t e = E - 1;
  EXPECT_EQ(lf[e * Fe * C], gf[(e * 2 * Fe + Fe / 2) * C]);              // expert e's gate rows Fe/2..
  EXPECT_EQ(lf[(e * Fe + Fe / 2) * C + 1], gf[(e * 2 * Fe + Fe + Fe / 2) * C + 1]);  // its up rows
  const float* gd = tensor(G, global, p + "experts.proj.weight");  // [E, C, Fe]
  const float* ld = tensor(L, local, p + "experts.proj.weight");   // [E, C, Fe / 2]
  EXPECT_EQ(ld[(e * C + 3) * (Fe / 2) + 1], gd[(e * C + 3) * Fe + Fe / 2 + 1]);
  const float* gs = tensor(G, global, p + "shared.fc.weight");
  const float* ls = tensor(L, local, p + "shared.fc.weight");
  EXPECT_EQ(ls[(Fs / 2) * C], gs[(Fs + Fs / 2) * C]);
  const float* gsd = tensor(G, global, p + "shared.proj.weight");
  const float* lsd = tensor(L, local, p + "shared.proj.weight");
  EXPECT_EQ(lsd[2 * (Fs / 2)], gsd[2 * Fs + Fs / 2]);
  EXPECT_EQ(tensor(L, local, p + "router.weight")[C + 5], tensor(G, global, p + "router.weight")[C + 5]);
  const auto& ts = L.tensors;
  for (size_t i = 0; i < ts.size(); ++i) {
    const std::string& n = ts[i].name;
    if (n.find(".moe.router.") == std::string::npos) continue;
    EXPECT_TRUE(map.replicated(i)) << n;
    EXPECT_EQ(map.partial_grad(i), n.find("router.weight") != std::string::npos) << n;
  }
}

TEST(TensorParallelMap, KeyValueGroupsAreReplicatedWhenRanksOutnumberThem) {
  const ModelSpec m = primus::testing::tiny_llama();  // 4 heads of 4, 2 kv groups, hidden 16
  const int64_t C = 16, QD = 16, KVD = 8, D = 4;
  const ParamLayout G = make_param_layout(m);
  std::vector<float> global(static_cast<size_t>(G.total));
  std::iota(global.begin(), global.end(), 0.f);
  for (int r = 0; r < 4; ++r) {
    const TpShardMap map(m, 4, r, false);
    EXPECT_EQ(map.kv_replicas(), 2);
    EXPECT_EQ(map.counts_kv(), r % 2 == 0) << "rank " << r;
    const ModelSpec& l = map.local_spec();
    EXPECT_EQ(l.num_attention_heads, 1);
    EXPECT_EQ(l.num_query_groups, 1);
    std::vector<float> local(static_cast<size_t>(map.local_layout().total));
    map.to_local(global.data(), local.data());
    const float* gq = tensor(G, global, "layers.0.attn.qkv.weight");
    const float* lq = tensor(map.local_layout(), local, "layers.0.attn.qkv.weight");
    const int64_t group = r / 2;  // heads r use kv group r / 2, as in the whole model
    EXPECT_EQ(lq[0], gq[r * D * C]) << "q: head " << r;
    EXPECT_EQ(lq[D * C], gq[(QD + group * D) * C]) << "k: group " << group;
    EXPECT_EQ(lq[2 * D * C + 1], gq[(QD + KVD + group * D) * C + 1]) << "v: group " << group;
    // One exchange per layer's q|k|v weight, over the global k|v rows; this rank's shared pieces.
    ASSERT_EQ(map.kv_exchanges().size(), size_t(m.num_layers));
    const TpKvExchange& x = map.kv_exchanges()[0];
    EXPECT_EQ(x.global_begin, G.get("layers.0.attn.qkv.weight").offset + QD * C);
    EXPECT_EQ(x.elems, 2 * KVD * C);
    int64_t shared = 0;
    for (const TpPiece& p : x.pieces) {
      EXPECT_TRUE(p.shared);
      shared += p.count;
    }
    EXPECT_EQ(shared, 2 * D * C);
  }
}

TEST(TensorParallelMap, SlicesAreWholeHeadsFfnHalvesInputColumnsAndVocabularyRows) {
  const ModelSpec m = primus::testing::tiny_llama();  // hidden 16, 4 heads of 4, 2 kv groups, ffn 24, vocab 29 of 32
  const TpShardMap map(m, 2, 1, false);
  const ModelSpec& l = map.local_spec();
  EXPECT_EQ(l.num_attention_heads, 2);
  EXPECT_EQ(l.num_query_groups, 1);
  EXPECT_EQ(l.head_dim(), 4);
  EXPECT_EQ(l.ffn_hidden_size, 12);
  EXPECT_EQ(l.padded_vocab_size, 16);
  EXPECT_EQ(map.vocab_begin(), 16);
  EXPECT_EQ(l.vocab_size, 13);  // rows 16..28 are real tokens, 29..31 padding

  const ParamLayout& G = map.global_layout();
  const ParamLayout& L = map.local_layout();
  const auto [global, local] = cut_iota(map);
  const int64_t C = 16, QD = 16, KVD = 8, F = 24;
  const float* gq = tensor(G, global, "layers.1.attn.qkv.weight");
  const float* lq = tensor(L, local, "layers.1.attn.qkv.weight");
  EXPECT_EQ(lq[0], gq[(QD / 2) * C]);                         // q: heads 2 and 3
  EXPECT_EQ(lq[(QD / 2) * C], gq[(QD + KVD / 2) * C]);        // k: group 1
  EXPECT_EQ(lq[(QD / 2 + KVD / 2) * C + 3], gq[(QD + KVD + KVD / 2) * C + 3]);  // v: group 1
  const float* gp = tensor(G, global, "layers.0.attn.proj.weight");
  const float* lp = tensor(L, local, "layers.0.attn.proj.weight");
  EXPECT_EQ(lp[5 * (QD / 2) + 2], gp[5 * QD + QD / 2 + 2]);   // row 5, input column 8 + 2
  const float* gf = tensor(G, global, "layers.0.mlp.fc.weight");
  const float* lf = tensor(L, local, "layers.0.mlp.fc.weight");
  EXPECT_EQ(lf[0], gf[(F / 2) * C]);                          // gate rows 12..23
  EXPECT_EQ(lf[(F / 2) * C], gf[(F + F / 2) * C]);            // up rows 36..47
  const float* gd = tensor(G, global, "layers.0.mlp.proj.weight");
  const float* ld = tensor(L, local, "layers.0.mlp.proj.weight");
  EXPECT_EQ(ld[3 * (F / 2)], gd[3 * F + F / 2]);
  EXPECT_EQ(tensor(L, local, "embedding.weight")[0], tensor(G, global, "embedding.weight")[16 * C]);
  EXPECT_EQ(tensor(L, local, "output_layer.weight")[C + 1], tensor(G, global, "output_layer.weight")[17 * C + 1]);
  EXPECT_EQ(tensor(L, local, "final_norm.weight")[7], tensor(G, global, "final_norm.weight")[7]);
}

TEST(TensorParallelMap, ReplicatedAndPartialGradientsAreMarked) {
  const ModelSpec q = primus::testing::tiny_qwen3();
  for (bool sp : {false, true}) {
    const TpShardMap map(q, 2, 0, sp);
    const auto& ts = map.local_layout().tensors;
    for (size_t i = 0; i < ts.size(); ++i) {
      const std::string& n = ts[i].name;
      const bool norm = n.find("norm1") != std::string::npos || n.find("norm2") != std::string::npos ||
                        n.rfind("final_norm", 0) == 0;
      const bool qk = n.find("q_norm") != std::string::npos || n.find("k_norm") != std::string::npos;
      EXPECT_EQ(map.replicated(i), norm || qk) << n;
      // Per-head q/k norm weights are shared by every rank's heads; the norms see part of the
      // sequence only under sequence parallelism.
      EXPECT_EQ(map.partial_grad(i), qk || (norm && sp)) << n << " sp " << sp;
    }
  }
}

TEST(TensorParallelMap, LayoutsThatCannotBeSplitAreRefusedByName) {
  ModelSpec three = primus::testing::tiny_llama();  // 12 heads in 3 kv groups: 4 ranks can neither split nor replicate them
  three.num_attention_heads = 12;
  three.num_query_groups = 3;
  three.kv_channels = 4;
  expect_error<ConfigError>([&] { TpShardMap(three, 4, 0, false); },
                            {"tensor_model_parallel_size 4 is above num_query_groups 3 but not a multiple of it"});
  ModelSpec six = three;  // 6 groups: 4 ranks do not divide them
  six.num_query_groups = 6;
  expect_error<ConfigError>([&] { TpShardMap(six, 4, 0, false); },
                            {"tensor_model_parallel_size 4 does not divide num_query_groups 6"});
  expect_error<ConfigError>([] { TpShardMap(primus::testing::tiny_gpt2(29, 30), 4, 0, false); },
                            {"does not divide the padded vocabulary 30", "make_vocab_size_divisible_by"});
  ModelSpec odd = primus::testing::tiny_moe();
  odd.moe.ffn_hidden_size = 6;
  expect_error<ConfigError>([&] { TpShardMap(odd, 4, 0, false); },
                            {"tensor_model_parallel_size 4 does not divide moe_ffn_hidden_size 6"});
  ModelSpec whole = primus::testing::tiny_qwen3();
  whole.qk_norm_whole = true;
  expect_error<ConfigError>([&] { TpShardMap(whole, 2, 0, false); }, {"qk_layernorm_scope: projection"});
  // One rank is the model itself.
  const TpShardMap one(primus::testing::tiny_llama(), 1, 0, false);
  EXPECT_EQ(one.local_layout().total, one.global_layout().total);
  EXPECT_EQ(one.pieces().size(), one.global_layout().tensors.size());
}
