#include "parallel/socket_process_group.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "io/dtype.h"

namespace primus::parallel {

namespace {

constexpr uint32_t kHelloMagic = 0x50524753;  // "PRGS"
constexpr size_t kBroadcastSegment = size_t(1) << 20;

using io::bf16_to_fp32;
using io::fp32_to_bf16;

// Chunk boundaries of `count` elements over `world` ranks: sizes differ by at most one.
std::vector<size_t> chunk_offsets(size_t count, int world) {
  std::vector<size_t> off(world + 1, 0);
  size_t base = count / world, rem = count % world;
  for (int i = 0; i < world; ++i) off[i + 1] = off[i] + base + (static_cast<size_t>(i) < rem ? 1 : 0);
  return off;
}

std::vector<size_t> equal_offsets(size_t count, int world) {
  std::vector<size_t> off(world + 1, 0);
  for (int i = 0; i < world; ++i) off[i + 1] = off[i] + count;
  return off;
}

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

double secs(std::chrono::milliseconds t) { return t.count() / 1000.0; }

}  // namespace

struct SocketProcessGroup::Op {
  const char* name;
  size_t count;
  DType dtype;
  std::string str() const { return fmt::format("{} of {} {} elements", name, count, dtype_name(dtype)); }
};

SocketProcessGroup::SocketProcessGroup(TcpStore& store, int rank, int world_size, std::chrono::milliseconds timeout,
                                       const std::string& name, const std::string& host, const std::string& store_host)
    : rank_(rank), world_(world_size), timeout_(timeout) {
  if (world_ < 1 || rank_ < 0 || rank_ >= world_) {
    throw CollectiveError(fmt::format("process group '{}': rank {} of world size {} is not valid", name, rank, world_size));
  }
  next_ = (rank_ + 1) % world_;
  prev_ = (rank_ + world_ - 1) % world_;
  if (world_ == 1) return;
  const std::string me = fmt::format("process group '{}' rank {}/{}", name, rank_, world_);
  const auto deadline = Clock::now() + timeout_;
  int port = 0;
  Fd listener = listen_tcp(0, &port);
  std::string addr = host.empty() ? local_address_towards(store_host) : host;
  store.set(fmt::format("{}/addr/{}", name, rank_), fmt::format("{} {}", addr, port));

  std::string peer;
  try {
    peer = store.get(fmt::format("{}/addr/{}", name, next_), timeout_);
  } catch (const RuntimeError& e) {
    throw CollectiveError(fmt::format("{}: rank {} did not publish its address within {} s (did it start?): {}", me,
                                      next_, secs(timeout_), e.what()));
  }
  size_t sp = peer.rfind(' ');
  if (sp == std::string::npos) throw CollectiveError(fmt::format("{}: malformed address '{}' of rank {}", me, peer, next_));
  std::string what = fmt::format("rank {} at {}:{}", next_, peer.substr(0, sp), peer.substr(sp + 1));
  try {
    to_next_ = connect_tcp(peer.substr(0, sp), std::stoi(peer.substr(sp + 1)), deadline, what);
    uint32_t hello[3] = {kHelloMagic, static_cast<uint32_t>(rank_), static_cast<uint32_t>(world_)};
    send_all(to_next_.get(), hello, sizeof hello, deadline, what);
  } catch (const RuntimeError& e) {
    throw CollectiveError(fmt::format("{}: cannot connect to {}", me, e.what()));
  }

  // Accept the previous rank; anything else knocking (a stray client) is refused.
  while (!from_prev_) {
    pollfd p{listener.get(), POLLIN, 0};
    int r = ::poll(&p, 1, poll_timeout_ms(deadline));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      throw CollectiveError(fmt::format("{}: rank {} did not connect within {} s (is it running?)", me, prev_,
                                        secs(timeout_)));
    }
    Fd c(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!c) continue;
    ::fcntl(c.get(), F_SETFL, ::fcntl(c.get(), F_GETFL) & ~O_NONBLOCK);
    uint32_t hello[3] = {0, 0, 0};
    try {
      recv_all(c.get(), hello, sizeof hello, deadline, fmt::format("rank {}", prev_));
    } catch (const RuntimeError&) {
      continue;
    }
    if (hello[0] != kHelloMagic || hello[1] != static_cast<uint32_t>(prev_) || hello[2] != static_cast<uint32_t>(world_)) {
      if (hello[0] == kHelloMagic) {
        throw CollectiveError(fmt::format("{}: expected rank {} of {}, was reached by rank {} of {} (two jobs share "
                                          "a store?)", me, prev_, world_, hello[1], hello[2]));
      }
      continue;
    }
    from_prev_ = std::move(c);
  }
  set_nonblocking(to_next_.get());
  set_nonblocking(from_prev_.get());
}

SocketProcessGroup::~SocketProcessGroup() = default;

void SocketProcessGroup::abort() {
  aborted_ = true;
  if (abort_reason_.empty()) abort_reason_ = "abort() was called";
  to_next_.reset();
  from_prev_.reset();
}

void SocketProcessGroup::check_usable(const char* what) const {
  if (aborted_) {
    throw CollectiveError(fmt::format("{} on rank {}: the process group was aborted earlier ({})", what, rank_,
                                      abort_reason_));
  }
}

void SocketProcessGroup::fail(const Op& op, const std::string& msg) {
  std::string text = fmt::format("{} on rank {}/{}: {}", op.str(), rank_, world_, msg);
  abort_reason_ = text;
  abort();
  throw CollectiveError(text);
}

void SocketProcessGroup::exchange(const Op& op, const void* sbuf, size_t sn, void* rbuf, size_t rn) {
  auto* sp = static_cast<const char*>(sbuf);
  auto* rp = static_cast<char*>(rbuf);
  size_t sent = 0, got = 0;
  auto last_progress = Clock::now();
  while (sent < sn || got < rn) {
    // While sending, to_next_ is watched for input too: the next rank never sends on it, so
    // readable means it closed the connection (died), found before our send buffer fills. Not
    // once our part is sent: a peer that finished the collective may already have left.
    const short out_events = sent < sn ? POLLIN | POLLOUT : 0;
    pollfd p[2] = {{to_next_.get(), out_events, 0},
                   {from_prev_.get(), static_cast<short>(got < rn ? POLLIN : 0), 0}};
    int r = ::poll(p, 2, poll_timeout_ms(last_progress + timeout_));
    if (r < 0) {
      if (errno == EINTR) continue;
      fail(op, fmt::format("poll failed: {}", std::strerror(errno)));
    }
    if (r == 0) {
      if (got < rn) {
        fail(op, fmt::format("rank {} sent nothing for {} s (the collective timeout, PRIMUS_DIST_TIMEOUT): it is "
                             "stalled, or has not reached this collective",
                             prev_, secs(timeout_)));
      }
      fail(op, fmt::format("rank {} received nothing for {} s (the collective timeout, PRIMUS_DIST_TIMEOUT): it is "
                           "stalled, or has not reached this collective",
                           next_, secs(timeout_)));
    }
    if (sent < sn && (p[0].revents & (POLLIN | POLLHUP | POLLERR))) {
      char c;
      ssize_t k = ::recv(to_next_.get(), &c, 1, MSG_DONTWAIT | MSG_PEEK);
      if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        fail(op, fmt::format("rank {} closed its connection (it exited or crashed){}", next_,
                             k < 0 ? fmt::format(": {}", std::strerror(errno)) : ""));
      }
      if (k > 0) fail(op, fmt::format("rank {} sent unexpected data (protocol error)", next_));
    }
    if (sent < sn && (p[0].revents & POLLOUT)) {
      ssize_t w = ::send(to_next_.get(), sp + sent, sn - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w > 0) {
        sent += static_cast<size_t>(w);
        last_progress = Clock::now();
      } else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        fail(op, fmt::format("connection to rank {} lost (it exited or crashed): {}", next_, std::strerror(errno)));
      }
    }
    if (got < rn && (p[1].revents & (POLLIN | POLLHUP | POLLERR))) {
      ssize_t k = ::recv(from_prev_.get(), rp + got, rn - got, MSG_DONTWAIT);
      if (k > 0) {
        got += static_cast<size_t>(k);
        last_progress = Clock::now();
      } else if (k == 0) {
        fail(op, fmt::format("rank {} closed its connection (it exited or crashed)", prev_));
      } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        fail(op, fmt::format("connection from rank {} lost (it exited or crashed): {}", prev_, std::strerror(errno)));
      }
    }
  }
}

void SocketProcessGroup::ring_reduce_scatter(const Op& op, float* buf, const std::vector<size_t>& off, ReduceOp rop) {
  // Step s: send the partial reduction of chunk (r-s-1), receive chunk (r-s-2) from the previous
  // rank and fold it in; after world-1 steps chunk r holds every rank's contribution.
  size_t max_chunk = 0;
  for (int i = 0; i < world_; ++i) max_chunk = std::max(max_chunk, off[i + 1] - off[i]);
  if (recv_tmp_.size() < max_chunk) recv_tmp_.resize(max_chunk);
  for (int s = 0; s < world_ - 1; ++s) {
    int sc = ((rank_ - s - 1) % world_ + world_) % world_;
    int rc = ((rank_ - s - 2) % world_ + world_) % world_;
    size_t sn = off[sc + 1] - off[sc], rn = off[rc + 1] - off[rc];
    exchange(op, buf + off[sc], sn * 4, recv_tmp_.data(), rn * 4);
    float* dst = buf + off[rc];
    for (size_t i = 0; i < rn; ++i) dst[i] = reduce_step(rop, dst[i], recv_tmp_[i]);
  }
}

void SocketProcessGroup::ring_all_gather(const Op& op, char* buf, const std::vector<size_t>& off, size_t esize) {
  // Step s: pass on chunk (r-s) (own chunk first), receive chunk (r-s-1) in place.
  for (int s = 0; s < world_ - 1; ++s) {
    int sc = ((rank_ - s) % world_ + world_) % world_;
    int rc = ((rank_ - s - 1) % world_ + world_) % world_;
    exchange(op, buf + off[sc] * esize, (off[sc + 1] - off[sc]) * esize, buf + off[rc] * esize,
             (off[rc + 1] - off[rc]) * esize);
  }
}

void SocketProcessGroup::all_reduce(void* buf, size_t count, DType dtype, ReduceOp rop) {
  Op op{"all_reduce", count, dtype};
  check_usable("all_reduce");
  if (world_ == 1 || count == 0) return;
  auto off = chunk_offsets(count, world_);
  float* f = static_cast<float*>(buf);
  if (dtype == DType::BF16) {
    scratch_.resize(count);
    auto* h = static_cast<const uint16_t*>(buf);
    for (size_t i = 0; i < count; ++i) scratch_[i] = bf16_to_fp32(h[i]);
    f = scratch_.data();
  }
  ring_reduce_scatter(op, f, off, rop);
  const size_t lo = off[rank_], hi = off[rank_ + 1];
  if (rop == ReduceOp::Avg) {
    for (size_t i = lo; i < hi; ++i) f[i] /= static_cast<float>(world_);
  }
  if (dtype == DType::F32) {
    ring_all_gather(op, static_cast<char*>(buf), off, 4);
  } else {
    // Round this rank's chunk once, then gather the bf16 chunks.
    auto* h = static_cast<uint16_t*>(buf);
    for (size_t i = lo; i < hi; ++i) h[i] = fp32_to_bf16(f[i]);
    ring_all_gather(op, static_cast<char*>(buf), off, 2);
  }
}

void SocketProcessGroup::reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp rop) {
  Op op{"reduce_scatter", count, dtype};
  check_usable("reduce_scatter");
  if (count == 0) return;
  const size_t total = count * static_cast<size_t>(world_);
  scratch_.resize(total);
  if (dtype == DType::F32) {
    std::memcpy(scratch_.data(), send, total * 4);
  } else {
    auto* h = static_cast<const uint16_t*>(send);
    for (size_t i = 0; i < total; ++i) scratch_[i] = bf16_to_fp32(h[i]);
  }
  if (world_ > 1 && count > 0) ring_reduce_scatter(op, scratch_.data(), equal_offsets(count, world_), rop);
  const float* mine = scratch_.data() + static_cast<size_t>(rank_) * count;
  const float scale = rop == ReduceOp::Avg ? static_cast<float>(world_) : 1.f;
  if (dtype == DType::F32) {
    auto* out = static_cast<float*>(recv);
    for (size_t i = 0; i < count; ++i) out[i] = rop == ReduceOp::Avg ? mine[i] / scale : mine[i];
  } else {
    auto* out = static_cast<uint16_t*>(recv);
    for (size_t i = 0; i < count; ++i) out[i] = fp32_to_bf16(rop == ReduceOp::Avg ? mine[i] / scale : mine[i]);
  }
}

void SocketProcessGroup::all_gather(const void* send, void* recv, size_t count, DType dtype) {
  Op op{"all_gather", count, dtype};
  check_usable("all_gather");
  if (count == 0) return;
  const size_t es = dtype_size(dtype);
  char* out = static_cast<char*>(recv);
  char* mine = out + static_cast<size_t>(rank_) * count * es;
  if (mine != send) std::memmove(mine, send, count * es);
  if (world_ > 1 && count > 0) ring_all_gather(op, out, equal_offsets(count, world_), es);
}

void SocketProcessGroup::broadcast(void* buf, size_t count, DType dtype, int root) {
  Op op{"broadcast", count, dtype};
  check_usable("broadcast");
  if (root < 0 || root >= world_) {
    throw CollectiveError(fmt::format("broadcast on rank {}: root {} is not a rank of {}", rank_, root, world_));
  }
  if (world_ == 1) return;
  // Along the ring from the root, in segments so that the ranks forward in a pipeline.
  const size_t bytes = count * dtype_size(dtype);
  char* p = static_cast<char*>(buf);
  for (size_t at = 0; at < bytes; at += kBroadcastSegment) {
    size_t n = std::min(kBroadcastSegment, bytes - at);
    if (rank_ != root) exchange(op, nullptr, 0, p + at, n);
    if (next_ != root) exchange(op, p + at, n, nullptr, 0);
  }
}

void SocketProcessGroup::barrier() {
  check_usable("barrier");
  if (world_ == 1) return;
  // One element per rank: every step of the ring moves bytes, so no rank leaves before all came.
  std::vector<float> token(world_, 1.f);
  Op op{"barrier", token.size(), DType::F32};
  ring_reduce_scatter(op, token.data(), chunk_offsets(token.size(), world_), ReduceOp::Sum);
  ring_all_gather(op, reinterpret_cast<char*>(token.data()), chunk_offsets(token.size(), world_), 4);
}

std::string local_address_towards(const std::string& host) {
  if (const char* a = std::getenv("PRIMUS_SOCKET_ADDR"); a && *a) return a;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &res) == 0) {
    for (addrinfo* ai = res; ai; ai = ai->ai_next) {
      Fd s(::socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
      if (!s || ::connect(s.get(), ai->ai_addr, ai->ai_addrlen) != 0) continue;  // UDP: no packet sent
      sockaddr_storage a{};
      socklen_t len = sizeof a;
      if (::getsockname(s.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0) continue;
      char text[INET6_ADDRSTRLEN] = {};
      const void* src = a.ss_family == AF_INET6 ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&a)->sin6_addr)
                                                : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&a)->sin_addr);
      if (::inet_ntop(a.ss_family, src, text, sizeof text)) {
        ::freeaddrinfo(res);
        return text;
      }
    }
    ::freeaddrinfo(res);
  }
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  return name;
}

}  // namespace primus::parallel
