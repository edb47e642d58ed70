// libprimus_gloo.so: the Gloo calls behind parallel::GlooProcessGroup, exported as plain C
// (gloo_plugin_abi.h says why). Each handle is one gloo context: a full mesh of TCP pairs between
// the ranks of one group. Every Gloo exception is caught here and returned as text; primus adds
// which rank is missing (it keeps the heartbeats, see parallel/gloo_process_group.h).
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/config.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "parallel/gloo/gloo_plugin_abi.h"

namespace {

using Ms = std::chrono::milliseconds;

void put_error(char* err, size_t errlen, const std::string& msg) {
  if (!err || errlen == 0) return;
  std::snprintf(err, errlen, "%s", msg.c_str());
}

// Gloo's Store over primus's, through the C callbacks. A failing callback becomes an exception
// that gloo's rendezvous passes up to connect(), which reports its text.
class CallbackStore final : public gloo::rendezvous::Store {
 public:
  CallbackStore(const PrimusGlooStore& s, Ms timeout) : s_(s), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    char err[1024] = "";
    if (s_.set(s_.ctx, key.c_str(), data.data(), data.size(), err, sizeof err) != 0) throw std::runtime_error(err);
  }
  std::vector<char> get(const std::string& key) override {
    char err[1024] = "";
    std::vector<char> out;
    auto put = [](void* sink, const char* d, size_t n) { static_cast<std::vector<char>*>(sink)->assign(d, d + n); };
    if (s_.get(s_.ctx, key.c_str(), &out, put, err, sizeof err) != 0) throw std::runtime_error(err);
    return out;
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const Ms& timeout) override {
    std::vector<const char*> k;
    for (const auto& s : keys) k.push_back(s.c_str());
    char err[1024] = "";
    if (s_.wait(s_.ctx, k.data(), k.size(), timeout.count(), err, sizeof err) != 0) throw std::runtime_error(err);
  }

 private:
  PrimusGlooStore s_;
  Ms timeout_;
};

struct Handle {
  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<gloo::rendezvous::Context> ctx;
};

// Runs f, turning any exception into (non-zero, err).
template <class F>
int guarded(char* err, size_t errlen, F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    put_error(err, errlen, e.what());
  } catch (...) {
    put_error(err, errlen, "unknown exception");
  }
  return 1;
}

void* plugin_connect(const PrimusGlooStore* store, void* share, const char* host, int rank, int size,
                     int64_t timeout_ms, char* err, size_t errlen) {
  auto h = std::make_unique<Handle>();
  int rc = guarded(err, errlen, [&] {
    if (share) {
      h->device = static_cast<Handle*>(share)->device;
    } else {
      gloo::transport::tcp::attr attr;
      attr.hostname = host;
      h->device = gloo::transport::tcp::CreateDevice(attr);
    }
    h->ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
    h->ctx->setTimeout(Ms(timeout_ms));
    CallbackStore cs(*store, Ms(timeout_ms));
    h->ctx->connectFullMesh(cs, h->device);
  });
  return rc == 0 ? h.release() : nullptr;
}

void plugin_close(void* p) {
  auto* h = static_cast<Handle*>(p);
  if (!h) return;
  try {
    if (h->ctx) h->ctx->closeConnections();
  } catch (...) {
    // Closing a broken mesh may throw; the handle is freed either way.
  }
  delete h;
}

int plugin_all_reduce_sum_f32(void* p, float* buf, size_t count, char* err, size_t errlen) {
  return guarded(err, errlen, [&] {
    auto* h = static_cast<Handle*>(p);
    gloo::AllreduceOptions o(h->ctx);
    o.setOutput(buf, count);
    o.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
    gloo::allreduce(o);
  });
}

int plugin_all_gather(void* p, const void* send, void* recv, size_t bytes, char* err, size_t errlen) {
  return guarded(err, errlen, [&] {
    auto* h = static_cast<Handle*>(p);
    gloo::AllgatherOptions o(h->ctx);
    char* out = static_cast<char*>(recv);
    // Without an input gloo gathers in place from out[rank]; a separate input is copied there.
    if (send != out + h->ctx->rank * bytes) o.setInput(const_cast<char*>(static_cast<const char*>(send)), bytes);
    o.setOutput(out, bytes * h->ctx->size);
    gloo::allgather(o);
  });
}

int plugin_all_to_all_v(void* p, const void* send, const int64_t* send_bytes, void* recv, const int64_t* recv_bytes,
                        char* err, size_t errlen) {
  return guarded(err, errlen, [&] {
    auto* h = static_cast<Handle*>(p);
    const int n = h->ctx->size;
    std::vector<int64_t> in(send_bytes, send_bytes + n), out(recv_bytes, recv_bytes + n);
    gloo::AlltoallvOptions o(h->ctx);
    o.setInput(const_cast<char*>(static_cast<const char*>(send)), in);
    o.setOutput(static_cast<char*>(recv), out);
    gloo::alltoallv(o);
  });
}

int plugin_broadcast(void* p, void* buf, size_t bytes, int root, char* err, size_t errlen) {
  return guarded(err, errlen, [&] {
    auto* h = static_cast<Handle*>(p);
    gloo::BroadcastOptions o(h->ctx);
    o.setOutput(static_cast<char*>(buf), bytes);
    o.setRoot(root);
    gloo::broadcast(o);
  });
}

int plugin_barrier(void* p, char* err, size_t errlen) {
  return guarded(err, errlen, [&] {
    gloo::BarrierOptions o(static_cast<Handle*>(p)->ctx);
    gloo::barrier(o);
  });
}

int plugin_send(void* p, const void* buf, size_t bytes, int peer, uint32_t tag, char* err, size_t errlen) {
  return guarded(err, errlen, [&] {
    auto* h = static_cast<Handle*>(p);
    auto ub = h->ctx->createUnboundBuffer(const_cast<void*>(buf), bytes);
    ub->send(peer, tag);
    if (!ub->waitSend(h->ctx->getTimeout())) throw std::runtime_error("the send was aborted");
  });
}

int plugin_recv(void* p, void* buf, size_t bytes, int peer, uint32_t tag, char* err, size_t errlen) {
  return guarded(err, errlen, [&] {
    auto* h = static_cast<Handle*>(p);
    auto ub = h->ctx->createUnboundBuffer(buf, bytes);
    ub->recv(peer, tag);
    if (!ub->waitRecv(h->ctx->getTimeout())) throw std::runtime_error("the receive was aborted");
  });
}

#define PRIMUS_GLOO_STR2(x) #x
#define PRIMUS_GLOO_STR(x) PRIMUS_GLOO_STR2(x)

const PrimusGlooApi kApi = {
    PRIMUS_GLOO_ABI_VERSION,
    PRIMUS_GLOO_STR(GLOO_VERSION_MAJOR) "." PRIMUS_GLOO_STR(GLOO_VERSION_MINOR) "." PRIMUS_GLOO_STR(GLOO_VERSION_PATCH),
    plugin_connect,
    plugin_close,
    plugin_all_reduce_sum_f32,
    plugin_all_gather,
    plugin_all_to_all_v,
    plugin_broadcast,
    plugin_barrier,
    plugin_send,
    plugin_recv,
};

}  // namespace

extern "C" __attribute__((visibility("default"))) const PrimusGlooApi* primus_gloo_api(void) { return &kApi; }
