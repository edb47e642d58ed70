// The dispatcher's priority order, autotune cache, capture skip, fallback warning and errors,
// exercised with fake backends (fake_op.h).
#include <gtest/gtest.h>

#include "fake_op.h"

namespace primus::turbo::testing {
namespace {

using BT = BackendType;

TEST_F(DispatchFixture, DefaultBackendWhenUserSaysNothing) {
  EXPECT_EQ(dispatcher->dispatch({7}), BT::CUBLASLT);
  EXPECT_EQ(runs[BT::CUBLASLT], 1);
  EXPECT_TRUE(warnings.empty());
}

TEST_F(DispatchFixture, EnvironmentOverridesDefault) {
  setenv(kEnv, "turbo", 1);
  EXPECT_EQ(dispatcher->dispatch({7}), BT::TURBO);
}

TEST_F(DispatchFixture, CodeSetterOverridesEnvironment) {
  setenv(kEnv, "TURBO", 1);
  GlobalBackendManager::instance().set_backend(kOp, BT::CPU);
  EXPECT_EQ(dispatcher->dispatch({7}), BT::CPU);
  GlobalBackendManager::instance().clear_backend(kOp);
  EXPECT_EQ(dispatcher->dispatch({7}), BT::TURBO);
}

TEST_F(DispatchFixture, PerPrecisionEnvironment) {
  setenv(kEnv, "fp8:TURBO, other:CPU", 1);
  EXPECT_EQ(dispatcher->dispatch({1, Precision::FP8}), BT::TURBO);
  EXPECT_EQ(dispatcher->dispatch({1, Precision::BF16}), BT::CPU);
  setenv(kEnv, "fp8:TURBO", 1);  // precisions not named keep the op's default
  EXPECT_EQ(dispatcher->dispatch({1, Precision::BF16}), BT::CUBLASLT);
  EXPECT_EQ(dispatcher->dispatch({1, Precision::FP8}), BT::TURBO);
}

TEST_F(DispatchFixture, PerPrecisionCodeSetterBeatsAllPrecisionEnvironment) {
  setenv(kEnv, "CPU", 1);
  GlobalBackendManager::instance().set_backend(kOp, BT::TURBO, Precision::FP32);
  EXPECT_EQ(dispatcher->dispatch({1, Precision::FP32}), BT::TURBO);
  EXPECT_EQ(dispatcher->dispatch({1, Precision::BF16}), BT::CPU);  // setter silent for bf16
}

// A per-call default rule picks the backend before the op's default; a preferred backend that
// cannot handle the call is passed over silently for the default; users' choices still win.
TEST_F(DispatchFixture, DefaultRulePrefersPerCallAndYieldsWhenIncapable) {
  dispatcher->set_default_rule([](const FakeArgs& a) -> std::optional<BT> {
    if (a.m >= 10) return BT::TURBO;
    return std::nullopt;
  });
  EXPECT_EQ(dispatcher->dispatch({7}), BT::CUBLASLT);
  EXPECT_EQ(dispatcher->dispatch({12}), BT::TURBO);
  unsupported[BT::TURBO] = 13;
  EXPECT_EQ(dispatcher->dispatch({13}), BT::CUBLASLT);
  EXPECT_TRUE(warnings.empty());
  setenv(kEnv, "CPU", 1);
  EXPECT_EQ(dispatcher->dispatch({12}), BT::CPU);
}

TEST_F(DispatchFixture, ResetClearsCodeSetters) {
  GlobalBackendManager::instance().set_backend(kOp, BT::TURBO);
  GlobalBackendManager::instance().reset();
  EXPECT_EQ(dispatcher->dispatch({1}), BT::CUBLASLT);
}

TEST_F(DispatchFixture, ForcedBackendThatCannotHandleIsAnErrorNamingOpBackendAndReason) {
  unsupported[BT::TURBO] = 5;
  setenv(kEnv, "TURBO", 1);
  EXPECT_EQ(dispatcher->dispatch({4}), BT::TURBO);
  try {
    dispatcher->dispatch({5});
    FAIL() << "expected an error";
  } catch (const BackendRefusedError& e) {  // a refusal, distinguishable from other failures (the benchmark skips it)
    const std::string w = e.what();
    EXPECT_NE(w.find("fakeop"), std::string::npos) << w;
    EXPECT_NE(w.find("TURBO"), std::string::npos) << w;
    EXPECT_NE(w.find(kEnv), std::string::npos) << w;
    EXPECT_NE(w.find("m=5 unsupported by fake TURBO"), std::string::npos) << w;
  }
  EXPECT_EQ(runs[BT::CUBLASLT], 0) << "no silent fallback";
}

TEST_F(DispatchFixture, ForcedBackendNotRegisteredIsAnError) {
  GlobalBackendManager::instance().set_backend(kOp, BT::CUDNN);
  try {
    dispatcher->dispatch({1});
    FAIL();
  } catch (const RuntimeError& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("CUDNN"), std::string::npos) << w;
    EXPECT_NE(w.find("set_backend"), std::string::npos) << w;
    EXPECT_NE(w.find("CUBLASLT, TURBO, CPU"), std::string::npos) << w;
    EXPECT_EQ(dynamic_cast<const BackendRefusedError*>(&e), nullptr) << "a backend the op lacks is not a refusal of one call";
  }
}

TEST_F(DispatchFixture, FallbackInRegistrationOrderWarnsOncePerPair) {
  unsupported[BT::CUBLASLT] = -1;
  EXPECT_EQ(dispatcher->dispatch({1}), BT::TURBO);
  EXPECT_EQ(dispatcher->dispatch({2}), BT::TURBO);
  EXPECT_EQ(dispatcher->dispatch({1}), BT::TURBO);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("falling back to TURBO"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("unsupported by fake CUBLASLT"), std::string::npos) << warnings[0];
  unsupported[BT::TURBO] = -1;  // a different fallback pair warns again, once
  EXPECT_EQ(dispatcher->dispatch({1}), BT::CPU);
  EXPECT_EQ(dispatcher->dispatch({3}), BT::CPU);
  EXPECT_EQ(warnings.size(), 2u);
}

TEST_F(DispatchFixture, NoCapableBackendListsEveryReason) {
  for (BT t : {BT::CUBLASLT, BT::TURBO, BT::CPU}) unsupported[t] = 9;
  EXPECT_EQ(dispatcher->dispatch({8}), BT::CUBLASLT);
  try {
    dispatcher->dispatch({9});
    FAIL();
  } catch (const RuntimeError& e) {
    const std::string w = e.what();
    for (const char* n : {"fake CUBLASLT", "fake TURBO", "fake CPU"})
      EXPECT_NE(w.find(n), std::string::npos) << w;
  }
}

TEST_F(DispatchFixture, GlobalAutotuneTimesOnceAndCachesWinner) {
  setenv("PRIMUS_TURBO_AUTO_TUNE", "1", 1);
  EXPECT_EQ(dispatcher->dispatch({1}), BT::TURBO);  // cheapest (cost 1.0)
  EXPECT_EQ(dispatcher->autotune_runs(), 1u);
  EXPECT_EQ(runs[BT::CUBLASLT], 1);  // each timed once by the fake timer
  EXPECT_EQ(runs[BT::CPU], 1);
  EXPECT_EQ(runs[BT::TURBO], 2);  // timed, then executed
  cost[BT::CPU] = 0.1;            // cached: a faster backend now is not re-timed for this key
  EXPECT_EQ(dispatcher->dispatch({1}), BT::TURBO);
  EXPECT_EQ(dispatcher->autotune_runs(), 1u);
  EXPECT_EQ(runs[BT::CPU], 1);
  EXPECT_EQ(dispatcher->dispatch({2}), BT::CPU);  // a new key is timed
  EXPECT_EQ(dispatcher->autotune_runs(), 2u);
}

TEST_F(DispatchFixture, AutotuneFromPerOpEnvironmentAndCodeSwitch) {
  setenv(kEnv, "AUTOTUNE", 1);
  EXPECT_EQ(dispatcher->dispatch({1}), BT::TURBO);
  EXPECT_EQ(dispatcher->autotune_runs(), 1u);
  unsetenv(kEnv);
  GlobalBackendManager::instance().set_auto_tune(true);
  cost[BT::CUBLASLT] = 0.5;
  EXPECT_EQ(dispatcher->dispatch({3}), BT::CUBLASLT);
  GlobalBackendManager::instance().set_auto_tune(false);
  setenv("PRIMUS_TURBO_AUTO_TUNE", "1", 1);  // the code switch wins over the environment
  EXPECT_EQ(dispatcher->dispatch({4}), BT::CUBLASLT);
  EXPECT_EQ(dispatcher->autotune_runs(), 2u);
}

TEST_F(DispatchFixture, UserBackendBeatsAutotune) {
  setenv("PRIMUS_TURBO_AUTO_TUNE", "1", 1);
  setenv(kEnv, "CPU", 1);
  EXPECT_EQ(dispatcher->dispatch({1}), BT::CPU);
  EXPECT_EQ(dispatcher->autotune_runs(), 0u);
}

TEST_F(DispatchFixture, AutotuneSkipsBackendsThatCannotHandle) {
  setenv("PRIMUS_TURBO_AUTO_TUNE", "1", 1);
  unsupported[BT::TURBO] = -1;
  EXPECT_EQ(dispatcher->dispatch({1}), BT::CUBLASLT);
  EXPECT_EQ(runs[BT::TURBO], 0);
}

TEST_F(DispatchFixture, AutotuneWithOneCapableBackendTimesNothing) {
  setenv("PRIMUS_TURBO_AUTO_TUNE", "1", 1);
  unsupported[BT::TURBO] = -1;
  unsupported[BT::CPU] = -1;
  EXPECT_EQ(dispatcher->dispatch({1}), BT::CUBLASLT);
  EXPECT_EQ(runs[BT::CUBLASLT], 1);
}

TEST_F(DispatchFixture, AutotuneCacheEvictsLeastRecentlyUsed) {
  setenv("PRIMUS_TURBO_AUTO_TUNE", "1", 1);  // capacity 4 (fixture)
  for (int m = 0; m < 4; ++m) dispatcher->dispatch({m});
  EXPECT_EQ(dispatcher->autotune_runs(), 4u);
  dispatcher->dispatch({0});  // refresh key 0; key 1 is now the oldest
  dispatcher->dispatch({4});  // evicts key 1
  EXPECT_EQ(dispatcher->autotune_cache_size(), 4u);
  EXPECT_EQ(dispatcher->autotune_evictions(), 1u);
  dispatcher->dispatch({0});
  EXPECT_EQ(dispatcher->autotune_runs(), 5u) << "key 0 must still be cached";
  dispatcher->dispatch({1});
  EXPECT_EQ(dispatcher->autotune_runs(), 6u) << "key 1 was evicted and is timed again";
}

TEST_F(DispatchFixture, ResetClearsAutotuneCache) {
  setenv("PRIMUS_TURBO_AUTO_TUNE", "1", 1);
  dispatcher->dispatch({1});
  GlobalBackendManager::instance().reset();
  EXPECT_EQ(dispatcher->autotune_cache_size(), 0u);
  dispatcher->dispatch({1});
  EXPECT_EQ(dispatcher->autotune_runs(), 2u);
}

TEST_F(DispatchFixture, CaptureSkipsAutotuneButUsesCachedWinner) {
  setenv("PRIMUS_TURBO_AUTO_TUNE", "1", 1);
  dispatcher->dispatch({1});  // cached: TURBO
  {
    GlobalBackendManager::CaptureScope capture;
    EXPECT_TRUE(GlobalBackendManager::instance().capturing());
    EXPECT_EQ(dispatcher->dispatch({1}), BT::TURBO);     // cache hit is fine while capturing
    EXPECT_EQ(dispatcher->dispatch({2}), BT::CUBLASLT);  // miss: default, nothing timed
    EXPECT_EQ(dispatcher->autotune_runs(), 1u);
    EXPECT_EQ(dispatcher->autotune_cache_size(), 1u);
  }
  EXPECT_FALSE(GlobalBackendManager::instance().capturing());
  EXPECT_EQ(dispatcher->dispatch({2}), BT::TURBO);  // after capture, tuned normally
  EXPECT_EQ(dispatcher->autotune_runs(), 2u);
}

TEST_F(DispatchFixture, CaptureProbeSkipsAutotune) {
  setenv("PRIMUS_TURBO_AUTO_TUNE", "1", 1);
  dispatcher->set_capture_probe([](const FakeArgs& a) { return a.m == 42; });
  EXPECT_EQ(dispatcher->dispatch({42}), BT::CUBLASLT);
  EXPECT_EQ(dispatcher->autotune_runs(), 0u);
  EXPECT_EQ(dispatcher->dispatch({41}), BT::TURBO);
}

TEST_F(DispatchFixture, OpsThatOptOutOfAutotuneAreNeverTimed) {
  OpDispatcher<FakeArgs> inplace("fakeinplace", BT::CPU, DispatcherOptions{false, 4});
  int timed = 0, ran = 0;
  inplace.set_timer([&](const FakeArgs&, const std::function<void()>& run) { ++timed; run(); return 1.0; });
  inplace.register_backend(make_backend<FakeArgs>(BT::TURBO, [](const FakeArgs&) { return std::string(); }, [&](const FakeArgs&) { ++ran; }));
  inplace.register_backend(make_backend<FakeArgs>(BT::CPU, [](const FakeArgs&) { return std::string(); }, [&](const FakeArgs&) { ++ran; }));
  setenv("PRIMUS_TURBO_AUTO_TUNE", "1", 1);
  EXPECT_EQ(inplace.dispatch({1}), BT::CPU);
  EXPECT_EQ(timed, 0);
  EXPECT_EQ(ran, 1);
}

TEST_F(DispatchFixture, MalformedEnvironmentIsAConfigError) {
  setenv(kEnv, "fp8:WARP", 1);
  EXPECT_THROW(dispatcher->dispatch({1}), ConfigError);
  setenv(kEnv, "TURBO", 1);  // fixed text is parsed again
  EXPECT_EQ(dispatcher->dispatch({1}), BT::TURBO);
  unsetenv(kEnv);
  setenv("PRIMUS_TURBO_AUTO_TUNE", "maybe", 1);
  try {
    dispatcher->dispatch({1});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("PRIMUS_TURBO_AUTO_TUNE"), std::string::npos);
  }
}

TEST_F(DispatchFixture, SelectDoesNotExecuteOutsideAutotune) {
  EXPECT_EQ(dispatcher->select({1}), BT::CUBLASLT);
  EXPECT_TRUE(runs.empty());
}

TEST(FunctionBackend, ThrowingCheckerMeansCannotHandle) {
  auto b = make_backend<FakeArgs>(
      BackendType::TURBO, [](const FakeArgs&) -> std::string { throw std::runtime_error("boom"); },
      [](const FakeArgs&) {});
  std::string why;
  EXPECT_FALSE(b->can_handle({1}, &why));
  EXPECT_NE(why.find("boom"), std::string::npos);
}

TEST(GlobalBackendManager, EnvVarNamePerOp) {
  EXPECT_EQ(GlobalBackendManager::env_var_for("gemm"), "PRIMUS_TURBO_GEMM_BACKEND");
  EXPECT_EQ(GlobalBackendManager::env_var_for("grouped-gemm"), "PRIMUS_TURBO_GROUPED_GEMM_BACKEND");
}

}  // namespace
}  // namespace primus::turbo::testing
