#include "parallel/tcp_store.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <exception>

#include "parallel/store_protocol.h"
#include "parallel/tcp_store_server.h"

namespace primus::parallel {
namespace {

using wire::Op;
using wire::Status;

// Slack over a request's own wait: the server answers a timed-out Get/Wait itself, so the client
// only gives up on its own when the server is stuck or unreachable.
constexpr TcpStore::Ms kReplyMargin{5000};

std::string quote_list(const std::vector<std::string>& keys, size_t max = 8) {
  std::string s;
  for (size_t i = 0; i < keys.size() && i < max; ++i) s += (i ? ", '" : "'") + keys[i] + "'";
  if (keys.size() > max) s += fmt::format(" and {} more", keys.size() - max);
  return s;
}

double seconds(TcpStore::Ms t) { return t.count() / 1000.0; }

}  // namespace

TcpStore::TcpStore(const std::string& host, int port, bool host_server, Ms timeout)
    : port_(port), timeout_(timeout) {
  if (host_server) {
    server_ = std::make_unique<TcpStoreServer>(port);
    port_ = server_->port();
  }
  where_ = fmt::format("TCP store at {}:{}", host, port_);
  auto deadline = Clock::now() + timeout_;
  fd_ = connect_tcp(host, port_, deadline, where_);
  std::string hello = wire::Writer().u8(uint8_t(Op::Hello)).u32(wire::kMagic).u32(wire::kVersion).frame();
  try {
    request(hello, Ms(0));
  } catch (const RuntimeError& e) {
    throw RuntimeError(fmt::format("{}: no greeting; is something else listening on port {}? ({})", where_, port_,
                                   e.what()));
  }
}

TcpStore::~TcpStore() {
  fd_.reset();
  // The host stays up until the other ranks have hung up (bounded by the timeout): a rank that
  // leaves the last barrier first must not pull the store away from one still inside it. Not
  // while unwinding from an error, so that a failing rank 0 exits at once and the launcher can
  // stop the others.
  if (server_ && std::uncaught_exceptions() == 0 && !leave_now_) server_->wait_idle(Clock::now() + timeout_);
}

std::unique_ptr<TcpStore> TcpStore::from_env(const DistEnv& env) {
  auto timeout = Ms(static_cast<int64_t>(std::ceil(env.timeout_s * 1000)));
  return std::make_unique<TcpStore>(env.master_addr, env.master_port, env.rank == 0, timeout);
}

std::string TcpStore::request(const std::string& frame, Ms wait) {
  auto deadline = Clock::now() + wait + kReplyMargin;
  send_all(fd_.get(), frame.data(), frame.size(), deadline, where_);
  uint32_t len = 0;
  recv_all(fd_.get(), &len, 4, deadline, where_);
  if (len == 0 || len > wire::kMaxFrame) {
    throw RuntimeError(fmt::format("{}: malformed reply (length {})", where_, len));
  }
  std::string body(len, '\0');
  recv_all(fd_.get(), body.data(), len, deadline, where_);
  return body;
}

void TcpStore::set(const std::string& key, std::string_view value) {
  std::lock_guard lock(mu_);
  request(wire::Writer().u8(uint8_t(Op::Set)).str(key).str(value).frame(), Ms(0));
}

std::string TcpStore::get(const std::string& key, Ms timeout) {
  std::lock_guard lock(mu_);
  std::string body =
      request(wire::Writer().u8(uint8_t(Op::Get)).str(key).u64(static_cast<uint64_t>(timeout.count())).frame(), timeout);
  wire::Reader r(body);
  if (static_cast<Status>(r.u8()) == Status::Timeout) {
    throw RuntimeError(fmt::format("timed out after {:.1f} s waiting for key '{}' in the {}", seconds(timeout), key,
                                   where_));
  }
  return r.str();
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  std::lock_guard lock(mu_);
  std::string body = request(wire::Writer().u8(uint8_t(Op::Add)).str(key).i64(delta).frame(), Ms(0));
  wire::Reader r(body);
  if (static_cast<Status>(r.u8()) != Status::Ok) throw RuntimeError(fmt::format("{}: add: {}", where_, r.str()));
  return r.i64();
}

std::vector<std::string> TcpStore::wait_missing(const std::vector<std::string>& keys, Ms timeout) {
  std::lock_guard lock(mu_);
  wire::Writer w;
  w.u8(uint8_t(Op::Wait)).u32(static_cast<uint32_t>(keys.size()));
  for (auto& k : keys) w.str(k);
  w.u64(static_cast<uint64_t>(timeout.count()));
  std::string body = request(w.frame(), timeout);
  wire::Reader r(body);  // views `body`
  std::vector<std::string> missing;
  if (static_cast<Status>(r.u8()) == Status::Timeout) {
    uint32_t n = r.u32();
    for (uint32_t i = 0; i < n; ++i) missing.push_back(r.str());
  }
  return missing;
}

void TcpStore::wait(const std::vector<std::string>& keys, Ms timeout) {
  auto missing = wait_missing(keys, timeout);
  if (!missing.empty()) {
    throw RuntimeError(fmt::format("timed out after {:.1f} s waiting for keys in the {}: missing {}", seconds(timeout),
                                   where_, quote_list(missing)));
  }
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  std::lock_guard lock(mu_);
  wire::Writer w;
  w.u8(uint8_t(Op::Check)).u32(static_cast<uint32_t>(keys.size()));
  for (auto& k : keys) w.str(k);
  std::string body = request(w.frame(), Ms(0));
  wire::Reader r(body);
  r.u8();
  return r.u8() != 0;
}

bool TcpStore::remove(const std::string& key) {
  std::lock_guard lock(mu_);
  std::string body = request(wire::Writer().u8(uint8_t(Op::Delete)).str(key).frame(), Ms(0));
  wire::Reader r(body);
  r.u8();
  return r.u8() != 0;
}

void TcpStore::barrier(const std::string& name, int rank, int world_size, Ms timeout) {
  if (rank < 0 || rank >= world_size) {
    throw RuntimeError(fmt::format("barrier '{}': rank {} is not in [0, {})", name, rank, world_size));
  }
  int gen;
  {
    std::lock_guard lock(mu_);
    gen = barrier_generation_[name]++;
  }
  // Each rank leaves its own key (so a timeout can say who is missing) and counts itself in; the
  // last to arrive opens the barrier for everyone.
  std::string base = fmt::format("barrier/{}/{}", name, gen);
  set(fmt::format("{}/rank/{}", base, rank), "");
  if (add(base + "/count", 1) == world_size) {
    // The last rank opens the barrier and has nothing to wait for: the others may leave (and
    // rank 0 take the server down) as soon as the key is set.
    set(base + "/open", "");
    return;
  }
  if (wait_missing({base + "/open"}, timeout).empty()) return;

  std::vector<std::string> rank_keys;
  for (int r = 0; r < world_size; ++r) rank_keys.push_back(fmt::format("{}/rank/{}", base, r));
  auto missing = wait_missing(rank_keys, Ms(0));
  if (missing.empty()) return;  // the last rank arrived just now and is opening the barrier
  std::string ranks;
  for (size_t i = 0; i < missing.size() && i < 16; ++i) {
    ranks += (i ? ", " : "") + missing[i].substr(missing[i].rfind('/') + 1);
  }
  if (missing.size() > 16) ranks += fmt::format(" and {} more", missing.size() - 16);
  throw RuntimeError(fmt::format("barrier '{}' timed out after {:.1f} s on rank {}: {} of {} ranks arrived; "
                                 "missing rank{} {}",
                                 name, seconds(timeout), rank, world_size - static_cast<int>(missing.size()),
                                 world_size, missing.size() == 1 ? "" : "s", ranks));
}

}  // namespace primus::parallel
