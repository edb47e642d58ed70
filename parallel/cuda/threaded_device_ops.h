// MemoryOps for buffers in the device memory of one GPU, so that a ThreadedGroup
// (parallel/threaded_process_group.h) runs device-memory collectives among N rank threads
// sharing that GPU, each driving its own stream: the stand-in for NCCL when tp / cp / FSDP code
// must run, and be compared with one rank, on a machine with one GPU.
//
//   auto hub = parallel::ThreadedGroup::create(4, timeout, parallel::DeviceMemoryOps::factory(0));
//   // in rank r's thread: cudaSetDevice(0); auto pg = hub->rank(r);  (pg's stream: see below)
//
// Copies are cudaMemcpyAsync on the rank's stream, reductions a kernel on it (f32 or bf16 in,
// f32 accumulation in rank order, one rounding to bf16; Avg divides the sum and Max takes the
// largest, as on the host, so device and host results are the same bits). The group synchronizes
// the stream around each collective: a rank's inputs must be complete on that stream when it
// calls, and the result is in place when the call returns.
#pragma once
#include <cuda_runtime_api.h>

#include "parallel/threaded_process_group.h"

namespace primus::parallel {

class DeviceMemoryOps final : public MemoryOps {
 public:
  // Buffers on `device`. `stream` is the stream the rank's own kernels write its buffers on (not
  // owned; the copies and reductions are enqueued on it, after that work). nullptr: a stream of
  // its own, created blocking, so it also follows work on the legacy default stream.
  explicit DeviceMemoryOps(int device, cudaStream_t stream = nullptr);
  ~DeviceMemoryOps() override;
  DeviceMemoryOps(const DeviceMemoryOps&) = delete;
  DeviceMemoryOps& operator=(const DeviceMemoryOps&) = delete;

  void copy(void* dst, const void* src, size_t bytes) override;
  // At most kMaxSources sources (a group of more ranks is refused with RuntimeError).
  void reduce(void* dst, const void* const* srcs, size_t k, size_t count, DType dtype, ReduceOp op) override;
  void synchronize() override;

  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }

  // For ThreadedGroup::create: each rank gets DeviceMemoryOps on `device` with a stream of its own.
  static ThreadedGroup::OpsFactory factory(int device);

  static constexpr size_t kMaxSources = 64;

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
  bool owned_ = false;
};

// The reduction kernel's launcher: dst[i] = srcs[0][i] + ... + srcs[k-1][i] (/ k for Avg; for Max
// the largest of them) for i < count, f32 accumulation in source order, on `stream`. Device
// pointers; dst may be one of srcs. k <= DeviceMemoryOps::kMaxSources.
void launch_threaded_reduce(void* dst, const void* const* srcs, size_t k, size_t count, DType dtype, ReduceOp op,
                            cudaStream_t stream);

}  // namespace primus::parallel
