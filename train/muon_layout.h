// Which parameters Muon updates, as which matrices, and (with ZeRO-1) which rank owns each.
//
// Muon orthogonalises the update of a linear map, so it takes the transformer layers' weight
// matrices: attention qkv and output projection, the MLP's fc and proj, the MoE experts and the
// shared expert. AdamW keeps the rest, as Moonlight and Kimi K2 do: the token and position
// embeddings and the output head (Moonlight names embed_tokens and lm_head: their rows are
// looked up or scored one token at a time, not a map of the hidden state), every 1-D tensor
// (norms, biases, q/k norms), and the MoE router (its E rows score the experts one by one;
// Moonlight's example would hand it to Muon only because it is 2-D, while DeepSeek-style
// routers are trained as plain gates; with E as small as 8 an orthogonalised [E, C] update would
// give every expert's logit the same step size whatever its gradient).
//
// Our fused tensors hold several matrices: qkv is rows [q; k; v], SwiGLU's fc rows [gate; up],
// stacked experts [E, out, in] one matrix (or gate and up) per expert. Each part is
// orthogonalised on its own (a "block"), exactly as if the model stored q_proj, k_proj, v_proj,
// gate_proj and up_proj separately (Hugging Face's and Moonlight's layout), so the update does
// not depend on how we fuse the tensors, and the scale sqrt(max(rows, cols)) is the part's.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "train/model_spec.h"
#include "train/param_layout.h"

namespace primus::train {

struct MuonBlock {
  int64_t offset = 0;  // elements from the start of the flat buffer (row-major [rows, cols])
  int64_t rows = 0, cols = 0;
};

struct MuonTensor {
  size_t index = 0;                // in layout.tensors
  std::vector<MuonBlock> blocks;   // together exactly the tensor's elements, in order
  int owner = 0;                   // the rank that orthogonalises it (ZeRO-1), else 0
};

// The tensors Muon updates, in layout order.
std::vector<MuonTensor> muon_tensors(const ModelSpec& spec, const ParamLayout& layout);

// Assigns whole tensors to `world` ranks, largest first to the least loaded rank (by elements;
// ties to the lower rank), so each rank runs Newton-Schulz on whole matrices and the ranks'
// shares differ by at most one tensor. Deterministic: every rank computes the same owners.
void assign_muon_owners(std::vector<MuonTensor>& tensors, const ParamLayout& layout, int world);

// The elements of the flat buffer that are Muon's (per layout tensor index): AdamW skips them.
std::vector<bool> muon_mask(const std::vector<MuonTensor>& tensors, const ParamLayout& layout);

// Tensor parallelism (train/tensor_parallel.h): a rank's Muon block is a piece of the global
// block, a row range (column-parallel: q, k, v, gate, up, the experts' gate and up) or a column
// range (row-parallel: the output projections, the experts' down projection), the r-th of
// full / local such ranges on rank r x rep .. r x rep + rep - 1 (rep > 1: key/value rows replicated
// over tp / num_query_groups ranks). Newton-Schulz needs the whole block: the ranks' pieces are
// gathered (in rank order) and put in place with assemble_muon_pieces.
struct MuonTpPiece {
  bool whole = true;  // the same block on every rank (nothing to gather)
  int64_t full_rows = 0, full_cols = 0, row0 = 0, col0 = 0;
  bool cols = false;  // a column range (else a row range)
  int rep = 1;
};
// Block `index` of `local` (a tensor of map.local_layout()) in `global` (muon_tensors of the global
// spec and layout). RuntimeError when the block is no rank-ordered row or column range.
MuonTpPiece muon_tp_piece(const class TpShardMap& map, const std::vector<MuonTensor>& global, const MuonTensor& local,
                          size_t index);
// `whole` [full_rows, full_cols] from `gathered`: every rank's [rows, cols] piece, in rank order
// (an all-gather over the tp group of `tp` ranks). One 2-D copy per distinct piece: `copy` (height
// rows of width floats, pitches in floats), or on the host when empty.
using Copy2d = std::function<void(float* dst, int64_t dst_pitch, const float* src, int64_t src_pitch, int64_t width,
                                  int64_t height)>;
void assemble_muon_pieces(const MuonTpPiece& p, int tp, const float* gathered, int64_t rows, int64_t cols, float* whole,
                          const Copy2d& copy = {});

}  // namespace primus::train
