// The real search for this machine's cuBLASLt and cuDNN (CUDA builds; no GPU needed: loading
// and binding needs none). Where the toolkit's copy exists the search must find a copy and bind
// every listed entry point; where the machine has none, the reason must name the library and
// the places tried. Either way nothing throws.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "turbo/kernels/cublaslt/cublaslt_api.h"
#ifdef PRIMUS_TURBO_WITH_CUDNN
#include "turbo/kernels/cudnn/cudnn_api.h"
#endif

namespace {

template <class Table>
void expect_found_or_explained(Table& table, const char* env, const char* file, const char* display) {
  if (std::getenv(env)) GTEST_SKIP() << env << " is set: the search is not this test's";
  const std::string why = table.unavailable_reason();
  if (std::filesystem::exists(std::string("/usr/local/cuda/lib64/") + file)) {
    EXPECT_EQ(why, "") << "the toolkit has " << file << " but the search did not load it";
    EXPECT_FALSE(table.path().empty());
    EXPECT_NO_THROW(table.get());
  } else if (!why.empty()) {
    EXPECT_NE(why.find(display), std::string::npos) << why;
    EXPECT_NE(why.find(std::string("/usr/local/cuda/lib64/") + file), std::string::npos) << why;
  }
}

TEST(RealVendorLibraries, CublasLtIsFoundWhereTheToolkitHasIt) {
  expect_found_or_explained(primus::turbo::cublaslt::library(), "PRIMUS_CUBLASLT_LIBRARY", "libcublasLt.so.13", "cuBLASLt");
}

#ifdef PRIMUS_TURBO_WITH_CUDNN
TEST(RealVendorLibraries, CudnnIsFoundWhereTheToolkitHasIt) {
  expect_found_or_explained(primus::turbo::cudnn::library(), "PRIMUS_CUDNN_LIBRARY", "libcudnn.so.9", "cuDNN");
  if (primus::turbo::cudnn::library().unavailable_reason().empty())
    EXPECT_GE(primus::turbo::cudnn::dnn().cudnnGetVersion(), 90000u);
}
#endif

}  // namespace
