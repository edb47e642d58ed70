// reference.runtime.num_threads: pins OpenMP and OpenBLAS to `num_threads` cores.
#include <cblas.h>
#include <omp.h>

#include "backends/reference/register.h"
#include "core/patches/context.h"
#include "core/patches/registry.h"
#include "train/common_patches.h"

namespace primus::backends::reference {

void register_patches(patches::PatchRegistry& reg) {
  using patches::PatchContext;
  reg.add({
      .id = "reference.runtime.num_threads",
      .description = "runs the CPU kernels on `num_threads` threads (OpenMP and OpenBLAS)",
      .phase = patches::Phase::Setup,
      .tags = {"runtime", "cpu"},
      .logic = "sets env OMP_NUM_THREADS and OPENBLAS_NUM_THREADS; calls omp_set_num_threads / openblas_set_num_threads",
      .condition = [](PatchContext& c) { return c.integer("num_threads") > 0; },
      .apply =
          [](PatchContext& c) {
            int n = static_cast<int>(c.integer("num_threads"));
            c.set_env("OMP_NUM_THREADS", std::to_string(n));
            c.set_env("OPENBLAS_NUM_THREADS", std::to_string(n));
            omp_set_num_threads(n);
            openblas_set_num_threads(n);
          },
  });
  train::register_common_args_patches(reg, kName);
}

}  // namespace primus::backends::reference
