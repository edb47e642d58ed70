// The CUDA BenchDevice: operands in a device arena, timed with CUDA events. Calls are enqueued
// back to back, each between its own pair of events, and synchronised once at the end, so the
// host's launch cost overlaps the previous call's GPU work as in a training step.
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#include "turbo/bench/bench_device.h"
#include "turbo/bench/fill.h"
#include "turbo/core/cuda_arena.h"
#include "turbo/core/cuda_check.h"

namespace primus::turbo::bench {
namespace {

class CudaBenchDevice final : public BenchDevice {
 public:
  explicit CudaBenchDevice(size_t bytes)
      : arena_(make_device_arena(bytes)), scratch_(make_device_arena(size_t{2} << 30)) {
    CUDA_CHECK(cudaGetDeviceProperties(&prop_, 0));
  }
  Device kind() const override { return Device::CUDA; }
  std::string name() const override { return prop_.name; }
  Arena& arena() override { return *arena_; }
  Arena& scratch() override { return *scratch_; }
  void fill_uniform(const TensorView& t, uint64_t seed, float scale, float offset) override {
    fill_uniform_device(t.data, t.dtype, t.numel(), seed, scale, offset);
  }
  void fill_ints(const TensorView& t, uint64_t seed, int32_t hi) override {
    fill_ints_device(t.ptr<int32_t>(), t.numel(), seed, hi);
  }
  void zero(const TensorView& t) override { CUDA_CHECK(cudaMemset(t.data, 0, t.nbytes())); }
  std::vector<float> read(const TensorView& t) override {
    std::vector<char> span(span_bytes(t));
    CUDA_CHECK(cudaMemcpy(span.data(), t.data, span.size(), cudaMemcpyDeviceToHost));
    return gather_f32(span.data(), t);
  }

  double time_ms(const std::function<void()>& run, int iters, bool fastest) override {
    const int reps = std::max(1, iters);
    for (int i = 0; i < 5; ++i) run();
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<cudaEvent_t> ev(static_cast<size_t>(2 * reps));
    for (auto& e : ev) CUDA_CHECK(cudaEventCreate(&e));
    if (idle_ms_ > 0 && idle_where_ == Idle::Device) spin_device(idle_ms_);
    if (idle_ms_ > 0 && idle_where_ == Idle::Host)
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(idle_ms_));
    for (int r = 0; r < reps; ++r) {
      CUDA_CHECK(cudaEventRecord(ev[2 * r]));
      run();
      CUDA_CHECK(cudaEventRecord(ev[2 * r + 1]));
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> ms(static_cast<size_t>(reps));
    for (int r = 0; r < reps; ++r) CUDA_CHECK(cudaEventElapsedTime(&ms[r], ev[2 * r], ev[2 * r + 1]));
    for (auto& e : ev) cudaEventDestroy(e);
    if (fastest) return *std::min_element(ms.begin(), ms.end());
    std::nth_element(ms.begin(), ms.begin() + static_cast<std::ptrdiff_t>(ms.size() / 2), ms.end());
    return ms[ms.size() / 2];
  }

  double copy_ms(size_t bytes, int iters) override {
    ArenaScope s(*arena_);
    void* a = arena_->allocate(bytes, Arena::kDefaultAlign, "copy ceiling source");
    void* b = arena_->allocate(bytes, Arena::kDefaultAlign, "copy ceiling destination");
    fill_uniform_device(a, DType::F32, static_cast<int64_t>(bytes / 4), 99, 1.0f);
    return time_ms([&] { CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); }, iters, true);
  }
  void synchronize() override { CUDA_CHECK(cudaDeviceSynchronize()); }

 private:
  std::unique_ptr<Arena> arena_, scratch_;
  cudaDeviceProp prop_{};
};

}  // namespace

std::unique_ptr<BenchDevice> make_cuda_bench_device(size_t arena_bytes, std::string* why) {
  if (cuda_device_count_or_zero() == 0) {
    if (why) *why = "no CUDA device (or no driver) on this machine";
    return nullptr;
  }
  return std::make_unique<CudaBenchDevice>(arena_bytes);
}

}  // namespace primus::turbo::bench
