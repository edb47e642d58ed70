#include "backends/cuda/model/host_staging.h"

#include <algorithm>
#include <cstring>

#include "turbo/core/cuda_check.h"

namespace primus::backends::cuda {

HostStaging::HostStaging(int64_t slots, int64_t slot_elems, const TensorView& status, const ModelStream& stream)
    : slots_(slots), slot_elems_(slot_elems), status_(status), stream_(stream) {
  if (stream_.host) {
    host_status_.resize(2 * static_cast<size_t>(status_.numel()));
    return;
  }
  const size_t batch_bytes = size_t(slots_) * 2 * size_t(slot_elems_) * 4;
  const size_t bytes = batch_bytes + 16 + status_.nbytes();
  try {
    for (Set& set : sets_) {
      CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&set.mem), bytes));
      set.batch = reinterpret_cast<int32_t*>(set.mem);
      set.scalars = reinterpret_cast<float*>(set.mem + batch_bytes);
      set.status = reinterpret_cast<float*>(set.mem + batch_bytes + 16);
      set.batch_done.assign(static_cast<size_t>(slots_), nullptr);
      for (cudaEvent_t& e : set.batch_done) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      CUDA_CHECK(cudaEventCreateWithFlags(&set.scalars_done, cudaEventDisableTiming));
      CUDA_CHECK(cudaEventCreateWithFlags(&set.status_done, cudaEventDisableTiming));
    }
  } catch (...) {
    release();
    throw;
  }
}

HostStaging::~HostStaging() { release(); }

void HostStaging::release() {
  for (Set& set : sets_) {
    for (cudaEvent_t e : set.batch_done)
      if (e) (void)cudaEventDestroy(e);
    if (set.scalars_done) (void)cudaEventDestroy(set.scalars_done);
    if (set.status_done) (void)cudaEventDestroy(set.status_done);
    if (set.mem) (void)cudaFreeHost(set.mem);
    set = Set{};
  }
}

void HostStaging::stage_batch(const int32_t* tokens, const int32_t* targets, int64_t n, int64_t slot,
                              const TensorView& dst_tokens, const TensorView& dst_targets) {
  const size_t at = size_t(slot * slot_elems_) * 4;
  char* tok = static_cast<char*>(dst_tokens.data) + at;
  char* tgt = static_cast<char*>(dst_targets.data) + at;
  if (stream_.host) {
    stream_.to_model(tok, tokens, size_t(n) * 4);
    stream_.to_model(tgt, targets, size_t(n) * 4);
    return;
  }
  Set& set = sets_[next_];
  cudaEvent_t done = set.batch_done[static_cast<size_t>(slot)];
  CUDA_CHECK(cudaEventSynchronize(done));  // the region's last copy has read it
  int32_t* pinned = set.batch + size_t(slot) * 2 * size_t(slot_elems_);
  std::copy_n(tokens, n, pinned);
  std::copy_n(targets, n, pinned + n);
  CUDA_CHECK(cudaMemcpyAsync(tok, pinned, size_t(n) * 4, cudaMemcpyHostToDevice, stream_.stream));
  CUDA_CHECK(cudaMemcpyAsync(tgt, pinned + n, size_t(n) * 4, cudaMemcpyHostToDevice, stream_.stream));
  CUDA_CHECK(cudaEventRecord(done, stream_.stream));
}

void HostStaging::stage_scalars(const float values[4], const TensorView& dst) {
  Set& set = sets_[next_];
  CUDA_CHECK(cudaEventSynchronize(set.scalars_done));  // the last copy from these scalars has read them
  std::copy_n(values, 4, set.scalars);
  CUDA_CHECK(cudaMemcpyAsync(dst.data, set.scalars, 4 * sizeof(float), cudaMemcpyHostToDevice, stream_.stream));
  CUDA_CHECK(cudaEventRecord(set.scalars_done, stream_.stream));
}

int HostStaging::enqueue_status() {
  const int ticket = next_;
  if (stream_.host) {  // the step has run: its status into this ticket's half
    std::memcpy(host_status_.data() + ticket * status_.numel(), status_.data, status_.nbytes());
    next_ ^= 1;
    return ticket;
  }
  Set& set = sets_[ticket];
  CUDA_CHECK(cudaEventSynchronize(set.status_done));  // its last copy has landed (and was read)
  CUDA_CHECK(cudaMemcpyAsync(set.status, status_.data, status_.nbytes(), cudaMemcpyDeviceToHost, stream_.stream));
  CUDA_CHECK(cudaEventRecord(set.status_done, stream_.stream));
  next_ ^= 1;
  return ticket;
}

const float* HostStaging::wait_status(int ticket) const {
  if (stream_.host) return host_status_.data() + ticket * status_.numel();
  CUDA_CHECK(cudaEventSynchronize(sets_[ticket].status_done));  // that step's copy, not later work
  return sets_[ticket].status;
}

}  // namespace primus::backends::cuda
