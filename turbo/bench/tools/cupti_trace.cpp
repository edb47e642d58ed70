// A GPU timeline for machines without Nsight Systems: an LD_PRELOAD library that records every kernel,
// memset and memcpy the process runs (CUPTI activity API: device start / end timestamps, graph node,
// stream, grid) and writes them as CSV at exit to $PRIMUS_CUPTI_TRACE (default cupti_trace.csv).
// Kernels launched from CUDA graphs are recorded one by one, so the gaps between a replayed step's
// kernels can be read off (bench/tools/cupti_gaps.py). A measuring tool, not part of the product:
// CMake does not build it. Build (bench/tools/build_cupti_trace.sh):
//   g++ -O2 -shared -fPIC -I/usr/local/cuda/include turbo/bench/tools/cupti_trace.cpp -o libcupti_trace.so
//       -L/usr/local/cuda/lib64 -lcupti
#include <cupti.h>
#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Record {
  char kind;  // K kernel, S memset, C memcpy
  uint64_t start, end, node, bytes;
  uint32_t stream, graph;
  int grid, block, smem;
  std::string name;
};

std::mutex g_mu;
std::vector<Record> g_records;
constexpr size_t kBufferBytes = size_t{8} << 20;

std::string demangle(const char* name) {
  if (!name) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string s = status == 0 && d ? d : name;
  std::free(d);
  for (char& c : s)
    if (c == ',' || c == '"') c = ';';
  return s.size() > 200 ? s.substr(0, 200) : s;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::vector<Record> got;
  CUpti_Activity* r = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
    Record x{};
    if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || r->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(r);
      x = {'K', k->start, k->end, k->graphNodeId, 0, k->streamId, k->graphId,
           k->gridX * k->gridY * k->gridZ, k->blockX * k->blockY * k->blockZ,
           k->staticSharedMemory + k->dynamicSharedMemory, demangle(k->name)};
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(r);
      x = {'S', m->start, m->end, m->graphNodeId, m->bytes, m->streamId, m->graphId, 0, 0, 0, "memset"};
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(r);
      x = {'C', m->start, m->end, m->graphNodeId, m->bytes, m->streamId, m->graphId, 0, 0, 0,
           "memcpy_kind" + std::to_string(m->copyKind)};
    } else {
      continue;
    }
    got.push_back(std::move(x));
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mu);
  for (auto& x : got) g_records.push_back(std::move(x));
}

void write_out() {
  cuptiActivityFlushAll(1);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_records.empty()) return;  // a process without GPU work (a wrapper such as timeout): no file
  }
  const char* path = std::getenv("PRIMUS_CUPTI_TRACE");
  FILE* f = std::fopen(path && *path ? path : "cupti_trace.csv", "w");
  if (!f) return;
  std::lock_guard<std::mutex> lock(g_mu);
  std::fprintf(f, "kind,start_ns,end_ns,graph,node,stream,grid,block,smem,bytes,name\n");
  for (const auto& x : g_records)
    std::fprintf(f, "%c,%llu,%llu,%u,%llu,%u,%d,%d,%d,%llu,%s\n", x.kind, (unsigned long long)x.start,
                 (unsigned long long)x.end, x.graph, (unsigned long long)x.node, x.stream, x.grid, x.block, x.smem,
                 (unsigned long long)x.bytes, x.name.c_str());
  std::fclose(f);
  std::fprintf(stderr, "[cupti_trace] %zu records written to %s\n", g_records.size(), path && *path ? path : "cupti_trace.csv");
}

__attribute__((constructor)) void start() {
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) {
    std::fprintf(stderr, "[cupti_trace] cannot register CUPTI callbacks: no trace\n");
    return;
  }
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  cuptiActivityFlushPeriod(500);  // ms: records reach the host while the process runs
  std::atexit(write_out);
}

}  // namespace
