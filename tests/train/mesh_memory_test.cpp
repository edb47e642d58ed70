// The per-rank memory a mesh implies (train/mesh_memory.h), worked by hand on the tiny Llama and
// checked on Llama-3-8B: tp divides the split tensors (norms stay whole), the sharding strategy
// divides the state over dp x cp, context parallelism the activations, sequence parallelism the
// hidden-sized ones.
#include <gtest/gtest.h>

#include "tests/common/tiny_models.h"
#include "train/mesh_memory.h"

using namespace primus::train;
using primus::parallel::Dim;
using primus::parallel::DpSharding;
using primus::parallel::ParallelSizes;

namespace {
ParallelSizes mesh(int64_t tp, int64_t cp, int64_t dp, DpSharding sh, bool sp = false) {
  ParallelSizes s;
  s[Dim::TP] = tp, s[Dim::CP] = cp, s[Dim::DP] = dp;
  s.sharding = sh;
  s.sequence_parallel = sp;
  return s;
}
}  // namespace

TEST(MeshMemory, TinyLlamaByHand) {
  const ModelSpec m = primus::testing::tiny_llama();  // hidden 16, 4 heads of 4, 2 kv groups, ffn 24, vocab 32, 2 layers
  const MeshMemory one = mesh_memory_per_rank(m, mesh(1, 1, 1, DpSharding::NoShard), 2, 8);
  EXPECT_EQ(one.parameters_per_rank, m.num_parameters());
  const double P = static_cast<double>(m.num_parameters());
  EXPECT_DOUBLE_EQ(one.weights, 2 * P);
  EXPECT_DOUBLE_EQ(one.master + one.gradients + one.optimizer, 16 * P);
  // Per token and layer: 2 x (4 x 16 hidden + qkv 32 + attention out 16 + gate/up 48 + act 24) + 4 x 4 heads.
  const double per_token_layer = 2.0 * (64 + 32 + 16 + 48 + 24) + 16;
  EXPECT_DOUBLE_EQ(one.activations, 2 * 8 * 2 * per_token_layer);
  EXPECT_DOUBLE_EQ(one.logits, 2 * 8 * 2.0 * 32);

  // tp 2: layers' matrices and the vocabulary halve, the norms (16 each: 2 per layer + final) do not.
  const MeshMemory tp = mesh_memory_per_rank(m, mesh(2, 1, 1, DpSharding::NoShard), 2, 8);
  const int64_t norms = 5 * 16;
  EXPECT_EQ(tp.parameters_per_rank, (m.num_parameters() - norms) / 2 + norms);
  // Without sequence parallelism the hidden-sized activations stay whole; with it they halve.
  EXPECT_DOUBLE_EQ(tp.activations, 2 * 8 * 2 * (2.0 * (64 + (32 + 16 + 48 + 24) / 2.0) + 8));
  const MeshMemory sp = mesh_memory_per_rank(m, mesh(2, 1, 1, DpSharding::NoShard, true), 2, 8);
  EXPECT_DOUBLE_EQ(sp.activations, one.activations / 2);
  EXPECT_DOUBLE_EQ(sp.logits, one.logits / 2);

  // FSDP over dp 2 x cp 2: the state of the tp slice over 4 ranks, plus one layer's weights and
  // gradient whole; cp halves the tokens.
  const MeshMemory f = mesh_memory_per_rank(m, mesh(2, 2, 2, DpSharding::OptimGradsParams, true), 2, 8);
  const double Pt = static_cast<double>(tp.parameters_per_rank);
  const double layer = (Pt - (32 * 16 * 2 / 2 + 16)) / 2;  // minus embedding and head halves and the final norm
  EXPECT_DOUBLE_EQ(f.weights, 2 * (Pt / 4 + layer));
  EXPECT_DOUBLE_EQ(f.gradients, 4 * (Pt / 4 + layer));
  EXPECT_DOUBLE_EQ(f.master, 4 * Pt / 4);
  EXPECT_DOUBLE_EQ(f.optimizer, 8 * Pt / 4);
  EXPECT_DOUBLE_EQ(f.activations, sp.activations / 2);
  // ZeRO-1 shards master and moments only.
  const MeshMemory z1 = mesh_memory_per_rank(m, mesh(1, 1, 4, DpSharding::Optim), 2, 8);
  EXPECT_DOUBLE_EQ(z1.weights, 2 * P);
  EXPECT_DOUBLE_EQ(z1.gradients, 4 * P);
  EXPECT_DOUBLE_EQ(z1.master + z1.optimizer, 12 * P / 4);
}

TEST(MeshMemory, Llama3_8BOnSixteenRanks) {
  ModelSpec m = primus::testing::tiny_llama();
  m.vocab_size = m.padded_vocab_size = 128256;
  m.seq_length = 8192, m.num_layers = 32, m.hidden_size = 4096, m.num_attention_heads = 32, m.num_query_groups = 8;
  m.ffn_hidden_size = 14336;
  ASSERT_EQ(m.num_parameters(), 8030261248);  // Llama-3-8B
  const MeshMemory r = mesh_memory_per_rank(m, mesh(2, 2, 4, DpSharding::OptimGradsParams, true), 1, 8192);
  EXPECT_NEAR(r.parameters_per_rank / 1e6, 4015.3, 0.1);
  // 18 bytes a parameter of the tp slice over 8 ranks, plus one layer (218M / 2) in bf16 and fp32.
  EXPECT_NEAR((r.weights + r.master + r.gradients + r.optimizer) / double(1 << 30), 9.03, 0.01);
  EXPECT_NEAR(r.activations / double(1 << 30), 8.51, 0.01);
  EXPECT_GT(mesh_memory_per_rank(m, mesh(1, 1, 16, DpSharding::NoShard), 1, 8192).total(), 9 * r.total());
}
