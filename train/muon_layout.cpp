#include "train/muon_layout.h"

#include <algorithm>
#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/util/error.h"

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

}  // namespace primus::train
