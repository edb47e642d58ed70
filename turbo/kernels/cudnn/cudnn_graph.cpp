#include "turbo/kernels/cudnn/cudnn_graph.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <mutex>
#include <optional>

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

namespace {

// Descriptors of `type` that a descriptor-valued attribute of `of` holds, filled by cuDNN.
std::vector<DescPtr> get_descs(const Desc& of, cudnnBackendAttributeName_t name, cudnnBackendDescriptorType_t type) {
  int64_t count = 0;
  PRIMUS_CUDNN_CHECK(dnn().cudnnBackendGetAttribute(of.get(), name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr));
  std::vector<DescPtr> out;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    out.push_back(std::make_shared<Desc>(type));
    raw.push_back(out.back()->get());
  }
  int64_t got = 0;
  if (count > 0)
    PRIMUS_CUDNN_CHECK(dnn().cudnnBackendGetAttribute(of.get(), name, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, raw.data()));
  out.resize(static_cast<size_t>(std::max<int64_t>(got, 0)));
  return out;
}
int64_t get_i64(const Desc& of, cudnnBackendAttributeName_t name) {
  int64_t v = 0, n = 0;
  PRIMUS_CUDNN_CHECK(dnn().cudnnBackendGetAttribute(of.get(), name, CUDNN_TYPE_INT64, 1, &n, &v));
  return v;
}
cudnnBackendKnobType_t get_knob_type(const Desc& of, cudnnBackendAttributeName_t name) {
  cudnnBackendKnobType_t v{};
  int64_t n = 0;
  PRIMUS_CUDNN_CHECK(dnn().cudnnBackendGetAttribute(of.get(), name, CUDNN_TYPE_KNOB_TYPE, 1, &n, &v));
  return v;
}

// An engine configuration as (engine global index, knob choices sorted by knob type).
struct CfgId {
  int64_t engine = -1;
  std::vector<std::pair<int64_t, int64_t>> knobs;
  bool operator==(const CfgId& o) const { return engine == o.engine && knobs == o.knobs; }
  std::string str() const {
    std::string s = fmt::format("engine {}", engine);
    for (const auto& [t, v] : knobs) s += fmt::format(" k{}={}", t, v);
    return s;
  }
};
CfgId describe_cfg(const Desc& cfg) {
  CfgId id;
  const auto engines = get_descs(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  if (!engines.empty()) id.engine = get_i64(*engines[0], CUDNN_ATTR_ENGINE_GLOBAL_INDEX);
  for (const auto& k : get_descs(cfg, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR))
    id.knobs.emplace_back(static_cast<int64_t>(get_knob_type(*k, CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE)),
                          get_i64(*k, CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE));
  std::sort(id.knobs.begin(), id.knobs.end());
  return id;
}

// A finalized engine configuration of `graph`: engine `engine` with `knobs`; null when cuDNN
// refuses any part of it. `keep` receives the descriptors the configuration references.
DescPtr make_cfg(const GraphBuilder::Graph& graph, const CfgId& id, std::vector<DescPtr>& keep) {
  auto engine = std::make_shared<Desc>(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  engine->set_desc(CUDNN_ATTR_ENGINE_OPERATION_GRAPH, *graph.graph);
  engine->set_i64(CUDNN_ATTR_ENGINE_GLOBAL_INDEX, id.engine);
  if (dnn().cudnnBackendFinalize(engine->get()) != CUDNN_STATUS_SUCCESS) return nullptr;
  std::vector<DescPtr> choices;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (const auto& [t, v] : id.knobs) {
    auto c = std::make_shared<Desc>(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR);
    const auto type = static_cast<cudnnBackendKnobType_t>(t);
    c->set(CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &type);
    c->set_i64(CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, v);
    if (dnn().cudnnBackendFinalize(c->get()) != CUDNN_STATUS_SUCCESS) return nullptr;
    raw.push_back(c->get());
    choices.push_back(std::move(c));
  }
  auto cfg = std::make_shared<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
  cfg->set_desc(CUDNN_ATTR_ENGINECFG_ENGINE, *engine);
  if (!raw.empty())
    cfg->set(CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(raw.size()), raw.data());
  if (dnn().cudnnBackendFinalize(cfg->get()) != CUDNN_STATUS_SUCCESS) return nullptr;
  keep.push_back(engine);
  for (auto& c : choices) keep.push_back(std::move(c));
  return cfg;
}

// The knob variants of `base` (one knob moved at a time through [min, max] by its stride),
// at most `limit` of them.
std::vector<CfgId> knob_variants(const GraphBuilder::Graph& graph, const CfgId& base, size_t limit) {
  std::vector<CfgId> out;
  Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  engine.set_desc(CUDNN_ATTR_ENGINE_OPERATION_GRAPH, *graph.graph);
  engine.set_i64(CUDNN_ATTR_ENGINE_GLOBAL_INDEX, base.engine);
  if (dnn().cudnnBackendFinalize(engine.get()) != CUDNN_STATUS_SUCCESS) return out;
  for (const auto& info : get_descs(engine, CUDNN_ATTR_ENGINE_KNOB_INFO, CUDNN_BACKEND_KNOB_INFO_DESCRIPTOR)) {
    const int64_t type = static_cast<int64_t>(get_knob_type(*info, CUDNN_ATTR_KNOB_INFO_TYPE));
    const int64_t lo = get_i64(*info, CUDNN_ATTR_KNOB_INFO_MINIMUM_VALUE);
    const int64_t hi = get_i64(*info, CUDNN_ATTR_KNOB_INFO_MAXIMUM_VALUE);
    const int64_t step = std::max<int64_t>(1, get_i64(*info, CUDNN_ATTR_KNOB_INFO_STRIDE));
    for (int64_t v = lo; v <= hi && out.size() < limit; v += step) {
      CfgId id = base;
      auto it = std::find_if(id.knobs.begin(), id.knobs.end(), [&](const auto& k) { return k.first == type; });
      if (it != id.knobs.end()) {
        if (it->second == v) continue;
        it->second = v;
      } else {
        id.knobs.emplace_back(type, v);
        std::sort(id.knobs.begin(), id.knobs.end());
      }
      out.push_back(std::move(id));
    }
  }
  return out;
}

// Finalizes an execution plan for `cfg`; nullopt (with the reason appended to `tried`) when
// cuDNN refuses it.
std::optional<Plan> finalize_plan(cudnnHandle_t handle, const GraphBuilder::Graph& graph, const DescPtr& cfg,
                                  const std::string& what, std::string& tried) {
  auto plan = std::make_shared<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
  plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
  cudnnBackendDescriptor_t raw = cfg->get();
  plan->set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &raw);
  const cudnnStatus_t st = dnn().cudnnBackendFinalize(plan->get());
  if (st != CUDNN_STATUS_SUCCESS) {
    char last[512] = {0};
    dnn().cudnnGetLastErrorString(last, sizeof(last));
    tried += fmt::format("({}: {} {}) ", what, dnn().cudnnGetErrorString(st), last);
    return std::nullopt;
  }
  Plan p;
  int64_t n = 0;
  PRIMUS_CUDNN_CHECK(dnn().cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                                    CUDNN_TYPE_INT64, 1, &n, &p.workspace_bytes));
  p.plan = std::move(plan);
  p.graph = graph;
  // The plan references its engine config: keep it alive with the graph.
  p.graph.keep.push_back(cfg);
  return p;
}

}  // namespace

std::vector<Plan> make_plans(cudnnHandle_t handle, const GraphBuilder::Graph& graph, size_t max_plans,
                             bool knob_variants_too) {
  std::string tried;
  std::vector<Plan> plans;
  std::vector<CfgId> seen;
  max_plans = std::max<size_t>(max_plans, 1);
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    if (!plans.empty()) break;
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
    const auto cfgs = get_descs(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
    tried += fmt::format("[mode {}: {} configs] ", static_cast<int>(mode), cfgs.size());
    for (size_t i = 0; i < cfgs.size() && plans.size() < max_plans; ++i) {
      CfgId id;
      try {
        id = describe_cfg(*cfgs[i]);
      } catch (const std::exception&) {  // an undescribable configuration can still run
      }
      auto p = finalize_plan(handle, graph, cfgs[i], fmt::format("cfg {}", i), tried);
      if (!p) continue;
      p->engine = fmt::format("heuristics mode {} config {} of {} ({})", static_cast<int>(mode), i, cfgs.size(), id.str());
      if (id.engine >= 0) seen.push_back(id);
      plans.push_back(std::move(*p));
    }
  }
  if (plans.empty()) throw RuntimeError("cuDNN: no engine configuration finalizes for this graph: " + tried);
  if (knob_variants_too && !seen.empty()) {
    for (const CfgId& id : knob_variants(graph, seen.front(), 4 * max_plans)) {
      if (plans.size() >= max_plans) break;
      if (std::find(seen.begin(), seen.end(), id) != seen.end()) continue;
      std::vector<DescPtr> keep;
      DescPtr cfg = make_cfg(graph, id, keep);
      if (!cfg) continue;
      auto p = finalize_plan(handle, graph, cfg, id.str(), tried);
      if (!p) continue;
      for (auto& d : keep) p->graph.keep.push_back(std::move(d));
      p->engine = "knob variant (" + id.str() + ")";
      seen.push_back(id);
      plans.push_back(std::move(*p));
    }
  }
  return plans;
}

Plan make_plan(cudnnHandle_t handle, GraphBuilder::Graph graph) {
  return std::move(make_plans(handle, graph, 1, false).front());
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
