// The hub of a job whose ranks are threads, and each rank's ProcessGroup over it. Rendezvous is a
// step counter per rank under the hub's mutex: a collective is two or three steps (post; for
// all_reduce, chunks reduced; done), each a wait until every rank's counter reaches the step.
// Counters only grow, so a rank that already left a step for the next call cannot be mistaken
// for one that has not arrived.
#include "parallel/threaded_process_group.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "io/dtype.h"

namespace primus::parallel {

namespace threaded_detail {

using Clock = std::chrono::steady_clock;
using Lock = std::unique_lock<std::mutex>;

std::string op_text(const char* name, size_t count, DType dtype) {
  return fmt::format("{} of {} {} elements", name, count, dtype_name(dtype));
}

double secs(std::chrono::milliseconds t) { return static_cast<double>(t.count()) / 1000.0; }

const char* byte_at(const void* p, size_t off) { return static_cast<const char*>(p) + off; }
char* byte_at(void* p, size_t off) { return static_cast<char*>(p) + off; }

template <class Load, class Store>
void reduce_loop(size_t k, size_t count, ReduceOp op, Load load, Store store) {
  const float div = static_cast<float>(k);
  for (size_t i = 0; i < count; ++i) {
    float acc = load(0, i);
    for (size_t j = 1; j < k; ++j) acc = reduce_step(op, acc, load(j, i));
    store(i, op == ReduceOp::Avg ? acc / div : acc);
  }
}

}  // namespace threaded_detail

void HostMemoryOps::copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0 && dst != src) std::memcpy(dst, src, bytes);
}

void HostMemoryOps::reduce(void* dst, const void* const* srcs, size_t k, size_t count, DType dtype, ReduceOp op) {
  if (k == 0 || count == 0) return;
  if (dtype == DType::F32) {
    threaded_detail::reduce_loop(
        k, count, op, [&](size_t j, size_t i) { return static_cast<const float*>(srcs[j])[i]; },
        [&](size_t i, float v) { static_cast<float*>(dst)[i] = v; });
  } else {
    threaded_detail::reduce_loop(
        k, count, op, [&](size_t j, size_t i) { return io::bf16_to_fp32(static_cast<const uint16_t*>(srcs[j])[i]); },
        [&](size_t i, float v) { static_cast<uint16_t*>(dst)[i] = io::fp32_to_bf16(v); });
  }
}

class ThreadedGroup::Hub {
 public:
  using Lock = threaded_detail::Lock;
  // What one rank brings to a collective. The metadata is copied by every rank at the first
  // step; the buffers stay valid until the last step.
  struct Post {
    std::string what;
    const char* kind = "";
    size_t count = 0;
    DType dtype = DType::F32;
    int root = -1;
    ReduceOp op = ReduceOp::Sum;
    const void* src = nullptr;
    void* dst = nullptr;
    std::vector<size_t> send_counts, recv_counts;  // all_to_all_v
  };
  // A send waiting for its recv: Posted until the receiver takes it, Taken while the receiver
  // copies from `buf`, Done after (the sender may then return and reuse its buffer).
  struct Mail {
    enum class State { Posted, Taken, Done };
    const void* buf = nullptr;
    size_t bytes = 0;
    std::string what;
    State state = State::Posted;
    std::string error;  // set by the receiver when the sizes disagree
  };

  Hub(std::string name_, std::vector<int> members_, Ms timeout_, bool sub_)
      : name(std::move(name_)), members(std::move(members_)), timeout(timeout_), sub(sub_) {
    const size_t n = members.size();
    step.assign(n, 0);
    calls.assign(n, 0);
    last.assign(n, "");
    posts.resize(n);
    accessing.assign(n, 0);
    left.assign(n, 0);
    joined.assign(n, 0);
  }

  int size() const { return static_cast<int>(members.size()); }

  std::string label(int group_rank) const {
    if (!sub) return fmt::format("rank {}", members[static_cast<size_t>(group_rank)]);
    return fmt::format("rank {} (rank {} of the group)", members[static_cast<size_t>(group_rank)], group_rank);
  }

  void abort(const std::string& reason) {
    std::vector<std::shared_ptr<Hub>> kids;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (!aborted) {
        aborted = true;
        abort_reason = reason;
      }
      for (auto& [name_of, hub] : children) kids.push_back(hub);
    }
    cv.notify_all();
    for (auto& k : kids) k->abort(reason);
  }

  const std::string name;
  const std::vector<int> members;  // the world rank of each rank of this group
  const Ms timeout;
  const bool sub;

  std::mutex mu;
  std::condition_variable cv;
  std::vector<int64_t> step;      // steps each rank has reached
  std::vector<int64_t> calls;     // collectives each rank has started
  std::vector<std::string> last;  // each rank's latest call, for error messages
  std::vector<Post> posts;
  // 1 while a rank may read its peers' buffers (between the steps of a call): a rank that fails
  // waits for these to clear before its caller can free its buffers.
  std::vector<char> accessing;
  std::vector<char> left;    // the rank's ProcessGroup was destroyed
  std::vector<char> joined;  // the rank has taken its group (world) or joined (sub-group)
  bool aborted = false;
  std::string abort_reason;
  std::map<std::tuple<int, int, uint32_t>, std::shared_ptr<Mail>> mail;  // (from, to, tag)
  std::map<std::string, std::shared_ptr<Hub>> children;                  // sub-groups by full name
};

namespace threaded_detail {

using Hub = ThreadedGroup::Hub;
using Ms = ThreadedGroup::Ms;

class ThreadedProcessGroup final : public ProcessGroup {
 public:
  ThreadedProcessGroup(std::shared_ptr<Hub> hub, int rank, std::shared_ptr<MemoryOps> ops)
      : hub_(std::move(hub)), rank_(rank), ops_(std::move(ops)) {}

  ~ThreadedProcessGroup() override {
    {
      Lock lk(hub_->mu);
      hub_->left[me()] = 1;
      hub_->accessing[me()] = 0;
    }
    hub_->cv.notify_all();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return hub_->size(); }
  std::string backend() const override { return "threads"; }
  Ms timeout() const override { return hub_->timeout; }

  void all_reduce(void* buf, size_t count, DType dtype, ReduceOp op) override {
    const std::string what = op_text("all_reduce", count, dtype);
    check_usable(what);
    if (count == 0) return;
    Hub::Post p{what, "all_reduce", count, dtype, -1, op, buf, buf, {}, {}};
    Call call(*this);
    begin(p);
    // Rank r reduces chunk r of every buffer into its own (only rank r reads chunk r in this
    // phase), then copies the other ranks' reduced chunks: the same bits on every rank.
    const size_t es = dtype_size(dtype);
    const auto [lo, hi] = chunk(count, rank_);
    if (hi > lo) {
      for (size_t q = 0; q < peers_.size(); ++q) srcs_[q] = byte_at(peers_[q].dst, lo * es);
      ops_->reduce(byte_at(buf, lo * es), srcs_.data(), peers_.size(), hi - lo, dtype, op);
    }
    ops_->synchronize();
    arrive(what, nullptr, false);
    for (int q = 0; q < world_size(); ++q) {
      const auto [qlo, qhi] = chunk(count, q);
      if (q != rank_ && qhi > qlo)
        ops_->copy(byte_at(buf, qlo * es), byte_at(peers_[q].dst, qlo * es), (qhi - qlo) * es);
    }
    finish(what);
  }

  void reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override {
    const std::string what = op_text("reduce_scatter", count, dtype);
    check_usable(what);
    if (count == 0) return;
    Hub::Post p{what, "reduce_scatter", count, dtype, -1, op, send, recv, {}, {}};
    Call call(*this);
    begin(p);
    // Only rank r reads chunk r of the inputs, so recv == send + r * count is safe.
    const size_t off = static_cast<size_t>(rank_) * count * dtype_size(dtype);
    for (size_t q = 0; q < peers_.size(); ++q) srcs_[q] = byte_at(peers_[q].src, off);
    ops_->reduce(recv, srcs_.data(), peers_.size(), count, dtype, op);
    finish(what);
  }

  void all_gather(const void* send, void* recv, size_t count, DType dtype) override {
    const std::string what = op_text("all_gather", count, dtype);
    check_usable(what);
    const size_t bytes = count * dtype_size(dtype);
    if (bytes == 0) return;
    Hub::Post p{what, "all_gather", count, dtype, -1, ReduceOp::Sum, send, recv, {}, {}};
    Call call(*this);
    begin(p);
    for (int q = 0; q < world_size(); ++q) {
      void* to = byte_at(recv, static_cast<size_t>(q) * bytes);
      if (q == rank_ && to == send) continue;  // in place
      ops_->copy(to, peers_[static_cast<size_t>(q)].src, bytes);
    }
    finish(what);
  }

  void broadcast(void* buf, size_t count, DType dtype, int root) override {
    const std::string what = op_text("broadcast", count, dtype) + fmt::format(" from rank {}", root);
    check_usable(what);
    if (root < 0 || root >= world_size()) {
      throw CollectiveError(fmt::format("{} {}: root {} is not a rank of the group", what, where(), root));
    }
    const size_t bytes = count * dtype_size(dtype);
    if (bytes == 0) return;
    Hub::Post p{what, "broadcast", count, dtype, root, ReduceOp::Sum, buf, buf, {}, {}};
    Call call(*this);
    begin(p);
    if (rank_ != root) ops_->copy(buf, peers_[static_cast<size_t>(root)].dst, bytes);
    finish(what);
  }

  void barrier() override {
    check_usable("barrier");
    Hub::Post p{"barrier", "barrier", 0, DType::F32, -1, ReduceOp::Sum, nullptr, nullptr, {}, {}};
    Call call(*this);
    // Two steps like every collective: the posts compared after the first stay valid until all
    // ranks have passed it.
    begin(p);
    arrive("barrier", nullptr, true);
  }

  void all_to_all_v(const void* send, const std::vector<size_t>& send_counts, void* recv,
                    const std::vector<size_t>& recv_counts, DType dtype) override {
    size_t total = 0;
    for (size_t c : send_counts) total += c;
    const std::string what = op_text("all_to_all", total, dtype);
    check_usable(what);
    const size_t n = static_cast<size_t>(world_size());
    if (send_counts.size() != n || recv_counts.size() != n) {
      throw CollectiveError(fmt::format("{} {}: {} send and {} receive counts for {} ranks", what, where(),
                                        send_counts.size(), recv_counts.size(), n));
    }
    Hub::Post p{what, "all_to_all", 0, dtype, -1, ReduceOp::Sum, send, recv, send_counts, recv_counts};
    Call call(*this);
    begin(p);
    const size_t es = dtype_size(dtype);
    size_t at = 0;  // where rank q's part goes in recv
    for (size_t q = 0; q < n; ++q) {
      const auto& theirs = peers_[q].send_counts;
      size_t from = 0;  // where this rank's part starts in rank q's send
      for (size_t r = 0; r < static_cast<size_t>(rank_); ++r) from += theirs[r];
      if (recv_counts[q] > 0)
        ops_->copy(byte_at(recv, at * es), byte_at(peers_[q].src, from * es), recv_counts[q] * es);
      at += recv_counts[q];
    }
    finish(what);
  }

  void send(const void* buf, size_t count, DType dtype, int peer, uint32_t tag) override {
    const std::string what = op_text("send", count, dtype) + fmt::format(" to rank {} (tag {})", peer, tag);
    check_peer(what, peer);
    if (count == 0) return;
    ops_->synchronize();  // the buffer's contents are final before the receiver reads them
    Hub& h = *hub_;
    Lock lk(h.mu);
    if (h.aborted) fail_aborted(lk, what);
    h.last[me()] = what;
    const auto key = std::make_tuple(rank_, peer, tag);
    auto m = std::make_shared<Hub::Mail>();
    m->buf = buf;
    m->bytes = count * dtype_size(dtype);
    m->what = what;
    h.mail[key] = m;
    h.cv.notify_all();
    const auto deadline = Clock::now() + h.timeout;
    while (m->state != Hub::Mail::State::Done) {
      if (m->state == Hub::Mail::State::Taken) {  // the receiver is copying from buf; it always ends
        h.cv.wait(lk);
        continue;
      }
      const bool gone = h.left[static_cast<size_t>(peer)] != 0;
      if (h.aborted || gone || Clock::now() >= deadline) {
        h.mail.erase(key);
        if (h.aborted) fail_aborted(lk, what);
        fail(lk, what, p2p_missing(peer, gone, "recv"));
      }
      h.cv.wait_until(lk, deadline);
    }
    if (!m->error.empty()) fail(lk, what, m->error);
  }

  void recv(void* buf, size_t count, DType dtype, int peer, uint32_t tag) override {
    const std::string what = op_text("recv", count, dtype) + fmt::format(" from rank {} (tag {})", peer, tag);
    check_peer(what, peer);
    if (count == 0) return;
    const size_t bytes = count * dtype_size(dtype);
    Hub& h = *hub_;
    Lock lk(h.mu);
    h.last[me()] = what;
    const auto key = std::make_tuple(peer, rank_, tag);
    const auto deadline = Clock::now() + h.timeout;
    std::shared_ptr<Hub::Mail> m;
    for (;;) {
      if (h.aborted) fail_aborted(lk, what);
      if (auto it = h.mail.find(key); it != h.mail.end()) {
        m = it->second;
        h.mail.erase(it);
        break;
      }
      const bool gone = h.left[static_cast<size_t>(peer)] != 0;
      if (gone || Clock::now() >= deadline) fail(lk, what, p2p_missing(peer, gone, "send"));
      h.cv.wait_until(lk, deadline);
    }
    if (m->bytes != bytes) {
      m->error = fmt::format("{} posted '{}' ({} bytes) but {} expects {} bytes", h.label(peer), m->what, m->bytes,
                             h.label(rank_), bytes);
      m->state = Hub::Mail::State::Done;
      h.cv.notify_all();
      fail(lk, what, m->error);
    }
    m->state = Hub::Mail::State::Taken;
    lk.unlock();
    try {
      ops_->copy(buf, m->buf, bytes);
      ops_->synchronize();
    } catch (const std::exception& e) {
      lk.lock();
      m->error = fmt::format("the receiving {} failed to copy: {}", h.label(rank_), e.what());
      m->state = Hub::Mail::State::Done;
      h.cv.notify_all();
      fail(lk, what, m->error);
    }
    lk.lock();
    m->state = Hub::Mail::State::Done;
    h.cv.notify_all();
  }

  std::unique_ptr<ProcessGroup> new_subgroup(const std::vector<int>& ranks, const std::string& name) override {
    Hub& h = *hub_;
    const std::string full = h.name + "/" + name;
    const std::string what = "new_subgroup '" + full + "'";
    check_usable(what);
    std::vector<int> members;
    int me_in_sub = -1;
    for (size_t i = 0; i < ranks.size(); ++i) {
      const int r = ranks[i];
      if (r < 0 || r >= world_size() || std::count(ranks.begin(), ranks.end(), r) != 1) {
        throw CollectiveError(
            fmt::format("sub-group '{}': rank {} is not a rank of '{}' ({} ranks), or is listed twice", full, r, h.name,
                        world_size()));
      }
      if (r == rank_) me_in_sub = static_cast<int>(i);
      members.push_back(h.members[static_cast<size_t>(r)]);
    }
    if (me_in_sub < 0) {
      throw CollectiveError(fmt::format("sub-group '{}': rank {} of '{}' is not a member; only the members create it",
                                        full, rank_, h.name));
    }
    std::shared_ptr<Hub> sub;
    {
      Lock lk(h.mu);
      if (h.aborted) fail_aborted(lk, what);
      auto& slot = h.children[full];
      if (!slot) slot = std::make_shared<Hub>(full, members, h.timeout, true);
      if (slot->members != members) {
        throw CollectiveError(
            fmt::format("sub-group '{}' on rank {}/{}: this rank lists world ranks [{}], another "
                        "member listed [{}]",
                        full, rank_, world_size(), fmt::join(members, ", "), fmt::join(slot->members, ", ")));
      }
      sub = slot;
    }
    Hub& s = *sub;
    Lock lk(s.mu);
    const size_t mine = static_cast<size_t>(me_in_sub);
    if (s.joined[mine]) {
      throw CollectiveError(
          fmt::format("sub-group '{}' was created on rank {} already; sub-groups need distinct names", full, rank_));
    }
    s.joined[mine] = 1;
    s.cv.notify_all();
    const auto deadline = Clock::now() + s.timeout;
    for (;;) {
      if (s.aborted) {
        throw CollectiveError(fmt::format("sub-group '{}' setup on rank {}/{}: the process group was aborted ({})",
                                          full, me_in_sub, s.size(), s.abort_reason));
      }
      std::vector<std::string> absent;
      for (int q = 0; q < s.size(); ++q) {
        if (!s.joined[static_cast<size_t>(q)]) absent.push_back(s.label(q));
      }
      if (absent.empty()) break;
      if (Clock::now() >= deadline) {
        const std::string text =
            fmt::format("sub-group '{}' setup on rank {}/{}: {} did not join within {:.1f} s (timeout)", full,
                        me_in_sub, s.size(), fmt::join(absent, ", "), secs(s.timeout));
        lk.unlock();
        s.abort(text);
        throw CollectiveError(text);
      }
      s.cv.wait_until(lk, deadline);
    }
    return std::make_unique<ThreadedProcessGroup>(sub, me_in_sub, ops_);
  }

  void synchronize() override { ops_->synchronize(); }

  void abort() override {
    hub_->abort(fmt::format("abort() was called on rank {}/{} (threads group '{}')", rank_, world_size(), hub_->name));
  }

 private:
  // Clears this rank's `accessing` mark when a collective throws between its steps.
  struct Call {
    explicit Call(ThreadedProcessGroup& g) : g(g), uncaught(std::uncaught_exceptions()) {}
    ~Call() {
      if (std::uncaught_exceptions() > uncaught) {
        {
          Lock lk(g.hub_->mu);
          g.hub_->accessing[g.me()] = 0;
        }
        g.hub_->cv.notify_all();
      }
    }
    ThreadedProcessGroup& g;
    int uncaught;
  };

  size_t me() const { return static_cast<size_t>(rank_); }

  std::string where() const {
    return fmt::format("on rank {}/{} (threads group '{}')", rank_, world_size(), hub_->name);
  }

  // [lo, hi) of rank q's chunk of an all_reduce of `count` elements.
  std::pair<size_t, size_t> chunk(size_t count, int q) const {
    const size_t n = static_cast<size_t>(world_size());
    return {count * static_cast<size_t>(q) / n, count * static_cast<size_t>(q + 1) / n};
  }

  void check_usable(const std::string& what) {
    Lock lk(hub_->mu);
    if (hub_->aborted) fail_aborted(lk, what);
  }

  void check_peer(const std::string& what, int peer) {
    check_usable(what);
    if (peer < 0 || peer >= world_size() || peer == rank_)
      throw CollectiveError(fmt::format("{} {}: not a peer", what, where()));
  }

  // Waits (at most timeout()) until no other rank may still read this rank's buffers, so that
  // a failing call does not hand them back to its caller while a peer copies from them.
  void settle(Lock& lk) {
    Hub& h = *hub_;
    h.accessing[me()] = 0;
    h.cv.notify_all();
    auto quiet = [&] { return std::none_of(h.accessing.begin(), h.accessing.end(), [](char a) { return a != 0; }); };
    h.cv.wait_until(lk, Clock::now() + h.timeout, quiet);
  }

  [[noreturn]] void fail_aborted(Lock& lk, const std::string& what) {
    const std::string text =
        fmt::format("{} {}: the process group was aborted ({})", what, where(), hub_->abort_reason);
    settle(lk);
    throw CollectiveError(text);
  }

  // Aborts the group (waking every other waiter with `text`) and throws.
  [[noreturn]] void fail(Lock& lk, const std::string& what, const std::string& detail) {
    const std::string text = fmt::format("{} {}: {}", what, where(), detail);
    hub_->accessing[me()] = 0;
    lk.unlock();
    hub_->abort(text);
    lk.lock();
    settle(lk);
    throw CollectiveError(text);
  }

  std::string missing_text(const std::vector<int>& absent, bool gone) const {
    const Hub& h = *hub_;
    std::vector<std::string> who;
    for (int q : absent) {
      const size_t i = static_cast<size_t>(q);
      std::string state;
      if (h.left[i]) {
        state = "left the group: its ProcessGroup was destroyed";
      } else if (h.calls[i] < calls_) {
        state = h.calls[i] == 0 ? "has made no collective call on this group"
                                : fmt::format("has made {} of these {} collective calls", h.calls[i], calls_);
        if (!h.last[i].empty()) state += "; its latest call: " + h.last[i];
      } else {
        state = "has not finished this call";
      }
      who.push_back(fmt::format("{} ({})", h.label(q), state));
    }
    const std::string head =
        gone ? std::string("a rank left the group") : fmt::format("timed out (timeout {:.1f} s)", secs(h.timeout));
    return fmt::format("{}; missing: {}", head, fmt::join(who, ", "));
  }

  std::string p2p_missing(int peer, bool gone, const char* matching) const {
    const Hub& h = *hub_;
    const size_t i = static_cast<size_t>(peer);
    std::string state = gone ? std::string("left the group: its ProcessGroup was destroyed")
                             : fmt::format("has not posted the matching {}", matching);
    if (!gone && !h.last[i].empty()) state += "; its latest call: " + h.last[i];
    const std::string head =
        gone ? std::string("the peer left the group") : fmt::format("timed out (timeout {:.1f} s)", secs(h.timeout));
    return fmt::format("{}; missing: {} ({})", head, h.label(peer), state);
  }

  // One rendezvous step: `post` (first step of a call) is published, then every rank's step
  // counter must reach this rank's. After a step that is not the call's last this rank may read
  // the others' buffers.
  void arrive(const std::string& what, const Hub::Post* post, bool last) {
    Hub& h = *hub_;
    Lock lk(h.mu);
    h.accessing[me()] = 0;
    if (h.aborted) fail_aborted(lk, what);
    if (post) {
      h.posts[me()] = *post;
      h.calls[me()] = ++calls_;
      h.last[me()] = what;
    }
    h.step[me()] = ++step_;
    h.cv.notify_all();
    const auto deadline = Clock::now() + h.timeout;
    std::vector<int> absent;
    for (;;) {
      // Abort first: once it is set no rank starts reading, so settle() only waits for reads
      // already under way.
      if (h.aborted) fail_aborted(lk, what);
      absent.clear();
      bool gone = false;
      for (int q = 0; q < h.size(); ++q) {
        if (h.step[static_cast<size_t>(q)] < step_) {
          absent.push_back(q);
          gone = gone || h.left[static_cast<size_t>(q)];
        }
      }
      if (absent.empty()) break;
      if (gone || Clock::now() >= deadline) fail(lk, what, missing_text(absent, gone));
      h.cv.wait_until(lk, deadline);
    }
    if (post) peers_ = h.posts;
    h.accessing[me()] = last ? 0 : 1;
  }

  // The first step of a collective, then the check that every rank called the same one.
  void begin(const Hub::Post& p) {
    ops_->synchronize();  // this rank's inputs are final before the others read them
    arrive(p.what, &p, false);
    srcs_.resize(peers_.size());
    std::string why;
    const Hub::Post& a = peers_[0];
    for (const auto& q : peers_) {
      if (std::strcmp(q.kind, a.kind) != 0 || q.count != a.count || q.dtype != a.dtype || q.root != a.root ||
          q.op != a.op) {
        std::vector<std::string> calls;
        for (size_t r = 0; r < peers_.size(); ++r) {
          calls.push_back(fmt::format("{} called {}{}", hub_->label(static_cast<int>(r)), peers_[r].what,
                                      peers_[r].op != ReduceOp::Sum ? fmt::format(" ({})", reduce_op_name(peers_[r].op))
                                                                    : ""));
        }
        why = "the ranks called different collectives: " + fmt::format("{}", fmt::join(calls, ", "));
        break;
      }
    }
    if (why.empty() && std::strcmp(a.kind, "all_to_all") == 0) {
      for (size_t q = 0; q < peers_.size() && why.empty(); ++q) {
        for (size_t r = 0; r < peers_.size(); ++r) {
          const size_t sends = peers_[q].send_counts[r], gets = peers_[r].recv_counts[q];
          if (sends != gets) {
            why = fmt::format("{} sends {} elements to {}, which expects {}", hub_->label(static_cast<int>(q)), sends,
                              hub_->label(static_cast<int>(r)), gets);
            break;
          }
        }
      }
    }
    if (!why.empty()) {
      Lock lk(hub_->mu);
      fail(lk, p.what, why);
    }
  }

  // The last step: this rank's reads are complete before the others may reuse their buffers.
  void finish(const std::string& what) {
    ops_->synchronize();
    arrive(what, nullptr, true);
  }

  std::shared_ptr<Hub> hub_;
  int rank_;
  std::shared_ptr<MemoryOps> ops_;
  int64_t step_ = 0;
  int64_t calls_ = 0;
  std::vector<Hub::Post> peers_;  // every rank's post of the current call
  std::vector<const void*> srcs_;
};

}  // namespace threaded_detail

ThreadedGroup::ThreadedGroup(std::shared_ptr<Hub> hub, OpsFactory ops) : hub_(std::move(hub)), ops_(std::move(ops)) {}

std::shared_ptr<ThreadedGroup> ThreadedGroup::create(int world_size, Ms timeout, OpsFactory ops,
                                                     const std::string& name) {
  if (world_size < 1)
    throw CollectiveError(fmt::format("threads group '{}': world size {} is not positive", name, world_size));
  std::vector<int> members(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) members[static_cast<size_t>(r)] = r;
  auto hub = std::make_shared<Hub>(name, std::move(members), timeout, false);
  return std::shared_ptr<ThreadedGroup>(new ThreadedGroup(std::move(hub), std::move(ops)));
}

std::unique_ptr<ProcessGroup> ThreadedGroup::rank(int r) {
  if (r < 0 || r >= hub_->size()) {
    throw CollectiveError(
        fmt::format("threads group '{}': rank {} of world size {} is not valid", hub_->name, r, hub_->size()));
  }
  {
    std::lock_guard<std::mutex> lk(hub_->mu);
    if (hub_->joined[static_cast<size_t>(r)]) {
      throw CollectiveError(fmt::format("threads group '{}': rank {} was taken already", hub_->name, r));
    }
    hub_->joined[static_cast<size_t>(r)] = 1;
  }
  std::shared_ptr<MemoryOps> ops = ops_ ? ops_(r) : std::unique_ptr<MemoryOps>(new HostMemoryOps());
  return std::make_unique<threaded_detail::ThreadedProcessGroup>(hub_, r, std::move(ops));
}

int ThreadedGroup::world_size() const { return hub_->size(); }
ThreadedGroup::Ms ThreadedGroup::timeout() const { return hub_->timeout; }
void ThreadedGroup::abort(const std::string& reason) { hub_->abort(reason); }

}  // namespace primus::parallel
