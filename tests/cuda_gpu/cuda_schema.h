// The cuda backend's config as an experiment's overrides give it, for tests of the keys the
// adapter reads (no device needed).
#pragma once
#include <string>

#include "backends/cuda/register.h"
#include "core/backend/backend.h"
#include "core/config/yaml_loader.h"
#include "core/patches/registry.h"

namespace primus::backends::cuda::testing {

// `yaml` (file name exp.yaml in the origins) checked against the cuda schema, its defaults added.
inline config::Value cuda_config(const std::string& yaml) {
  BackendRegistry backends;
  patches::PatchRegistry reg;
  register_backend(backends, reg);
  auto adapter = backends.create("cuda");
  config::Value v = config::parse_yaml_text(yaml, "exp.yaml");
  adapter->schema().validate(v);
  adapter->schema().apply_defaults(v);
  return v;
}

}  // namespace primus::backends::cuda::testing
