// cuBLASLt and cuDNN are loaded at first use. Here both are made unloadable (the environment
// names files that do not exist), and the dispatcher must treat their backends as incapable,
// with the loader's message, instead of crashing. No GPU is needed: the views below claim to be
// device memory, and every call is refused before a kernel could run.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "core/util/error.h"
#include "turbo/dispatch/backend_manager.h"
#include "turbo/kernels/cublaslt/cublaslt_api.h"
#include "turbo/ops/attention.h"
#include "turbo/ops/gemm.h"
#ifdef PRIMUS_TURBO_WITH_CUDNN
#include "turbo/kernels/cudnn/cudnn_api.h"
#endif

using namespace primus::turbo;

namespace {

const char* kMissingLt = "/nonexistent/primus-test/libcublasLt.so";
const char* kMissingDnn = "/nonexistent/primus-test/libcudnn.so";
// Before main, hence before anything could load either library in this process.
const bool kEnvSet = [] {
  setenv("PRIMUS_CUBLASLT_LIBRARY", kMissingLt, 1);
  setenv("PRIMUS_CUDNN_LIBRARY", kMissingDnn, 1);
  return true;
}();

std::vector<char>& backing() {
  static std::vector<char> b(1 << 20);
  return b;
}
// A view that claims to be on the device; never dereferenced here.
TensorView fake_device(DType t, std::initializer_list<int64_t> shape) {
  auto* p = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(backing().data()) + 255) & ~uintptr_t{255});
  return TensorView(p, t, Device::CUDA, shape);
}

GemmArgs device_gemm() {
  GemmArgs g;
  g.a = fake_device(DType::BF16, {64, 32});
  g.b = fake_device(DType::BF16, {32, 16});
  g.d = fake_device(DType::BF16, {64, 16});
  return g;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const primus::RuntimeError& e) {
    return e.what();
  }
  return "(no error)";
}

class LazyLibs : public ::testing::Test {
 protected:
  void TearDown() override { GlobalBackendManager::instance().reset(); }
};

TEST_F(LazyLibs, CublasLtReasonNamesTheVariableAndTheFile) {
  ASSERT_TRUE(kEnvSet);
  const std::string why = cublaslt::library().unavailable_reason();
  EXPECT_NE(why.find("cuBLASLt"), std::string::npos) << why;
  EXPECT_NE(why.find(std::string("PRIMUS_CUBLASLT_LIBRARY=") + kMissingLt), std::string::npos) << why;
  EXPECT_NE(why.find("no such file"), std::string::npos) << why;
  EXPECT_EQ(cublaslt::library().path(), "");
  EXPECT_THROW(cublaslt::lt(), primus::RuntimeError);
}

TEST_F(LazyLibs, ForcedCublasLtGemmIsAnErrorWithTheLoaderMessage) {
  GlobalBackendManager::instance().set_backend("gemm", BackendType::CUBLASLT);
  const std::string w = message_of([] { gemm(device_gemm()); });
  EXPECT_NE(w.find("backend CUBLASLT"), std::string::npos) << w;
  EXPECT_NE(w.find("cannot handle"), std::string::npos) << w;
  EXPECT_NE(w.find(kMissingLt), std::string::npos) << w;
}

TEST_F(LazyLibs, DefaultGemmOnTheDeviceSaysNoBackendCanAndWhy) {
  const std::string w = message_of([] { gemm(device_gemm()); });
  EXPECT_NE(w.find("no backend can handle"), std::string::npos) << w;
  EXPECT_NE(w.find("CUBLASLT: cuBLASLt"), std::string::npos) << w;
}

TEST_F(LazyLibs, HostGemmStillRunsOnTheCpuBackend) {
  std::vector<float> a(6, 1.0f), b(6, 2.0f), d(4, 0.0f);
  GemmArgs g;
  g.a = TensorView(a.data(), DType::F32, Device::CPU, {2, 3});
  g.b = TensorView(b.data(), DType::F32, Device::CPU, {3, 2});
  g.d = TensorView(d.data(), DType::F32, Device::CPU, {2, 2});
  EXPECT_EQ(gemm(g), BackendType::CPU);
  EXPECT_FLOAT_EQ(d[3], 6.0f);
}

#ifdef PRIMUS_TURBO_WITH_CUDNN
TEST_F(LazyLibs, ForcedCudnnAttentionIsAnErrorWithTheLoaderMessage) {
  const std::string why = cudnn::library().unavailable_reason();
  EXPECT_NE(why.find(std::string("PRIMUS_CUDNN_LIBRARY=") + kMissingDnn), std::string::npos) << why;
  GlobalBackendManager::instance().set_backend("attention", BackendType::CUDNN);
  AttentionForwardArgs f;
  f.q = fake_device(DType::BF16, {1, 16, 2, 64});
  f.k = fake_device(DType::BF16, {1, 16, 2, 64});
  f.v = fake_device(DType::BF16, {1, 16, 2, 64});
  f.out = fake_device(DType::BF16, {1, 16, 2, 64});
  f.lse = fake_device(DType::F32, {1, 2, 16});
  const std::string w = message_of([&] { attention_forward(f); });
  EXPECT_NE(w.find("backend CUDNN"), std::string::npos) << w;
  EXPECT_NE(w.find(kMissingDnn), std::string::npos) << w;
}
#endif

}  // namespace
