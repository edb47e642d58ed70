/* The C interface between primus and its Gloo plugin (libprimus_gloo.so, parallel/gloo/).
 *
 * Why a plugin and a C interface: Debian ships Gloo only as a shared library (libgloo.so.0, which
 * pulls in libibverbs, libhiredis and libnl). Linking it into primus would make the binary that
 * is carried to the GPU machines (which have none of these) fail to start. So the Gloo calls live
 * in a module that primus opens with dlopen when a CPU job of more than one rank needs it, and
 * only plain C crosses between the two: primus links libstdc++ statically and the plugin uses the
 * system's, so neither C++ objects nor exceptions may pass the boundary.
 *
 * Conventions: functions return 0 on success; on failure they write a NUL-terminated message of
 * at most errlen bytes into err and return non-zero. Sizes are bytes unless named otherwise. */
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PRIMUS_GLOO_ABI_VERSION 1

/* The rendezvous store, implemented by primus over its TcpStore. Keys arrive with primus's
 * prefix already applied. get() waits for the key (up to the store's timeout) and hands its
 * bytes to put(sink, ...) once. */
typedef struct PrimusGlooStore {
  void* ctx;
  int (*set)(void* ctx, const char* key, const char* data, size_t n, char* err, size_t errlen);
  int (*get)(void* ctx, const char* key, void* sink, void (*put)(void* sink, const char* data, size_t n), char* err,
             size_t errlen);
  int (*wait)(void* ctx, const char* const* keys, size_t nkeys, int64_t timeout_ms, char* err, size_t errlen);
} PrimusGlooStore;

typedef struct PrimusGlooApi {
  int abi_version;
  const char* gloo_version; /* "0.5.0" */
  /* Creates a full mesh of TCP pairs between `size` ranks through `store`, listening on `host`.
   * share_device_of: a handle whose TCP device (listening socket and event loop) the new context
   * reuses, or NULL for a new device. Returns a handle or NULL (err says why). */
  void* (*connect)(const PrimusGlooStore* store, void* share_device_of, const char* host, int rank, int size,
                   int64_t timeout_ms, char* err, size_t errlen);
  /* Closes the connections (peers blocked on this rank then fail) and frees the handle. */
  void (*close)(void* h);
  int (*all_reduce_sum_f32)(void* h, float* buf, size_t count, char* err, size_t errlen);
  /* send: `bytes`; recv: bytes x size in rank order. send == recv + rank * bytes is in place. */
  int (*all_gather)(void* h, const void* send, void* recv, size_t bytes, char* err, size_t errlen);
  /* send_bytes[r] bytes go to rank r (send is their concatenation in rank order); recv_bytes[r]
   * bytes come from rank r. Equal sizes everywhere are an ordinary all-to-all. */
  int (*all_to_all_v)(void* h, const void* send, const int64_t* send_bytes, void* recv, const int64_t* recv_bytes,
                      char* err, size_t errlen);
  int (*broadcast)(void* h, void* buf, size_t bytes, int root, char* err, size_t errlen);
  int (*barrier)(void* h, char* err, size_t errlen);
  int (*send)(void* h, const void* buf, size_t bytes, int peer, uint32_t tag, char* err, size_t errlen);
  int (*recv)(void* h, void* buf, size_t bytes, int peer, uint32_t tag, char* err, size_t errlen);
} PrimusGlooApi;

/* The one symbol primus looks up. */
const PrimusGlooApi* primus_gloo_api(void);

#ifdef __cplusplus
}
#endif
