// The flat optimizers against LibTorch's own, at sizes that hit every tail.
#include <gtest/gtest.h>

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include "zero/optim/flat_optimizer.h"

namespace {

using zero::config::OptimizerConfig;
using zero::config::OptimizerType;

struct Case {
  OptimizerType type;
  bool adam_w_mode;
  double weight_decay;
  int64_t numel;
};

std::string case_name(const Case& c) {
  std::string t = c.type == OptimizerType::kAdamW ? "AdamW" : c.type == OptimizerType::kAdam ? "Adam" : "Adagrad";
  return t + (c.adam_w_mode ? "_wmode" : "_l2") + "_wd" + std::to_string(static_cast<int>(c.weight_decay * 100)) +
         "_n" + std::to_string(c.numel);
}

class FlatOptimizerVsTorch : public ::testing::TestWithParam<Case> {};

TEST_P(FlatOptimizerVsTorch, MatchesOverManySteps) {
  const Case c = GetParam();
  OptimizerConfig cfg;
  cfg.type = c.type;
  cfg.adam_w_mode = c.adam_w_mode;
  cfg.lr = 1e-2;
  cfg.betas = {0.9, 0.99};
  cfg.eps = 1e-8;
  cfg.weight_decay = c.weight_decay;
  auto ours = zero::optim::FlatOptimizer::create(cfg);

  torch::manual_seed(c.numel);
  auto init = torch::randn({c.numel});
  auto ref = init.clone().requires_grad_(true);
  std::unique_ptr<torch::optim::Optimizer> torch_opt;
  const bool decoupled = c.type == OptimizerType::kAdamW || (c.type == OptimizerType::kAdam && c.adam_w_mode);
  if (c.type == OptimizerType::kAdagrad) {
    torch_opt = std::make_unique<torch::optim::Adagrad>(
        std::vector<torch::Tensor>{ref},
        torch::optim::AdagradOptions(cfg.lr).eps(cfg.eps).weight_decay(cfg.weight_decay));
  } else if (decoupled) {
    torch_opt = std::make_unique<torch::optim::AdamW>(
        std::vector<torch::Tensor>{ref},
        torch::optim::AdamWOptions(cfg.lr).betas({0.9, 0.99}).eps(cfg.eps).weight_decay(cfg.weight_decay));
  } else {
    torch_opt = std::make_unique<torch::optim::Adam>(
        std::vector<torch::Tensor>{ref},
        torch::optim::AdamOptions(cfg.lr).betas({0.9, 0.99}).eps(cfg.eps).weight_decay(cfg.weight_decay));
  }

  auto param = init.clone();
  std::vector<torch::Tensor> states;
  for (int i = 0; i < ours->num_states(); ++i) states.push_back(torch::zeros({c.numel}));
  for (int64_t step = 1; step <= 25; ++step) {
    auto grad = torch::randn({c.numel});
    ref.mutable_grad() = grad.clone();
    torch_opt->step();
    zero::optim::StepParams p;
    p.step = step;
    p.lr = cfg.lr;
    p.beta1 = cfg.betas[0];
    p.beta2 = cfg.betas[1];
    ours->update(p, param, grad, states);
  }
  // 1e-6 relative, element by element, with values below 1 compared on the
  // absolute scale (a value that crossed zero keeps the rounding of its
  // earlier magnitude), and on the whole vector by norm.
  auto expected = ref.detach();
  const auto diff = (param - expected).abs();
  const double elementwise = (diff / expected.abs().clamp_min(1.0)).max().item<double>();
  const double by_norm = (diff.norm() / expected.norm()).item<double>();
  EXPECT_LT(elementwise, 1e-6) << case_name(c) << ": max |diff| " << diff.max().item<double>();
  EXPECT_LT(by_norm, 1e-6) << case_name(c);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (int64_t n : {1, 15, 17, 22, 1048576 + 7}) {
    out.push_back({OptimizerType::kAdamW, true, 0.01, n});
    out.push_back({OptimizerType::kAdam, false, 0.01, n});
    out.push_back({OptimizerType::kAdam, true, 0.0, n});
    out.push_back({OptimizerType::kAdagrad, false, 0.01, n});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Sizes, FlatOptimizerVsTorch, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return case_name(info.param); });

TEST(FlatOptimizer, AdamWithoutBiasCorrectionUsesRawMoments) {
  OptimizerConfig cfg;
  cfg.type = OptimizerType::kAdamW;
  cfg.bias_correction = false;
  cfg.lr = 0.1;
  cfg.betas = {0.5, 0.75};
  cfg.eps = 0.0;
  auto opt = zero::optim::FlatOptimizer::create(cfg);
  auto param = torch::zeros({1});
  std::vector<torch::Tensor> states{torch::zeros({1}), torch::zeros({1})};
  opt->update({1, 0.1, 0.5, 0.75}, param, torch::full({1}, 2.0f), states);
  // m = 0.5*2 = 1, v = 0.25*4 = 1 -> p = -0.1 * 1/1
  EXPECT_NEAR(param.item<double>(), -0.1, 1e-7);
}

TEST(FlatOptimizer, LionStepsBySignOfInterpolatedMomentum) {
  OptimizerConfig cfg;
  cfg.type = OptimizerType::kLion;
  cfg.lr = 0.01;
  cfg.betas = {0.9, 0.99};
  auto opt = zero::optim::FlatOptimizer::create(cfg);
  auto param = torch::tensor({1.0f, 1.0f});
  std::vector<torch::Tensor> states{torch::tensor({1.0f, -1.0f})};
  opt->update({1, 0.01, 0.9, 0.99}, param, torch::tensor({-100.0f, 0.5f}), states);
  // c = 0.9*m + 0.1*g = {-9.1, -0.85} -> sign {-1, -1}; p = 1 + 0.01
  EXPECT_NEAR(param[0].item<double>(), 1.01, 1e-7);
  EXPECT_NEAR(param[1].item<double>(), 1.01, 1e-7);
  EXPECT_NEAR(states[0][0].item<double>(), 0.99 * 1 + 0.01 * -100, 1e-5);
}

}  // namespace
