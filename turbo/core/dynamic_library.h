// Loading a vendor library (cuBLASLt, cuDNN) with dlopen at its first use instead of linking it,
// so that a CUDA build of primus starts, and runs its CPU paths, on a machine that lacks it.
//
// Search order for one library (LibrarySpec):
//   1. the environment variable spec.env_var (a file path); when set, it is the only place tried:
//      a library the user named explicitly that fails to load is an error, not a silent fallback;
//   2. the plain soname through the dynamic loader (LD_LIBRARY_PATH, the ld.so cache, RUNPATH);
//   3. each of spec.fixed_dirs (e.g. /usr/local/cuda/lib64);
//   4. each Python site-packages folder joined with each of spec.wheel_subdirs (PyTorch's pip
//      packages: nvidia/cublas/lib, nvidia/cudnn/lib); the folders are asked of python3 only when
//      the earlier places failed, since starting Python costs tens of milliseconds.
// A candidate counts only when it loads and exports spec.probe_symbol (a file of the right name
// that is something else is reported as such). When nothing loads, the error names the library
// and every place tried with the loader's reason for each.
//
// Thread-safe; a LazyLibrary tries once per process and remembers the outcome. Handles are never
// closed (the vendor libraries keep threads and atexit handlers). An ApiTable binds a struct of
// the library's entry points, typed from the vendor header:
//   #define MY_FUNCTIONS(X) X(fooCreate) X(fooRun)
//   struct FooApi { MY_FUNCTIONS(PRIMUS_DL_MEMBER) };
//   void bind(LazyLibrary& lib, FooApi& api) { MY_FUNCTIONS(PRIMUS_DL_BIND) }
#pragma once
#include <atomic>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace primus::turbo {

struct LibrarySpec {
  std::string display;                     // "cuBLASLt", for messages
  std::string soname;                      // "libcublasLt.so.13"
  std::string env_var;                     // "PRIMUS_CUBLASLT_LIBRARY"
  std::string probe_symbol;                // a function every good copy exports
  std::vector<std::string> fixed_dirs;     // tried after the loader's own search
  std::vector<std::string> wheel_subdirs;  // under each Python site-packages folder
};

// Where a library was found, or why it was not.
struct LoadOutcome {
  void* handle = nullptr;              // nullptr when nothing loaded
  std::string path;                    // the candidate that loaded
  std::vector<std::string> attempts;   // "candidate: reason" for every candidate that failed
  std::string error;                   // empty when loaded; else the full message
};

// Python's site-packages folders (site.getsitepackages() and the user site), from `python3`
// on PATH (or $PRIMUS_PYTHON); empty when there is no Python. Never throws.
std::vector<std::string> python_site_dirs();

// Tries the candidates of `spec` in the order above. `site_dirs` is called only when steps 1-3
// found nothing and spec.wheel_subdirs is not empty (tests pass their own folders). Never throws.
LoadOutcome load_library(const LibrarySpec& spec,
                         const std::function<std::vector<std::string>()>& site_dirs = python_site_dirs);

// A library loaded at first use, once per process.
class LazyLibrary {
 public:
  explicit LazyLibrary(LibrarySpec spec) : spec_(std::move(spec)) {}
  // True when the library loaded (tries on the first call).
  bool available();
  // Empty when available, else the message naming the library and every place tried.
  std::string error();
  // Where it was loaded from ("" when it was not).
  std::string path();
  // The address of `name`. Throws primus::RuntimeError with error() when the library is missing,
  // or naming the symbol and the file when that copy lacks it.
  void* symbol(const char* name);
  const LibrarySpec& spec() const { return spec_; }

 private:
  void load();
  LibrarySpec spec_;
  std::once_flag once_;
  LoadOutcome outcome_;
};

// "13" from a header's version macro (CUBLAS_VER_MAJOR): sonames carry the major version.
#define PRIMUS_DL_STR(x) PRIMUS_DL_STR_(x)
#define PRIMUS_DL_STR_(x) #x

// A member of an entry-point struct with the exact type of the header's declaration of `f`.
#define PRIMUS_DL_MEMBER(f) decltype(&::f) f = nullptr;
// Inside a binder with parameters (LazyLibrary& lib, Api& api): resolves `f` or throws.
#define PRIMUS_DL_BIND(f) api.f = reinterpret_cast<decltype(api.f)>(lib.symbol(#f));

// The entry points of one library, bound at the first get().
template <class Api>
class ApiTable {
 public:
  using Binder = void (*)(LazyLibrary& lib, Api& api);
  ApiTable(LibrarySpec spec, Binder bind) : lib_(std::move(spec)), bind_(bind) {}
  // Throws primus::RuntimeError naming the library and every place tried, or the missing
  // symbol. A failed bind is retried (and fails the same way) at the next call.
  const Api& get() {
    // Called per vendor call: after the first bind only an atomic load. A mutex, not
    // std::call_once, for the first: libstdc++'s call_once does not survive a throwing callable.
    if (bound_.load(std::memory_order_acquire)) return api_;
    std::lock_guard lock(mu_);
    if (!bound_.load(std::memory_order_relaxed)) {
      Api api{};
      bind_(lib_, api);
      api_ = api;
      bound_.store(true, std::memory_order_release);
    }
    return api_;
  }
  // Empty when the library loads and has every entry point, else what get() would throw.
  // Never throws: a dispatcher's can_handle asks it.
  std::string unavailable_reason() noexcept {
    try {
      if (!lib_.available()) return lib_.error();
      (void)get();
      return "";
    } catch (const std::exception& e) {
      return e.what();
    } catch (...) {
      return lib_.spec().display + " could not be loaded";
    }
  }
  std::string path() { return lib_.path(); }  // "" when not loaded

 private:
  LazyLibrary lib_;
  Binder bind_;
  std::mutex mu_;
  std::atomic<bool> bound_{false};
  Api api_{};
};

}  // namespace primus::turbo
