// The libFuzzer entry points of a fuzz executable, which holds exactly one registered target.
#include <cstdio>
#include <cstdlib>

#include "fuzz/fuzz_target.h"

namespace {
primus::fuzz::TargetFn the_target() {
  static primus::fuzz::TargetFn fn = [] {
    auto& t = primus::fuzz::targets();
    if (t.size() != 1) {
      std::fprintf(stderr, "a fuzz executable must link exactly one target (has %zu)\n", t.size());
      std::abort();
    }
    return t.front().fn;
  }();
  return fn;
}
}  // namespace

// Runs the target once on an empty input before fuzzing starts, so one-time set-up (loading
// GPT-2's vocabulary, say) is not charged to the first input's -timeout.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  the_target()(nullptr, 0);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  the_target()(data, size);
  return 0;
}
