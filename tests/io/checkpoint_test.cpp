#include "io/checkpoint.h"

#include <nlohmann/json.hpp>

#include "checkpoint_test_util.h"
#include "core/util/fs.h"

namespace {

using namespace primus::io;
using primus::FormatError;
using primus::io::testing::expect_error;
using primus::io::testing::read_bytes;
using primus::io::testing::write_bytes;

class Checkpoint : public primus::io::testing::CheckpointTest {
 protected:
  // Flips one random bit of `file` inside the byte range [from, size).
  void flip_bit(const std::filesystem::path& file, size_t from = 0) {
    std::string b = read_bytes(file);
    ASSERT_GT(b.size(), from);
    size_t at = from + rng_() % (b.size() - from);
    b[at] = static_cast<char>(b[at] ^ (1 << (rng_() % 8)));
    write_bytes(file, b);
  }
};

TEST_F(Checkpoint, SaveLoadRoundTrip) {
  auto data = make_data(100);
  auto dir = save_checkpoint(save_dir(), 100, data);
  EXPECT_EQ(dir, save_dir() / "iter_0000100");
  EXPECT_EQ(tracker(), "100");
  for (const char* f : {kModelFile, kOptimizerFile, kStateFile, kManifestFile}) {
    EXPECT_TRUE(std::filesystem::is_regular_file(dir / f)) << f;
  }
  EXPECT_TRUE(entries(".").empty()) << "temporary folders left behind";

  auto manifest = nlohmann::json::parse(read_bytes(dir / kManifestFile));
  EXPECT_EQ(manifest["iteration"], 100);
  EXPECT_EQ(manifest["files"][kModelFile]["size"], std::filesystem::file_size(dir / kModelFile));

  auto latest = find_latest(save_dir());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->iteration, 100);
  EXPECT_EQ(latest->dir, dir);
  CheckpointData back = load_checkpoint(latest->dir);
  expect_same(data, back);
  // Loaded tensors are in-place views of the mapped file, aligned for their element type.
  auto wte = back.model.at("transformer.wte.weight").as<float>();
  EXPECT_EQ(wte.size(), data.model.at("transformer.wte.weight").numel());
  EXPECT_EQ(back.optimizer.at("step").as<int64_t>()[0], 100);
}

TEST_F(Checkpoint, SavesBorrowedTrainerBuffersWithoutCopy) {
  std::vector<float> weights = random_floats(4096);
  CheckpointData d;
  d.model["lm_head.weight"] = TensorBlob::borrow(DType::F32, {64, 64}, weights.data(), weights.size() * 4);
  d.state = {{"step", 7}};
  save_checkpoint(save_dir(), 7, d);
  auto back = load_checkpoint(checkpoint_dir(save_dir(), 7));
  EXPECT_TRUE(back.optimizer.empty());
  auto w = back.model.at("lm_head.weight").to_vector<float>();
  EXPECT_EQ(w, weights);
}

TEST_F(Checkpoint, TruncatedFileIsNamedOnLoad) {
  auto dir = save_checkpoint(save_dir(), 100, make_data(100));
  auto f = dir / kOptimizerFile;
  std::filesystem::resize_file(f, std::filesystem::file_size(f) - 1 - rng_() % 100);
  expect_error<FormatError>([&] { load_checkpoint(dir); },
                            {dir.string(), kOptimizerFile, "truncated"});
  expect_error<FormatError>([&] { verify_checkpoint(dir, true); }, {dir.string(), kOptimizerFile});
}

TEST_F(Checkpoint, FlippedBitIsNamedOnLoad) {
  for (const char* file : {kModelFile, kOptimizerFile, kStateFile}) {
    auto dir = save_checkpoint(save_dir(), 100, make_data(100));
    flip_bit(dir / file);
    expect_error<FormatError>([&] { load_checkpoint(dir); }, {dir.string(), file, "checksum"});
    expect_error<FormatError>([&] { verify_checkpoint(dir); }, {dir.string(), file, "checksum"});
    EXPECT_NO_THROW(verify_checkpoint(dir, /*sizes_only=*/true));  // same size: only the CRC sees it
  }
}

TEST_F(Checkpoint, MissingFileOrManifestIsNamed) {
  auto dir = save_checkpoint(save_dir(), 100, make_data(100));
  std::filesystem::remove(dir / kStateFile);
  expect_error<FormatError>([&] { load_checkpoint(dir); }, {dir.string(), kStateFile, "missing"});
  std::filesystem::remove(dir / kManifestFile);
  expect_error<FormatError>([&] { load_checkpoint(dir); }, {dir.string(), kManifestFile, "missing"});
  write_bytes(dir / kManifestFile, "{\"format\": \"primus.checkpoint\", ");
  expect_error<FormatError>([&] { load_checkpoint(dir); }, {dir.string(), kManifestFile, "JSON"});
}

TEST_F(Checkpoint, FindLatestFallsBackToNewestCompleteCheckpoint) {
  EXPECT_FALSE(find_latest(save_dir()).has_value());  // no folder yet
  auto d100 = save_checkpoint(save_dir(), 100, make_data(100));
  auto d200 = save_checkpoint(save_dir(), 200, make_data(200));
  EXPECT_EQ(find_latest(save_dir())->iteration, 200);

  // The tracker names a checkpoint whose file is truncated: the previous one is used.
  auto f = d200 / kModelFile;
  std::filesystem::resize_file(f, std::filesystem::file_size(f) / 2);
  EXPECT_EQ(find_latest(save_dir())->iteration, 100);

  // The tracker is gone or unreadable: the newest complete directory, checksums verified.
  std::filesystem::remove_all(d200);
  auto d300 = save_checkpoint(save_dir(), 300, make_data(300));
  flip_bit(d300 / kStateFile);
  std::filesystem::remove(save_dir() / kTrackerFile);
  EXPECT_EQ(find_latest(save_dir())->iteration, 100);
  write_bytes(save_dir() / kTrackerFile, "release");
  EXPECT_EQ(find_latest(save_dir())->iteration, 100);
  EXPECT_EQ(find_latest(save_dir())->dir, d100);
}

TEST_F(Checkpoint, KeepsLastK) {
  SaveOptions opts;
  opts.keep_last = 2;
  for (int it : {10, 20, 30, 40}) save_checkpoint(save_dir(), it, make_data(it, 100), opts);
  EXPECT_EQ(list_checkpoints(save_dir()), (std::vector<int64_t>{30, 40}));
  EXPECT_EQ(tracker(), "40");
  EXPECT_TRUE(entries(".").empty());
  // Saving an older iteration (a rollback) never prunes the one just saved, which the tracker
  // now names.
  save_checkpoint(save_dir(), 5, make_data(5, 100), opts);
  EXPECT_EQ(list_checkpoints(save_dir()), (std::vector<int64_t>{5, 30, 40}));
  EXPECT_EQ(find_latest(save_dir())->iteration, 5);
  // keep_last = 0 keeps everything.
  for (int it : {50, 60, 70}) save_checkpoint(save_dir(), it, make_data(it, 100));
  EXPECT_EQ(list_checkpoints(save_dir()).size(), 6u);
}

TEST_F(Checkpoint, ResavingAnIterationReplacesItWhole) {
  auto first = make_data(100);
  save_checkpoint(save_dir(), 100, first);
  auto second = make_data(100, 2000);
  save_checkpoint(save_dir(), 100, second);
  expect_same(second, load_checkpoint(checkpoint_dir(save_dir(), 100)));
  EXPECT_EQ(entries(), (std::vector<std::string>{"iter_0000100", kTrackerFile}));
}

TEST_F(Checkpoint, StaleTemporariesOfDeadProcessesAreRemovedOnNextSave) {
  std::filesystem::create_directories(save_dir());
  // A pid that is certainly finished: a child we started and reaped.
  pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ::waitpid(dead, nullptr, 0);
  auto tmp = save_dir() / fmt::format(".iter_0000200.tmp-{}", dead);
  auto del = save_dir() / fmt::format(".iter_0000050.del-{}", dead);
  auto live = save_dir() / fmt::format(".iter_0000300.tmp-{}", ::getppid());
  for (const auto& d : {tmp, del, live}) {
    std::filesystem::create_directories(d);
    write_bytes(d / kModelFile, "partial");
  }
  save_checkpoint(save_dir(), 100, make_data(100, 100));
  EXPECT_FALSE(std::filesystem::exists(tmp));
  EXPECT_FALSE(std::filesystem::exists(del));
  EXPECT_TRUE(std::filesystem::exists(live)) << "a live process's save must not be touched";
  EXPECT_EQ(list_checkpoints(save_dir()), (std::vector<int64_t>{100}));
}

TEST_F(Checkpoint, FailedSaveLeavesNothingBehind) {
  save_checkpoint(save_dir(), 100, make_data(100, 100));
  CheckpointData bad = make_data(200, 100);
  bad.state = {{"name", std::string("\xff\xfe", 2)}};  // invalid UTF-8 cannot be written as JSON
  EXPECT_THROW(save_checkpoint(save_dir(), 200, bad), primus::RuntimeError);
  EXPECT_EQ(entries(), (std::vector<std::string>{"iter_0000100", kTrackerFile}));
  EXPECT_EQ(tracker(), "100");
}

}  // namespace
