#include "parallel/store_vote.h"

#include <fmt/format.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "core/util/error.h"
#include "parallel/tcp_store.h"

namespace primus::parallel {

StoreVote::StoreVote(TcpStore& store, std::string name, int world, std::chrono::milliseconds timeout)
    : store_(store), name_(std::move(name)), world_(world), timeout_(timeout) {
  if (world_ < 1) throw RuntimeError(fmt::format("store vote '{}': {} ranks", name_, world_));
}

bool StoreVote::any(bool flag, const std::string& what) {
  const int64_t n = round_++;
  const std::string key = fmt::format("{}/{}", name_, n), result = key + "/result";
  const int64_t total = store_.add(key, 1 + (flag ? world_ : 0));
  if (total % world_ == 0) {  // arrivals + world x flags: the arrivals are complete
    store_.set(result, total / world_ > 1 ? "1" : "0");
    if (n > 0) {
      const std::string before = fmt::format("{}/{}", name_, n - 1);
      store_.remove(before);
      store_.remove(before + "/result");
    }
  }
  // Poll: a round normally waits for the slowest rank's step, milliseconds.
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout_;
  auto pause = std::chrono::microseconds(50);
  while (!store_.check({result})) {
    if (Clock::now() >= deadline) {
      const int64_t now = store_.add(key, 0);
      throw RuntimeError(fmt::format("{}: {} of {} ranks voted in round {} within {:.1f} s (the others are stuck or "
                                     "gone)",
                                     what, now % world_, world_, n, std::chrono::duration<double>(timeout_).count()));
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(2000));
  }
  return store_.get(result) == "1";
}

}  // namespace primus::parallel
