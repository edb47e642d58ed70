// The server half of the TCP store: one background thread that owns the key-value map and serves
// every client connection with poll(). Rank 0 hosts it (TcpStore does that); it lives as long as
// this object. Blocking requests (Get, Wait) park until their keys arrive or their timeout passes;
// a client that disconnects simply drops its parked request. Protocol: parallel/store_protocol.h.
#pragma once
#include <atomic>
#include <thread>

#include "parallel/socket.h"

namespace primus::parallel {

class TcpStoreServer {
 public:
  // Listens on every interface at `port` (0: a free port, see port()). Throws RuntimeError when
  // the port cannot be bound.
  explicit TcpStoreServer(int port);
  ~TcpStoreServer();  // stops the thread and closes every connection
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const { return port_; }
  // Client connections open now.
  int connections() const { return connections_.load(); }
  // Waits until no client is connected or `deadline` passes; true when idle.
  bool wait_idle(Clock::time_point deadline) const;

 private:
  void run();
  std::atomic<int> connections_{0};
  Fd listener_;
  Fd wake_read_, wake_write_;  // a byte here stops the loop
  int port_ = 0;
  std::thread thread_;
};

}  // namespace primus::parallel
