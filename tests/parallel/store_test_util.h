// Shared by the TCP store tests: a fixture hosting a store on a free port, and random bytes.
#pragma once
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <random>
#include <string>

#include "parallel/tcp_store.h"

namespace primus::parallel {

using Ms = std::chrono::milliseconds;

inline std::string random_bytes(std::mt19937& rng, size_t n) {
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng());  // includes '\0' and bytes >= 0x80
  return s;
}

inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A server store on a free port plus a way to open more clients to it.
class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override { server_ = std::make_unique<TcpStore>("127.0.0.1", 0, true, Ms(5000)); }
  std::unique_ptr<TcpStore> client(Ms timeout = Ms(5000)) {
    return std::make_unique<TcpStore>("127.0.0.1", server_->port(), false, timeout);
  }
  std::unique_ptr<TcpStore> server_;
  std::mt19937 rng_{std::random_device{}()};
};

}  // namespace primus::parallel
