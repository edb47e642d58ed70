#include "backends/cuda/param_init.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace primus::backends::cuda {

void init_params(const train::ModelSpec& spec, const train::ParamLayout& layout, uint64_t seed, float* params) {
  std::mt19937_64 rng(seed);
  const double resid_scale = 1.0 / std::sqrt(2.0 * static_cast<double>(spec.num_layers));
  auto ends_with = [](const std::string& s, const char* suffix) {
    const size_t n = std::char_traits<char>::length(suffix);
    return s.size() > n && s.compare(s.size() - n, n, suffix) == 0;
  };
  for (const auto& t : layout.tensors) {
    float* p = params + t.offset;
    if (ends_with(t.name, ".bias")) {
      std::fill(p, p + t.numel, 0.0f);
    } else if (t.name.find("norm") != std::string::npos) {
      std::fill(p, p + t.numel, 1.0f);
    } else {
      const bool resid = t.name.find("attn.proj.weight") != std::string::npos ||
                         t.name.find("mlp.proj.weight") != std::string::npos;
      std::normal_distribution<double> dist(0.0, spec.init_method_std * (resid ? resid_scale : 1.0));
      for (int64_t i = 0; i < t.numel; ++i) p[i] = static_cast<float>(dist(rng));
    }
  }
  // Padded vocabulary rows never receive gradient from real tokens; zero keeps them inert.
  for (const char* name : {"embedding.weight", "output_layer.weight"}) {
    if (const train::ParamTensor* t = layout.find(name)) {
      float* p = params + t->offset;
      std::fill(p + spec.vocab_size * spec.hidden_size, p + t->numel, 0.0f);
    }
  }
}

}  // namespace primus::backends::cuda
