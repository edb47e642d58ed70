#include "backends/cuda/model/grad_placement.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>

#include "core/util/error.h"

namespace primus::backends::cuda {

int64_t layer_of(const std::string& name) {
  static const std::string prefix = "layers.";
  if (name.rfind(prefix, 0) != 0) return -1;
  const size_t dot = name.find('.', prefix.size());
  if (dot == std::string::npos || dot == prefix.size()) return -1;
  int64_t l = 0;
  for (size_t i = prefix.size(); i < dot; ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    l = l * 10 + (name[i] - '0');
  }
  return l;
}

turbo::TensorView grad_view(const turbo::TensorView& grads, const GradPlacement& place, size_t i, int64_t first, int64_t n) {
  const int64_t at = place.offset.at(i);
  if (i >= place.bf16.size() || !place.bf16[i]) return grads.slice0(at + first, at + first + n);
  if (grads.dtype != turbo::DType::F32) throw RuntimeError("cuda model: a bf16 gradient's place is in an f32 buffer");
  char* p = static_cast<char*>(grads.data) + at * int64_t(sizeof(float)) + first * 2;
  return turbo::TensorView(p, turbo::DType::BF16, grads.device, {n});
}

bool is_expert_weight(const std::string& name) {
  if (layer_of(name) < 0) return false;
  for (const std::string suffix : {".moe.experts.fc.weight", ".moe.experts.proj.weight"})
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) return true;
  return false;
}

bool grad_written_before_layer_backward(const std::string& name) {
  static const std::string suffix = ".mlp.proj.bias";
  return layer_of(name) >= 0 && name.size() > suffix.size() &&
         name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

GradPlacement place_grads(const train::ParamLayout& layout, int windows,
                          const std::function<bool(const std::string& name)>& outside) {
  GradPlacement g;
  g.offset.resize(layout.tensors.size());
  g.in_window.assign(layout.tensors.size(), false);
  if (windows < 0 || windows > 2) throw RuntimeError(fmt::format("gradient placement: {} windows (0, 1 or 2)", windows));
  if (windows == 0) {
    for (size_t i = 0; i < layout.tensors.size(); ++i) g.offset[i] = layout.tensors[i].offset;
    g.elems = layout.total;
    return g;
  }
  // The layout keeps each layer's tensors contiguous, layers in order between the embeddings and
  // the final norm; the window starts where layer 0 starts and is as large as the largest layer.
  struct Span {
    int64_t begin = -1, end = -1;
  };
  std::vector<Span> layers;
  int64_t first = -1, last = -1;
  for (const auto& t : layout.tensors) {
    const int64_t l = layer_of(t.name);
    if (l < 0) continue;
    if (static_cast<size_t>(l) >= layers.size()) layers.resize(static_cast<size_t>(l) + 1);
    Span& s = layers[static_cast<size_t>(l)];
    s.begin = s.begin < 0 ? t.offset : std::min(s.begin, t.offset);
    s.end = std::max(s.end, t.offset + t.numel);
    first = first < 0 ? t.offset : std::min(first, t.offset);
    last = std::max(last, t.offset + t.numel);
  }
  if (layers.empty()) throw RuntimeError("gradient placement: the layout has no transformer layers");
  int64_t window = 0, expect = first;
  for (size_t l = 0; l < layers.size(); ++l) {
    const Span& s = layers[l];
    if (s.begin != expect) {
      throw RuntimeError(fmt::format("gradient placement: layer {} does not follow the layer before it in the layout "
                                     "(starts at {}, expected {})",
                                     l, s.begin, expect));
    }
    window = std::max(window, s.end - s.begin);
    expect = s.end;
  }
  g.shared_window = true;
  g.window_begin = first;
  g.window_elems = window;
  g.windows = windows;
  const int64_t span = window * windows;  // the windows, one after the other
  // The untied head and the embedding: one place, at the embedding's (before the layers).
  const train::ParamTensor* emb = layout.find("embedding.weight");
  const train::ParamTensor* head = layout.find("output_layer.weight");
  const bool share = emb && head && emb->numel == head->numel && emb->offset + emb->numel <= first && head->offset >= last;
  const int64_t dropped = share ? head->numel : 0;
  int64_t end = layout.total - (last - first) + span - dropped;  // the own places go after everything
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const auto& t = layout.tensors[i];
    const int64_t l = layer_of(t.name);
    if (l >= 0 && outside && outside(t.name)) {
      g.offset[i] = end;
      end += t.numel;
    } else if (l >= 0) {
      g.offset[i] = first + (l % windows) * window + (t.offset - layers[static_cast<size_t>(l)].begin);
      g.in_window[i] = true;
    } else if (t.offset < first) {
      g.offset[i] = t.offset;
    } else if (share && &t == head) {
      g.offset[i] = emb->offset;
      g.reuse.emplace_back(i, static_cast<size_t>(emb - layout.tensors.data()));
    } else {  // after the layers: moved down to the window's end (and past the head's place)
      g.offset[i] = t.offset - last + first + span - (share && t.offset > head->offset ? dropped : 0);
    }
  }
  g.elems = end;
  return g;
}

}  // namespace primus::backends::cuda
