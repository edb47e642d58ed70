// The host-memory ProcessGroup on Gloo (the CPU engine PyTorch uses), over TCP. What the
// reference backend's data parallelism and CI use; the contract is parallel/process_group.h's.
//
// Gloo itself is in a plugin opened at first use (parallel/gloo/gloo_plugin_abi.h says why):
// gloo_plugin() finds it. Ranks meet through the job's TcpStore: each group's rendezvous keys sit
// under its name, so several groups (the world, its tp / cp / dp sub-groups) share one store.
//
// Reductions: f32 all_reduce is Gloo's ring; bf16 buffers are widened to f32, reduced, and rounded
// once. reduce_scatter is an all-to-all of the f32 chunks followed by a reduction in rank order, so
// its result does not depend on the transport's order. Avg divides the sum by the group's size.
// all_reduce's Max (the plugin's ring only sums) all-gathers every rank's values as f32 and takes
// the largest here: world_size x the buffer on the wire, which the small buffers it serves (FP8
// amaxes) afford.
//
// Who is missing: Gloo's errors name addresses, not ranks, and a timeout names nobody. So every
// process keeps a heartbeat in the store (a counter bumped every `heartbeat` on a store
// connection of its own, "left" when its world group is destroyed). When a call fails (a peer
// closed its connections, or nothing arrived within timeout()), the group reads its members'
// heartbeats twice a few periods apart and names the ranks whose counter stopped (dead, hung or
// stopped), that left, or that never joined:
//
//   all_reduce of 1000 f32 elements on rank 0/2 (gloo group 'pg'): Timed out waiting 1000ms for
//   recv operation to complete; missing: rank 1 (no heartbeat for 0.6 s: dead, hung or stopped)
//
// After an error the group is aborted and every later call throws at once. Creating a world
// group sets SIGPIPE to be ignored when it has its default action (a write to a dead peer must
// fail, not kill the process).
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "parallel/process_group.h"
#include "parallel/tcp_store.h"

struct PrimusGlooApi;

namespace primus::parallel {

// The Gloo plugin, opened on first use and kept: PRIMUS_GLOO_PLUGIN (a file; when set, the only
// place tried), else libprimus_gloo.so beside the running executable, else where this build put
// it. RuntimeError listing every place tried and why it failed (e.g. libgloo.so.0 missing).
const PrimusGlooApi& gloo_plugin();
// Whether gloo_plugin() succeeds; otherwise `why` (when given) receives its error.
bool gloo_plugin_available(std::string* why = nullptr);

class GlooProcessGroup final : public ProcessGroup {
 public:
  using Ms = std::chrono::milliseconds;
  // The world group of a job (or of a test): `world_size` ranks meet through `store` under the
  // key prefix `name`. store_host is the store's host (the heartbeats open their own connection
  // to it, at store.port()); host is the address this rank listens at (empty: the local end of
  // the route to store_host, or PRIMUS_SOCKET_ADDR). `store` must outlive the group and every
  // sub-group. Throws CollectiveError naming the ranks that did not join within `timeout`.
  GlooProcessGroup(TcpStore& store, const std::string& store_host, int rank, int world_size, Ms timeout,
                   const std::string& name = "pg", const std::string& host = "");
  ~GlooProcessGroup() override;

  int rank() const override { return rank_; }
  int world_size() const override { return static_cast<int>(members_.size()); }
  std::string backend() const override { return "gloo"; }
  Ms timeout() const override;
  // The world rank of each rank of this group (the identity for a world group).
  const std::vector<int>& members() const { return members_; }
  const std::string& name() const { return name_; }

  void all_reduce(void* buf, size_t count, DType dtype, ReduceOp op) override;
  void reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override;
  void all_gather(const void* send, void* recv, size_t count, DType dtype) override;
  void broadcast(void* buf, size_t count, DType dtype, int root) override;
  void barrier() override;
  void all_to_all(const void* send, void* recv, size_t count, DType dtype) override;
  void all_to_all_v(const void* send, const std::vector<size_t>& send_counts, void* recv,
                    const std::vector<size_t>& recv_counts, DType dtype) override;
  void send(const void* buf, size_t count, DType dtype, int peer, uint32_t tag = 0) override;
  void recv(void* buf, size_t count, DType dtype, int peer, uint32_t tag = 0) override;
  // Key prefix: this group's name + "/" + name.
  std::unique_ptr<ProcessGroup> new_subgroup(const std::vector<int>& ranks, const std::string& name) override;
  void synchronize() override {}
  void abort() override;

  struct Shared;  // the plugin, the store and the heartbeat, shared by a world group and its sub-groups

 private:
  GlooProcessGroup(std::shared_ptr<Shared> shared, std::vector<int> members, int rank, std::string name,
                   void* share_device_of);
  void connect(void* share_device_of);
  void check_usable(const std::string& what) const;
  // Aborts the group and throws CollectiveError: `what` on rank r/n, the plugin's text, who is missing.
  [[noreturn]] void fail(const std::string& what, const std::string& detail);
  // Runs a plugin call; a non-zero return fails the group.
  template <class F>
  void call(const std::string& what, F&& f);

  std::shared_ptr<Shared> shared_;
  std::vector<int> members_;
  int rank_ = 0;
  std::string name_;
  void* handle_ = nullptr;
  bool aborted_ = false;
  std::string abort_reason_;
  std::vector<float> f32_in_, f32_out_;  // widened bf16 buffers; reduce_scatter's chunks, Max's gather
};

}  // namespace primus::parallel
