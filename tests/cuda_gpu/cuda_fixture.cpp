#include "cuda_fixture.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>
#include <stdexcept>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>

#include "backends/cuda/hooks.h"
#include "backends/cuda/model.h"
#include "backends/reference/model.h"
#include "core/util/fs.h"
#include "io/hf_export.h"
#include "io/safetensors.h"
#include "train/param_layout.h"
#include "train/checkpointing.h"
#include "train/moe_stats.h"
#include "turbo/kernels/cpu/optimizer.h"
#include "turbo/kernels/cpu/reduce.h"

namespace primus::backends::cuda::testing {

train::ModelSpec tiny_spec(bool llama) {
  train::ModelSpec m;
  m.model_type = llama ? "llama" : "gpt2";
  m.vocab_size = 256;
  m.padded_vocab_size = 256;
  m.seq_length = 64;
  m.num_layers = 2;
  m.hidden_size = 128;
  m.num_attention_heads = 2;
  m.num_query_groups = llama ? 1 : 2;
  m.ffn_hidden_size = llama ? 256 : 512;
  m.layernorm = !llama;
  m.swiglu = llama;
  m.rope = llama;
  m.rotary_base = 10000;
  m.untied = llama;
  m.bias = !llama;
  m.init_method_std = 0.02;
  return m;
}

train::ModelSpec tiny_moe_spec(bool deepseek) {
  train::ModelSpec m = tiny_spec(true);
  m.model_type = deepseek ? "deepseek_v3" : "mixtral";
  train::MoeSpec& e = m.moe;
  e.moe_layers = {!deepseek, true};  // DeepSeek style: the first layer dense
  e.aux_loss_coeff = 0.01;
  e.z_loss_coeff = 0.001;
  e.ffn_hidden_size = 64;
  if (!deepseek) {
    e.num_experts = 8, e.topk = 2;
  } else {
    e.num_experts = 16, e.topk = 4, e.shared_ffn_hidden_size = 96;
    e.sigmoid = true, e.num_groups = 4, e.group_topk = 2, e.topk_scaling_factor = 2.5, e.expert_bias = true;
  }
  return m;
}

train::ModelSpec tiny_moe_spec_128(bool deepseek) {
  train::ModelSpec m = tiny_moe_spec(deepseek);
  m.num_query_groups = 2;  // kv width 128
  m.moe.ffn_hidden_size = 128;
  if (deepseek) m.moe.shared_ffn_hidden_size = 128;
  return m;
}

train::ModelSpec tiny_qwen3_spec(bool moe) {
  train::ModelSpec m = moe ? tiny_moe_spec(false) : tiny_spec(true);
  m.model_type = moe ? "qwen3_moe" : "qwen3";
  m.num_attention_heads = 4;
  m.num_query_groups = 2;
  m.kv_channels = 64;
  m.qk_layernorm = true;
  if (moe) m.moe.moe_layers = {true, true};
  return m;
}

train::ModelSpec tiny_qwen2_spec() {
  train::ModelSpec m = tiny_spec(true);
  m.model_type = "qwen2";
  m.add_qkv_bias = true;
  return m;
}

train::ModelSpec tiny_olmoe_spec(bool moe) {
  train::ModelSpec m = tiny_qwen3_spec(moe);
  m.model_type = moe ? "olmoe" : "llama";
  m.qk_norm_whole = true;
  if (moe) m.moe.pre_softmax = true;
  return m;
}

double rel_l2(const float* got, const float* ref, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    const double d = double(got[i]) - double(ref[i]);
    num += d * d;
    den += double(ref[i]) * double(ref[i]);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

CudaOps ops_for(Attn a) {
  CudaOps o = CudaOps::defaults();
  if (a == Attn::Fallback) {
    o.attention_forward = fallback_attention_forward;
    o.attention_backward = fallback_attention_backward;
  }
  return o;
}

CudaModelOptions options(const train::ModelSpec& spec, int64_t B, turbo::Device device) {
  CudaModelOptions mo;
  mo.max_batch = B;
  mo.max_seq = spec.seq_length;
  mo.device = device;
  mo.attention_scratch_bytes = fallback_attention_scratch_bytes(B, spec.seq_length, spec.num_attention_heads,
                                                                spec.num_query_groups, spec.head_dim(), 4);
  return mo;
}

namespace {
// lr 1e-3: at 2e-3 the tiny GPT-2's curve (train/param_init's weights, seed 1234) has loss spikes
// (step 10: 3.44 -> 5.00, step 17) in the fp64 reference itself, so bf16 runs fall on either side
// of them and a curve comparison measures chaos, not the kernels. At 1e-3 the reference is smooth.
constexpr double kLr = 1e-3, kBeta1 = 0.9, kBeta2 = 0.99, kEps = 1e-8, kDecay = 0.1, kClip = 1.0;
}  // namespace

Batches::Batches(int64_t T, int steps) {
  // The sources may sit elsewhere than at build time (the GPU machine): $PRIMUS_SOURCE_DIR wins.
  const char* env = std::getenv("PRIMUS_SOURCE_DIR");
  const std::string path = std::string(env && *env ? env : PRIMUS_SOURCE_DIR) + "/examples/data/tinyshakespeare.txt";
  std::ifstream f(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (text.size() < 100000) throw std::runtime_error(path + " is missing or short (set PRIMUS_SOURCE_DIR)");
  std::mt19937_64 rng(42);
  std::uniform_int_distribution<size_t> off(0, text.size() - size_t(T) - 2);
  for (int s = 0; s < steps; ++s) {
    std::vector<int32_t> in(kTrainBatch * T), tg(kTrainBatch * T);
    for (int64_t b = 0; b < kTrainBatch; ++b) {
      const size_t o = off(rng);
      for (int64_t t = 0; t < T; ++t) {
        in[b * T + t] = static_cast<unsigned char>(text[o + t]);
        tg[b * T + t] = static_cast<unsigned char>(text[o + t + 1]);
      }
    }
    inputs.push_back(std::move(in));
    targets.push_back(std::move(tg));
  }
}

std::vector<float> initial_params(const train::ModelSpec& spec) {
  reference::GptModel<float> m(spec, 1, spec.seq_length);
  m.init_weights(1234);
  for (auto& w : m.params) w = round_bf16(w);
  return m.params;
}

namespace {

const std::vector<double>& reference_curve(const train::ModelSpec& spec, int steps) {
  static std::map<std::pair<std::string, int>, std::vector<double>> cache;
  const std::string key = train::spec_json(spec).dump();
  auto it = cache.find({key, steps});
  if (it != cache.end()) return it->second;
  const int64_t T = spec.seq_length;
  Batches data(T, steps);
  reference::GptModel<float> ref(spec, kTrainBatch, T);
  ref.params = initial_params(spec);
  std::vector<float> m(ref.params.size(), 0.0f), v(ref.params.size(), 0.0f);
  std::vector<double> curve;
  for (int s = 0; s < steps; ++s) {
    ref.zero_grad();
    curve.push_back(
        ref.forward(data.inputs[s].data(), data.targets[s].data(), kTrainBatch, T, 1.0 / double(kTrainBatch * T)));
    ref.backward();
    const double norm = std::sqrt(turbo::cpu::sum_squares(ref.grads.data(), int64_t(ref.grads.size())));
    turbo::cpu::AdamWParams hp;
    hp.lr = kLr, hp.beta1 = kBeta1, hp.beta2 = kBeta2, hp.eps = kEps, hp.step = s + 1;
    hp.grad_scale = turbo::cpu::clip_scale(norm, kClip);
    for (const auto& t : ref.layout().tensors) {
      hp.weight_decay = t.decay ? kDecay : 0.0;
      turbo::cpu::adamw_update(ref.params.data() + t.offset, ref.grads.data() + t.offset, m.data() + t.offset,
                               v.data() + t.offset, t.numel, hp);
    }
  }
  return cache[{key, steps}] = curve;
}

// Every parameter tensor of `layout` cut into its Hugging Face tensors (names, layouts,
// vocabulary rows trimmed as `export hf` does), from the flat buffer `flat`.
std::map<std::string, io::TensorBlob> hf_tensors(const train::ModelSpec& spec, const train::ParamLayout& layout,
                                                 const float* flat) {
  std::map<std::string, io::TensorBlob> out;
  for (const auto& t : layout.tensors) {
    const bool vocab = t.name == "embedding.weight" || t.name == "output_layer.weight";
    for (const auto& part : t.hf) {
      std::vector<float> buf;
      auto shape = train::to_hf(t, part, flat, buf, vocab ? spec.vocab_size : 0);
      out.emplace(part.name, io::TensorBlob::from_vector(shape, std::move(buf)));
    }
  }
  return out;
}

void write_tensors(const std::filesystem::path& path, const std::map<std::string, io::TensorBlob>& tensors) {
  io::SafetensorsWriter w;
  w.set_metadata("format", "pt");
  for (const auto& [name, blob] : tensors) w.add(name, blob);
  w.write(path);
}

struct DumpInputs {
  const train::ModelSpec& spec;
  const train::ParamLayout& layout;
  Attn attn;
  turbo::Device device;
  unsigned seed;
  int64_t B, T;
  const std::vector<int32_t>& tokens;
  const std::vector<int32_t>& targets;
  const float* params;
  const float* ref_grads;
  const float* our_grads;
};

std::string write_parity_dump(const std::string& root, const DumpInputs& in, const Step0& r) {
  namespace fsys = std::filesystem;
  const fsys::path dir = fsys::path(root) / fmt::format("{}-{}-{}-seed{}", in.spec.model_type,
                                                          in.attn == Attn::Default ? "default" : "fallback",
                                                          in.device == turbo::Device::CPU ? "host" : "cuda", in.seed);
  fsys::create_directories(dir / "hf");
  io::HfExportOptions opts;
  opts.dtype = io::DType::F32;  // the values are bf16-representable: fp32 holds them exactly
  auto config = nlohmann::json::parse(train::hf_config_json(in.spec, 0));
  config["torch_dtype"] = "float32";
  io::export_hf(dir / "hf", config, hf_tensors(in.spec, in.layout, in.params), opts);
  write_tensors(dir / "grads_ref.safetensors", hf_tensors(in.spec, in.layout, in.ref_grads));
  write_tensors(dir / "grads_ours.safetensors", hf_tensors(in.spec, in.layout, in.our_grads));
  std::map<std::string, io::TensorBlob> batch;
  batch.emplace("tokens", io::TensorBlob::from_vector(std::vector<int64_t>{in.B, in.T}, in.tokens));
  batch.emplace("targets", io::TensorBlob::from_vector(std::vector<int64_t>{in.B, in.T}, in.targets));
  write_tensors(dir / "batch.safetensors", batch);

  nlohmann::json tensors = nlohmann::json::array();
  size_t next = 0;  // r.errors: the trainable tensors, in layout order
  for (const auto& t : in.layout.tensors) {
    if (!t.trainable) continue;
    if (r.errors.at(next).first != t.name) throw std::logic_error("parity dump: errors not in layout order");
    nlohmann::json parts = nlohmann::json::array();
    for (const auto& part : t.hf) parts.push_back(part.name);
    tensors.push_back({{"name", t.name}, {"hf", parts}, {"rel_l2", r.errors.at(next++).second}});
  }
  nlohmann::json j = {{"model", in.spec.model_type},
                      {"attention", in.attn == Attn::Default ? "default" : "fallback"},
                      {"attention_impl", attn_name(in.attn)},
                      {"device", in.device == turbo::Device::CPU ? "host" : "cuda"},
                      {"compute", in.device == turbo::Device::CPU ? "fp32" : "bf16"},
                      {"seed", in.seed},
                      {"batch", in.B},
                      {"seq", in.T},
                      {"vocab_size", in.spec.vocab_size},
                      {"tied_embeddings", !in.spec.untied},
                      {"loss", r.loss},
                      {"ref_loss", r.ref_loss},
                      {"loss_definition", "mean cross-entropy over the B*T (tokens[b,t] -> targets[b,t]) pairs"},
                      {"tensors", tensors}};
  fs::atomic_write_file(dir / "parity.json", j.dump(2) + "\n");
  return dir.string();
}

}  // namespace

std::string parity_dump_root() {
  const char* env = std::getenv("PRIMUS_PARITY_DUMP");
  return env && *env ? std::string(env) : std::string();
}

Step0 step0_parity(bool llama, Attn attn, turbo::Device device, unsigned seed, const std::string& dump_root) {
  return step0_parity(tiny_spec(llama), attn, device, seed, dump_root);
}

Step0 step0_parity(train::ModelSpec spec, Attn attn, turbo::Device device, unsigned seed, const std::string& dump_root) {
  spec.init_method_std = 0.1;  // enough signal through attention for the q/k gradients
  const int64_t B = 4, T = spec.seq_length;
  std::mt19937 rng(seed);
  reference::GptModel<float> ref(spec, B, T);
  ref.init_weights(seed);
  std::normal_distribution<float> jitter(0.0f, 0.1f);
  for (const auto& t : ref.layout().tensors) {
    const bool generic = t.name.find("norm") != std::string::npos || t.name.find("bias") != std::string::npos;
    for (int64_t i = 0; i < t.numel; ++i) {
      float& w = ref.params[t.offset + i];
      if (generic) w += jitter(rng);
      w = round_bf16(w);
    }
  }
  std::vector<int32_t> tokens(B * T), targets(B * T);
  std::uniform_int_distribution<int32_t> tok(0, int32_t(spec.vocab_size) - 1);
  for (auto& x : tokens) x = tok(rng);
  for (auto& x : targets) x = tok(rng);
  const double dloss = 1.0 / double(B * T);
  ref.zero_grad();
  Step0 r;
  r.ref_loss = ref.forward(tokens.data(), targets.data(), B, T, dloss);
  ref.backward();
  train::MoeStepStats theirs(spec);
  for (int64_t l = 0; l < spec.num_layers; ++l)
    if (const auto* m = ref.moe_layer(l)) theirs.add(l, m->stats().counts.data(), m->stats().dropped, 0, 0);
  r.ref_expert_load = theirs.load();

  CudaModel model(spec, options(spec, B, device), ops_for(attn));
  EXPECT_EQ(model.layout().total, ref.layout().total);
  model.set_params(ref.params.data());
  model.zero_grad();
  model.forward(tokens.data(), targets.data(), B, T, static_cast<float>(dloss), 0);
  model.backward();
  r.loss = model.read_loss_sum(1);
  // MoE: our routing against the reference's; on a difference, the reference again on ours.
  const int64_t N = B * T, K = spec.moe.topk, E = spec.moe.num_experts;
  bool rerouted = false;
  std::vector<std::vector<int32_t>> ours_idx(static_cast<size_t>(spec.num_layers));
  // A token rerouted in one layer reaches the next with a different input, and through attention
  // so do the tokens after it in its sequence: only the first MoE layer's inputs differ by bf16
  // arithmetic alone, so the gap and the count that bound rounding are taken there.
  bool first_moe = true;
  for (int64_t l = 0; l < spec.num_layers; ++l) {
    auto* m = ref.moe_layer(l);
    if (!m) continue;
    ours_idx[l] = model.read_moe_topk(l, N);
    const std::vector<int32_t>& mine = m->topk_idx();
    for (int64_t n = 0; n < N; ++n) {
      std::vector<int32_t> a(ours_idx[l].begin() + n * K, ours_idx[l].begin() + (n + 1) * K);
      std::vector<int32_t> b(mine.begin() + n * K, mine.begin() + (n + 1) * K);
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      if (a == b) continue;
      ++r.rerouted_tokens;
      rerouted = true;
      if (!first_moe) continue;
      ++r.rerouted_first_layer;
      // The gap, in the reference's own selection scores (logits, or sigmoid scores, plus the
      // expert bias), between its weakest choice and our choice it left out.
      const float* lg = m->logits().data() + n * E;
      const train::ParamTensor* bt = ref.layout().find(fmt::format("layers.{}.moe.router.expert_bias", l));
      auto sel = [&](int32_t e) {
        const double v = spec.moe.sigmoid ? 1.0 / (1.0 + std::exp(-double(lg[e]))) : double(lg[e]);
        return v + (bt ? double(ref.params[bt->offset + e]) : 0.0);
      };
      double weakest = INFINITY, missed = -INFINITY;
      for (int32_t e : b) weakest = std::min(weakest, sel(e));
      for (int32_t e : a)
        if (!std::binary_search(b.begin(), b.end(), e)) missed = std::max(missed, sel(e));
      // Group-limited routing decides the groups first (by the sum of each group's top
      // topk / group_topk scores): where the chosen groups differ, the near-tie was between groups,
      // and the experts that swapped may lie far apart in their own scores.
      if (spec.moe.num_groups > 1) {
        const int64_t G = spec.moe.num_groups, per = E / G, take = K / spec.moe.group_topk;
        std::vector<double> group(static_cast<size_t>(G));
        for (int64_t g = 0; g < G; ++g) {
          std::vector<double> v;
          for (int64_t e = g * per; e < (g + 1) * per; ++e) v.push_back(sel(static_cast<int32_t>(e)));
          std::sort(v.rbegin(), v.rend());
          group[g] = std::accumulate(v.begin(), v.begin() + take, 0.0);
        }
        std::set<int64_t> ga, gb;
        for (int32_t e : a) ga.insert(e / per);
        for (int32_t e : b) gb.insert(e / per);
        if (ga != gb) {
          weakest = INFINITY, missed = -INFINITY;
          for (int64_t g : gb) weakest = std::min(weakest, group[g]);
          for (int64_t g : ga)
            if (!gb.count(g)) missed = std::max(missed, group[g]);
        }
      }
      r.max_gap = std::max(r.max_gap, weakest - missed);
    }
    first_moe = false;
  }
  if (rerouted) {
    for (int64_t l = 0; l < spec.num_layers; ++l)
      if (auto* m = ref.moe_layer(l)) m->force_routing(&ours_idx[l]);
    ref.zero_grad();
    r.ref_loss = ref.forward(tokens.data(), targets.data(), B, T, dloss);
    ref.backward();
  }
  const auto losses_of = [](const train::MoeStepStats& s) {
    train::StepStats st;
    s.report(st);
    std::vector<std::pair<std::string, double>> out;
    for (const auto& d : st.details)
      if (d.first.find("_loss") != std::string::npos) out.push_back(d);
    return out;
  };
  train::MoeStepStats ref_losses(spec);
  for (int64_t l = 0; l < spec.num_layers; ++l)
    if (const auto* m = ref.moe_layer(l))
      ref_losses.add(l, m->stats().counts.data(), m->stats().dropped, m->stats().aux, m->stats().z);
  r.ref_moe_losses = losses_of(ref_losses);
  std::vector<float> grads(static_cast<size_t>(model.layout().total));
  model.get_grads(grads.data());
  for (const auto& t : model.layout().tensors) {
    if (!t.trainable) continue;  // a buffer (the expert bias): no gradient on either side
    r.errors.push_back({t.name, rel_l2(grads.data() + t.offset, ref.grads.data() + t.offset, t.numel)});
  }
  // Our slots per expert, from the step status (the path the trainer reports them by).
  CudaModel::StepStatus st = model.read_step_status(1);
  train::MoeStepStats ours(spec);
  model.moe_report(st, 1, ours);
  r.expert_load = ours.load();
  r.moe_losses = losses_of(ours);
  if (!dump_root.empty()) {
    r.dump_dir = write_parity_dump(dump_root,
                                   DumpInputs{spec, model.layout(), attn, device, seed, B, T, tokens, targets,
                                              ref.params.data(), ref.grads.data(), grads.data()},
                                   r);
  }
  model.forward(tokens.data(), targets.data(), B, T, 0.0f, 0);
  r.eval_loss = model.read_loss_sum(1);
  std::vector<float> again(grads.size());
  model.get_grads(again.data());
  r.eval_kept_grads = again == grads;
  return r;
}

turbo::Fp8Recipe fp8_test_recipe(const char* format, const char* scaling, const Fp8TestState& state) {
  turbo::Fp8Recipe r = turbo::parse_fp8_recipe(format, scaling, "test", "fp8_recipe");
  if (r.scaling == turbo::Fp8Scaling::Delayed) r.delayed = std::make_shared<turbo::Fp8DelayedScaling>(state.delayed);
  if (state.saved) r.saved = std::make_shared<turbo::Fp8SavedInputs>(r.act_granularity());
  if (state.weights) r.weights = std::make_shared<turbo::Fp8WeightCache>(r.weight_granularity());
  if (state.maxima && r.takes_maxima()) r.maxima = std::make_shared<turbo::Fp8Maxima>(r.act_granularity());
  if (state.producers && r.scaling == turbo::Fp8Scaling::Delayed) r.producers = std::make_shared<turbo::Fp8Producers>();
  return r;
}

void use_fp8_recipe(const train::ModelSpec& spec, const turbo::Fp8Recipe& r, CudaOps& ops, CudaModelOptions& mo) {
  use_fp8_linear(ops, r);
  mo.fp8_linear = true;
  mo.fp8_multiple = turbo::linear_fp8_multiple(r);  // as model_options_for: blockwise 128
  mo.fp8_delayed = r.delayed;  // fp8_recipe delayed: the model holds the histories the slots read
  mo.fp8_saved = r.saved;      // inputs saved in FP8 for the backward (null: kept in bf16)
  mo.fp8_weights = r.weights;  // weights quantized once per step (with accumulation only)
  mo.fp8_maxima = r.maxima;    // rowwise, tensorwise: the SwiGLU kernels' maxima for the next quantization
  mo.fp8_producers = r.producers;  // delayed: the SwiGLU folded into the quantizers that read its output
  if (spec.moe.enabled()) {    // the experts too (patch cuda.moe.fp8: rowwise and blockwise)
    use_fp8_moe(ops, r);
    mo.fp8_moe = true;
  }
}

std::pair<std::vector<double>, std::vector<double>> training_curves(bool llama, Attn attn, turbo::Device device,
                                                                    int steps, const turbo::Fp8Recipe* fp8,
                                                                    const std::function<void(CudaModel&)>& at_end) {
  return training_curves(tiny_spec(llama), attn, device, steps, fp8, at_end);
}

std::pair<std::vector<double>, std::vector<double>> training_curves(const train::ModelSpec& spec, Attn attn,
                                                                    turbo::Device device, int steps,
                                                                    const turbo::Fp8Recipe* fp8,
                                                                    const std::function<void(CudaModel&)>& at_end) {
  const int64_t T = spec.seq_length;
  const std::vector<double>& ref = reference_curve(spec, steps);
  Batches data(T, steps);
  CudaOps ops = ops_for(attn);
  CudaModelOptions mo = options(spec, kTrainBatch, device);
  if (fp8) use_fp8_recipe(spec, *fp8, ops, mo);
  CudaModel model(spec, mo, ops);
  const std::vector<float> init = initial_params(spec);
  model.set_params(init.data());
  const std::vector<double> curve = train_reference_steps(model, data, steps);
  if (at_end) at_end(model);
  return {curve, ref};
}

std::vector<double> train_reference_steps(CudaModel& model, Batches& data, int64_t steps) {
  const int64_t T = model.spec().seq_length;
  std::vector<double> curve;
  for (int64_t s = 0; s < steps; ++s) {
    model.zero_grad();
    model.forward(data.inputs[s].data(), data.targets[s].data(), kTrainBatch, T, 1.0f / float(kTrainBatch * T), 0);
    model.backward();
    model.grad_norm(static_cast<float>(kClip));
    curve.push_back(model.read_loss_sum(1));
    turbo::AdamWHyper hp;
    hp.lr = float(kLr), hp.beta1 = float(kBeta1), hp.beta2 = float(kBeta2), hp.eps = float(kEps);
    hp.weight_decay = float(kDecay);
    hp.step = s + 1;
    model.update(hp);
  }
  return curve;
}

}  // namespace primus::backends::cuda::testing
