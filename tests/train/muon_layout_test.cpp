// Which tensors Muon takes and how the fused ones split, on the tiny families: every block is one
// Hugging Face matrix (q_proj, k_proj, v_proj, gate_proj, up_proj, each expert's), the rest stays
// on AdamW, and ZeRO-1 ownership is whole tensors, balanced.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "tests/common/tiny_models.h"
#include "train/muon_layout.h"
#include "train/tensor_parallel.h"

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

// Tensor parallelism: every rank's Muon blocks are pieces of the global ones where the piece
// description says (each local element equals the global block's element at (row0 + r, col0 +
// c), on a buffer of distinct values cut by the shard map), and the all-gather of every rank's
// pieces, assembled, gives each global block whole. The Llama (2 kv groups) under tp2 and tp4
// (k and v replicated on two ranks each) and the DeepSeek-style MoE (experts' pieces) under tp2.
TEST(MuonLayout, TensorParallelPiecesAssembleTheGlobalBlocks) {
  struct Case {
    ModelSpec spec;
    int tp;
  };
  std::vector<Case> cases = {
      {primus::testing::tiny_llama(), 2}, {primus::testing::tiny_llama(), 4}, {primus::testing::tiny_moe(true), 2}};
  for (const auto& [spec, tp] : cases) {
    SCOPED_TRACE("tp" + std::to_string(tp));
    const ParamLayout G = make_param_layout(spec);
    std::vector<float> global(static_cast<size_t>(G.total));
    for (size_t i = 0; i < global.size(); ++i) global[i] = static_cast<float>(i);
    const std::vector<MuonTensor> gm = muon_tensors(spec, G);
    std::vector<TpShardMap> maps;
    std::vector<std::vector<float>> local(static_cast<size_t>(tp));
    for (int r = 0; r < tp; ++r) {
      maps.emplace_back(spec, tp, r, false);
      local[r].resize(static_cast<size_t>(maps[r].local_layout().total));
      maps[r].to_local(global.data(), local[r].data());
    }
    const std::vector<MuonTensor> lm = muon_tensors(maps[0].local_spec(), maps[0].local_layout());
    ASSERT_EQ(lm.size(), gm.size());
    int pieces = 0, replicated = 0, column = 0;
    for (size_t t = 0; t < lm.size(); ++t) {
      for (size_t b = 0; b < lm[t].blocks.size(); ++b) {
        const MuonBlock& lb = lm[t].blocks[b];
        const MuonBlock& gb = gm[t].blocks[b];
        std::vector<float> gathered;
        MuonTpPiece p0;
        for (int r = 0; r < tp; ++r) {
          const MuonTpPiece p = muon_tp_piece(maps[r], gm, lm[t], b);
          if (r == 0) p0 = p;
          ASSERT_FALSE(p.whole) << "every Muon matrix is split under tp";
          for (int64_t i = 0; i < lb.rows * lb.cols; ++i) {
            const int64_t gr = p.row0 + i / lb.cols, gc = p.col0 + i % lb.cols;
            ASSERT_EQ(local[r][static_cast<size_t>(lb.offset + i)], global[static_cast<size_t>(gb.offset + gr * gb.cols + gc)])
                << "rank " << r << " block " << b << " of tensor " << t;
          }
          gathered.insert(gathered.end(), local[r].begin() + lb.offset, local[r].begin() + lb.offset + lb.rows * lb.cols);
        }
        std::vector<float> whole(static_cast<size_t>(gb.rows * gb.cols), -1.f);
        assemble_muon_pieces(p0, tp, gathered.data(), lb.rows, lb.cols, whole.data());
        EXPECT_TRUE(std::equal(whole.begin(), whole.end(), global.begin() + gb.offset)) << "tensor " << t << " block " << b;
        ++pieces;
        replicated += p0.rep > 1;
        column += p0.cols;
      }
    }
    EXPECT_GT(pieces, 0);
    EXPECT_GT(column, 0) << "the output projections are column pieces";
    EXPECT_EQ(replicated > 0, tp == 4) << "k and v are replicated only above num_query_groups";
  }
}
