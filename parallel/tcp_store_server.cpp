#include "parallel/tcp_store_server.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <map>
#include <unordered_map>
#include <vector>

#include "parallel/store_protocol.h"

namespace primus::parallel {
namespace {

using wire::Op;
using wire::Status;

struct Conn {
  Fd fd;
  std::string in, out;
  bool greeted = false;
  bool parked = false;  // a Get/Wait is waiting; later requests stay buffered until it is answered
  bool closing = false;
};

struct Parked {
  uint64_t conn;
  Op op;
  std::vector<std::string> keys;
  Clock::time_point deadline;
};

// All state of the serving loop; lives on the server thread only, so it needs no locks.
class Loop {
 public:
  Loop(int listener, int wake, std::atomic<int>* connections)
      : listener_(listener), wake_(wake), connections_(connections) {}

  void run() {
    while (true) {
      std::vector<pollfd> fds{{wake_, POLLIN, 0}, {listener_, POLLIN, 0}};
      std::vector<uint64_t> ids;
      for (auto& [id, c] : conns_) {
        fds.push_back({c.fd.get(), static_cast<short>(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
        ids.push_back(id);
      }
      int timeout = -1;
      for (auto& p : parked_) {
        int t = poll_timeout_ms(p.deadline);
        timeout = timeout < 0 ? t : std::min(timeout, t);
      }
      int r = ::poll(fds.data(), fds.size(), timeout);
      if (r < 0 && errno != EINTR) return;
      if (fds[0].revents) return;  // stop requested
      if (fds[1].revents & POLLIN) accept_all();
      for (size_t i = 0; i < ids.size(); ++i) {
        if (fds[i + 2].revents) service(ids[i], fds[i + 2].revents);
      }
      expire();
      for (auto it = conns_.begin(); it != conns_.end();) {
        if (it->second.closing) {
          drop_parked(it->first);
          it = conns_.erase(it);
        } else {
          ++it;
        }
      }
      connections_->store(static_cast<int>(conns_.size()));
    }
  }

 private:
  void accept_all() {
    while (true) {
      int fd = ::accept4(listener_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN: no more; other errors: the client will retry
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      conns_[next_id_++].fd.reset(fd);
    }
  }

  void service(uint64_t id, short events) {
    Conn& c = conns_.at(id);
    bool eof = false;
    if (events & POLLIN) {
      char buf[65536];
      while (true) {
        ssize_t n = ::recv(c.fd.get(), buf, sizeof buf, MSG_DONTWAIT);
        if (n > 0) {
          c.in.append(buf, static_cast<size_t>(n));
          continue;
        }
        if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) eof = true;
        break;
      }
    } else if (events & (POLLERR | POLLHUP | POLLNVAL)) {
      eof = true;
    }
    pump(id);  // a request that arrived just before the peer hung up still counts (e.g. a Set)
    flush(c);
    if (eof) c.closing = true;
  }

  // Handles every complete frame of a connection until one parks.
  void pump(uint64_t id) {
    Conn& c = conns_.at(id);
    while (!c.closing && !c.parked && c.in.size() >= 4) {
      uint32_t len;
      std::memcpy(&len, c.in.data(), 4);
      if (len > wire::kMaxFrame) {
        c.closing = true;
        return;
      }
      if (c.in.size() < 4 + static_cast<size_t>(len)) return;
      std::string body = c.in.substr(4, len);
      c.in.erase(0, 4 + static_cast<size_t>(len));
      try {
        handle(id, c, body);
      } catch (const std::exception&) {
        c.closing = true;  // malformed request: this client is not speaking our protocol
      }
    }
  }

  void handle(uint64_t id, Conn& c, const std::string& body) {
    wire::Reader r(body);
    Op op = static_cast<Op>(r.u8());
    if (!c.greeted) {
      if (op != Op::Hello || r.u32() != wire::kMagic || r.u32() != wire::kVersion) {
        c.closing = true;
        return;
      }
      c.greeted = true;
      reply(c, wire::Writer().u8(uint8_t(Status::Ok)));
      return;
    }
    switch (op) {
      case Op::Set: {
        std::string key = r.str();
        kv_[key] = r.str();
        reply(c, wire::Writer().u8(uint8_t(Status::Ok)));
        flush(c);  // before waking the waiters: one of them may be rank 0, about to stop the server
        resolve();
        return;
      }
      case Op::Add: {
        std::string key = r.str();
        int64_t delta = r.i64(), cur = 0;
        auto it = kv_.find(key);
        if (it != kv_.end()) {
          const std::string& s = it->second;
          auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), cur);
          if (ec != std::errc() || end != s.data() + s.size()) {
            reply(c, wire::Writer().u8(uint8_t(Status::Error)).str("key '" + key + "' does not hold an integer"));
            return;
          }
        }
        cur += delta;
        kv_[key] = std::to_string(cur);
        reply(c, wire::Writer().u8(uint8_t(Status::Ok)).i64(cur));
        flush(c);
        resolve();
        return;
      }
      case Op::Get:
      case Op::Wait: {
        Parked p{id, op, {}, {}};
        if (op == Op::Get) {
          p.keys.push_back(r.str());
        } else {
          uint32_t n = r.u32();
          for (uint32_t i = 0; i < n; ++i) p.keys.push_back(r.str());
        }
        p.deadline = Clock::now() + std::chrono::milliseconds(r.u64());
        if (!answer_if_ready(c, p)) {
          c.parked = true;
          parked_.push_back(std::move(p));
        }
        return;
      }
      case Op::Check: {
        uint32_t n = r.u32();
        bool all = true;
        for (uint32_t i = 0; i < n; ++i) all = kv_.count(r.str()) > 0 && all;
        reply(c, wire::Writer().u8(uint8_t(Status::Ok)).u8(all));
        return;
      }
      case Op::Delete: {
        bool existed = kv_.erase(r.str()) > 0;
        reply(c, wire::Writer().u8(uint8_t(Status::Ok)).u8(existed));
        return;
      }
      default:
        c.closing = true;
    }
  }

  bool answer_if_ready(Conn& c, const Parked& p) {
    for (const auto& k : p.keys) {
      if (!kv_.count(k)) return false;
    }
    wire::Writer w;
    w.u8(uint8_t(Status::Ok));
    if (p.op == Op::Get) w.str(kv_.at(p.keys[0]));
    reply(c, w);
    return true;
  }

  // A key arrived: answer every parked request that is now complete.
  void resolve() {
    std::vector<uint64_t> woken;
    for (auto it = parked_.begin(); it != parked_.end();) {
      Conn& c = conns_.at(it->conn);
      if (answer_if_ready(c, *it)) {
        c.parked = false;
        woken.push_back(it->conn);
        it = parked_.erase(it);
      } else {
        ++it;
      }
    }
    for (uint64_t id : woken) {
      flush(conns_.at(id));
      pump(id);  // may recurse into resolve() through a buffered Set; parked_ is re-walked there
    }
  }

  void expire() {
    auto now = Clock::now();
    std::vector<uint64_t> woken;
    for (auto it = parked_.begin(); it != parked_.end();) {
      if (it->deadline > now) {
        ++it;
        continue;
      }
      Conn& c = conns_.at(it->conn);
      wire::Writer w;
      w.u8(uint8_t(Status::Timeout));
      if (it->op == Op::Wait) {
        std::vector<std::string> missing;
        for (auto& k : it->keys) {
          if (!kv_.count(k)) missing.push_back(k);
        }
        w.u32(static_cast<uint32_t>(missing.size()));
        for (auto& k : missing) w.str(k);
      }
      reply(c, w);
      c.parked = false;
      woken.push_back(it->conn);
      it = parked_.erase(it);
    }
    for (uint64_t id : woken) {
      flush(conns_.at(id));
      pump(id);
    }
  }

  void drop_parked(uint64_t id) {
    std::erase_if(parked_, [id](const Parked& p) { return p.conn == id; });
  }

  void reply(Conn& c, const wire::Writer& w) { c.out += w.frame(); }

  void flush(Conn& c) {
    while (!c.out.empty() && !c.closing) {
      ssize_t n = ::send(c.fd.get(), c.out.data(), c.out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        c.out.erase(0, static_cast<size_t>(n));
      } else {
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) c.closing = true;
        return;  // full: poll() reports POLLOUT later
      }
    }
  }

  int listener_, wake_;
  std::atomic<int>* connections_;
  std::map<uint64_t, Conn> conns_;
  uint64_t next_id_ = 1;
  std::unordered_map<std::string, std::string> kv_;
  std::vector<Parked> parked_;
};

}  // namespace

TcpStoreServer::TcpStoreServer(int port) {
  listener_ = listen_tcp(port, &port_);
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) throw RuntimeError("TCP store: cannot create a pipe");
  wake_read_.reset(p[0]);
  wake_write_.reset(p[1]);
  thread_ = std::thread([this] { run(); });
}

TcpStoreServer::~TcpStoreServer() {
  char b = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_write_.get(), &b, 1);
  if (thread_.joinable()) thread_.join();
}

void TcpStoreServer::run() { Loop(listener_.get(), wake_read_.get(), &connections_).run(); }

bool TcpStoreServer::wait_idle(Clock::time_point deadline) const {
  while (connections_.load() > 0) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

}  // namespace primus::parallel
