// `primus projection` for the cuda backend without a GPU: the memory it projects is what the
// model allocates (CudaModel in host mode, every recompute policy, dense and both MoE styles),
// its parts add up to the arenas, ZeRO-1 moves the optimizer state into a 1/N shard, and through
// the binary: a layout whose batch does not divide is refused naming the keys, --json parses
// with parts that add up to its total, and the dry run prints the memory line.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>

#include "backends/cuda/projection.h"
#include "core/util/error.h"
#include "tests/cuda_gpu/cuda_fixture.h"
#include "tests/cuda_gpu/threaded_ranks.h"
#include "train/tensor_parallel.h"
#include "tests/e2e/cli_runner.h"
#include "turbo/kernels/cuda/optimizer.h"
#include "turbo/ops/muon.h"

namespace primus::backends::cuda {
namespace {

CudaArgs projection_args(const train::ModelSpec& spec, int64_t mb, int64_t accum) {
  CudaArgs a;
  a.model = spec;
  a.train.micro_batch_size = mb;
  a.train.grad_accum_steps = accum;
  a.train.global_batch_size = mb * accum;
  a.host_mode = true;
  a.attention_backend = "fallback";  // what the host tests run (the scratch then has a size of its own)
  return a;
}

train::ProjectionLayout projection_host_layout(const CudaArgs& a, int64_t gpus) {
  train::ProjectionLayout l;
  l.gpus = gpus;
  l.micro_batch = a.train.micro_batch_size;
  l.grad_accum = a.train.grad_accum_steps;
  l.global_batch = l.micro_batch * l.grad_accum * gpus;
  l.seq_length = a.model.seq_length;
  l.zero1 = a.use_distributed_optimizer && gpus > 1;
  return l;
}

// The bytes of the "weights" part of a `projection memory --json` output.
double weights_of(const std::string& out) {
  double w = 0;
  const nlohmann::json j = nlohmann::json::parse(out);
  for (const auto& part : j.at("memory").at("parts"))
    if (part["name"] == "weights") w += part["bytes"].get<double>();
  return w;
}

TEST(CudaProjection, PlannedSizesAreWhatTheModelAllocates) {
  const std::pair<const char*, train::ModelSpec> specs[] = {{"gpt2", testing::tiny_spec(false)},
                                                            {"llama", testing::tiny_spec(true)},
                                                            {"mixtral", testing::tiny_moe_spec(false)},
                                                            {"deepseek", testing::tiny_moe_spec(true)}};
  for (const auto& [name, spec] : specs) {
    size_t previous = 0;
    for (Recompute r : {Recompute::None, Recompute::Norms, Recompute::Selective, Recompute::Full}) {
      SCOPED_TRACE(std::string(name) + " recompute " + recompute_name(r));
      const CudaArgs a = projection_args(spec, 2, 3);
      CudaOps ops = testing::ops_for(testing::Attn::Fallback);
      ops.recompute_policy = [r](int64_t, int64_t) { return r; };
      const CudaModelOptions mo = model_options_for(a, 1);
      const train::ParamLayout layout = train::make_param_layout(spec);
      const MemoryPlanSizes sz = MemoryPlan::sizes(spec, layout, memory_plan_options(spec, layout, mo, ops));
      CudaModel model(spec, mo, ops);
      EXPECT_EQ(sz.total(), model.reserved_bytes());
      EXPECT_EQ(sz.acts_arena, model.activation_bytes());
      EXPECT_GT(sz.scratch_arena, 0u);  // the fallback attention's scores
      // The projection's parts are the arenas, nothing lost or counted twice (no runtime here).
      const train::MemoryProjection m = project_cuda_memory(a, ops, projection_host_layout(a, 1), false, 0.0);
      EXPECT_DOUBLE_EQ(m.total(), double(model.reserved_bytes()));
      EXPECT_DOUBLE_EQ(m.bytes("activations"), double(sz.acts_arena));
      const double flat = double((layout.total * 4 + 255) / 256 * 256);  // the arena's 256-byte rounding
      EXPECT_DOUBLE_EQ(m.bytes("gradients"), flat);
      EXPECT_DOUBLE_EQ(m.bytes("optimizer_state"), 2 * flat);
      // Each policy keeps no more than the one before (a policy's savings can be nil on a model
      // this small: one MoE layer's kept buffers are the size of the shared set).
      if (previous) {
        EXPECT_LE(sz.acts_arena, previous);
      }
      previous = sz.acts_arena;
    }
  }
}

// FP8 experts (fp8 with num_experts > 0): the plan reserves the expert GEMMs' quantized copies in
// scratch, the model allocates what the plan says, and the projection's "fp8" part is the scratch
// above the plan without FP8 (linear layers and experts both off), nothing counted twice.
TEST(CudaProjection, Fp8ExpertCopiesAreTheFp8Part) {
  train::ModelSpec spec = testing::tiny_moe_spec(false);
  spec.moe.ffn_hidden_size = 1024;  // expert weights large enough for their copies to pass the 1 MiB rounding
  CudaArgs a = projection_args(spec, 2, 1);
  a.fp8 = "hybrid";
  a.fp8_recipe = "rowwise";
  CudaOps ops = testing::ops_for(testing::Attn::Fallback);
  const CudaModelOptions mo = model_options_for(a, 1);
  ASSERT_TRUE(mo.fp8_linear && mo.fp8_moe);
  const train::ParamLayout layout = train::make_param_layout(spec);
  MemoryPlanOptions mp = memory_plan_options(spec, layout, mo, ops);
  const MemoryPlanSizes sz = MemoryPlan::sizes(spec, layout, mp);
  CudaModel model(spec, mo, ops);
  EXPECT_EQ(sz.total(), model.reserved_bytes());
  mp.fp8_linear = mp.fp8_moe = false;
  const size_t plain = MemoryPlan::sizes(spec, layout, mp).scratch_arena;
  mp.fp8_linear = true;  // the dense layers' copies alone
  const size_t dense_only = MemoryPlan::sizes(spec, layout, mp).scratch_arena;
  EXPECT_GT(sz.scratch_arena, dense_only) << "the expert copies are the largest borrow on this model";
  const train::MemoryProjection m = project_cuda_memory(a, ops, projection_host_layout(a, 1), false, 0.0);
  EXPECT_DOUBLE_EQ(m.total(), double(model.reserved_bytes()));
  EXPECT_DOUBLE_EQ(m.bytes("fp8"), double(sz.scratch_arena - plain));
}

TEST(CudaProjection, Zero1ShardsTheOptimizerStateAndRuntimeIsItsOwnPart) {
  const train::ModelSpec spec = testing::tiny_spec(true);
  CudaArgs a = projection_args(spec, 2, 1);
  a.host_mode = false;  // sized, not built: ZeRO-1 is device-only
  a.use_distributed_optimizer = true;
  const CudaOps ops = testing::ops_for(testing::Attn::Fallback);
  const train::MemoryProjection one = project_cuda_memory(a, ops, projection_host_layout(a, 1), false, 0.0);
  const train::MemoryProjection four = project_cuda_memory(a, ops, projection_host_layout(a, 4), false, 1.5);
  const train::ParamLayout layout = train::make_param_layout(spec);
  const double padded = double(parallel::zero1_padded_total(layout, 4));
  EXPECT_DOUBLE_EQ(one.bytes("optimizer_state"), 2.0 * double((layout.total * 4 + 255) / 256 * 256));
  // Four ranks: m and v of a quarter of the padded buffer each (rounded to 256 bytes), the fp32
  // master shard likewise; the flat gradients and bf16 weights stay whole (padded).
  EXPECT_NEAR(four.bytes("optimizer_state"), 2 * padded / 4 * 4, 2 * 256.0);
  EXPECT_NEAR(four.bytes("master_weights"), padded / 4 * 4, 256.0);
  EXPECT_DOUBLE_EQ(four.bytes("gradients"), padded * 4);
  EXPECT_DOUBLE_EQ(four.bytes("runtime"), 1.5 * double(size_t{1} << 30));
  EXPECT_FALSE(four.notes.empty());
}

// optim_grads_params: the state is the model's own shard (model/fsdp.h), sized by the same plan the
// model allocates: master weights and moments of a quarter of the model each on four ranks, the
// gradients the averaged chunks plus the units' places, nothing of ZeRO-1's.
TEST(CudaProjection, ShardedDataParallelismIsTheModelsOwnPlan) {
  train::ModelSpec spec = testing::tiny_spec(true);
  spec.num_layers = 8;
  CudaArgs a = projection_args(spec, 2, 1);
  a.host_mode = false;
  a.use_distributed_optimizer = true;  // what data_parallel_sharding_strategy sets beside the strategy
  a.train.model_parallel.sharding = parallel::DpSharding::OptimGradsParams;
  const CudaOps ops = testing::ops_for(testing::Attn::Fallback);
  const train::MemoryProjection one = project_cuda_memory(a, ops, projection_host_layout(a, 1), false, 0.0);
  train::ProjectionLayout lay4 = projection_host_layout(a, 4);
  lay4.zero1 = false;  // as the projector's layout says for a sharded strategy
  const train::MemoryProjection four = project_cuda_memory(a, ops, lay4, false, 0.0);
  const double P = double(train::make_param_layout(spec).total);
  EXPECT_NEAR(one.bytes("master_weights"), 4 * P, 256.0);
  EXPECT_GE(four.bytes("master_weights"), P);  // 4 P / 4, plus the chunks' padding
  EXPECT_LT(four.bytes("master_weights"), P * 1.1);
  EXPECT_LT(four.bytes("optimizer_state"), 2 * P * 1.1);
  EXPECT_LT(four.bytes("gradients"), one.bytes("gradients"));
  EXPECT_LT(four.bytes("weights"), one.bytes("weights"));
  EXPECT_LT(four.total(), 0.6 * one.total() + four.bytes("activations") + four.bytes("workspace"));
}

TEST(CudaProjection, FollowsTheTrainersOptionsForTheOptimizerInTheBackward) {
  const train::ModelSpec spec = testing::tiny_spec(false);
  CudaArgs a = projection_args(spec, 2, 1);
  const CudaOps ops = testing::ops_for(testing::Attn::Fallback);
  const double whole = project_cuda_memory(a, ops, projection_host_layout(a, 1), false, 0.0).bytes("gradients");
  a.optimizer_in_bwd = true;
  a.train.optim.clip_grad = 1.0;  // refused as the trainer refuses it (model_options_for)
  EXPECT_THROW(project_cuda_memory(a, ops, projection_host_layout(a, 1), false, 0.0), ConfigError);
  a.train.optim.clip_grad = 0;
  const train::MemoryProjection m = project_cuda_memory(a, ops, projection_host_layout(a, 1), false, 0.0);
  EXPECT_LT(m.bytes("gradients"), whole);  // the layers share one gradient window
  const train::ParamLayout layout = train::make_param_layout(spec);
  CudaModel model(spec, model_options_for(a, 1), ops);
  EXPECT_DOUBLE_EQ(m.total(), double(model.reserved_bytes()));
  // Beside data parallelism each layer's mean runs while the layer below fills a second window:
  // the projection for two GPUs holds one window more, in fp32 (and refuses ZeRO-1 with it).
  const train::MemoryProjection dp2 = project_cuda_memory(a, ops, projection_host_layout(a, 2), false, 0.0);
  const GradPlacement one_window = place_grads(layout, 1, grad_written_before_layer_backward);
  EXPECT_NEAR(dp2.bytes("gradients") - m.bytes("gradients"), 4.0 * double(one_window.window_elems), 256.0);
  a.use_distributed_optimizer = true;
  EXPECT_THROW(project_cuda_memory(a, ops, projection_host_layout(a, 2), false, 0.0), ConfigError);
}

// The optimizer's bytes a parameter in the step-time projection follow the trainer's options:
// 34 (AdamW 28, the bf16 copy 2, the grad norm 4), 30 in the backward (the norm inside the AdamW
// pass), and 2 fewer a parameter of the experts with bf16 expert gradients.
TEST(CudaProjection, OptimizerBytesFollowTheOptimizerInTheBackwardAndBf16ExpertGradients) {
  const train::ModelSpec spec = testing::tiny_moe_spec(true);
  CudaArgs a = projection_args(spec, 1, 1);
  const train::StepCostOptions base;
  EXPECT_DOUBLE_EQ(cuda_step_cost(a, base).optimizer_bytes_per_param, 34);
  a.optimizer_in_bwd = true;
  EXPECT_DOUBLE_EQ(cuda_step_cost(a, base).optimizer_bytes_per_param, 30);
  a.bf16_expert_grads = true;
  const train::ParamLayout layout = train::make_param_layout(spec);
  int64_t experts = 0;
  for (const auto& t : layout.tensors)
    if (t.name.find(".moe.experts.") != std::string::npos) experts += t.numel;
  ASSERT_GT(experts, 0);
  EXPECT_NEAR(cuda_step_cost(a, base).optimizer_bytes_per_param, 30 - 2.0 * double(experts) / double(layout.total), 1e-12);
}

// Split master weights: the master buffer is the low halves (2 bytes a parameter instead of 4, the
// rest of the plan unchanged, the same total as the model reserves), the update's traffic 2 bytes
// a parameter less; refused where the trainer refuses it.
TEST(CudaProjection, SplitMasterWeightsHalveTheMasterBuffer) {
  const train::ModelSpec spec = testing::tiny_spec(false);
  CudaArgs a = projection_args(spec, 1, 1);
  a.host_mode = false;
  const CudaOps ops = testing::ops_for(testing::Attn::Fallback);
  const train::MemoryProjection f32 = project_cuda_memory(a, ops, projection_host_layout(a, 1), false, 0.0);
  a.split_master = true;
  const train::MemoryProjection split = project_cuda_memory(a, ops, projection_host_layout(a, 1), false, 0.0);
  const double P = double(train::make_param_layout(spec).total);
  EXPECT_NEAR(f32.bytes("master_weights"), 4 * P, 256.0);
  EXPECT_NEAR(split.bytes("master_weights"), 2 * P, 256.0);
  EXPECT_NEAR(f32.total() - split.total(), 2 * P, 512.0);
  for (const char* part : {"weights", "gradients", "optimizer_state", "activations"})
    EXPECT_DOUBLE_EQ(split.bytes(part), f32.bytes(part)) << part;
  const train::StepCostOptions base;
  EXPECT_DOUBLE_EQ(cuda_step_cost(a, base).optimizer_bytes_per_param, 32);
  a.optimizer_in_bwd = true;
  a.train.optim.clip_grad = 0;
  EXPECT_DOUBLE_EQ(cuda_step_cost(a, base).optimizer_bytes_per_param, 28);
  a.optimizer_in_bwd = false;
  a.host_mode = true;
  EXPECT_THROW(project_cuda_memory(a, ops, projection_host_layout(a, 1), false, 0.0), ConfigError);
  a.host_mode = false;
  a.train.optim.optimizer = "muon";
  EXPECT_THROW(project_cuda_memory(a, ops, projection_host_layout(a, 1), false, 0.0), ConfigError);
  a.train.optim.optimizer = "adamw";
  CudaArgs two = projection_args(spec, 2, 1);
  two.host_mode = false;
  two.split_master = true;
  EXPECT_NO_THROW(project_cuda_memory(two, ops, projection_host_layout(two, 2), false, 0.0));  // plain data parallelism
  two.use_distributed_optimizer = true;  // ZeRO-1
  try {
    project_cuda_memory(two, ops, projection_host_layout(two, 2), false, 0.0);
    ADD_FAILURE() << "accepted with ZeRO-1";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("master_weights: split: use_distributed_optimizer"), std::string::npos)
        << e.what();
  }
}

// bf16 AdamW moments: the plan's m and v take 2 bytes a parameter each (the rest unchanged), the
// update's traffic 4 bytes a parameter less each; refused beside ZeRO-1 and Muon, naming the key.
TEST(CudaProjection, Bf16MomentsHalveTheOptimizerState) {
  const train::ModelSpec spec = testing::tiny_spec(false);
  CudaArgs a = projection_args(spec, 1, 1);
  a.host_mode = false;
  const CudaOps ops = testing::ops_for(testing::Attn::Fallback);
  const train::MemoryProjection f32 = project_cuda_memory(a, ops, projection_host_layout(a, 1), false, 0.0);
  a.train.optim.exp_avg_bf16 = true;
  const train::MemoryProjection m16 = project_cuda_memory(a, ops, projection_host_layout(a, 1), false, 0.0);
  a.train.optim.exp_avg_sq_bf16 = true;
  const train::MemoryProjection both = project_cuda_memory(a, ops, projection_host_layout(a, 1), false, 0.0);
  const double P = double(train::make_param_layout(spec).total);
  EXPECT_NEAR(f32.bytes("optimizer_state"), 8 * P, 512.0);
  EXPECT_NEAR(m16.bytes("optimizer_state"), 6 * P, 512.0);
  EXPECT_NEAR(both.bytes("optimizer_state"), 4 * P, 512.0);
  for (const char* part : {"weights", "master_weights", "gradients", "activations"})
    EXPECT_DOUBLE_EQ(both.bytes(part), f32.bytes(part)) << part;
  const train::StepCostOptions base;
  EXPECT_DOUBLE_EQ(cuda_step_cost(a, base).optimizer_bytes_per_param, 34 - 8);
  a.split_master = true;
  a.optimizer_in_bwd = true;
  a.train.optim.clip_grad = 0;
  EXPECT_DOUBLE_EQ(cuda_step_cost(a, base).optimizer_bytes_per_param, 34 - 8 - 2 - 4);
  a.optimizer_in_bwd = false;
  a.split_master = false;
  a.train.optim.optimizer = "muon";
  EXPECT_THROW(project_cuda_memory(a, ops, projection_host_layout(a, 1), false, 0.0), ConfigError);
  a.train.optim.optimizer = "adamw";
  CudaArgs two = projection_args(spec, 2, 1);
  two.host_mode = false;
  two.train.optim.exp_avg_sq_bf16 = true;
  EXPECT_NO_THROW(project_cuda_memory(two, ops, projection_host_layout(two, 2), false, 0.0));  // plain data parallelism
  two.use_distributed_optimizer = true;  // ZeRO-1
  try {
    project_cuda_memory(two, ops, projection_host_layout(two, 2), false, 0.0);
    ADD_FAILURE() << "accepted with ZeRO-1";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("exp_avg_sq_dtype: bf16 on the cuda backend is not implemented beside "
                                         "use_distributed_optimizer"),
              std::string::npos)
        << e.what();
  }
}

std::string projection_example(const char* name) {
  return std::string(PRIMUS_SOURCE_DIR) + "/examples/cuda/" + name;
}

TEST(CudaProjection, TheBinaryRefusesALayoutThatDoesNotDivideAndPrintsJson) {
  // gpt2-124M-shakespeare: micro-batch 16, global batch 32.
  auto r = primus::testing::run_primus("projection memory --config " + projection_example("gpt2-124M-shakespeare.yaml") +
                                       " --gpus 3");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("global_batch_size 32 is not a multiple of micro_batch_size 16 x data_parallel_size 3"),
            std::string::npos)
      << r.out;

  r = primus::testing::run_primus("projection both --json --device 'NVIDIA H200' --config " +
                                  projection_example("olmoe-mini.yaml"));
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  double sum = 0;
  for (const auto& p : j["memory"]["parts"]) sum += p["bytes"].get<double>();
  EXPECT_DOUBLE_EQ(sum, j["memory"]["total_bytes"].get<double>());
  bool grouped = false;
  double seconds = 0;
  for (const auto& p : j["time"]["parts"]) {
    grouped |= p["name"] == "grouped_gemm";
    seconds += p["seconds"].get<double>();
  }
  EXPECT_TRUE(grouped);
  EXPECT_NEAR(seconds, j["time"]["step_seconds"].get<double>(), 1e-9);

  r = primus::testing::run_primus("projection performance --device 'NVIDIA H200' --gpus 2 --config " +
                                  projection_example("gpt2-124M-shakespeare.yaml"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--net-gbps"), std::string::npos) << r.out;

  // `primus benchmark --cache` writes this machine's rates where the projection reads them; a part
  // it did not measure is refused, naming the benchmark to run.
  primus::testing::Workdir w;
  const std::string cache = "PRIMUS_RATES_CACHE=" + (w.path() / "rates.json").string();
  r = primus::testing::run_primus("benchmark gemm --shapes 64x64x64 --iters 1 --cache", cache);
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json rates = nlohmann::json::parse(std::ifstream(w.path() / "rates.json"));
  ASSERT_EQ(rates["devices"].size(), 1u) << rates.dump();
  EXPECT_GT(rates["devices"].begin().value()["gemm_tflops"].get<double>(), 0.0);
  r = primus::testing::run_primus("projection performance --config " + projection_example("gpt2-124M-shakespeare.yaml") +
                                      " --device '" + rates["devices"].begin().key() + "'",
                                  cache);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("nothing measured for: attention"), std::string::npos) << r.out;

  r = primus::testing::run_primus("train pretrain --dry-run --config " + projection_example("llama3.2-1B.yaml"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("  memory:    "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" per GPU: "), std::string::npos) << r.out;
}

// Tensor and context parallelism, memory only: the projection is rank 0's plan, the model the
// trainer builds for tp rank 0 from the shard map's local spec (host mode on two threaded ranks
// allocates exactly the projected total), its flat state a tp slice's; the sharded strategies
// beside cp shard over dp x cp. Through the binary, --gpus is the job's GPUs (dp = gpus / (tp x
// cp)), the layout names the mesh, and the step time of such a layout is refused by name.
TEST(CudaProjection, TensorAndContextParallelLayoutsAreRankZerosPlan) {
  const train::ModelSpec spec = testing::tiny_spec(true);
  CudaArgs a = projection_args(spec, 2, 1);
  a.train.model_parallel[parallel::Dim::TP] = 2;
  const CudaOps ops = testing::ops_for(testing::Attn::Fallback);
  train::ProjectionLayout lay = projection_host_layout(a, 1);
  lay.tp = 2;
  const train::MemoryProjection m = project_cuda_memory(a, ops, lay, false, 0.0);
  size_t reserved = 0;
  int64_t local_total = 0;
  testing::run_threaded_ranks(2, {}, "tp", [&](int r, parallel::ProcessGroup* pg) {
    auto map = std::make_shared<train::TpShardMap>(spec, 2, r, false);
    CudaArgs la = a;
    la.model = map->local_spec();
    CudaModelOptions mo = model_options_for(la, 1);
    mo.tp_group = pg;
    mo.tp_map = map;
    CudaModel model(la.model, mo, ops);
    if (r == 0) reserved = model.reserved_bytes(), local_total = model.layout().total;
  });
  EXPECT_DOUBLE_EQ(m.total(), double(reserved));
  EXPECT_NEAR(m.bytes("master_weights"), 4.0 * double(local_total), 256.0);
  EXPECT_LT(local_total, train::make_param_layout(spec).total);

  CudaArgs c = projection_args(spec, 2, 1);
  c.host_mode = false;
  c.train.model_parallel[parallel::Dim::CP] = 2;
  c.train.model_parallel.sharding = parallel::DpSharding::OptimGradsParams;
  train::ProjectionLayout lay_c = projection_host_layout(c, 2);  // cp 2 x dp 2: sharded over four ranks
  lay_c.cp = 2;
  lay_c.zero1 = false;
  const double P = double(train::make_param_layout(spec).total);
  const train::MemoryProjection sharded = project_cuda_memory(c, ops, lay_c, false, 0.0);
  EXPECT_GE(sharded.bytes("master_weights"), P);  // 4 P / 4, plus the chunks' padding
  EXPECT_LT(sharded.bytes("master_weights"), 1.2 * P);
  // ZeRO-1 beside cp (8 layers): the same shard of the master weights and moments as optim_grads,
  // the gradients whole beside the shard of the averaged gradient, where optim_grads keeps three
  // layer places.
  c.model.num_layers = 8;
  const double P8 = double(train::make_param_layout(c.model).total);
  c.train.model_parallel.sharding = parallel::DpSharding::OptimGrads;
  const train::MemoryProjection zero2 = project_cuda_memory(c, ops, lay_c, false, 0.0);
  c.use_distributed_optimizer = true;
  c.train.model_parallel.sharding = parallel::DpSharding::Optim;
  const train::MemoryProjection zero1 = project_cuda_memory(c, ops, lay_c, false, 0.0);
  EXPECT_DOUBLE_EQ(zero1.bytes("master_weights"), zero2.bytes("master_weights"));
  EXPECT_DOUBLE_EQ(zero1.bytes("optimizer_state"), zero2.bytes("optimizer_state"));
  EXPECT_GE(zero1.bytes("gradients"), 4.0 * P8 + P8);
  EXPECT_LT(zero2.bytes("gradients"), 0.8 * zero1.bytes("gradients"));

  auto r = primus::testing::run_primus("projection memory --json --gpus 8 --config " + projection_example("llama3.2-1B.yaml") +
                                       " tensor_model_parallel_size=2 sequence_parallel=true global_batch_size=16");
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["layout"]["gpus"].get<int64_t>(), 4);
  EXPECT_EQ(j["layout"]["tensor_model_parallel_size"].get<int64_t>(), 2);
  EXPECT_TRUE(j["layout"]["sequence_parallel"].get<bool>());
  r = primus::testing::run_primus("projection memory --gpus 8 --config " + projection_example("llama3.2-1B.yaml") +
                                  " tensor_model_parallel_size=2 sequence_parallel=true global_batch_size=16");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("layout: 8 GPUs (tp 2+sp x cp 1 x dp 4)"), std::string::npos) << r.out;
  r = primus::testing::run_primus("projection performance --device 'NVIDIA H200' --gpus 4 --config " +
                                  projection_example("llama3.2-1B.yaml") + " tensor_model_parallel_size=2");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("projection performance: tensor_model_parallel_size = 2 is not modelled yet"), std::string::npos)
      << r.out;
  // An MoE preset under tp2: every expert split, so the weights of a rank are half the model's
  // (the router and norms replicated: a little more than half).
  r = primus::testing::run_primus("projection memory --json --gpus 1 --config " + projection_example("olmoe-mini.yaml"));
  ASSERT_EQ(r.code, 0) << r.out;
  const double moe_one = weights_of(r.out);
  r = primus::testing::run_primus("projection memory --json --gpus 2 --config " + projection_example("olmoe-mini.yaml") +
                                  " tensor_model_parallel_size=2");
  ASSERT_EQ(r.code, 0) << r.out;
  const double moe_tp2 = weights_of(r.out);
  EXPECT_GT(moe_tp2, 0.5 * moe_one);
  EXPECT_LT(moe_tp2, 0.51 * moe_one);
  r = primus::testing::run_primus("projection memory --gpus 3 --config " + projection_example("llama3.2-1B.yaml") +
                                  " tensor_model_parallel_size=2");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--gpus 3 is not a multiple of tensor_model_parallel_size 2"), std::string::npos) << r.out;
}

// Expert parallelism: rank 0 of ep holds 1/ep of the experts (the rest whole) and the held side's
// buffers; the plan is the one the model allocates with its group (host mode, two threaded
// ranks), and the binary projects an MoE preset's memory under ep (its weights about 1/ep of the
// experts') but refuses to project its step time.
TEST(CudaProjection, ExpertParallelLayoutsAreRankZerosPlan) {
  const train::ModelSpec spec = testing::tiny_moe_spec(false);
  CudaArgs a = projection_args(spec, 2, 1);
  a.train.model_parallel[parallel::Dim::EP] = 2;
  a.train.data_parallel_size = 2;
  const CudaOps ops = testing::ops_for(testing::Attn::Fallback);
  train::ProjectionLayout lay = projection_host_layout(a, 2);
  lay.ep = 2;
  const train::MemoryProjection m = project_cuda_memory(a, ops, lay, false, 0.0);
  size_t reserved = 0;
  int64_t local_total = 0;
  testing::run_threaded_ranks(2, {}, "ep", [&](int r, parallel::ProcessGroup* pg) {
    auto map = std::make_shared<train::EpShardMap>(spec, 2, r);
    CudaArgs la = a;
    la.model = map->local_spec();
    CudaModelOptions mo = model_options_for(la, 2);
    mo.ep_group = pg;
    mo.ep_map = map;
    mo.ep_dense_group = pg;
    CudaModel model(la.model, mo, ops);
    if (r == 0) reserved = model.reserved_bytes(), local_total = model.layout().total;
  });
  EXPECT_DOUBLE_EQ(m.total(), double(reserved));
  EXPECT_NEAR(m.bytes("master_weights"), 4.0 * double(local_total), 256.0);
  EXPECT_LT(local_total, train::make_param_layout(spec).total);

  auto r = primus::testing::run_primus("projection memory --json --gpus 1 --config " + projection_example("olmoe-mini.yaml"));
  ASSERT_EQ(r.code, 0) << r.out;
  const double one = weights_of(r.out);
  r = primus::testing::run_primus("projection memory --json --gpus 4 --config " + projection_example("olmoe-mini.yaml") +
                                  " expert_model_parallel_size=4 global_batch_size=16");
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["layout"]["gpus"].get<int64_t>(), 4);  // the ep ranks read their own samples
  EXPECT_EQ(j["layout"]["expert_model_parallel_size"].get<int64_t>(), 4);
  const double ep4 = weights_of(r.out);
  // (1 - f) + f / 4 of the weights for the experts' share f of olmoe-mini's parameters (~0.9).
  EXPECT_LT(ep4, 0.35 * one);
  EXPECT_GT(ep4, 0.30 * one);
  r = primus::testing::run_primus("projection memory --gpus 4 --config " + projection_example("olmoe-mini.yaml") +
                                  " expert_model_parallel_size=4 global_batch_size=16");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("the experts over ep 4"), std::string::npos) << r.out;
  r = primus::testing::run_primus("projection performance --device 'NVIDIA H200' --gpus 4 --config " +
                                  projection_example("olmoe-mini.yaml") + " expert_model_parallel_size=4 global_batch_size=16");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("projection performance: expert_model_parallel_size = 4 is not modelled yet"), std::string::npos)
      << r.out;
}

}  // namespace
}  // namespace primus::backends::cuda

namespace primus::backends::cuda {
namespace {
// optimizer: muon reaches the model's options (the tensors Muon takes) on one GPU and with plain
// data parallelism; with ZeRO-1 on several GPUs or the optimizer in the backward it is refused
// naming the keys, in the trainer's and the projection's shared model_options_for.
TEST(CudaProjection, MuonOptionsAndItsRefusals) {
  const train::ModelSpec spec = testing::tiny_spec(true);
  CudaArgs a = projection_args(spec, 2, 1);
  a.host_mode = false;
  a.train.optim.optimizer = "muon";
  EXPECT_EQ(model_options_for(a, 1).muon.size(), static_cast<size_t>(4 * spec.num_layers));
  EXPECT_EQ(model_options_for(a, 2).muon.size(), static_cast<size_t>(4 * spec.num_layers));  // plain DP
  // The projection adds Muon's own arenas: the working set of its largest block and the AdamW table
  // of the other tensors.
  const CudaOps ops = testing::ops_for(testing::Attn::Fallback);
  const double muon = project_cuda_memory(a, ops, projection_host_layout(a, 1), false, 0.0).total();
  CudaArgs plain = a;
  plain.train.optim.optimizer = "adamw";
  const double adamw = project_cuda_memory(plain, ops, projection_host_layout(plain, 1), false, 0.0).total();
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (const auto& mt : model_options_for(a, 1).muon)
    for (const auto& b : mt.blocks) shapes.emplace_back(b.rows, b.cols);
  const int rest = static_cast<int>(train::make_param_layout(spec).tensors.size()) - 4 * static_cast<int>(spec.num_layers);
  EXPECT_DOUBLE_EQ(muon - adamw, double(turbo::MultiMatrixMuon::working_set_bytes(shapes) +
                                        turbo::cuda::multi_tensor_table_bytes(rest) + 2 * turbo::Arena::kDefaultAlign));
  a.use_distributed_optimizer = true;
  EXPECT_FALSE(model_options_for(a, 1).muon.empty());  // one GPU: no shards, nothing to refuse
  try {
    model_options_for(a, 2);
    ADD_FAILURE() << "Muon with ZeRO-1 on 2 GPUs was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("use_distributed_optimizer"), std::string::npos) << e.what();
  }
  a.use_distributed_optimizer = false;
  a.optimizer_in_bwd = true;
  a.train.optim.clip_grad = 0;
  EXPECT_THROW(model_options_for(a, 1), ConfigError);
}
// The sequence-wise balance loss on the cuda backend: its per-sequence statistics in the step
// status (the projection counts them: one more status word per sequence, expert and MoE layer,
// counts and sums), and under context parallelism, where a micro-batch is two chunks of each
// sequence, one row per sequence still, plus the counts' f32 copy for the group's sum.
TEST(CudaProjection, SequenceWiseAuxLossPlansItsStatisticsPerSequence) {
  train::ModelSpec spec = testing::tiny_moe_spec(false);
  const CudaOps ops = testing::ops_for(testing::Attn::Fallback);
  CudaArgs a = projection_args(spec, 2, 1);
  const double words = 8.0 * 2 * spec.num_moe_layers() * spec.moe.num_experts;  // 2 sequences, counts and sums
  const train::MemoryProjection batch_wise = project_cuda_memory(a, ops, projection_host_layout(a, 1), false, 0.0);
  a.model.moe.set_balance(train::MoeSpec::Balance::Sequence, a.model.moe.aux_loss_coeff);
  EXPECT_NO_THROW(model_options_for(a, 1));
  const train::MemoryProjection seq_wise = project_cuda_memory(a, ops, projection_host_layout(a, 1), false, 0.0);
  EXPECT_GT(seq_wise.total(), batch_wise.total());
  EXPECT_LT(seq_wise.total(), batch_wise.total() + 4096.0 + words);

  // Context parallelism, a micro-batch of 512 sequences (a rank holds two chunks of each; enough
  // rows to stand above the allocations' rounding): the sequences' counts and sums and their f32
  // copy for the group's sum, against the switch loss's one summed row of counts and its i32 copy.
  CudaArgs c = projection_args(spec, 512, 1);
  c.model.moe.set_balance(train::MoeSpec::Balance::Sequence, 0.01);
  c.train.model_parallel[parallel::Dim::CP] = 2;
  EXPECT_NO_THROW(model_options_for(c, 2));
  const train::MemoryProjection seq_cp = project_cuda_memory(c, ops, projection_host_layout(c, 2), false, 0.0);
  c.model.moe.set_balance(train::MoeSpec::Balance::Batch, 0.01);
  const train::MemoryProjection batch_cp = project_cuda_memory(c, ops, projection_host_layout(c, 2), false, 0.0);
  const double Lm = static_cast<double>(spec.num_moe_layers()), E = static_cast<double>(spec.moe.num_experts);
  const double more = 8.0 * 512 * Lm * E - 4.0 * Lm * E + 4.0 * 512 * E - 4.0 * E;
  EXPECT_GT(seq_cp.total() - batch_cp.total(), more - 2 * 4096.0);
  EXPECT_LT(seq_cp.total() - batch_cp.total(), more + 2 * 4096.0);
}
}  // namespace
}  // namespace primus::backends::cuda
