#include "train/param_init.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

namespace primus::train {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::char_traits<char>::length(suffix);
  return s.size() > n && s.compare(s.size() - n, n, suffix) == 0;
}

template <class Real>
void init_impl(const ModelSpec& spec, const ParamLayout& layout, uint64_t seed, Real* params) {
  const double resid_scale = 1.0 / std::sqrt(2.0 * static_cast<double>(spec.num_layers));
  struct Block {
    size_t tensor;
    int64_t begin, end;
    double std;
  };
  std::vector<Block> blocks;
  for (size_t ti = 0; ti < layout.tensors.size(); ++ti) {
    const ParamTensor& t = layout.tensors[ti];
    Real* p = params + t.offset;
    if (ends_with(t.name, ".bias") || !t.trainable) {  // biases and buffers (the expert bias) start at 0
      std::fill(p, p + t.numel, Real(0));
    } else if (t.name.find("norm") != std::string::npos) {
      std::fill(p, p + t.numel, Real(1));
    } else {
      const bool resid = t.name.find("attn.proj.weight") != std::string::npos ||
                         t.name.find("mlp.proj.weight") != std::string::npos ||
                         t.name.find("moe.experts.proj.weight") != std::string::npos ||
                         t.name.find("moe.shared.proj.weight") != std::string::npos;
      const double sd = spec.init_method_std * (resid ? resid_scale : 1.0);
      for (int64_t b = 0; b < t.numel; b += kInitBlock) blocks.push_back({ti, b, std::min(t.numel, b + kInitBlock), sd});
    }
  }
  const int64_t nb = static_cast<int64_t>(blocks.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < nb; ++i) {
    const Block& bl = blocks[static_cast<size_t>(i)];
    const uint64_t block_index = static_cast<uint64_t>(bl.begin / kInitBlock);
    std::mt19937_64 rng(splitmix64(seed ^ splitmix64((uint64_t(bl.tensor) << 32) ^ block_index)));
    std::normal_distribution<double> dist(0.0, bl.std);
    Real* p = params + layout.tensors[bl.tensor].offset;
    for (int64_t j = bl.begin; j < bl.end; ++j) p[j] = static_cast<Real>(dist(rng));
  }
  // Padded vocabulary rows never receive gradient from real tokens; zero keeps them inert.
  for (const char* name : {"embedding.weight", "output_layer.weight"}) {
    if (const ParamTensor* t = layout.find(name)) {
      Real* p = params + t->offset;
      std::fill(p + spec.vocab_size * spec.hidden_size, p + t->numel, Real(0));
    }
  }
}

}  // namespace

void init_params(const ModelSpec& spec, const ParamLayout& layout, uint64_t seed, float* params) {
  init_impl(spec, layout, seed, params);
}
void init_params(const ModelSpec& spec, const ParamLayout& layout, uint64_t seed, double* params) {
  init_impl(spec, layout, seed, params);
}

}  // namespace primus::train
