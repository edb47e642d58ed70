// Where one benchmark runs its kernels: the host (the CPU backends, f32) or a CUDA device (the
// device backends). Each gives an operand arena, a scratch arena for ExecContext, random fills
// and a timer, so that one case definition serves every backend.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "turbo/core/arena.h"
#include "turbo/core/tensor_view.h"

namespace primus::turbo::bench {

class BenchDevice {
 public:
  virtual ~BenchDevice() = default;
  virtual Device kind() const = 0;
  virtual std::string name() const = 0;  // "NVIDIA H100 80GB HBM3", "CPU: <model> (2 threads)"
  virtual Arena& arena() = 0;            // operands, reset between cases
  virtual Arena& scratch() = 0;          // ExecContext::scratch
  // t[i] = offset + scale * u, u uniform in [-1, 1) from a hash of (i, seed); f32 or bf16.
  virtual void fill_uniform(const TensorView& t, uint64_t seed, float scale, float offset) = 0;
  // t[i] uniform in [0, hi); i32.
  virtual void fill_ints(const TensorView& t, uint64_t seed, int32_t hi) = 0;
  virtual void zero(const TensorView& t) = 0;
  // t's elements as f32 in row-major order of its shape (a strided view too), on the host: what
  // the cross-check compares.
  virtual std::vector<float> read(const TensorView& t) = 0;
  // Time of one call of `run` over `iters` calls, after warm-up calls: the median, or with
  // fastest=true the fastest call (what the ceilings use: a ceiling is the best the device does).
  virtual double time_ms(const std::function<void()>& run, int iters, bool fastest = false) = 0;
  // Before each timed series (after its warm-up calls): `ms` of idling, on the device (a spin
  // kernel, while the host queues the timed calls behind it, as bench/fp8/gemm_torch.py's
  // torch.cuda._sleep does) or on the host (the device idles and the host gets no lead). What the
  // two harnesses of a comparison must share: under a power cap a device that has just idled runs
  // its first milliseconds of work at higher clocks. 0: none (the default).
  enum class Idle { Device, Host };
  void set_idle(double ms, Idle where) {
    idle_ms_ = ms;
    idle_where_ = where;
  }
  // Copies `bytes` from one buffer of the operand arena to another, `iters` times: the fastest ms.
  virtual double copy_ms(size_t bytes, int iters) = 0;
  virtual void synchronize() = 0;

 protected:
  double idle_ms_ = 0;
  Idle idle_where_ = Idle::Device;
};

// The host: operand arena of `arena_bytes` (the scratch arena is 1/8 of it).
std::unique_ptr<BenchDevice> make_host_bench_device(size_t arena_bytes);

// CUDA device 0, or nullptr when this build has no CUDA or the machine has no device
// (*why then says which).
std::unique_ptr<BenchDevice> make_cuda_bench_device(size_t arena_bytes, std::string* why);

// Host random numbers of the same construction as the device fill (for the host device).
float hash_uniform(uint64_t i, uint64_t seed);

// The bytes from t.data to t's last element (non-negative strides), and those elements gathered
// from a host copy of that span as f32, row-major: BenchDevice::read's two halves.
size_t span_bytes(const TensorView& t);
std::vector<float> gather_f32(const void* span, const TensorView& t);

}  // namespace primus::turbo::bench
