// The reference backend's adapter: schema, hooks, config -> args, trainer.
#include <fmt/format.h>

#include "backends/reference/args.h"
#include "backends/reference/projection.h"
#include "backends/reference/register.h"
#include "backends/reference/trainer.h"
#include "train/hf_import.h"

namespace primus::backends::reference {

std::vector<std::pair<std::string, std::string>> ReferenceArgs::describe() const {
  auto d = train.describe();
  d.insert(d.begin(), {"model", model.summary()});
  d.push_back({"num_threads", num_threads == 0 ? "all cores" : std::to_string(num_threads)});
  if (train.data_parallel_size > 1 || dp.distributed_optimizer) {
    d.push_back({"data_parallel", fmt::format("{}gradients reduced in {} MiB buckets",
                                              dp.distributed_optimizer ? "ZeRO-1 (optimizer state sharded), " : "",
                                              dp.bucket_size_mb)});
  }
  return d;
}

namespace {

class ReferenceAdapter : public BackendAdapter {
 public:
  ReferenceAdapter() {
    train::add_model_schema(schema_);
    train::add_training_schema(schema_);
    train::add_hf_import_schema(schema_);
    parallel::add_data_parallel_schema(schema_);
    schema_.integer("num_threads", 0, "CPU threads for OpenMP and OpenBLAS (0: all cores)", 0, 1024);
  }
  std::string name() const override { return kName; }
  std::string version() const override { return kVersion; }
  std::string description() const override { return "CPU, fp32, OpenMP + OpenBLAS: the oracle for every other backend"; }
  const config::Schema& schema() const override { return schema_; }
  void define_hooks(patches::HookTable&) const override {}
  void prepare(const config::ModuleConfig&) override {}
  std::shared_ptr<BackendArgs> convert_config(const config::ModuleConfig& cfg, const config::Experiment& exp) override {
    auto a = std::make_shared<ReferenceArgs>();
    // With load_hf the model keys (and the tokenizer) come from the Hugging Face folder.
    const config::Value params = train::resolve_load_hf(cfg.params, exp.file);
    a->model = train::ModelSpec::from_config(params);
    a->train = train::TrainingArgs::from_config(params, exp);
    a->train.model_parallel.check_implemented(kReferenceMesh);
    if (const int64_t tp = a->train.model_parallel[parallel::Dim::TP]; tp > 1 && a->model.moe.enabled()) {
      throw ConfigError(fmt::format("tensor_model_parallel_size {} with MoE layers (num_experts) is not implemented yet "
                                    "on the reference backend (the cuda backend splits every expert over the tp ranks); "
                                    "use data parallelism here",
                                    tp));
    }
    a->dp = parallel::DataParallelArgs::from_config(params);
    a->num_threads = params.find_path("num_threads")->as_int();
    a->params = params;
    a->experiment_file = exp.file.string();
    return a;
  }
  std::unique_ptr<Trainer> create_trainer(const std::string& stage, std::shared_ptr<BackendArgs> args,
                                          const patches::HookTable&) override {
    if (stage != "pretrain") return nullptr;
    return std::make_unique<ReferenceTrainer>(std::static_pointer_cast<ReferenceArgs>(args));
  }

 private:
  config::Schema schema_;
};

}  // namespace

void register_backend(BackendRegistry& backends, patches::PatchRegistry& patches) {
  backends.add(kName, [] { return std::make_unique<ReferenceAdapter>(); });
  register_patches(patches);
  register_reference_projection();  // `primus projection` and the dry run's memory line
}

}  // namespace primus::backends::reference
