// The reference backend's memory projection (backends/reference/projection.cpp) against what its
// model allocates: every heap byte GptModel<float>'s constructor takes is counted (operator new
// is replaced in this test binary, counting only while a test asks), and the projected weights,
// gradients and activations must match it within the bookkeeping (names of the parameter layout,
// per-layer structs). ZeRO-1 shrinks the optimizer state to the rank's shard.
#include <gtest/gtest.h>

#include <tuple>

#include <atomic>
#include <cstdlib>
#include <new>

#include "backends/reference/model.h"
#include "backends/reference/projection.h"

namespace {
std::atomic<bool> g_projection_counting{false};
std::atomic<size_t> g_projection_bytes{0};
}  // namespace

// Counting allocations of this binary; everything is forwarded to malloc / aligned_alloc.
void* operator new(size_t n) {
  if (g_projection_counting.load(std::memory_order_relaxed)) g_projection_bytes += n;
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t n) { return ::operator new(n); }
void* operator new(size_t n, std::align_val_t a) {
  if (g_projection_counting.load(std::memory_order_relaxed)) g_projection_bytes += n;
  const size_t al = static_cast<size_t>(a);
  if (void* p = std::aligned_alloc(al, (n + al - 1) / al * al)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t n, std::align_val_t a) { return ::operator new(n, a); }
// The nothrow forms too (std::stable_sort's temporary buffer takes one): left to the runtime, their
// memory would come back through the free() above, which AddressSanitizer reports as a mismatch.
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  try {
    return ::operator new(n);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](size_t n, const std::nothrow_t&) noexcept { return ::operator new(n, std::nothrow); }
void* operator new(size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  try {
    return ::operator new(n, a);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return ::operator new(n, a, std::nothrow);
}
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t, std::align_val_t) noexcept { std::free(p); }

namespace primus::backends::reference {
namespace {

train::ModelSpec reference_projection_spec(bool llama, bool moe) {
  train::ModelSpec m;
  m.model_type = llama ? "llama" : "gpt2";
  m.vocab_size = m.padded_vocab_size = 512;
  m.seq_length = 64;
  m.num_layers = 3;
  m.hidden_size = 128;
  m.num_attention_heads = 4;
  m.num_query_groups = llama ? 2 : 4;
  m.ffn_hidden_size = llama ? 256 : 512;
  m.layernorm = !llama, m.swiglu = llama, m.rope = llama, m.untied = llama, m.bias = !llama;
  if (moe) {
    m.model_type = "deepseek_v3";
    m.moe.num_experts = 8, m.moe.topk = 2, m.moe.ffn_hidden_size = 96, m.moe.shared_ffn_hidden_size = 64;
    m.moe.moe_layers = {false, true, true};
  }
  return m;
}

size_t allocated_by_model(const train::ModelSpec& spec, int64_t B) {
  g_projection_bytes = 0;
  g_projection_counting = true;
  size_t bytes = 0;
  {
    GptModel<float> model(spec, B, spec.seq_length);
    bytes = g_projection_bytes;
    g_projection_counting = false;
  }
  return bytes;
}

TEST(ReferenceProjection, ModelBuffersMatchWhatTheModelAllocates) {
  for (auto [llama, moe, qwen] : {std::tuple{false, false, false}, std::tuple{true, false, false},
                                  std::tuple{true, true, false}, std::tuple{true, false, true}}) {
    train::ModelSpec spec = reference_projection_spec(llama, moe);
    if (qwen) {  // q 4 x 48 = 192 wide over a width of 128, with the per-head q/k norms' buffers
      spec.model_type = "qwen3";
      spec.kv_channels = 48;
      spec.qk_layernorm = true;
    }
    SCOPED_TRACE(spec.model_type);
    ReferenceArgs a;
    a.model = spec;
    train::ProjectionLayout lay;
    lay.micro_batch = 4;
    lay.seq_length = spec.seq_length;
    const train::MemoryProjection m = project_reference_memory(a, lay);
    const double model_part = m.bytes("master_weights") + m.bytes("gradients") + m.bytes("activations");
    const double actual = double(allocated_by_model(spec, lay.micro_batch));
    ASSERT_GT(actual, 1e6);
    // What the projection leaves out is bookkeeping: tensor names, per-layer structs, MoE layer objects.
    EXPECT_LE(model_part, actual);
    EXPECT_NEAR(model_part, actual, 0.01 * actual);
    double sum = 0;
    for (const train::MemoryPart& p : m.parts) sum += p.bytes;
    EXPECT_DOUBLE_EQ(sum, m.total());
  }
}

TEST(ReferenceProjection, Zero1KeepsTheRanksShardOfTheMoments) {
  ReferenceArgs a;
  a.model = reference_projection_spec(false, false);
  train::ProjectionLayout lay;
  lay.micro_batch = 4;
  lay.seq_length = a.model.seq_length;
  const double one = project_reference_memory(a, lay).bytes("optimizer_state");
  lay.gpus = 4;
  lay.zero1 = true;
  const train::MemoryProjection four = project_reference_memory(a, lay);
  EXPECT_NEAR(four.bytes("optimizer_state"), one / 4, 2 * 4 * 4.0);  // rounded up to whole elements per rank
  EXPECT_GT(four.bytes("comm"), 0.0);  // the gradient shard and the staging of one bucket from every rank
}

}  // namespace
}  // namespace primus::backends::reference
