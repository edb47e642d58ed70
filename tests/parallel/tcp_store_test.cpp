// The rendezvous store across threads (processes: tcp_store_process_test.cpp): values arrive intact, counters are atomic,
// barriers hold everyone back, and every wait ends: in an error that names the missing key or
// ranks when the timeout passes, or in a lost-connection error when the server goes away.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <random>
#include <thread>

#include "parallel/store_protocol.h"
#include "tests/core/test_util.h"
#include "tests/parallel/store_test_util.h"

namespace primus::parallel {
namespace {

using primus::testing::expect_error;

TEST_F(StoreTest, SetGetAcrossThreads) {
  constexpr int kRanks = 4;
  std::vector<std::string> values;
  for (int r = 0; r < kRanks; ++r) values.push_back(random_bytes(rng_, 1 + rng_() % 300));
  std::vector<std::vector<std::string>> seen(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      auto s = client();
      s->set("value/" + std::to_string(r), values[r]);
      for (int q = 0; q < kRanks; ++q) seen[r].push_back(s->get("value/" + std::to_string(q)));
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(seen[r], values) << "rank " << r;
  EXPECT_EQ(server_->get("value/2"), values[2]);
  server_->set("value/2", "replaced");
  EXPECT_EQ(client()->get("value/2"), "replaced");
}

TEST_F(StoreTest, GetWaitsForTheKey) {
  std::string id = random_bytes(rng_, 128);  // the size of an NCCL unique id
  auto t0 = Clock::now();
  std::thread late([&] {
    std::this_thread::sleep_for(Ms(150));
    client()->set("nccl_id", id);
  });
  EXPECT_EQ(server_->get("nccl_id"), id);
  EXPECT_GE(seconds_since(t0), 0.1);
  late.join();
}

TEST_F(StoreTest, GetTimeoutNamesTheKey) {
  auto c = client();
  auto t0 = Clock::now();
  expect_error<RuntimeError>([&] { c->get("no_such_key", Ms(200)); }, {"no_such_key", "timed out after 0.2 s"});
  EXPECT_LT(seconds_since(t0), 2.0);
  c->set("after", "x");  // the connection is still in step after a timeout
  EXPECT_EQ(c->get("after"), "x");
}

TEST_F(StoreTest, AddIsAtomic) {
  constexpr int kThreads = 4, kAdds = 100;
  std::vector<std::vector<int64_t>> got(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto s = client();
      for (int i = 0; i < kAdds; ++i) got[t].push_back(s->add("counter", 1));
    });
  }
  for (auto& t : threads) t.join();
  std::vector<int64_t> all;
  for (auto& g : got) all.insert(all.end(), g.begin(), g.end());
  std::sort(all.begin(), all.end());
  for (int i = 0; i < kThreads * kAdds; ++i) ASSERT_EQ(all[i], i + 1) << "every add saw a distinct value";
  int64_t delta = static_cast<int64_t>(rng_() % 1000000) - 500000;
  EXPECT_EQ(server_->add("counter", delta), kThreads * kAdds + delta);
  EXPECT_EQ(server_->get("counter"), std::to_string(kThreads * kAdds + delta));
  server_->set("text", "abc");
  expect_error<RuntimeError>([&] { server_->add("text", 1); }, {"'text'", "not hold an integer"});
}

TEST_F(StoreTest, WaitCheckRemove) {
  auto c = client();
  c->set("a", "1");
  EXPECT_TRUE(c->check({"a"}));
  EXPECT_FALSE(c->check({"a", "b"}));
  std::string msg = expect_error<RuntimeError>([&] { c->wait({"a", "b", "c"}, Ms(150)); }, {"'b'", "'c'"});
  EXPECT_EQ(msg.find("'a'"), std::string::npos) << msg;
  std::thread late([&] { client()->set("b", "2"); });
  c->wait({"a", "b"}, Ms(3000));
  late.join();
  EXPECT_TRUE(c->remove("a"));
  EXPECT_FALSE(c->remove("a"));
  EXPECT_FALSE(c->check({"a"}));
}

TEST_F(StoreTest, BarrierHoldsEveryoneBackAndRepeats) {
  constexpr int kRanks = 4, kRounds = 5;
  std::atomic<int> arrived{0};
  std::atomic<bool> early{false};
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      auto s = client();
      for (int round = 0; round < kRounds; ++round) {
        std::this_thread::sleep_for(Ms(rng_() % 20));
        arrived++;
        s->barrier("step", r, kRanks);
        if (arrived.load() < (round + 1) * kRanks) early = true;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_FALSE(early.load()) << "a rank left a barrier before all had arrived";
  EXPECT_EQ(arrived.load(), kRanks * kRounds);
}

TEST_F(StoreTest, BarrierTimeoutNamesMissingRanks) {
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  int present[] = {0, 2};
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      auto s = client();
      try {
        s->barrier("init", present[i], 4, Ms(300));
      } catch (const RuntimeError& e) {
        errors[i] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    EXPECT_NE(e.find("barrier 'init' timed out"), std::string::npos) << e;
    EXPECT_NE(e.find("2 of 4 ranks arrived"), std::string::npos) << e;
    EXPECT_NE(e.find("missing ranks 1, 3"), std::string::npos) << e;
  }
}

// A host destroyed normally stays up while a client still uses it: the last rank out of a
// barrier may still be talking to the store when rank 0 leaves.
TEST_F(StoreTest, HostOutlivesItsClients) {
  auto c = client();
  auto t0 = Clock::now();
  std::thread leave([&] { server_.reset(); });
  std::this_thread::sleep_for(Ms(150));
  std::string v = random_bytes(rng_, 40);
  c->set("late", v);
  EXPECT_EQ(c->get("late"), v);
  c.reset();
  leave.join();
  EXPECT_GE(seconds_since(t0), 0.14);
  EXPECT_LT(seconds_since(t0), 3.0) << "the host should leave as soon as its last client hung up";
}

// ...but not while unwinding from an error: a failing rank 0 must exit promptly.
TEST_F(StoreTest, FailingHostDoesNotLinger) {
  auto c = client();
  auto t0 = Clock::now();
  try {
    auto host = std::move(server_);
    throw std::runtime_error("rank 0 failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_LT(seconds_since(t0), 1.0);
  expect_error<RuntimeError>([&] { c->get("x", Ms(2000)); }, {"closed the connection"});
}

TEST(TcpStore, ConnectGivesUpAtTheTimeout) {
  int port = 0;
  listen_tcp(0, &port);  // a port that was free a moment ago and has no listener now
  auto t0 = Clock::now();
  expect_error<RuntimeError>([&] { TcpStore("127.0.0.1", port, false, Ms(300)); },
                             {"cannot reach", "127.0.0.1:" + std::to_string(port), "MASTER_ADDR"});
  EXPECT_LT(seconds_since(t0), 2.0);
}

TEST(TcpStore, BusyPortIsNamed) {
  TcpStore a("127.0.0.1", 0, true, Ms(1000));
  expect_error<RuntimeError>([&] { TcpStore("127.0.0.1", a.port(), true, Ms(1000)); },
                             {std::to_string(a.port()), "MASTER_PORT", "in use"});
}

// A client that speaks garbage loses its own connection; the store keeps serving the others.
TEST_F(StoreTest, GarbageFromOneClientHarmsNoOther) {
  auto good = client();
  good->set("k", "v");
  Fd raw = connect_tcp("127.0.0.1", server_->port(), Clock::now() + Ms(2000), "raw");
  std::string junk = random_bytes(rng_, 64);
  junk[0] = junk[1] = junk[2] = junk[3] = '\xff';  // an absurd frame length
  send_all(raw.get(), junk.data(), junk.size(), Clock::now() + Ms(1000), "raw");
  char b;
  EXPECT_EQ(::recv(raw.get(), &b, 1, 0), 0) << "the server should close a connection that sends garbage";
  EXPECT_EQ(good->get("k"), "v");
  EXPECT_EQ(client()->add("n", 2), 2);
}

TEST(StoreWire, ReaderRejectsTruncatedMessages) {
  std::string body = wire::Writer().u8(3).str("key").i64(-7).frame().substr(4);
  wire::Reader ok(body);
  EXPECT_EQ(ok.u8(), 3);
  EXPECT_EQ(ok.str(), "key");
  EXPECT_EQ(ok.i64(), -7);
  EXPECT_TRUE(ok.done());
  for (size_t cut = 0; cut < body.size(); ++cut) {
    wire::Reader r(std::string_view(body).substr(0, cut));
    EXPECT_THROW(
        {
          r.u8();
          r.str();
          r.i64();
        },
        FormatError)
        << "cut at " << cut;
  }
}

}  // namespace
}  // namespace primus::parallel
