// Where each parameter's gradient lives in the model's gradient buffer.
//
// Normally at the tensor's own offset in the flat layout (train/param_layout.h), so the buffer is
// as large as the model. With the optimizer in the backward (CudaModelOptions::optimizer_in_backward)
// a transformer layer's gradients exist only from its backward to its AdamW update, which runs
// right after it, before the layer below writes any gradient: every layer then uses one window
// of the size of the largest layer, at the same relative offsets, and the buffer holds the
// embeddings, that window, and the final norm and head. For a MoE model that is the difference
// between 4 bytes per parameter and a few per cent of it (olmoe-mini: 13.3 GiB -> 2.3 GiB).
// An untied head's gradient is final before the first layer's backward, and its AdamW group runs
// then; the token embedding's is written only at the very end. So the embedding's gradient takes
// the head's place (GradPlacement::reuse) and the gradients of the two largest tensors of a small
// model with a large vocabulary cost one of them (Llama-3.2-1B: 1.0 GB less).
// Beside data or context parallelism each layer's gradients are averaged over the ranks while the
// layer below runs its backward, and updated after it: then the layers alternate between two
// windows (layer l in window l % 2), so the layer below never writes what is being averaged.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "train/param_layout.h"
#include "turbo/core/tensor_view.h"

namespace primus::backends::cuda {

struct GradPlacement {
  std::vector<int64_t> offset;  // per layout tensor: its gradient's first element in the buffer
  std::vector<bool> in_window;  // per layout tensor: its gradient lives in the shared window
  int64_t elems = 0;            // elements of the buffer
  bool shared_window = false;   // the layers share one window (or two, see windows)
  // The windows' place and each one's size (elements; window w starts at window_begin + w x
  // window_elems); 0 without shared_window.
  int64_t window_begin = 0, window_elems = 0;
  int windows = 0;  // 1 or 2 with shared_window: layer l uses window l % windows
  // (a, b), layout tensor indices: b's gradient lies at a's place. a's optimizer group runs before
  // anything writes b's gradient, which is cleared right after it (not at the step's start).
  std::vector<std::pair<size_t, size_t>> reuse;
  // Per layout tensor (empty: none): its gradient is bf16, in the first half of the bytes of its
  // f32 place (CudaModelOptions::bf16_expert_grads); read it through grad_view.
  std::vector<bool> bf16;
};

// Elements [first, first + n) of layout tensor i's gradient in `grads` (the f32 buffer the
// placement describes): an f32 slice, or the bf16 view where place.bf16 says so.
turbo::TensorView grad_view(const turbo::TensorView& grads, const GradPlacement& place, size_t i, int64_t first, int64_t n);

// The MoE experts' grouped weights ("layers.<l>.moe.experts.fc.weight" and ".proj.weight"), whose
// gradients the grouped weight-gradient GEMM writes.
bool is_expert_weight(const std::string& name);

// The transformer layer a layout tensor belongs to ("layers.<l>."), or -1 (embeddings, final
// norm, head).
int64_t layer_of(const std::string& name);

// Whether the decoder writes a layer tensor's gradient before that layer's backward begins: the
// MLP output projection's bias, whose gradient is the column sum of the residual gradient that the
// next layer's norm1 backward (the final norm's, for the last layer) produces (decoder.h, BiasGrad
// Norm and Ones).
bool grad_written_before_layer_backward(const std::string& name);

// windows = 0: every gradient at its layout offset (elems = layout.total). With 1 or 2 windows,
// the layers' tensors for which `outside(name)` holds keep a place of their own after the window:
// those whose gradient is written before their layer's backward begins (a layer's last linear
// bias, whose column sum the next layer's norm backward computes), while the layer above still
// owns the window; and an untied head ("output_layer.weight") of the token embedding's shape
// shares the embedding's place (reuse = {(head, embedding)}).
GradPlacement place_grads(const train::ParamLayout& layout, int windows,
                          const std::function<bool(const std::string& name)>& outside = {});

}  // namespace primus::backends::cuda
