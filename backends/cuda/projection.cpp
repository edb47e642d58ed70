#include "backends/cuda/projection.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>

#include "backends/cuda/model/decoder.h"
#include "backends/cuda/model/grad_placement.h"
#include "backends/cuda/register.h"
#include "core/util/error.h"
#include "parallel/cuda/grad_reducer.h"
#include "train/expert_parallel.h"
#include "turbo/core/arena.h"
#include "turbo/kernels/cuda/optimizer.h"
#include "turbo/ops/muon.h"

namespace primus::backends::cuda {

namespace {

// The plan's buffer names (memory_plan.cpp) grouped into the projection's parts.
struct ProjectedStatePart {
  const char* what;  // the buffer's name in the plan, as it starts
  const char* part;
  const char* detail;
};
constexpr ProjectedStatePart kProjectedStateParts[] = {
    {"bf16 weights", "weights", "bf16 compute copy of the weights (flat, layout order)"},
    {"fp32 master weights", "master_weights", "fp32 master weights"},
    {"low halves of the fp32 master weights", "master_weights",
     "low halves of the fp32 master weights (master_weights: split; the bf16 weights are the high halves)"},
    {"fp32 gradients", "gradients", "fp32 gradients (flat; accumulated over the micro-batches)"},
    {"fp32 averaged gradients", "gradients", "sharded data parallelism: this rank's chunks of the averaged gradient"},
    {"weights (gathered", "weights", "sharded data parallelism: the gathered units' places"},
    {"fp32 reduce-scatter chunk", "comm", "sharded data parallelism: one reduce-scatter's output chunk"},
    {"AdamW first moments", "optimizer_state", "AdamW first moments m (fp32, or bf16 with exp_avg_dtype: bf16)"},
    {"AdamW second moments", "optimizer_state", "AdamW second moments v (fp32, or bf16 with exp_avg_sq_dtype: bf16)"},
    {"FP8 weight", "fp8", "FP8 copies of the layers' linear and expert weights with their scales, both layouts (the "
                          "forward one alone with no_fp8_weight_transpose_cache), quantized once per step under "
                          "gradient accumulation"},
};

bool projection_starts_with(const std::string& s, const char* p) { return s.rfind(p, 0) == 0; }

}  // namespace

train::MemoryProjection project_cuda_memory(const CudaArgs& args, const CudaOps& ops, const train::ProjectionLayout& lay,
                                            bool query_device, double runtime_gib) {
  // The mesh the trainer would build (without its process groups), for its rank 0: tensor
  // parallelism's slice (the shard map's local spec, as the trainer builds the model), context
  // parallelism's chunk slots, and the sharded strategies' plan over the dp x cp ranks (every rank's
  // chunks are equal).
  const int64_t tp = args.train.model_parallel[parallel::Dim::TP], cp = args.train.model_parallel[parallel::Dim::CP];
  const int64_t ep = args.train.model_parallel[parallel::Dim::EP];
  CudaArgs a = args;
  std::shared_ptr<train::TpShardMap> map;
  if (tp > 1) {
    map = std::make_shared<train::TpShardMap>(args.model, tp, 0, a.train.model_parallel.sequence_parallel);
    a.model = map->local_spec();
  }
  if (ep > 1) a.model = train::EpShardMap(args.model, static_cast<int>(ep), 0).local_spec();  // rank 0's experts
  const train::ModelSpec& spec = a.model;
  const train::ParamLayout layout = train::make_param_layout(spec);
  CudaModelOptions mo;
  try {
    mo = model_options_for(a, lay.gpus);  // the trainer's refusals, before anything is built
  } catch (const ConfigError& e) {
    throw train::RunRefusal(e.what());
  }
  if (map) mo.tp_map = map;
  MemoryPlanOptions mp = memory_plan_options(spec, layout, mo, ops);
  mp.query_device = query_device;
  if (cp > 1) mp.cp = cp;
  if (ep > 1) mp.ep = ep;  // the held side's buffers (mp.ep_buffer_factor from the options)
  const parallel::DpSharding sharding = a.train.model_parallel.sharding;
  const int64_t shard_world = lay.gpus * cp;
  const bool sharded = shard_world > 1 && (parallel::shards_gradients(sharding) || zero1_in_model(a));
  if (sharded) {
    mp.fsdp = std::make_shared<FsdpPlan>(plan_fsdp(layout, spec.num_layers, static_cast<int>(shard_world), 0, sharding));
    mp.zero_ranges = 0;
  }
  const MemoryPlanSizes sz = MemoryPlan::sizes(spec, layout, mp);

  train::MemoryProjection m;
  m.source = fmt::format("the cuda memory plan's own sizes{}{}{}", map ? fmt::format(" for tp rank 0 of {}", tp) : "",
                         ep > 1 ? fmt::format(" for ep rank 0 of {}", ep) : "",
                         sz.scratch_exact ? "" : "; no GPU here: see notes");
  if (tp > 1 || cp > 1) {
    m.notes.push_back(fmt::format("tp {} x cp {}: the tp and cp collectives' own buffers (NCCL's) are not counted; the "
                                  "step time is not projected for this layout",
                                  tp, cp));
  }
  if (ep > 1) {
    m.notes.push_back(fmt::format("ep {}: rank 0's {} of {} experts, and the held side's buffers for {} x its permuted "
                                  "rows (moe_ep_buffer_factor); NCCL's all-to-all buffers and the moves' row maps "
                                  "(4 bytes a local and a held row, twice, per MoE layer) are not counted; the step "
                                  "time is not projected for this layout",
                                  ep, args.model.moe.num_experts / ep, args.model.moe.num_experts,
                                  std::min(static_cast<double>(ep), std::max(1.0, args.moe_ep_buffer_factor))));
  }
  // State arena: the flat buffers by name, the small tables together.
  size_t state_named = 0;
  for (const ProjectedStatePart& p : kProjectedStateParts) {
    size_t b = 0;
    std::string detail = p.detail;
    for (const PlannedBuffer& buf : sz.buffers) {
      if (!buf.state || !projection_starts_with(buf.what, p.what)) continue;
      b += buf.bytes;
      // The optimizer in the backward: the gradients are the layers' shared windows (the plan says how many).
      if (buf.what.find("window") != std::string::npos) detail = buf.what;
    }
    state_named += b;
    m.add(p.part, detail, double(b));
  }
  m.add("workspace", "state tables: step status, AdamW hyper-parameters and descriptors, RoPE table, zero_grad ranges",
        double(sz.state_arena - state_named));
  // Activations arena, in four groups.
  std::string policy = mp.policy.empty() ? "none" : recompute_name(mp.policy.front());
  if (const auto n = std::count(mp.policy.begin(), mp.policy.end(), mp.policy.front());
      n < static_cast<int64_t>(mp.policy.size()))
    policy += fmt::format(" in the first {} of {} layers", n, mp.policy.size());
  size_t layers = 0, moe = 0, head = 0, backward = 0;
  for (const PlannedBuffer& buf : sz.buffers) {
    if (buf.state) continue;
    const std::string& w = buf.what;
    if (projection_starts_with(w, "MoE")) moe += buf.bytes;
    else if (projection_starts_with(w, "logits") || projection_starts_with(w, "per-token") ||
             projection_starts_with(w, "tokens") || projection_starts_with(w, "targets"))
      head += buf.bytes;
    else if (w.find("gradient") != std::string::npos) backward += buf.bytes;
    else layers += buf.bytes;
  }
  const size_t acts_slack = sz.acts_arena - (layers + moe + head + backward);
  m.add("activations",
        fmt::format("saved for the backward, per layer and the shared recompute set (recompute_granularity {})", policy),
        double(layers + acts_slack));
  m.add("activations", fmt::format("MoE routing and expert buffers ({} of {} experts per token, padded groups)",
                                   spec.moe.topk, spec.moe.num_experts),
        double(moe));
  m.add("activations", "LM head logits block, per-token losses, token and target slots", double(head));
  m.add("activations", "the backward's working gradients (shared by the layers)", double(backward));
  // Scratch: with FP8 the quantized copies are what grows it over the bf16 plan's; unfused
  // accumulation adds one weight gradient.
  size_t scratch = sz.scratch_arena;
  if (mp.unfused_wgrad) {
    MemoryPlanOptions fused = mp;
    fused.unfused_wgrad = false;
    const size_t without = MemoryPlan::sizes(spec, layout, fused).scratch_arena;
    m.add("gradients", "the largest weight gradient in f32, before it is rounded and added "
          "(gradient_accumulation_fusion: false)", double(scratch - std::min(without, scratch)));
    scratch = std::min(without, scratch);
  }
  if (mp.fp8_linear) {
    MemoryPlanOptions bf16 = mp;
    bf16.fp8_linear = false;
    bf16.fp8_moe = false;
    bf16.unfused_wgrad = false;
    const size_t base = MemoryPlan::sizes(spec, layout, bf16).scratch_arena;
    m.add("workspace", "op scratch (the largest single borrow: attention workspace, norm partials)", double(base));
    m.add("fp8", fmt::format("FP8 ({}) quantized copies of one layer's GEMM operands and their scales", lay.fp8),
          double(scratch - std::min(base, scratch)));
    if (scratch <= base) {
      m.notes.push_back(fmt::format("fp8 {}: the quantized copies of one layer's GEMM operands fit in the op scratch the "
                                    "other ops already need (no memory of their own at this size)",
                                    lay.fp8));
    }
  } else {
    m.add("workspace", "op scratch (the largest single borrow: attention workspace, norm partials)", double(scratch));
  }
  if (!mo.muon.empty()) {  // OptimizerState's own arenas (model/optimizer_state.cpp)
    std::vector<std::pair<int64_t, int64_t>> shapes;
    int64_t piece_elems = 0, stage_elems = 0;
    const std::vector<train::MuonTensor> local = train::muon_tensors(spec, layout);
    // Under tp Newton-Schulz runs on the whole (global) matrices; each rank's pieces' u is gathered
    // (CudaModel::tp_muon_pieces: column and replicated pieces through a staging buffer).
    const std::vector<train::MuonTensor> global = map ? train::muon_tensors(args.model, map->global_layout()) : local;
    for (const train::MuonTensor& mt : local) {
      for (size_t b = 0; b < mt.blocks.size(); ++b) {
        const train::MuonBlock& lb = mt.blocks[b];
        const train::MuonTpPiece p = map ? train::muon_tp_piece(*map, global, mt, b) : train::MuonTpPiece();
        if (p.whole) {
          shapes.emplace_back(lb.rows, lb.cols);
          continue;
        }
        shapes.emplace_back(p.full_rows, p.full_cols);
        piece_elems = std::max(piece_elems, lb.rows * lb.cols);
        if (p.cols || p.rep > 1) stage_elems = std::max(stage_elems, lb.rows * lb.cols * tp);
      }
    }
    const int rest = static_cast<int>(layout.tensors.size() - local.size());
    const size_t table = rest > 0 ? turbo::cuda::multi_tensor_table_bytes(rest) + 2 * turbo::Arena::kDefaultAlign : 0;
    const size_t stage = stage_elems > 0 ? size_t(stage_elems) * 4 + 2 * turbo::Arena::kDefaultAlign : 0;
    m.add("workspace",
          fmt::format("Muon's Newton-Schulz working set (the largest matrix: u in fp32, three bf16 copies, two Gram "
                      "matrices){} and the other tensors' AdamW descriptors",
                      map ? ", this rank's pieces' u and the tp gather's staging" : ""),
          double(turbo::MultiMatrixMuon::working_set_bytes(shapes, piece_elems) + table + stage));
  }
  if (!sz.scratch_exact) {
    m.notes.push_back("no GPU here: the scratch leaves out the norm and column-sum partials, whose size depends on the "
                      "device's SM count; the attention's reservation above them is counted, so the scratch is exact "
                      "unless those partials exceed it");
  }
  // Outside the arenas: data parallelism's own buffers (parallel/cuda/grad_reducer.cpp; sharded
  // data parallelism has none: its buffers are the plan's; beside expert parallelism the model
  // reduces the gradients itself, in place).
  if (lay.gpus > 1 && !sharded && ep == 1) {
    const int world = static_cast<int>(lay.gpus);
    const int64_t granule = lay.zero1 ? parallel::zero1_granule(world) : 1;
    const int64_t total = lay.zero1 ? parallel::zero1_padded_total(layout, world) : layout.total;
    const auto buckets =
        parallel::plan_buckets(grad_ready_points(layout), total, granule, std::max<int64_t>(a.ddp_bucket_size, granule));
    if (lay.zero1) {
      const size_t align = turbo::Arena::kDefaultAlign;
      const int64_t shard = total / world;
      const size_t shard_bytes = (size_t(shard) * 4 + align) / align * align;
      m.add("master_weights", fmt::format("ZeRO-1: this rank's 1/{} shard of the fp32 master weights", world),
            double(shard_bytes));
      m.add("optimizer_state", fmt::format("ZeRO-1: this rank's 1/{} shard of AdamW m and v", world),
            double(2 * shard_bytes));
      // The shard's AdamW table (at most one piece per tensor and bucket) and grad-norm partials.
      const int pieces = static_cast<int>(layout.tensors.size() + buckets.size());
      m.add("workspace", "ZeRO-1 AdamW descriptors and grad-norm partials (bounds)",
            double(turbo::cuda::multi_tensor_table_bytes(pieces) + 4 * align +
                   turbo::cuda::grad_norm_scratch_bytes(shard / 256 + pieces + 1) + 4 * align));
    }
    int64_t biggest = 0;
    for (const auto& b : buckets) biggest = std::max(biggest, b.end - b.begin);
    if (lay.grad_reduce_in_bf16)
      m.add("comm", fmt::format("bf16 staging of the largest gradient bucket ({} elements)", biggest),
            double(biggest) * 2);
    m.notes.push_back(fmt::format("NCCL's own buffers are not counted (they depend on the topology and NCCL_BUFFSIZE); "
                                  "{} buckets of up to {} elements reduce {}",
                                  buckets.size(), biggest, lay.overlap_grad_reduce ? "under the backward" : "after it"));
  }
  const double rt = runtime_gib < 0 ? kRuntimeOverheadGiB : runtime_gib;
  m.add("runtime", fmt::format("CUDA context and libraries' workspaces ({:.2f} GiB{})", rt,
                               runtime_gib < 0 ? ", measured on H100/H200; --runtime-gib to state another" : ", stated"),
        rt * double(size_t{1} << 30));
  return m;
}

train::StepCostOptions cuda_step_cost(const CudaArgs& a, train::StepCostOptions c) {
  // Split masters: the update rewrites the bf16 weights as the masters' high halves, so the 4-byte
  // master read and write become 2 + 2 and the separate 2-byte bf16 write is gone.
  if (a.split_master) c.optimizer_bytes_per_param -= 2;
  // bf16 moments: each read and written in 2 bytes instead of 4.
  if (a.train.optim.exp_avg_bf16) c.optimizer_bytes_per_param -= 4;
  if (a.train.optim.exp_avg_sq_bf16) c.optimizer_bytes_per_param -= 4;
  if (!a.optimizer_in_bwd) return c;
  // The norm is summed inside the AdamW pass (no separate read of the gradients): 30 bytes.
  c.optimizer_bytes_per_param -= 4;
  if (a.bf16_expert_grads) {  // the experts' gradients read as bf16: 2 bytes fewer each
    const train::ParamLayout layout = train::make_param_layout(a.model);
    int64_t experts = 0;
    for (const train::ParamTensor& t : layout.tensors)
      if (is_expert_weight(t.name)) experts += t.numel;
    c.optimizer_bytes_per_param -= 2.0 * double(experts) / double(std::max<int64_t>(layout.total, 1));
  }
  return c;
}

void register_cuda_projection() {
  train::BackendProjector p;
  p.spec = [](const BackendArgs& args) -> const train::ModelSpec& {
    return dynamic_cast<const CudaArgs&>(args).model;
  };
  p.layout = [](const BackendArgs& args) {
    const auto& a = dynamic_cast<const CudaArgs&>(args);
    train::ProjectionLayout l = train::batch_layout(a.train, a.model.seq_length);
    const parallel::DpSharding sharding = a.train.model_parallel.sharding;
    l.zero1 = a.use_distributed_optimizer && l.gpus > 1 && !parallel::shards_gradients(sharding);
    l.grad_reduce_in_bf16 = a.grad_reduce_in_bf16;
    l.overlap_grad_reduce = a.overlap_grad_reduce;
    l.recompute = a.params.find_path("recompute_granularity")->as_string();
    l.recompute_layers = a.recompute_layers;
    l.fp8 = a.fp8;
    return l;
  };
  p.memory = [](const BackendArgs& args, const patches::HookTable& hooks, const train::ProjectionLayout& l,
                const train::MemoryProjectionOptions& o) {
    int devices = 0;
    const bool gpu = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
    if (!gpu) (void)cudaGetLastError();
    return project_cuda_memory(dynamic_cast<const CudaArgs&>(args), CudaOps::from(hooks), l, gpu, o.runtime_gib);
  };
  p.mesh_memory = true;
  p.cost.act_bytes = 2;
  // AdamW 28 + the bf16 copy 2, the grad norm 4; zero_grad clears only the few tensors whose first
  // gradient GEMM accumulates (plan_grad_clearing), left out.
  p.cost.optimizer_bytes_per_param = 34;
  p.cost_of = [cost = p.cost](const BackendArgs& args) { return cuda_step_cost(dynamic_cast<const CudaArgs&>(args), cost); };
  p.local_device = [](std::string* name, double* bytes) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      (void)cudaGetLastError();
      return false;
    }
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return false;
    *name = prop.name;
    *bytes = double(prop.totalGlobalMem);
    return true;
  };
  train::register_backend_projector(kName, std::move(p));
}

}  // namespace primus::backends::cuda
