// The host BenchDevice: the CPU backends' f32 tensors in a host arena, timed with steady_clock.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <fstream>
#include <thread>
#include <vector>

#include "core/util/error.h"
#include "turbo/bench/bench_device.h"

namespace primus::turbo::bench {

float hash_uniform(uint64_t i, uint64_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<float>(x >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;  // [-1, 1)
}

size_t span_bytes(const TensorView& t) {
  if (t.numel() == 0) return 0;
  int64_t last = 0;
  for (int d = 0; d < t.ndim; ++d) last += (t.shape[d] - 1) * t.strides[d];
  return static_cast<size_t>(last + 1) * dtype_size(t.dtype);
}

std::vector<float> gather_f32(const void* span, const TensorView& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  std::array<int64_t, TensorView::kMaxDims> idx{};
  for (size_t i = 0; i < v.size(); ++i) {
    int64_t off = 0;
    for (int d = 0; d < t.ndim; ++d) off += idx[d] * t.strides[d];
    v[i] = load_as_float(span, t.dtype, static_cast<size_t>(off));
    for (int d = t.ndim - 1; d >= 0 && ++idx[d] == t.shape[d]; --d) idx[d] = 0;  // row-major odometer
  }
  return v;
}

namespace {

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto c = line.find(':');
      if (c != std::string::npos) return line.substr(line.find_first_not_of(' ', c + 1));
    }
  }
  return "unknown model";
}

class HostBenchDevice final : public BenchDevice {
 public:
  explicit HostBenchDevice(size_t bytes)
      : arena_(make_host_arena(bytes)), scratch_(make_host_arena(std::max<size_t>(bytes / 8, 1 << 20))) {}
  Device kind() const override { return Device::CPU; }
  std::string name() const override {
    return fmt::format("CPU: {} ({} threads)", cpu_model(), std::max(1u, std::thread::hardware_concurrency()));
  }
  Arena& arena() override { return *arena_; }
  Arena& scratch() override { return *scratch_; }

  void fill_uniform(const TensorView& t, uint64_t seed, float scale, float offset) override {
    for (int64_t i = 0; i < t.numel(); ++i)
      store_from_float(t.data, t.dtype, static_cast<size_t>(i), offset + scale * hash_uniform(static_cast<uint64_t>(i), seed));
  }
  void fill_ints(const TensorView& t, uint64_t seed, int32_t hi) override {
    PRIMUS_CHECK(t.dtype == DType::I32, "fill_ints: {} is not i32", t.describe());
    auto* p = t.ptr<int32_t>();
    for (int64_t i = 0; i < t.numel(); ++i)
      p[i] = static_cast<int32_t>((hash_uniform(static_cast<uint64_t>(i), seed) * 0.5f + 0.5f) * static_cast<float>(hi)) % hi;
  }
  void zero(const TensorView& t) override { std::memset(t.data, 0, t.nbytes()); }
  std::vector<float> read(const TensorView& t) override { return gather_f32(t.data, t); }

  double time_ms(const std::function<void()>& run, int iters, bool fastest) override {
    run();  // warm-up: first-touch page faults, plan creation
    std::vector<double> ms(static_cast<size_t>(std::max(1, iters)));
    for (double& m : ms) {
      const auto t0 = std::chrono::steady_clock::now();
      run();
      m = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
    if (fastest) return *std::min_element(ms.begin(), ms.end());
    std::nth_element(ms.begin(), ms.begin() + static_cast<std::ptrdiff_t>(ms.size() / 2), ms.end());
    return ms[ms.size() / 2];
  }

  double copy_ms(size_t bytes, int iters) override {
    ArenaScope s(*arena_);
    char* a = static_cast<char*>(arena_->allocate(bytes, Arena::kDefaultAlign, "copy ceiling source"));
    char* b = static_cast<char*>(arena_->allocate(bytes, Arena::kDefaultAlign, "copy ceiling destination"));
    std::memset(a, 1, bytes);
    std::memset(b, 0, bytes);
    return time_ms([&] { std::memcpy(b, a, bytes); }, iters, true);
  }
  void synchronize() override {}

 private:
  std::unique_ptr<Arena> arena_, scratch_;
};

}  // namespace

std::unique_ptr<BenchDevice> make_host_bench_device(size_t arena_bytes) {
  return std::make_unique<HostBenchDevice>(arena_bytes);
}

}  // namespace primus::turbo::bench
