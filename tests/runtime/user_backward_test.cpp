// The user's own training code through the engine, on one process: their
// own backward (NOTE [user backward]: loss.backward() and
// engine.scale(loss).backward() instead of engine.backward(loss), a loss over
// two engines, a non-scalar backward, and the mistakes the engine names), and
// the conveniences it calls (the checkpointer, the batch check).
#include <gtest/gtest.h>

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "tiny_gpt.h"
#include "zero/core/error.h"
#include "zero/zero.h"

namespace {

using zero::test::config_json;
using zero::test::quiet;

}  // namespace

namespace {

// NOTE [user backward]: two engines in one backward (a loss over both
// models) and a non-scalar backward with its gradient give the bits of
// engine.backward; the ways are not mixed within a window or repeated in
// a micro-step.
torch::nn::Sequential mlp(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
}

std::string usage_error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const zero::UsageError& e) {
    return e.what();
  } catch (const c10::Error& e) {  // autograd may pass on what a hook threw as its own error
    return e.what();
  }
  return "";
}

// One loss over two engines, in every way it reaches them (NOTE [user
// backward]): engine a's backward feeding b's parameters, engine.scale's
// backward (fp16), over an accumulation of 2, equal each engine's own
// backward of its part.
TEST(UserBackward, OneLossOverTwoEnginesWithAccumulationAndFp16) {
  for (const char* precision : {"", R"(, "fp16": {"enabled": true, "initial_scale_power": 8})"}) {
    for (const char* way : {"a_backward", "scale_backward"}) {
      if (std::string(way) == "scale_backward" && std::string(precision).empty()) continue;
      auto run = [&](bool joint) {
        torch::manual_seed(1);
        auto a = torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
        torch::manual_seed(2);
        auto b = torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
        const std::string cfg = config_json(std::string(precision) + R"(, "zero_optimization": {"stage": 2})", 4, 2);
        auto ea = zero::initialize(a.ptr(), cfg, quiet());
        auto eb = zero::initialize(b.ptr(), cfg, quiet());
        const auto dtype = ea.compute_dtype();
        for (int s = 0; s < 6; ++s) {
          auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + s);
          const auto x = torch::randn({4, 8}, gen).to(dtype);
          const auto la = a->forward(x).to(torch::kFloat).pow(2).mean();
          const auto lb = b->forward(x).to(torch::kFloat).abs().mean();
          if (!joint) {
            ea.backward(la);
            eb.backward(lb);
          } else if (std::string(way) == "a_backward") {
            ea.backward(la + lb);
          } else {
            ea.scale(la + lb).backward();
          }
          ea.step();
          eb.step();
        }
        return std::vector<double>{ea.parameter_l2(), eb.parameter_l2()};
      };
      if (std::string(way) == "a_backward") {
        EXPECT_EQ(run(true), run(false)) << way << precision;
      } else {  // the plain engine.backward of each is the reference for the scaled pass too
        EXPECT_EQ(run(true), run(false)) << way << precision;
      }
    }
  }
}

// A model checkpointed whole: its last parameters' gradients come inside the
// recompute's nested backward, and the engine's backward still ends with the
// outer pass (checkpointing::queue_when_backward_ends).
TEST(UserBackward, EndsWithTheOuterPassThroughACheckpoint) {
  auto run = [](bool plain) {
    auto a = mlp(1);
    auto e = zero::initialize(a.ptr(), config_json(R"(, "zero_optimization": {"stage": 1})", 4, 2), quiet());
    for (int s = 0; s < 4; ++s) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(400 + s);
      const auto x = torch::randn({4, 8}, gen).requires_grad_(true);
      auto loss = zero::checkpointing::checkpoint(
          zero::checkpointing::UnaryFunction([&](const torch::Tensor& t) { return a->forward(t); }), x).pow(2).mean();
      if (plain) loss.backward();
      else e.backward(loss);
      e.step();
    }
    return e.parameter_l2();
  };
  EXPECT_EQ(run(true), run(false));
}

// A backward that fails half-way (a hook throws after some gradients came)
// leaves nothing half-done: the next step says so and discards the window,
// and training goes on as from a clean start.
TEST(UserBackward, AFailedBackwardIsDiscardedAndSaid) {
  auto train = [](bool fail_first) {
    auto a = mlp(1);
    auto e = zero::initialize(a.ptr(), config_json("", 4), quiet());
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    const auto x = torch::randn({4, 8}, gen);
    if (fail_first) {
      auto h = a[0]->as<torch::nn::Linear>()->forward(x);
      h.register_hook([](torch::Tensor) -> torch::Tensor { throw std::runtime_error("a hook failed"); });
      auto out = a[2]->as<torch::nn::Linear>()->forward(torch::tanh(h));
      EXPECT_ANY_THROW(out.pow(2).mean().backward());
      const std::string m = usage_error_of([&] { e.step(); });
      EXPECT_NE(m.find("ended in an error before it finished"), std::string::npos) << m;
    }
    a->forward(x).pow(2).mean().backward();
    e.step();
    return e.parameter_l2();
  };
  EXPECT_EQ(train(true), train(false));
}

TEST(UserBackward, TwoEnginesInOneBackwardAndANonScalarBackward) {
  for (const char* stage : {R"(, "zero_optimization": {"stage": 2})",
                            R"(, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0})"}) {
    auto run = [&](bool user) {
      auto a = mlp(1), b = mlp(2);
      auto ea = zero::initialize(a.ptr(), config_json(stage, 4), quiet());
      auto eb = zero::initialize(b.ptr(), config_json(stage, 4), quiet());
      for (int s = 0; s < 3; ++s) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + s);
        const auto x = torch::randn({4, 8}, gen), g = torch::randn({4, 4}, gen);
        const auto la = a->forward(x).pow(2).mean();
        const auto out = b->forward(x);
        if (user) {
          la.backward();             // engine a's alone...
          out.backward(g);           // ...then engine b's, non-scalar
        } else {
          ea.backward(la);
          eb.backward((out * g).sum());
        }
        ea.step();
        eb.step();
      }
      return std::vector<double>{ea.parameter_l2(), eb.parameter_l2()};
    };
    EXPECT_EQ(run(true), run(false)) << stage;

    // One loss over two models: one backward feeds both engines.
    auto joint = [&](bool user) {
      auto a = mlp(1), b = mlp(2);
      auto ea = zero::initialize(a.ptr(), config_json(stage, 4), quiet());
      auto eb = zero::initialize(b.ptr(), config_json(stage, 4), quiet());
      for (int s = 0; s < 3; ++s) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(200 + s);
        const auto x = torch::randn({4, 8}, gen);
        if (user) {
          (a->forward(x).pow(2).mean() + b->forward(x).abs().mean()).backward();
        } else {
          ea.backward(a->forward(x).pow(2).mean());
          eb.backward(b->forward(x).abs().mean());
        }
        ea.step();
        eb.step();
      }
      return std::vector<double>{ea.parameter_l2(), eb.parameter_l2()};
    };
    EXPECT_EQ(joint(true), joint(false)) << stage;
  }
}

TEST(UserBackward, OneWayPerWindowAndOneBackwardPerMicroStep) {
  auto a = mlp(1);
  auto e = zero::initialize(a.ptr(), config_json("", 4, 2), quiet());
  const auto x = torch::randn({4, 8});
  e.backward(a->forward(x).sum());
  e.step();
  std::string m = usage_error_of([&] { a->forward(x).sum().backward(); });
  EXPECT_NE(m.find("one way per window"), std::string::npos) << m;
  e.step();  // ends the window (its gradients are the engine.backward's)
  a->forward(x).sum().backward();
  m = usage_error_of([&] { a->forward(x).sum().backward(); });
  EXPECT_NE(m.find("a second backward in one micro-step"), std::string::npos) << m;
}

}  // namespace

namespace {

// A module reaches its engine's checkpointer without a pointer to it
// (zero::checkpointing::checkpoint and current(), as DeepSpeed's
// deepspeed.checkpointing); the batch fed is checked against the config.
TEST(Conveniences, CheckpointerFromTheModelsCodeAndTheBatchChecked) {
  EXPECT_EQ(zero::checkpointing::current(), nullptr);
  {
    auto a = mlp(1);
    auto opts = quiet();
    opts.tokens_per_sample = 8;
    auto e = zero::initialize(a.ptr(), config_json(R"(, "activation_checkpointing": {"cpu_checkpointing": true})", 4), opts);
    EXPECT_EQ(zero::checkpointing::current(), &e.checkpointer());
    // Through the engine's checkpointer: its cpu_checkpointing keeps the
    // input in host memory, which the engine's ledger counts.
    const auto x = torch::randn({4, 8}, torch::requires_grad());
    auto checkpointed = zero::checkpointing::checkpoint(
        zero::checkpointing::UnaryFunction([&](const torch::Tensor& t) { return a->forward(t); }), x).pow(2).sum();
    EXPECT_TRUE(torch::equal(a->forward(x).pow(2).sum(), checkpointed));
    EXPECT_GT(e.ledger().get(zero::Tier::kHost, zero::Kind::kActivations).peak_bytes +
                  e.ledger().get(zero::Tier::kPinnedHost, zero::Kind::kActivations).peak_bytes,
              0)
        << "the free checkpoint() did not go through the engine's checkpointer";
    e.backward(checkpointed);
    e.step();
    e.check_batch(torch::zeros({4, 8}, torch::kLong));
    std::string m = usage_error_of([&] { e.check_batch(torch::zeros({3, 8}, torch::kLong)); });
    EXPECT_NE(m.find("the batch fed has shape [3, 8]; <string> says train_micro_batch_size_per_gpu 4"), std::string::npos)
        << m;
    m = usage_error_of([&] { e.check_batch(torch::zeros({4, 9}, torch::kLong)); });
    EXPECT_NE(m.find("InitOptions::tokens_per_sample says 8"), std::string::npos) << m;
    // One process: the mean is a copy; an integer tensor is refused, not truncated.
    const auto loss = torch::tensor({2.5}, torch::requires_grad());
    const auto mean = e.all_reduce_mean(loss);
    EXPECT_TRUE(torch::equal(mean, loss.detach()));
    EXPECT_FALSE(mean.requires_grad());
    m = usage_error_of([&] { e.all_reduce_mean(torch::ones({2}, torch::kLong)); });
    EXPECT_NE(m.find("a mean needs a floating-point tensor; got Long"), std::string::npos) << m;
  }
  EXPECT_EQ(zero::checkpointing::current(), nullptr) << "the engine is gone";
}

}  // namespace
