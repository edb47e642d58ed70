// reference.runtime.num_threads: pins OpenMP and OpenBLAS to `num_threads` cores.
#include <cblas.h>
#include <omp.h>

#include "backends/reference/register.h"
#include "core/patches/context.h"
#include "train/common_patches.h"

namespace primus::backends::reference {

void register_patches(patches::PatchRegistry& reg) {
  patches::Patch p;
  p.id = "reference.runtime.num_threads";
  p.backend = kName;
  p.phase = patches::Phase::Setup;
  p.description = "runs the CPU kernels on `num_threads` threads (OpenMP and OpenBLAS)";
  p.logic = "sets env OMP_NUM_THREADS and OPENBLAS_NUM_THREADS; calls omp_set_num_threads / openblas_set_num_threads";
  p.tags = {"runtime", "cpu"};
  p.condition = [](patches::PatchContext& c) { return c.integer("num_threads") > 0; };
  p.apply = [](patches::PatchContext& c) {
    int n = static_cast<int>(c.integer("num_threads"));
    c.set_env("OMP_NUM_THREADS", std::to_string(n));
    c.set_env("OPENBLAS_NUM_THREADS", std::to_string(n));
    omp_set_num_threads(n);
    openblas_set_num_threads(n);
  };
  reg.add(p);
  train::register_common_args_patches(reg, kName);
}

}  // namespace primus::backends::reference
