// What every Turbo op call runs with besides its tensors: the CUDA stream to enqueue on and an
// arena for scratch space. Scratch is taken with an ArenaScope inside the op and given back
// before it returns (the kernels are enqueued in stream order, so the next op on the same
// stream may reuse the bytes safely).
#pragma once
#include "turbo/core/arena.h"

namespace primus::turbo {

struct ExecContext {
  void* stream = nullptr;   // cudaStream_t (nullptr: the default stream); unused on the host
  Arena* scratch = nullptr; // device arena for ops that need scratch (norm / embedding backward,
                            // grad norm, linear bias grads); nullptr where none is needed
};

// True when Turbo was built with its CUDA backends (TURBO, CUBLASLT).
bool turbo_has_cuda();

}  // namespace primus::turbo
