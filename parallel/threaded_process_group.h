// A ProcessGroup whose ranks are threads of one process: N ranks of a job run side by side (on
// the CPU, or on one GPU with parallel/cuda/threaded_device_ops.h), so the tensor-, context- and
// data-parallel code paths run, and can be compared with one rank, on a machine with a single
// device. The contract is parallel/process_group.h's, all of it: all_reduce, reduce_scatter,
// all_gather (in place or not), broadcast, barrier, all_to_all(_v), tagged send/recv,
// new_subgroup, synchronize and abort.
//
// Usage (one hub per job, one thread per rank):
//
//   auto hub = parallel::ThreadedGroup::create(4, std::chrono::seconds(30));
//   std::vector<std::thread> ranks;
//   for (int r = 0; r < 4; ++r) ranks.emplace_back([&, r] {
//     std::unique_ptr<parallel::ProcessGroup> pg = hub->rank(r);
//     auto tp = pg->new_subgroup(...);  // as with any other group
//     train(*pg);
//   });
//
// How a collective works: every rank posts its buffer pointers (and counts) in the hub and waits
// for all the others; since the ranks share one address space, each then reads the others'
// buffers directly, through the hub's MemoryOps (memcpy on the host, copies and a reduction
// kernel on the rank's CUDA stream for device memory). A last rendezvous keeps every rank in the
// call until no other rank still reads its buffers. Collectives are therefore synchronous: they
// return with the result in place (the device ones after synchronizing the rank's stream).
//
// Results do not depend on thread timing: a reduction sums the ranks' values in rank order,
// accumulating in f32 (bf16 inputs widened, the result rounded to bf16 once, like the Gloo and
// socket groups), and Avg divides that sum by the group's size; Max takes the largest instead.
// An all_reduce reduces chunk r of the buffer on rank r, then every rank copies the other chunks,
// so all ranks hold the same bits.
//
// The ranks must agree: a collective whose kind, count, dtype, root or op differ between ranks,
// or all_to_all_v counts that do not pair up, throws CollectiveError on every rank, listing what
// each called. A rank that does not arrive within timeout() makes the others throw
// CollectiveError naming the operation, the missing rank(s) (world rank, and group rank in a
// sub-group) and what each missing rank last called; one whose group was destroyed is named at
// once. After any error the group (and its sub-groups) is aborted and every later call throws.
#pragma once
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "parallel/process_group.h"

namespace primus::parallel {

// How a rank reaches buffers: its own and, during a collective, its peers'. One per rank (each
// rank's thread calls only its own). Work may be asynchronous until synchronize().
class MemoryOps {
 public:
  virtual ~MemoryOps() = default;
  // `bytes` from src to dst; the ranges do not overlap.
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // dst[i] = srcs[0][i] + ... + srcs[k-1][i] for i < count, added in that order in f32 (bf16
  // widened), divided by k for Avg, rounded to dtype once; for Max the largest of them
  // (parallel::reduce_step). dst may be one of srcs; no other overlap.
  virtual void reduce(void* dst, const void* const* srcs, size_t k, size_t count, DType dtype, ReduceOp op) = 0;
  // Returns when the work issued so far on this rank's buffers has finished: both this object's
  // copies and reductions and the rank's own producers (for device memory, its stream).
  virtual void synchronize() = 0;
};

// Host memory: memcpy and a plain loop; synchronous, so synchronize() has nothing to wait for.
class HostMemoryOps final : public MemoryOps {
 public:
  void copy(void* dst, const void* src, size_t bytes) override;
  void reduce(void* dst, const void* const* srcs, size_t k, size_t count, DType dtype, ReduceOp op) override;
  void synchronize() override {}
};

// The hub that the ranks of one job share. Thread-safe; every rank's group (and sub-group) holds
// a reference to it, so the caller may drop its own first.
class ThreadedGroup {
 public:
  using Ms = std::chrono::milliseconds;
  // The MemoryOps of world rank r (called once per rank, from rank()).
  using OpsFactory = std::function<std::unique_ptr<MemoryOps>(int rank)>;

  // A job of `world_size` ranks; `ops` (empty: HostMemoryOps for every rank) says where buffers
  // live. `name` appears in error messages; sub-groups are named `name`/<sub-group name>.
  static std::shared_ptr<ThreadedGroup> create(int world_size, Ms timeout, OpsFactory ops = {},
                                               const std::string& name = "world");

  // World rank r's group, backend() "threads". Each rank is taken once (a second call throws
  // CollectiveError); the group is used by one thread at a time. Destroying it tells the other
  // ranks that it left: their waits for it fail at once, naming it.
  std::unique_ptr<ProcessGroup> rank(int r);

  int world_size() const;
  Ms timeout() const;

  // Wakes every rank waiting in this job's groups (sub-groups included) with CollectiveError
  // carrying `reason`; every later call throws it too. What a signal handler's shutdown or a
  // test's supervisor calls; a rank's ProcessGroup::abort() does the same.
  void abort(const std::string& reason);

  class Hub;  // the rendezvous state of one group (the world or a sub-group)

 private:
  ThreadedGroup(std::shared_ptr<Hub> hub, OpsFactory ops);
  std::shared_ptr<Hub> hub_;
  OpsFactory ops_;
};

}  // namespace primus::parallel
