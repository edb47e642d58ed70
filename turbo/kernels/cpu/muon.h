// Muon (Jordan et al. 2024; Moonlight, Liu et al. 2025, "Muon is scalable for LLM training"):
// momentum SGD whose update direction is orthogonalised by a quintic Newton-Schulz iteration,
// for 2-D weight matrices. The CPU reference of the CUDA kernels (turbo/ops/muon.h).
#pragma once
#include <cstdint>
#include <string>

namespace primus::turbo::cpu {

// The quintic iteration's coefficients (Keller Jordan's, as Moonlight and Kimi K2 use them):
// X <- a X + (b A + c A A) X with A = X X^T. They make it converge fast to singular values in a
// band around 1 (about [0.7, 1.2]) rather than exactly to 1.
inline constexpr double kMuonNsA = 3.4445, kMuonNsB = -4.7750, kMuonNsC = 2.0315;
inline constexpr double kMuonNsEps = 1e-7;  // X / (||X||_F + eps): a zero matrix stays zero

// out [rows, cols] = NS(g [rows, cols]): X = g / (||g||_F + eps), transposed first when
// rows > cols (so A = X X^T is the smaller Gram matrix) and back at the end, then `steps`
// iterations. Row-major; out may not alias g. Real: float or double.
template <typename Real>
void newton_schulz(const Real* g, int64_t rows, int64_t cols, int64_t steps, Real* out);

// How the orthogonalised matrix O of a [rows, cols] block is scaled (Megatron's muon_scale_mode):
//   spectral       sqrt(max(rows, cols))           (with extra 0.2: Moonlight's AdamW-matched RMS)
//   shape_scaling  sqrt(max(1, rows / cols))       (Keller Jordan's)
//   unit_rms_norm  sqrt(rows / cols)
// times `extra` (Megatron's muon_extra_scale_factor).
enum class MuonScale { Spectral, ShapeScaling, UnitRmsNorm };
double muon_update_scale(int64_t rows, int64_t cols, MuonScale mode, double extra);
// "spectral" | "shape_scaling" | "unit_rms_norm"; throws primus::ConfigError naming muon_scale_mode.
MuonScale muon_scale_from_name(const std::string& name);

struct MuonParams {
  double lr = 0.02;
  double momentum = 0.95;
  bool nesterov = true;
  int64_t ns_steps = 5;
  MuonScale scale_mode = MuonScale::Spectral;
  double extra_scale = 0.2;   // spectral x 0.2: the update's RMS matches AdamW's (Moonlight)
  double weight_decay = 0.0;  // decoupled: params *= 1 - lr * weight_decay before the update
  double grad_scale = 1.0;    // multiplies every gradient first (the grad-norm clip factor)
};

// One Muon step of one matrix [rows, cols] (Moonlight's Muon):
//   g = grad_scale * grads;  m = momentum * m + g
//   u = nesterov ? g + momentum * m : m
//   params = params * (1 - lr * weight_decay) - lr * muon_update_scale(rows, cols, ...) * NS(u)
// Updates params and m (zero at the start) in place.
template <typename Real>
void muon_update(Real* params, const Real* grads, Real* m, int64_t rows, int64_t cols, const MuonParams& hp);

// muon_update's two halves around Newton-Schulz, for a matrix whose rows or columns are split over
// ranks (tensor parallelism): the momentum of n elements (m updated, u written), and the update of
// a [rows, cols] piece at (row0, col0) of the orthogonalised whole o [full_rows, full_cols] (the
// update scale the whole's). muon_update is both with the piece the whole.
template <typename Real>
void muon_momentum(const Real* grads, Real* m, int64_t n, const MuonParams& hp, Real* u);
template <typename Real>
void muon_apply(Real* params, const Real* o, int64_t rows, int64_t cols, int64_t full_rows, int64_t full_cols,
                int64_t row0, int64_t col0, const MuonParams& hp);

}  // namespace primus::turbo::cpu
