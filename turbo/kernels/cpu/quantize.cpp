#include "turbo/kernels/cpu/quantize.h"

#include <fmt/format.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "core/util/error.h"

namespace primus::turbo::cpu {
namespace {

float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// |x| as f32 bits, and x as f32, for one element of a row.
uint32_t abs_bits_at(const void* row, DType t, int64_t c) {
  if (t == DType::BF16) return static_cast<uint32_t>(static_cast<const uint16_t*>(row)[c] & 0x7fffu) << 16;
  uint32_t u;
  std::memcpy(&u, static_cast<const float*>(row) + c, 4);
  return u & 0x7fffffffu;
}
float value_at(const void* row, DType t, int64_t c) {
  return t == DType::BF16 ? bf16_bits_to_float(static_cast<const uint16_t*>(row)[c])
                          : static_cast<const float*>(row)[c];
}
const void* row_ptr(const void* inp, DType t, int64_t r, int64_t ld) {
  return static_cast<const char*>(inp) + static_cast<size_t>(r * ld) * dtype_size(t);
}

void check_dtypes(DType in_dtype, DType fp8, const char* fn) {
  if (in_dtype != DType::F32 && in_dtype != DType::BF16)
    throw RuntimeError(fmt::format("{}: input dtype {} not supported (f32, bf16)", fn, dtype_name(in_dtype)));
  if (!dtype_is_fp8(fp8))
    throw RuntimeError(fmt::format("{}: output dtype {} is not an FP8 format (f8e4m3, f8e5m2)", fn, dtype_name(fp8)));
}

}  // namespace

float fp8_max(DType fp8) {
  switch (fp8) {
    case DType::F8E4M3: return 448.0f;
    case DType::F8E5M2: return 57344.0f;
    default: return 0.0f;
  }
}

bool Fp8Scaling::finite() const { return std::isfinite(amax); }

Fp8Scaling fp8_tensorwise_scaling(float amax, DType fp8) {
  Fp8Scaling s;
  s.amax = amax;
  if (!std::isfinite(amax)) {
    s.scale = s.scale_inv = std::numeric_limits<float>::quiet_NaN();  // 0x7fc00000
    return s;
  }
  if (amax == 0.0f) return s;  // an all-zero tensor: scale 1, any scale would do
  float scale = fp8_max(fp8) / amax;
  if (std::isinf(scale)) scale = FLT_MAX;
  s.scale = scale;
  s.scale_inv = 1.0f / scale;
  return s;
}

uint32_t absmax_bits(const void* inp, DType in_dtype, int64_t R, int64_t C, int64_t ld) {
  uint32_t m = 0;
  for (int64_t r = 0; r < R; ++r) {
    const void* row = row_ptr(inp, in_dtype, r, ld);
    for (int64_t c = 0; c < C; ++c) m = std::max(m, abs_bits_at(row, in_dtype, c));
  }
  return m;
}

Fp8Scaling quantize_fp8_tensorwise(const void* inp, DType in_dtype, int64_t R, int64_t C, int64_t ld,
                                   uint8_t* out, uint8_t* out_t, DType fp8, int64_t amax_rows) {
  check_dtypes(in_dtype, fp8, "quantize_fp8_tensorwise");
  const int64_t used = amax_rows < 0 ? R : std::min(amax_rows, R);
  const Fp8Scaling s = fp8_tensorwise_scaling(bits_to_float(absmax_bits(inp, in_dtype, used, C, ld)), fp8);
  const bool finite = s.finite();
  const bool e4m3 = fp8 == DType::F8E4M3;
  for (int64_t r = 0; r < R; ++r) {
    const void* row = row_ptr(inp, in_dtype, r, ld);
    for (int64_t c = 0; c < C; ++c) {
      uint8_t q = kFp8PoisonByte;
      if (finite) {
        const float y = value_at(row, in_dtype, c) * s.scale;  // rounded to f32 first, as on the device
        q = e4m3 ? float_to_f8e4m3_bits(y) : float_to_f8e5m2_bits(y);
      }
      if (out) out[r * C + c] = q;
      if (out_t) out_t[c * R + r] = q;
    }
  }
  return s;
}

uint32_t quantize_fp8_with_scale(const void* inp, DType in_dtype, int64_t R, int64_t C, int64_t ld, float scale,
                                 uint8_t* out, uint8_t* out_t, DType fp8, int64_t amax_rows) {
  check_dtypes(in_dtype, fp8, "quantize_fp8_with_scale");
  const int64_t recorded = amax_rows < 0 ? R : std::min(amax_rows, R);
  const bool e4m3 = fp8 == DType::F8E4M3;
  uint32_t m = 0;
  for (int64_t r = 0; r < R; ++r) {
    const void* row = row_ptr(inp, in_dtype, r, ld);
    for (int64_t c = 0; c < C; ++c) {
      const uint32_t a = abs_bits_at(row, in_dtype, c);
      if (r < recorded) m = std::max(m, a);
      uint8_t q = kFp8PoisonByte;
      if (a < 0x7f800000u) {
        const float y = value_at(row, in_dtype, c) * scale;  // rounded to f32 first, as on the device
        q = e4m3 ? float_to_f8e4m3_bits(y) : float_to_f8e5m2_bits(y);
      }
      if (out) out[r * C + c] = q;
      if (out_t) out_t[c * R + r] = q;
    }
  }
  return m;
}

void fp8_delayed_update(float* history, float* scale, const float* fp8_max, int64_t T, int64_t len, bool use_max,
                        int margin) {
  const float factor = std::ldexp(1.0f, -margin);  // exact: a power of two
  for (int64_t t = 0; t < T; ++t) {
    float* h = history + t * len;
    if (!std::isfinite(h[0])) h[0] = 0.0f;
    float amax = h[0];
    if (use_max)
      for (int64_t i = 1; i < len; ++i) amax = std::max(amax, h[i]);
    if (amax > 0.0f) {
      float s = fp8_max[t] / amax;
      if (std::isinf(s)) s = FLT_MAX;
      scale[t] = s * factor;
    }
    for (int64_t i = len - 1; i > 0; --i) h[i] = h[i - 1];
    h[0] = 0.0f;
  }
}

namespace {
// Quantises the [Rm, Cm] matrix whose element (i, j) is at(i, j) at granularity g into q (row-major
// [Rm, Cm]) and scales (fp8_scale_shape(g, Rm, Cm)).
template <typename At>
void quantize_matrix(At at, int64_t Rm, int64_t Cm, Fp8Granularity g, uint8_t* q, float* scales, DType fp8) {
  const int64_t groups = fp8_scale_numel(g, Rm, Cm);
  std::vector<uint32_t> amax(static_cast<size_t>(groups), 0);
  std::vector<char> used(static_cast<size_t>(groups), 0);
  for (int64_t i = 0; i < Rm; ++i)
    for (int64_t j = 0; j < Cm; ++j) {
      const size_t k = static_cast<size_t>(fp8_scale_index(g, Rm, Cm, i, j));
      amax[k] = std::max(amax[k], at(i, j).first);
      used[k] = 1;
    }
  std::vector<Fp8Scaling> sc(static_cast<size_t>(groups));
  for (int64_t k = 0; k < groups; ++k) {
    sc[static_cast<size_t>(k)] = fp8_tensorwise_scaling(bits_to_float(amax[static_cast<size_t>(k)]), fp8);
    if (scales) scales[k] = used[static_cast<size_t>(k)] ? sc[static_cast<size_t>(k)].scale_inv : 1.0f;
  }
  const bool e4m3 = fp8 == DType::F8E4M3;
  for (int64_t i = 0; i < Rm; ++i)
    for (int64_t j = 0; j < Cm; ++j) {
      const Fp8Scaling& s = sc[static_cast<size_t>(fp8_scale_index(g, Rm, Cm, i, j))];
      uint8_t b = kFp8PoisonByte;
      if (s.finite()) {
        const float y = at(i, j).second * s.scale;  // rounded to f32 first, as on the device
        b = e4m3 ? float_to_f8e4m3_bits(y) : float_to_f8e5m2_bits(y);
      }
      q[i * Cm + j] = b;
    }
}
}  // namespace

void quantize_fp8_grouped(const void* inp, DType in_dtype, int64_t R, int64_t C, int64_t ld, Fp8Granularity g,
                          uint8_t* out, float* scale_inv, uint8_t* out_t, float* scale_inv_t, DType fp8) {
  constexpr const char* fn = "quantize_fp8_grouped";
  check_dtypes(in_dtype, fp8, fn);
  if ((g == Fp8Granularity::Block1x128 || g == Fp8Granularity::Block128x128) &&
      (R % kFp8BlockSize != 0 || C % kFp8BlockSize != 0))
    throw RuntimeError(fmt::format("{}: {} blocks need both dimensions to be multiples of {}, got [{}, {}]", fn,
                                   fp8_granularity_name(g), kFp8BlockSize, R, C));
  if (!out && !out_t) throw RuntimeError(fmt::format("{}: neither out nor out_t is set", fn));
  // (|x| bits, x) of element (r, c) of inp
  const auto elem = [&](int64_t r, int64_t c) {
    const void* row = row_ptr(inp, in_dtype, r, ld);
    return std::pair<uint32_t, float>(abs_bits_at(row, in_dtype, c), value_at(row, in_dtype, c));
  };
  if (out) quantize_matrix(elem, R, C, g, out, scale_inv, fp8);
  if (out_t) {
    float* st = g == Fp8Granularity::Tensor && !scale_inv_t ? (out ? nullptr : scale_inv) : scale_inv_t;
    quantize_matrix([&](int64_t i, int64_t j) { return elem(j, i); }, C, R, g, out_t, st, fp8);
  }
}

void check_row_groups(const int32_t* offsets, int64_t G, int64_t R, const char* op, const char* rows_name) {
  if (G < 0 || offsets == nullptr)
    throw RuntimeError(fmt::format("{}: offsets: expected [G + 1] entries with G >= 0, got G = {}", op, G));
  if (offsets[0] != 0) throw RuntimeError(fmt::format("{}: offsets[0] = {}, expected 0", op, offsets[0]));
  for (int64_t g = 0; g < G; ++g)
    if (offsets[g + 1] < offsets[g] || offsets[g + 1] > R)
      throw RuntimeError(fmt::format("{}: offsets[{}] = {} after offsets[{}] = {} (non-decreasing, at most {} = {})",
                                     op, g + 1, offsets[g + 1], g, offsets[g], rows_name, R));
}

void quantize_fp8_row_groups_t(const void* inp, DType in_dtype, int64_t R, int64_t C, int64_t ld,
                               const int32_t* offsets, int64_t G, uint8_t* out_t, float* scale_inv_t, DType fp8) {
  constexpr const char* fn = "quantize_fp8_row_groups_t";
  check_dtypes(in_dtype, fp8, fn);
  check_row_groups(offsets, G, R, fn);
  const bool e4m3 = fp8 == DType::F8E4M3;
  std::vector<uint32_t> amax(static_cast<size_t>(C));
  std::vector<Fp8Scaling> sc(static_cast<size_t>(C));
  for (int64_t g = 0; g < G; ++g) {
    const int64_t r0 = offsets[g], r1 = offsets[g + 1];
    std::fill(amax.begin(), amax.end(), 0u);
    for (int64_t r = r0; r < r1; ++r) {
      const void* row = row_ptr(inp, in_dtype, r, ld);
      for (int64_t c = 0; c < C; ++c) {
        uint32_t& m = amax[static_cast<size_t>(c)];
        m = std::max(m, abs_bits_at(row, in_dtype, c));
      }
    }
    for (int64_t c = 0; c < C; ++c) {
      sc[static_cast<size_t>(c)] = fp8_tensorwise_scaling(bits_to_float(amax[static_cast<size_t>(c)]), fp8);
      scale_inv_t[g * C + c] = sc[static_cast<size_t>(c)].scale_inv;
    }
    for (int64_t r = r0; r < r1; ++r) {
      const void* row = row_ptr(inp, in_dtype, r, ld);
      for (int64_t c = 0; c < C; ++c) {
        const Fp8Scaling& s = sc[static_cast<size_t>(c)];
        uint8_t q = kFp8PoisonByte;
        if (s.finite()) {
          const float y = value_at(row, in_dtype, c) * s.scale;  // rounded to f32 first, as on the device
          q = e4m3 ? float_to_f8e4m3_bits(y) : float_to_f8e5m2_bits(y);
        }
        out_t[c * R + r] = q;
      }
    }
  }
}

}  // namespace primus::turbo::cpu
