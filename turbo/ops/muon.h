// Muon over many weight matrices (turbo/kernels/cpu/muon.h is the reference: Moonlight's Muon,
// quintic Newton-Schulz, Nesterov momentum, update scaled to AdamW's RMS by
// 0.2 * sqrt(max(rows, cols)) by default (cpu::muon_update_scale), decoupled weight decay).
//
// Each matrix: an fp32 master [rows, cols] (row-major, contiguous), an f32 gradient and an f32
// momentum of the same size, an optional bf16 model copy rewritten after the update, and a decay
// flag. On the GPU, per matrix: one kernel updates the momentum and sums u^2, one writes X =
// u / ||u||_F in bf16 (transposed when rows > cols, so X X^T is the smaller Gram matrix), then
// each Newton-Schulz step is A = X X^T, B = b A + c A A, X = a X + B X: three bf16 GEMMs with
// fp32 accumulation through turbo::gemm (as Moonlight and Keller Jordan run it in bf16) and two
// small combine kernels, and a last kernel applies the update. Nothing waits on the host, so a
// step can be captured in a CUDA graph. On the CPU (host tensors) it is the reference itself.
//
// A MultiMatrixMuon is built once after the buffers exist; on the GPU it allocates its working
// set (the largest whole matrix's: u in f32, four bf16 matrices and two Gram matrices; with
// tensor-parallel pieces also the largest piece's u) in a device arena of its own. It holds
// views, not memory: the buffers must outlive it.
#pragma once
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "turbo/core/arena.h"
#include "turbo/core/tensor_view.h"
#include "turbo/kernels/cpu/muon.h"
#include "turbo/ops/exec_context.h"

namespace primus::turbo {

struct MuonMatrix {
  TensorView master, model, grad, m;  // model optional (bf16)
  int64_t rows = 0, cols = 0;
  bool decay = true;
  // Tensor parallelism (gather set): this matrix is rows [row0, row0 + rows) x columns [col0, col0 +
  // cols) of a [full_rows, full_cols] one whose other pieces other ranks hold. gather(piece, whole)
  // puts every rank's u (f32 [rows, cols], this one's in `piece`) together into `whole` (f32
  // [full_rows, full_cols]) on the matrices' device, in the stream order of the step's context:
  // Newton-Schulz then runs on the whole matrix (the same on every rank, and its update scale is
  // the whole matrix's), and each rank applies its own piece.
  int64_t full_rows = 0, full_cols = 0, row0 = 0, col0 = 0;
  std::function<void(const TensorView& piece, const TensorView& whole)> gather;
  bool piece() const { return static_cast<bool>(gather); }
  int64_t whole_rows() const { return piece() ? full_rows : rows; }
  int64_t whole_cols() const { return piece() ? full_cols : cols; }
};

struct MuonHyper {
  float lr = 0.02f;        // used when step() gets no device lr
  float lr_scale = 1.0f;   // with a device lr: lr = device_lr[0] * lr_scale (muon_lr / lr)
  float momentum = 0.95f;
  bool nesterov = true;
  int64_t ns_steps = 5;
  cpu::MuonScale scale_mode = cpu::MuonScale::Spectral;  // cpu::muon_update_scale
  float extra_scale = 0.2f;
  float weight_decay = 0.0f;  // on matrices with decay
};

class MultiMatrixMuon {
 public:
  // Throws primus::RuntimeError naming the matrix index for mismatched sizes, dtypes or devices.
  explicit MultiMatrixMuon(std::vector<MuonMatrix> mats);
  ~MultiMatrixMuon();

  // One update of every matrix. grad_scale: f32 [1] on the matrices' device multiplying every
  // gradient (the clip factor), or undefined for 1; non-finite skips the update (nothing
  // written). device_lr: f32 [>= 1] on the device, the schedule's lr of this step (a graph replay
  // reads it), or undefined to use hp.lr.
  void step(const MuonHyper& hp, const TensorView& grad_scale, const TensorView& device_lr, const ExecContext& ctx);

  const std::vector<MuonMatrix>& matrices() const { return mats_; }
  size_t device_bytes() const;  // the working set's arena (0 on the CPU)
  // The device working set's bytes for matrices of these whole [rows, cols] (what the constructor
  // allocates; `primus projection` counts it), and with tensor-parallel pieces of at most
  // `piece_elems` elements the f32 buffer their u is written to before it is put together.
  static size_t working_set_bytes(const std::vector<std::pair<int64_t, int64_t>>& shapes, int64_t piece_elems = 0);

 private:
  std::vector<MuonMatrix> mats_;
  Device device_ = Device::CPU;
  std::unique_ptr<Arena> work_;
  void *u_ = nullptr, *x_ = nullptr, *y_ = nullptr, *t_ = nullptr, *a_ = nullptr, *b_ = nullptr, *partial_ = nullptr;
  void* piece_ = nullptr;  // tensor-parallel pieces' u before gather
};

}  // namespace primus::turbo
