// What every ProcessGroup shares: dtype names, the group of a job of one, and the factory that
// picks the group for a launched job.
#include "parallel/process_group.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "parallel/socket_process_group.h"

namespace primus::parallel {

size_t dtype_size(DType t) { return t == DType::F32 ? 4 : 2; }
const char* dtype_name(DType t) { return t == DType::F32 ? "f32" : "bf16"; }

void SingleProcessGroup::reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp) {
  if (count > 0 && send != recv) std::memmove(recv, send, count * dtype_size(dtype));
}

void SingleProcessGroup::all_gather(const void* send, void* recv, size_t count, DType dtype) {
  if (count > 0 && send != recv) std::memmove(recv, send, count * dtype_size(dtype));
}

void SingleProcessGroup::broadcast(void*, size_t, DType, int root) {
  if (root != 0) throw CollectiveError(fmt::format("broadcast: root {} is not a rank of a job of 1", root));
}

std::unique_ptr<ProcessGroup> make_process_group(const DistEnv& env, TcpStore& store) {
  if (env.world_size == 1) return std::make_unique<SingleProcessGroup>();
  auto timeout = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(env.timeout_s * 1000)));
  return std::make_unique<SocketProcessGroup>(store, env.rank, env.world_size, timeout, "pg", "", env.master_addr);
}

}  // namespace primus::parallel
