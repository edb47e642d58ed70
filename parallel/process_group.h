// Collectives across the ranks of a job, independent of where the buffers live. Implementations:
// `GlooProcessGroup` (parallel/, host memory, Gloo over TCP; what the reference backend and CI
// use), `SocketProcessGroup` (a hand-written TCP ring, used only where the Gloo plugin cannot be
// loaded), the NCCL one (parallel/cuda, device memory, NCCL loaded at run time) and the threaded
// one (parallel/threaded_process_group.h: ranks as threads of one process, host or device memory,
// for checking model-parallel code on one GPU). Trainers see only this interface, so data parallelism and ZeRO-1 are
// written once per backend against it and tested on the CPU.
//
// Contract for every collective:
// - every rank calls the same collectives in the same order with the same counts and dtype;
// - `count` is elements of `dtype`; buffers are host pointers for the Gloo and socket groups, device
//   pointers for NCCL (the call is then enqueued on the group's stream and returns at once);
// - reduce_scatter and all_gather split a buffer of count * world_size elements into world_size
//   equal, contiguous chunks in rank order (NCCL's layout);
// - reductions: Sum; Avg, the sum divided by world_size; Max, the largest value, where a NaN gives
//   way to a number (IEEE maxNum, what NCCL's max does), so that every engine agrees. Max is
//   exact in either dtype (the result is one of the inputs);
// - a peer that dies, or does not join within `timeout()`, makes the call throw
//   parallel::CollectiveError naming the operation, the peer rank(s) it waited for and the
//   timeout, never a silent hang; after an error the group is unusable (abort()ed).
#pragma once
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/util/error.h"

namespace primus::parallel {

enum class DType { F32, BF16 };
enum class ReduceOp { Sum, Avg, Max };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
const char* reduce_op_name(ReduceOp op);  // "sum" | "avg" | "max"

// One step of a reduction in f32, as the host engines take it in rank order: Sum and Avg add (Avg
// divides the total once, at the end), Max keeps the larger (std::fmax: a NaN gives way).
inline float reduce_step(ReduceOp op, float acc, float x) { return op == ReduceOp::Max ? std::fmax(acc, x) : acc + x; }

// A collective failed or timed out. what() names the op, the rank(s) and the timeout.
struct CollectiveError : RuntimeError {
  using RuntimeError::RuntimeError;
};

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string backend() const = 0;  // "gloo" | "socket" | "nccl" | "threads" | "single"
  virtual std::chrono::milliseconds timeout() const = 0;

  // In place: buf holds this rank's input and receives the reduction.
  virtual void all_reduce(void* buf, size_t count, DType dtype, ReduceOp op) = 0;
  // send holds count * world_size elements; recv (count elements) receives this rank's chunk
  // of the reduction. send and recv must not overlap except recv == send + rank * count.
  virtual void reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) = 0;
  // send holds count elements; recv (count * world_size) receives every rank's send in rank
  // order. send may be recv + rank * count (in place).
  virtual void all_gather(const void* send, void* recv, size_t count, DType dtype) = 0;
  virtual void broadcast(void* buf, size_t count, DType dtype, int root) = 0;
  virtual void barrier() = 0;

  // The collectives below are Gloo's (and the job of one's); another engine throws
  // CollectiveError saying it does not have them yet.
  //
  // send holds count * world_size elements, chunk r going to rank r; recv (count * world_size)
  // receives rank r's chunk for this rank at chunk r. send and recv must not overlap.
  virtual void all_to_all(const void* send, void* recv, size_t count, DType dtype);
  // Variable sizes: send_counts[r] elements (consecutive in send, in rank order) go to rank r;
  // recv_counts[r] elements come from rank r. Rank q's send_counts[r] must equal rank r's
  // recv_counts[q]. Both vectors have world_size entries.
  virtual void all_to_all_v(const void* send, const std::vector<size_t>& send_counts, void* recv,
                            const std::vector<size_t>& recv_counts, DType dtype);
  // Point to point, blocking until the buffer may be reused. A send to `peer` with `tag` matches
  // that peer's recv from this rank with the same tag; count and dtype must agree. A send may
  // wait until the peer has posted the matching recv (Gloo's does), so two ranks that both send
  // first deadlock until the timeout: order them (one sends while the other receives).
  virtual void send(const void* buf, size_t count, DType dtype, int peer, uint32_t tag = 0);
  virtual void recv(void* buf, size_t count, DType dtype, int peer, uint32_t tag = 0);
  // One step of a ring: `count` elements at `send` to rank `to` while `count` elements arrive at
  // `recv` from rank `from` (send and recv must not overlap). Every rank of the ring calls it at
  // once. This default orders blocking send and recv so that no two ranks both wait to send (even
  // ranks send first, odd ranks receive first); NCCL overrides it with one grouped send/recv. A
  // rank that is its own peer copies.
  virtual void send_recv(const void* send, int to, void* recv, int from, size_t count, DType dtype, uint32_t tag = 0);
  // The group of the given ranks of this group (ranks in this group's numbering, ascending order
  // not required: the sub-group's rank i is ranks[i]). Called by the members only, every member
  // with the same ranks and name; several sub-groups must differ in name (the store keys of their
  // rendezvous are prefixed with it). Throws CollectiveError naming a member that does not join
  // within timeout().
  virtual std::unique_ptr<ProcessGroup> new_subgroup(const std::vector<int>& ranks, const std::string& name);
  // Waits until every collective issued so far has finished (a no-op for the host groups).
  virtual void synchronize() = 0;
  // Gives up on in-flight work and closes the group (after an error, or on shutdown by signal).
  virtual void abort() = 0;
};

}  // namespace primus::parallel
