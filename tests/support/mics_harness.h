// What the MiCS tests share (tests/partition/mics_test.cpp on the CPU,
// tests/gpu/gpu_test.cpp on the card): a small model, its gradients, one
// rank's training with a partition comm and replicas (NOTE [MiCS]; the
// groups come from make_mics_groups, as the engine's).
#pragma once

#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "zero/core/comm.h"
#include "zero/core/memory_ledger.h"
#include "zero/optim/flat_optimizer.h"
#include "zero/partition/zero_optimizer.h"

namespace zero::partition::mics_test {

inline const std::vector<int64_t> kSizes = {300, 1000, 50};  // with 600-element buckets: three groups

// The parameters, the same on every rank, in a module (stage 3's layer).
struct Net : torch::nn::Module {
  Net() {
    for (size_t i = 0; i < kSizes.size(); ++i)
      register_parameter("p" + std::to_string(i), at::linspace(-1, 1, kSizes[i], at::kFloat));
  }
};

inline config::OptimizerConfig adamw() {
  config::OptimizerConfig c;
  c.type = config::OptimizerType::kAdamW;
  c.lr = 1e-2;
  c.weight_decay = 0.01;
  return c;
}

struct Case {
  std::string name;
  int stage = 2;
  bool offload = false;
  int micro_steps = 1;  // a window's micro-steps
  int shard = 2;        // mics_shard_size
  int world = 4;
  bool last_skipped = false;  // the window's boundary micro-step runs no backward
  bool hierarchical = false;  // stage 3: mics_hierarchical_params_gather (NOTE [hierarchical gather])
};

inline void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// Rank `data`'s gradient of parameter i at micro-step t: low bits set.
inline at::Tensor grad_of(int data, size_t i, int t) {
  auto gen = at::detail::createCPUGenerator(100000 * static_cast<uint64_t>(t) + 1000 * static_cast<uint64_t>(data) + i + 1);
  return at::randn({kSizes[i]}, gen) + 1.0 / 3.0;
}

struct Trained {
  at::Tensor params;          // stage 2's (every one, in slot order), stage 3's shards
  std::vector<double> norms;  // each step's gradient norm (the average's, unscaled)
};

// Trains `steps` steps on one rank: its partition comm and replicas (MiCS:
// the shard and replica groups), the gradients of rank `data`.
// On `device` (a CUDA one: the ranks share it through Gloo).
inline Trained train(const Case& c, Comm* comm, Comm* replicas, int data, int steps, MemoryLedger& ledger,
                     at::Device device = at::kCPU) {
  ZeroOptimizerOptions o;
  o.stage = c.stage;
  o.bucket_numel = 600;
  o.offload_optimizer = c.offload;
  o.device = device;
  // On the CPU every transfer waits for its event, as on a GPU.
  o.copy_mode = device.is_cpu() ? CopyMode::kDeferred : CopyMode::kImmediate;
  std::unique_ptr<ZeroOptimizer> opt;
  auto net = std::make_shared<Net>();
  net->to(device);
  if (c.stage == 3) {
    Stage3Layout layout;
    layout.groups.resize(2);
    layout.groups[1].name = "net";
    for (const auto& p : net->named_parameters()) layout.groups[1].params.emplace_back(p.key(), p.value());
    layout.units.push_back({"net", net, {1}});
    layout.options.hierarchical_gather = c.hierarchical;
    opt = std::make_unique<ZeroOptimizer>(std::move(layout), optim::FlatOptimizer::create(adamw()), o, ledger, comm,
                                          replicas);
  } else {
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (const auto& p : net->named_parameters()) named.emplace_back(p.key(), p.value());
    opt = std::make_unique<ZeroOptimizer>(named, optim::FlatOptimizer::create(adamw()), o, ledger, comm, replicas);
  }
  Trained out;
  for (int64_t step = 1; step <= steps; ++step) {
    for (int t = 0; t < c.micro_steps; ++t) {
      if (c.last_skipped && t + 1 == c.micro_steps) break;
      opt->begin_backward(/*boundary=*/t + 1 == c.micro_steps);
      for (size_t i = kSizes.size(); i-- > 0;)
        opt->on_grad_ready(i, grad_of(data, i, static_cast<int>(step) * c.micro_steps + t).to(device));
      opt->end_backward();
    }
    out.norms.push_back(opt->step({step, 1e-2, 0.9, 0.999}, static_cast<double>(c.micro_steps), /*clip=*/0.5).grad_norm);
  }
  const auto& flat = opt->parameters();
  if (c.stage < 3) {  // the parameters without the layout's padding (which depends on the partitions)
    std::vector<at::Tensor> values;
    for (const auto& slot : flat.slots()) values.push_back(flat.flat().narrow(0, slot.offset, slot.numel));
    out.params = at::cat(values).cpu();
    return out;
  }
  std::vector<at::Tensor> parts;
  for (size_t g = 1; g < flat.groups().size(); ++g) parts.push_back(flat.part(g).clone());
  out.params = at::cat(parts).cpu();
  return out;
}

}  // namespace zero::partition::mics_test
