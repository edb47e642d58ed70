// The reference backend's memory model for `primus projection` (train/projection.h): an
// analytical count of its fp32 host buffers per process.
#pragma once
#include "backends/reference/args.h"
#include "train/projection.h"

namespace primus::backends::reference {

train::MemoryProjection project_reference_memory(const ReferenceArgs& args, const train::ProjectionLayout& layout);

// Registers the reference backend's train::BackendProjector.
void register_reference_projection();

}  // namespace primus::backends::reference
