// Registers the CUDA backend (NVIDIA GPUs: bf16 compute, fp32 master weights, Turbo ops) and
// its patches.
#pragma once
#include "core/backend/backend.h"
#include "core/patches/registry.h"

namespace primus::backends::cuda {

inline constexpr const char* kName = "cuda";
inline constexpr const char* kVersion = "0.1.0";

void register_backend(BackendRegistry& backends, patches::PatchRegistry& patches);
void register_patches(patches::PatchRegistry& patches);  // backends/cuda/patches/
void register_step_patches(patches::PatchRegistry& patches);  // patches/step_patches.cpp (graph, recompute, profile)

}  // namespace primus::backends::cuda
