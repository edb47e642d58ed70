#pragma once
#include "core/backend/backend.h"
#include "core/patches/registry.h"

namespace primus::cli {
// Registers every backend compiled into this binary (idempotent).
void register_builtin_backends();
}  // namespace primus::cli
