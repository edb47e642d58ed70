#include "dummy_backend.h"

#include <cstdlib>

#include "core/patches/context.h"
#include "core/util/error.h"

namespace dummy {

using primus::patches::PatchContext;
using primus::patches::Phase;
using Greet = std::string(const std::string&);

std::vector<std::string>& journal() {
  static std::vector<std::string> j;
  return j;
}

std::vector<std::pair<std::string, std::string>> DummyArgs::describe() const {
  return {{"train_iters", std::to_string(train_iters)}, {"lr", std::to_string(lr)},
          {"grad_accum", std::to_string(grad_accum)}};
}

namespace {

class DummyTrainer : public primus::Trainer {
 public:
  DummyTrainer(std::shared_ptr<DummyArgs> a, const primus::patches::HookTable& h) : args_(a), hooks_(h) {}
  void setup() override { journal().push_back("setup"); }
  void init() override { journal().push_back("init"); }
  void train() override {
    journal().push_back("train:" + hooks_.get<Greet>("dummy.greet")("world"));
    if (args_->train_iters < 0) throw primus::RuntimeError("train failed on purpose");
  }
  void cleanup(bool on_error) override { journal().push_back(on_error ? "cleanup:error" : "cleanup"); }

 private:
  std::shared_ptr<DummyArgs> args_;
  const primus::patches::HookTable& hooks_;
};

class DummyAdapter : public primus::BackendAdapter {
 public:
  DummyAdapter() {
    schema_.integer("train_iters", 10, "steps to run", -1, 1000000)
        .number("lr", 1e-3, "learning rate", 0.0)
        .integer("global_batch_size", 8, "samples per step", 1)
        .integer("micro_batch_size", 2, "samples per micro step", 1)
        .flag("use_fancy_greeting", false, "wrap the greeting")
        .flag("fail_in_setup_patch", false, "make a setup patch throw")
        .text("optimizer", "adamw", "optimizer", {"adamw", "sgd"})
        .integer("num_layers", 2, "layers", 1)
        .integer("hidden_size", 64, "width", 1)
        .any("data_path", primus::config::KeyType::List, "datasets")
        .any("extra", primus::config::KeyType::Map, "free-form section");
  }
  std::string name() const override { return "dummy"; }
  std::string version() const override { return "1.2.0"; }
  std::string description() const override { return "test-only backend"; }
  const primus::config::Schema& schema() const override { return schema_; }
  void define_hooks(primus::patches::HookTable& h) const override {
    h.define<Greet>("dummy.greet", [](const std::string& who) { return "hello " + who; }, "greeting");
  }
  void prepare(const primus::config::ModuleConfig&) override { journal().push_back("prepare"); }
  std::shared_ptr<primus::BackendArgs> convert_config(const primus::config::ModuleConfig& cfg,
                                                      const primus::config::Experiment&) override {
    auto a = std::make_shared<DummyArgs>();
    a->train_iters = cfg.params.find_path("train_iters")->as_int();
    a->lr = cfg.params.find_path("lr")->as_double();
    journal().push_back("convert_config");
    return a;
  }
  std::unique_ptr<primus::Trainer> create_trainer(const std::string& stage,
                                                  std::shared_ptr<primus::BackendArgs> args,
                                                  const primus::patches::HookTable& hooks) override {
    if (stage != "pretrain") return nullptr;
    return std::make_unique<DummyTrainer>(std::static_pointer_cast<DummyArgs>(args), hooks);
  }

 private:
  primus::config::Schema schema_;
};

}  // namespace

void register_backend(primus::BackendRegistry& backends, primus::patches::PatchRegistry& patches) {
  backends.add("dummy", [] { return std::make_unique<DummyAdapter>(); });

  patches.add({
      .id = "dummy.env.marker",
      .description = "sets PRIMUS_DUMMY_MARKER",
      .phase = Phase::Setup,
      .logic = "sets env PRIMUS_DUMMY_MARKER",
      .apply =
          [](PatchContext& c) {
            if (c.flag("fail_in_setup_patch")) throw primus::RuntimeError("boom");
            c.set_env("PRIMUS_DUMMY_MARKER", "1");
            journal().push_back("patch:dummy.env.marker");
          },
  });

  patches.add({
      .id = "dummy.args.grad_accum",
      .description = "derives gradient accumulation from global and micro batch",
      .logic = "rewrites args: grad_accum",
      .apply =
          [](PatchContext& c) {
            auto& a = c.args_as<DummyArgs>();
            a.grad_accum = c.integer("global_batch_size") / c.integer("micro_batch_size");
            journal().push_back("patch:dummy.args.grad_accum=" + std::to_string(a.grad_accum));
          },
  });

  patches.add({
      .id = "dummy.greet.fancy",
      .description = "wraps the greeting in stars",
      .priority = 10,  // runs before the grad_accum patch (priority 50)
      .slots = {"dummy.greet"},
      .condition = [](PatchContext& c) { return c.flag("use_fancy_greeting"); },
      .apply =
          [](PatchContext& c) {
            c.wrap<Greet>("dummy.greet", [](std::function<Greet> inner) {
              return std::function<Greet>([inner](const std::string& w) { return "*" + inner(w) + "*"; });
            });
            journal().push_back("patch:dummy.greet.fancy");
          },
  });

  patches.add({
      .id = "dummy.compat.old_versions",
      .description = "only for dummy < 1.0",
      .phase = Phase::BeforeTrain,
      .backend_versions = "<1.0",
      .apply = [](PatchContext&) { journal().push_back("patch:dummy.compat.old_versions"); },
  });

  patches.add({
      .id = "dummy.lifecycle.before",
      .description = "notes the start of training",
      .phase = Phase::BeforeTrain,
      .backend_versions = ">=1.0,<2.0",
      .apply = [](PatchContext&) { journal().push_back("patch:dummy.lifecycle.before"); },
  });

  patches.add({
      .id = "*.lifecycle.after",
      .description = "notes the end of training (any backend)",
      .phase = Phase::AfterTrain,
      .apply = [](PatchContext&) { journal().push_back("patch:*.lifecycle.after"); },
  });
}

}  // namespace dummy
