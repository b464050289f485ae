// Stage-3 layers know their engine through a mark on the module, not a
// process-wide table (NOTE [stage-3 layers]): one live engine per model, the
// mark gone with its engine, and a graph that outlives its engine fails its
// backward with a UsageError instead of calling into freed memory.
#include <gtest/gtest.h>

#include <torch/nn/functional/loss.h>
#include <torch/utils.h>

#include "data.h"
#include "tiny_gpt.h"
#include "zero/zero.h"

namespace {

mingpt::GPT tiny(uint64_t seed) {
  torch::manual_seed(seed);
  return mingpt::GPT(zero::test::tiny_gpt_config());
}

zero::InitOptions quiet(mingpt::GPT* layers_of = nullptr) {
  zero::InitOptions o;
  o.print_progress = false;
  o.device = torch::Device(torch::kCPU);
  if (layers_of != nullptr) o.layers = (*layers_of)->stage3_layers();  // the layers outside the ModuleList
  return o;
}

const char* kStage3 = R"({"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
                          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})";

torch::Tensor loss_of(mingpt::GPT& model) {
  auto task = mingpt::make_addition_task(2);
  auto b = task->train_batch({0, 1, 2, 3});
  auto logits = model->forward(b.x);
  return torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}), b.y.view({-1}),
                                              torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1));
}

bool marked(const torch::nn::Module& m) { return m.named_children().find("_zero_stage3_layer") != nullptr; }

TEST(Stage3Layers, OneLiveEnginePerModelAndTheMarkGoesWithItsEngine) {
  auto model = tiny(1);
  const auto layers = model->stage3_layers();
  ASSERT_FALSE(layers.empty());
  {
    auto engine = zero::initialize(model.ptr(), kStage3, quiet(&model));
    for (const auto& l : layers) EXPECT_TRUE(zero::is_layer(*l));
    try {
      auto second = zero::initialize(model.ptr(), kStage3, quiet(&model));
      FAIL() << "expected a UsageError";
    } catch (const zero::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("another live engine"), std::string::npos) << e.what();
    }
    for (const auto& l : layers) EXPECT_TRUE(zero::is_layer(*l)) << "the refused engine took the first one's marks";
  }
  for (const auto& l : layers) {
    EXPECT_FALSE(zero::is_layer(*l));
    EXPECT_FALSE(marked(*l)) << "the model keeps a mark of a destroyed engine";
  }
}

TEST(Stage3Layers, TwoModelsTrainSideBySideInOneProcess) {
  auto a = tiny(1), b = tiny(1);
  auto ea = zero::initialize(a.ptr(), kStage3, quiet());
  auto eb = zero::initialize(b.ptr(), kStage3, quiet());
  for (int s = 0; s < 3; ++s) {
    ea.backward(loss_of(a));
    eb.backward(loss_of(b));
    ea.step();
    eb.step();
  }
  EXPECT_EQ(ea.parameter_l2(), eb.parameter_l2()) << "the same model and data through two engines";
}

TEST(Stage3Layers, BackwardAfterTheEngineIsGoneIsAUsageError) {
  auto model = tiny(2);
  torch::Tensor loss;
  {
    auto engine = zero::initialize(model.ptr(), kStage3, quiet());
    loss = loss_of(model);
  }
  try {
    loss.backward();
    FAIL() << "expected a UsageError";
  } catch (const zero::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("engine is gone"), std::string::npos) << e.what();
  } catch (const c10::Error& e) {  // autograd may wrap what a node throws
    EXPECT_NE(std::string(e.what()).find("engine is gone"), std::string::npos) << e.what();
  }
}

}  // namespace

namespace {

// zero::Init and the engine apply one persistence rule (NOTE [stage-3
// plan]): with stage3_model_persistence_threshold capping the whole
// parameters, a model built under Init trains to the same bits as the same
// model built whole (before, Init kept every small parameter whole and the
// engine then found layers mixing shards and whole parameters).
TEST(Stage3Layers, InitAndWholeBuiltModelsFollowTheSamePersistenceRule) {
  const std::string config =
      R"({"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100,
                                "stage3_model_persistence_threshold": 150}})";
  mingpt::GPTConfig c;
  c.vocab_size = 10;
  c.block_size = 6;
  c.n_layer = 3;
  c.n_head = 2;
  c.n_embd = 32;
  c.embd_pdrop = c.resid_pdrop = c.attn_pdrop = 0.0;
  auto train = [&](bool under_init) {
    auto o = quiet();
    std::unique_ptr<zero::Init> init;
    if (under_init) init = std::make_unique<zero::Init>(config, o);
    torch::manual_seed(4);
    mingpt::GPT model(c, init.get());
    auto engine = init ? zero::initialize(model.ptr(), *init, model->stage3_layers())
                       : [&] {
                           o.layers = model->stage3_layers();
                           return zero::initialize(model.ptr(), config, o);
                         }();
    for (int s = 0; s < 3; ++s) {
      engine.backward(loss_of(model));
      engine.step();
    }
    return engine.parameter_l2();
  };
  const double whole = train(false);
  double built = 0;
  ASSERT_NO_THROW(built = train(true));
  EXPECT_EQ(built, whole);
}



// NOTE [ungathered use]: a model whose forward calls its layers directly (no
// zero::forward) uses their parameters empty. LibTorch's error names shapes
// only; the engine names the parameter, its layer, the operator and the fix
// first. A model that goes through zero::forward hears nothing of it.
struct DirectImpl : torch::nn::Module {
  DirectImpl() {
    blocks = register_module("blocks", torch::nn::ModuleList(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (const auto& b : *blocks) x = b->as<torch::nn::Linear>()->forward(x);  // the mistake: no zero::forward
    return x;
  }
  torch::nn::ModuleList blocks{nullptr};
};

TEST(Stage3Layers, ALayerCalledWithoutZeroForwardIsNamed) {
  torch::manual_seed(0);
  auto model = std::make_shared<DirectImpl>();
  auto engine = zero::initialize(model, kStage3, quiet());
  testing::internal::CaptureStderr();
  EXPECT_ANY_THROW(model->forward(torch::randn({4, 8})));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("parameter blocks.0.weight of layer blocks.0 is used by aten::"), std::string::npos) << err;
  EXPECT_NE(err.find("while the layer is not gathered"), std::string::npos) << err;
  EXPECT_NE(err.find("zero::forward(layer, inputs...)"), std::string::npos) << err;

  auto good = tiny(1);
  testing::internal::CaptureStderr();
  auto e2 = zero::initialize(good.ptr(), kStage3, quiet(&good));
  for (int s = 0; s < 2; ++s) {
    e2.backward(loss_of(good));
    e2.step();
  }
  const std::string quiet_err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(quiet_err.find("not gathered"), std::string::npos) << quiet_err;
}

}  // namespace
