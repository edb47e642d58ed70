// The TURBO GEMM's argument checks that come before any device query (so they hold on a machine
// without a GPU, where CI runs): each refusal names what is wrong, and the GELU epilogues, which
// exist only in the 16-bit-output kernels, are refused for an f32 D instead of reaching a kernel
// that has no code for them.
#include <gtest/gtest.h>

#include <string>

#include "turbo/kernels/cuda/gemm_sm90.h"

namespace primus::turbo::cuda {
namespace {

alignas(16) char g_a[256], g_b[256], g_d[1024], g_aux[1024], g_bias[64];

GemmSm90Problem problem(GemmSm90Epilogue epi, DType d_dtype) {
  GemmSm90Problem p;
  p.m = 8, p.n = 8, p.k = 8;
  p.in_dtype = DType::BF16;
  p.a = {g_a, 8, false};
  p.b = {g_b, 8, true};
  p.d = g_d;
  p.ldd = 8;
  p.d_dtype = d_dtype;
  p.epilogue = epi;
  if (epi != GemmSm90Epilogue::None) {
    p.aux = g_aux;
    p.ld_aux = 8;
  }
  return p;
}

void expect_reason(const GemmSm90Problem& p, const std::string& part) {
  const std::string why = gemm_sm90_unsupported_reason(p);
  EXPECT_NE(why.find(part), std::string::npos) << "reason: '" << why << "', expected it to mention '" << part << "'";
}

TEST(GemmSm90Host, GeluEpiloguesNeedA16BitD) {
  expect_reason(problem(GemmSm90Epilogue::GeluAux, DType::F32), "16-bit D");
  expect_reason(problem(GemmSm90Epilogue::DGelu, DType::F32), "16-bit D");
}

TEST(GemmSm90Host, EpilogueArgumentsAreChecked) {
  GemmSm90Problem p = problem(GemmSm90Epilogue::GeluAux, DType::BF16);
  p.aux = nullptr;
  expect_reason(p, "need an aux matrix");
  p = problem(GemmSm90Epilogue::GeluAux, DType::BF16);
  p.ld_aux = 4;
  expect_reason(p, "aux's leading dimension 4 is below n = 8");
  p = problem(GemmSm90Epilogue::DGelu, DType::BF16);
  p.bias = g_bias;
  expect_reason(p, "dgelu epilogue takes no bias");
}

TEST(GemmSm90Host, OperandChecksNameTheOperand) {
  GemmSm90Problem p = problem(GemmSm90Epilogue::None, DType::F32);
  p.ldd = 4;
  expect_reason(p, "D's leading dimension 4 is below n = 8");
  p = problem(GemmSm90Epilogue::None, DType::F16);
  expect_reason(p, "D is f16");  // bf16 inputs write bf16 or f32
  p = problem(GemmSm90Epilogue::None, DType::BF16);
  p.a.ld = 12;
  expect_reason(p, "A's leading dimension 12 is not a multiple of 8");
  p = problem(GemmSm90Epilogue::None, DType::BF16);
  p.b.ptr = g_b + 2;
  expect_reason(p, "B's base pointer is not 16-byte aligned");
}

}  // namespace
}  // namespace primus::turbo::cuda
