// parallel::ProcessGroup on NCCL (loaded at run time, parallel/nccl_library.h): device buffers, every
// collective enqueued on the group's own CUDA stream (callers order their streams against it
// with events, see record()/wait_on()).
//
// Faults never hang. The communicator is non-blocking (NCCL config blocking=0), and a watchdog
// thread polls ncclCommGetAsyncError and the completion of each enqueued collective: a NCCL
// error, or a collective still running after timeout(), aborts the communicator (its kernels
// then return), and the next call on the group, synchronize() included, throws
// parallel::CollectiveError naming the operation, the timeout and the missing rank(s). Which ranks
// are missing comes from heartbeats: every rank bumps a counter in the TCP store each second
// (on its own connection), with the number of collectives it has issued, and the watchdog
// reports the ranks whose counter stopped (dead, hung, or stopped by a signal), that left the
// group or never joined, or, when all are alive, those that have issued fewer collectives
// (stuck outside NCCL); an unreachable store means rank 0, which hosts it, is gone. If the thread that uses the group does not pick the error up
// (blocked elsewhere), the watchdog prints it and ends the process (exit 3) a grace period later.
//
// NCCL_NVLS_ENABLE=0 is set before the communicator is created unless the user set it.
#pragma once
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "parallel/launch_env.h"
#include "parallel/nccl_library.h"
#include "parallel/process_group.h"
#include "parallel/tcp_store.h"

namespace primus::parallel {

struct NcclGroupOptions {
  int device = 0;                                   // CUDA device of this rank (LOCAL_RANK)
  std::chrono::milliseconds timeout{300000};         // per collective, and for the setup
  std::chrono::milliseconds heartbeat{1000};         // heartbeat period
  std::chrono::milliseconds grace{30000};            // then the watchdog ends a process that ignores the error
  std::string name = "world";                        // store keys are primus/nccl/<name>/...
  // A group of some of the job's ranks (the env given to the constructor then holds the rank in
  // the group and the group's size): the members' global ranks, in group order, so that messages
  // name the ranks a user sees. Empty: the group is the whole job.
  std::vector<int> ranks;
};

class NcclProcessGroup : public parallel::ProcessGroup {
 public:
  // Collective over every rank: rank 0 makes the NCCL id and set()s it in `store`, the others
  // get() it; then the communicator is created on opt.device. `env` says where the store is
  // (the group opens its own connections for heartbeats). Throws CollectiveError when a rank
  // does not join within the timeout (naming it), RuntimeError when NCCL cannot be loaded.
  NcclProcessGroup(parallel::TcpStore& store, const parallel::DistEnv& env, const NcclGroupOptions& opt);
  // The group of the job's `ranks` (global, in group order; this rank among them): its own
  // communicator, its store keys under `opt.name`, which must differ between groups. Called by
  // the members only, each group's members in the same order as the other groups they join.
  static std::shared_ptr<NcclProcessGroup> subgroup(parallel::TcpStore& store, const parallel::DistEnv& job,
                                                    const std::vector<int>& ranks, NcclGroupOptions opt);
  ~NcclProcessGroup() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend() const override { return "nccl"; }
  std::chrono::milliseconds timeout() const override { return opt_.timeout; }

  void all_reduce(void* buf, size_t count, parallel::DType dtype, parallel::ReduceOp op) override;
  void reduce_scatter(const void* send, void* recv, size_t count, parallel::DType dtype, parallel::ReduceOp op) override;
  void all_gather(const void* send, void* recv, size_t count, parallel::DType dtype) override;
  // One grouped ncclSend / ncclRecv on the group's stream (a ring step; device buffers).
  void send_recv(const void* send, int to, void* recv, int from, size_t count, parallel::DType dtype,
                 uint32_t tag = 0) override;
  // One grouped set of ncclSend / ncclRecv on the group's stream, a peer's chunks consecutive in
  // rank order (device buffers; counts of 0 skip the peer).
  void all_to_all_v(const void* send, const std::vector<size_t>& send_counts, void* recv,
                    const std::vector<size_t>& recv_counts, parallel::DType dtype) override;
  void broadcast(void* buf, size_t count, parallel::DType dtype, int root) override;
  void barrier() override;
  void synchronize() override;
  void abort() override;

  cudaStream_t stream() const { return stream_; }
  // Stream ordering: the group's stream waits for `other`'s work so far; `other` waits for the
  // group's collectives so far.
  void wait_for(cudaStream_t other);
  void make_wait(cudaStream_t other);
  // Collectives on host buffers, staged through the device (NCCL moves device memory only);
  // synchronising. all_gather_host: every rank's `bytes` at `send` into `recv` (bytes x world, rank
  // order), e.g. a checkpoint's shard digests (parallel::HostAllGather). all_reduce_host: `data`
  // summed over the ranks in place, through a device buffer of at most 256 MiB at a time.
  void all_gather_host(const void* send, void* recv, size_t bytes);
  void all_reduce_host(float* data, size_t count);
  // Throws the recorded CollectiveError, if any (cheap; call it between steps).
  void check() const;
  const parallel::nccl::Library& library() const { return *lib_; }

 private:
  struct Pending {
    cudaEvent_t done;
    std::string op;
    std::chrono::steady_clock::time_point start;
  };
  template <class F>
  void enqueue(const std::string& op, F&& call);
  void wait_ready(const std::string& op);  // non-blocking comm: wait until the last call is enqueued
  void fail(const std::string& message);   // record the error, abort the communicator
  std::string diagnose();                  // which ranks are missing, from the heartbeats
  void heartbeat_loop();
  void watchdog_loop();
  std::string key(const std::string& what) const;
  std::string rank_name(int r) const;  // "rank G" (G global), and the group's own rank r in a subgroup

  const parallel::nccl::Library* lib_ = nullptr;
  parallel::DistEnv env_;
  NcclGroupOptions opt_;
  int rank_ = 0, world_ = 1;
  parallel::nccl::comm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  float* scratch_ = nullptr;  // barrier()'s one float
  std::atomic<uint64_t> seq_{0};  // collectives issued (published with the heartbeat)

  std::unique_ptr<parallel::TcpStore> hb_store_;  // heartbeats and diagnosis (own connection)
  std::mutex hb_mu_;
  std::mutex mu_;       // pending_, free_events_, error_
  std::mutex comm_mu_;  // every NCCL call on comm_ after setup: the watchdog's abort never races one
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> free_events_;
  std::string error_;
  std::atomic<bool> error_seen_{false}, aborted_{false}, stop_{false};
  std::thread heartbeat_, watchdog_;
};

}  // namespace primus::parallel
