// Decodes the event files with a minimal independent reader (TFRecord framing, masked CRC-32C,
// protobuf wire format) and checks every field.
#include "io/tensorboard.h"

#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include "io/crc32c.h"
#include "io_test_util.h"

namespace {

using namespace primus::io;
using primus::io::testing::read_bytes;
using primus::io::testing::write_bytes;

struct Event {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  std::vector<std::pair<std::string, float>> values;
};

struct Reader {
  std::string_view s;
  size_t pos = 0;
  bool done() const { return pos >= s.size(); }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (done()) throw std::runtime_error("truncated varint");
      uint8_t b = static_cast<uint8_t>(s[pos++]);
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    throw std::runtime_error("varint too long");
  }
  std::string_view take(size_t n) {
    if (pos + n > s.size()) throw std::runtime_error("field runs past the message");
    auto v = s.substr(pos, n);
    pos += n;
    return v;
  }
  template <class T>
  T fixed() {
    T v;
    std::memcpy(&v, take(sizeof(T)).data(), sizeof(T));
    return v;
  }
};

// Splits the file into records, checking both masked CRCs of each.
std::vector<std::string> read_records(const std::string& file) {
  std::vector<std::string> out;
  Reader r{file};
  while (!r.done()) {
    auto len_bytes = r.take(8);
    uint64_t len;
    std::memcpy(&len, len_bytes.data(), 8);
    uint32_t len_crc = r.fixed<uint32_t>();
    if (crc32c_mask(crc32c(len_bytes.data(), 8)) != len_crc) throw std::runtime_error("length CRC");
    auto data = r.take(len);
    uint32_t data_crc = r.fixed<uint32_t>();
    if (crc32c_mask(crc32c(data.data(), data.size())) != data_crc) throw std::runtime_error("data CRC");
    out.emplace_back(data);
  }
  return out;
}

std::pair<std::string, float> decode_value(std::string_view msg) {
  std::pair<std::string, float> v{"", std::nanf("")};
  Reader r{msg};
  while (!r.done()) {
    uint64_t key = r.varint();
    if (key == ((1 << 3) | 2)) v.first = std::string(r.take(r.varint()));
    else if (key == ((2 << 3) | 5)) v.second = r.fixed<float>();
    else throw std::runtime_error("unexpected field in Summary.Value");
  }
  return v;
}

Event decode_event(std::string_view msg) {
  Event e;
  Reader r{msg};
  while (!r.done()) {
    uint64_t key = r.varint();
    switch (key) {
      case (1 << 3) | 1: e.wall_time = r.fixed<double>(); break;
      case (2 << 3) | 0: e.step = static_cast<int64_t>(r.varint()); break;
      case (3 << 3) | 2: e.file_version = std::string(r.take(r.varint())); break;
      case (5 << 3) | 2: {
        Reader summary{r.take(r.varint())};
        while (!summary.done()) {
          if (summary.varint() != ((1 << 3) | 2)) throw std::runtime_error("unexpected Summary field");
          e.values.push_back(decode_value(summary.take(summary.varint())));
        }
        break;
      }
      default: throw std::runtime_error("unexpected Event field " + std::to_string(key));
    }
  }
  return e;
}

std::vector<Event> decode_file(const std::filesystem::path& p) {
  std::vector<Event> out;
  for (const auto& rec : read_records(read_bytes(p))) out.push_back(decode_event(rec));
  return out;
}

double now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

class TensorBoard : public primus::io::testing::TempDirTest {};

TEST_F(TensorBoard, ScalarsDecodeWithValidCrcsAndExactFields) {
  struct Scalar {
    std::string tag;
    float value;
    int64_t step;
  };
  std::vector<Scalar> want;
  std::uniform_real_distribution<float> val(-1e4f, 1e4f);
  std::vector<int64_t> steps{0, 1, 127, 128, 300, 1LL << 40, -5};  // varint edge cases
  for (size_t i = 0; i < 50; ++i) {
    int64_t step = i < steps.size() ? steps[i] : static_cast<int64_t>(rng_() % 1000000);
    want.push_back({i % 2 ? "train/loss" : "train/lr_" + std::to_string(i), val(rng_), step});
  }
  double t0 = now();
  std::filesystem::path path;
  {
    TensorBoardWriter tb(dir() / "tb");
    path = tb.path();
    for (const auto& s : want) tb.add_scalar(s.tag, s.value, s.step);
  }  // closed by the destructor
  double t1 = now();

  EXPECT_TRUE(std::regex_match(path.filename().string(),
                               std::regex(R"(events\.out\.tfevents\.\d{10}\.[^/]+)")))
      << path.filename();
  auto events = decode_file(path);
  ASSERT_EQ(events.size(), want.size() + 1);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_TRUE(events[0].values.empty());
  for (size_t i = 0; i < want.size(); ++i) {
    const Event& e = events[i + 1];
    EXPECT_EQ(e.step, want[i].step) << i;
    ASSERT_EQ(e.values.size(), 1u) << i;
    EXPECT_EQ(e.values[0].first, want[i].tag);
    EXPECT_EQ(e.values[0].second, want[i].value);  // bit-exact float
    EXPECT_GE(e.wall_time, t0 - 1);
    EXPECT_LE(e.wall_time, t1 + 1);
    EXPECT_TRUE(e.file_version.empty());
  }
}

TEST_F(TensorBoard, BatchedScalarsAndExplicitWallTime) {
  std::filesystem::path path;
  float a = random_floats(1)[0], b = random_floats(1)[0];
  {
    TensorBoardWriter tb(dir());
    path = tb.path();
    tb.add_scalars(42, {{"loss", a}, {"grad_norm", b}});
    tb.add_scalar("tokens_per_s", 1.5e6f, 43, 1700000000.25);
  }
  auto ev = decode_file(path);
  ASSERT_EQ(ev.size(), 3u);
  EXPECT_EQ(ev[1].step, 42);
  EXPECT_EQ(ev[1].values, (std::vector<std::pair<std::string, float>>{{"loss", a}, {"grad_norm", b}}));
  EXPECT_EQ(ev[2].wall_time, 1700000000.25);
}

TEST_F(TensorBoard, FlushesOnIntervalOnRequestAndAtClose) {
  TensorBoardWriter slow(dir() / "slow", /*flush_secs=*/3600);
  slow.add_scalar("x", 1.f, 1);
  EXPECT_EQ(decode_file(slow.path()).size(), 1u) << "only the header record is on disk yet";
  slow.flush();
  EXPECT_EQ(decode_file(slow.path()).size(), 2u);
  slow.add_scalar("x", 2.f, 2);
  slow.close();
  EXPECT_EQ(decode_file(slow.path()).size(), 3u);
  EXPECT_THROW(slow.add_scalar("x", 3.f, 3), primus::RuntimeError);

  TensorBoardWriter fast(dir() / "fast", /*flush_secs=*/0);
  fast.add_scalar("y", 1.f, 1);
  EXPECT_EQ(decode_file(fast.path()).size(), 2u) << "a zero interval flushes every record";
}

TEST_F(TensorBoard, WritersInTheSameSecondGetDistinctFiles) {
  TensorBoardWriter a(dir()), b(dir()), c(dir());
  EXPECT_NE(a.path(), b.path());
  EXPECT_NE(b.path(), c.path());
  EXPECT_NE(a.path(), c.path());
}

TEST_F(TensorBoard, DecoderRejectsACorruptedRecord) {
  std::filesystem::path path;
  {
    TensorBoardWriter tb(dir());
    path = tb.path();
    tb.add_scalar("loss", 2.5f, 10);
  }
  std::string bytes = read_bytes(path);
  bytes[bytes.size() - 6] ^= 0x10;  // inside the last record's data
  write_bytes(path, bytes);
  EXPECT_THROW(decode_file(path), std::runtime_error);
}

// Leaves a sample run and the values it holds in the build folder, for tests/io/tb_check.py to
// read with TensorBoard's own EventAccumulator (on a machine that has the tensorboard package).
TEST_F(TensorBoard, WritesSampleForTensorBoardCheck) {
  auto out = std::filesystem::path(PRIMUS_BINARY_DIR) / "tests" / "io" / "tb_sample";
  std::filesystem::remove_all(out);
  nlohmann::json expected = nlohmann::json::array();
  std::filesystem::path path;
  {
    TensorBoardWriter tb(out);
    path = tb.path();
    for (int step = 0; step < 20; ++step) {
      float loss = random_floats(1)[0] + 10.f - step * 0.3f;
      float lr = 6e-4f * (step + 1) / 20.f;
      tb.add_scalar("train/loss", loss, step);
      tb.add_scalar("train/lr", lr, step);
      expected.push_back({{"tag", "train/loss"}, {"step", step}, {"value", loss}});
      expected.push_back({{"tag", "train/lr"}, {"step", step}, {"value", lr}});
    }
  }
  primus::io::testing::write_bytes(out / "expected.json", expected.dump(1));
  EXPECT_EQ(decode_file(path).size(), 41u);
}

}  // namespace
