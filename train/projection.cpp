#include "train/projection.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <mutex>

#include "core/util/error.h"
#include "parallel/parallel_dims.h"

namespace primus::train {

ProjectionLayout batch_layout(const TrainingArgs& t, int64_t seq_length) {
  ProjectionLayout l;
  l.gpus = t.data_parallel_size;
  l.tp = t.model_parallel[parallel::Dim::TP];
  l.cp = t.model_parallel[parallel::Dim::CP];
  l.ep = t.model_parallel[parallel::Dim::EP];
  l.sequence_parallel = t.model_parallel.sequence_parallel;
  l.sharding = parallel::dp_sharding_name(t.model_parallel.sharding);
  l.micro_batch = t.micro_batch_size;
  l.global_batch = t.global_batch_size;
  l.grad_accum = t.grad_accum_steps;
  l.seq_length = seq_length;
  return l;
}

using nlohmann::json;

// ---- memory ------------------------------------------------------------------------------

double MemoryProjection::total() const {
  double t = 0;
  for (const MemoryPart& p : parts) t += p.bytes;
  return t;
}

double MemoryProjection::bytes(const std::string& name) const {
  double t = 0;
  for (const MemoryPart& p : parts)
    if (p.name == name) t += p.bytes;
  return t;
}

void MemoryProjection::add(const std::string& name, const std::string& detail, double b) {
  if (b > 0) parts.push_back({name, detail, b});
}

namespace {
std::mutex& projection_projector_mutex() {
  static std::mutex m;
  return m;
}
std::map<std::string, BackendProjector>& projection_projectors() {
  static std::map<std::string, BackendProjector> p;
  return p;
}
}  // namespace

void register_backend_projector(const std::string& backend, BackendProjector fn) {
  std::lock_guard<std::mutex> lock(projection_projector_mutex());
  projection_projectors()[backend] = std::move(fn);
}

const BackendProjector* find_backend_projector(const std::string& backend) {
  std::lock_guard<std::mutex> lock(projection_projector_mutex());
  auto it = projection_projectors().find(backend);
  return it == projection_projectors().end() ? nullptr : &it->second;
}

// ---- step time ---------------------------------------------------------------------------

namespace {

// FLOPs and bytes of one token through the model, forward + backward, split by the part of the
// step that runs them. Recomputation adds the forward of what the policy drops.
struct ProjectionTokenCost {
  double gemm_params = 0;      // dense matmul parameters a token goes through (x 6 FLOPs)
  double grouped_params = 0;   // routed expert parameters a token goes through (top-k of them)
  double recompute_gemm = 0;   // extra forward matmul parameters (x 2 FLOPs)
  double recompute_grouped = 0;
  double attention_flops = 0;  // causal attention, forward + backward (+ recomputed forward)
  double elementwise_elems = 0;  // activation elements read + written by memory-bound kernels
};

int projection_recompute_level(const std::string& r) {
  if (r == "none") return 0;
  if (r == "norms") return 1;
  if (r == "selective") return 2;
  if (r == "full") return 3;
  throw ConfigError(fmt::format("projection: recompute_granularity '{}' is not one of none, norms, selective, full", r));
}

ProjectionTokenCost projection_token_cost(const ModelSpec& s, const ProjectionLayout& lay) {
  ProjectionTokenCost c;
  const double C = double(s.hidden_size), T = double(lay.seq_length), KVD = double(s.kv_dim());
  const double V = double(s.padded_vocab_size);
  const int every_level = projection_recompute_level(lay.recompute);
  // Causal attention as `primus benchmark` counts it: forward 2*T*C per token (half the square),
  // the backward 2.5x the forward (five matmuls against two).
  const double QD = double(s.q_dim());  // attention runs over heads x head dim (== C unless kv_channels is set)
  const double att_fwd = 2.0 * T * QD;
  c.gemm_params += C * V;  // LM head
  for (int64_t l = 0; l < s.num_layers; ++l) {
    const int level = lay.recompute_layers < 0 || l < lay.recompute_layers ? every_level : 0;
    const double attn = C * double(s.qkv_dim()) + QD * C;
    c.gemm_params += attn;
    c.attention_flops += 3.5 * att_fwd;
    // Norms: forward reads x (and the residual), writes y (and the sum); backward reads dy, x,
    // writes dx and accumulates the residual gradient: about 9 C elements per norm.
    double elems = 2 * 9 * C;
    if (s.rope) elems += 4 * (QD + KVD);  // rotate q|k forward, rotate dq|dk back
    if (s.qk_layernorm) elems += 9 * (QD + KVD);  // per-head norms of q and k, as a norm above
    // Whole-width q|k norms (OLMoE) run on dense copies: q|k out and back in the forward, dq|dk
    // out and the input gradient back in the backward.
    if (s.qk_norm_whole) elems += 6 * (QD + KVD);
    if (s.add_qkv_bias && !s.bias) elems += double(s.qkv_dim());  // the qkv bias gradient's column sums
    double mlp_recompute = 0, grouped_recompute = 0;
    if (s.is_moe_layer(l)) {
      const MoeSpec& e = s.moe;
      const double K = double(e.topk), F = double(e.ffn_hidden_size), Fs = double(e.shared_ffn_hidden_size);
      c.gemm_params += C * double(e.num_experts) + 3 * Fs * C;  // router, shared expert
      c.grouped_params += K * 3 * F * C;
      // permute/unpermute (gather C per slot both ways, forward and backward), SwiGLU on the
      // slots (2F in, F out; backward 3F in, 2F out), router softmax/top-k (small)
      elems += K * (4 * C + 3 * F + 5 * F) + (Fs > 0 ? 8 * Fs : 0) + 4 * double(e.num_experts);
      if (level >= 3) grouped_recompute = K * 3 * F * C, mlp_recompute += 3 * Fs * C;
      if (level >= 2) elems += K * (C + 3 * F);  // the gather and SwiGLU forward again
    } else {
      const double FC = double(s.fc_dim()), F = double(s.ffn_hidden_size);
      c.gemm_params += C * FC + F * C;
      elems += (FC + F) + (FC + F + FC);  // activation forward; backward reads pre-act and dact, writes dpre
      if (level >= 3) mlp_recompute = C * FC + F * C;
      else if (level >= 2) mlp_recompute = C * FC;  // the MLP pre-activation
      if (level >= 2) elems += FC + F;
    }
    if (level >= 3) c.recompute_gemm += attn + mlp_recompute, c.attention_flops += att_fwd;
    else if (level >= 2) c.recompute_gemm += C * double(s.qkv_dim()) + mlp_recompute, c.attention_flops += att_fwd;
    c.recompute_grouped += grouped_recompute;
    if (level >= 1) elems += 2 * 2 * C;  // the two norms' outputs again
    c.elementwise_elems += elems;
  }
  // Final norm, embedding gather/scatter, and the loss over the vocabulary (read logits, write
  // dlogits, in head blocks).
  c.elementwise_elems += 9 * C + 4 * C + 3 * V;
  return c;
}

}  // namespace

TimeProjection project_step_time(const ModelSpec& s, const ProjectionLayout& lay, const DeviceRates& r,
                                 const StepCostOptions& opt) {
  {
    std::string missing;
    for (const auto& [rate, family] : {std::pair{r.gemm_tflops, "gemm"}, {r.attention_tflops, "attention"},
                                       {r.memory_gbs, "norm activation loss"}, {r.optimizer_gbs, "optimizer"}})
      if (rate <= 0) missing += std::string(missing.empty() ? "" : " ") + family;
    if (!missing.empty())
      throw ConfigError(fmt::format("projection: the rates of '{}' have nothing measured for: {} (run `primus benchmark "
                                    "{} --cache` on that device, or state a roofline: --peak-tflops, --hbm-gbps)",
                                    r.device, missing, missing));
  }
  TimeProjection t;
  t.rates_source = r.source;
  t.rates = r;
  const ProjectionTokenCost c = projection_token_cost(s, lay);
  const double n = double(lay.micro_batch) * double(lay.grad_accum) * double(lay.seq_length);  // this rank's tokens
  auto flop_part = [&](const std::string& name, const std::string& detail, double flops, double tflops) {
    if (flops <= 0) return;
    t.parts.push_back({name, detail, flops, "flop", tflops, flops / (tflops * 1e12)});
  };
  auto byte_part = [&](const std::string& name, const std::string& detail, double bytes, double gbs) {
    if (bytes <= 0) return;
    t.parts.push_back({name, detail, bytes, "byte", gbs, bytes / (gbs * 1e9)});
  };
  flop_part("gemm", "dense GEMMs (linear layers, router, LM head): forward, dgrad, wgrad" +
                        std::string(c.recompute_gemm > 0 ? " + recomputed forward" : ""),
            n * (6 * c.gemm_params + 2 * c.recompute_gemm), r.gemm_tflops);
  if (c.grouped_params > 0) {
    const double rate = r.grouped_gemm_tflops > 0 ? r.grouped_gemm_tflops : r.gemm_tflops;
    if (r.grouped_gemm_tflops <= 0) t.notes.push_back("no grouped-GEMM rate: the MoE experts use the dense GEMM rate");
    flop_part("grouped_gemm", "MoE expert grouped GEMMs (top-k experts per token)",
              n * (6 * c.grouped_params + 2 * c.recompute_grouped), rate);
  }
  flop_part("attention", "causal attention forward + backward", n * c.attention_flops, r.attention_tflops);
  byte_part("elementwise", "norms, activations, RoPE, residuals, embedding, loss (memory-bound)",
            n * c.elementwise_elems * opt.act_bytes, r.memory_gbs);
  const double P = double(s.num_parameters());
  const double P_rank = lay.zero1 && lay.gpus > 1 ? P / double(lay.gpus) : P;
  byte_part("optimizer",
            fmt::format("AdamW and the grad norm over {} parameters, {:.0f} bytes each", lay.zero1 && lay.gpus > 1
                        ? fmt::format("this rank's 1/{} shard of the", lay.gpus) : std::string("all"),
                        opt.optimizer_bytes_per_param),
            P_rank * opt.optimizer_bytes_per_param, r.optimizer_gbs);
  double compute = 0, forward_backward = 0;
  for (const TimePart& p : t.parts) {
    compute += p.seconds;
    if (p.name != "optimizer") forward_backward += p.seconds;
  }
  double exposed = 0;
  if (lay.gpus > 1) {
    if (r.net_gbs <= 0)
      throw ConfigError(fmt::format("projection performance: {} data-parallel GPUs need the collectives' bandwidth: "
                                    "--net-gbps GBPS (bus bandwidth, as NCCL-tests report it) or --preflight FILE "
                                    "(`primus preflight --json FILE`)",
                                    lay.gpus));
    const double W = double(lay.gpus), gb = lay.grad_reduce_in_bf16 ? 2.0 : 4.0;
    // NCCL-tests' bus bandwidth: an all-reduce of S bytes takes S * 2(W-1)/W / busbw; a
    // reduce-scatter or all-gather half of that.
    const double ring = (W - 1) / W;
    double reduce = 0, gather = 0;
    if (lay.zero1) {
      reduce = P * gb * ring / (r.net_gbs * 1e9);
      gather = P * opt.weight_bytes * ring / (r.net_gbs * 1e9);  // the updated compute weights
      t.parts.push_back({"comm", fmt::format("ZeRO-1: reduce-scatter of {} gradients over {} GPUs",
                                             gb == 2 ? "bf16" : "fp32", lay.gpus),
                         P * gb * ring, "byte", r.net_gbs, reduce});
      t.parts.push_back({"comm", fmt::format("ZeRO-1: all-gather of the updated {} weights", opt.weight_bytes == 2 ? "bf16" : "fp32"),
                         P * opt.weight_bytes * ring, "byte", r.net_gbs, gather});
    } else {
      reduce = P * gb * 2 * ring / (r.net_gbs * 1e9);
      t.parts.push_back({"comm", fmt::format("all-reduce of {} gradients over {} GPUs", gb == 2 ? "bf16" : "fp32",
                                             lay.gpus),
                         P * gb * 2 * ring, "byte", r.net_gbs, reduce});
    }
    if (lay.overlap_grad_reduce) {
      // The buckets launch while the last micro-batch's backward runs (about 2/3 of its compute);
      // only what outlasts it shows. The ZeRO-1 all-gather follows the optimizer, exposed.
      const double last_backward = forward_backward / double(lay.grad_accum) * (2.0 / 3.0);
      exposed = std::max(0.0, reduce - last_backward) + gather;
      t.comm_overlapped = true;
    } else {
      exposed = reduce + gather;
    }
  }
  if (lay.fp8 != "none") {
    t.notes.push_back(fmt::format("fp8 {}: the linear layers' GEMMs are timed at the bf16 GEMM rate and the "
                                  "quantization passes are not counted (measured on Llama-3.2-1B: 18% more tokens/s "
                                  "than bf16, GPT-2 124M: 11% fewer; docs/cuda.md \"FP8\")",
                                  lay.fp8));
  }
  t.step_seconds = compute + exposed;
  t.tokens_per_second = double(lay.tokens_per_step()) / t.step_seconds;
  if (r.peak_tflops > 0) t.mfu = s.flops_per_token() * n / t.step_seconds / (r.peak_tflops * 1e12);
  return t;
}

// ---- JSON --------------------------------------------------------------------------------

namespace {

json projection_layout_json(const ProjectionLayout& l) {
  return {{"gpus", l.gpus},
          {"tensor_model_parallel_size", l.tp},
          {"context_parallel_size", l.cp},
          {"expert_model_parallel_size", l.ep},
          {"sequence_parallel", l.sequence_parallel},
          {"data_parallel_sharding_strategy", l.sharding},
          {"micro_batch_size", l.micro_batch},
          {"global_batch_size", l.global_batch},
          {"grad_accum_steps", l.grad_accum},
          {"seq_length", l.seq_length},
          {"use_distributed_optimizer", l.zero1},
          {"grad_reduce_in_bf16", l.grad_reduce_in_bf16},
          {"overlap_grad_reduce", l.overlap_grad_reduce},
          {"recompute_granularity", l.recompute},
          {"fp8", l.fp8}};
}

template <class T>
T projection_field(const json& j, const char* key, const char* where) {
  if (!j.contains(key)) throw ConfigError(fmt::format("projection JSON: {} has no '{}'", where, key));
  return j.at(key).get<T>();
}

std::vector<std::string> projection_strings(const json& j, const char* key) {
  std::vector<std::string> v;
  if (j.contains(key))
    for (const json& s : j[key]) v.push_back(s.get<std::string>());
  return v;
}

}  // namespace

json projection_to_json(const Projection& p) {
  json j = {{"config", p.config},
            {"backend", p.backend},
            {"model", p.model},
            {"parameters", p.parameters},
            {"active_parameters", p.active_parameters},
            {"layout", projection_layout_json(p.layout)},
            {"device_memory_bytes", p.device_memory_bytes}};
  if (p.has_memory) {
    json parts = json::array();
    for (const MemoryPart& m : p.memory.parts) parts.push_back({{"name", m.name}, {"detail", m.detail}, {"bytes", m.bytes}});
    j["memory"] = {{"source", p.memory.source}, {"total_bytes", p.memory.total()}, {"parts", parts},
                   {"notes", p.memory.notes}};
  }
  if (p.has_time) {
    json parts = json::array();
    for (const TimePart& t : p.time.parts) {
      parts.push_back({{"name", t.name}, {"detail", t.detail}, {"work", t.work}, {"unit", t.unit}, {"rate", t.rate},
                       {"seconds", t.seconds}});
    }
    j["time"] = {{"rates_source", p.time.rates_source}, {"rates", rates_to_json(p.time.rates)}, {"parts", parts}, {"comm_overlapped", p.time.comm_overlapped},
                 {"step_seconds", p.time.step_seconds}, {"tokens_per_second", p.time.tokens_per_second},
                 {"mfu", p.time.mfu}, {"notes", p.time.notes}};
  }
  return j;
}

Projection projection_from_json(const json& j) {
  Projection p;
  p.config = projection_field<std::string>(j, "config", "the projection");
  p.backend = projection_field<std::string>(j, "backend", "the projection");
  p.model = projection_field<std::string>(j, "model", "the projection");
  p.parameters = projection_field<int64_t>(j, "parameters", "the projection");
  p.active_parameters = projection_field<int64_t>(j, "active_parameters", "the projection");
  p.device_memory_bytes = projection_field<double>(j, "device_memory_bytes", "the projection");
  const json& l = j.at("layout");
  p.layout.gpus = projection_field<int64_t>(l, "gpus", "layout");
  p.layout.tp = projection_field<int64_t>(l, "tensor_model_parallel_size", "layout");
  p.layout.cp = projection_field<int64_t>(l, "context_parallel_size", "layout");
  // Written since expert parallelism is projected; 1 in older files.
  p.layout.ep = l.contains("expert_model_parallel_size") ? projection_field<int64_t>(l, "expert_model_parallel_size", "layout") : 1;
  p.layout.sequence_parallel = projection_field<bool>(l, "sequence_parallel", "layout");
  p.layout.sharding = projection_field<std::string>(l, "data_parallel_sharding_strategy", "layout");
  p.layout.micro_batch = projection_field<int64_t>(l, "micro_batch_size", "layout");
  p.layout.global_batch = projection_field<int64_t>(l, "global_batch_size", "layout");
  p.layout.grad_accum = projection_field<int64_t>(l, "grad_accum_steps", "layout");
  p.layout.seq_length = projection_field<int64_t>(l, "seq_length", "layout");
  p.layout.zero1 = projection_field<bool>(l, "use_distributed_optimizer", "layout");
  p.layout.grad_reduce_in_bf16 = projection_field<bool>(l, "grad_reduce_in_bf16", "layout");
  p.layout.overlap_grad_reduce = projection_field<bool>(l, "overlap_grad_reduce", "layout");
  p.layout.recompute = projection_field<std::string>(l, "recompute_granularity", "layout");
  p.layout.fp8 = projection_field<std::string>(l, "fp8", "layout");
  if (j.contains("memory")) {
    p.has_memory = true;
    const json& m = j["memory"];
    p.memory.source = projection_field<std::string>(m, "source", "memory");
    for (const json& part : m.at("parts"))
      p.memory.parts.push_back({projection_field<std::string>(part, "name", "a memory part"),
                                projection_field<std::string>(part, "detail", "a memory part"),
                                projection_field<double>(part, "bytes", "a memory part")});
    p.memory.notes = projection_strings(m, "notes");
  }
  if (j.contains("time")) {
    p.has_time = true;
    const json& t = j["time"];
    p.time.rates_source = projection_field<std::string>(t, "rates_source", "time");
    p.time.rates = rates_from_json(t.at("rates"));
    for (const json& part : t.at("parts"))
      p.time.parts.push_back({projection_field<std::string>(part, "name", "a time part"),
                              projection_field<std::string>(part, "detail", "a time part"), projection_field<double>(part, "work", "a time part"),
                              projection_field<std::string>(part, "unit", "a time part"), projection_field<double>(part, "rate", "a time part"),
                              projection_field<double>(part, "seconds", "a time part")});
    p.time.comm_overlapped = projection_field<bool>(t, "comm_overlapped", "time");
    p.time.step_seconds = projection_field<double>(t, "step_seconds", "time");
    p.time.tokens_per_second = projection_field<double>(t, "tokens_per_second", "time");
    p.time.mfu = projection_field<double>(t, "mfu", "time");
    p.time.notes = projection_strings(t, "notes");
  }
  return p;
}

// ---- text --------------------------------------------------------------------------------

std::string format_bytes(double b) {
  const double gib = b / double(int64_t{1} << 30);
  if (gib >= 1.0) return fmt::format("{:.2f} GiB", gib);
  if (b >= double(1 << 20)) return fmt::format("{:.1f} MiB", b / double(1 << 20));
  return fmt::format("{:.1f} KiB", b / 1024.0);
}

std::string memory_summary_line(const MemoryProjection& m, const std::string& rank) {
  std::vector<MemoryPart> parts;  // merged by name, biggest first
  for (const MemoryPart& p : m.parts) {
    auto it = std::find_if(parts.begin(), parts.end(), [&](const MemoryPart& q) { return q.name == p.name; });
    if (it == parts.end()) parts.push_back({p.name, "", p.bytes});
    else it->bytes += p.bytes;
  }
  std::sort(parts.begin(), parts.end(), [](const MemoryPart& a, const MemoryPart& b) { return a.bytes > b.bytes; });
  std::string s = fmt::format("{} per {}", format_bytes(m.total()), rank);
  for (size_t i = 0; i < parts.size() && i < 3; ++i)
    s += fmt::format("{}{} {}", i == 0 ? ": " : ", ", parts[i].name, format_bytes(parts[i].bytes));
  return s;
}

std::string format_projection(const Projection& p) {
  const ProjectionLayout& l = p.layout;
  // The reference backend's ranks are CPU processes.
  const std::string gpu = p.backend == "reference" ? "process" : "GPU";
  std::string s = fmt::format("Projection for {} (backend {})\n  model:  {}\n", p.config, p.backend, p.model);
  const int64_t ranks = l.gpus * l.tp * l.cp;
  std::string mesh = l.tp * l.cp == 1 ? "data parallel"
                                      : fmt::format("tp {}{} x cp {} x dp {}", l.tp, l.sequence_parallel ? "+sp" : "",
                                                    l.cp, l.gpus);
  if (l.ep > 1) mesh += fmt::format(", the experts over ep {}", l.ep);
  const std::string sharded = l.sharding == "optim_grads" || l.sharding == "optim_grads_params"
                                  ? fmt::format(", {} over dp x cp = {}", l.sharding, l.gpus * l.cp)
                                  : "";
  s += fmt::format("  layout: {} {}{} ({}{}{}), micro-batch {} x {} tokens, {} accumulation step{}, global "
                   "batch {} ({} tokens/step); recompute {}, fp8 {}\n",
                   ranks, gpu, ranks == 1 ? "" : (gpu == "GPU" ? "s" : "es"), mesh, l.zero1 ? ", ZeRO-1 sharded optimizer" : "",
                   sharded,
                   l.micro_batch,
                   l.seq_length, l.grad_accum, l.grad_accum == 1 ? "" : "s", l.global_batch, l.tokens_per_step(),
                   l.recompute_layers < 0    ? l.recompute
                   : l.recompute_layers == 0 ? fmt::format("none ({} in no layer)", l.recompute)
                                             : fmt::format("{} in the first {} layers", l.recompute, l.recompute_layers),
                   l.fp8);
  if (p.has_memory) {
    s += fmt::format("\nMemory per {} ({})\n", gpu, p.memory.source);
    s += fmt::format("  {:<16} {:>12}  {}\n", "part", "size", "what");
    for (const MemoryPart& m : p.memory.parts) s += fmt::format("  {:<16} {:>12}  {}\n", m.name, format_bytes(m.bytes), m.detail);
    s += fmt::format("  {:<16} {:>12}", "total", format_bytes(p.memory.total()));
    if (p.device_memory_bytes > 0) {
      const double share = p.memory.total() / p.device_memory_bytes;
      s += fmt::format("  {:.0f}% of the device's {}{}", 100 * share, format_bytes(p.device_memory_bytes),
                       share > 1 ? ": DOES NOT FIT" : "");
    }
    s += "\n";
    for (const std::string& n : p.memory.notes) s += "  note: " + n + "\n";
  }
  if (p.has_time) {
    s += fmt::format("\nStep time per {} (rates: {})\n", gpu, p.time.rates_source);
    s += fmt::format("  {:<13} {:>12} {:>14} {:>10}  {}\n", "part", "work", "rate", "ms", "what");
    for (const TimePart& t : p.time.parts) {
      const bool fl = t.unit == "flop";
      s += fmt::format("  {:<13} {:>12} {:>14} {:>10.2f}  {}\n", t.name,
                       fl ? fmt::format("{:.2f} TF", t.work / 1e12) : fmt::format("{:.2f} GB", t.work / 1e9),
                       fmt::format("{:.4g} {}", t.rate, fl ? "TFLOP/s" : "GB/s"), t.seconds * 1e3, t.detail);
    }
    s += fmt::format("  {:<13} {:>12} {:>14} {:>10.2f}  {}\n", "step", "", "", p.time.step_seconds * 1e3,
                     p.time.comm_overlapped ? "compute + the communication the backward does not hide"
                                            : "compute + communication");
    s += fmt::format("  throughput {:.0f} tokens/s (whole job){}\n", p.time.tokens_per_second,
                     p.time.mfu > 0 ? fmt::format(", MFU {:.1f}%", 100 * p.time.mfu) : "");
    for (const std::string& n : p.time.notes) s += "  note: " + n + "\n";
  }
  return s;
}

}  // namespace primus::train
