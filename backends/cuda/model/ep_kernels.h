// The one kernel of expert parallelism (ep_comm.h) the device needs beyond copies and the group's
// collectives: the experts' averaged gradients divided by ep. Device only (host mode: a loop).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace primus::backends::cuda::ep {

// x f32 [n] *= s, on `stream`.
void scale_f32(float* x, int64_t n, float s, cudaStream_t stream);

}  // namespace primus::backends::cuda::ep
