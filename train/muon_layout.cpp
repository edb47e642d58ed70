#include "train/muon_layout.h"

#include <algorithm>
#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/util/error.h"
#include "train/tensor_parallel.h"

namespace primus::train {

namespace {
bool ends_with(const std::string& s, const std::string& t) {
  return s.size() >= t.size() && s.compare(s.size() - t.size(), t.size(), t) == 0;
}

// The row sizes of the matrices fused into one [rows, cols] slice of a tensor.
std::vector<int64_t> parts_of(const ModelSpec& m, const ParamTensor& t, int64_t rows) {
  if (ends_with(t.name, ".attn.qkv.weight")) return {m.q_dim(), m.kv_dim(), m.kv_dim()};
  if (ends_with(t.name, ".mlp.fc.weight") && m.swiglu) return {m.ffn_hidden_size, m.ffn_hidden_size};
  if (ends_with(t.name, ".moe.experts.fc.weight")) return {m.moe.ffn_hidden_size, m.moe.ffn_hidden_size};
  if (ends_with(t.name, ".moe.shared.fc.weight")) return {m.moe.shared_ffn_hidden_size, m.moe.shared_ffn_hidden_size};
  return {rows};
}
}  // namespace

std::vector<MuonTensor> muon_tensors(const ModelSpec& spec, const ParamLayout& layout) {
  std::vector<MuonTensor> out;
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const ParamTensor& t = layout.tensors[i];
    if (!t.trainable || t.shape.size() < 2 || t.name.rfind("layers.", 0) != 0) continue;
    if (t.name.find(".moe.router.") != std::string::npos) continue;
    // [E, out, in] is E matrices [out, in]; [out, in] is one.
    const int64_t cols = t.shape.back(), rows = t.shape[t.shape.size() - 2];
    const int64_t count = t.numel / (rows * cols);
    const std::vector<int64_t> parts = parts_of(spec, t, rows);
    if (std::accumulate(parts.begin(), parts.end(), int64_t{0}) != rows) {
      throw RuntimeError(fmt::format("muon: tensor '{}' [{}] does not split into parts of [{}] rows", t.name,
                                     fmt::join(t.shape, ", "), fmt::join(parts, ", ")));
    }
    MuonTensor mt;
    mt.index = i;
    int64_t off = t.offset;
    for (int64_t e = 0; e < count; ++e) {
      for (int64_t r : parts) {
        mt.blocks.push_back({off, r, cols});
        off += r * cols;
      }
    }
    out.push_back(std::move(mt));
  }
  return out;
}

void assign_muon_owners(std::vector<MuonTensor>& tensors, const ParamLayout& layout, int world) {
  PRIMUS_CHECK(world >= 1, "assign_muon_owners: world {}", world);
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  auto numel = [&](size_t k) { return layout.tensors[tensors[k].index].numel; };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return numel(a) > numel(b); });
  std::vector<int64_t> load(static_cast<size_t>(world), 0);
  for (size_t k : order) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    tensors[k].owner = r;
    load[static_cast<size_t>(r)] += numel(k);
  }
}

std::vector<bool> muon_mask(const std::vector<MuonTensor>& tensors, const ParamLayout& layout) {
  std::vector<bool> mask(layout.tensors.size(), false);
  for (const auto& t : tensors) mask[t.index] = true;
  return mask;
}

MuonTpPiece muon_tp_piece(const TpShardMap& map, const std::vector<MuonTensor>& global, const MuonTensor& local,
                          size_t index) {
  const ParamLayout& ll = map.local_layout();
  const std::string& name = ll.tensors.at(local.index).name;
  const ParamTensor* gt = map.global_layout().find(name);
  const auto gi = gt ? static_cast<size_t>(gt - map.global_layout().tensors.data()) : size_t(-1);
  const auto it = std::find_if(global.begin(), global.end(), [gi](const MuonTensor& m) { return m.index == gi; });
  if (it == global.end() || index >= it->blocks.size() || index >= local.blocks.size())
    throw RuntimeError(fmt::format("Muon under tp: block {} of {} has no global block", index, name));
  const MuonBlock& lb = local.blocks[index];
  const MuonBlock& gb = it->blocks[index];
  MuonTpPiece p;
  if (lb.rows == gb.rows && lb.cols == gb.cols) return p;
  const auto& pieces = map.pieces();
  const auto q = std::upper_bound(pieces.begin(), pieces.end(), lb.offset,
                                  [](int64_t off, const TpPiece& x) { return off < x.local; });
  if (q == pieces.begin()) throw RuntimeError(fmt::format("Muon under tp: no piece holds {}'s block {}", name, index));
  const int64_t rel = (q - 1)->global + (lb.offset - (q - 1)->local) - gb.offset;
  const int64_t r0 = rel / gb.cols, c0 = rel % gb.cols;
  const int rank = map.rank(), tp = map.tp();
  // The ranks hold full / local distinct pieces, each on tp / (full / local) consecutive ranks.
  auto rep_of = [&](int64_t l, int64_t full, int64_t at, int64_t other_at) {
    if (other_at != 0 || l <= 0 || full % l != 0 || tp % (full / l) != 0) return 0;
    const int rep = tp / static_cast<int>(full / l);
    return at == (rank / rep) * l ? rep : 0;
  };
  const int rows_rep = lb.cols == gb.cols ? rep_of(lb.rows, gb.rows, r0, c0) : 0;
  const int cols_rep = lb.rows == gb.rows ? rep_of(lb.cols, gb.cols, c0, r0) : 0;
  if (rows_rep == 0 && cols_rep == 0) {
    throw RuntimeError(fmt::format("Muon under tp: block {} of {}: [{}, {}] at ({}, {}) is not rank {}'s row or column "
                                   "range of [{}, {}]",
                                   index, name, lb.rows, lb.cols, r0, c0, rank, gb.rows, gb.cols));
  }
  p.whole = false;
  p.full_rows = gb.rows;
  p.full_cols = gb.cols;
  p.row0 = r0;
  p.col0 = c0;
  p.cols = rows_rep == 0;
  p.rep = p.cols ? cols_rep : rows_rep;
  return p;
}

void assemble_muon_pieces(const MuonTpPiece& p, int tp, const float* gathered, int64_t rows, int64_t cols, float* whole,
                          const Copy2d& copy) {
  const int64_t n = rows * cols, C = p.full_cols;
  for (int64_t k = 0; k < tp / p.rep; ++k) {  // distinct piece k, from rank k x rep
    const float* src = gathered + k * p.rep * n;
    float* dst = whole + (p.cols ? k * cols : k * n);
    if (copy) {
      copy(dst, C, src, cols, cols, rows);
    } else {
      for (int64_t r = 0; r < rows; ++r) std::copy(src + r * cols, src + (r + 1) * cols, dst + r * C);
    }
  }
}

}  // namespace primus::train
