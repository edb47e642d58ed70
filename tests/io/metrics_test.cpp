#include "io/metrics.h"

#include <cmath>

#include "io_test_util.h"

namespace {

using namespace primus::io;
using nlohmann::json;
using primus::io::testing::expect_error;
using primus::io::testing::read_bytes;
using primus::io::testing::write_bytes;

class Metrics : public primus::io::testing::TempDirTest {};

TEST_F(Metrics, OneFlushedLinePerRecordAppendedAcrossRuns) {
  auto path = dir() / "run" / "metrics.jsonl";
  std::vector<json> want;
  {
    MetricsWriter m(path);
    for (int step = 1; step <= 5; ++step) {
      json r = {{"step", step}, {"loss", random_floats(1)[0]}, {"phase", "train"}};
      m.write(r);
      want.push_back(r);
      // Flushed per line: a reader sees the record while the writer is still open.
      EXPECT_EQ(read_jsonl(path).size(), want.size());
    }
  }
  {
    MetricsWriter resumed(path);  // a resumed run appends
    json r = {{"step", 6}, {"loss", random_floats(1)[0]}};
    resumed.write(r);
    want.push_back(r);
  }
  EXPECT_EQ(read_jsonl(path), want);
  std::string text = read_bytes(path);
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 6);
}

TEST_F(Metrics, TornLastLineIsDroppedOnReopen) {
  auto path = dir() / "metrics.jsonl";
  std::string big(10000, 'x');  // longer than one read block, so the search crosses blocks
  write_bytes(path, "{\"step\":1}\n{\"step\":2,\"note\":\"" + big);
  {
    MetricsWriter m(path);
    m.write({{"step", 3}});
  }
  EXPECT_EQ(read_jsonl(path), (std::vector<json>{{{"step", 1}}, {{"step", 3}}}));

  write_bytes(path, "{\"step\":");  // no complete line at all
  MetricsWriter m(path);
  m.write({{"step", 4}});
  EXPECT_EQ(read_jsonl(path), (std::vector<json>{{{"step", 4}}}));
}

TEST_F(Metrics, RefusesNonObjectsAndWritesNonFiniteAsNull) {
  auto path = dir() / "metrics.jsonl";
  MetricsWriter m(path);
  EXPECT_THROW(m.write(json::array({1, 2})), primus::RuntimeError);
  m.write({{"loss", std::nan("")}, {"inf", INFINITY}});
  auto rows = read_jsonl(path);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_TRUE(rows[0]["loss"].is_null());
  EXPECT_TRUE(rows[0]["inf"].is_null());
}

TEST_F(Metrics, MalformedLineIsNamedByFileAndNumber) {
  auto path = dir() / "metrics.jsonl";
  write_bytes(path, "{\"a\":1}\n\n{\"b\":2}\nnot json\n");
  expect_error<primus::FormatError>([&] { read_jsonl(path); }, {path.string(), "line 4"});
  write_bytes(path, "{\"a\":1}\n[1,2]\n");
  expect_error<primus::FormatError>([&] { read_jsonl(path); }, {path.string(), "line 2", "object"});
}

}  // namespace
