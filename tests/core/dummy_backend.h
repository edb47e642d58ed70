// A backend that lives only in the tests: it registers itself and runs through the runtime with
// patches in every phase, proving a backend can be added without touching core/.
#pragma once
#include <string>
#include <vector>

#include "core/backend/backend.h"
#include "core/patches/registry.h"

namespace dummy {

// Everything the dummy saw, in order, so tests can check the lifecycle.
std::vector<std::string>& journal();

struct DummyArgs : primus::BackendArgs {
  int64_t train_iters = 0;
  double lr = 0;
  int64_t grad_accum = 1;
  std::string greeting;
  std::vector<std::pair<std::string, std::string>> describe() const override;
};

// Registers the "dummy" backend (version 1.2.0) and its patches into the given registries.
void register_backend(primus::BackendRegistry& backends, primus::patches::PatchRegistry& patches);

}  // namespace dummy
