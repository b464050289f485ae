// offload_optimizer.super_offload (NOTE [speculative step]): the CPU step
// begins during the boundary backward and is validated at step(). Each run
// here must equal the same run without it, bit for bit (the master and every
// optimizer state, each loss and gradient norm), while the speculation
// counts show which path it took: accepted, clipped and redone, or undone
// (an fp16 overflow, a failed backward, gradients zeroed before the step).
// One process; copies held back until waited for (CopyMode::kDeferred), so
// a missing wait computes wrong values here.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/nn/functional/loss.h>

#include "data.h"
#include "model.h"
#include "zero/core/trace.h"
#include "zero/runtime/engine_internal.h"
#include "zero/zero.h"

namespace {

struct Trained {
  std::vector<torch::Tensor> states;  // master and states, sub-group by sub-group
  std::vector<double> losses, norms;
  zero::detail::SpeculationCounts counts;
  int64_t skipped = 0;
  int64_t undo_bytes = 0;  // the ledger's pageable host optimizer states: the undo copy
  int64_t device_state_bytes = 0, device_grad_bytes = 0, host_state_bytes = 0;  // the ledger's (partial offload)
  int64_t host_grad_bytes = 0;
  int64_t nvme_state_bytes = 0;  // the ledger's: the swap files
  std::vector<torch::Tensor> states_mid;  // read between a backward and its step (eval_at)
  double l2_mid = 0;
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
  int64_t n_embd = 32;
  int64_t sub_group_size = 1500;
  int eval_at = -1;  // after this micro-step's backward, before its step: a forward without gradients
  double ratio = 1.0;  // offload_optimizer.ratio (NOTE [partial offload])
  bool grads_on_device = false;  // offload_optimizer.gradients_on_device (NOTE [device gradients])
  int stage = 3;
  std::string nvme_path;  // offload_optimizer nvme there (else cpu)
  int64_t max_in_cpu = 0;  // with nvme (NOTE [state placement])
};

Trained train(bool super_offload, const Options& o) {
  mingpt::GPTConfig g;
  g.vocab_size = 10;
  g.block_size = 6;
  g.n_layer = 3;
  g.n_head = 2;
  g.n_embd = o.n_embd;
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
      R"( "zero_optimization": {"stage": )" + std::to_string(o.stage) +
      R"(, "stage3_param_persistence_threshold": 0, "sub_group_size": )" +
      std::to_string(o.sub_group_size) +
      R"(, "reduce_bucket_size": 3000, "offload_optimizer": {)" +
      (o.nvme_path.empty() ? std::string(R"("device": "cpu")")
                           : R"("device": "nvme", "nvme_path": ")" + o.nvme_path + R"(", "max_in_cpu": )" +
                                 std::to_string(o.max_in_cpu)) +
      R"(, "ratio": )" + std::to_string(o.ratio) +
      R"(, "super_offload": )" + (super_offload ? "true" : "false") +
      R"(, "gradients_on_device": )" + (o.grads_on_device ? "true" : "false") + "}}}";
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
    if (s == o.eval_at) {
      torch::NoGradGuard no_grad;
      r.losses.push_back(loss_of().item<double>());
      r.states_mid = zero::detail::optimizer_states_of(engine);
      r.l2_mid = engine.parameter_l2();
    }
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
  r.device_state_bytes = engine.ledger().get(zero::Tier::kDevice, zero::Kind::kOptimizerStates).current_bytes;
  r.device_grad_bytes = engine.ledger().get(zero::Tier::kDevice, zero::Kind::kGradients).current_bytes;
  r.host_state_bytes = engine.ledger().get(zero::Tier::kPinnedHost, zero::Kind::kOptimizerStates).current_bytes;
  r.host_grad_bytes = engine.ledger().get(zero::Tier::kPinnedHost, zero::Kind::kGradients).current_bytes +
                      engine.ledger().get(zero::Tier::kHost, zero::Kind::kGradients).current_bytes;
  r.nvme_state_bytes = engine.ledger().get(zero::Tier::kNvme, zero::Kind::kOptimizerStates).current_bytes;
  return r;
}

void expect_same_bits(const Trained& plain, const Trained& spec) {
  ASSERT_EQ(spec.states.size(), plain.states.size());
  for (size_t i = 0; i < plain.states.size(); ++i)
    EXPECT_TRUE(torch::equal(spec.states[i], plain.states[i])) << "state tensor " << i;
  ASSERT_EQ(spec.states_mid.size(), plain.states_mid.size());
  for (size_t i = 0; i < plain.states_mid.size(); ++i)
    EXPECT_TRUE(torch::equal(spec.states_mid[i], plain.states_mid[i])) << "state tensor " << i << " before the step";
  EXPECT_EQ(spec.l2_mid, plain.l2_mid);
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

// A bf16 master with 8-bit states (their fp32 side blocks too) and with bf16
// ones, in sub-groups of 1500 elements, and of about 200K, whose undo copy
// is written 64K elements at a time as they are stepped and restored whole.
TEST(SuperOffload, Bf16MasterAndEightBitStatesAreRestoredExactly) {
  for (const int64_t n_embd : {32, 128}) {
    for (const std::string& params : {std::string(R"("lr": 0.003, "optim_bits": 8, "min_8bit_size": 4096)"),
                                      std::string(R"("lr": 0.003)")}) {
      SCOPED_TRACE(params + " n_embd " + std::to_string(n_embd));
      Options o;
      o.optimizer_params = params;
      o.precision = R"("bf16": {"enabled": true, "bf16_master_weights_and_grads": true},)";
      o.clip = n_embd == 32 ? 0.05 : 0.5;  // some steps clip, some do not
      o.steps = n_embd == 32 ? 5 : 3;
      o.n_embd = n_embd;
      if (n_embd == 128) o.sub_group_size = 1000000000;
      const Trained plain = train(false, o), spec = train(true, o);
      expect_same_bits(plain, spec);
      EXPECT_EQ(spec.counts.validated + spec.counts.redone, o.steps);
      int64_t largest = 0;
      for (const auto& t : spec.states) largest = std::max<int64_t>(largest, t.numel());
      if (n_embd == 128) EXPECT_GT(largest, 2 * 65536) << "a sub-group of several windows";
    }
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

// A forward between a boundary backward and its step (an evaluation) reads
// the shards: the speculation is undone first, so it sees the weights as
// they were, and so do the states a checkpoint would read and the norm.
TEST(SuperOffload, AForwardBeforeTheStepSeesTheWeightsAsTheyWere) {
  Options o;
  o.eval_at = 1;
  const Trained plain = train(false, o), spec = train(true, o);
  expect_same_bits(plain, spec);
  EXPECT_EQ(spec.counts.undone, 1);
  EXPECT_EQ(spec.counts.validated, 3);
  EXPECT_FALSE(spec.states_mid.empty());
}

TEST(SuperOffload, ABackwardTheProgramStartsStepsAfterIt) {
  Options o;
  o.user_backward = true;
  o.clip = 1.0;
  const Trained plain = train(false, o), spec = train(true, o);
  expect_same_bits(plain, spec);
  EXPECT_EQ(spec.counts.planned, 0);  // no planned step: nothing speculated
}

// NOTE [speculative step] in a trace (NOTE [trace]): the sub-groups' CPU
// steps begin inside the backward phase. The embedding's gradient, backward's
// last, waits until a speculative step has been taken in this backward (the
// later layers' groups are final by then), so the order does not depend on
// how the threads are scheduled; the trace must show it.
TEST(SuperOffload, TheTraceShowsSubGroupStepsBeforeBackwardEnds) {
  const std::string file = std::string(ZERO_BINARY_DIR) + "/tests/super_offload_trace_" + std::to_string(getpid()) + ".json";
  ::setenv("ZERO_TRACE", file.c_str(), 1);
  {
    mingpt::GPTConfig g;
    g.vocab_size = 10;
    g.block_size = 6;
    g.n_layer = 4;
    g.n_head = 2;
    g.n_embd = 32;
    torch::manual_seed(11);
    mingpt::GPT model(g);
    zero::InitOptions io;
    io.print_progress = false;
    io.device = torch::Device(torch::kCPU);
    auto engine = zero::initialize(
        model.ptr(),
        R"({"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0, "optimizer": {"type": "AdamW", "params": {"lr": 0.003}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 4000,
              "offload_optimizer": {"device": "cpu", "super_offload": true}}})",
        io);
    ::unsetenv("ZERO_TRACE");
    int64_t before = 0;
    bool waited_out = false;
    model->named_parameters()["tok_emb.weight"].register_hook([&](torch::Tensor grad) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
      while (zero::detail::speculation_counts(engine).sub_groups == before) {
        if (std::chrono::steady_clock::now() > until) {
          waited_out = true;
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      return grad;
    });
    auto task = mingpt::make_addition_task(2);
    for (int s = 0; s < 3; ++s) {
      auto b = task->train_batch({8 * s, 8 * s + 1, 8 * s + 2, 8 * s + 3, 8 * s + 4, 8 * s + 5, 8 * s + 6, 8 * s + 7});
      auto logits = model->forward(b.x);
      auto loss = torch::nn::functional::cross_entropy(
          logits.view({-1, logits.size(-1)}), b.y.view({-1}),
          torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1));
      before = zero::detail::speculation_counts(engine).sub_groups;
      engine.backward(loss);
      engine.step();
    }
    EXPECT_FALSE(waited_out) << "no speculative step within 120 s of the embedding's gradient";
    EXPECT_EQ(zero::detail::speculation_counts(engine).validated, 3);
  }  // the engine writes the trace as it ends
  zero::trace::stop();
  std::ifstream in(file);
  ASSERT_TRUE(in) << file;
  const auto t = nlohmann::json::parse(in);
  struct Span {
    std::string cat, name;
    int64_t ts, end;
  };
  std::vector<Span> backward, steps;
  int validated = 0;
  for (const auto& e : t["traceEvents"]) {
    if (e["ph"] != "X") continue;
    const Span x{e["cat"], e["name"], e["ts"].get<int64_t>(), e["ts"].get<int64_t>() + e["dur"].get<int64_t>()};
    if (x.cat == "phase" && x.name == "backward") backward.push_back(x);
    if (x.cat == "optimizer" && x.name == "speculative CPU step of a sub-group") steps.push_back(x);
    validated += x.cat == "optimizer" && x.name == "speculative step validated";
  }
  ASSERT_EQ(backward.size(), 3u);
  EXPECT_EQ(validated, 3);
  for (const auto& b : backward) {
    int began_inside = 0;
    for (const auto& x : steps) began_inside += b.ts <= x.ts && x.ts < b.end;
    EXPECT_GE(began_inside, 1) << "a backward phase from " << b.ts << " to " << b.end;
  }
  std::filesystem::remove(file);
}

// offload_optimizer.ratio (NOTE [partial offload]): the device keeps the
// first groups' master, states and gradients and steps them in place; the
// host the rest. On CPU ranks the arithmetic is the same, so every ratio
// equals ratio 1 bit for bit: with and without speculation (which then
// covers the host's groups only), clipped, overflowed, accumulated, 8-bit.
TEST(PartialOffload, EveryRatioEqualsAllOnTheHost) {
  struct Variant {
    const char* name;
    Options o;
  };
  std::vector<Variant> variants(5);
  variants[0].name = "fp32 unclipped";
  variants[1].name = "bf16, every step clipped";
  variants[1].o.clip = 1e-4;
  variants[1].o.precision = R"("bf16": {"enabled": true},)";
  variants[2].name = "fp16 overflows";
  variants[2].o.steps = 6;
  variants[2].o.precision = R"("fp16": {"enabled": true, "initial_scale_power": 18, "hysteresis": 1},)";
  variants[2].o.clip = 1.0;
  variants[3].name = "accumulation 3, some clipped";
  variants[3].o.gas = 3;
  variants[3].o.clip = 0.05;
  variants[4].name = "bf16 master, 8-bit states";
  variants[4].o.precision = R"("bf16": {"enabled": true, "bf16_master_weights_and_grads": true},)";
  variants[4].o.optimizer_params = R"("lr": 0.003, "optim_bits": 8, "min_8bit_size": 4096)";
  variants[4].o.clip = 0.05;
  for (const auto& v : variants) {
    const Trained all_host = train(false, v.o);
    for (const double ratio : {0.0, 0.5}) {
      for (const bool speculate : {false, true}) {
        SCOPED_TRACE(std::string(v.name) + ", ratio " + std::to_string(ratio) + (speculate ? ", super_offload" : ""));
        Options o = v.o;
        o.ratio = ratio;
        const Trained got = train(speculate, o);
        expect_same_bits(all_host, got);
        // The device holds the states of its share, the host the rest.
        EXPECT_GT(got.device_state_bytes, 0);
        EXPECT_GT(got.device_grad_bytes, all_host.device_grad_bytes);
        if (ratio == 0) {
          EXPECT_EQ(got.host_state_bytes, 0);
        } else {
          EXPECT_GT(got.host_state_bytes, 0);
        }
        EXPECT_EQ(all_host.device_state_bytes, 0);
        EXPECT_EQ(got.device_state_bytes + got.host_state_bytes, all_host.host_state_bytes);
        // Speculation keeps an undo copy of the host's share alone.
        if (speculate) {
          EXPECT_EQ(got.counts.validated + got.counts.redone + got.counts.undone, got.counts.planned);
          EXPECT_LE(got.undo_bytes, got.host_state_bytes + 4096);
          if (ratio == 0) {  // nothing on the host: no speculation (the config says so)
            EXPECT_EQ(got.undo_bytes, 0);
            EXPECT_EQ(got.counts.planned, 0);
          }
        }
      }
    }
  }
}

// offload_optimizer.gradients_on_device (NOTE [device gradients]): the
// gradient partition stays on the device and comes to the host a piece at a
// time at the step: the bits of gradients in host memory, alone and with a
// partial offload, clipped, overflowed, accumulated, 8-bit; at stage 2 in
// fp16, accumulated over 2 micro-steps in the host's fp32 (not fp16).
TEST(DeviceGradients, EqualGradientsInHostMemory) {
  std::vector<Options> variants(5);
  variants[4].stage = 2;
  variants[4].gas = 2;
  variants[4].clip = 1.0;
  variants[4].precision = R"("fp16": {"enabled": true, "initial_scale_power": 12},)";
  variants[1].clip = 1e-4;
  variants[1].precision = R"("bf16": {"enabled": true},)";
  variants[2].steps = 6;
  variants[2].precision = R"("fp16": {"enabled": true, "initial_scale_power": 18, "hysteresis": 1},)";
  variants[2].clip = 1.0;
  variants[3].gas = 3;
  variants[3].clip = 0.05;
  variants[3].precision = R"("bf16": {"enabled": true, "bf16_master_weights_and_grads": true},)";
  variants[3].optimizer_params = R"("lr": 0.003, "optim_bits": 8, "min_8bit_size": 4096)";
  for (size_t i = 0; i < variants.size(); ++i) {
    const Trained host = train(false, variants[i]);
    EXPECT_GT(host.host_grad_bytes, 0);
    for (const double ratio : {1.0, 0.5}) {
      if (variants[i].stage != 3 && ratio != 1.0) continue;  // a partial offload is stage 3's
      SCOPED_TRACE("variant " + std::to_string(i) + ", ratio " + std::to_string(ratio));
      Options o = variants[i];
      o.grads_on_device = true;
      o.ratio = ratio;
      const Trained got = train(false, o);
      expect_same_bits(host, got);
      EXPECT_EQ(got.host_grad_bytes, 0);
      // The host's gradient bytes, moved to the device in their dtype.
      EXPECT_EQ(got.device_grad_bytes - host.device_grad_bytes, host.host_grad_bytes);
    }
  }
}

// NOTE [state placement]: the optimizer states on three tiers, the device's
// share first, then host memory within offload_optimizer.max_in_cpu, then
// NVMe: every placement gives the bits of all in host memory, fp32 and bf16
// clipped, accumulated, a bf16 master with 8-bit states, with the gradients
// on the device, and at stage 2 (no device share there); the swap files
// hold only the disk's share.
TEST(StatePlacement, EveryPlacementEqualsAllInHostMemory) {
  const std::string dir = std::filesystem::temp_directory_path() / ("zero_placement_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::vector<Options> variants(4);
  variants[3].stage = 2;  // (a group per bucket, not per layer)
  variants[3].gas = 2;
  variants[3].clip = 1.0;
  variants[1].clip = 1e-4;
  variants[1].gas = 2;
  variants[1].precision = R"("bf16": {"enabled": true},)";
  variants[2].clip = 0.05;
  variants[2].precision = R"("bf16": {"enabled": true, "bf16_master_weights_and_grads": true},)";
  variants[2].optimizer_params = R"("lr": 0.003, "optim_bits": 8, "min_8bit_size": 4096)";
  struct Placement {
    double ratio;
    int64_t max_in_cpu;
    bool grads_on_device;
  };
  // (Each block is a group of about 12.7k elements here: 14000 keeps the
  // first offloaded block in host memory.)
  const std::vector<Placement> placements = {{1.0, 0, false}, {1.0, 14000, false}, {0.5, 14000, false},
                                             {0.5, 14000, true}, {1.0, 1000000, false}};
  for (size_t v = 0; v < variants.size(); ++v) {
    const Trained host = train(false, variants[v]);
    std::vector<int64_t> disk;
    for (const auto& p : placements) {
      if (variants[v].stage != 3 && p.ratio < 1) {  // a device share is stage 3's
        disk.push_back(-1);
        continue;
      }
      SCOPED_TRACE("variant " + std::to_string(v) + ", ratio " + std::to_string(p.ratio) + ", max_in_cpu " +
                   std::to_string(p.max_in_cpu) + (p.grads_on_device ? ", gradients on the device" : ""));
      Options o = variants[v];
      o.nvme_path = dir;
      o.ratio = p.ratio;
      o.max_in_cpu = p.max_in_cpu;
      o.grads_on_device = p.grads_on_device;
      const Trained got = train(false, o);
      expect_same_bits(host, got);
      disk.push_back(got.nvme_state_bytes);
      if (p.ratio < 1) {
        EXPECT_GT(got.device_state_bytes, 0);
      } else {
        EXPECT_EQ(got.device_state_bytes, 0);
      }
    }
    // Less on disk as the device and host memory hold more; nothing with
    // every group within max_in_cpu.
    EXPECT_GT(disk[0], disk[1]);
    EXPECT_GT(disk[1], 0);
    if (variants[v].stage == 3) {
      EXPECT_GT(disk[1], disk[2]);
      EXPECT_GT(disk[2], 0);
      EXPECT_EQ(disk[3], disk[2]);
    }
    EXPECT_EQ(disk[4], 0);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
