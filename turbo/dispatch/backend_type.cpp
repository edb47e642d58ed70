#include "turbo/dispatch/backend_type.h"

#include <algorithm>
#include <cctype>
#include <string>

namespace primus::turbo {
namespace {
bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
}
}  // namespace

std::string_view backend_name(BackendType b) {
  switch (b) {
    case BackendType::CPU: return "CPU";
    case BackendType::CUBLASLT: return "CUBLASLT";
    case BackendType::CUDNN: return "CUDNN";
    case BackendType::TURBO: return "TURBO";
  }
  return "?";
}

std::optional<BackendType> parse_backend(std::string_view s) {
  for (BackendType b : kAllBackends)
    if (iequals(s, backend_name(b))) return b;
  return std::nullopt;
}

std::string_view precision_name(Precision p) {
  switch (p) {
    case Precision::FP32: return "fp32";
    case Precision::FP16: return "fp16";
    case Precision::BF16: return "bf16";
    case Precision::FP8: return "fp8";
  }
  return "?";
}

std::optional<Precision> parse_precision(std::string_view s) {
  for (Precision p : kAllPrecisions)
    if (iequals(s, precision_name(p))) return p;
  return std::nullopt;
}

Precision precision_of(DType t) {
  switch (t) {
    case DType::BF16: return Precision::BF16;
    case DType::F16: return Precision::FP16;
    case DType::F8E4M3:
    case DType::F8E5M2: return Precision::FP8;
    default: return Precision::FP32;
  }
}

}  // namespace primus::turbo
