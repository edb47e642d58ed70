// The CUDA model's host staging: the only host <-> device copies of a training step (the
// micro-batches' tokens and targets, the AdamW scalars, the step status) go through pinned
// buffers, in two sets, so that the host stages step s + 1 while step s runs. Each region's last
// copy records an event that the host waits on before it rewrites the region; in training the
// set was last used two steps ago, so the wait returns at once (a test that stages twice in a
// row waits for the first copy). In host mode the copies are plain memcpy and the status of each
// ticket is kept in host memory.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "backends/cuda/model/memory_plan.h"

namespace primus::backends::cuda {

class HostStaging {
 public:
  // slots: batch slots (one per micro-batch), slot_elems: tokens per slot, status: the device
  // status buffer (its size sets the status copy's).
  HostStaging(int64_t slots, int64_t slot_elems, const TensorView& status, const ModelStream& stream);
  ~HostStaging();
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;

  // n tokens and targets into batch slot `slot` of dst_tokens / dst_targets (device i32
  // buffers of slots x slot_elems), stream-ordered; the host arrays may be reused at once.
  void stage_batch(const int32_t* tokens, const int32_t* targets, int64_t n, int64_t slot,
                   const TensorView& dst_tokens, const TensorView& dst_targets);
  // f32 [4] into `dst` (device), stream-ordered.
  void stage_scalars(const float values[4], const TensorView& dst);
  // Queues the D2H copy of the status after everything enqueued so far and returns its ticket;
  // later staging uses the other set. At most two tickets may be outstanding.
  int enqueue_status();
  // Waits for ticket's copy alone (not for work enqueued after it); the status floats.
  const float* wait_status(int ticket) const;

 private:
  struct Set {
    char* mem = nullptr;  // one cudaMallocHost block: batches, then the scalars, then the status
    int32_t* batch = nullptr;  // [slots][tokens | targets][slot_elems]
    float* scalars = nullptr;  // [4]
    float* status = nullptr;   // status.numel()
    std::vector<cudaEvent_t> batch_done;  // per batch slot
    cudaEvent_t scalars_done = nullptr, status_done = nullptr;
  };
  void release();  // no throwing: called from the destructor

  int64_t slots_, slot_elems_;
  TensorView status_;
  ModelStream stream_;
  Set sets_[2];
  int next_ = 0;  // the set the next staging writes
  std::vector<float> host_status_;  // host mode: the status of each ticket (2 x status)
};

}  // namespace primus::backends::cuda
