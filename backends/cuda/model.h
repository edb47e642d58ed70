// The CUDA decoder: GPT-2 and Llama from one ModelSpec, llm.c style, on the device.
//
// Memory: everything is allocated once, in the constructor, from three device arenas, so a
// training step never calls cudaMalloc:
//   state        fp32 master weights, fp32 gradients, fp32 AdamW moments (each one flat buffer in
//                train/param_layout.h order, the reference backend's layout, so checkpoints,
//                export and generate are shared), the bf16 compute copy of the weights (same
//                layout), the RoPE table and the optimizer's descriptor table;
//   activations  what the backward needs, per layer, for batches up to max_batch x max_seq
//                (bf16; norm statistics and attention log-sum-exp f32), the bf16 logits of one
//                head block of B*T/chunks rows, at most ~1 GiB (the fused loss writes their gradient in
//                place: no fp32 [N,V] buffer exists), and the backward's working buffers,
//                shared by all layers (the MLP's and the attention's overlap);
//   scratch      what the ops borrow inside a call (ExecContext::scratch).
// Precision: bf16 activations and weights for compute, fp32 accumulation in every GEMM, norm
// and loss, fp32 parameter gradients (accumulated across micro-batches), fp32 optimizer.
//
// One step: stage_batch() for each micro-batch and set_hyper(hp) (the only host -> device
// copies), then zero_grad(); per micro-batch forward_staged(slot) + backward(); grad_norm();
// check_step() (the non-finite check, on the device); update(); and after it one
// read_step_status() (one D2H copy into pinned memory). Everything between set_hyper and
// read_step_status is enqueued on the model's stream with no host decision and no allocation,
// so the trainer can capture it as one CUDA graph and replay it (backends/cuda/step_graph.h).
// forward(tokens, ...) and update(hp) are the one-call forms (stage + forward, set_hyper +
// update) for evaluation and tests.
//
// Activation recomputation (the cuda.recompute.policy slot, hooks.h) decides per layer which
// activations plan() gives their own memory; the rest share one set, refilled by backward().
//
// Host mode (options.device = CPU): the same code on host memory in fp32, every op served by
// Turbo's CPU backends (the reference kernels) and the weights being the master copy. It checks
// the model's wiring against the reference backend on machines without a GPU.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "backends/cuda/hooks.h"
#include "backends/cuda/profile.h"
#include "train/model_spec.h"
#include "train/param_layout.h"
#include "turbo/core/arena.h"
#include "turbo/ops/optimizer.h"

namespace primus::backends::cuda {

struct CudaModelOptions {
  int64_t max_batch = 1;
  int64_t max_seq = 0;     // 0: spec.seq_length
  int64_t loss_slots = 1;  // forward() calls whose losses can be pending before read_loss (>= grad accumulation)
  // Scratch the attention slot needs (the fallback: fallback_attention_scratch_bytes). On the
  // device the model reserves at least enough for Turbo's flash kernels and cuDNN.
  size_t attention_scratch_bytes = 0;
  turbo::Device device = turbo::Device::CUDA;  // CPU: host mode (fp32, no GPU needed)
  // Data parallelism (data_parallel.h). flat_elems: the flat gradient and bf16 weight buffers
  // hold this many elements (>= layout().total; ZeRO-1 pads them to equal per-rank chunks, the
  // tail stays zero); 0: layout().total. optimizer_state = false: no fp32 master weights and
  // moments here (the ZeRO-1 shard holds them); set_params() then only refreshes the bf16
  // weights, and get_params(), the moment calls, grad_norm() and update() throw. Device only.
  int64_t flat_elems = 0;
  bool optimizer_state = true;
  // The linear slots run FP8 GEMMs (patch cuda.linear.fp8): scratch holds their quantized
  // copies (turbo::linear_fp8_scratch_bytes) and every linear dimension must be a multiple of 16.
  bool fp8_linear = false;
};

class CudaModel {
 public:
  // Needs a current CUDA device (select_device) unless in host mode. Throws ConfigError for shapes the kernels do
  // not serve (hidden, head and FFN sizes must be multiples of 8, so are padded vocab rows).
  CudaModel(const train::ModelSpec& spec, const CudaModelOptions& opt, CudaOps ops);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const train::ModelSpec& spec() const { return spec_; }
  const train::ParamLayout& layout() const { return layout_; }
  cudaStream_t stream() const { return stream_; }
  // For data parallelism: the flat fp32 gradients and bf16 weights (flat_elems each), reduced
  // and gathered in place, and the device {grad norm, clip factor} that update() applies.
  const TensorView& grads() const { return grads_; }
  const TensorView& weights() const { return weights_; }
  const TensorView& grad_norm_buffer() const { return norm_; }

  // Host <-> device copies of the flat fp32 buffers (layout().total floats each). They
  // synchronise. set_params also refreshes the bf16 compute copy.
  void set_params(const float* host);
  void get_params(float* host) const;
  void set_moments(const float* m, const float* v);  // nullptr: zeros
  void get_moments(float* m, float* v) const;
  void get_grads(float* host) const;

  void zero_grad();
  // tokens, targets: host int32 [B*T], copied (stream-ordered; the host buffers may be reused at
  // once) into the device token buffers of `slot` (0 .. loss_slots-1, one per micro-batch),
  // through pinned memory (see staging_).
  void stage_batch(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, int64_t slot);
  // Forward of the batch staged in `slot`; its mean loss goes to loss slot `slot`. dloss != 0
  // (pass 1 / (B*T*accumulation steps)) also runs the head's backward, block by block while each
  // block's dlogits exist: the head weight's gradient is accumulated here, and backward()
  // continues from the final norm. dloss == 0 (evaluation) leaves the gradients alone.
  void forward_staged(int64_t B, int64_t T, float dloss, int64_t slot);
  void forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, float dloss, int64_t slot = 0) {
    stage_batch(tokens, targets, B, T, slot);
    forward_staged(B, T, dloss, slot);
  }
  // Accumulates parameter gradients of the last forward (which must have had dloss != 0),
  // recomputing the activations the layers did not keep.
  void backward();
  // Global gradient norm and clip factor min(1, max_norm / norm) (1 when max_norm <= 0), on the
  // device; update() scales the gradients by the factor.
  void grad_norm(float max_norm);
  // The step's non-finite check over loss slots [0, n) and the grad norm, on the device: a
  // non-finite step sets the clip factor to NaN, which makes update() leave every weight and
  // moment untouched (turbo/ops/optimizer.h). Runs after grad_norm().
  void check_step(int64_t n);
  // The learning rate and the bias corrections of step hp.step, copied to a device scalar that
  // update() reads (so a captured update follows the schedule); the other fields (betas, eps,
  // weight decay) are fixed per run.
  void set_hyper(const turbo::AdamWHyper& hp);
  void update();
  void update(const turbo::AdamWHyper& hp) {
    set_hyper(hp);
    update();
  }

  // Synchronising reads: the sum of the mean losses in slots [0, n), and the last grad norm.
  double read_loss_sum(int64_t n) const;
  double read_grad_norm() const;
  // One D2H copy (pinned memory) after a step: the mean loss summed over slots [0, n), the grad
  // norm, and whether check_step() found the step finite (false: update() skipped it).
  struct StepStatus {
    double loss_sum = 0, grad_norm = 0;
    bool finite = true;
  };
  StepStatus read_step_status(int64_t n) { return wait_step_status(enqueue_step_status(), n); }
  // The same in two halves, so the host can enqueue the next step before reading this one's:
  // enqueue_step_status() queues the D2H copy of the status after everything enqueued so far and
  // returns a ticket; later staging (stage_batch, set_hyper, the next status) uses the other set
  // of pinned buffers. wait_step_status(ticket, n) waits for that copy alone (not for work
  // enqueued after it) and reads it. At most two steps may be outstanding.
  int enqueue_step_status();
  StepStatus wait_step_status(int ticket, int64_t n) const;

  // Phase marks for the step profiler (nullptr: none; the profiler must outlive the model's use).
  void set_profiler(StepProfiler* p) { prof_ = p; }
  StepProfiler* profiler() const { return prof_; }
  Recompute recompute(int64_t layer) const { return policy_.at(static_cast<size_t>(layer)); }
  // Bytes of the activations arena (what recomputation shrinks).
  size_t activation_bytes() const;
  // Whether q|k|v's and the MLP up-projection's bias gradients come from their weight GEMMs
  // (PRIMUS_CUDA_BIAS_GRAD=ones, the default where it applies; see BiasGrad).
  bool bias_grad_from_ones() const { return ones_pad_ != 0; }

  void sync() const;  // waits for everything enqueued on the model's stream

  // Device bytes held by the three arenas.
  size_t reserved_bytes() const;
  size_t scratch_high_water() const;

 private:
  // One parameter tensor: its bf16 compute weight and its f32 gradient (undefined when the
  // model has no such tensor, e.g. biases in Llama).
  struct Param {
    TensorView w, g;
  };
  struct NormParams {
    Param weight, bias;
  };
  struct LayerParams {
    NormParams norm1, norm2;
    Param qkv_w, qkv_b, proj_w, proj_b, fc_w, fc_b, out_w, out_b;
  };
  struct LayerActs {
    // qkv [N, C + 2*KVD]: one GEMM's packed q|k|v columns; attention reads them as strided views.
    TensorView x_in, ln1, mean1, rstd1, qkv, att, lse, x2, ln2, mean2, rstd2, fc, act;
  };
  template <class Take>
  void plan(Take&& take);  // assigns every buffer; run once to count bytes, once to allocate
  // Layer l's forward from its residual input. recompute = false: the step's forward (norm1
  // fused with the residual add of the layer below, unless l == 0); true: the backward's
  // recomputation (norm1 from the stored x_in; the last GEMM, whose output nothing needs, skipped).
  void layer_forward(int64_t l, int64_t B, int64_t T, bool recompute);
  void recompute_layer(int64_t l, int64_t B, int64_t T);  // refills what policy_[l] did not keep
  // A linear layer's gradients from dout: dinp = (skipped if undefined), w.g +=, b.g += (if the
  // layer has a bias: its own column-sum reduction, the GEMM's epilogue with BiasGrad::Gemm, or
  // nothing when `bias_done`: a norm backward already summed dout into b.g).
  void linear_backward(const TensorView& dinp, const Param& w, const Param& b, const TensorView& dout,
                       const TensorView& inp, bool bias_done = false);
  // Whether a tensor's gradient is first written by a GEMM with beta 0 in each step (the linear
  // layers' weights and the head's), so that zero_grad() need not clear it.
  bool written_by_first_gemm(const std::string& name) const;
  void mark(Phase p) const {
    if (prof_) prof_->mark(p);
  }
  Param param(const std::string& name, bool required) const;
  void need_optimizer_state(const char* what) const;  // throws without it (ZeRO-1)
  // out = norm(inp (+ residual, stored to res_out)); residual undefined: out = norm(inp).
  void norm_forward(const TensorView& out, const TensorView& mean, const TensorView& rstd, const TensorView& res_out,
                    const TensorView& inp, const TensorView& residual, const NormParams& p, int64_t N);
  // dres (+)= d inp, p's gradients +=; with BiasGrad::Norm also dres_colsum (if defined) += the
  // column sums of the resulting dres (the bias gradient of the linear layer that wrote it).
  void norm_backward(const TensorView& dres, const TensorView& dout, const TensorView& inp, const TensorView& mean,
                     const TensorView& rstd, const NormParams& p, int64_t N, bool accumulate,
                     const TensorView& dres_colsum = {});
  ExecContext ctx() const;
  TensorView view(const TensorView& buf, std::initializer_list<int64_t> shape) const;  // same memory, new shape
  // [B,T,heads,D] view of columns [col, col + heads*D) of a row-major [rows, W] buffer (tokens W apart).
  TensorView heads(const TensorView& buf, int64_t B, int64_t T, int64_t col, int64_t heads) const;
  void to_model(void* dst, const void* src, size_t bytes) const;    // host -> model memory, stream-ordered
  void from_model(void* dst, const void* src, size_t bytes) const;  // model memory -> host
  void zero(const TensorView& t) const;

  train::ModelSpec spec_;
  train::ParamLayout layout_;
  CudaModelOptions opt_;
  CudaOps ops_;
  bool host_ = false;                        // host mode
  turbo::DType act_ = turbo::DType::BF16;    // activations and compute weights (f32 in host mode)
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<turbo::Arena> state_, acts_, scratch_;

  // parameters (views into the state arena)
  Param wte_, wpe_, head_;
  NormParams final_norm_;
  std::vector<LayerParams> params_;
  // state
  // status_ = {loss sums [loss_slots], grad norm, clip factor, finite flag}: loss_slots_ and norm_
  // are views into it, so a step's status is one D2H copy. hyper_ = {lr, 1-beta1^t, 1-beta2^t}.
  TensorView master_, weights_, grads_, m_, v_, rope_table_, status_, loss_slots_, norm_, hyper_;
  // zero_grad(): the gradient ranges it clears (everything but the tensors written_by_first_gemm,
  // merged where adjacent; on the device the small ones through zero_ranges_f32 and its table in the
  // state arena, the large ones by memset; host mode clears range by range),
  // and the flags telling the head's and the layers' weight-gradient GEMMs to write (beta 0)
  // instead of accumulate: set by zero_grad(), cleared once the first micro-batch has written.
  // PRIMUS_CUDA_ZERO_GRAD=full restores a full clear with every GEMM accumulating (A/B timing).
  std::vector<std::pair<int64_t, int64_t>> zero_ranges_;  // (offset, count)
  std::vector<std::pair<int64_t, int64_t>> memset_ranges_;  // the large ones, one cudaMemsetAsync each
  static constexpr int64_t kMemsetRange = int64_t{1} << 22;  // elements (16 MiB)
  TensorView zero_table_;  // device mode only
  int64_t zero_total_ = 0;  // elements in zero_ranges_
  bool zero_grad_full_ = false;
  bool gelu_unfused_fwd_ = false;  // PRIMUS_CUDA_GELU_FWD=unfused (A/B): bias GEMM, then the GELU op
  bool gelu_unfused_bwd_ = false;  // PRIMUS_CUDA_GELU_BWD=unfused (A/B): plain dgrad, then GELU's backward in place
  bool fresh_head_ = false, fresh_layers_ = false;
  turbo::AdamWHyper hp_;
  std::vector<float> status_host_mem_;  // host mode: the status of each ticket (2 x status_), as staging_ below
  // Pinned host buffers for the step's copies (device mode), in two sets, so that the host stages
  // step s + 1 while step s runs: per set every batch slot's tokens and targets, the AdamW
  // scalars and the step status. Each region's last copy records an event that the host waits
  // on before it rewrites the region; in training the set was last used two steps ago, so the
  // wait returns at once (a test that stages twice in a row waits for the first copy).
  struct StagingSet {
    char* mem = nullptr;  // one cudaMallocHost block: batches, then the scalars, then the status
    int32_t* batch = nullptr;  // [loss_slots][tokens | targets][max_batch * max_seq]
    float* hyper = nullptr;    // [3]
    float* status = nullptr;   // status_.numel()
    std::vector<cudaEvent_t> batch_done;  // per batch slot
    cudaEvent_t hyper_done = nullptr, status_done = nullptr;
  };
  StagingSet staging_[2];
  int staging_set_ = 0;  // the set the next staging writes
  void init_staging();
  void free_staging();
  // activations; policy_[l] says which of layers_[l]'s tensors are its own (the rest alias work_)
  std::vector<Recompute> policy_;
  LayerActs work_;
  std::vector<LayerActs> layers_;
  TensorView tmp_, x_final_, lnf_, meanf_, rstdf_, logits_, losses_, tokens_, targets_;
  // dqkv_ [N, C + 2*KVD] packs dq|dk|dv like LayerActs::qkv (one dgrad and one wgrad GEMM);
  // dqk_rot_ [N, C + KVD] holds the attention's dq|dk before RoPE's backward rotates them into dqkv_.
  TensorView dres_, dln_, datt_, dqkv_, dqk_rot_, dfc_, dact_;
  size_t scratch_bytes_ = 0;

  std::unique_ptr<turbo::MultiTensorAdamW> adamw_;
  // The LM head and loss run in row blocks: the [rows, V] logits buffer is the largest single
  // activation (1.6 GB bf16 for GPT-2 at B*T = 16k, 4.2 GB for Llama-3's 128k vocabulary at 8 x
  // 2048). At least 2 blocks, and as many as keep one block's logits within kHeadBlockBytes; each
  // extra block costs one f32 read+write of the head's weight gradient (GPT-2 B32 with 4 blocks instead of 2: 1.132x vs 1.133x torch.compile, H100).
  static constexpr int64_t kMinHeadChunks = 2;
  static constexpr int64_t kHeadBlockBytes = int64_t{1} << 30;
  int64_t head_rows_ = 0;
  int64_t B_ = 0, T_ = 0;
  int64_t slot_ = 0;  // the token slot of the last forward (backward's embedding gradient reads it)
  int64_t train_tokens_ = 1;  // B * T of the last forward with a gradient (the step status divides by it)
  bool have_grad_logits_ = false;
  // Where the linear layers' bias gradients are computed (PRIMUS_CUDA_BIAS_GRAD, for A/B runs):
  //   Norm      (default) the attention projection's and the MLP down-projection's, whose output
  //             gradient is the residual stream's, in the norm backward that produces it
  //             (NormBackwardArgs::dinp_colsum); the others by the cuda.linear.bias_grad slot;
  //   Separate  all by the cuda.linear.bias_grad slot (a column-sum reduction each);
  //   Gemm      all in the weight-gradient GEMM's epilogue (cuBLASLt BGRADB);
  //   Ones      (default where it applies: linear biases, no FP8) as Norm for the projections
  //             that write the residual; q|k|v's and the MLP up-projection's, whose inputs are norm
  //             outputs, in their weight GEMM: the norm writes its rows kOnesPad columns apart with a
  //             column of ones after them (set once at construction), so dout^T @ [inp | 1] is
  //             [weight gradient | bias gradient] (cuda.linear.weight_grad_ones) instead of a pass
  //             over dout. Elsewhere it falls back to Norm.
  enum class BiasGrad : uint8_t { Norm, Separate, Gemm, Ones };
  BiasGrad bias_grad_ = BiasGrad::Ones;
  bool norm_colsum() const { return bias_grad_ == BiasGrad::Norm || bias_grad_ == BiasGrad::Ones; }
  static constexpr int64_t kOnesPad = 8;  // 16 bytes of bf16: the norm's vector stores stay aligned
  int64_t ones_pad_ = 0;                  // kOnesPad when the Ones mode applies, else 0
  std::vector<TensorView> ones_buffers_;  // the padded norm outputs, [N, C + kOnesPad], to initialise
  // The [N, C + pad] view (with the column of ones) of a padded [N, C] norm output, or undefined.
  TensorView with_ones(const TensorView& t) const;
  StepProfiler* prof_ = nullptr;
};

}  // namespace primus::backends::cuda
