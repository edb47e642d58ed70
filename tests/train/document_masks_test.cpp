// The document tables of packed samples (train/document_masks.h) against Megatron's
// get_ltor_masks_and_position_ids, worked by hand: the end-of-document token belongs to the
// document it ends, the token after it starts the next one at position 0.
#include "train/document_masks.h"

#include <gtest/gtest.h>

#include <random>

#include "core/util/error.h"

namespace primus::train {
namespace {

constexpr int32_t kEod = 9;

TEST(DocumentMasks, HandWorkedTwoRows) {
  // Row 0: a b EOD | c d EOD | e     Row 1: EOD | f g h i j EOD (an EOD last adds no document)
  const std::vector<int32_t> tokens{1, 2, kEod, 3, 4, kEod, 5, kEod, 6, 7, 8, 1, 2, kEod};
  DocumentTables t;
  build_document_tables(tokens.data(), 2, 7, {true, true, kEod}, &t);
  EXPECT_EQ(t.positions, (std::vector<int32_t>{0, 1, 2, 0, 1, 2, 0, 0, 0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(t.cu_seqlens, (std::vector<int32_t>{0, 3, 6, 7, 8, 14}));

  build_document_tables(tokens.data(), 2, 7, {false, true, kEod}, &t);  // positions only
  EXPECT_EQ(t.positions, (std::vector<int32_t>{0, 1, 2, 0, 1, 2, 0, 0, 0, 1, 2, 3, 4, 5}));
  EXPECT_TRUE(t.cu_seqlens.empty());

  build_document_tables(tokens.data(), 2, 7, {true, false, kEod}, &t);  // attention only
  EXPECT_EQ(t.positions, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(t.cu_seqlens, (std::vector<int32_t>{0, 3, 6, 7, 8, 14}));
}

TEST(DocumentMasks, FixedTablesDescribeTheSameDocuments) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int32_t> tok(0, 11);  // eod about one token in twelve
  const int64_t B = 3, T = 50;
  std::vector<int32_t> tokens(B * T);
  for (auto& x : tokens) x = tok(rng);
  DocumentTables t;
  build_document_tables(tokens.data(), B, T, {true, true, kEod}, &t);
  std::vector<int32_t> pos(B * T), cu(B * T + 1);
  build_fixed_document_tables(tokens.data(), B, T, kEod, pos.data(), cu.data());
  EXPECT_EQ(pos, t.positions);
  // Every token's entry is its document's start: the compact table's last offset <= it.
  for (int64_t i = 0; i < B * T; ++i) {
    int32_t start = 0;
    for (int32_t c : t.cu_seqlens)
      if (c <= i) start = c;
    EXPECT_EQ(cu[i], start) << i;
  }
  EXPECT_EQ(cu[B * T], B * T);
}

TEST(DocumentMasks, OffMeansPlainPositionsAndNoEodNeeded) {
  const std::vector<int32_t> tokens{kEod, 1, kEod, 2};
  DocumentTables t;
  build_document_tables(tokens.data(), 1, 4, {}, &t);
  EXPECT_EQ(t.positions, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_TRUE(t.cu_seqlens.empty());
  EXPECT_THROW(build_document_tables(tokens.data(), 1, 4, {true, false, -1}, &t), RuntimeError);
}

// eod_mask_loss (Megatron-LM's loss_mask[tokens == eod] = 0): the target after each
// end-of-document input is dropped, the one at an end-of-document target is kept; a target that
// was already ignored stays so and is not counted.
TEST(DocumentMasks, EodMaskLossDropsTheTargetAfterEachEnd) {
  const std::vector<int32_t> inputs{1, 2, kEod, 3, kEod, kEod, 4, 5};
  std::vector<int32_t> targets{2, kEod, 3, kEod, kEod, 4, 5, -100};
  EXPECT_EQ(mask_eod_targets(inputs.data(), targets.data(), 8, kEod, -100), 4);
  EXPECT_EQ(targets, (std::vector<int32_t>{2, kEod, -100, kEod, -100, -100, 5, -100}));
  std::vector<int32_t> none{1, 2};
  EXPECT_EQ(mask_eod_targets(inputs.data(), none.data(), 2, kEod, -100), 2);
  EXPECT_THROW(mask_eod_targets(inputs.data(), targets.data(), 8, -1, -100), RuntimeError);
}

}  // namespace
}  // namespace primus::train
