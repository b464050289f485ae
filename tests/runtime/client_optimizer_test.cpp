// NOTE [client optimizer]: a config with no optimizer section trains with
// the program's torch::optim optimizer, which gives zero's flat optimizer
// its type, options and parameter groups: equal, bit for bit, to the same
// optimizer written as a config section (and to its ParamGroups); what zero
// cannot take is refused, naming it; a config's own section wins, with a
// warning. And ZERO_STOP_AFTER_STEPS in a program that does not end itself
// (NOTE [run report]): the engine ends it, saying so, and leaves no writer
// lock or empty folder behind.
#include <gtest/gtest.h>

#include <unistd.h>

#include <torch/nn/functional/loss.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "data.h"
#include "tiny_gpt.h"
#include "zero/core/error.h"
#include "zero/snapshots/checkpoint_format.h"
#include "zero/zero.h"

namespace {

mingpt::GPT make_model() {
  torch::manual_seed(11);
  return mingpt::GPT(zero::test::tiny_gpt_config());
}

zero::InitOptions quiet() {
  zero::InitOptions o;
  o.print_progress = false;
  o.device = torch::Device(torch::kCPU);
  return o;
}

// Three steps of the addition task; the parameters after them.
std::vector<torch::Tensor> train(mingpt::GPT& model, zero::Engine& engine) {
  auto task = mingpt::make_addition_task(2);
  auto order = mingpt::epoch_order(task->train_size(), 1, 0);
  for (int s = 0; s < 3; ++s) {
    auto b = task->train_batch(mingpt::micro_batch_indices(order, s, 0, 0, 16, 1, 1));
    auto logits = model->forward(b.x);
    engine.backward(torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}), b.y.view({-1}),
                                                         torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1)));
    engine.step();
  }
  std::vector<torch::Tensor> out;
  for (auto& p : model->parameters()) out.push_back(p.detach().clone());
  return out;
}

void expect_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i;
}

const std::string kNoOptimizer = R"({"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 2}})";

std::string with_section(const std::string& section) {
  return R"({"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 2}, "optimizer": )" + section + "}";
}

std::vector<torch::Tensor> with_config(const std::string& section, std::vector<zero::ParamGroup> groups = {}) {
  auto model = make_model();
  auto o = quiet();
  o.param_groups = std::move(groups);
  auto engine = zero::initialize(model.ptr(), with_section(section), o);
  return train(model, engine);
}

template <typename Make>
std::vector<torch::Tensor> with_client(Make make) {
  auto model = make_model();
  auto opt = make(model);
  auto o = quiet();
  o.optimizer = opt.get();
  auto engine = zero::initialize(model.ptr(), kNoOptimizer, o);
  return train(model, engine);
}

TEST(ClientOptimizer, EachTypeEqualsItsConfigSection) {
  expect_equal(with_client([](mingpt::GPT& m) {
                 return std::make_unique<torch::optim::AdamW>(
                     m->parameters(), torch::optim::AdamWOptions(0.003).betas({0.9, 0.95}).eps(1e-7).weight_decay(0.05));
               }),
               with_config(R"({"type": "AdamW", "params": {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-7,
                               "weight_decay": 0.05}})"));
  // torch's Adam adds its weight decay to the gradient: DeepSpeed's Adam
  // with adam_w_mode false.
  expect_equal(with_client([](mingpt::GPT& m) {
                 return std::make_unique<torch::optim::Adam>(m->parameters(),
                                                             torch::optim::AdamOptions(0.002).weight_decay(0.01));
               }),
               with_config(R"({"type": "Adam", "params": {"lr": 0.002, "weight_decay": 0.01, "adam_w_mode": false}})"));
  expect_equal(with_client([](mingpt::GPT& m) {
                 return std::make_unique<torch::optim::Adagrad>(
                     m->parameters(), torch::optim::AdagradOptions(0.01).initial_accumulator_value(0.1));
               }),
               with_config(R"({"type": "Adagrad", "params": {"lr": 0.01, "initial_accumulator_value": 0.1}})"));
}

// The optimizer's parameter groups, each with its lr and weight decay, are
// zero's ParamGroups.
TEST(ClientOptimizer, ParameterGroupsKeepTheirLrAndWeightDecay) {
  auto biases = [](const std::string& name) { return name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0; };
  const auto client = with_client([&](mingpt::GPT& m) {
    std::vector<torch::Tensor> decay, no_decay;
    for (const auto& item : m->named_parameters(true)) (biases(item.key()) ? no_decay : decay).push_back(item.value());
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(0.003).weight_decay(0.1)));
    groups.emplace_back(no_decay,
                        std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(0.001).weight_decay(0.0)));
    return std::make_unique<torch::optim::AdamW>(std::move(groups), torch::optim::AdamWOptions(0.003).weight_decay(0.1));
  });
  zero::ParamGroup g;
  g.name = "biases";
  g.lr = 0.001;
  g.weight_decay = 0.0;
  g.match = [&](const std::string& name, const torch::Tensor&) { return biases(name); };
  expect_equal(client, with_config(R"({"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.1}})", {g}));
}

TEST(ClientOptimizer, WhatZeroCannotTakeIsRefusedNamingIt) {
  auto refused = [](auto make, const std::string& message) {
    auto model = make_model();
    auto opt = make(model);
    auto o = quiet();
    o.optimizer = opt.get();
    try {
      zero::initialize(model.ptr(), kNoOptimizer, o);
      ADD_FAILURE() << "accepted; expected: " << message;
    } catch (const zero::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  };
  refused([](mingpt::GPT& m) { return std::make_unique<torch::optim::SGD>(m->parameters(), torch::optim::SGDOptions(0.1)); },
          "the program's optimizer (InitOptions::optimizer) is torch::optim::SGD; zero's flat optimizers are Adam, AdamW "
          "and Adagrad");
  refused([](mingpt::GPT& m) {
            return std::make_unique<torch::optim::AdamW>(m->parameters(), torch::optim::AdamWOptions(0.1).amsgrad(true));
          },
          "amsgrad is true");
  refused([](mingpt::GPT& m) {
            return std::make_unique<torch::optim::Adagrad>(m->parameters(), torch::optim::AdagradOptions(0.1).lr_decay(0.5));
          },
          "lr_decay is 0.5");
  refused([](mingpt::GPT& m) {
            auto ps = m->parameters();
            ps.pop_back();
            return std::make_unique<torch::optim::AdamW>(ps, torch::optim::AdamWOptions(0.1));
          },
          "are in none of its groups; add them, or freeze them");
  refused([](mingpt::GPT& m) {
            std::vector<torch::optim::OptimizerParamGroup> groups;
            auto ps = m->parameters();
            const auto half = static_cast<std::ptrdiff_t>(ps.size() / 2);
            groups.emplace_back(std::vector<torch::Tensor>(ps.begin(), ps.begin() + half),
                                std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(0.1)));
            groups.emplace_back(std::vector<torch::Tensor>(ps.begin() + half, ps.end()),
                                std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(0.1).betas({0.8, 0.9})));
            return std::make_unique<torch::optim::AdamW>(std::move(groups), torch::optim::AdamWOptions(0.1));
          },
          "parameter group 1: its betas, eps or initial_accumulator_value differ");
  // No section and no optimizer: both ways named.
  auto model = make_model();
  try {
    zero::initialize(model.ptr(), kNoOptimizer, quiet());
    ADD_FAILURE() << "accepted";
  } catch (const zero::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("pass a torch::optim Adam, AdamW or Adagrad as InitOptions::optimizer"),
              std::string::npos)
        << e.what();
  }
}

// A config with its own section keeps it: the program's optimizer is named
// in a warning and not used.
TEST(ClientOptimizer, TheConfigsSectionWinsWithAWarning) {
  const std::string section = R"({"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.05}})";
  auto model = make_model();
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.5));
  auto o = quiet();
  o.optimizer = &sgd;
  testing::internal::CaptureStderr();
  auto engine = zero::initialize(model.ptr(), with_section(section), o);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("optimizer: the config's section (AdamW) is used, not the program's torch::optim::SGD"),
            std::string::npos)
      << err;
  expect_equal(train(model, engine), with_config(section));
}

// NOTE [run report]: a program that does not end itself at the stop is
// ended by the engine, which says so, and takes its checkpoint folder's
// lock (and the folder it made and left empty) along.
TEST(StopAfterSteps, AProgramThatDoesNotStopItselfIsEndedSayingSo) {
  const std::string dir = std::string(ZERO_BINARY_DIR) + "/tests/stop_" + std::to_string(::getpid());
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        ::setenv("ZERO_STOP_AFTER_STEPS", "2", 1);
        auto model = make_model();
        auto engine = zero::initialize(model.ptr(), with_section(R"({"type": "AdamW", "params": {"lr": 0.003}})"), quiet());
        engine.open_checkpoint_dir(dir + "/ck");
        train(model, engine);  // three steps: the engine ends the process after the second
        std::_Exit(7);
      },
      ::testing::ExitedWithCode(0),
      "ZERO_STOP_AFTER_STEPS=2: the run stops after 2 optimizer step\\(s\\) .* the process ends now, without the "
      "program's own end");
  EXPECT_FALSE(zero::ckpt::path_exists(dir + "/ck/.zero-lock"));
  EXPECT_FALSE(zero::ckpt::path_exists(dir + "/ck")) << "the empty folder the run made stayed";
  zero::ckpt::remove_tree(dir);
}

}  // namespace
