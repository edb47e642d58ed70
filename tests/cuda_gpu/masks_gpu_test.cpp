// Sliding window and document masks in the cuda model on the device (bf16, TURBO attention
// kernels) against the fp32 reference (masks_parity.h), and the device document tables against
// the host ones. Skips without a GPU.
#include <cuda_runtime_api.h>

#include "tests/cuda_gpu/masks_parity.h"
#include "turbo/kernels/cuda/document_masks.h"

namespace primus::backends::cuda::testing {
namespace {

class MasksGpuTest : public CudaGpuTest {};

// bf16 against fp32: model_parity_test.cpp's step-0 loss gate, its Llama gradient gate rounded up.
TEST_F(MasksGpuTest, WindowAndDocumentMasksMatchReference) { expect_mask_parity(turbo::Device::CUDA, 1e-2, 3e-2); }
// bf16: the two sides round differently (other shapes, other tiles), within 1e-2 of the loss; the
// host test checks that the unmasked sample differs.
TEST_F(MasksGpuTest, PackedSampleEqualsDocumentsAlone) { expect_packed_equals_separate(turbo::Device::CUDA, 1e-2, false); }

// The device tables (turbo/kernels/cuda/document_masks.cu) equal the host ones, over rows longer
// than the kernel's 256-token chunks, with an eod as a row's first and last token.
TEST_F(MasksGpuTest, DocumentTablesMatchHost) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t B = 3, T = 1000;
  const int32_t eod = 7;
  std::uniform_int_distribution<int32_t> tok(0, 40);  // an eod about every 41 tokens
  std::vector<int32_t> tokens(B * T);
  for (auto& x : tokens) x = tok(rng);
  tokens[0] = tokens[T - 1] = tokens[T] = eod;
  std::vector<int32_t> pos(B * T), cu(B * T + 1);
  train::build_fixed_document_tables(tokens.data(), B, T, eod, pos.data(), cu.data());
  int32_t *d_tok = nullptr, *d_pos = nullptr, *d_cu = nullptr;
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d_tok), tokens.size() * 4));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d_pos), pos.size() * 4));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d_cu), cu.size() * 4));
  CUDA_CHECK(cudaMemcpy(d_tok, tokens.data(), tokens.size() * 4, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemset(d_pos, 0xFF, pos.size() * 4));
  CUDA_CHECK(cudaMemset(d_cu, 0xFF, cu.size() * 4));
  turbo::cuda::build_document_tables(d_tok, B, T, eod, d_pos, d_cu, nullptr);
  std::vector<int32_t> got_pos(pos.size()), got_cu(cu.size());
  CUDA_CHECK(cudaMemcpy(got_pos.data(), d_pos, pos.size() * 4, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(got_cu.data(), d_cu, cu.size() * 4, cudaMemcpyDeviceToHost));
  cudaFree(d_tok), cudaFree(d_pos), cudaFree(d_cu);
  EXPECT_EQ(got_pos, pos);
  EXPECT_EQ(got_cu, cu);
}

}  // namespace
}  // namespace primus::backends::cuda::testing
