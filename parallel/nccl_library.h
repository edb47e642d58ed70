// NCCL, loaded at run time with dlopen. Nothing links libnccl: a CPU-only run of the CUDA build
// never needs it, and a machine without NCCL's -dev files (only PyTorch's pip wheel
// `nvidia-nccl-cu13`, with nvidia/nccl/lib/libnccl.so.2 under site-packages) can still use it.
//
// The declarations below are the subset of nccl.h's ABI this project calls (stable since NCCL
// 2.14, the first release with non-blocking communicators); nccl.h itself is not needed to build.
//
// Where the library is looked for, in order (the first that loads and has every function wins):
//   1. PRIMUS_NCCL_LIBRARY: a file, or a folder holding libnccl.so.2. When set, it is the only
//      place tried: a wrong explicit choice is an error, never a silent fallback.
//   2. the loader's normal path (LD_LIBRARY_PATH, ld.so.cache): libnccl.so.2, libnccl.so;
//   3. /usr/local/cuda/lib64 and /usr/local/cuda/lib;
//   4. nvidia/nccl/lib/ under every site-/dist-packages folder of `python3` (asked with
//      `python3 -c`, PRIMUS_PYTHON overriding the interpreter) and of /usr/lib/python3*/ and
//      /usr/local/lib/python3*/.
// Failure is a RuntimeError listing every place tried and why each failed.
#pragma once
#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace primus::parallel::nccl {

// ---- the ABI subset (values as in nccl.h) ----
struct Comm;  // opaque ncclComm
using comm_t = Comm*;
struct UniqueId {
  char internal[128];
};
enum Result : int {
  Success = 0,
  UnhandledCudaError = 1,
  SystemError = 2,
  InternalError = 3,
  InvalidArgument = 4,
  InvalidUsage = 5,
  RemoteError = 6,
  InProgress = 7,
};
enum DataType : int { Float32 = 7, Bfloat16 = 9 };
enum RedOp : int { Sum = 0, Max = 2, Avg = 4 };
// ncclConfig_t as of NCCL 2.14. NCCL copies min(size, its own size) bytes and treats fields
// newer than `version` as unset, so this prefix is valid for every later release.
struct Config {
  size_t size = sizeof(Config);
  unsigned int magic = 0xcafebeef;
  unsigned int version = 21400;  // NCCL_VERSION(2, 14, 0)
  int blocking = -2147483647 - 1;  // NCCL_CONFIG_UNDEF_INT
  int cga_cluster_size = -2147483647 - 1;
  int min_ctas = -2147483647 - 1;
  int max_ctas = -2147483647 - 1;
  const char* net_name = nullptr;
};
using Stream = void*;  // cudaStream_t

// The functions this project uses, resolved from one loaded library.
struct Api {
  Result (*GetVersion)(int*) = nullptr;
  const char* (*GetErrorString)(Result) = nullptr;
  Result (*GetUniqueId)(UniqueId*) = nullptr;
  Result (*CommInitRank)(comm_t*, int nranks, UniqueId, int rank) = nullptr;
  Result (*CommInitRankConfig)(comm_t*, int nranks, UniqueId, int rank, Config*) = nullptr;
  Result (*CommGetAsyncError)(comm_t, Result*) = nullptr;
  Result (*CommAbort)(comm_t) = nullptr;
  Result (*CommDestroy)(comm_t) = nullptr;
  Result (*AllReduce)(const void*, void*, size_t, DataType, RedOp, comm_t, Stream) = nullptr;
  Result (*ReduceScatter)(const void*, void*, size_t recvcount, DataType, RedOp, comm_t, Stream) = nullptr;
  Result (*AllGather)(const void*, void*, size_t sendcount, DataType, comm_t, Stream) = nullptr;
  Result (*Broadcast)(const void*, void*, size_t, DataType, int root, comm_t, Stream) = nullptr;
  Result (*Send)(const void*, size_t, DataType, int peer, comm_t, Stream) = nullptr;
  Result (*Recv)(void*, size_t, DataType, int peer, comm_t, Stream) = nullptr;
  Result (*GroupStart)() = nullptr;
  Result (*GroupEnd)() = nullptr;
};

struct Library {
  Api api;
  std::string path;     // what was loaded: the file dlopen found (from the loader when known)
  std::string how;      // which search step found it, e.g. "PRIMUS_NCCL_LIBRARY" or "python3 site-packages"
  int version_code = 0;  // ncclGetVersion: 22809 for 2.28.9
  std::string version() const;  // "2.28.9"
};

// One place to try: a dlopen argument (a path, or a bare soname for the loader's own search)
// and which search step produced it.
struct Candidate {
  std::string file;
  std::string how;
};

// What the search reads from the machine; tests replace each part.
struct SearchInputs {
  std::function<std::optional<std::string>(const std::string&)> getenv;  // default: ::getenv
  // Site-/dist-packages folders reported by the python interpreter (default: runs python3).
  std::function<std::vector<std::string>()> python_site_dirs;
  // Expands a glob pattern to existing paths (default: glob(3)).
  std::function<std::vector<std::string>(const std::string&)> glob;
};
SearchInputs default_search_inputs();

// The places to try, in order, without touching any library. Duplicates are dropped.
std::vector<Candidate> search_candidates(const SearchInputs& in);

// Tries each candidate in order. `open` returns a handle or nullptr with the reason (dlopen and
// dlsym by default); a library missing a required function counts as a failure naming it.
// Throws RuntimeError listing every candidate and its reason when none works.
struct Opener {
  std::function<void*(const std::string& file, std::string* error)> open;
  std::function<void*(void* handle, const char* symbol)> symbol;
  std::function<std::string(void* handle, const std::string& file)> resolved_path;
  std::function<void(void* handle)> close;
};
Opener dlopen_opener();
Library load_library(const std::vector<Candidate>& candidates, const Opener& opener);

// The process-wide library: searched and loaded on first use, then shared. Throws on failure
// (every call retries, so a fixed environment works without restarting).
const Library& library();

// Sets NCCL_NVLS_ENABLE=0 unless the user set it: NVLink multicast (NVLS) must stay off on the
// GPU machines this project is run on (their notes require it). Call before the first
// communicator is created. Returns the value in effect.
std::string disable_nvls_unless_set();

// "ncclAllReduce failed: unhandled system error (code 2)" using the library's error strings.
std::string describe(const Library& lib, Result r);

}  // namespace primus::parallel::nccl
