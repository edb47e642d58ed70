// Names of the kernel backends and of the precision classes the dispatcher selects by.
#pragma once
#include <cstdint>
#include <optional>
#include <string_view>

#include "turbo/core/dtype.h"

namespace primus::turbo {

// Who implements a kernel: the host reference (turbo/kernels/cpu), NVIDIA's libraries, or
// Turbo's own CUDA kernels (turbo/kernels/cuda).
enum class BackendType : uint8_t { CPU, CUBLASLT, CUDNN, TURBO };
inline constexpr BackendType kAllBackends[] = {BackendType::CPU, BackendType::CUBLASLT,
                                               BackendType::CUDNN, BackendType::TURBO};

std::string_view backend_name(BackendType b);  // "CPU", "CUBLASLT", "CUDNN", "TURBO"
// Case-insensitive inverse of backend_name; nullopt for anything else.
std::optional<BackendType> parse_backend(std::string_view s);

// The precision class of a call: what a per-precision backend choice keys on
// (PRIMUS_TURBO_GEMM_BACKEND=fp8:TURBO,other:CUBLASLT).
enum class Precision : uint8_t { FP32, FP16, BF16, FP8 };
inline constexpr Precision kAllPrecisions[] = {Precision::FP32, Precision::FP16, Precision::BF16,
                                               Precision::FP8};
std::string_view precision_name(Precision p);  // "fp32", "fp16", "bf16", "fp8"
std::optional<Precision> parse_precision(std::string_view s);  // case-insensitive
// The precision class of an operand dtype (integers count as fp32: they never pick a backend).
Precision precision_of(DType t);

}  // namespace primus::turbo
