// Frozen parameters at stage 3 (NOTE [frozen groups]) on one process: a
// model of layers with a frozen base and trainable adapters trains to the
// same bits partitioned as whole, with zero::Init, with offload_param (cpu
// and nvme) and activation checkpointing; the ledger counts the frozen
// shards; which parameters train is decided before partitioning and a
// change after it is refused; checkpoints without the frozen base resume
// to the same bits; leaf modules make one layer of a module (NOTE [leaf
// modules]). Multi-rank runs are in tests/models/lora_test.cpp.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include "zero/core/error.h"
#include "zero/runtime/engine_internal.h"
#include "zero/zero.h"

namespace {

constexpr int64_t kDim = 48, kRank = 4, kLayers = 3;

// y = x W^T + (x A^T) B^T: W frozen (a pretrained base), A and B adapters.
struct AdaptedImpl : torch::nn::Module {
  torch::Tensor weight, lora_a, lora_b;
  zero::checkpointing::Checkpointer* checkpointer = nullptr;
  AdaptedImpl() {
    weight = register_parameter("weight", torch::randn({kDim, kDim}) * 0.2, /*requires_grad=*/false);
    lora_a = register_parameter("lora_a", torch::randn({kRank, kDim}) * 0.1);
    lora_b = register_parameter("lora_b", torch::randn({kDim, kRank}) * 0.1);
  }
  torch::Tensor forward(torch::Tensor x) {
    zero::checkpointing::Function f = [this](const std::vector<at::Tensor>& in) {
      return std::vector<at::Tensor>{torch::tanh(torch::nn::functional::linear(in[0], weight) +
                                                 torch::nn::functional::linear(torch::nn::functional::linear(in[0], lora_a), lora_b))};
    };
    if (checkpointer != nullptr && is_training()) return checkpointer->checkpoint(f, std::vector<at::Tensor>{x}).at(0);
    return f({x}).at(0);
  }
};
TORCH_MODULE(Adapted);

struct Built {
  torch::nn::Sequential net;
  std::vector<Adapted> layers;
};

// kLayers adapted layers and a trainable head; `init` partitions each as built.
Built build(zero::Init* init, uint64_t seed = 3) {
  torch::manual_seed(seed);
  Built b;
  for (int i = 0; i < kLayers; ++i) {
    Adapted l;
    b.layers.push_back(l);
    b.net->push_back(init != nullptr ? init->partition(l) : l);
  }
  torch::nn::Linear head(kDim, 4);
  b.net->push_back(init != nullptr ? init->partition(head) : head);
  return b;
}

std::string config(int stage, const std::string& offload_param = "none", const std::string& extra = "") {
  std::string op = offload_param == "none" ? "" : R"(, "offload_param": {"device": ")" + offload_param + R"(")" +
                                                      (offload_param == "nvme" ? R"(, "nvme_path": ")" +
                                                                                     std::filesystem::temp_directory_path().string() +
                                                                                     R"(", "max_in_cpu": 0)"
                                                                               : "") +
                                                      "}";
  return R"({"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.5,
             "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
             "zero_optimization": {"stage": )" +
         std::to_string(stage) + R"(, "stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": true)" + op +
         "}" + extra + "}";
}

zero::InitOptions quiet() {
  zero::InitOptions o;
  o.print_progress = false;
  o.device = torch::Device(torch::kCPU);
  o.cpu_copy_mode = zero::CopyMode::kDeferred;  // a missing wait fails here, as it would race on a GPU
  return o;
}

torch::Tensor batch(int step, int64_t n = 8) {
  torch::manual_seed(1000 + step);
  return torch::randn({n, kDim});
}

torch::Tensor loss_of(torch::nn::Sequential& net, int step) {
  torch::manual_seed(2000 + step);
  const auto y = torch::randint(4, {8});
  const auto x = batch(step).to(net->parameters().back().scalar_type());  // (a bf16 model's dtype)
  return torch::nn::functional::cross_entropy(net->forward(x).to(torch::kFloat), y);
}

// Losses of `steps` steps, and every parameter's final values (gathered at stage 3).
struct Trained {
  std::vector<double> losses;
  std::vector<torch::Tensor> values;
};

std::vector<torch::Tensor> values_of(zero::Engine& engine, torch::nn::Sequential& net) {
  std::vector<torch::Tensor> out;
  std::vector<torch::Tensor> params;
  for (const auto& p : net->parameters()) params.push_back(p);
  zero::GatheredParameters g(engine, params);
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

Trained train(zero::Engine& engine, Built& b, int from, int to) {
  Trained t;
  for (int s = from; s < to; ++s) {
    auto loss = loss_of(b.net, s);
    t.losses.push_back(loss.item<double>());
    engine.backward(loss);
    engine.step();
  }
  t.values = values_of(engine, b.net);
  return t;
}

void expect_same_bits(const Trained& a, const Trained& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << what << ": step " << i;
  ASSERT_EQ(a.values.size(), b.values.size());
  for (size_t i = 0; i < a.values.size(); ++i)
    EXPECT_TRUE(torch::equal(a.values[i], b.values[i])) << what << ": parameter " << i;
}

Trained reference(int steps, bool checkpointing = false) {
  auto b = build(nullptr);
  auto engine = zero::initialize(b.net.ptr(), config(0), quiet());
  if (checkpointing)
    for (auto& l : b.layers) l->checkpointer = &engine.checkpointer();
  return train(engine, b, 0, steps);
}

int64_t frozen_bytes(zero::Engine& e, zero::Tier t) {
  return e.ledger().get(t, zero::Kind::kFrozenParameters).current_bytes;
}

TEST(Frozen, Stage3PartitionsThemAndTrainsToTheBitsOfStage0) {
  const auto want = reference(4), want_checkpointed = reference(4, true);
  struct Case {
    std::string name, offload;
    bool init, checkpointing;
    zero::Tier tier;
  };
  for (const auto& c : std::vector<Case>{{"whole", "none", false, false, zero::Tier::kDevice},
                                          {"init", "none", true, false, zero::Tier::kDevice},
                                          {"init+cpu", "cpu", true, false, zero::Tier::kPinnedHost},
                                          {"nvme", "nvme", false, false, zero::Tier::kNvme},
                                          {"init+nvme", "nvme", true, false, zero::Tier::kNvme},
                                          {"checkpointing", "none", false, true, zero::Tier::kDevice}}) {
    SCOPED_TRACE(c.name);
    const std::string cfg = config(3, c.offload);
    std::unique_ptr<zero::Init> init;
    if (c.init) init = std::make_unique<zero::Init>(cfg, quiet());
    auto b = build(init.get());
    auto engine = init ? zero::initialize(b.net.ptr(), *init) : zero::initialize(b.net.ptr(), cfg, quiet());
    if (c.checkpointing)
      for (auto& l : b.layers) l->checkpointer = &engine.checkpointer();
    // One frozen group a layer: kDim x kDim fp32 each (a multiple of the
    // partition unit; in the swap file, of its 4 KiB alignment).
    const int64_t shard = kDim * kDim * 4, aligned = (shard + 4095) / 4096 * 4096;
    EXPECT_EQ(frozen_bytes(engine, c.tier), kLayers * (c.tier == zero::Tier::kNvme ? aligned : shard));
    EXPECT_EQ(engine.num_parameters(), kLayers * 2 * kRank * kDim + kDim * 4 + 4) << "trainable ones only";
    expect_same_bits(train(engine, b, 0, 4), c.checkpointing ? want_checkpointed : want, c.name);
    // Released after every backward (a recompute's gather too): only shards are held.
    EXPECT_EQ(engine.stage3_stats()->live_parameters, 0);
    EXPECT_EQ(frozen_bytes(engine, zero::Tier::kDevice), c.tier == zero::Tier::kDevice ? kLayers * kDim * kDim * 4 : 0);
    EXPECT_NE(engine.memory_summary().find("frozen_parameters"), std::string::npos) << engine.memory_summary();
  }
}

TEST(Frozen, WholeFrozenParametersBelowStage3AreCounted) {
  auto b = build(nullptr);
  auto engine = zero::initialize(b.net.ptr(), config(2), quiet());
  EXPECT_EQ(frozen_bytes(engine, zero::Tier::kDevice), kLayers * kDim * kDim * 4);
}

TEST(Frozen, InitOptionsTrainableDecidesBeforePartitioning) {
  // Every parameter built trainable; the options freeze the bases by name,
  // under Init as each layer is partitioned and at initialize for a model built whole.
  auto all_trainable = [](Built& b) {
    for (auto& l : b.layers) l->weight.requires_grad_(true);
  };
  const auto want = reference(3);
  for (const bool with_init : {false, true}) {
    SCOPED_TRACE(with_init ? "init" : "whole");
    auto o = quiet();
    o.trainable = zero::frozen_matching({"\\.weight$"});
    const std::string cfg = config(3);
    std::unique_ptr<zero::Init> init;
    if (with_init) init = std::make_unique<zero::Init>(cfg, o);
    torch::manual_seed(3);
    Built b;
    for (int i = 0; i < kLayers; ++i) {
      Adapted l;
      l->weight.requires_grad_(true);
      b.layers.push_back(l);
      b.net->push_back(init ? init->partition(l, std::to_string(i)) : l);
    }
    torch::nn::Linear head(kDim, 4);
    b.net->push_back(init ? init->partition(head, std::to_string(kLayers)) : head);
    (void)all_trainable;
    auto engine = init ? zero::initialize(b.net.ptr(), *init) : zero::initialize(b.net.ptr(), cfg, o);
    for (auto& l : b.layers) EXPECT_FALSE(l->weight.requires_grad());
    // The head's weight too, its group padded to the partition unit (256).
    EXPECT_EQ(frozen_bytes(engine, zero::Tier::kDevice), (kLayers * kDim * kDim + 256) * 4);
  }
  (void)want;
}

TEST(Frozen, FreezingAfterInitializeIsRefusedNamingTheParameter) {
  {  // after initialize
    auto b = build(nullptr);
    auto engine = zero::initialize(b.net.ptr(), config(3), quiet());
    b.layers[1]->lora_a.requires_grad_(false);
    try {
      engine.backward(loss_of(b.net, 0));
      FAIL() << "expected a UsageError";
    } catch (const zero::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("1.lora_a"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("InitOptions::trainable"), std::string::npos) << e.what();
    }
    b.layers[1]->lora_a.requires_grad_(true);
    b.layers[0]->weight.requires_grad_(true);  // unfrozen
    EXPECT_THROW(engine.step(), zero::UsageError);
  }
  {  // between zero::Init and initialize: not an internal error
    zero::Init init(config(3), quiet());
    auto b = build(&init);
    b.layers[2]->lora_b.requires_grad_(false);
    try {
      auto engine = zero::initialize(b.net.ptr(), init);
      FAIL() << "expected a UsageError";
    } catch (const zero::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("2.lora_b"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("zero::Init"), std::string::npos) << e.what();
    }
  }
}

TEST(Frozen, CheckpointWithoutTheFrozenBaseResumesToTheSameBits) {
  const std::string dir = std::filesystem::temp_directory_path().string() + "/zero_frozen_ckpt_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  const auto want = [&] {
    auto b = build(nullptr);
    auto engine = zero::initialize(b.net.ptr(), config(3), quiet());
    return train(engine, b, 0, 6);
  }();
  int64_t with_bytes = 0, without_bytes = 0;
  for (const bool exclude : {false, true}) {
    SCOPED_TRACE(exclude ? "exclude_frozen" : "with the frozen");
    {
      auto b = build(nullptr);
      auto engine = zero::initialize(b.net.ptr(), config(3), quiet());
      train(engine, b, 0, 3);
      zero::SaveCheckpointOptions so;
      so.exclude_frozen = exclude;
      const auto st = engine.save_checkpoint(dir, exclude ? "without" : "with", "{}", so);
      (exclude ? without_bytes : with_bytes) = st.bytes;
    }
    // A fresh model: its base as built (the same seed), its adapters trained from elsewhere.
    auto b = build(nullptr, exclude ? 3 : 99);
    if (exclude) {
      torch::NoGradGuard no_grad;
      for (auto& l : b.layers) l->lora_a.zero_();
    }
    auto engine = zero::initialize(b.net.ptr(), config(3), quiet());
    engine.load_checkpoint(dir, exclude ? "without" : "with");
    auto got = train(engine, b, 3, 6);
    std::vector<double> tail(want.losses.begin() + 3, want.losses.end());
    ASSERT_EQ(got.losses.size(), tail.size());
    for (size_t i = 0; i < tail.size(); ++i) EXPECT_EQ(got.losses[i], tail[i]) << "step " << 3 + i;
    for (size_t i = 0; i < want.values.size(); ++i) EXPECT_TRUE(torch::equal(got.values[i], want.values[i])) << i;
  }
  EXPECT_LT(without_bytes, with_bytes - kLayers * kDim * kDim * 4 + 4096) << "the base is not in it";
  std::filesystem::remove_all(dir);
}

// A layer of experts whose run depends on a flag: as a leaf module it is
// one stage-3 layer, whatever runs inside it.
struct ExpertsImpl : torch::nn::Module {
  torch::nn::ModuleList experts;
  bool second = false;
  ExpertsImpl() : experts(register_module("experts", torch::nn::ModuleList())) {
    for (int i = 0; i < 2; ++i) experts->push_back(torch::nn::Linear(kDim, kDim));
  }
  torch::Tensor forward(torch::Tensor x) { return zero::forward(experts[second ? 1 : 0]->as<torch::nn::Linear>(), x); }
};
TORCH_MODULE(Experts);

struct MoENetImpl : torch::nn::Module {
  Experts moe;
  torch::nn::Linear head{nullptr};
  MoENetImpl() : moe(register_module("moe", Experts())), head(register_module("head", torch::nn::Linear(kDim, 4))) {}
  torch::Tensor forward(torch::Tensor x) { return zero::forward(head, zero::forward(moe, x)); }
};
TORCH_MODULE(MoENet);

TEST(Leaf, AModuleWhosePartsRunByTheDataIsOneLayer) {
  for (const int how : {0, 1, 2}) {  // 0: no leaf, 1: InitOptions::leaf_modules, 2: zero::set_leaf
    SCOPED_TRACE(how);
    torch::manual_seed(5);
    MoENet net;
    auto o = quiet();
    o.layers = {net->head.ptr()};
    if (how == 1) o.leaf_modules = {net->moe.ptr()};
    if (how == 2) zero::set_leaf(*net->moe);
    EXPECT_EQ(zero::is_leaf(*net->moe), how == 2);
    auto engine = zero::initialize(net.ptr(), config(3), o);
    EXPECT_EQ(engine.stage3_stats()->layers, how == 0 ? 3 : 2) << "each expert a layer, or the mixture one";
    for (int s = 0; s < 3; ++s) {
      net->moe->second = s % 2 == 1;
      torch::manual_seed(s);
      auto loss = net->forward(torch::randn({8, kDim})).pow(2).mean();
      engine.backward(loss);
      engine.step();
    }
  }
}

TEST(Leaf, ALeafOutsideTheModelIsAClearError) {
  torch::manual_seed(5);
  MoENet net;
  Experts stray;
  auto o = quiet();
  o.leaf_modules = {stray.ptr()};
  try {
    auto engine = zero::initialize(net.ptr(), config(3), o);
    FAIL() << "expected a ConfigError";
  } catch (const zero::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("InitOptions::leaf_modules[0]"), std::string::npos) << e.what();
  }
}

// set_lr: the lr of the next steps; with a scheduler, its next step wins
// (DeepSpeed's rule); per group; param_groups() reads what the next step uses.
TEST(FineTuningApi, SetLrLastsUntilTheSchedulesNextStep) {
  {  // Without a scheduler the value stays: the same bits as a config of that lr.
    auto a = build(nullptr), b = build(nullptr);
    auto ea = zero::initialize(a.net.ptr(), config(3), quiet());
    std::string other = config(3);
    other.replace(other.find("\"lr\": 0.01"), 10, "\"lr\": 0.03");
    auto eb = zero::initialize(b.net.ptr(), other, quiet());
    ea.set_lr(0.03);
    EXPECT_EQ(ea.get_lr(), 0.03);
    expect_same_bits(train(ea, a, 0, 3), train(eb, b, 0, 3), "set_lr");
    EXPECT_EQ(ea.get_lr(), 0.03);
  }
  {  // With one, the schedule's next step sets it again.
    const std::string cfg = config(3, "none", R"(, "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0,
        "warmup_max_lr": 0.01, "warmup_num_steps": 10, "warmup_type": "linear"}})");
    auto b = build(nullptr);
    auto e = zero::initialize(b.net.ptr(), cfg, quiet());
    train(e, b, 0, 1);
    const double scheduled = e.get_lr();
    e.set_lr(0.5);
    EXPECT_EQ(e.get_lr(), 0.5);
    EXPECT_EQ(e.param_groups().at(0).lr, 0.5);
    train(e, b, 1, 2);
    EXPECT_NE(e.get_lr(), 0.5);
    EXPECT_GT(e.get_lr(), scheduled) << "the warmup goes on from its own value";
  }
  {  // Per group, and weight decay.
    auto b = build(nullptr);
    auto o = quiet();
    o.param_groups.push_back(zero::ParamGroup::by_name("adapters", {".lora_a", ".lora_b"}, {}, 0.0));
    auto e = zero::initialize(b.net.ptr(), config(3), o);
    auto groups = e.param_groups();
    ASSERT_EQ(groups.size(), 2u);
    EXPECT_EQ(groups[1].name, "adapters");
    EXPECT_EQ(groups[1].numel, kLayers * 2 * kRank * kDim);
    e.set_lr(0.002, 1);
    e.set_weight_decay(0.3, 0);
    groups = e.param_groups();
    EXPECT_EQ(groups[0].lr, 0.01);
    EXPECT_EQ(groups[1].lr, 0.002);
    EXPECT_EQ(groups[0].weight_decay, 0.3);
    EXPECT_EQ(groups[1].weight_decay, 0.0);
    EXPECT_THROW(e.set_lr(0.1, 2), zero::UsageError);
    EXPECT_THROW(e.set_lr(-1), zero::UsageError);
  }
}

// GatheredParameters at stage 3 with offload_param: the full values to
// read, and a modifier's change in the shards, the master and the model.
TEST(FineTuningApi, GatheredParametersReadAndWriteBackAtStage3) {
  auto ref = build(nullptr);
  auto got = build(nullptr);
  auto er = zero::initialize(ref.net.ptr(), config(0), quiet());
  auto eg = zero::initialize(got.net.ptr(), config(3, "cpu"), quiet());
  train(er, ref, 0, 2);
  train(eg, got, 0, 2);
  // The same change in both: the frozen base of layer 1 and the adapter of layer 2.
  for (auto* b : {&ref, &got}) {
    auto& e = b == &ref ? er : eg;
    zero::GatheredParameters g(e, {b->layers[1]->weight, b->layers[2]->lora_a}, /*modifier_rank=*/0);
    EXPECT_EQ(b->layers[1]->weight.sizes(), (std::vector<int64_t>{kDim, kDim}));
    torch::NoGradGuard no_grad;
    b->layers[1]->weight.mul_(0.5);
    b->layers[2]->lora_a.add_(0.25);
    g.done();
  }
  EXPECT_EQ(got.layers[1]->weight.numel(), 0) << "released after the scope";
  expect_same_bits(train(eg, got, 2, 4), train(er, ref, 2, 4), "after the change");
  EXPECT_THROW(zero::GatheredParameters(eg, {torch::ones({2})}), zero::UsageError);
}

// A checkpoint moves between stages with its frozen parameters, a tied one
// too (saved under one name at stage 3, under each below it).
TEST(Frozen, CheckpointsMoveBetweenStagesWithATiedFrozenParameter) {
  const std::string dir = std::filesystem::temp_directory_path().string() + "/zero_frozen_stages_" + std::to_string(::getpid());
  auto tied = [](uint64_t seed) {
    auto b = build(nullptr, seed);
    b.net->register_parameter("tied", b.layers[0]->weight, /*requires_grad=*/false);  // a second name
    return b;
  };
  for (const auto& [from, to] : std::vector<std::pair<int, int>>{{3, 2}, {2, 3}}) {
    SCOPED_TRACE(std::to_string(from) + " -> " + std::to_string(to));
    std::filesystem::remove_all(dir);
    const auto want = [&] {
      auto b = tied(3);
      auto e = zero::initialize(b.net.ptr(), config(from), quiet());
      return train(e, b, 0, 6);
    }();
    {
      auto b = tied(3);
      auto e = zero::initialize(b.net.ptr(), config(from), quiet());
      train(e, b, 0, 3);
      e.save_checkpoint(dir, "t");
    }
    auto b = tied(77);  // other values everywhere: the checkpoint brings them, the base too
    auto e = zero::initialize(b.net.ptr(), config(to), quiet());
    e.load_checkpoint(dir, "t");
    const auto got = train(e, b, 3, 6);
    for (size_t i = 0; i < got.losses.size(); ++i) EXPECT_EQ(got.losses[i], want.losses[i + 3]) << "step " << i + 3;
    for (size_t i = 0; i < want.values.size(); ++i) EXPECT_TRUE(torch::equal(got.values[i], want.values[i])) << i;
  }
  std::filesystem::remove_all(dir);
}

// A modifier that changes one parameter leaves the master of the others
// in its group as it was (bf16: not rounded to the compute copy).
TEST(FineTuningApi, GatheredParametersChangeOnlyTheParametersGiven) {
  for (const int stage : {2, 3}) {
    SCOPED_TRACE(stage);
    auto b = build(nullptr);
    auto e = zero::initialize(b.net.ptr(), config(stage, "none", R"(, "bf16": {"enabled": true})"), quiet());
    train(e, b, 0, 2);
    const auto before = zero::detail::optimizer_states_of(e);
    {
      zero::GatheredParameters g(e, {b.layers[2]->lora_a}, /*modifier_rank=*/0);  // and left as it is
    }
    const auto after = zero::detail::optimizer_states_of(e);
    ASSERT_EQ(before.size(), after.size());
    for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], after[i])) << i;
    {
      zero::GatheredParameters g(e, {b.layers[2]->lora_a}, 0);
      torch::NoGradGuard no_grad;
      b.layers[2]->lora_a.fill_(0.5);
    }
    zero::GatheredParameters read(e, {b.layers[2]->lora_a});
    EXPECT_TRUE(torch::all(b.layers[2]->lora_a == 0.5).item<bool>());
    EXPECT_THROW(e.backward(loss_of(b.net, 9)), zero::UsageError) << "inside a scope";
  }
}

}  // namespace
