// A fake op for dispatcher tests: its backends record each execution, and a per-test
// "support" table decides what each backend can handle.
#pragma once
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "turbo/dispatch/dispatcher.h"

namespace primus::turbo::testing {

struct FakeArgs {
  int m = 0;
  Precision prec = Precision::BF16;
  std::string key() const { return fmt::format("fake m={} {}", m, precision_name(prec)); }
  Precision precision() const { return prec; }
};

// Holds the fake dispatcher and what happened; restores the manager and environment.
class DispatchFixture : public ::testing::Test {
 protected:
  static constexpr const char* kOp = "fakeop";
  static constexpr const char* kEnv = "PRIMUS_TURBO_FAKEOP_BACKEND";

  void SetUp() override {
    unsetenv(kEnv);
    unsetenv("PRIMUS_TURBO_AUTO_TUNE");
    GlobalBackendManager::instance().reset();
    GlobalBackendManager::instance().set_warning_sink(
        [this](const std::string& m) { warnings.push_back(m); });
    dispatcher = std::make_unique<OpDispatcher<FakeArgs>>(kOp, BackendType::CUBLASLT,
                                                          DispatcherOptions{true, 4});
    for (BackendType t : {BackendType::CUBLASLT, BackendType::TURBO, BackendType::CPU}) add(t);
    // Fake timer: the cost of a backend is its entry in `cost` (every run is counted).
    dispatcher->set_timer([this](const FakeArgs&, const std::function<void()>& run) {
      run();
      return cost[last_ran];
    });
  }
  void TearDown() override {
    unsetenv(kEnv);
    unsetenv("PRIMUS_TURBO_AUTO_TUNE");
    GlobalBackendManager::instance().set_warning_sink(nullptr);
    GlobalBackendManager::instance().reset();
  }

  void add(BackendType t) {
    dispatcher->register_backend(make_backend<FakeArgs>(
        t,
        [this, t](const FakeArgs& a) -> std::string {
          auto it = unsupported.find(t);
          if (it != unsupported.end() && (it->second < 0 || it->second == a.m))
            return fmt::format("m={} unsupported by fake {}", a.m, backend_name(t));
          return "";
        },
        [this, t](const FakeArgs&) {
          last_ran = t;
          runs[t]++;
        }));
  }

  std::unique_ptr<OpDispatcher<FakeArgs>> dispatcher;
  std::map<BackendType, int> unsupported;  // backend -> m it rejects (-1: everything)
  std::map<BackendType, double> cost{{BackendType::CUBLASLT, 3.0}, {BackendType::TURBO, 1.0},
                                     {BackendType::CPU, 9.0}};
  std::map<BackendType, int> runs;
  BackendType last_ran = BackendType::CPU;
  std::vector<std::string> warnings;
};

}  // namespace primus::turbo::testing
