// A small TCP key-value store for rendezvous, in the manner of torch's TCPStore: rank 0 hosts
// the server (a thread in its process) on MASTER_ADDR:MASTER_PORT and every rank, rank 0
// included, talks to it as a client. The CUDA backend exchanges the NCCL unique id through it
// (rank 0 set()s 128 bytes, the others get() them) and ranks meet at barrier()s.
//
// Every blocking call has a timeout and fails with a RuntimeError that says what it waited for:
// the key, or for a barrier the ranks that have not arrived. A lost connection (rank 0 exited)
// is an error too, never a hang. Rank 0's store, when destroyed normally, stays up until the
// other ranks have disconnected (at most the timeout), so ranks may leave in any order. One
// TcpStore may be shared by threads; calls are serialised.
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "parallel/launch_env.h"
#include "parallel/socket.h"

namespace primus::parallel {

class TcpStoreServer;

class TcpStore {
 public:
  using Ms = std::chrono::milliseconds;

  // Connects to host:port, retrying until `timeout` (rank 0 may start later than the others).
  // With `host_server`, first starts the server in this process on `port` (0: a free port; see
  // port()). `timeout` is also the default for every blocking call.
  TcpStore(const std::string& host, int port, bool host_server, Ms timeout = Ms(300000));
  ~TcpStore();  // the host waits for the other clients to hang up first (see above)
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  // The store of a launched job: rank 0 hosts, timeout from PRIMUS_DIST_TIMEOUT (DistEnv).
  static std::unique_ptr<TcpStore> from_env(const DistEnv& env);

  void set(const std::string& key, std::string_view value);
  // Waits until the key exists, then returns its bytes.
  std::string get(const std::string& key) { return get(key, timeout_); }
  std::string get(const std::string& key, Ms timeout);
  // Adds `delta` to the integer at key (absent: 0) and returns the new value; atomic across
  // ranks. The value is stored as decimal text.
  int64_t add(const std::string& key, int64_t delta);
  // Waits until every key exists; the error lists the ones still missing.
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, Ms timeout);
  bool check(const std::vector<std::string>& keys);  // all present now? never blocks
  bool remove(const std::string& key);              // true when the key existed

  // Returns once all `world_size` ranks have called barrier(name, ...). Barriers of one name may
  // repeat (each call on a rank is the next generation), as long as every rank calls them in
  // the same order. The timeout error names the ranks that have not arrived.
  void barrier(const std::string& name, int rank, int world_size) { barrier(name, rank, world_size, timeout_); }
  void barrier(const std::string& name, int rank, int world_size, Ms timeout);

  int port() const { return port_; }
  Ms timeout() const { return timeout_; }
  // The job is failing: the host's destructor then leaves at once instead of waiting for the
  // other ranks to hang up (one of them may be the stalled rank that caused the failure).
  void leave_without_waiting() { leave_now_ = true; }

 private:
  // Sends one request and reads its reply body; the deadline is the request's own wait plus
  // a margin for the network and the server.
  std::string request(const std::string& frame, Ms wait);
  std::vector<std::string> wait_missing(const std::vector<std::string>& keys, Ms timeout);

  std::unique_ptr<TcpStoreServer> server_;
  std::string where_;  // "TCP store at host:port", for errors
  int port_;
  Ms timeout_;
  std::mutex mu_;
  Fd fd_;
  std::map<std::string, int> barrier_generation_;
  bool leave_now_ = false;
};

}  // namespace primus::parallel
