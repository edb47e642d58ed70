// Views of host vectors for the ops tests on host tensors: f32 and i32, shape as given.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "turbo/core/tensor_view.h"

namespace primus::turbo::testing {

inline TensorView host(std::vector<float>& v, std::initializer_list<int64_t> shape) {
  return TensorView(v.data(), DType::F32, Device::CPU, shape);
}
inline TensorView host(std::vector<int32_t>& v, std::initializer_list<int64_t> shape) {
  return TensorView(v.data(), DType::I32, Device::CPU, shape);
}

}  // namespace primus::turbo::testing
