#include "parallel/gloo_process_group.h"

#include <dlfcn.h>
#include <signal.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>

#include "io/dtype.h"
#include "parallel/gloo/gloo_plugin_abi.h"
#include "parallel/socket_process_group.h"  // local_address_towards

namespace primus::parallel {

namespace {

using GlooMs = std::chrono::milliseconds;

std::string gloo_exe_dir() {
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : exe.parent_path().string();
}

struct GlooPluginLoad {
  const PrimusGlooApi* api = nullptr;
  std::string error;
};

GlooPluginLoad load_gloo_plugin() {
  std::vector<std::string> places;
  if (const char* e = std::getenv("PRIMUS_GLOO_PLUGIN"); e && *e) {
    places.push_back(e);  // set: the only place, so a wrong path is an error, not another plugin
  } else {
    if (auto d = gloo_exe_dir(); !d.empty()) places.push_back(d + "/libprimus_gloo.so");
#ifdef PRIMUS_GLOO_PLUGIN_BUILD_PATH
    places.push_back(PRIMUS_GLOO_PLUGIN_BUILD_PATH);
#endif
  }
  std::string tried;
  for (const auto& p : places) {
    if (!std::filesystem::exists(p)) {
      tried += fmt::format("\n  {}: not found", p);
      continue;
    }
    void* lib = ::dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* why = ::dlerror();
      tried += fmt::format("\n  {}: {}", p, why ? why : "dlopen failed");
      continue;
    }
    using Entry = const PrimusGlooApi* (*)();
    auto entry = reinterpret_cast<Entry>(::dlsym(lib, "primus_gloo_api"));
    const PrimusGlooApi* api = entry ? entry() : nullptr;
    if (!api || api->abi_version != PRIMUS_GLOO_ABI_VERSION) {
      tried += fmt::format("\n  {}: not a primus Gloo plugin of interface version {}", p, PRIMUS_GLOO_ABI_VERSION);
      continue;  // the handle stays open: closing a library that may have started threads is unsafe
    }
    return {api, ""};
  }
  return {nullptr, "the Gloo plugin (libprimus_gloo.so, which needs libgloo.so.0: Debian's libgloo0) could not be "
                   "loaded; tried:" + tried};
}

const GlooPluginLoad& gloo_plugin_load() {
  static const GlooPluginLoad load = load_gloo_plugin();
  return load;
}

double gloo_secs(GlooMs t) { return static_cast<double>(t.count()) / 1000.0; }

// primus's TcpStore behind the plugin's C store interface; keys get the group's prefix.
struct GlooStoreCtx {
  TcpStore* store;
  std::string prefix;
  GlooMs timeout;
};

int gloo_store_set(void* c, const char* key, const char* data, size_t n, char* err, size_t errlen) {
  auto* s = static_cast<GlooStoreCtx*>(c);
  try {
    s->store->set(s->prefix + key, std::string_view(data, n));
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, errlen, "%s", e.what());
    return 1;
  }
}

int gloo_store_get(void* c, const char* key, void* sink, void (*put)(void*, const char*, size_t), char* err,
                   size_t errlen) {
  auto* s = static_cast<GlooStoreCtx*>(c);
  try {
    std::string v = s->store->get(s->prefix + key, s->timeout);
    put(sink, v.data(), v.size());
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, errlen, "%s", e.what());
    return 1;
  }
}

int gloo_store_wait(void* c, const char* const* keys, size_t n, int64_t timeout_ms, char* err, size_t errlen) {
  auto* s = static_cast<GlooStoreCtx*>(c);
  try {
    std::vector<std::string> k;
    for (size_t i = 0; i < n; ++i) k.push_back(s->prefix + keys[i]);
    s->store->wait(k, GlooMs(timeout_ms));
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, errlen, "%s", e.what());
    return 1;
  }
}

}  // namespace

const PrimusGlooApi& gloo_plugin() {
  const auto& l = gloo_plugin_load();
  if (!l.api) throw RuntimeError(l.error);
  return *l.api;
}

bool gloo_plugin_available(std::string* why) {
  const auto& l = gloo_plugin_load();
  if (!l.api && why) *why = l.error;
  return l.api != nullptr;
}

// ---- the heartbeat shared by a world group and its sub-groups ----

struct GlooProcessGroup::Shared {
  const PrimusGlooApi* api = nullptr;
  TcpStore* store = nullptr;
  std::string root;  // the world group's name; heartbeats are root/hb/<world rank>
  int world_rank = 0;
  GlooMs timeout{0}, period{1000};
  std::string host;  // the address this process listens at
  std::unique_ptr<TcpStore> hb_store;
  std::thread thread;
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;

  std::string hb_key(int world_rank_of) const { return fmt::format("{}/hb/{}", root, world_rank_of); }

  void start() {
    hb_store->set(hb_key(world_rank), "0");
    thread = std::thread([this] {
      uint64_t beat = 0;
      std::unique_lock<std::mutex> lk(mu);
      while (!cv.wait_for(lk, period, [this] { return stop; })) {
        lk.unlock();
        try {
          hb_store->set(hb_key(world_rank), std::to_string(++beat));
        } catch (const std::exception&) {
          return;  // the store's host (rank 0) is gone; the collectives report that
        }
        lk.lock();
      }
    });
  }

  ~Shared() { leave(); }

  // Stops the heartbeat and marks this process as gone. Idempotent.
  void leave() {
    if (thread.joinable()) {
      {
        std::lock_guard<std::mutex> lk(mu);
        stop = true;
      }
      cv.notify_all();
      thread.join();
      try {
        hb_store->set(hb_key(world_rank), "left");
      } catch (const std::exception&) {
        // rank 0's store already gone: nobody is left to read the marker
      }
    }
  }

  // Which of `members` (world ranks) stopped beating, left, or never joined; `label(m)` names one.
  std::string diagnose(const std::vector<int>& members, const std::function<std::string(int)>& label) {
    if (!hb_store) return "";
    auto read = [&](std::vector<std::string>& out) {
      out.assign(members.size(), "");
      for (size_t i = 0; i < members.size(); ++i) {
        if (members[i] == world_rank) continue;
        const std::string k = hb_key(members[i]);
        out[i] = hb_store->check({k}) ? hb_store->get(k, GlooMs(2000)) : "<none>";
      }
    };
    std::vector<std::string> a, b;
    bool looked_twice = true;
    const GlooMs gap = std::max(GlooMs(3 * period.count()), GlooMs(300));
    try {
      read(a);
      // When every other member has left or never came, that is the answer already; a counter
      // that may have stopped needs a second look.
      bool all_gone = true;
      for (size_t i = 0; i < members.size(); ++i) {
        if (members[i] != world_rank && a[i] != "left" && a[i] != "<none>") all_gone = false;
      }
      if (all_gone) {
        b = a;
        looked_twice = false;
      } else {
        std::this_thread::sleep_for(gap);
        read(b);
      }
    } catch (const std::exception& e) {
      return fmt::format("missing: rank 0 (the TCP store it hosts is unreachable: {})", e.what());
    }
    // Stopped counters first: a rank that left usually did so because its own collective failed
    // on the dead or stalled one.
    std::vector<std::string> missing, left;
    for (size_t i = 0; i < members.size(); ++i) {
      if (members[i] == world_rank) continue;
      if (b[i] == "<none>") {
        missing.push_back(fmt::format("{} (never joined)", label(members[i])));
      } else if (b[i] == "left") {
        left.push_back(fmt::format("{} (left the group)", label(members[i])));
      } else if (looked_twice && a[i] == b[i]) {
        missing.push_back(fmt::format("{} (no heartbeat for {:.1f} s: dead, hung or stopped)", label(members[i]),
                                      gloo_secs(gap)));
      }
    }
    missing.insert(missing.end(), left.begin(), left.end());
    if (missing.empty()) {
      return "every other rank still sends heartbeats (one is busy outside this collective, or the ranks called "
             "different collectives)";
    }
    std::string s = "missing: ";
    for (size_t i = 0; i < missing.size(); ++i) s += (i ? ", " : "") + missing[i];
    return s;
  }
};

// ---- the group ----

GlooProcessGroup::GlooProcessGroup(TcpStore& store, const std::string& store_host, int rank, int world_size, Ms timeout,
                                   const std::string& name, const std::string& host)
    : rank_(rank), name_(name) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw CollectiveError(fmt::format("gloo group '{}': rank {} of world size {} is not valid", name, rank, world_size));
  }
  // Gloo's TCP transport writes with writev, which raises SIGPIPE when a peer has died; the
  // default action would kill this rank silently instead of letting the write fail and the
  // collective name the dead peer. (Python ignores SIGPIPE at start, which is why PyTorch's Gloo
  // users never see it.) Only the default action is replaced: a handler someone set stays.
  struct sigaction old_pipe {};
  if (::sigaction(SIGPIPE, nullptr, &old_pipe) == 0 && old_pipe.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
  auto sh = std::make_shared<Shared>();
  sh->api = &gloo_plugin();
  sh->store = &store;
  sh->root = name;
  sh->world_rank = rank;
  sh->timeout = timeout;
  // A few beats per timeout, so that a stalled rank is told from a slow one well within it.
  sh->period = std::clamp(GlooMs(timeout.count() / 5), GlooMs(50), GlooMs(500));
  sh->host = host.empty() ? local_address_towards(store_host) : host;
  sh->hb_store = std::make_unique<TcpStore>(store_host, store.port(), false, timeout);
  sh->start();
  shared_ = std::move(sh);
  for (int r = 0; r < world_size; ++r) members_.push_back(r);
  connect(nullptr);
}

GlooProcessGroup::GlooProcessGroup(std::shared_ptr<Shared> shared, std::vector<int> members, int rank, std::string name,
                                   void* share_device_of)
    : shared_(std::move(shared)), members_(std::move(members)), rank_(rank), name_(std::move(name)) {
  connect(share_device_of);
}

GlooProcessGroup::~GlooProcessGroup() {
  // The world group says it is leaving before its connections close, so that a peer whose
  // collective fails on that close reads "left" instead of waiting for the heartbeat to stop.
  if (name_ == shared_->root) shared_->leave();
  if (handle_) shared_->api->close(handle_);
}

GlooProcessGroup::Ms GlooProcessGroup::timeout() const { return shared_->timeout; }

void GlooProcessGroup::connect(void* share_device_of) {
  const int n = world_size();
  const std::string prefix = name_ + "/gloo/";
  // Our own marker, so that a failed rendezvous names the ranks that never came whatever keys
  // Gloo itself uses.
  shared_->store->set(fmt::format("{}/joined/{}", name_, rank_), "1");
  GlooStoreCtx ctx{shared_->store, prefix, shared_->timeout};
  PrimusGlooStore cs{&ctx, gloo_store_set, gloo_store_get, gloo_store_wait};
  char err[2048] = "";
  handle_ = shared_->api->connect(&cs, share_device_of, shared_->host.c_str(), rank_, n, shared_->timeout.count(), err,
                                  sizeof err);
  if (handle_) {
    // Creating a group is collective: return only once every member's mesh is connected. Gloo's
    // setup can return on one rank while a peer still completes its side of their connection; a
    // rank that closed its group at once (a short job, a failing rank) would then reset that
    // connection and fail the peer's setup, instead of the peer's next collective naming it.
    try {
      shared_->store->barrier(name_ + "/connected", rank_, n, shared_->timeout);
    } catch (const std::exception& e) {
      shared_->api->close(handle_);
      handle_ = nullptr;
      throw CollectiveError(fmt::format("gloo group '{}' setup on rank {}/{}: connected, but not every rank finished "
                                        "its setup: {} (timeout {:.1f} s, PRIMUS_DIST_TIMEOUT)",
                                        name_, rank_, n, e.what(), gloo_secs(shared_->timeout)));
    }
    return;
  }
  std::vector<std::string> absent;
  for (int r = 0; r < n; ++r) {
    if (r == rank_) continue;
    try {
      if (!shared_->store->check({fmt::format("{}/joined/{}", name_, r)})) {
        absent.push_back(members_[r] == r ? fmt::format("rank {}", r)
                                          : fmt::format("rank {} (rank {} of the group)", members_[r], r));
      }
    } catch (const std::exception&) {
      break;  // the store is gone too; Gloo's text says enough
    }
  }
  std::string who;
  for (size_t i = 0; i < absent.size(); ++i) who += (i ? ", " : "") + absent[i];
  throw CollectiveError(fmt::format("gloo group '{}' setup on rank {}/{}: {}{} (timeout {:.1f} s, "
                                    "PRIMUS_DIST_TIMEOUT)",
                                    name_, rank_, n, absent.empty() ? "" : who + " did not join: ", err,
                                    gloo_secs(shared_->timeout)));
}

void GlooProcessGroup::abort() {
  aborted_ = true;
  if (abort_reason_.empty()) abort_reason_ = "abort() was called";
  if (handle_) {
    shared_->api->close(handle_);
    handle_ = nullptr;
  }
}

void GlooProcessGroup::check_usable(const std::string& what) const {
  if (aborted_ || !handle_) {
    throw CollectiveError(fmt::format("{} on rank {}/{} (gloo group '{}'): the process group was aborted earlier ({})",
                                      what, rank_, world_size(), name_, abort_reason_));
  }
}

void GlooProcessGroup::fail(const std::string& what, const std::string& detail) {
  const bool sub = name_ != shared_->root;
  auto label = [&](int world_rank) {
    if (!sub) return fmt::format("rank {}", world_rank);
    auto it = std::find(members_.begin(), members_.end(), world_rank);
    return fmt::format("rank {} (rank {} of the group)", world_rank, it - members_.begin());
  };
  std::string text = fmt::format("{} on rank {}/{} (gloo group '{}'): {}", what, rank_, world_size(), name_, detail);
  // Close first: peers blocked on this rank then fail at once instead of at their timeout.
  abort_reason_ = text;
  abort();
  const std::string who = shared_->diagnose(members_, label);
  if (!who.empty()) text += "; " + who;
  abort_reason_ = text;
  throw CollectiveError(text);
}

template <class F>
void GlooProcessGroup::call(const std::string& what, F&& f) {
  check_usable(what);
  char err[2048] = "";
  if (f(err, sizeof err) != 0) fail(what, err);
}

namespace {
std::string gloo_op_text(const char* name, size_t count, DType dtype) {
  return fmt::format("{} of {} {} elements", name, count, dtype_name(dtype));
}
}  // namespace

void GlooProcessGroup::all_reduce(void* buf, size_t count, DType dtype, ReduceOp op) {
  const std::string what = gloo_op_text("all_reduce", count, dtype);
  check_usable(what);
  if (count == 0 || world_size() == 1) return;
  float* f = static_cast<float*>(buf);
  if (dtype == DType::BF16) {
    f32_in_.resize(count);
    const auto* b = static_cast<const uint16_t*>(buf);
    for (size_t i = 0; i < count; ++i) f32_in_[i] = io::bf16_to_fp32(b[i]);
    f = f32_in_.data();
  }
  if (op == ReduceOp::Max) {
    const size_t n = static_cast<size_t>(world_size());
    f32_out_.resize(count * n);
    call(what, [&](char* e, size_t l) {
      return shared_->api->all_gather(handle_, f, f32_out_.data(), count * sizeof(float), e, l);
    });
    for (size_t i = 0; i < count; ++i) {
      float m = f32_out_[i];
      for (size_t r = 1; r < n; ++r) m = reduce_step(op, m, f32_out_[r * count + i]);
      f[i] = m;
    }
  } else {
    call(what, [&](char* e, size_t n) { return shared_->api->all_reduce_sum_f32(handle_, f, count, e, n); });
  }
  if (op == ReduceOp::Avg) {
    const float w = static_cast<float>(world_size());
    for (size_t i = 0; i < count; ++i) f[i] /= w;
  }
  if (dtype == DType::BF16) {
    auto* b = static_cast<uint16_t*>(buf);
    for (size_t i = 0; i < count; ++i) b[i] = io::fp32_to_bf16(f[i]);
  }
}

void GlooProcessGroup::reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
  const std::string what = gloo_op_text("reduce_scatter", count, dtype);
  check_usable(what);
  const size_t n = static_cast<size_t>(world_size());
  if (count == 0) return;
  const float* in = static_cast<const float*>(send);
  if (dtype == DType::BF16) {
    f32_in_.resize(count * n);
    const auto* b = static_cast<const uint16_t*>(send);
    for (size_t i = 0; i < count * n; ++i) f32_in_[i] = io::bf16_to_fp32(b[i]);
    in = f32_in_.data();
  }
  // Rank r receives every rank's chunk r, then reduces them in rank order: the same order, and so
  // the same bits, whatever the transport did.
  f32_out_.resize(count * n);
  std::vector<int64_t> bytes(n, static_cast<int64_t>(count * sizeof(float)));
  if (n > 1) {
    call(what, [&](char* e, size_t l) {
      return shared_->api->all_to_all_v(handle_, in, bytes.data(), f32_out_.data(), bytes.data(), e, l);
    });
  } else {
    std::memcpy(f32_out_.data(), in, count * sizeof(float));
  }
  std::vector<float> sum(f32_out_.begin(), f32_out_.begin() + static_cast<std::ptrdiff_t>(count));
  for (size_t r = 1; r < n; ++r) {
    for (size_t i = 0; i < count; ++i) sum[i] = reduce_step(op, sum[i], f32_out_[r * count + i]);
  }
  if (op == ReduceOp::Avg) {
    for (auto& v : sum) v /= static_cast<float>(n);
  }
  if (dtype == DType::BF16) {
    auto* b = static_cast<uint16_t*>(recv);
    for (size_t i = 0; i < count; ++i) b[i] = io::fp32_to_bf16(sum[i]);
  } else {
    std::memcpy(recv, sum.data(), count * sizeof(float));
  }
}

void GlooProcessGroup::all_gather(const void* send, void* recv, size_t count, DType dtype) {
  const std::string what = gloo_op_text("all_gather", count, dtype);
  check_usable(what);
  const size_t bytes = count * dtype_size(dtype);
  if (bytes == 0) return;
  if (world_size() == 1) {
    if (send != recv) std::memmove(recv, send, bytes);
    return;
  }
  call(what, [&](char* e, size_t l) { return shared_->api->all_gather(handle_, send, recv, bytes, e, l); });
}

void GlooProcessGroup::broadcast(void* buf, size_t count, DType dtype, int root) {
  const std::string what = gloo_op_text("broadcast", count, dtype) + fmt::format(" from rank {}", root);
  check_usable(what);
  if (root < 0 || root >= world_size()) {
    throw CollectiveError(fmt::format("{} on rank {}/{} (gloo group '{}'): root {} is not a rank of the group", what,
                                      rank_, world_size(), name_, root));
  }
  const size_t bytes = count * dtype_size(dtype);
  if (bytes == 0 || world_size() == 1) return;
  call(what, [&](char* e, size_t l) { return shared_->api->broadcast(handle_, buf, bytes, root, e, l); });
}

void GlooProcessGroup::barrier() {
  check_usable("barrier");
  if (world_size() == 1) return;
  call("barrier", [&](char* e, size_t l) { return shared_->api->barrier(handle_, e, l); });
}

void GlooProcessGroup::all_to_all(const void* send, void* recv, size_t count, DType dtype) {
  std::vector<size_t> counts(static_cast<size_t>(world_size()), count);
  all_to_all_v(send, counts, recv, counts, dtype);
}

void GlooProcessGroup::all_to_all_v(const void* send, const std::vector<size_t>& send_counts, void* recv,
                                    const std::vector<size_t>& recv_counts, DType dtype) {
  const size_t n = static_cast<size_t>(world_size());
  size_t total = 0;
  for (size_t c : send_counts) total += c;
  const std::string what = gloo_op_text("all_to_all", total, dtype);
  check_usable(what);
  if (send_counts.size() != n || recv_counts.size() != n) {
    throw CollectiveError(fmt::format("{} on rank {}/{} (gloo group '{}'): {} send and {} receive counts for {} ranks",
                                      what, rank_, n, name_, send_counts.size(), recv_counts.size(), n));
  }
  const size_t es = dtype_size(dtype);
  if (n == 1) {
    if (send_counts[0] != recv_counts[0]) {
      throw CollectiveError(fmt::format("{} on rank 0/1 (gloo group '{}'): sends {} elements to itself but receives {}",
                                        what, name_, send_counts[0], recv_counts[0]));
    }
    if (send_counts[0] > 0) std::memmove(recv, send, send_counts[0] * es);
    return;
  }
  std::vector<int64_t> sb(n), rb(n);
  for (size_t r = 0; r < n; ++r) {
    sb[r] = static_cast<int64_t>(send_counts[r] * es);
    rb[r] = static_cast<int64_t>(recv_counts[r] * es);
  }
  call(what, [&](char* e, size_t l) {
    return shared_->api->all_to_all_v(handle_, send, sb.data(), recv, rb.data(), e, l);
  });
}

void GlooProcessGroup::send(const void* buf, size_t count, DType dtype, int peer, uint32_t tag) {
  const std::string what = gloo_op_text("send", count, dtype) + fmt::format(" to rank {} (tag {})", peer, tag);
  check_usable(what);
  if (peer < 0 || peer >= world_size() || peer == rank_) {
    throw CollectiveError(fmt::format("{} on rank {}/{} (gloo group '{}'): not a peer", what, rank_, world_size(), name_));
  }
  if (count == 0) return;
  call(what, [&](char* e, size_t l) { return shared_->api->send(handle_, buf, count * dtype_size(dtype), peer, tag, e, l); });
}

void GlooProcessGroup::recv(void* buf, size_t count, DType dtype, int peer, uint32_t tag) {
  const std::string what = gloo_op_text("recv", count, dtype) + fmt::format(" from rank {} (tag {})", peer, tag);
  check_usable(what);
  if (peer < 0 || peer >= world_size() || peer == rank_) {
    throw CollectiveError(fmt::format("{} on rank {}/{} (gloo group '{}'): not a peer", what, rank_, world_size(), name_));
  }
  if (count == 0) return;
  call(what, [&](char* e, size_t l) { return shared_->api->recv(handle_, buf, count * dtype_size(dtype), peer, tag, e, l); });
}

std::unique_ptr<ProcessGroup> GlooProcessGroup::new_subgroup(const std::vector<int>& ranks, const std::string& name) {
  const std::string full = name_ + "/" + name;
  check_usable("new_subgroup '" + full + "'");
  std::vector<int> members;
  int me = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int r = ranks[i];
    if (r < 0 || r >= world_size() || std::count(ranks.begin(), ranks.end(), r) != 1) {
      throw CollectiveError(fmt::format("sub-group '{}': rank {} is not a rank of '{}' ({} ranks), or is listed twice",
                                        full, r, name_, world_size()));
    }
    if (r == rank_) me = static_cast<int>(i);
    members.push_back(members_[static_cast<size_t>(r)]);
  }
  if (me < 0) {
    throw CollectiveError(fmt::format("sub-group '{}': rank {} of '{}' is not a member; only the members create it",
                                      full, rank_, name_));
  }
  return std::unique_ptr<ProcessGroup>(new GlooProcessGroup(shared_, std::move(members), me, full, handle_));
}

}  // namespace primus::parallel
