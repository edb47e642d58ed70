#include "turbo/kernels/cudnn/cudnn_graph.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <mutex>

#include "core/util/error.h"

namespace primus::turbo::cudnn {

void throw_cudnn_error(cudnnStatus_t st, const char* expr, const char* file, int line) {
  char last[1024] = {0};
  dnn().cudnnGetLastErrorString(last, sizeof(last));
  throw RuntimeError(fmt::format("cuDNN error {} ({}) in `{}` at {}:{}{}{}", static_cast<int>(st),
                                 dnn().cudnnGetErrorString(st), expr, file, line, last[0] ? ": " : "", last));
}

Desc::Desc(cudnnBackendDescriptorType_t type) {
  PRIMUS_CUDNN_CHECK(dnn().cudnnBackendCreateDescriptor(type, &d_));
}
Desc::~Desc() {
  if (d_) dnn().cudnnBackendDestroyDescriptor(d_);
}
void Desc::set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
               const void* values) {
  const cudnnStatus_t st = dnn().cudnnBackendSetAttribute(d_, name, type, count, values);
  if (st != CUDNN_STATUS_SUCCESS)
    throw_cudnn_error(st, fmt::format("cudnnBackendSetAttribute(attr {})", static_cast<int>(name)).c_str(),
                      __FILE__, __LINE__);
}
void Desc::set_desc(cudnnBackendAttributeName_t name, const Desc& other) {
  cudnnBackendDescriptor_t o = other.get();
  set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &o);
}
void Desc::set_i64(cudnnBackendAttributeName_t name, int64_t v) { set(name, CUDNN_TYPE_INT64, 1, &v); }
void Desc::finalize() { PRIMUS_CUDNN_CHECK(dnn().cudnnBackendFinalize(d_)); }

// ---- graph builder ---------------------------------------------------------------------------

int64_t GraphBuilder::tensor(const TensorSpec& s) {
  PRIMUS_CHECK(s.dims.size() == s.strides.size() && !s.dims.empty(), "cudnn graph: dims/strides rank mismatch");
  specs_.push_back(s);
  tensors_.emplace_back();
  return static_cast<int64_t>(specs_.size());  // uids start at 1
}

int64_t GraphBuilder::virtual_like(int64_t like, cudnnDataType_t dtype) {
  TensorSpec s = spec(like);
  s.dtype = dtype;
  s.is_virtual = true;
  s.by_value = false;
  return tensor(s);
}

int64_t GraphBuilder::scalar(cudnnDataType_t dtype) {
  return tensor(TensorSpec{{1, 1, 1, 1}, {1, 1, 1, 1}, dtype, false, true});
}

const DescPtr& GraphBuilder::tdesc(int64_t uid) {
  DescPtr& d = tensors_.at(static_cast<size_t>(uid - 1));
  if (d) return d;
  const TensorSpec& s = spec(uid);
  d = std::make_shared<Desc>(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  d->set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &s.dtype);
  d->set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, static_cast<int64_t>(s.dims.size()), s.dims.data());
  d->set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, static_cast<int64_t>(s.strides.size()), s.strides.data());
  d->set_i64(CUDNN_ATTR_TENSOR_UNIQUE_ID, uid);
  d->set_i64(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, 16);
  if (s.is_virtual) {
    const bool t = true;
    d->set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &t);
  }
  if (s.by_value) {
    const bool t = true;
    d->set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &t);
  }
  d->finalize();
  return d;
}

void GraphBuilder::matmul(int64_t a, int64_t b, int64_t c) {
  auto mm = std::make_shared<Desc>(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
  const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
  mm->set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
  mm->finalize();
  auto op = std::make_shared<Desc>(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
  op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, *tdesc(a));
  op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, *tdesc(b));
  op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, *tdesc(c));
  op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, *mm);
  op->finalize();
  aux_.push_back(std::move(mm));
  ops_.push_back(std::move(op));
}

void GraphBuilder::pointwise(cudnnPointwiseMode_t mode, int64_t x, int64_t y, int64_t b, int64_t t,
                             cudnnDataType_t compute, int64_t axis) {
  auto pw = std::make_shared<Desc>(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
  pw->set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
  pw->set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &compute);
  if (mode == CUDNN_POINTWISE_GEN_INDEX) pw->set_i64(CUDNN_ATTR_POINTWISE_AXIS, axis);
  pw->finalize();
  auto op = std::make_shared<Desc>(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
  op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, *pw);
  op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, *tdesc(x));
  if (b) op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *tdesc(b));
  if (t) op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, *tdesc(t));
  op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, *tdesc(y));
  op->finalize();
  aux_.push_back(std::move(pw));
  ops_.push_back(std::move(op));
}

void GraphBuilder::reduction(cudnnReduceTensorOp_t rop, int64_t x, int64_t y) {
  auto rd = std::make_shared<Desc>(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
  rd->set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &rop);
  const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
  rd->set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
  rd->finalize();
  auto op = std::make_shared<Desc>(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
  op->set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, *tdesc(x));
  op->set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, *tdesc(y));
  op->set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, *rd);
  op->finalize();
  aux_.push_back(std::move(rd));
  ops_.push_back(std::move(op));
}

void GraphBuilder::reshape(int64_t x, int64_t y) {
  auto op = std::make_shared<Desc>(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
  op->set_desc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, *tdesc(x));
  op->set_desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, *tdesc(y));
  op->finalize();
  ops_.push_back(std::move(op));
}

GraphBuilder::Graph GraphBuilder::build(cudnnHandle_t handle) {
  Graph g;
  g.graph = std::make_shared<Desc>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  std::vector<cudnnBackendDescriptor_t> raw;
  for (const auto& op : ops_) raw.push_back(op->get());
  g.graph->set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
  g.graph->set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
               static_cast<int64_t>(raw.size()), raw.data());
  g.graph->finalize();
  for (auto& t : tensors_)
    if (t) g.keep.push_back(t);
  for (auto& d : aux_) g.keep.push_back(d);
  for (auto& d : ops_) g.keep.push_back(d);
  return g;
}

// ---- plans -----------------------------------------------------------------------------------

Plan make_plan(cudnnHandle_t handle, GraphBuilder::Graph graph) {
  std::string tried;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    heur.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, *graph.graph);
    heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    const cudnnStatus_t hst = dnn().cudnnBackendFinalize(heur.get());
    if (hst != CUDNN_STATUS_SUCCESS) {
      char last[512] = {0};
      dnn().cudnnGetLastErrorString(last, sizeof(last));
      tried += fmt::format("[heuristics mode {}: {} {}] ", static_cast<int>(mode), dnn().cudnnGetErrorString(hst), last);
      continue;
    }
    int64_t count = 0;
    PRIMUS_CUDNN_CHECK(dnn().cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr));
    std::vector<std::unique_ptr<Desc>> cfgs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (int64_t i = 0; i < count; ++i) {
      cfgs.push_back(std::make_unique<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
      raw.push_back(cfgs.back()->get());
    }
    int64_t got = 0;
    if (count > 0)
      PRIMUS_CUDNN_CHECK(dnn().cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                  CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, raw.data()));
    tried += fmt::format("[mode {}: {} configs] ", static_cast<int>(mode), got);
    for (int64_t i = 0; i < got; ++i) {
      auto plan = std::make_shared<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
      cudnnBackendDescriptor_t cfg = raw[static_cast<size_t>(i)];
      plan->set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfg);
      const cudnnStatus_t st = dnn().cudnnBackendFinalize(plan->get());
      if (st != CUDNN_STATUS_SUCCESS) {
        char last[512] = {0};
        dnn().cudnnGetLastErrorString(last, sizeof(last));
        tried += fmt::format("(cfg {}: {} {}) ", i, dnn().cudnnGetErrorString(st), last);
        continue;
      }
      Plan p;
      int64_t n = 0;
      PRIMUS_CUDNN_CHECK(dnn().cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                                  CUDNN_TYPE_INT64, 1, &n, &p.workspace_bytes));
      p.plan = std::move(plan);
      p.engine = fmt::format("heuristics mode {} config {} of {}", static_cast<int>(mode), i, got);
      p.graph = std::move(graph);
      // The plan references its engine config: keep the chosen one alive with the graph.
      p.graph.keep.push_back(DescPtr(cfgs[static_cast<size_t>(i)].release()));
      return p;
    }
  }
  throw RuntimeError("cuDNN: no engine configuration finalizes for this graph: " + tried);
}

void execute(cudnnHandle_t handle, const Plan& plan, const std::vector<int64_t>& uids,
             const std::vector<void*>& ptrs, void* workspace) {
  PRIMUS_CHECK(uids.size() == ptrs.size(), "cudnn execute: {} uids for {} pointers", uids.size(), ptrs.size());
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<int64_t>(uids.size()), uids.data());
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<int64_t>(ptrs.size()), ptrs.data());
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  pack.finalize();
  PRIMUS_CUDNN_CHECK(dnn().cudnnBackendExecute(handle, plan.plan->get(), pack.get()));
}

size_t runtime_version() { return dnn().cudnnGetVersion(); }

cudnnHandle_t handle_for_current_device() {
  static std::mutex mu;
  static std::vector<cudnnHandle_t> handles;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) throw RuntimeError("cuDNN: cudaGetDevice failed");
  std::lock_guard lock(mu);
  if (handles.size() <= static_cast<size_t>(dev)) handles.resize(static_cast<size_t>(dev) + 1, nullptr);
  if (!handles[static_cast<size_t>(dev)]) PRIMUS_CUDNN_CHECK(dnn().cudnnCreate(&handles[static_cast<size_t>(dev)]));
  return handles[static_cast<size_t>(dev)];
}

}  // namespace primus::turbo::cudnn
