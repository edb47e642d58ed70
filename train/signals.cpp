#include "train/signals.h"

#include <unistd.h>

#include <atomic>
#include <csignal>

namespace primus::train {
namespace {
std::atomic<int> g_signal{0};

void on_signal(int sig) {
  int expected = 0;
  if (!g_signal.compare_exchange_strong(expected, sig)) {
    if (sig == SIGTERM) _exit(128 + SIGTERM);  // second request: leave now, save nothing
  }
}
}  // namespace

void install_exit_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGUSR1, &sa, nullptr);
}
bool exit_requested() { return g_signal.load() != 0; }
int exit_signal() { return g_signal.load(); }
void reset_exit_request() { g_signal.store(0); }

}  // namespace primus::train
