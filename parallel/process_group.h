// Collectives across the ranks of a job, independent of where the buffers live. Two
// implementations: `SocketProcessGroup` (parallel/, host memory, a ring over TCP between the ranks;
// what the reference backend and CI use) and the NCCL one (backends/cuda, device memory, NCCL
// loaded at run time). Trainers see only this interface, so data parallelism and ZeRO-1 are
// written once per backend against it and tested on the CPU.
//
// Contract for every collective:
// - every rank calls the same collectives in the same order with the same counts and dtype;
// - `count` is elements of `dtype`; buffers are host pointers for the socket group, device
//   pointers for NCCL (the call is then enqueued on the group's stream and returns at once);
// - reduce_scatter and all_gather split a buffer of count * world_size elements into world_size
//   equal, contiguous chunks in rank order (NCCL's layout);
// - a peer that dies, or does not join within `timeout()`, makes the call throw
//   parallel::CollectiveError naming the operation, the peer rank(s) it waited for and the
//   timeout, never a silent hang; after an error the group is unusable (abort()ed).
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/util/error.h"

namespace primus::parallel {

enum class DType { F32, BF16 };
enum class ReduceOp { Sum, Avg };

size_t dtype_size(DType t);
const char* dtype_name(DType t);

// A collective failed or timed out. what() names the op, the rank(s) and the timeout.
struct CollectiveError : RuntimeError {
  using RuntimeError::RuntimeError;
};

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string backend() const = 0;  // "socket" | "nccl"
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
  // Waits until every collective issued so far has finished (a no-op for the socket group).
  virtual void synchronize() = 0;
  // Gives up on in-flight work and closes the group (after an error, or on shutdown by signal).
  virtual void abort() = 0;
};

}  // namespace primus::parallel
