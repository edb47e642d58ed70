// Python's package folders, for finding the vendor libraries that PyTorch's pip wheels carry
// (nvidia/cublas/lib, nvidia/cudnn/lib, nvidia/nccl/lib) on machines that have no system copy.
#pragma once
#include <string>
#include <vector>

namespace primus {

// site.getsitepackages() and the user site of `python3` on PATH (or $PRIMUS_PYTHON), one folder
// per entry; empty when there is no Python or it fails. Starts a process (tens of ms): call it
// only after the cheaper places were tried. Never throws.
std::vector<std::string> python_site_dirs();

}  // namespace primus
