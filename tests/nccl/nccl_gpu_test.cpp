// NcclProcessGroup across real processes, one per local GPU (label gpu: skipped without a GPU,
// and the multi-rank cases without two). Each rank is nccl_test_worker with torchrun's
// variables; the output of every rank is collected and checked here.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "turbo/core/cuda_check.h"

namespace {

struct RankRun {
  int status = 0;
  std::string out;
  double seconds = 0;
};

// Starts `world` workers on local GPUs 0..world-1 (a free port, timeout `timeout_s`), waits for
// all, and returns their interleaved output. A stopped rank is killed once the others are done.
RankRun run_ranks(int world, const std::string& mode, int timeout_s) {
  // PRIMUS_NCCL_TEST_WORKER: where the worker is when the tests run away from their build tree.
  const char* env_worker = std::getenv("PRIMUS_NCCL_TEST_WORKER");
  const std::string worker = env_worker && *env_worker ? env_worker : std::string(PRIMUS_BINARY_DIR) + "/bin/nccl_test_worker";
  const int port = 20000 + (static_cast<int>(::getpid()) % 20000);
  std::string script = "pids=''; ";
  for (int r = 0; r < world; ++r) {
    script += "RANK=" + std::to_string(r) + " WORLD_SIZE=" + std::to_string(world) + " LOCAL_RANK=" + std::to_string(r) +
              " LOCAL_WORLD_SIZE=" + std::to_string(world) + " MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
              std::to_string(port) + " PRIMUS_DIST_TIMEOUT=" + std::to_string(timeout_s) + " " + worker + " " + mode +
              " & pids=\"$pids $!\"; ";
  }
  // rank 0 decides; then everything left (a stopped rank) is killed
  script += "p0=$(echo $pids | cut -d' ' -f1); wait $p0; rc=$?; kill -9 $pids 2>/dev/null; wait 2>/dev/null; exit $rc";
  const std::string cmd = "bash -c '" + [&] {
    std::string s;
    for (char c : script) s += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return s;
  }() + "' 2>&1";
  auto t0 = std::chrono::steady_clock::now();
  RankRun r;
  FILE* f = popen(cmd.c_str(), "r");
  char buf[4096];
  while (f && fgets(buf, sizeof(buf), f)) r.out += buf;
  int st = f ? pclose(f) : -1;
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

int gpus() { return primus::turbo::cuda_device_count_or_zero(); }

TEST(NcclGpu, CollectivesOnOneGpu) {
  if (gpus() < 1) GTEST_SKIP() << "no CUDA device";
  RankRun r = run_ranks(1, "collectives", 60);
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("OK rank 0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("NVLS=0"), std::string::npos) << r.out;
}

TEST(NcclGpu, CollectivesOnTwoGpusMatchTheSerialReduction) {
  if (gpus() < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus();
  RankRun r = run_ranks(2, "collectives", 60);
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("OK rank 0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("OK rank 1"), std::string::npos) << r.out;
}

TEST(NcclGpu, StoppedRankIsNamedWithinTheTimeout) {
  if (gpus() < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus();
  RankRun r = run_ranks(2, "hang", 5);
  EXPECT_EQ(r.status, 3) << r.out;
  EXPECT_NE(r.out.find("ERROR rank 0: NCCL all_reduce(1024 x f32) #"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("did not complete within the 5 s timeout"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 1 (no heartbeat"), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, 5 + 20) << r.out;  // timeout + setup + diagnosis
}

TEST(NcclGpu, LiveRankThatNeverJoinsIsNamed) {
  if (gpus() < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus();
  RankRun r = run_ranks(2, "stall", 5);
  EXPECT_EQ(r.status, 3) << r.out;
  EXPECT_NE(r.out.find("did not complete within the 5 s timeout"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 1 (alive, but has issued 1 collectives to this rank's 2"), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, 5 + 20) << r.out;
}

TEST(NcclGpu, RankThatExitsIsNamed) {
  if (gpus() < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus();
  RankRun r = run_ranks(2, "leave", 5);
  EXPECT_EQ(r.status, 3) << r.out;
  EXPECT_NE(r.out.find("ERROR rank 0: NCCL all_reduce"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 1 (no heartbeat"), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, 5 + 20) << r.out;
}

// ---- data-parallel training through the primus binary ----

std::string primus_bin() {
  const char* p = std::getenv("PRIMUS_BIN");
  return p && *p ? p : std::string(PRIMUS_BINARY_DIR) + "/bin/primus";
}

// Runs `primus [launch --nproc-per-node N --] train pretrain` on a small GPT-2 (4 layers, hidden
// 256, head dim 64, mock data, global batch 16 of 128 tokens, micro-batch 8) and returns
// step -> {loss, grad norm} from rank 0's metrics.jsonl.
std::map<int, std::pair<double, double>> train_losses(int gpus, const std::string& name, const std::string& extra,
                                                      std::string* log, bool keep = false) {
  const std::string src = PRIMUS_SOURCE_DIR;
  const std::string ws = "/tmp/primus-nccl-test-" + std::to_string(::getpid());
  std::string cmd = "PRIMUS_CONFIG_DIR=${PRIMUS_CONFIG_DIR:-" + src + "/configs} PRIMUS_GPT2_VOCAB_DIR=${PRIMUS_GPT2_VOCAB_DIR:-" +
                    src + "/third_party/gpt2} timeout 300 " + primus_bin();
  if (gpus > 1) cmd += " launch --nproc-per-node " + std::to_string(gpus) + " --timeout 60 --";
  cmd += " train pretrain --config " + src +
         "/examples/cuda/gpt2-124M-shakespeare.yaml mock_data=true num_layers=4 hidden_size=256 "
         "num_attention_heads=4 ffn_hidden_size=1024 seq_length=128 micro_batch_size=8 global_batch_size=16 "
         "train_iters=20 lr=1e-3 lr_warmup_iters=2 log_interval=1 eval_interval=0 save_interval=0 keep_last_k=1 "
         "workspace=" + ws + " exp_name=" + name + " " + extra + " 2>&1";
  FILE* f = popen(cmd.c_str(), "r");
  char buf[4096];
  while (f && fgets(buf, sizeof(buf), f)) *log += buf;
  if (f) pclose(f);
  std::map<int, std::pair<double, double>> losses;
  FILE* m = popen(("cat " + ws + "/*/*/" + name + "/metrics.jsonl 2>/dev/null").c_str(), "r");
  while (m && fgets(buf, sizeof(buf), m)) {
    std::string l(buf);
    auto s = l.find("\"step\":"), lo = l.find("\"loss\":"), gn = l.find("\"grad_norm\":");
    if (s == std::string::npos || lo == std::string::npos || gn == std::string::npos) continue;
    losses[std::atoi(l.c_str() + s + 7)] = {std::atof(l.c_str() + lo + 7), std::atof(l.c_str() + gn + 12)};
  }
  if (m) pclose(m);
  if (!keep) std::system(("rm -rf " + ws + "/*/*/" + name).c_str());
  return losses;
}

// Issue [multi-gpu]: 2-GPU data parallelism at global batch G gives 1 GPU's losses at G (bf16
// tolerance: the reductions add in another order), with and without ZeRO-1, and with bf16 reduction
// launched after the backward.
TEST(NcclGpu, TwoGpuTrainingMatchesOneGpuWithAndWithoutZero1) {
  if (gpus() < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus();
  std::string log1;
  const auto one = train_losses(1, "dp1", "", &log1);
  ASSERT_EQ(one.size(), 20u) << log1;
  for (const char* extra : {"use_distributed_optimizer=false", "use_distributed_optimizer=true",
                            "use_distributed_optimizer=true grad_reduce_in_bf16=true overlap_grad_reduce=false"}) {
    std::string log2;
    const auto two = train_losses(2, "dp2", extra, &log2);
    ASSERT_EQ(two.size(), 20u) << extra << "\n" << log2;
    EXPECT_NE(log2.find("data parallel: 2 ranks"), std::string::npos) << log2;
    // Mock data is random tokens, so the loss hardly moves; the gradient norm, which follows
    // every weight, is compared too.
    double worst = 0, worst_norm = 0;
    for (const auto& [step, v1] : one) {
      worst = std::max(worst, std::abs(two.at(step).first - v1.first) / std::abs(v1.first));
      worst_norm = std::max(worst_norm, std::abs(two.at(step).second - v1.second) / std::abs(v1.second));
    }
    const bool bf16 = std::string(extra).find("grad_reduce_in_bf16=true") != std::string::npos;
    EXPECT_LT(worst, 2e-2) << extra;
    EXPECT_LT(worst_norm, bf16 ? 1e-1 : 5e-2) << extra;  // bf16 sums: ~3 significant digits per gradient
    std::printf("[dp] %s: 20 steps, worst relative difference vs 1 GPU: loss %.3e, grad norm %.3e (final loss %.4f "
                "vs %.4f)\n",
                extra, worst, worst_norm, two.at(20).first, one.at(20).first);
  }
}

// The mesh over NCCL subgroups (NcclProcessGroup::subgroup): on 4 GPUs tp2 x dp2, tp2+sp x cp2,
// cp2 x FSDP over dp x cp, and FSDP x tp2 give 1 GPU's losses and gradient norms at the same global
// batch (bf16 tolerance, as the 2-GPU data-parallel test's).
TEST(NcclGpu, FourGpuMeshLayoutsMatchOneGpu) {
  if (gpus() < 4) GTEST_SKIP() << "needs 4 GPUs, found " << gpus();
  std::string log1;
  const auto one = train_losses(1, "mesh1", "", &log1);
  ASSERT_EQ(one.size(), 20u) << log1;
  const std::pair<const char*, const char*> layouts[] = {
      {"tensor_model_parallel_size=2", "tensor parallel over 2 ranks (nccl group) x data parallel over 2 ranks"},
      {"tensor_model_parallel_size=2 sequence_parallel=true context_parallel_size=2", "x context parallel over 2 ranks"},
      {"context_parallel_size=2 data_parallel_sharding_strategy=optim_grads_params", "sharded over dp x cp = 4 ranks"},
      {"tensor_model_parallel_size=2 data_parallel_sharding_strategy=optim_grads_params",
       "data_parallel_sharding_strategy optim_grads_params"},
  };
  for (const auto& [extra, banner] : layouts) {
    std::string log4;
    const auto four = train_losses(4, "mesh4", extra, &log4);
    ASSERT_EQ(four.size(), 20u) << extra << "\n" << log4;
    EXPECT_NE(log4.find(banner), std::string::npos) << extra << "\n" << log4;
    double worst = 0, worst_norm = 0;
    for (const auto& [step, v1] : one) {
      worst = std::max(worst, std::abs(four.at(step).first - v1.first) / std::abs(v1.first));
      worst_norm = std::max(worst_norm, std::abs(four.at(step).second - v1.second) / std::abs(v1.second));
    }
    EXPECT_LT(worst, 2e-2) << extra;
    EXPECT_LT(worst_norm, 5e-2) << extra;
    std::printf("[mesh] %s: 20 steps on 4 GPUs, worst relative difference vs 1 GPU: loss %.3e, grad norm %.3e\n", extra,
                worst, worst_norm);
  }
}

// The output of a shell command.
std::string shell(const std::string& cmd) {
  std::string out;
  char buf[4096];
  FILE* f = popen(cmd.c_str(), "r");
  while (f && fgets(buf, sizeof(buf), f)) out += buf;
  if (f) pclose(f);
  return out;
}

// Issue [multi-gpu]: a checkpoint saved by 2 GPUs under ZeRO-1 (each rank writes its shard of the
// moments, one segment per gradient bucket) resumes on 1 GPU and continues the 1-GPU run's curve.
TEST(NcclGpu, Zero1CheckpointFromTwoGpusResumesOnOneGpu) {
  if (gpus() < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus();
  std::string log1, log2, log3;
  const auto one = train_losses(1, "rs1", "lr_decay_iters=20", &log1);  // the schedule of all three runs
  ASSERT_EQ(one.size(), 20u) << log1;
  train_losses(2, "rs2", "use_distributed_optimizer=true train_iters=10 lr_decay_iters=20 save_interval=10", &log2,
               true);
  ASSERT_NE(log2.find("saved step 10"), std::string::npos) << log2;
  // The checkpoint holds one shard file per rank, listed with its segments in the manifest; the
  // moments are not in optimizer.safetensors (nothing was gathered).
  const std::string ck = "/tmp/primus-nccl-test-" + std::to_string(::getpid()) + "/*/*/rs2";
  const std::string manifest = shell("cat " + ck + "/checkpoints/iter_0000010/manifest.json 2>/dev/null");
  EXPECT_NE(manifest.find("\"scheme\": \"zero1\""), std::string::npos) << manifest;
  EXPECT_NE(manifest.find("\"segments\""), std::string::npos) << manifest;
  EXPECT_EQ(shell("ls " + ck + "/checkpoints/iter_0000010/ | grep -c '^optimizer.rank0000[01]-of-00002.safetensors$'"),
            "2\n");
  const auto resumed = train_losses(1, "rs2", "auto_continue_train=true lr_decay_iters=20", &log3);
  ASSERT_NE(log3.find("resumed from"), std::string::npos) << log3;
  EXPECT_NE(log3.find("at step 10 (saved by 2 rank(s), resharded for 1)"), std::string::npos) << log3;
  double worst = 0;
  for (int step = 11; step <= 20; ++step) {
    ASSERT_TRUE(resumed.count(step)) << "step " << step << " missing\n" << log3;
    worst = std::max(worst, std::abs(resumed.at(step).first - one.at(step).first) / std::abs(one.at(step).first));
  }
  EXPECT_LT(worst, 2e-2);
  std::printf("[dp] ZeRO-1 2-GPU checkpoint resumed on 1 GPU: steps 11-20 within %.3e of the 1-GPU run\n", worst);
}

// fp8_recipe delayed on 2 GPUs, plain and ZeRO-1: the amaxes are max-reduced over the ranks every
// step (CudaModel::reduce_fp8_amaxes, inside the step), so the run follows 1 GPU's losses (bf16
// tolerance); the ZeRO-1 run's step-10 checkpoint holds the amax histories (rank 0 writes them)
// and resumes on 1 GPU with them.
TEST(NcclGpu, TwoGpuDelayedFp8TrainsAsOneGpuAndResumesOnOne) {
  if (gpus() < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus();
  const std::string fp8 = "fp8=hybrid fp8_recipe=delayed fp8_amax_history_len=3 fp8_amax_compute_algo=max ";
  std::string log1;
  const auto one = train_losses(1, "fp8d1", fp8 + "lr_decay_iters=20", &log1);
  ASSERT_EQ(one.size(), 20u) << log1;
  for (const char* extra : {"use_distributed_optimizer=false", "use_distributed_optimizer=true"}) {
    std::string log2;
    const auto two = train_losses(2, "fp8d2", fp8 + "lr_decay_iters=20 " + extra, &log2);
    ASSERT_EQ(two.size(), 20u) << extra << "\n" << log2;
    double worst = 0;
    for (const auto& [step, v1] : one) worst = std::max(worst, std::abs(two.at(step).first - v1.first) / v1.first);
    EXPECT_LT(worst, 2e-2) << extra;
    std::printf("[dp] fp8 delayed, %s: 20 steps within %.3e of 1 GPU's losses\n", extra, worst);
  }
  std::string log2, log3;
  train_losses(2, "fp8rs", fp8 + "use_distributed_optimizer=true train_iters=10 lr_decay_iters=20 save_interval=10",
               &log2, true);
  ASSERT_NE(log2.find("saved step 10"), std::string::npos) << log2;
  const auto resumed = train_losses(1, "fp8rs", fp8 + "auto_continue_train=true lr_decay_iters=20", &log3);
  ASSERT_NE(log3.find("resumed from"), std::string::npos) << log3;
  EXPECT_EQ(log3.find("has no FP8 amax histories"), std::string::npos) << log3;
  double worst = 0;
  for (int step = 11; step <= 20; ++step) {
    ASSERT_TRUE(resumed.count(step)) << "step " << step << " missing\n" << log3;
    worst = std::max(worst, std::abs(resumed.at(step).first - one.at(step).first) / one.at(step).first);
  }
  EXPECT_LT(worst, 2e-2);
}

}  // namespace
