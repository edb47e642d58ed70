// How the CUDA model's collectives (tensor, context and sharded data parallelism) are ordered
// against its stream. On the device the group is NCCL (parallel/cuda/nccl_process_group.h), whose
// collectives run on the group's stream: a call makes that stream wait for the model's work so far
// and the model's stream wait for the collective, so nothing blocks the host. Any other group with
// device buffers must be synchronous (the threaded group of parallel/cuda/threaded_device_ops.h,
// which runs N ranks on one GPU for tests): the model's stream is synchronised before the call and
// the result is in place when it returns. In host mode every group is synchronous.
#pragma once
#include <fmt/format.h>

#include <string>

#include "backends/cuda/model/memory_plan.h"
#include "core/util/error.h"
#include "parallel/cuda/nccl_process_group.h"
#include "parallel/process_group.h"
#include "turbo/core/cuda_check.h"

namespace primus::backends::cuda {

// The group as NCCL (null when it is another kind); ConfigError naming `what` when a device model
// gets a group that is neither NCCL nor the threaded one.
inline parallel::NcclProcessGroup* device_group(parallel::ProcessGroup& group, const ModelStream& stream,
                                                const char* what) {
  auto* nccl = dynamic_cast<parallel::NcclProcessGroup*>(&group);
  if (!stream.host && !nccl && group.backend() != "threads") {
    throw ConfigError(fmt::format("{} on the GPU needs a NCCL or threaded process group, got '{}'", what, group.backend()));
  }
  return nccl;
}

// The element type of a collective over t (f32 or bf16); RuntimeError naming `what` otherwise.
inline parallel::DType comm_dtype(const TensorView& t, const char* what) {
  if (t.dtype == turbo::DType::F32) return parallel::DType::F32;
  if (t.dtype == turbo::DType::BF16) return parallel::DType::BF16;
  throw RuntimeError(fmt::format("{} of dtype {} (f32 or bf16)", what, turbo::dtype_name(t.dtype)));
}

// A collective in two halves, so the model's stream can run other work while it is in flight:
// issue_in_order runs call() after the model's work so far without making the model wait (NCCL; a
// synchronous group completes it here), await_group makes the model's stream wait for everything
// issued so far.
template <class F>
void issue_in_order(parallel::NcclProcessGroup* nccl, const ModelStream& stream, F&& call) {
  if (stream.host) {
    call();
  } else if (nccl) {
    nccl->wait_for(stream.stream);
    call();
  } else {
    CUDA_CHECK(cudaStreamSynchronize(stream.stream));
    call();
  }
}
inline void await_group(parallel::NcclProcessGroup* nccl, const ModelStream& stream) {
  if (nccl && !stream.host) nccl->make_wait(stream.stream);
}

// Both halves: call() (one collective) in the model's stream order, done when the model's next work runs.
template <class F>
void in_stream_order(parallel::NcclProcessGroup* nccl, const ModelStream& stream, F&& call) {
  issue_in_order(nccl, stream, call);
  await_group(nccl, stream);
}

}  // namespace primus::backends::cuda
