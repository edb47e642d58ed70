#include "io/hf_export.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <regex>
#include <set>
#include <vector>

#include "core/util/error.h"
#include "core/util/fs.h"
#include "io/safetensors.h"

namespace primus::io {
namespace fsys = std::filesystem;
using nlohmann::json;

namespace {

bool is_float(DType t) {
  return t == DType::F32 || t == DType::F64 || t == DType::BF16 || t == DType::F16;
}

// The tensor as it will be written: unchanged when it already has the target dtype (no copy),
// else converted into a new owned buffer.
TensorBlob converted(const TensorBlob& b, DType target) {
  if (!is_float(b.dtype()) || b.dtype() == target) return b;
  std::vector<float> f32 = b.to_fp32();
  if (target == DType::F32) return TensorBlob::from_vector(b.shape(), std::move(f32));
  std::vector<uint16_t> bf16(f32.size());
  fp32_to_bf16(f32, bf16);
  return TensorBlob::from_vector(b.shape(), std::move(bf16), DType::BF16);
}

uint64_t out_bytes(const TensorBlob& b, DType target) {
  return is_float(b.dtype()) ? b.numel() * dtype_size(target) : b.nbytes();
}

json derived_generation_config(const json& config) {
  json g = {{"_from_model_config", true}};
  for (const char* k : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
    if (config.contains(k) && !config[k].is_null()) g[k] = config[k];
  }
  return g;
}

void remove_if_exists(const fsys::path& p) {
  std::error_code ec;
  if (fsys::remove(p, ec)) spdlog::info("removed '{}' left by an earlier export", p.string());
}

}  // namespace

void export_hf(const fsys::path& out_dir, const json& config,
               const std::map<std::string, TensorBlob>& tensors, const HfExportOptions& opts) {
  if (opts.dtype != DType::F32 && opts.dtype != DType::BF16) {
    throw ConfigError(fmt::format("Hugging Face export dtype must be F32 or BF16, not {}",
                                  dtype_name(opts.dtype)));
  }
  if (!config.is_object()) throw ConfigError("Hugging Face export: config is not a JSON object");
  std::error_code ec;
  fsys::create_directories(out_dir, ec);
  if (ec) throw IoError(fmt::format("cannot create '{}': {}", out_dir.string(), ec.message()));

  // Shards in name order, greedily filled up to max_shard_bytes (as transformers does).
  std::vector<std::vector<const std::pair<const std::string, TensorBlob>*>> shards(1);
  uint64_t in_shard = 0, total = 0;
  for (const auto& entry : tensors) {
    uint64_t n = out_bytes(entry.second, opts.dtype);
    if (opts.max_shard_bytes && in_shard > 0 && in_shard + n > opts.max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(&entry);
    in_shard += n;
    total += n;
  }

  json weight_map = json::object();
  std::set<std::string> written;
  for (size_t s = 0; s < shards.size(); ++s) {
    std::string file = shards.size() == 1 ? "model.safetensors"
                                          : fmt::format("model-{:05d}-of-{:05d}.safetensors",
                                                        s + 1, shards.size());
    SafetensorsWriter w;
    w.set_metadata("format", "pt");
    for (const auto* e : shards[s]) {
      w.add(e->first, converted(e->second, opts.dtype));
      weight_map[e->first] = file;
    }
    w.write(out_dir / file);  // this shard's converted copies are freed here
    written.insert(file);
  }

  if (shards.size() > 1) {
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    fs::atomic_write_file(out_dir / "model.safetensors.index.json", index.dump(2) + "\n");
  }
  // Files of the other layout (or of a different shard count) would be loaded by transformers
  // in place of, or together with, the new ones.
  const std::regex shard_name(R"(model-\d{5}-of-\d{5}\.safetensors)");
  std::vector<fsys::path> stale;
  for (const auto& de : fsys::directory_iterator(out_dir, ec)) {
    std::string name = de.path().filename().string();
    bool ours = written.count(name) > 0;
    bool single = name == "model.safetensors", index = name == "model.safetensors.index.json";
    if (!ours && (single || (index && shards.size() == 1) || std::regex_match(name, shard_name))) {
      stale.push_back(de.path());
    }
  }
  for (const auto& p : stale) remove_if_exists(p);

  json cfg = config;
  if (!cfg.contains("torch_dtype") && !cfg.contains("dtype")) {
    cfg["torch_dtype"] = opts.dtype == DType::BF16 ? "bfloat16" : "float32";
  }
  fs::atomic_write_file(out_dir / "config.json", cfg.dump(2) + "\n");
  json gen = opts.generation_config.is_null() ? derived_generation_config(config)
                                              : opts.generation_config;
  fs::atomic_write_file(out_dir / "generation_config.json", gen.dump(2) + "\n");
  spdlog::info("exported {} tensors ({} bytes, {}) to '{}' in {} file(s)", tensors.size(), total,
               dtype_name(opts.dtype), out_dir.string(), shards.size());
}

}  // namespace primus::io
