// Token (+ learned position) embeddings, forward and deterministic backward
// (turbo/kernels/cpu/embedding.h is the reference).
//   out [B,T,C] = wte[tokens] (+ wpe[pos]);  tokens/positions [B,T] int32 (positions optional:
//   pos = t); wte [V,C], wpe [max_pos,C] (optional) in the activation dtype (f32 or bf16).
//   backward: dwte [V,C] += , dwpe [max_pos,C] += (f32), summed in token order: bitwise the
//   same on every run.
// Backends: TURBO (device; the backward needs ctx.scratch), CPU (host f32).
#pragma once
#include <string>

#include "turbo/core/tensor_view.h"
#include "turbo/dispatch/backend_type.h"
#include "turbo/ops/exec_context.h"

namespace primus::turbo {

struct EmbeddingArgs {
  bool backward = false;
  TensorView out;           // forward: [B,T,C]
  TensorView dwte, dwpe;    // backward outputs (f32); dwpe optional
  TensorView dout;          // backward input [B,T,C]
  TensorView tokens, positions;
  TensorView wte, wpe;      // forward tables; for the backward only their shapes are used (V, max_pos)
  // >= 0: vocabulary-parallel tables (Megatron's VocabParallelEmbedding, one tensor-parallel rank's
  // part): wte / dwte hold the rows of ids [vocab_begin, vocab_begin + V); another rank's id gives
  // a zero token row (wpe still added) and no gradient. The sum over the ranks is the embedding.
  int64_t vocab_begin = -1;
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return precision_of(backward ? dout.dtype : wte.dtype); }
};

BackendType embedding_forward(const EmbeddingArgs& args);
BackendType embedding_backward(const EmbeddingArgs& args);

}  // namespace primus::turbo
