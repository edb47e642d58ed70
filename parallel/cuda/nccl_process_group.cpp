#include "parallel/cuda/nccl_process_group.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>

#include "core/util/error.h"
#include "turbo/core/cuda_check.h"

namespace primus::parallel {

using Clock = std::chrono::steady_clock;
using Ms = std::chrono::milliseconds;

namespace {

nccl::DataType to_nccl(parallel::DType t) { return t == parallel::DType::F32 ? nccl::Float32 : nccl::Bfloat16; }
nccl::RedOp to_nccl(parallel::ReduceOp op) {
  switch (op) {
    case parallel::ReduceOp::Sum: return nccl::Sum;
    case parallel::ReduceOp::Avg: return nccl::Avg;
    case parallel::ReduceOp::Max: return nccl::Max;  // fmaxf on floats: the contract's NaN rule
  }
  throw RuntimeError("NCCL: unknown reduction");
}
const char* dtype_text(parallel::DType t) { return t == parallel::DType::F32 ? "f32" : "bf16"; }
double secs(Ms t) { return static_cast<double>(t.count()) / 1000.0; }

}  // namespace

std::string NcclProcessGroup::key(const std::string& what) const { return fmt::format("primus/nccl/{}/{}", opt_.name, what); }

std::shared_ptr<NcclProcessGroup> NcclProcessGroup::subgroup(parallel::TcpStore& store, const parallel::DistEnv& job,
                                                         const std::vector<int>& ranks, NcclGroupOptions opt) {
  const auto at = std::find(ranks.begin(), ranks.end(), job.rank);
  if (at == ranks.end())
    throw RuntimeError(fmt::format("NCCL group '{}': rank {} is not one of its ranks", opt.name, job.rank));
  parallel::DistEnv env = job;
  env.rank = static_cast<int>(at - ranks.begin());
  env.world_size = static_cast<int>(ranks.size());
  opt.ranks = ranks;
  return std::make_shared<NcclProcessGroup>(store, env, opt);
}

std::string NcclProcessGroup::rank_name(int r) const {
  if (opt_.ranks.empty()) return fmt::format("rank {}", r);
  const int global = r >= 0 && r < static_cast<int>(opt_.ranks.size()) ? opt_.ranks[static_cast<size_t>(r)] : -1;
  return fmt::format("rank {} ({}'s rank {})", global, opt_.name, r);
}

NcclProcessGroup::NcclProcessGroup(parallel::TcpStore& store, const parallel::DistEnv& env, const NcclGroupOptions& opt)
    : env_(env), opt_(opt), rank_(env.rank), world_(env.world_size) {
  nccl::disable_nvls_unless_set();
  lib_ = &nccl::library();
  CUDA_CHECK(cudaSetDevice(opt_.device));
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&scratch_), sizeof(float)));

  try {
    // Heartbeats first, so that a rank missing at the id exchange or the init is named.
    hb_store_ = std::make_unique<parallel::TcpStore>(env.master_addr, env.master_port, false, opt_.timeout);
    hb_store_->set(key(fmt::format("heartbeat/{}", rank_)), "0");
    heartbeat_ = std::thread([this] { heartbeat_loop(); });

    nccl::UniqueId id{};
    const std::string id_key = key("unique_id");
    if (rank_ == 0) {
      nccl::Result r = lib_->api.GetUniqueId(&id);
      if (r != nccl::Success) throw RuntimeError("ncclGetUniqueId failed: " + nccl::describe(*lib_, r));
      store.set(id_key, std::string_view(id.internal, sizeof(id.internal)));
    } else {
      std::string bytes;
      try {
        bytes = store.get(id_key, opt_.timeout);
      } catch (const Error& e) {
        throw parallel::CollectiveError(fmt::format("NCCL setup on {}: {} did not publish the NCCL id within {} s "
                                                "({}); {}",
                                                rank_name(rank_), rank_name(0), secs(opt_.timeout), e.what(), diagnose()));
      }
      if (bytes.size() != sizeof(id.internal)) {
        throw RuntimeError(fmt::format("NCCL setup on {}: store key '{}' holds {} bytes, expected {}", rank_name(rank_), id_key,
                                       bytes.size(), sizeof(id.internal)));
      }
      std::memcpy(id.internal, bytes.data(), sizeof(id.internal));
    }

    nccl::Config cfg;
    cfg.blocking = 0;
    nccl::Result r = lib_->api.CommInitRankConfig(&comm_, world_, id, rank_, &cfg);
    if (r != nccl::Success && r != nccl::InProgress) {
      throw RuntimeError(fmt::format("ncclCommInitRankConfig ({} of {}, device {}) failed: {}", rank_name(rank_), world_,
                                     opt_.device, nccl::describe(*lib_, r)));
    }
    const auto deadline = Clock::now() + opt_.timeout;
    nccl::Result state = nccl::InProgress;
    while (true) {
      r = lib_->api.CommGetAsyncError(comm_, &state);
      if (r != nccl::Success || state != nccl::InProgress) break;
      if (Clock::now() > deadline) {
        std::string who = diagnose();
        lib_->api.CommAbort(comm_);
        comm_ = nullptr;
        throw parallel::CollectiveError(fmt::format("NCCL communicator setup on {} of {} did not complete within {} s; {}",
                                                rank_name(rank_), world_, secs(opt_.timeout), who));
      }
      std::this_thread::sleep_for(Ms(1));
    }
    if (r != nccl::Success || state != nccl::Success) {
      const nccl::Result bad = r != nccl::Success ? r : state;
      std::string who = diagnose();
      lib_->api.CommAbort(comm_);
      comm_ = nullptr;
      throw parallel::CollectiveError(fmt::format("NCCL communicator setup on {} of {} failed: {}; {}", rank_name(rank_), world_,
                                              nccl::describe(*lib_, bad), who));
    }
  } catch (...) {
    // No destructor runs for a half-built object: stop the heartbeat and free what exists.
    stop_ = true;
    if (heartbeat_.joinable()) heartbeat_.join();
    cudaFree(scratch_);
    cudaStreamDestroy(stream_);
    throw;
  }
  watchdog_ = std::thread([this] { watchdog_loop(); });
  if (rank_ == 0) {
    spdlog::info("[nccl] {} ranks, NCCL {} from {} ({}), timeout {} s, NCCL_NVLS_ENABLE={}", world_, lib_->version(),
                 lib_->path, lib_->how, secs(opt_.timeout), std::getenv("NCCL_NVLS_ENABLE"));
  }
}

NcclProcessGroup::~NcclProcessGroup() {
  if (!aborted_ && comm_) {
    try {
      synchronize();
    } catch (...) {  // no throwing from a destructor; the error was reported where it happened
    }
  }
  stop_ = true;
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  if (heartbeat_.joinable()) heartbeat_.join();
  try {
    std::lock_guard lock(hb_mu_);
    if (hb_store_) hb_store_->set(key(fmt::format("heartbeat/{}", rank_)), "left");
  } catch (...) {
  }
  if (comm_ && !aborted_) lib_->api.CommDestroy(comm_);
  for (auto& p : pending_) cudaEventDestroy(p.done);
  for (auto e : free_events_) cudaEventDestroy(e);
  if (scratch_) cudaFree(scratch_);
  if (stream_) cudaStreamDestroy(stream_);
}

void NcclProcessGroup::check() const {
  if (!error_seen_) return;
  std::string msg;
  {
    std::lock_guard lock(const_cast<std::mutex&>(mu_));
    msg = error_;
  }
  throw parallel::CollectiveError(msg);
}

void NcclProcessGroup::wait_ready(const std::string& op) {
  const auto deadline = Clock::now() + opt_.timeout;
  nccl::Result state = nccl::InProgress;
  while (true) {
    {
      std::lock_guard lock(comm_mu_);
      if (aborted_) break;  // the watchdog gave up on the communicator: check() below throws its error
      nccl::Result r = lib_->api.CommGetAsyncError(comm_, &state);
      if (r != nccl::Success) state = r;
    }
    if (state != nccl::InProgress) break;
    if (Clock::now() > deadline) {
      fail(fmt::format("NCCL {} on {}: enqueueing did not finish within {} s; {}", op, rank_name(rank_), secs(opt_.timeout),
                       diagnose()));
      check();
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  check();
  if (state != nccl::Success) {
    fail(fmt::format("NCCL {} on {} failed: {}; {}", op, rank_name(rank_), nccl::describe(*lib_, state), diagnose()));
    check();
  }
}

template <class F>
void NcclProcessGroup::enqueue(const std::string& op, F&& call) {
  check();
  if (aborted_) throw parallel::CollectiveError(fmt::format("NCCL {} on {}: the group was aborted", op, rank_));
  nccl::Result r;
  {
    std::lock_guard lock(comm_mu_);
    if (aborted_) throw parallel::CollectiveError(fmt::format("NCCL {} on {}: the group was aborted", op, rank_));
    r = call();
  }
  if (r == nccl::InProgress) {
    wait_ready(op);
  } else if (r != nccl::Success) {
    fail(fmt::format("NCCL {} on {} failed: {}", op, rank_name(rank_), nccl::describe(*lib_, r)));
    check();
  }
  cudaEvent_t ev = nullptr;
  {
    std::lock_guard lock(mu_);
    if (!free_events_.empty()) {
      ev = free_events_.back();
      free_events_.pop_back();
    }
  }
  if (!ev) CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(ev, stream_));
  {
    std::lock_guard lock(mu_);
    pending_.push_back({ev, fmt::format("{} #{}", op, ++seq_), Clock::now()});
  }
  cv_.notify_all();
}

void NcclProcessGroup::all_reduce(void* buf, size_t count, parallel::DType dtype, parallel::ReduceOp op) {
  enqueue(fmt::format("all_reduce({} x {})", count, dtype_text(dtype)), [&] {
    return lib_->api.AllReduce(buf, buf, count, to_nccl(dtype), to_nccl(op), comm_, stream_);
  });
}

void NcclProcessGroup::reduce_scatter(const void* send, void* recv, size_t count, parallel::DType dtype,
                                      parallel::ReduceOp op) {
  enqueue(fmt::format("reduce_scatter({} x {} per rank)", count, dtype_text(dtype)), [&] {
    return lib_->api.ReduceScatter(send, recv, count, to_nccl(dtype), to_nccl(op), comm_, stream_);
  });
}

void NcclProcessGroup::all_gather(const void* send, void* recv, size_t count, parallel::DType dtype) {
  enqueue(fmt::format("all_gather({} x {} per rank)", count, dtype_text(dtype)),
          [&] { return lib_->api.AllGather(send, recv, count, to_nccl(dtype), comm_, stream_); });
}

void NcclProcessGroup::send_recv(const void* send, int to, void* recv, int from, size_t count, parallel::DType dtype,
                                 uint32_t) {
  if (to < 0 || to >= world_ || from < 0 || from >= world_) {
    throw parallel::CollectiveError(
        fmt::format("NCCL send_recv: peers {} and {} are not both ranks of this group of {}", to, from, world_));
  }
  enqueue(fmt::format("send_recv({} x {} to {}, from {})", count, dtype_text(dtype), rank_name(to), rank_name(from)), [&] {
    const nccl::Api& a = lib_->api;
    nccl::Result r = a.GroupStart();
    if (r != nccl::Success) return r;
    r = a.Send(send, count, to_nccl(dtype), to, comm_, stream_);
    const nccl::Result r2 = a.Recv(recv, count, to_nccl(dtype), from, comm_, stream_);
    const nccl::Result end = a.GroupEnd();
    if (r != nccl::Success && r != nccl::InProgress) return r;
    if (r2 != nccl::Success && r2 != nccl::InProgress) return r2;
    return end;
  });
}

void NcclProcessGroup::all_to_all_v(const void* send, const std::vector<size_t>& send_counts, void* recv,
                                    const std::vector<size_t>& recv_counts, parallel::DType dtype) {
  if (send_counts.size() != static_cast<size_t>(world_) || recv_counts.size() != static_cast<size_t>(world_)) {
    throw parallel::CollectiveError(fmt::format("NCCL all_to_all: {} send and {} receive counts for a group of {}",
                                                send_counts.size(), recv_counts.size(), world_));
  }
  size_t out = 0, in = 0;
  for (int r = 0; r < world_; ++r) out += send_counts[r], in += recv_counts[r];
  const size_t esize = parallel::dtype_size(dtype);
  enqueue(fmt::format("all_to_all({} x {} out, {} in)", out, dtype_text(dtype), in), [&] {
    const nccl::Api& a = lib_->api;
    nccl::Result r = a.GroupStart();
    if (r != nccl::Success) return r;
    nccl::Result first = nccl::Success;
    auto keep = [&](nccl::Result x) {
      if (first == nccl::Success && x != nccl::Success && x != nccl::InProgress) first = x;
    };
    size_t so = 0, ro = 0;
    for (int p = 0; p < world_; ++p) {
      if (send_counts[p] > 0)
        keep(a.Send(static_cast<const char*>(send) + so * esize, send_counts[p], to_nccl(dtype), p, comm_, stream_));
      if (recv_counts[p] > 0)
        keep(a.Recv(static_cast<char*>(recv) + ro * esize, recv_counts[p], to_nccl(dtype), p, comm_, stream_));
      so += send_counts[p];
      ro += recv_counts[p];
    }
    const nccl::Result end = a.GroupEnd();
    return first != nccl::Success ? first : end;
  });
}

void NcclProcessGroup::broadcast(void* buf, size_t count, parallel::DType dtype, int root) {
  if (root < 0 || root >= world_) {
    throw parallel::CollectiveError(fmt::format("NCCL broadcast: root {} is not a rank of this group of {}", root, world_));
  }
  enqueue(fmt::format("broadcast({} x {} from {})", count, dtype_text(dtype), rank_name(root)),
          [&] { return lib_->api.Broadcast(buf, buf, count, to_nccl(dtype), root, comm_, stream_); });
}

void NcclProcessGroup::barrier() {
  CUDA_CHECK(cudaMemsetAsync(scratch_, 0, sizeof(float), stream_));
  enqueue("barrier", [&] { return lib_->api.AllReduce(scratch_, scratch_, 1, nccl::Float32, nccl::Sum, comm_, stream_); });
  synchronize();
}

namespace {
// A device buffer freed on every way out.
struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) { CUDA_CHECK(cudaMalloc(&p, bytes)); }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};
}  // namespace

void NcclProcessGroup::all_gather_host(const void* send, void* recv, size_t bytes) {
  const size_t words = (bytes + 3) / 4;  // moved as f32 "elements": NCCL copies the bits as they are
  if (words == 0) return;
  std::vector<float> host(words * size_t(world_), 0.0f);
  std::memcpy(host.data() + size_t(rank_) * words, send, bytes);
  DeviceBuffer dev(host.size() * 4);
  float* d = static_cast<float*>(dev.p);
  CUDA_CHECK(cudaMemcpyAsync(d + size_t(rank_) * words, host.data() + size_t(rank_) * words, words * 4,
                             cudaMemcpyHostToDevice, stream_));
  all_gather(d + size_t(rank_) * words, d, words, parallel::DType::F32);
  CUDA_CHECK(cudaMemcpyAsync(host.data(), d, host.size() * 4, cudaMemcpyDeviceToHost, stream_));
  synchronize();
  for (int r = 0; r < world_; ++r) {
    std::memcpy(static_cast<char*>(recv) + size_t(r) * bytes, host.data() + size_t(r) * words, bytes);
  }
}

void NcclProcessGroup::all_reduce_host(float* data, size_t count) {
  constexpr size_t kChunk = size_t{64} << 20;  // floats: 256 MiB
  const size_t chunk = std::min(kChunk, count);
  if (chunk == 0) return;
  DeviceBuffer dev(chunk * sizeof(float));
  float* d = static_cast<float*>(dev.p);
  for (size_t at = 0; at < count; at += chunk) {
    const size_t n = std::min(chunk, count - at);
    CUDA_CHECK(cudaMemcpyAsync(d, data + at, n * sizeof(float), cudaMemcpyHostToDevice, stream_));
    all_reduce(d, n, parallel::DType::F32, parallel::ReduceOp::Sum);
    CUDA_CHECK(cudaMemcpyAsync(data + at, d, n * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    synchronize();
  }
}

void NcclProcessGroup::synchronize() {
  check();
  // Poll rather than block in cudaStreamSynchronize: the watchdog may abort the communicator
  // meanwhile, and the error must then reach this thread.
  while (true) {
    cudaError_t e = cudaStreamQuery(stream_);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) CUDA_CHECK(e);
    check();
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  check();
}

void NcclProcessGroup::wait_for(cudaStream_t other) {
  cudaEvent_t ev;
  CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(ev, other));
  CUDA_CHECK(cudaStreamWaitEvent(stream_, ev, 0));
  CUDA_CHECK(cudaEventDestroy(ev));  // destruction is deferred until the wait is satisfied
}

void NcclProcessGroup::make_wait(cudaStream_t other) {
  cudaEvent_t ev;
  CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(ev, stream_));
  CUDA_CHECK(cudaStreamWaitEvent(other, ev, 0));
  CUDA_CHECK(cudaEventDestroy(ev));
}

void NcclProcessGroup::abort() { fail(fmt::format("NCCL group on {} aborted by the caller", rank_name(rank_))); }

void NcclProcessGroup::fail(const std::string& message) {
  {
    std::lock_guard lock(mu_);
    if (error_.empty()) error_ = message;
  }
  error_seen_ = true;
  std::lock_guard lock(comm_mu_);
  if (!aborted_.exchange(true) && comm_) lib_->api.CommAbort(comm_);  // in-flight kernels return
  cv_.notify_all();
}

std::string NcclProcessGroup::diagnose() {
  // Two reads of every heartbeat, a few periods apart: a counter that does not move is a rank
  // that is dead, hung or stopped.
  std::map<int, std::string> first, second;
  std::vector<std::string> keys;
  for (int r = 0; r < world_; ++r) keys.push_back(key(fmt::format("heartbeat/{}", r)));
  auto read = [&](std::map<int, std::string>& out) {
    std::lock_guard lock(hb_mu_);
    for (int r = 0; r < world_; ++r) {
      if (hb_store_->check({keys[r]})) out[r] = hb_store_->get(keys[r], Ms(1000));
    }
  };
  try {
    read(first);
    std::this_thread::sleep_for(std::max(Ms(3 * opt_.heartbeat.count()), Ms(500)));
    read(second);
  } catch (const Error& e) {
    return fmt::format("missing: rank 0 (the TCP store it hosts at {}:{} is unreachable: {})", env_.master_addr,
                       env_.master_port, e.what());
  }
  std::vector<std::string> missing;
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    if (!second.count(r)) {
      missing.push_back(fmt::format("{} (never joined)", rank_name(r)));
    } else if (second[r] == "left") {
      missing.push_back(fmt::format("{} (left the group)", rank_name(r)));
    } else if (first.count(r) && first[r] == second[r]) {
      missing.push_back(fmt::format("{} (no heartbeat for {:.1f} s: dead, hung or stopped)", rank_name(r),
                                    secs(std::max(Ms(3 * opt_.heartbeat.count()), Ms(500)))));
    }
  }
  if (missing.empty()) {
    // Everyone is alive: name the ranks that have not issued the collective this rank waits in.
    const uint64_t mine = seq_.load();
    for (int r = 0; r < world_; ++r) {
      if (r == rank_ || !second.count(r)) continue;
      const std::string& hb = second[r];
      const size_t sp = hb.find(' ');
      const uint64_t theirs = sp == std::string::npos ? 0 : std::strtoull(hb.c_str() + sp + 1, nullptr, 10);
      if (sp != std::string::npos && theirs < mine) {
        missing.push_back(fmt::format("{} (alive, but has issued {} collectives to this rank's {}: stuck outside "
                                      "NCCL)",
                                      rank_name(r), theirs, mine));
      }
    }
  }
  if (missing.empty()) {
    return "every other rank still sends heartbeats and has issued as many collectives (the ranks issued different "
           "collectives, or NCCL itself is stuck)";
  }
  std::string s = "missing: ";
  for (size_t i = 0; i < missing.size(); ++i) s += (i ? ", " : "") + missing[i];
  return s;
}

void NcclProcessGroup::heartbeat_loop() {
  uint64_t beat = 0;
  const std::string k = key(fmt::format("heartbeat/{}", rank_));
  while (!stop_) {
    try {
      std::lock_guard lock(hb_mu_);
      hb_store_->set(k, fmt::format("{} {}", ++beat, seq_.load()));  // "<beat> <collectives issued>"
    } catch (...) {  // the store is gone (rank 0 exited); the watchdog reports it
    }
    for (int i = 0; i < 10 && !stop_; ++i) std::this_thread::sleep_for(opt_.heartbeat / 10);
  }
}

void NcclProcessGroup::watchdog_loop() {
  cudaSetDevice(opt_.device);
  std::optional<Clock::time_point> failed_at;
  while (!stop_) {
    {
      std::unique_lock lock(mu_);
      cv_.wait_for(lock, Ms(20));
    }
    if (stop_) break;
    if (error_seen_) {
      // The user thread should throw it at its next call; if it never makes one (blocked
      // elsewhere), end the process instead of hanging.
      if (!failed_at) failed_at = Clock::now();
      if (Clock::now() - *failed_at > opt_.grace) {
        std::string msg;
        {
          std::lock_guard lock(mu_);
          msg = error_;
        }
        std::fprintf(stderr, "error: %s (the watchdog ends this process: nothing picked the error up within %.0f s)\n",
                     msg.c_str(), secs(opt_.grace));
        std::fflush(stderr);
        std::_Exit(3);
      }
      continue;
    }
    nccl::Result state = nccl::Success;
    bool bad = false;
    {
      std::lock_guard lock(comm_mu_);
      bad = !aborted_ && lib_->api.CommGetAsyncError(comm_, &state) == nccl::Success && state != nccl::Success &&
            state != nccl::InProgress;
    }
    if (bad) {
      std::string op;
      {
        std::lock_guard lock(mu_);
        op = pending_.empty() ? "collective" : pending_.front().op;
      }
      std::string who = diagnose();
      fail(fmt::format("NCCL {} on {} failed asynchronously: {}; {}", op, rank_name(rank_), nccl::describe(*lib_, state), who));
      continue;
    }
    // Retire finished collectives; time the oldest unfinished one.
    std::optional<Pending> late;
    {
      std::lock_guard lock(mu_);
      while (!pending_.empty()) {
        cudaError_t e = cudaEventQuery(pending_.front().done);
        if (e == cudaErrorNotReady) break;
        free_events_.push_back(pending_.front().done);
        pending_.pop_front();
      }
      if (!pending_.empty() && Clock::now() - pending_.front().start > opt_.timeout) late = pending_.front();
    }
    if (late) {
      std::string who = diagnose();
      fail(fmt::format("NCCL {} on {} did not complete within the {} s timeout (PRIMUS_DIST_TIMEOUT); {}",
                       late->op, rank_name(rank_), secs(opt_.timeout), who));
    }
  }
}

}  // namespace primus::parallel
