// Registers the reference backend (CPU, fp32) and its patches.
#pragma once
#include "core/backend/backend.h"
#include "core/patches/registry.h"

namespace primus::backends::reference {

inline constexpr const char* kName = "reference";
inline constexpr const char* kVersion = "0.1.0";

void register_backend(BackendRegistry& backends, patches::PatchRegistry& patches);
void register_patches(patches::PatchRegistry& patches);  // backends/reference/patches/

}  // namespace primus::backends::reference
