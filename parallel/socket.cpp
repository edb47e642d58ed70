#include "parallel/socket.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <thread>

#include "core/util/error.h"

namespace primus::parallel {

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) reset(o.release());
  return *this;
}

void Fd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

int poll_timeout_ms(Clock::time_point deadline) {
  auto ms = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(ms, 0, INT_MAX));
}

namespace {

// Waits until fd is ready for `events` or the deadline passes; false on timeout.
bool wait_ready(int fd, short events, Clock::time_point deadline, const std::string& what) {
  while (true) {
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, poll_timeout_ms(deadline));
    if (r > 0) return true;
    if (r == 0) return false;
    if (errno != EINTR) throw RuntimeError(fmt::format("{}: poll failed: {}", what, std::strerror(errno)));
  }
}

// Returns an invalid Fd and sets *err when the socket cannot be created, bound or listened on.
Fd bind_listener(int family, int port, int* err) {
  Fd fd(::socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd) {
    *err = errno;
    return fd;
  }
  int one = 1;
  // A restarted job reuses the port while the old connections sit in TIME_WAIT.
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  int rc;
  if (family == AF_INET6) {
    int zero = 0;
    ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons(static_cast<uint16_t>(port));
    rc = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a);
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(port));
    rc = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a);
  }
  if (rc != 0 || ::listen(fd.get(), 1024) != 0) {
    *err = errno;
    fd.reset();
  }
  return fd;
}

}  // namespace

Fd listen_tcp(int port, int* bound_port) {
  int err6 = 0, err4 = 0;
  Fd fd = bind_listener(AF_INET6, port, &err6);
  if (!fd) fd = bind_listener(AF_INET, port, &err4);  // no IPv6 in this container / kernel
  if (!fd) {
    int err = err4 == EAFNOSUPPORT ? err6 : err4;
    throw RuntimeError(fmt::format("cannot listen on TCP port {} (MASTER_PORT): {}{}", port, std::strerror(err),
                                   err == EADDRINUSE ? "; another job or store uses it, pick another port" : ""));
  }
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len);
  *bound_port = a.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port)
                                        : ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
  return fd;
}

Fd connect_tcp(const std::string& host, int port, Clock::time_point deadline, const std::string& what) {
  std::string last = "no attempt made";
  auto pause = std::chrono::milliseconds(20);
  while (true) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    int gai = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
    if (gai != 0) {
      last = fmt::format("cannot resolve '{}': {}", host, ::gai_strerror(gai));
    }
    for (addrinfo* ai = res; ai; ai = ai->ai_next) {
      Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol));
      if (!fd) {
        last = std::strerror(errno);
        continue;
      }
      int rc = ::connect(fd.get(), ai->ai_addr, ai->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        if (!wait_ready(fd.get(), POLLOUT, deadline, what)) {
          last = "connect timed out";
          continue;
        }
        int err = 0;
        socklen_t len = sizeof err;
        ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
        rc = err == 0 ? 0 : -1;
        errno = err;
      }
      if (rc != 0) {
        last = std::strerror(errno);
        continue;
      }
      int flags = ::fcntl(fd.get(), F_GETFL);
      ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
      int one = 1;
      ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      ::freeaddrinfo(res);
      return fd;
    }
    if (res) ::freeaddrinfo(res);
    if (Clock::now() + pause > deadline) break;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(500));  // rank 0 may start seconds later
  }
  throw RuntimeError(fmt::format("cannot reach the {} (MASTER_ADDR/MASTER_PORT): {}; is rank 0 running?", what, last));
}

void send_all(int fd, const void* data, size_t n, Clock::time_point deadline, const std::string& what) {
  auto* p = static_cast<const char*>(data);
  while (n > 0) {
    if (!wait_ready(fd, POLLOUT, deadline, what)) {
      throw RuntimeError(fmt::format("{}: timed out sending a request", what));
    }
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      throw RuntimeError(fmt::format("{}: connection lost while sending: {}", what, std::strerror(errno)));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void recv_all(int fd, void* data, size_t n, Clock::time_point deadline, const std::string& what) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    if (!wait_ready(fd, POLLIN, deadline, what)) {
      throw RuntimeError(fmt::format("{}: no reply before the deadline (the store is up but not answering)", what));
    }
    ssize_t r = ::recv(fd, p, n, MSG_DONTWAIT);
    if (r == 0) {
      throw RuntimeError(fmt::format("{} closed the connection; did rank 0 exit or crash?", what));
    }
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      throw RuntimeError(fmt::format("{}: connection lost: {}", what, std::strerror(errno)));
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
}

}  // namespace primus::parallel
