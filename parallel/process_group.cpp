// What every ProcessGroup shares: dtype names, the group of a job of one, what an engine without
// the newer collectives throws, and the factory that picks the group for a launched job.
#include "parallel/process_group.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include <spdlog/spdlog.h>

#include "parallel/gloo_process_group.h"
#include "parallel/socket_process_group.h"

namespace primus::parallel {

size_t dtype_size(DType t) { return t == DType::F32 ? 4 : 2; }
const char* dtype_name(DType t) { return t == DType::F32 ? "f32" : "bf16"; }
const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
  }
  return "?";
}

void SingleProcessGroup::reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp) {
  if (count > 0 && send != recv) std::memmove(recv, send, count * dtype_size(dtype));
}

void SingleProcessGroup::all_gather(const void* send, void* recv, size_t count, DType dtype) {
  if (count > 0 && send != recv) std::memmove(recv, send, count * dtype_size(dtype));
}

void SingleProcessGroup::broadcast(void*, size_t, DType, int root) {
  if (root != 0) throw CollectiveError(fmt::format("broadcast: root {} is not a rank of a job of 1", root));
}

void SingleProcessGroup::all_to_all_v(const void* send, const std::vector<size_t>& send_counts, void* recv,
                                      const std::vector<size_t>& recv_counts, DType dtype) {
  if (send_counts.size() != 1 || recv_counts.size() != 1 || send_counts[0] != recv_counts[0]) {
    throw CollectiveError("all_to_all in a job of 1: needs one send and one equal receive count");
  }
  if (send_counts[0] > 0 && send != recv) std::memmove(recv, send, send_counts[0] * dtype_size(dtype));
}

std::unique_ptr<ProcessGroup> SingleProcessGroup::new_subgroup(const std::vector<int>& ranks, const std::string& name) {
  if (ranks != std::vector<int>{0}) throw CollectiveError(fmt::format("sub-group '{}' of a job of 1 can only be {{0}}", name));
  return std::make_unique<SingleProcessGroup>();
}

// ---- what an engine without them throws ----

namespace {
[[noreturn]] void pg_lacks(const ProcessGroup& pg, const char* op) {
  throw CollectiveError(fmt::format("{} is not implemented by the {} process group yet (the gloo group has it)", op,
                                    pg.backend()));
}
}  // namespace

void ProcessGroup::all_to_all(const void* send, void* recv, size_t count, DType dtype) {
  std::vector<size_t> counts(static_cast<size_t>(world_size()), count);
  all_to_all_v(send, counts, recv, counts, dtype);
}
void ProcessGroup::all_to_all_v(const void*, const std::vector<size_t>&, void*, const std::vector<size_t>&, DType) {
  pg_lacks(*this, "all_to_all");
}
void ProcessGroup::send(const void*, size_t, DType, int, uint32_t) { pg_lacks(*this, "send"); }
void ProcessGroup::recv(void*, size_t, DType, int, uint32_t) { pg_lacks(*this, "recv"); }
void ProcessGroup::send_recv(const void* send_buf, int to, void* recv_buf, int from, size_t count, DType dtype,
                             uint32_t tag) {
  const int me = rank();
  if (to == me && from == me) {
    if (count > 0 && send_buf != recv_buf) std::memmove(recv_buf, send_buf, count * dtype_size(dtype));
    return;
  }
  if (me % 2 == 0) {
    send(send_buf, count, dtype, to, tag);
    recv(recv_buf, count, dtype, from, tag);
  } else {
    recv(recv_buf, count, dtype, from, tag);
    send(send_buf, count, dtype, to, tag);
  }
}
std::unique_ptr<ProcessGroup> ProcessGroup::new_subgroup(const std::vector<int>&, const std::string&) {
  pg_lacks(*this, "new_subgroup");
}

std::unique_ptr<ProcessGroup> make_process_group(const DistEnv& env, TcpStore& store) {
  if (env.world_size == 1) return std::make_unique<SingleProcessGroup>();
  auto timeout = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(env.timeout_s * 1000)));
  std::string why;
  if (gloo_plugin_available(&why)) {
    return std::make_unique<GlooProcessGroup>(store, env.master_addr, env.rank, env.world_size, timeout, "pg");
  }
  // The binary carried to a machine without libgloo (the GPU machines) still runs CPU jobs.
  spdlog::warn("CPU collectives on the socket ring instead of Gloo: {}", why);
  return std::make_unique<SocketProcessGroup>(store, env.rank, env.world_size, timeout, "pg", "", env.master_addr);
}

}  // namespace primus::parallel
