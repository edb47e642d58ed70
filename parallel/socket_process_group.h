// The fallback host-memory ProcessGroup, used only where the Gloo plugin cannot be loaded (a
// binary carried to a machine without libgloo; see make_process_group): ranks form a ring of TCP connections (each rank listens on an
// ephemeral port, publishes host:port in the TcpStore, connects to the next rank and accepts the
// previous one). all_reduce is a ring reduce-scatter then a ring all-gather, so each rank sends
// about 2 x the buffer whatever the world size; Max takes the larger value where Sum adds. The NCCL
// group (parallel/cuda/nccl_process_group.h) has the same contract, see parallel/process_group.h.
//
// bf16 reductions accumulate in f32: the buffer is widened once, reduced as f32 (partial sums
// travel as f32) and rounded to bf16 once at the end, so the result does not depend on the
// ring's summation order more than an f32 sum does.
//
// Timeouts: a collective throws CollectiveError when no byte moves on a connection it waits on
// for timeout() (the peer stalled), or at once when a peer closes its connection (it died). The
// error names the operation, the peer rank and the timeout; the group is aborted after it.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "parallel/launch_env.h"
#include "parallel/process_group.h"
#include "parallel/socket.h"
#include "parallel/tcp_store.h"

namespace primus::parallel {

class SocketProcessGroup final : public ProcessGroup {
 public:
  // Rendezvous through `store` under the key prefix `name` (several groups may share a store
  // when their names differ). `host` is the address other ranks reach this one at (empty: the
  // local address of the route to the store's host, see local_address_towards). Throws
  // CollectiveError naming the rank it could not reach within `timeout`.
  SocketProcessGroup(TcpStore& store, int rank, int world_size, std::chrono::milliseconds timeout,
                     const std::string& name = "pg", const std::string& host = "", const std::string& store_host = "127.0.0.1");
  ~SocketProcessGroup() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend() const override { return "socket"; }
  std::chrono::milliseconds timeout() const override { return timeout_; }

  void all_reduce(void* buf, size_t count, DType dtype, ReduceOp op) override;
  void reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override;
  void all_gather(const void* send, void* recv, size_t count, DType dtype) override;
  void broadcast(void* buf, size_t count, DType dtype, int root) override;
  void barrier() override;
  void synchronize() override {}
  void abort() override;

 private:
  struct Op;  // the collective under way, for error messages
  // Sends `sn` bytes to the next rank while receiving `rn` bytes from the previous one.
  void exchange(const Op& op, const void* sbuf, size_t sn, void* rbuf, size_t rn);
  // f32 ring reduce-scatter in place over `buf` (a sum, or the max for ReduceOp::Max); chunk i is
  // [off[i], off[i+1]).
  void ring_reduce_scatter(const Op& op, float* buf, const std::vector<size_t>& off, ReduceOp rop);
  // ring all-gather in place over `buf` (bytes); chunk i is [off[i], off[i+1]) elements of `esize`.
  void ring_all_gather(const Op& op, char* buf, const std::vector<size_t>& off, size_t esize);
  void check_usable(const char* what) const;
  [[noreturn]] void fail(const Op& op, const std::string& msg);

  int rank_, world_;
  int next_, prev_;
  std::chrono::milliseconds timeout_;
  Fd to_next_, from_prev_;
  bool aborted_ = false;
  std::string abort_reason_;
  std::vector<float> scratch_, recv_tmp_;
};

// Collectives of a job of one: reductions leave the buffer as it is (Avg or Max of one value is
// the value), gathers and scatters copy.
class SingleProcessGroup final : public ProcessGroup {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string backend() const override { return "single"; }
  std::chrono::milliseconds timeout() const override { return std::chrono::milliseconds(0); }
  void all_reduce(void*, size_t, DType, ReduceOp) override {}
  void reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp) override;
  void all_gather(const void* send, void* recv, size_t count, DType dtype) override;
  void broadcast(void*, size_t, DType, int root) override;
  void barrier() override {}
  void all_to_all_v(const void* send, const std::vector<size_t>& send_counts, void* recv,
                    const std::vector<size_t>& recv_counts, DType dtype) override;
  std::unique_ptr<ProcessGroup> new_subgroup(const std::vector<int>& ranks, const std::string& name) override;
  void synchronize() override {}
  void abort() override {}
};

// The local address of the route from this host to `host` (no packet is sent): what the other
// ranks can reach this one at. PRIMUS_SOCKET_ADDR, when set, wins. Falls back to the hostname.
std::string local_address_towards(const std::string& host);

// The group of a launched job: world 1 -> SingleProcessGroup; else a GlooProcessGroup with
// env.timeout_s as its timeout, rendezvousing through `store` (whose host is env.master_addr);
// where the Gloo plugin cannot be loaded, a SocketProcessGroup, with a warning saying why.
std::unique_ptr<ProcessGroup> make_process_group(const DistEnv& env, TcpStore& store);

}  // namespace primus::parallel
