// A vote of every rank of a job through its TCP store (tcp_store.h), on the hosts alone: no
// process group takes part, so a rank can vote while collectives it has already queued on a GPU
// stream are still waiting for their step. The cuda trainer agrees on a stop signal with it in a
// job that is one tensor-parallel group, where the next step's collectives are launched before
// the current step is finished (launch-ahead): a vote through the group would queue behind them.
//
// Each round is one counter key: every rank adds 1 + world x its flag, so the rank whose add
// makes the count of arrivals whole (the total a multiple of world) is the last; it publishes
// the result under a second key and removes the round before's two keys (every rank has read
// them once all have arrived here). The others poll for the result (check() never blocks, so the
// store stays free for the other threads that share it, e.g. heartbeats).
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

namespace primus::parallel {

class TcpStore;

class StoreVote {
 public:
  // `name`: the keys' prefix (one per vote of the job); `world`: the ranks that vote; `timeout`:
  // how long a round may wait for the last rank.
  StoreVote(TcpStore& store, std::string name, int world, std::chrono::milliseconds timeout);

  // Every rank calls it, the same number of times: whether any rank passed true this round.
  // Throws RuntimeError naming `what`, the round and how many ranks had voted when the timeout
  // passes (a rank stuck or gone).
  bool any(bool flag, const std::string& what);

  int64_t rounds() const { return round_; }

 private:
  TcpStore& store_;
  std::string name_;
  int world_;
  std::chrono::milliseconds timeout_;
  int64_t round_ = 0;
};

}  // namespace primus::parallel
