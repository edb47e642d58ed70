// Training end to end through the binary: resume is bit-identical, a damaged checkpoint is
// refused, a non-finite loss stops (or is skipped), export and generation work.
#include <gtest/gtest.h>

#include <cmath>

#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_runner.h"
#include "core/util/fs.h"
#include "io/metrics.h"
#include "io/safetensors.h"

using primus::testing::run_primus;
using primus::testing::tiny_run_args;
using primus::testing::Workdir;
namespace fsys = std::filesystem;

namespace {
fsys::path out_dir(const Workdir& w) { return w.path() / "local/local/shakespeare"; }

std::vector<std::pair<int64_t, double>> losses(const fsys::path& metrics, const std::string& key = "loss") {
  std::vector<std::pair<int64_t, double>> out;
  for (auto& j : primus::io::read_jsonl(metrics))
    if (j.contains(key)) out.emplace_back(j["step"].get<int64_t>(), j[key].get<double>());
  return out;
}
}  // namespace

TEST(TrainE2E, ResumeGivesBitIdenticalLossesAndWeights) {
  Workdir straight, resumed;
  auto a = run_primus(tiny_run_args(straight.str()));
  ASSERT_EQ(a.code, 0) << a.out;
  auto b1 = run_primus(tiny_run_args(resumed.str()) + " train_iters=10");
  ASSERT_EQ(b1.code, 0) << b1.out;
  auto b2 = run_primus(tiny_run_args(resumed.str()) + " auto_continue_train=true");
  ASSERT_EQ(b2.code, 0) << b2.out;
  EXPECT_NE(b2.out.find("resumed from"), std::string::npos) << b2.out;
  auto la = losses(out_dir(straight) / "metrics.jsonl");
  auto lb = losses(out_dir(resumed) / "metrics.jsonl");
  ASSERT_EQ(la.size(), 20u);
  ASSERT_EQ(lb.size(), 20u);
  for (size_t i = 0; i < la.size(); ++i) {
    EXPECT_EQ(la[i].first, lb[i].first);
    EXPECT_EQ(la[i].second, lb[i].second) << "step " << la[i].first;  // bitwise
  }
  EXPECT_LT(la.back().second, la.front().second);  // it learns
  auto wa = primus::fs::read_file(out_dir(straight) / "checkpoints/iter_0000020/model.safetensors");
  auto wb = primus::fs::read_file(out_dir(resumed) / "checkpoints/iter_0000020/model.safetensors");
  EXPECT_TRUE(wa == wb) << "final weights differ";
  auto oa = primus::fs::read_file(out_dir(straight) / "checkpoints/iter_0000020/optimizer.safetensors");
  auto ob = primus::fs::read_file(out_dir(resumed) / "checkpoints/iter_0000020/optimizer.safetensors");
  EXPECT_TRUE(oa == ob) << "optimizer state differs";
  // metrics.jsonl and TensorBoard events exist with the required fields.
  auto rows = primus::io::read_jsonl(out_dir(straight) / "metrics.jsonl");
  for (const char* k : {"step", "loss", "lr", "grad_norm", "tokens_per_s"}) EXPECT_TRUE(rows[0].contains(k)) << k;
  bool tb = false;
  for (auto& e : fsys::directory_iterator(out_dir(straight) / "tensorboard"))
    tb |= e.path().filename().string().rfind("events.out.tfevents.", 0) == 0;
  EXPECT_TRUE(tb);
}

TEST(TrainE2E, SaveAtEndFalseWritesOnlyTheIntervalCheckpoints) {
  Workdir w;
  auto r = run_primus(tiny_run_args(w.str()) + " train_iters=7 save_interval=3 save_at_end=false");
  ASSERT_EQ(r.code, 0) << r.out;
  const fsys::path ck = out_dir(w) / "checkpoints";
  EXPECT_TRUE(fsys::exists(ck / "iter_0000003"));
  EXPECT_TRUE(fsys::exists(ck / "iter_0000006"));
  EXPECT_FALSE(fsys::exists(ck / "iter_0000007")) << "no checkpoint after the last step";
}

TEST(TrainE2E, DamagedCheckpointIsRefusedNamingTheFile) {
  Workdir w;
  ASSERT_EQ(run_primus(tiny_run_args(w.str()) + " train_iters=10").code, 0);
  fsys::path ck = out_dir(w) / "checkpoints/iter_0000010";
  const std::string good_model = primus::fs::read_file(ck / "model.safetensors");
  {
    std::fstream f(ck / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-20, std::ios::end);
    f.put('\x7f');
  }
  auto r = run_primus(tiny_run_args(w.str()) + " load=" + ck.string());
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("model.safetensors"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("iter_0000010"), std::string::npos) << r.out;
  std::ofstream(ck / "model.safetensors", std::ios::binary) << good_model;
  fsys::resize_file(ck / "optimizer.safetensors", 100);
  auto t = run_primus(tiny_run_args(w.str()) + " load=" + ck.string());
  EXPECT_EQ(t.code, 3) << t.out;
  EXPECT_NE(t.out.find("optimizer.safetensors"), std::string::npos) << t.out;
}

TEST(TrainE2E, CheckpointForAnotherModelIsRefused) {
  Workdir w;
  ASSERT_EQ(run_primus(tiny_run_args(w.str()) + " train_iters=10").code, 0);
  auto r = run_primus(tiny_run_args(w.str()) + " hidden_size=48 load=" + (out_dir(w) / "checkpoints").string());
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("another model"), std::string::npos) << r.out;
}

TEST(TrainE2E, NonFiniteLossStopsNamingStepAndLastCheckpoint) {
  Workdir w;
  auto r = run_primus(tiny_run_args(w.str()) + " lr=1e38 lr_warmup_iters=0 save_interval=1");
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("non-finite loss"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("at step 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("iter_0000001"), std::string::npos) << r.out;
  auto s = run_primus(tiny_run_args(w.str()) + " lr=1e38 lr_warmup_iters=0 skip_nan_steps=true train_iters=4 exp_name=skip");
  EXPECT_EQ(s.code, 0) << s.out;
  EXPECT_NE(s.out.find("step skipped"), std::string::npos) << s.out;
}

TEST(TrainE2E, ExportHfAndGenerate) {
  Workdir w;
  ASSERT_EQ(run_primus(tiny_run_args(w.str()) + " train_iters=10").code, 0);
  auto ck = out_dir(w) / "checkpoints";
  auto e = run_primus("export hf " + ck.string() + " " + (w.path() / "hf").string() + " --dtype fp32");
  ASSERT_EQ(e.code, 0) << e.out;
  auto cfg = nlohmann::json::parse(primus::fs::read_file(w.path() / "hf/config.json"));
  EXPECT_EQ(cfg["model_type"], "gpt2");
  EXPECT_EQ(cfg["n_embd"], 32);
  auto st = primus::io::SafetensorsFile::open(w.path() / "hf/model.safetensors");
  EXPECT_EQ(st.info("transformer.h.0.attn.c_attn.weight").shape, (std::vector<int64_t>{32, 96}));  // Conv1D [in,out]
  EXPECT_EQ(st.info("transformer.wte.weight").shape, (std::vector<int64_t>{256, 32}));
  auto g = run_primus("generate --checkpoint " + ck.string() + " --prompt 'ROMEO:' -n 20 --top-k 5");
  EXPECT_EQ(g.code, 0) << g.out;
  EXPECT_EQ(g.out.rfind("ROMEO:", 0), 0u) << g.out;
  EXPECT_GE(g.out.size(), 6u + 20u);
  // --score: the fp32 mean next-token loss of a text, finite and in (0, a few x ln 256); the
  // same text twice gives the same bits; a one-byte text is refused with exit 2.
  const std::string text = "First Citizen:\nBefore we proceed any further, hear me speak.";
  auto s1 = run_primus("generate --checkpoint " + ck.string() + " --score --prompt '" + text + "'");
  auto s2 = run_primus("generate --checkpoint " + ck.string() + " --score --prompt '" + text + "'");
  ASSERT_EQ(s1.code, 0) << s1.out;
  const double loss = std::stod(s1.out);
  EXPECT_GT(loss, 0.0) << s1.out;
  EXPECT_LT(loss, 3 * std::log(256.0)) << s1.out;
  EXPECT_EQ(s1.out, s2.out);
  EXPECT_EQ(run_primus("generate --checkpoint " + ck.string() + " --score --prompt 'x'").code, 2);
}

// finetune (Megatron-LM's): the weights of `load` and nothing else. With lr 0 the run's weights
// stay the checkpoint's bit for bit, while its steps, optimizer state and data start afresh; a
// restarted finetune run resumes its own checkpoint; a missing `load` or another model is named.
TEST(TrainE2E, FinetuneStartsFromTheWeightsOnly) {
  Workdir base, tuned;
  ASSERT_EQ(run_primus(tiny_run_args(base.str())).code, 0);
  const fsys::path ck = out_dir(base) / "checkpoints";
  const std::string ft = " finetune=true load=" + ck.string() + " lr=0 min_lr=0 train_iters=3 save_interval=0";
  auto r = run_primus(tiny_run_args(tuned.str()) + ft);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("finetune: weights from " + (ck / "iter_0000020").string() + " (its step 20)"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("resumed from"), std::string::npos) << r.out;
  const auto lb = losses(out_dir(base) / "metrics.jsonl");
  const auto lt = losses(out_dir(tuned) / "metrics.jsonl");
  ASSERT_EQ(lt.size(), 3u);
  EXPECT_EQ(lt.front().first, 1);                  // step 0 onwards, not 20
  EXPECT_LT(lt.front().second, lb.front().second - 0.2);  // trained weights, not a fresh init
  const fsys::path out = out_dir(tuned) / "checkpoints/iter_0000003";
  EXPECT_TRUE(primus::fs::read_file(out / "model.safetensors") ==
              primus::fs::read_file(ck / "iter_0000020/model.safetensors"))
      << "lr 0 must leave the loaded weights as they were";
  EXPECT_FALSE(primus::fs::read_file(out / "optimizer.safetensors") ==
               primus::fs::read_file(ck / "iter_0000020/optimizer.safetensors"));
  // Restarted with auto_continue_train, the finetune run resumes its own checkpoint.
  auto again = run_primus(tiny_run_args(tuned.str()) + ft + " train_iters=4 auto_continue_train=true");
  ASSERT_EQ(again.code, 0) << again.out;
  EXPECT_NE(again.out.find("resumed from " + out.string()), std::string::npos) << again.out;
  EXPECT_EQ(again.out.find("finetune: weights from"), std::string::npos) << again.out;
  auto own = run_primus(tiny_run_args(base.str()) + ft + " --dry-run");
  EXPECT_EQ(own.code, 2) << own.out;
  EXPECT_NE(own.out.find("give the finetuning run a save folder of its own"), std::string::npos) << own.out;
  auto no_load = run_primus(tiny_run_args(tuned.str()) + " finetune=true --dry-run");
  EXPECT_EQ(no_load.code, 2) << no_load.out;
  EXPECT_NE(no_load.out.find("finetune: true needs load"), std::string::npos) << no_load.out;
  auto other = run_primus(tiny_run_args(tuned.str()) + ft + " hidden_size=48 exp_name=other");
  EXPECT_EQ(other.code, 3) << other.out;
  EXPECT_NE(other.out.find("another model"), std::string::npos) << other.out;
  // What the weights do not record may change (the init's scale); learned positions' table is
  // sized by seq_length, so a finetune at another length is another model.
  EXPECT_EQ(run_primus(tiny_run_args(tuned.str()) + ft + " init_method_std=0.01 exp_name=std").code, 0);
  auto shorter = run_primus(tiny_run_args(tuned.str()) + ft + " seq_length=64 exp_name=short");
  EXPECT_EQ(shorter.code, 3) << shorter.out;
  EXPECT_NE(shorter.out.find("another model"), std::string::npos) << shorter.out;
}

// Megatron-LM's train_data_path: separate training data, every document of it trains (split does
// not apply), validation only from valid_data_path. The prepared halves of a text run given as
// train_data_path and valid_data_path are that run again, loss for loss; without valid_data_path
// the same training has no validation. Beside data_path, or as a text file, it is refused by name.
TEST(TrainE2E, TrainDataPathTrainsOnEveryDocumentOfIt) {
  Workdir text, both, alone;
  auto a = run_primus(tiny_run_args(text.str()) + " train_iters=10");
  ASSERT_EQ(a.code, 0) << a.out;
  const std::string prefix = (out_dir(text) / "data/tinyshakespeare-bytes").string();
  const std::string sep = " data_path=null train_data_path=[" + prefix + "_train] train_iters=10";
  auto b = run_primus(tiny_run_args(both.str()) + sep + " valid_data_path=[" + prefix + "_valid] split=0.5");
  ASSERT_EQ(b.code, 0) << b.out;
  auto c = run_primus(tiny_run_args(alone.str()) + sep);
  ASSERT_EQ(c.code, 0) << c.out;
  const auto want = losses(out_dir(text) / "metrics.jsonl");
  ASSERT_EQ(want.size(), 10u);
  EXPECT_EQ(losses(out_dir(both) / "metrics.jsonl"), want);
  EXPECT_EQ(losses(out_dir(alone) / "metrics.jsonl"), want);
  EXPECT_FALSE(losses(out_dir(text) / "metrics.jsonl", "val_loss").empty());
  EXPECT_EQ(losses(out_dir(both) / "metrics.jsonl", "val_loss"), losses(out_dir(text) / "metrics.jsonl", "val_loss"));
  EXPECT_TRUE(losses(out_dir(alone) / "metrics.jsonl", "val_loss").empty()) << "no validation data";

  auto twice = run_primus(tiny_run_args(alone.str()) + " train_data_path=[" + prefix + "_train] --dry-run");
  EXPECT_EQ(twice.code, 2) << twice.out;
  EXPECT_NE(twice.out.find("train_data_path and data_path"), std::string::npos) << twice.out;
  auto txt = run_primus(tiny_run_args(alone.str()) + " data_path=null train_data_path=[" + std::string(PRIMUS_SOURCE_DIR) +
                        "/examples/data/tinyshakespeare.txt]");
  EXPECT_NE(txt.code, 0) << txt.out;
  EXPECT_NE(txt.out.find("is a text input"), std::string::npos) << txt.out;
}

// Megatron-LM's test data: evaluated once after the last step, eval_iters batches at the final
// weights. Given the validation data as test data, the test loss is the last validation loss to
// the bit (the two are shuffled alike); given other data, another number. A three-part split's
// test documents are the test data when test_data_path is unset; a text file is refused. (That a
// stop signal skips the test is the step loop's test.)
TEST(TrainE2E, TestDataIsEvaluatedOnceAfterTheLastStep) {
  Workdir text, same, other, split;
  ASSERT_EQ(run_primus(tiny_run_args(text.str()) + " train_iters=1").code, 0);
  const std::string prefix = (out_dir(text) / "data/tinyshakespeare-bytes").string();
  const std::string sep = " data_path=null train_data_path=[" + prefix + "_train] valid_data_path=[" + prefix +
                          "_valid] train_iters=6 eval_interval=3 eval_iters=3";
  auto a = run_primus(tiny_run_args(same.str()) + sep + " test_data_path=[" + prefix + "_valid]");
  ASSERT_EQ(a.code, 0) << a.out;
  EXPECT_NE(a.out.find("step 6 | test loss "), std::string::npos) << a.out;
  const auto val = losses(out_dir(same) / "metrics.jsonl", "val_loss");
  const auto test = losses(out_dir(same) / "metrics.jsonl", "test_loss");
  ASSERT_EQ(val.size(), 2u);
  ASSERT_EQ(test.size(), 1u);
  EXPECT_EQ(test[0], val[1]) << "step 6: the validation data as test data";

  auto b = run_primus(tiny_run_args(other.str()) + sep + " test_data_path=[" + prefix + "_train]");
  ASSERT_EQ(b.code, 0) << b.out;
  const auto test_b = losses(out_dir(other) / "metrics.jsonl", "test_loss");
  ASSERT_EQ(test_b.size(), 1u);
  EXPECT_EQ(losses(out_dir(other) / "metrics.jsonl", "val_loss"), val) << "the test data changes nothing else";
  EXPECT_NE(test_b[0].second, test[0].second);
  EXPECT_TRUE(std::isfinite(test_b[0].second));

  auto c = run_primus(tiny_run_args(split.str()) + " data_path=[" + prefix + "_train] split=80,10,10 train_iters=4");
  ASSERT_EQ(c.code, 0) << c.out;
  const auto test_c = losses(out_dir(split) / "metrics.jsonl", "test_loss");
  ASSERT_EQ(test_c.size(), 1u);
  EXPECT_EQ(test_c[0].first, 4);

  auto none = losses(out_dir(text) / "metrics.jsonl", "test_loss");
  EXPECT_TRUE(none.empty()) << "no test data: no test loss";
  auto txt = run_primus(tiny_run_args(other.str()) + " test_data_path=[" + std::string(PRIMUS_SOURCE_DIR) +
                        "/examples/data/tinyshakespeare.txt]");
  EXPECT_NE(txt.code, 0) << txt.out;
  EXPECT_NE(txt.out.find("test_data_path: "), std::string::npos) << txt.out;
  EXPECT_NE(txt.out.find("is a text input"), std::string::npos) << txt.out;
}

// no_load_optim (Megatron-LM's): a resume takes the weights, step, data position and learning-rate
// schedule but starts the optimizer afresh. The resumed step's loss is the uninterrupted run's; its
// update is a fresh AdamW's first, lr x g / (|g| + eps) = +-lr for every weight with a gradient
// well above eps (weight decay 0 here); the checkpoints it writes record the step the optimizer began at, so a
// plain resume of one counts AdamW's steps on from there (step 13 as the run that went on).
TEST(TrainE2E, NoLoadOptimResumesWithAFreshOptimizer) {
  Workdir base, fresh, on, resumed;
  const std::string args = " weight_decay=0";
  ASSERT_EQ(run_primus(tiny_run_args(base.str()) + args).code, 0);
  const fsys::path ck10 = out_dir(base) / "checkpoints/iter_0000010";
  const std::string from10 = args + " no_load_optim=true load=" + ck10.string();
  auto f = run_primus(tiny_run_args(fresh.str()) + from10 + " train_iters=11");
  ASSERT_EQ(f.code, 0) << f.out;
  EXPECT_NE(f.out.find("no_load_optim: the optimizer state starts afresh at step 10"), std::string::npos) << f.out;
  const auto lb = losses(out_dir(base) / "metrics.jsonl"), lf = losses(out_dir(fresh) / "metrics.jsonl");
  ASSERT_EQ(lf.size(), 1u);
  EXPECT_EQ(lf[0], lb[10]) << "step 11's loss comes before its update";
  const double lr = losses(out_dir(fresh) / "metrics.jsonl", "lr").at(0).second;
  const auto w10 = primus::io::SafetensorsFile::open(ck10 / "model.safetensors");
  const auto w11 = primus::io::SafetensorsFile::open(out_dir(fresh) / "checkpoints/iter_0000011/model.safetensors");
  int64_t moved = 0, unit = 0, total = 0;
  double largest = 0;
  for (const auto& t : w10.tensors()) {
    const auto a = w10.read_as<float>(t.name), b = w11.read_as<float>(t.name);
    for (size_t i = 0; i < a.size(); ++i) {
      const double d = std::fabs(double(b[i]) - double(a[i]));
      ++total;
      largest = std::max(largest, d);
      if (d == 0) continue;
      ++moved;
      unit += std::fabs(d - lr) <= 1e-2 * lr;
    }
  }
  // Never more than lr; exactly lr but where the gradient is near eps (the keys' weights and bias,
  // to which a nearly uniform attention gives little: 94% are lr here; a loaded optimizer's
  // m / sqrt(v) spreads them).
  EXPECT_LE(largest, 1.01 * lr);
  EXPECT_GT(moved, total * 9 / 10);
  EXPECT_GT(unit, moved * 85 / 100) << unit << " of " << moved << " moved weights by lr " << lr;
  const auto state = nlohmann::json::parse(
      primus::fs::read_file(out_dir(fresh) / "checkpoints/iter_0000011/trainer_state.json"));
  EXPECT_EQ(state.value("optimizer_step_base", int64_t{-1}), 10);

  ASSERT_EQ(run_primus(tiny_run_args(on.str()) + from10 + " train_iters=13").code, 0);
  auto r = run_primus(tiny_run_args(resumed.str()) + args + " train_iters=13 load=" +
                      (out_dir(fresh) / "checkpoints/iter_0000011").string());
  ASSERT_EQ(r.code, 0) << r.out;
  const auto lo = losses(out_dir(on) / "metrics.jsonl"), lr2 = losses(out_dir(resumed) / "metrics.jsonl");
  ASSERT_EQ(lo.size(), 3u);
  ASSERT_EQ(lr2.size(), 2u);
  EXPECT_EQ(lr2[1], lo[2]) << "step 13 follows step 12's update, AdamW's second";
}

// Megatron-LM's checkpoint switches. no_save_rng writes checkpoints without the RNG state; such a
// checkpoint resumes only with no_load_rng (Megatron-LM's rule), and then with the uninterrupted
// run's losses bit for bit (the data order is the seed's and the step's, not the RNG's).
// no_save_optim writes checkpoints without the optimizer state (the weights are the same); such
// a checkpoint resumes only with no_load_optim, and then gives the uninterrupted run's next loss.
// Primus' disable_last_saving carries over as what it says.
TEST(TrainE2E, MegatronCheckpointSwitchesDoWhatTheySay) {
  Workdir straight, cut, refused, resumed;
  auto a = run_primus(tiny_run_args(straight.str()));
  ASSERT_EQ(a.code, 0) << a.out;
  auto b = run_primus(tiny_run_args(cut.str()) + " train_iters=10 no_save_rng=true no_load_optim=false no_save_optim=false");
  ASSERT_EQ(b.code, 0) << b.out;
  const fsys::path ck = out_dir(cut) / "checkpoints/iter_0000010";
  const auto state = nlohmann::json::parse(primus::fs::read_file(ck / "trainer_state.json"));
  EXPECT_FALSE(state.contains("rng"));
  EXPECT_TRUE(nlohmann::json::parse(primus::fs::read_file(out_dir(straight) / "checkpoints/iter_0000010/trainer_state.json"))
                  .contains("rng"));
  auto r = run_primus(tiny_run_args(refused.str()) + " load=" + ck.string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("no_load_rng: true"), std::string::npos) << r.out;
  auto c = run_primus(tiny_run_args(resumed.str()) + " load=" + ck.string() + " no_load_rng=true");
  ASSERT_EQ(c.code, 0) << c.out;
  const auto la = losses(out_dir(straight) / "metrics.jsonl"), lc = losses(out_dir(resumed) / "metrics.jsonl");
  ASSERT_EQ(la.size(), 20u);
  ASSERT_EQ(lc.size(), 10u);
  for (size_t i = 0; i < lc.size(); ++i) EXPECT_EQ(lc[i], la[i + 10]) << "step " << lc[i].first;

  Workdir lean, fresh;
  auto n = run_primus(tiny_run_args(lean.str()) + " train_iters=10 no_save_optim=true");
  ASSERT_EQ(n.code, 0) << n.out;
  const fsys::path nk = out_dir(lean) / "checkpoints/iter_0000010";
  EXPECT_EQ(nlohmann::json::parse(primus::fs::read_file(nk / "trainer_state.json")).value("optimizer_state", true),
            false);
  EXPECT_TRUE(primus::io::SafetensorsFile::open(nk / "optimizer.safetensors").tensors().empty());
  EXPECT_FALSE(primus::io::SafetensorsFile::open(ck / "optimizer.safetensors").tensors().empty());
  EXPECT_TRUE(primus::fs::read_file(nk / "model.safetensors") == primus::fs::read_file(ck / "model.safetensors"));
  EXPECT_LT(fsys::file_size(nk / "optimizer.safetensors"), 1024u);
  auto t = run_primus(tiny_run_args(refused.str()) + " load=" + nk.string());
  EXPECT_EQ(t.code, 2) << t.out;
  EXPECT_NE(t.out.find("holds no optimizer state (saved with no_save_optim: true)"), std::string::npos) << t.out;
  auto f = run_primus(tiny_run_args(fresh.str()) + " train_iters=11 no_load_optim=true load=" + nk.string());
  ASSERT_EQ(f.code, 0) << f.out;
  const auto lf = losses(out_dir(fresh) / "metrics.jsonl");
  ASSERT_EQ(lf.size(), 1u);
  EXPECT_EQ(lf[0], la[10]) << "step 11's loss comes before its update";
  // Primus' disable_last_saving is save_at_end's opposite: 3 steps, no checkpoint before the end.
  for (const bool disable : {true, false}) {
    Workdir run;
    auto r = run_primus(tiny_run_args(run.str()) + " train_iters=3 save_interval=0 disable_last_saving=" +
                        (disable ? "true" : "false"));
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_EQ(fsys::exists(out_dir(run) / "checkpoints/iter_0000003"), !disable) << r.out;
  }
}
