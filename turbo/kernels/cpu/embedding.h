// Token and learned position embeddings (GPT-2's wte + wpe), forward and backward.
//
// Conventions of every header in turbo/kernels/cpu/:
//   - Real is float or double (double is what the finite-difference tests run); shapes are
//     row-major, dimensions are int64_t, index arrays (tokens, targets, offsets) are int32_t.
//   - Gradients of inputs and parameters are ACCUMULATED (+=), as in llm.c: the caller zeroes
//     them once per step. Where a kernel overwrites instead, its comment says so.
//   - The caller owns every buffer; no kernel allocates memory it hands back.
//   - Results are bitwise reproducible: the same bits on every run, and for any OMP_NUM_THREADS
//     (no racing or unordered reductions). The one exception is matmul, whose last bits can
//     depend on OpenBLAS's thread count (see matmul.cpp); it is still the same run to run.
#pragma once
#include <cstdint>

namespace primus::turbo::cpu {

// out[B,T,C] = wte[tokens[b,t], :] + wpe[pos, :]   (overwrites out)
//   tokens:    [B,T] ids in [0, V); an id out of range throws primus::RuntimeError.
//   wte:       [V,C] token embedding table.
//   wpe:       [max_pos,C] learned positions, or nullptr for none (Llama: RoPE instead).
//   positions: [B,T] position of each token, or nullptr for pos = t (its index in the row); with
//              packed documents pass positions that restart at 0 per document. Every position must
//              be < max_pos (checked).
//   vocab_begin >= 0: a vocabulary-parallel table (Megatron's VocabParallelEmbedding): wte holds
//              the rows of ids [vocab_begin, vocab_begin + V); an id outside them (a row another
//              tensor-parallel rank holds) gives a zero token row, to which wpe is still added.
//              Ids are then not range-checked (no rank knows the whole vocabulary here).
template <typename Real>
void embedding_forward(Real* out, const int32_t* tokens, const int32_t* positions, const Real* wte,
                       const Real* wpe, int64_t B, int64_t T, int64_t C, int64_t V,
                       int64_t max_pos, int64_t vocab_begin = -1);

// Backward of embedding_forward: scatter-adds dout[B,T,C] into dwte[V,C] (+=) and, when dwpe is
// not nullptr, into dwpe[max_pos,C] (+=). Each row of dwte/dwpe is summed in token order, so the
// result is deterministic. Needs only the tokens (and positions), no saved activations.
// vocab_begin >= 0: as in embedding_forward; ids outside the table's rows add nothing to dwte.
template <typename Real>
void embedding_backward(Real* dwte, Real* dwpe, const Real* dout, const int32_t* tokens,
                        const int32_t* positions, int64_t B, int64_t T, int64_t C, int64_t V,
                        int64_t max_pos, int64_t vocab_begin = -1);

}  // namespace primus::turbo::cpu
