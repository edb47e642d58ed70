// The runner of `primus benchmark` (benchmark.h): devices, ceilings, the per-case and per-backend
// loop, the table and the JSON lines.
#include "turbo/bench/benchmark.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <map>
#include <memory>
#include <optional>

#include "core/util/error.h"
#include "turbo/bench/harness.h"
#include "turbo/dispatch/backend_manager.h"
#include "turbo/dispatch/dispatcher.h"
#include "turbo/ops/gemm.h"

namespace primus::turbo::bench {

// ---- CaseEnv -------------------------------------------------------------------------------------
TensorView CaseEnv::empty(DType t, std::initializer_list<int64_t> shape) { return dev.arena().tensor(t, shape, "benchmark operand"); }
TensorView CaseEnv::rand(DType t, std::initializer_list<int64_t> shape, float scale, float offset) {
  TensorView v = empty(t, shape);
  dev.fill_uniform(v, seed++, scale, offset);
  return v;
}
TensorView CaseEnv::zeros(DType t, std::initializer_list<int64_t> shape) {
  TensorView v = empty(t, shape);
  dev.zero(v);
  return v;
}
TensorView CaseEnv::ints(std::initializer_list<int64_t> shape, int32_t hi) {
  TensorView v = empty(DType::I32, shape);
  dev.fill_ints(v, seed++, hi);
  return v;
}

std::vector<int64_t> parse_dims(const std::string& op, const std::string& entry, size_t n, const std::string& syntax) {
  std::vector<int64_t> d;
  size_t pos = 0;
  bool ok = !entry.empty();
  while (ok && pos <= entry.size()) {
    size_t end = entry.find('x', pos);
    if (end == std::string::npos) end = entry.size();
    const std::string part = entry.substr(pos, end - pos);
    ok = !part.empty() && part.size() <= 12;
    for (char c : part) ok = ok && std::isdigit(static_cast<unsigned char>(c));
    if (ok) {
      d.push_back(std::stoll(part));
      ok = d.back() > 0;
    }
    pos = end + 1;
  }
  if (!ok || d.size() != n)
    throw UsageError(fmt::format("{}: shape '{}' is not {} ({} positive integers joined by 'x')", op, entry, syntax, n));
  return d;
}

namespace {

const std::vector<OpFamily>& families() {
  static const std::vector<OpFamily> f = {gemm_family(), norm_family(), activation_family(), loss_family(),
                                          optimizer_family(), rope_family(), head_norm_family(), embedding_family(),
                                          attention_family(),
                                          quantize_family(), gemm_fp8_family(), layer_family(), grouped_gemm_family(),
                                          grouped_gemm_fp8_family(), moe_family()};
  return f;
}

const OpFamily& family_named(const std::string& name) {
  for (const auto& f : families())
    if (f.name == name) return f;
  std::string known;
  for (const auto& f : families()) known += (known.empty() ? "" : ", ") + f.name;
  throw UsageError(fmt::format("benchmark: unknown op '{}' (known: {})", name, known));
}

// The ceilings of one device, measured once per run.
struct Ceilings {
  double tflops = 0, gbs = 0;           // 0: not measured (then *_why says why)
  std::string tflops_what, gbs_what, tflops_why;
};

// A large GEMM (bf16 8192^3 on a GPU through cuBLASLt; f32 512^3 on the host through the CPU
// backend) and a copy (512 MiB device to device; 64 MiB memcpy on the host), each the fastest of
// `iters` calls.
Ceilings measure_ceilings(BenchDevice& dev, int iters) {
  Ceilings c;
  const bool gpu = dev.kind() == Device::CUDA;
  const size_t copy_bytes = gpu ? size_t{512} << 20 : size_t{64} << 20;
  const double copy_ms = dev.copy_ms(copy_bytes, iters);
  c.gbs = 2.0 * static_cast<double>(copy_bytes) / copy_ms / 1e6;  // bytes read + written
  c.gbs_what = gpu ? "device-to-device copy of 512 MiB" : "host memcpy of 64 MiB";
  const int64_t n = gpu ? 8192 : 512;
  const DType dt = gpu ? DType::BF16 : DType::F32;
  const BackendType be = gpu ? BackendType::CUBLASLT : BackendType::CPU;
  c.tflops_what = fmt::format("{} GEMM {}x{}x{} ({})", dtype_name(dt), n, n, n, backend_name(be));
  ArenaScope scope(dev.arena());
  CaseEnv e{dev, dt, ExecContext{nullptr, &dev.scratch()}};
  GemmArgs g;
  g.a = e.rand(dt, {n, n});
  g.b = e.rand(dt, {n, n}).transposed();
  g.d = e.empty(dt, {n, n});
  g.ctx = e.ctx;
  auto& mgr = GlobalBackendManager::instance();
  mgr.set_backend("gemm", be);
  try {
    const double ms = dev.time_ms([&] { gemm(g); }, iters, true);
    c.tflops = 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) / ms / 1e9;
  } catch (const std::exception& ex) {
    c.tflops_why = ex.what();
  }
  mgr.clear_backend("gemm");
  return c;
}

std::string first_line(const std::string& s) {
  const auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl) + " [...]";
}

std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += {'\\', c};
    else if (static_cast<unsigned char>(c) < 0x20) o += fmt::format("\\u{:04x}", static_cast<int>(c));
    else o += c;
  }
  return o + "\"";
}

std::string today_utc() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[16];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d", &tm);
  return buf;
}

class Reporter {
 public:
  Reporter(const BenchConfig& cfg, std::FILE* out) : cfg_(cfg), out_(out), date_(cfg.date.empty() ? today_utc() : cfg.date) {
    if (!cfg.json_path.empty()) {
      json_ = std::fopen(cfg.json_path.c_str(), "a");
      if (!json_) throw IoError(fmt::format("benchmark: cannot open --json file '{}' for appending", cfg.json_path));
    }
  }
  ~Reporter() {
    if (json_) std::fclose(json_);
  }

  // A measurement: value in its metric's unit, share of the ceiling as the anchor when measured.
  // xcheck: the cross-check's JSON object, or "".
  void measurement(const std::string& bench, const std::string& case_name, const std::string& backend,
                   const std::string& device, DType dt, Metric m, double work, double ms, double ceiling,
                   const std::string& ceiling_what, const std::string& note, const std::string& xcheck) {
    const bool flops = m == Metric::Flops;
    const double value = flops ? work / ms / 1e9 : work / ms / 1e6;
    const char* unit = flops ? "TFLOP/s" : "GB/s";
    const std::string share = ceiling > 0 ? fmt::format("{:5.1f}% of ceiling", 100.0 * value / ceiling) : "  (no ceiling)";
    std::fprintf(out_, "  %-40s %-8s %11.4f ms %10.2f %-7s %s%s\n", case_name.c_str(), backend.c_str(), ms, value, unit,
                 share.c_str(), note.empty() ? "" : ("  " + note).c_str());
    std::fflush(out_);
    if (json_) {
      std::string anchor = "null", anchor_name = "null", ratio = "null";
      if (ceiling > 0) {
        anchor = fmt::format("{:.6g}", ceiling);
        anchor_name = json_str("ceiling: " + ceiling_what + ", same run");
        ratio = fmt::format("{:.6g}", value / ceiling);
      }
      write_json(bench, case_name, backend, device, std::string(dtype_name(dt)), unit, value, anchor, anchor_name, ratio, ms,
                 work, xcheck);
    }
    ++count_;
  }

  void ceiling_line(const std::string& bench, const std::string& case_name, const std::string& backend,
                    const std::string& device, const std::string& dtype, const char* unit, double value, double ms,
                    double work) {
    if (json_) write_json(bench, case_name, backend, device, dtype, unit, value, "null", "null", "null", ms, work);
  }
  int count() const { return count_; }

 private:
  void write_json(const std::string& bench, const std::string& case_name, const std::string& backend,
                  const std::string& device, const std::string& dtype, const char* unit, double value,
                  const std::string& anchor,
                  const std::string& anchor_name, const std::string& ratio, double ms, double work,
                  const std::string& xcheck = "") {
    std::fprintf(json_,
                 "{\"bench\": %s, \"case\": %s, \"device\": %s, \"date\": %s, \"commit\": %s, \"metric\": %s, "
                 "\"ours\": %.6g, \"anchor\": %s, \"anchor_name\": %s, \"ratio\": %s, \"backend\": %s, \"dtype\": %s, "
                 "\"ms\": %.6g, \"work\": %.17g%s}\n",
                 json_str(bench).c_str(), json_str(case_name).c_str(), json_str(device).c_str(), json_str(date_).c_str(),
                 json_str(cfg_.commit).c_str(), json_str(unit).c_str(), value, anchor.c_str(), anchor_name.c_str(),
                 ratio.c_str(), json_str(backend).c_str(), json_str(dtype).c_str(), ms, work,
                 xcheck.empty() ? "" : (", \"xcheck\": " + xcheck).c_str());
    std::fflush(json_);
  }

  const BenchConfig& cfg_;
  std::FILE* out_;
  std::FILE* json_ = nullptr;
  std::string date_;
  int count_ = 0;
};

bool is_device_backend(BackendType b) { return b != BackendType::CPU; }

// A family whose one backend is CPU runs on the host, in a GPU run too.
bool host_only_family(const OpFamily& f) { return f.backends == std::vector<BackendType>{BackendType::CPU}; }

// Environment variables set for a scope and put back at its end (their old values, or unset),
// also when the scope ends by an exception.
class ScopedEnv {
 public:
  ScopedEnv() = default;
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second) setenv(it->first.c_str(), it->second->c_str(), 1);
      else unsetenv(it->first.c_str());
    }
  }
  void set(const std::string& var, const std::string& value) {
    if (std::none_of(saved_.begin(), saved_.end(), [&](const auto& v) { return v.first == var; })) {
      const char* old = std::getenv(var.c_str());
      saved_.emplace_back(var, old ? std::optional<std::string>(old) : std::nullopt);
    }
    setenv(var.c_str(), value.c_str(), 1);
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

// ||got - ref|| / ||ref|| over all elements; infinite when either holds a NaN or an infinity.
double rel_l2(const std::vector<float>& got, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i]) || !std::isfinite(ref[i])) return INFINITY;
    const double d = static_cast<double>(got[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// The cross-check of one family's run: per case, the outputs (Timed::outputs) of the first
// backend that ran each measurement are the reference of every later backend or variant, which
// all ran on the same inputs (the same seeds; a host backend's f32 against a device's bf16 sees
// the rounding of the inputs too).
class CrossCheck {
 public:
  void next_case() { refs_.clear(); }

  // Reads t's outputs from `dev` after its timing; returns the JSON object for t's line, or ""
  // when t has no outputs or is the reference.
  std::string check(const Timed& t, const std::string& label, BenchDevice& dev, double gate) {
    if (t.outputs.empty()) return "";
    dev.synchronize();
    std::vector<std::pair<std::string, std::vector<float>>> got;
    for (const auto& [name, view] : t.outputs) got.emplace_back(name, dev.read(view));
    const auto it = refs_.find(t.name);
    if (it == refs_.end()) {
      refs_.emplace(t.name, Ref{label, std::move(got)});
      return "";
    }
    const Ref& ref = it->second;
    std::string json = fmt::format("{{\"vs\": {}, \"rel_l2\": {{", json_str(ref.label)), cells;
    bool above = false, first = true;
    for (size_t i = 0; i < got.size() && i < ref.values.size(); ++i) {
      if (got[i].first != ref.values[i].first || got[i].second.size() != ref.values[i].second.size()) continue;
      const double e = rel_l2(got[i].second, ref.values[i].second);
      above = above || !(e <= gate);
      json += fmt::format("{}{}: {}", first ? "" : ", ", json_str(got[i].first),
                          std::isfinite(e) ? fmt::format("{:.3g}", e) : std::string("null"));
      cells += fmt::format(" {:>4} {:<9}", got[i].first, fmt::format("{:.2e}", e));
      first = false;
    }
    rows_ += fmt::format("  {:<40} {:<18} vs {:<8}{}{}\n", t.name, label, ref.label, cells,
                         above ? fmt::format("  ABOVE {:.0e}", gate) : "");
    above_ = above_ || above;
    return json + "}}";
  }

  void print(const OpFamily& f, std::FILE* out) const {
    if (rows_.empty()) return;
    std::fprintf(out, "\n%s: outputs against the first backend's on the same inputs (relative L2 error; gate %.0e)\n",
                 f.name.c_str(), f.check_gate);
    std::fprintf(out, "%s", rows_.c_str());
    if (above_) std::fprintf(out, "  some outputs differ by more than the gate: see ABOVE\n");
    std::fflush(out);
  }

 private:
  struct Ref {
    std::string label;
    std::vector<std::pair<std::string, std::vector<float>>> values;
  };
  std::map<std::string, Ref> refs_;
  std::string rows_;
  bool above_ = false;
};

// f.compare's tables: for each (ours, anchor) pair, every measurement both backends took in this
// run, with anchor ms / ours ms (above 1: ours is faster) and the geometric mean over the cases.
void print_comparisons(const OpFamily& f, const std::vector<std::string>& measured,
                       const std::map<std::string, std::map<std::string, double>>& times, std::FILE* out) {
  for (const auto& [ours, anchor] : f.compare) {
    const std::string o(backend_name(ours)), a(backend_name(anchor));
    std::string rows;
    double log_sum = 0.0;
    int n = 0;
    for (const std::string& name : measured) {
      const auto& per = times.at(name);
      const auto io = per.find(o), ia = per.find(a);
      if (io == per.end() || ia == per.end()) continue;
      const double ratio = ia->second / io->second;
      rows += fmt::format("  {:<40} {:>11.4f} ms {:>11.4f} ms {:>8.3f}x\n", name, io->second, ia->second, ratio);
      log_sum += std::log(ratio);
      ++n;
    }
    if (n == 0) continue;
    std::fprintf(out, "\n%s %s vs %s (same run; ratio = %s time / %s time, above 1: %s is faster)\n", f.name.c_str(),
                 o.c_str(), a.c_str(), a.c_str(), o.c_str(), o.c_str());
    std::fprintf(out, "  %-40s %14s %14s %9s\n", "case", o.c_str(), a.c_str(), "ratio");
    std::fprintf(out, "%s", rows.c_str());
    std::fprintf(out, "  %-40s %14s %14s %8.3fx\n", "geometric mean", "", "", std::exp(log_sum / n));
    std::fflush(out);
  }
}

// A bandwidth measurement, for the same-size copy table.
struct Moved {
  std::string name, backend;
  BenchDevice* dev;
  int iters;
  double work, ms;  // bytes read + written; milliseconds
};

// Memory-bound ops against a device copy of their own byte count. The ceiling of the per-case
// lines is a 512 MiB copy, a steady state that an op moving 25-270 MB (one GPT-2 or Llama layer's
// norm at 16384 tokens) cannot reach: launch, ramp-up and the last wave weigh more the less is
// moved (an H200, 2026-11-26: 3.6-3.8 TB/s for the copies of GPT-2's norm sizes, 4.2 for 512 MiB).
// Each size is copied once per device (cached across families), timed as the ceiling is (the
// fastest call); lines go to the JSON file as `copy/<bytes>` ceiling rows.
void print_copy_shares(const OpFamily& f, const std::vector<Moved>& moved,
                       std::map<std::pair<BenchDevice*, size_t>, double>& copy_gbs, Reporter& rep, std::FILE* out) {
  if (moved.empty()) return;
  std::string rows;
  for (const Moved& m : moved) {
    const size_t bytes = (static_cast<size_t>(m.work / 2.0) + 255) / 256 * 256;  // copied once: read + written = work
    if (bytes == 0) continue;
    auto key = std::make_pair(m.dev, bytes);
    auto it = copy_gbs.find(key);
    if (it == copy_gbs.end()) {
      m.dev->arena().reset();
      m.dev->scratch().reset();
      if (2 * bytes + 2 * Arena::kDefaultAlign > m.dev->arena().capacity()) continue;  // cannot hold both copies
      const double ms = m.dev->copy_ms(bytes, m.iters);
      const double gbs = 2.0 * static_cast<double>(bytes) / ms / 1e6;
      it = copy_gbs.emplace(key, gbs).first;
      const bool gpu = m.dev->kind() == Device::CUDA;
      rep.ceiling_line("ops", fmt::format("copy/{}", bytes), gpu ? "cudaMemcpyAsync" : "memcpy", m.dev->name(), "bytes",
                       "GB/s", gbs, ms, 2.0 * static_cast<double>(bytes));
    }
    const double gbs = m.work / m.ms / 1e6;
    rows += fmt::format("  {:<40} {:<8} {:>10.2f} {:>10.2f} {:>7.1f}%\n", m.name, m.backend, gbs, it->second,
                        100.0 * gbs / it->second);
  }
  if (rows.empty()) return;
  std::fprintf(out, "\n%s: bandwidth against a copy of the same bytes on the same device (GB/s, read + written)\n",
               f.name.c_str());
  std::fprintf(out, "  %-40s %-8s %10s %10s %8s\n", "case", "backend", "op", "copy", "share");
  std::fprintf(out, "%s", rows.c_str());
  std::fflush(out);
}

}  // namespace

std::vector<std::string> benchmark_op_names() {
  std::vector<std::string> n;
  for (const auto& f : families()) n.push_back(f.name);
  return n;
}

std::string benchmark_shape_help() {
  std::string s;
  for (const auto& f : families()) s += fmt::format("  {:<11} {}\n", f.name, f.shape_syntax);
  return s;
}

std::string benchmark_variant_help() {
  std::string s;
  for (const auto& f : families())
    for (const KernelVariant& v : f.variants) {
      std::string env;
      for (const auto& [var, value] : v.env) env += fmt::format("{}{}={}", env.empty() ? "" : " ", var, value);
      s += fmt::format("  {:<11} {:<18} {} with {}\n", f.name, v.name, backend_name(v.backend), env);
    }
  return s;
}

int run_benchmarks(const BenchConfig& cfg, std::FILE* out) {
  if (cfg.ops.empty()) throw UsageError("benchmark: name at least one op");
  std::vector<const OpFamily*> ops;
  for (const auto& name : cfg.ops) ops.push_back(&family_named(name));
  if (cfg.dtype != DType::BF16 && cfg.dtype != DType::F16 && cfg.dtype != DType::F32)
    throw UsageError(fmt::format("benchmark: --dtype {} is not bf16, f16 or f32", dtype_name(cfg.dtype)));
  if (cfg.iters < 0) throw UsageError(fmt::format("benchmark: --iters {} is negative", cfg.iters));
  if (cfg.memory_gib < 0) throw UsageError(fmt::format("benchmark: --memory-gib {} is negative", cfg.memory_gib));
  // Which backends: "" (the device's), "all", or one name that every op named must have.
  std::optional<BackendType> named;
  const bool all = cfg.backend == "all";
  if (!cfg.backend.empty() && !all) {
    named = parse_backend(cfg.backend);
    if (!named) throw UsageError(fmt::format("benchmark: unknown --backend '{}' (CPU, CUBLASLT, CUDNN, TURBO or all)", cfg.backend));
    for (const OpFamily* f : ops) {
      bool has = false;
      std::string list;
      for (BackendType b : f->backends) {
        has = has || b == *named;
        list += (list.empty() ? "" : ", ") + std::string(backend_name(b));
      }
      if (!has) throw UsageError(fmt::format("benchmark: op '{}' has no backend {} (it has: {})", f->name, cfg.backend, list));
    }
  }
  // --variants: names of kernel variants of the ops named, or "all" (every variant of those ops).
  const bool all_variants = std::find(cfg.variants.begin(), cfg.variants.end(), "all") != cfg.variants.end();
  std::vector<std::pair<const OpFamily*, const KernelVariant*>> asked;  // the names given, resolved
  for (const std::string& name : cfg.variants) {
    if (name == "all") continue;
    const KernelVariant* found = nullptr;
    for (const OpFamily* f : ops)
      for (const KernelVariant& v : f->variants)
        if (v.name == name) asked.emplace_back(f, found = &v);
    if (found) continue;
    std::string known;
    for (const auto& f : families())
      for (const KernelVariant& v : f.variants) {
        if (v.name == name)
          throw UsageError(fmt::format("benchmark: --variants {} is a variant of op '{}', which this run does not benchmark",
                                       name, f.name));
        known += (known.empty() ? "" : ", ") + v.name;
      }
    throw UsageError(fmt::format("benchmark: unknown variant '{}' (known: {})", name, known.empty() ? "none" : known));
  }
  auto variant_wanted = [&](const KernelVariant& v) {
    return all_variants || std::find(cfg.variants.begin(), cfg.variants.end(), v.name) != cfg.variants.end();
  };
  // Cases: parse every --shapes entry up front, so a typo fails before anything runs.
  std::map<const OpFamily*, std::vector<Case>> explicit_cases;
  for (const OpFamily* f : ops)
    for (const auto& s : cfg.shapes) explicit_cases[f].push_back(f->from_shape(s));

  // Host-only families (CPU alone) need no device: a run of only those leaves the GPU alone.
  const bool host_only = std::all_of(ops.begin(), ops.end(), [](const OpFamily* f) { return host_only_family(*f); });
  std::string no_gpu;
  std::unique_ptr<BenchDevice> gpu;
  if (cfg.cpu_only) no_gpu = "--cpu-only";
  else if (!host_only)
    gpu = make_cuda_bench_device(static_cast<size_t>((cfg.memory_gib > 0 ? cfg.memory_gib : 24.0) * (1u << 30)), &no_gpu);
  if (cfg.idle_ms < 0) throw UsageError(fmt::format("benchmark: --idle-ms {} is negative", cfg.idle_ms));
  if (cfg.idle_on != "device" && cfg.idle_on != "host")
    throw UsageError(fmt::format("benchmark: --idle-on '{}' (expected device or host)", cfg.idle_on));
  if (gpu) gpu->set_idle(cfg.idle_ms, cfg.idle_on == "host" ? BenchDevice::Idle::Host : BenchDevice::Idle::Device);
  if (!gpu && !host_only) {
    if (named && is_device_backend(*named))
      throw UsageError(fmt::format("benchmark: --backend {} needs a CUDA device: {}", cfg.backend, no_gpu));
    std::fprintf(out, "no GPU (%s): running the CPU kernels only, on f32 tensors\n", no_gpu.c_str());
  }
  // Which of a family's backends this run times: the one named, all, or the device's (CPU without
  // a GPU); a host-only family runs its CPU backend in any run.
  auto runs_backend = [&](const OpFamily& f, BackendType b) {
    if (named) return b == *named;
    if (all || host_only_family(f)) return true;
    return gpu ? is_device_backend(b) : b == BackendType::CPU;
  };
  for (const auto& [f, v] : asked) {
    if (is_device_backend(v->backend) && !gpu)
      throw UsageError(fmt::format("benchmark: --variants {} needs a CUDA device: {}", v->name, no_gpu));
    if (!runs_backend(*f, v->backend))
      throw UsageError(fmt::format("benchmark: --variants {} runs on backend {}, which --backend {} leaves out", v->name,
                                   backend_name(v->backend), cfg.backend));
  }
  std::unique_ptr<BenchDevice> host;
  auto host_device = [&]() -> BenchDevice& {
    if (!host) host = make_host_bench_device(static_cast<size_t>((cfg.memory_gib > 0 && !gpu ? cfg.memory_gib : 2.0) * (1u << 30)));
    return *host;
  };

  Reporter rep(cfg, out);
  std::map<BenchDevice*, Ceilings> ceilings;
  std::map<std::pair<BenchDevice*, size_t>, double> copy_gbs;  // same-size copies, GB/s
  auto ceiling_of = [&](BenchDevice& dev, int iters) -> const Ceilings& {
    auto it = ceilings.find(&dev);
    if (it != ceilings.end()) return it->second;
    const Ceilings c = measure_ceilings(dev, std::max(10, std::min(iters, 20)));
    std::fprintf(out, "device: %s\n", dev.name().c_str());
    if (c.tflops > 0) std::fprintf(out, "  ceiling %-40s %10.2f TFLOP/s\n", c.tflops_what.c_str(), c.tflops);
    else std::fprintf(out, "  ceiling %-40s not measured: %s\n", c.tflops_what.c_str(), first_line(c.tflops_why).c_str());
    std::fprintf(out, "  ceiling %-40s %10.2f GB/s\n", c.gbs_what.c_str(), c.gbs);
    std::fflush(out);
    const bool on_gpu = dev.kind() == Device::CUDA;
    const std::string be = on_gpu ? "cudaMemcpyAsync" : "memcpy";
    const double copy_bytes = on_gpu ? 2.0 * (512 << 20) : 2.0 * (64 << 20);
    rep.ceiling_line("ops", on_gpu ? "copy/512MiB" : "copy/64MiB", be, dev.name(), "bytes", "GB/s", c.gbs,
                     copy_bytes / c.gbs / 1e6, copy_bytes);
    if (c.tflops > 0) {
      const double n = on_gpu ? 8192.0 : 512.0;
      rep.ceiling_line("ops", on_gpu ? "ceiling/gemm_8192" : "ceiling/gemm_512", on_gpu ? "CUBLASLT" : "CPU", dev.name(),
                       on_gpu ? "bf16" : "f32", "TFLOP/s", c.tflops, 2 * n * n * n / c.tflops / 1e9, 2 * n * n * n);
    }
    return ceilings.emplace(&dev, c).first->second;
  };

  auto& mgr = GlobalBackendManager::instance();
  for (const OpFamily* f : ops) {
    // Times per measurement name and lane (backend or variant), in the order first measured (for
    // f->compare).
    std::vector<std::string> measured;
    std::map<std::string, std::map<std::string, double>> times;
    std::vector<Moved> moved;  // the bandwidth measurements, in order
    CrossCheck checks;
    // The backends this run times, each followed by its variants asked for.
    std::vector<std::pair<BackendType, const KernelVariant*>> chosen;
    for (BackendType b : f->backends) {
      if (!runs_backend(*f, b)) continue;
      chosen.emplace_back(b, nullptr);
      for (const KernelVariant& v : f->variants)
        if (v.backend == b && variant_wanted(v)) chosen.emplace_back(b, &v);
    }
    std::fprintf(out, "\n%s (%s)\n", f->name.c_str(), f->shape_syntax.c_str());
    // Each backend's (or variant's) lane: its device, repetitions, ceilings and cases.
    struct Lane {
      BackendType be;
      const KernelVariant* variant;  // nullptr: the backend as configured
      std::string label;             // the backend's name, or the variant's
      BenchDevice* dev;
      int iters;
      const Ceilings* ceil;
      DType dt;
      std::vector<Case> cases;
    };
    std::vector<Lane> lanes;
    for (const auto& [be, variant] : chosen) {
      const std::string label = variant ? variant->name : std::string(backend_name(be));
      if (is_device_backend(be) && !gpu) {
        std::fprintf(out, "  %s: skipped, no CUDA device\n", label.c_str());
        continue;
      }
      BenchDevice& dev = is_device_backend(be) ? *gpu : host_device();
      const bool on_gpu = dev.kind() == Device::CUDA;
      const int iters = cfg.iters > 0 ? cfg.iters : on_gpu ? 50 : 5;
      const Ceilings& ceil = ceiling_of(dev, iters);
      lanes.push_back({be, variant, label, &dev, iters, &ceil, on_gpu ? cfg.dtype : DType::F32,
                       cfg.shapes.empty() ? f->defaults(Scale{on_gpu, on_gpu ? 16384 : 256}) : explicit_cases[f]});
    }
    auto run_case = [&](const Lane& l, const Case& c) {
      const BackendType be = l.be;
      BenchDevice& dev = *l.dev;
      ScopedEnv variant_env;  // a variant's switches, for the case's setup and timing
      if (l.variant)
        for (const auto& [var, value] : l.variant->env) variant_env.set(var, value);
      dev.arena().reset();
      dev.scratch().reset();
      for (const auto& op : f->dispatch_ops) mgr.set_backend(op, be);
      try {
        CaseEnv env{dev, l.dt, ExecContext{nullptr, &dev.scratch()}};
        const std::vector<Timed> calls = c.build(env);
        std::optional<std::string> refused;  // named: the first product the backend refused
        size_t timed = 0;
        for (const Timed& t : calls) {
          std::vector<std::pair<std::string, double>> runs;  // (reported name, ms): one, or one per --ab value
          try {
            if (cfg.ab_var.empty()) runs.emplace_back(t.name, dev.time_ms(t.run, l.iters));
            else runs = time_ab(cfg, dev, t, l.iters);
          } catch (const std::exception& ex) {
            // One product a backend cannot run (e.g. TURBO on an unaligned shape) skips only it.
            // A backend named with --backend fails the run instead, unless it refused one product
            // of a case with others (TURBO has no bias-gradient epilogue, but the training cases'
            // other products are its own); a case it refuses whole is still the error.
            if (named && !(calls.size() > 1 && dynamic_cast<const BackendRefusedError*>(&ex))) throw;
            if (named && !refused) refused = ex.what();
            std::fprintf(out, "  %-40s %-8s skipped: %s (case %s)\n", t.name.c_str(), l.label.c_str(),
                         first_line(ex.what()).c_str(), c.name.c_str());
            std::fflush(out);
            dev.synchronize();
            continue;
          }
          // The cross-check reads what the timed calls wrote; under --ab that would be only the
          // last value's, so it is left out there, as in a run of one lane (nothing to compare).
          std::string xcheck;
          if (cfg.ab_var.empty() && lanes.size() > 1) {
            try {
              xcheck = checks.check(t, l.label, dev, f->check_gate);
            } catch (const std::exception& ex) {
              std::fprintf(out, "  %-40s %-8s cross-check failed: %s\n", t.name.c_str(), l.label.c_str(),
                           first_line(ex.what()).c_str());
            }
          }
          const double ceiling = t.metric == Metric::Flops ? l.ceil->tflops : l.ceil->gbs;
          for (const auto& [name, ms] : runs) {
            rep.measurement(f->bench, name, l.label, dev.name(), l.dt, t.metric, t.work, ms, ceiling,
                            t.metric == Metric::Flops ? l.ceil->tflops_what : l.ceil->gbs_what, t.note, xcheck);
            if (times.find(name) == times.end()) measured.push_back(name);
            times[name][l.label] = ms;
            if (t.metric == Metric::Bytes) moved.push_back({name, l.label, &dev, l.iters, t.work, ms});
          }
          ++timed;
        }
        if (refused && timed == 0) throw RuntimeError(*refused);
      } catch (const std::exception& ex) {
        for (const auto& op : f->dispatch_ops) mgr.clear_backend(op);
        if (named) throw RuntimeError(fmt::format("benchmark {} case '{}' on {}: {}", f->name, c.name, l.label, ex.what()));
        std::fprintf(out, "  %-40s %-8s skipped: %s\n", c.name.c_str(), l.label.c_str(), first_line(ex.what()).c_str());
        std::fflush(out);
      }
      for (const auto& op : f->dispatch_ops) mgr.clear_backend(op);
      dev.synchronize();
    };
    // Case-major: every backend runs a case back to back before the next case starts, so the
    // ratios between backends are not skewed by whatever drifts over a long run (seen on an H200,
    // 2026-11-26: one TURBO product timed 0.118 ms alone and 0.149 ms late in a full run, and
    // cuBLASLt's likewise; cause not isolated, clocks and heat are the suspects).
    size_t most = 0;
    for (const Lane& l : lanes) most = std::max(most, l.cases.size());
    for (size_t i = 0; i < most; ++i) {
      checks.next_case();
      for (const Lane& l : lanes)
        if (i < l.cases.size()) run_case(l, l.cases[i]);
    }
    print_comparisons(*f, measured, times, out);
    print_copy_shares(*f, moved, copy_gbs, rep, out);
    checks.print(*f, out);
  }
  if (rep.count() == 0)
    throw RuntimeError("benchmark: no measurements were taken (every backend was skipped; the reasons are above)");
  return rep.count();
}

std::vector<std::pair<std::string, double>> time_ab(const BenchConfig& cfg, BenchDevice& dev, const Timed& t, int iters) {
  ScopedEnv env;  // the variable's previous value (or its absence) comes back, also when a call throws
  std::vector<std::vector<double>> ms(cfg.ab_values.size());
  for (int r = 0; r < cfg.ab_rounds; ++r)
    for (size_t i = 0; i < cfg.ab_values.size(); ++i) {
      env.set(cfg.ab_var, cfg.ab_values[i]);
      ms[i].push_back(dev.time_ms(t.run, iters));
    }
  std::vector<std::pair<std::string, double>> out;
  for (size_t i = 0; i < ms.size(); ++i) {
    // The median as BenchDevice::time_ms takes it (the upper one of an even count).
    std::nth_element(ms[i].begin(), ms[i].begin() + static_cast<std::ptrdiff_t>(ms[i].size() / 2), ms[i].end());
    out.emplace_back(fmt::format("{} [{}={}]", t.name, cfg.ab_var, cfg.ab_values[i]), ms[i][ms[i].size() / 2]);
  }
  return out;
}

void parse_ab(const std::string& spec, BenchConfig& cfg) {
  const size_t eq = spec.find('=');
  if (eq == std::string::npos || eq == 0)
    throw UsageError(fmt::format("benchmark: --ab '{}': expected VAR=A,B[,...] (an environment variable and its values)", spec));
  std::vector<std::string> values;
  for (size_t at = eq + 1;;) {
    const size_t comma = spec.find(',', at);
    values.push_back(spec.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
    if (values.back().empty()) throw UsageError(fmt::format("benchmark: --ab '{}': an empty value", spec));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  if (values.size() < 2) throw UsageError(fmt::format("benchmark: --ab '{}': at least two values to compare", spec));
  cfg.ab_var = spec.substr(0, eq);
  cfg.ab_values = std::move(values);
}

}  // namespace primus::turbo::bench
