// offload_optimizer.super_offload (NOTE [speculative step]): the CPU step
// begins during the boundary backward and is validated at step(). Each run
// here must equal the same run without it, bit for bit (the master and every
// optimizer state, each loss and gradient norm), while the speculation
// counts show which path it took: accepted, clipped and redone, or undone
// (an fp16 overflow, a failed backward, gradients zeroed before the step).
// One process; copies held back until waited for (CopyMode::kDeferred), so
// a missing wait computes wrong values here.
#include <gtest/gtest.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/nn/functional/loss.h>

#include "data.h"
#include "model.h"
#include "zero/runtime/engine_internal.h"
#include "zero/zero.h"

namespace {

struct Trained {
  std::vector<torch::Tensor> states;  // master and states, sub-group by sub-group
  std::vector<double> losses, norms;
  zero::detail::SpeculationCounts counts;
  int64_t skipped = 0;
  int64_t undo_bytes = 0;  // the ledger's pageable host optimizer states: the undo copy
};

struct Options {
  std::string precision;     // top-level keys, each followed by a comma
  double clip = 0.0;
  int gas = 1;
  int steps = 4;
  std::string optimizer_params = R"("lr": 0.003)";
  int throw_at = -1;         // this micro-step's first backward throws from the embedding's gradient hook
  int zero_grad_at = -1;     // this boundary micro-step's gradients are zeroed and its backward runs again
  bool user_backward = false;  // loss.backward() in place of engine.backward(loss)
};

Trained train(bool super_offload, const Options& o) {
  mingpt::GPTConfig g;
  g.vocab_size = 10;
  g.block_size = 6;
  g.n_layer = 3;
  g.n_head = 2;
  g.n_embd = 32;
  torch::manual_seed(11);
  mingpt::GPT model(g);
  zero::InitOptions io;
  io.print_progress = false;
  io.device = torch::Device(torch::kCPU);
  io.cpu_copy_mode = zero::CopyMode::kDeferred;
  const std::string config =
      R"({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": )" + std::to_string(o.gas) +
      R"(, "gradient_clipping": )" + std::to_string(o.clip) + R"(, "optimizer": {"type": "AdamW", "params": {)" +
      o.optimizer_params + "}}, " + o.precision +
      R"( "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 1500,)"
      R"( "reduce_bucket_size": 3000, "offload_optimizer": {"device": "cpu", "super_offload": )" +
      (super_offload ? "true" : "false") + "}}}";
  auto engine = zero::initialize(model.ptr(), config, io);
  bool throw_now = false;
  auto& emb = model->named_parameters()["tok_emb.weight"];
  emb.register_hook([&throw_now](torch::Tensor grad) {
    if (throw_now) throw std::runtime_error("the test's failing backward");
    return grad;
  });
  auto task = mingpt::make_addition_task(2);
  Trained r;
  const int micro = o.steps * o.gas;
  for (int s = 0; s < micro; ++s) {
    auto b = task->train_batch({8 * s, 8 * s + 1, 8 * s + 2, 8 * s + 3, 8 * s + 4, 8 * s + 5, 8 * s + 6, 8 * s + 7});
    auto loss_of = [&] {
      auto logits = model->forward(b.x);
      return torch::nn::functional::cross_entropy(logits.to(torch::kFloat).view({-1, logits.size(-1)}),
                                                  b.y.view({-1}),
                                                  torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1));
    };
    auto backward = [&](const torch::Tensor& loss) {
      if (o.user_backward) engine.scale(loss).backward();
      else engine.backward(loss);
    };
    if (s == o.throw_at) {
      throw_now = true;
      EXPECT_THROW(backward(loss_of()), std::exception);
      throw_now = false;
    }
    if (s == o.zero_grad_at) {
      backward(loss_of());
      engine.zero_grad();
    }
    auto loss = loss_of();
    backward(loss);
    engine.step();
    r.losses.push_back(loss.item<double>());
    if (engine.is_gradient_accumulation_boundary() || o.gas == 1) r.norms.push_back(engine.last_grad_norm());
  }
  EXPECT_EQ(engine.global_steps(), o.steps);
  r.states = zero::detail::optimizer_states_of(engine);
  r.counts = zero::detail::speculation_counts(engine);
  r.skipped = engine.skipped_steps();
  // The store's states are pinned (pin_memory); only the undo copy is pageable.
  r.undo_bytes = engine.ledger().get(zero::Tier::kHost, zero::Kind::kOptimizerStates).current_bytes;
  return r;
}

void expect_same_bits(const Trained& plain, const Trained& spec) {
  ASSERT_EQ(spec.states.size(), plain.states.size());
  for (size_t i = 0; i < plain.states.size(); ++i)
    EXPECT_TRUE(torch::equal(spec.states[i], plain.states[i])) << "state tensor " << i;
  EXPECT_EQ(spec.losses, plain.losses);
  // Bit for bit: a skipped step's norm is not finite, and NaN != NaN.
  ASSERT_EQ(spec.norms.size(), plain.norms.size());
  EXPECT_EQ(std::memcmp(spec.norms.data(), plain.norms.data(), plain.norms.size() * sizeof(double)), 0)
      << "the gradient norms differ";
  EXPECT_EQ(spec.skipped, plain.skipped);
  EXPECT_EQ(plain.counts.planned, 0);
  EXPECT_EQ(plain.undo_bytes, 0);
}

TEST(SuperOffload, UnclippedStepsAreAcceptedAsSpeculated) {
  Options o;
  const Trained plain = train(false, o), spec = train(true, o);
  expect_same_bits(plain, spec);
  EXPECT_EQ(spec.counts.planned, 4);
  EXPECT_EQ(spec.counts.validated, 4);
  EXPECT_EQ(spec.counts.redone + spec.counts.undone, 0);
  // The undo copy: fp32 master and two fp32 moments, 12 bytes a parameter (and alignment).
  int64_t state_bytes = 0;
  for (const auto& t : spec.states) state_bytes += t.numel() * static_cast<int64_t>(t.element_size());
  EXPECT_GE(spec.undo_bytes, state_bytes);
  EXPECT_LE(spec.undo_bytes, state_bytes + 64 * static_cast<int64_t>(spec.states.size()));
}

TEST(SuperOffload, ForcedClipsAreUndoneAndRedone) {
  Options o;
  o.clip = 1e-4;  // every step clips
  o.precision = R"("bf16": {"enabled": true},)";
  const Trained plain = train(false, o), spec = train(true, o);
  expect_same_bits(plain, spec);
  EXPECT_EQ(spec.counts.redone, 4);
  EXPECT_EQ(spec.counts.validated, 0);
}

TEST(SuperOffload, ForcedOverflowsAreUndoneAndSkipped) {
  Options o;
  o.steps = 8;
  // 2^18 times the loss overflows fp16's gradients for the first steps.
  o.precision = R"("fp16": {"enabled": true, "initial_scale_power": 18, "hysteresis": 1},)";
  o.clip = 1.0;
  const Trained plain = train(false, o), spec = train(true, o);
  expect_same_bits(plain, spec);
  EXPECT_GE(spec.skipped, 1);
  EXPECT_EQ(spec.counts.undone, spec.skipped);
  EXPECT_EQ(spec.counts.validated + spec.counts.redone, 8 - spec.skipped);
  EXPECT_GE(spec.counts.validated + spec.counts.redone, 1);
}

TEST(SuperOffload, GradientAccumulationSpeculatesAtTheBoundaryOnly) {
  Options o;
  o.gas = 3;
  o.clip = 1.0;
  const Trained plain = train(false, o), spec = train(true, o);
  expect_same_bits(plain, spec);
  EXPECT_EQ(spec.counts.planned, 4);
  EXPECT_EQ(spec.counts.validated + spec.counts.redone, 4);
}

TEST(SuperOffload, Bf16MasterAndEightBitStatesAreRestoredExactly) {
  for (const std::string& params : {std::string(R"("lr": 0.003, "optim_bits": 8, "min_8bit_size": 4096)"),
                                    std::string(R"("lr": 0.003)")}) {
    SCOPED_TRACE(params);
    Options o;
    o.optimizer_params = params;
    o.precision = R"("bf16": {"enabled": true, "bf16_master_weights_and_grads": true},)";
    o.clip = 0.05;  // some steps clip, some do not
    o.steps = 5;
    const Trained plain = train(false, o), spec = train(true, o);
    expect_same_bits(plain, spec);
    EXPECT_EQ(spec.counts.validated + spec.counts.redone, 5);
  }
}

TEST(SuperOffload, AFailedBackwardAfterSpeculatedGroupsIsUndone) {
  Options o;
  o.throw_at = 2;  // the embedding's gradient, backward's last, throws: later layers already stepped
  const Trained plain = train(false, o), spec = train(true, o);
  expect_same_bits(plain, spec);
  EXPECT_EQ(spec.counts.undone, 1);
  EXPECT_EQ(spec.counts.planned, 5);
  EXPECT_EQ(spec.counts.validated, 4);
}

TEST(SuperOffload, GradientsZeroedBeforeTheStepUndoTheSpeculation) {
  Options o;
  o.zero_grad_at = 1;
  const Trained plain = train(false, o), spec = train(true, o);
  expect_same_bits(plain, spec);
  EXPECT_EQ(spec.counts.undone, 1);
  EXPECT_EQ(spec.counts.validated, 4);
}

TEST(SuperOffload, ABackwardTheProgramStartsStepsAfterIt) {
  Options o;
  o.user_backward = true;
  o.clip = 1.0;
  const Trained plain = train(false, o), spec = train(true, o);
  expect_same_bits(plain, spec);
  EXPECT_EQ(spec.counts.planned, 0);  // no planned step: nothing speculated
}

}  // namespace
