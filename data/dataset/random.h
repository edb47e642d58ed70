// Deterministic randomness for data order. std::shuffle and the std distributions are
// implementation-defined, so a data order built on them could change with the compiler; these
// are fixed algorithms (SplitMix64, Lemire's bounded integers, Fisher-Yates), so a seed names
// the same order on every machine and every build, which resuming a run relies on.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <vector>

namespace primus::data {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A seed derived from a base seed and a path of integers (e.g. {tag, epoch}).
inline uint64_t derive_seed(uint64_t seed, std::initializer_list<uint64_t> path) {
  uint64_t h = splitmix64(seed);
  for (uint64_t v : path) h = splitmix64(h ^ splitmix64(v + 0x632BE59BD9B4E019ull));
  return h;
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {  // the SplitMix64 stream
    uint64_t r = splitmix64(state_);
    state_ += 0x9E3779B97F4A7C15ull;
    return r;
  }
  // Uniform in [0, n), n > 0, without modulo bias (Lemire 2019).
  uint64_t below(uint64_t n) {
    unsigned __int128 m = static_cast<unsigned __int128>(next()) * n;
    auto low = static_cast<uint64_t>(m);
    if (low < n) {
      uint64_t threshold = -n % n;
      while (low < threshold) {
        m = static_cast<unsigned __int128>(next()) * n;
        low = static_cast<uint64_t>(m);
      }
    }
    return static_cast<uint64_t>(m >> 64);
  }

 private:
  uint64_t state_;
};

// A uniformly random permutation of [0, n) (Fisher-Yates).
template <class Index = uint32_t>
std::vector<Index> random_permutation(uint64_t n, uint64_t seed) {
  std::vector<Index> p(n);
  for (uint64_t i = 0; i < n; ++i) p[i] = static_cast<Index>(i);
  Rng rng(seed);
  for (uint64_t i = n; i > 1; --i) {
    uint64_t j = rng.below(i);
    std::swap(p[i - 1], p[j]);
  }
  return p;
}

}  // namespace primus::data
