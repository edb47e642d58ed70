// TCP plumbing for the rendezvous store: an owning file descriptor, a listener, a connect that
// retries until a deadline, and whole-buffer send/recv that never block past a deadline. Every
// failure is a RuntimeError naming `what` (e.g. "TCP store at node01:29500"), never a hang.
#pragma once
#include <chrono>
#include <cstddef>
#include <string>

namespace primus::parallel {

using Clock = std::chrono::steady_clock;

// Owns one file descriptor; closes it on destruction. Move-only.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset(int fd = -1);
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// Listens on every interface (IPv6 dual-stack, else IPv4) at `port`; port 0 picks a free one.
// Returns the listening socket (non-blocking, close-on-exec) and writes the bound port.
Fd listen_tcp(int port, int* bound_port);

// Connects to host:port, retrying while the peer is not up yet (refused, unreachable, unknown
// host) until `deadline`; then throws RuntimeError with the last reason. The socket is blocking
// with TCP_NODELAY; use send_all/recv_all, which poll against a deadline.
Fd connect_tcp(const std::string& host, int port, Clock::time_point deadline, const std::string& what);

// Writes / reads exactly n bytes before `deadline`. RuntimeError on timeout, error, or (recv) the
// peer closing the connection.
void send_all(int fd, const void* data, size_t n, Clock::time_point deadline, const std::string& what);
void recv_all(int fd, void* data, size_t n, Clock::time_point deadline, const std::string& what);

// Milliseconds from now until `deadline`, clamped to [0, INT_MAX] for poll().
int poll_timeout_ms(Clock::time_point deadline);

}  // namespace primus::parallel
