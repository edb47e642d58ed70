#include "data/prepare/prepare.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

#include "core/util/error.h"
#include "data/dataset/indexed_dataset.h"
#include "data/prepare/document_reader.h"
#include "data/tokenizer/tokenizer.h"

namespace primus::data {
namespace {

using Clock = std::chrono::steady_clock;

// Documents read together and encoded as one task: large enough that task overhead vanishes,
// small enough that workers stay busy and memory stays flat.
constexpr size_t kChunkBytes = 1 << 20;

struct Chunk {
  std::string text;
  std::vector<size_t> ends;  // document i is text[ends[i-1], ends[i])
  uint64_t input_bytes = 0;
};

struct Encoded {
  std::vector<int32_t> ids;
  std::vector<uint32_t> lengths;  // tokens per document, end-of-document included
  uint64_t input_bytes = 0;
};

Encoded encode_chunk(const Tokenizer& tok, const Chunk& c) {
  Encoded e;
  e.ids.reserve(c.text.size() / 3);
  e.lengths.reserve(c.ends.size());
  e.input_bytes = c.input_bytes;
  size_t begin = 0;
  for (size_t end : c.ends) {
    size_t before = e.ids.size();
    tok.encode_into(std::string_view(c.text).substr(begin, end - begin), e.ids);
    e.ids.push_back(tok.eod_id());
    e.lengths.push_back(static_cast<uint32_t>(e.ids.size() - before));
    begin = end;
  }
  return e;
}

// A fixed set of threads running tasks in submission order of their results: futures are
// collected front to back, so output order never depends on which worker finished first.
class WorkerPool {
 public:
  explicit WorkerPool(int n) {
    for (int i = 0; i < n; ++i) threads_.emplace_back([this] { run(); });
  }
  ~WorkerPool() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  std::future<Encoded> submit(std::function<Encoded()> fn) {
    std::packaged_task<Encoded()> task(std::move(fn));
    auto fut = task.get_future();
    {
      std::lock_guard lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
    return fut;
  }

 private:
  void run() {
    for (;;) {
      std::packaged_task<Encoded()> task;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<Encoded()>> tasks_;
  std::vector<std::thread> threads_;
  bool stop_ = false;
};

std::string format_duration(double s) {
  auto t = static_cast<long>(std::lround(s));
  return t >= 3600 ? fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60)
                   : fmt::format("{}:{:02}", t / 60, t % 60);
}

}  // namespace

bool is_validation_document(uint64_t i, double split) {
  // In integers (parts per million), so that 0.9 means exactly every tenth document: in
  // floating point 1 - 0.9 is a hair below 0.1 and would move the boundaries.
  const auto v = static_cast<uint64_t>(std::llround((1.0 - split) * 1e6));
  return (i + 1) * v / 1000000 > i * v / 1000000;
}

PrepareResult prepare_dataset(const PrepareOptions& o) {
  if (o.inputs.empty()) throw ConfigError("data prepare: no --input files");
  if (o.output_prefix.empty()) throw ConfigError("data prepare: --output-prefix is required");
  if (o.workers < 1) throw ConfigError(fmt::format("data prepare: --workers must be >= 1, got {}", o.workers));
  if (o.split && !(*o.split > 0.0 && *o.split < 1.0)) {
    throw ConfigError(fmt::format("data prepare: --split must be in (0, 1), got {}", *o.split));
  }
  auto tok = make_tokenizer(o.tokenizer);
  if (tok->eod_id() < 0) {
    throw ConfigError(fmt::format("tokenizer {} has no end-of-document token", tok->name()));
  }
  const DType dtype = dtype_for_vocab(tok->vocab_size());
  DocumentReader reader(o.inputs, o.json_key);

  std::vector<std::unique_ptr<IndexedDatasetWriter>> writers;
  if (o.split) {
    writers.push_back(std::make_unique<IndexedDatasetWriter>(o.output_prefix + "_train", dtype));
    writers.push_back(std::make_unique<IndexedDatasetWriter>(o.output_prefix + "_valid", dtype));
  } else {
    writers.push_back(std::make_unique<IndexedDatasetWriter>(o.output_prefix, dtype));
  }

  const auto start = Clock::now();
  auto last_report = start;
  uint64_t doc_index = 0, done_bytes = 0;
  auto write = [&](const Encoded& e) {
    size_t at = 0;
    for (uint32_t len : e.lengths) {
      size_t w = o.split && is_validation_document(doc_index, *o.split) ? 1 : 0;
      writers[w]->add_document(std::span<const int32_t>(e.ids.data() + at, len));
      at += len;
      ++doc_index;
    }
    done_bytes += e.input_bytes;
    auto now = Clock::now();
    if (o.progress && now - last_report >= std::chrono::seconds(1)) {
      last_report = now;
      double secs = std::chrono::duration<double>(now - start).count();
      double rate = static_cast<double>(done_bytes) / secs;
      double total = static_cast<double>(reader.total_bytes());
      double left = rate > 0 ? (total - static_cast<double>(done_bytes)) / rate : 0;
      std::fprintf(stderr, "data prepare: %.1f/%.1f MB (%.0f%%), %llu documents, %.2f MB/s, ETA %s\n",
                   static_cast<double>(done_bytes) / 1e6, total / 1e6,
                   total > 0 ? 100.0 * static_cast<double>(done_bytes) / total : 100.0,
                   static_cast<unsigned long long>(doc_index), rate / 1e6,
                   format_duration(left).c_str());
    }
  };

  auto read_chunk = [&](Chunk& c) {
    uint64_t before = reader.bytes_read();
    while (c.text.size() < kChunkBytes && reader.next(c.text)) c.ends.push_back(c.text.size());
    c.input_bytes = reader.bytes_read() - before;
    return !c.ends.empty() || c.input_bytes > 0;
  };

  if (o.workers == 1) {  // encode on this thread: one worker is one core
    for (Chunk c; read_chunk(c); c = Chunk()) write(encode_chunk(*tok, c));
  } else {
    WorkerPool pool(o.workers);
    std::deque<std::future<Encoded>> in_flight;
    const size_t depth = static_cast<size_t>(o.workers) * 2;
    for (Chunk c; read_chunk(c); c = Chunk()) {
      auto shared = std::make_shared<Chunk>(std::move(c));
      in_flight.push_back(pool.submit([&tok, shared] { return encode_chunk(*tok, *shared); }));
      if (in_flight.size() >= depth) {
        write(in_flight.front().get());
        in_flight.pop_front();
      }
    }
    while (!in_flight.empty()) {
      write(in_flight.front().get());
      in_flight.pop_front();
    }
  }

  PrepareResult r;
  for (auto& w : writers) {
    w->finalize();
    r.outputs.push_back({w->prefix(), w->documents(), w->tokens()});
  }
  r.dtype = dtype_name(dtype);
  r.input_bytes = reader.bytes_read();
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return r;
}

}  // namespace primus::data
