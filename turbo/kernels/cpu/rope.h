// Rotary position embedding (RoPE) on q or k, interleaved-pairs convention.
//
// x [B,T,H,D] (D even). For each token at position pos and each pair i in [0, D/2), the pair
// (x[2i], x[2i+1]) is rotated by angle pos * base^(-2i/D):
//   y[2i]   = x[2i] cos - x[2i+1] sin
//   y[2i+1] = x[2i] sin + x[2i+1] cos
// Angles and their cos/sin are computed in double, then rounded to Real. With Llama-3's
// frequency scaling (core/util/rope_scaling.h) base^(-2i/D) is replaced by rope_inv_freq's value.
//
// Hugging Face's Llama uses the half-split ("rotate_half") convention instead: pair i is
// (x[i], x[i + D/2]) with the same angle. The two are the same operation up to a permutation of
// each head's D features. Since attention scores are dot products q·k, applying the same
// permutation to the rows of W_q and W_k (per head) changes no score. So a checkpoint converts
// between the conventions by permuting those rows once; see rope_half_split_permutation.
#pragma once
#include <cstdint>

#include "core/util/rope_scaling.h"

namespace primus::turbo::cpu {

// inv_freq[D/2]: the rotation frequency of each pair, base^(-2i/D), rescaled when
// scaling.enabled (core/util/rope_scaling.h states the rule). Every RoPE kernel, CPU or CUDA,
// takes its frequencies from here. Throws on an odd D or scaling parameters the rule cannot use
// (factor <= 0, high_freq_factor <= low_freq_factor, a non-positive low_freq_factor or position).
void rope_inv_freq(double* inv_freq, int64_t D, double base, const RopeScaling& scaling = {});

// out = RoPE(inp) (overwrites out; out may alias inp for an in-place rotation).
//   positions: [B,T] position of each token, or nullptr for pos = t. With packed documents pass
//              positions that restart at 0 per document.
template <typename Real>
void rope_forward(Real* out, const Real* inp, const int32_t* positions, int64_t B, int64_t T,
                  int64_t H, int64_t D, double base, const RopeScaling& scaling = {});

// dinp += R(-angle) dout: the rotation is orthogonal, so its backward is the inverse rotation.
// Needs only the positions (nothing saved). dinp must not alias dout.
template <typename Real>
void rope_backward(Real* dinp, const Real* dout, const int32_t* positions, int64_t B, int64_t T,
                   int64_t H, int64_t D, double base, const RopeScaling& scaling = {});

// perm[D]: feature j of a head in the interleaved layout is feature perm[j] of the same head in
// the half-split (Hugging Face) layout: perm[2i] = i, perm[2i+1] = i + D/2.
// Hugging Face -> interleaved: row h*D + j of our W_q / W_k is row h*D + perm[j] of HF's
//   q_proj / k_proj weight (and bias, if any);
// interleaved -> Hugging Face: row h*D + perm[j] of HF's is row h*D + j of ours.
void rope_half_split_permutation(int64_t* perm, int64_t D);

// Applies that row permutation to a projection weight w [n_heads*D, cols] (q_proj or k_proj):
// to_interleaved = true maps HF's layout to ours, false maps ours back. out must not alias w.
template <typename Real>
void rope_permute_rows(Real* out, const Real* w, int64_t n_heads, int64_t D, int64_t cols,
                       bool to_interleaved);

}  // namespace primus::turbo::cpu
