// The threaded process group on device memory (parallel/cuda/threaded_device_ops.h): the checks
// of the host test (tests/parallel/threaded_pg_checks.h) with every rank's buffers on GPU 0 and
// each rank thread on a stream of its own, so the copies and the reduction kernel must give the
// host reference's bits. Label gpu: skipped without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "parallel/cuda/threaded_device_ops.h"
#include "tests/parallel/threaded_pg_checks.h"
#include "turbo/core/cuda_check.h"

namespace primus::parallel::threaded_test {
namespace {

// Plain cudaMalloc / cudaMemcpy: synchronous, so an upload is complete before the collective
// and the collective (which synchronizes its stream) is complete before a download.
class DeviceTestMemory final : public TestMemory {
 public:
  void* alloc(size_t bytes) override {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 1));
    return p;
  }
  void release(void* p) override { (void)cudaFree(p); }
  void put(void* dst, const Bytes& src) override {
    if (!src.empty()) CUDA_CHECK(cudaMemcpy(dst, src.data(), src.size(), cudaMemcpyHostToDevice));
  }
  Bytes get(const void* src, size_t bytes) override {
    Bytes b(bytes);
    if (bytes) CUDA_CHECK(cudaMemcpy(b.data(), src, bytes, cudaMemcpyDeviceToHost));
    return b;
  }
  ThreadedGroup::OpsFactory ops() override { return DeviceMemoryOps::factory(0); }
  void enter_rank_thread() override { CUDA_CHECK(cudaSetDevice(0)); }
};

class ThreadedDeviceGroup : public ::testing::Test {
 protected:
  void SetUp() override {
    if (turbo::cuda_device_count_or_zero() == 0) GTEST_SKIP() << "no CUDA device";
  }
  DeviceTestMemory mem;
};

TEST_F(ThreadedDeviceGroup, AllReduceSumAvgAndMaxF32AndBf16) { check_all_reduce(mem); }
TEST_F(ThreadedDeviceGroup, ReduceScatterInPlaceAndNot) { check_reduce_scatter(mem); }
TEST_F(ThreadedDeviceGroup, AllGatherInPlaceAndNot) { check_all_gather(mem); }
TEST_F(ThreadedDeviceGroup, BroadcastFromEveryRoot) { check_broadcast(mem); }
TEST_F(ThreadedDeviceGroup, AllToAllAndUnevenAllToAllV) { check_all_to_all(mem); }
TEST_F(ThreadedDeviceGroup, SendRecvRingAndTags) { check_send_recv(mem); }
TEST_F(ThreadedDeviceGroup, MeshSubGroupsRunConcurrently) { check_mesh_subgroups(mem, 50); }
TEST_F(ThreadedDeviceGroup, ThousandSmallAllReduces) {
  for (int world : kWorlds) check_many_small_all_reduces(mem, world, 1000);
}

// The kernel alone, on a large buffer with a ragged tail: the grid-stride loop covers every
// element, and bf16 sums of many ranks round once.
TEST_F(ThreadedDeviceGroup, ReductionKernelMatchesTheHostLoop) {
  for (DType d : kDtypes) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
      const size_t count = (size_t{1} << 21) + 77, k = 7, es = dtype_size(d);
      std::mt19937 rng(1234);
      auto in = random_inputs(rng, static_cast<int>(k), count, d);
      std::vector<std::unique_ptr<Buffer>> bufs;
      std::vector<const void*> dev_srcs, host_srcs;
      std::vector<Bytes> host(k);
      for (size_t j = 0; j < k; ++j) {
        host[j] = encode(in[j], d);
        bufs.push_back(std::make_unique<Buffer>(mem, count * es));
        bufs.back()->put(host[j]);
        dev_srcs.push_back(bufs.back()->data());
        host_srcs.push_back(host[j].data());
      }
      Buffer dst(mem, count * es);
      DeviceMemoryOps ops(0);
      ops.reduce(dst.data(), dev_srcs.data(), k, count, d, op);
      ops.synchronize();
      Bytes want(count * es);
      HostMemoryOps().reduce(want.data(), host_srcs.data(), k, count, d, op);
      expect_equal(decode(dst.get(), d), decode(want, d), std::string("kernel ") + dtype_name(d));
    }
  }
}

}  // namespace
}  // namespace primus::parallel::threaded_test
