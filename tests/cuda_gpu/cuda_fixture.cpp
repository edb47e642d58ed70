#include "cuda_fixture.h"

#include "backends/cuda/attention_fallback.h"

namespace primus::backends::cuda::testing {

CudaOps ops_for(Attn a) {
  CudaOps o = CudaOps::defaults();
  if (a == Attn::Fallback) {
    o.attention_forward = fallback_attention_forward;
    o.attention_backward = fallback_attention_backward;
  }
  return o;
}

}  // namespace primus::backends::cuda::testing
