// A thin C++ layer over cuDNN 9's backend descriptor API (cudnn_graph.h): owning descriptor
// handles, a builder that records tensors and operations of one operation graph, and the step
// from a graph to a finalized execution plan. The C++ cudnn_frontend is not used (not shipped
// here); this file only knows what the backend API documents: descriptor types, attributes and
// their value types.
//
// Ownership: every descriptor made here is destroyed by its Desc. A Plan keeps the descriptors
// its graph references alive for as long as it lives (the backend does not copy them).
// Errors: every backend call is checked; a failure throws primus::RuntimeError with the
// status name, cuDNN's last error message and the call that failed.
#pragma once
#include <cudnn_graph.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "turbo/kernels/cudnn/cudnn_api.h"  // dnn(): the entry points, loaded at first use

namespace primus::turbo::cudnn {

[[noreturn]] void throw_cudnn_error(cudnnStatus_t st, const char* expr, const char* file, int line);

#define PRIMUS_CUDNN_CHECK(expr)                                                         \
  do {                                                                                   \
    const cudnnStatus_t primus_cudnn_st_ = (expr);                                       \
    if (primus_cudnn_st_ != CUDNN_STATUS_SUCCESS)                                        \
      ::primus::turbo::cudnn::throw_cudnn_error(primus_cudnn_st_, #expr, __FILE__, __LINE__); \
  } while (0)

// One backend descriptor, destroyed with the object.
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type);
  ~Desc();
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }

  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
           const void* values);
  void set_desc(cudnnBackendAttributeName_t name, const Desc& other);
  void set_i64(cudnnBackendAttributeName_t name, int64_t v);
  void finalize();

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};
using DescPtr = std::shared_ptr<Desc>;

// What a tensor of the graph is. Dims and strides are the backend's 4-D (or more) element
// counts; `uid` is the id the variant pack binds memory to.
struct TensorSpec {
  std::vector<int64_t> dims, strides;
  cudnnDataType_t dtype = CUDNN_DATA_FLOAT;
  bool is_virtual = true;
  bool by_value = false;  // a host scalar passed at execution (dims all 1)
};

// Records the tensors and operations of one operation graph.
class GraphBuilder {
 public:
  // A tensor with a fresh uid; returns the uid.
  int64_t tensor(const TensorSpec& s);
  int64_t virtual_like(int64_t like, cudnnDataType_t dtype);  // same dims/strides, virtual
  int64_t scalar(cudnnDataType_t dtype = CUDNN_DATA_FLOAT);   // by-value [1,1,1,1]
  const TensorSpec& spec(int64_t uid) const { return specs_.at(static_cast<size_t>(uid - 1)); }

  // Operations, in graph order. Outputs must already exist as tensors.
  void matmul(int64_t a, int64_t b, int64_t c);
  // Pointwise y = op(x [, b [, t]]); `compute` is the math precision; axis only for GEN_INDEX.
  void pointwise(cudnnPointwiseMode_t mode, int64_t x, int64_t y, int64_t b = 0, int64_t t = 0,
                 cudnnDataType_t compute = CUDNN_DATA_FLOAT, int64_t axis = -1);
  void reduction(cudnnReduceTensorOp_t op, int64_t x, int64_t y);
  void reshape(int64_t x, int64_t y);

  // Finalizes everything and returns the operation graph, plus the descriptors it references.
  struct Graph {
    DescPtr graph;
    std::vector<DescPtr> keep;  // tensors, op descriptors
  };
  Graph build(cudnnHandle_t handle);

 private:
  const DescPtr& tdesc(int64_t uid);
  std::vector<TensorSpec> specs_;
  std::vector<DescPtr> tensors_;  // index uid-1, built lazily
  std::vector<DescPtr> ops_, aux_;
};

// A finalized execution plan and the workspace it needs.
struct Plan {
  DescPtr plan;
  int64_t workspace_bytes = 0;
  std::string engine;  // what was chosen, for logs ("engine 7 of 12 heuristics results")
  GraphBuilder::Graph graph;
};

// Asks the heuristics (mode A, then FALLBACK) for engine configurations and returns the first
// that finalizes. Throws RuntimeError listing what was tried when none does.
Plan make_plan(cudnnHandle_t handle, GraphBuilder::Graph graph);

// Up to `max_plans` finalized plans, best guess first: heuristics mode A's configurations in its
// order (FALLBACK's only when A has none), then, when `knob_variants`, the first configuration's
// engine with each of its knobs moved one step at a time through its documented range (the
// variants cuDNN finalizes; duplicates of a configuration already listed are skipped). Each
// Plan's `engine` names the engine's global index and its knob choices. Throws like make_plan
// when nothing finalizes.
std::vector<Plan> make_plans(cudnnHandle_t handle, const GraphBuilder::Graph& graph, size_t max_plans,
                             bool knob_variants);

// Runs `plan` with memory bound by uid (pointers of by-value scalars point at host values).
void execute(cudnnHandle_t handle, const Plan& plan, const std::vector<int64_t>& uids,
             const std::vector<void*>& ptrs, void* workspace);

// The cuDNN library version at run time (e.g. 91900), and the handle of the current device
// (created on first use, one per device, never destroyed: it lives as long as the process).
size_t runtime_version();
cudnnHandle_t handle_for_current_device();

}  // namespace primus::turbo::cudnn
