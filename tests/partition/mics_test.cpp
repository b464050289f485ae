// MiCS (NOTE [MiCS]) in one process: ranks as threads over Gloo on 2 nodes
// of 2 (ranks.h), the optimizer given a shard group and a replica group as
// the engine gives them. Replicas that see the same gradients double each
// sum exactly, so the run steps to the bits of its shard group alone, at
// stages 2 and 3, on the device and offloaded, over an accumulation window,
// and with a shard group of one rank; with different gradients on every
// rank it trains as 4 ranks without MiCS (the order of the additions
// apart); the bytes cross nodes only in the replicas' sum. And the
// hierarchical gather (NOTE [hierarchical gather]): the bits of a flat
// gather, one shard a rank across nodes.
#include <gtest/gtest.h>

#include <mutex>
#include <numeric>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include "ranks.h"
#include "zero/core/memory_ledger.h"
#include "zero/optim/flat_optimizer.h"
#include "zero/partition/zero_optimizer.h"

namespace zero::partition {
namespace {

const std::vector<int64_t> kSizes = {300, 1000, 50};  // with 600-element buckets: three groups

// The parameters, the same on every rank, in a module (stage 3's layer).
struct Net : torch::nn::Module {
  Net() {
    for (size_t i = 0; i < kSizes.size(); ++i)
      register_parameter("p" + std::to_string(i), at::linspace(-1, 1, kSizes[i], at::kFloat));
  }
};

config::OptimizerConfig adamw() {
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
};

// Rank `data`'s gradient of parameter i at micro-step t: low bits set.
at::Tensor grad_of(int data, size_t i, int t) {
  auto gen = at::detail::createCPUGenerator(100000 * static_cast<uint64_t>(t) + 1000 * static_cast<uint64_t>(data) + i + 1);
  return at::randn({kSizes[i]}, gen) + 1.0 / 3.0;
}

// Trains `steps` steps on one rank: its partition comm and replicas (MiCS:
// the shard and replica groups), the gradients of rank `data`. Returns its
// parameters: stage 2's (every one, in slot order), stage 3's shards.
at::Tensor train(const Case& c, Comm* comm, Comm* replicas, int data, int steps, MemoryLedger& ledger) {
  ZeroOptimizerOptions o;
  o.stage = c.stage;
  o.bucket_numel = 600;
  o.offload_optimizer = c.offload;
  o.copy_mode = CopyMode::kDeferred;  // every transfer waits for its event, as on a GPU
  std::unique_ptr<ZeroOptimizer> opt;
  auto net = std::make_shared<Net>();
  if (c.stage == 3) {
    Stage3Layout layout;
    layout.groups.resize(2);
    layout.groups[1].name = "net";
    for (const auto& p : net->named_parameters()) layout.groups[1].params.emplace_back(p.key(), p.value());
    layout.units.push_back({"net", net, {1}});
    opt = std::make_unique<ZeroOptimizer>(std::move(layout), optim::FlatOptimizer::create(adamw()), o, ledger, comm,
                                          replicas);
  } else {
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (const auto& p : net->named_parameters()) named.emplace_back(p.key(), p.value());
    opt = std::make_unique<ZeroOptimizer>(named, optim::FlatOptimizer::create(adamw()), o, ledger, comm, replicas);
  }
  for (int64_t step = 1; step <= steps; ++step) {
    for (int t = 0; t < c.micro_steps; ++t) {
      opt->begin_backward(/*boundary=*/t + 1 == c.micro_steps);
      for (size_t i = kSizes.size(); i-- > 0;)
        opt->on_grad_ready(i, grad_of(data, i, static_cast<int>(step) * c.micro_steps + t));
      opt->end_backward();
    }
    opt->step({step, 1e-2, 0.9, 0.999}, static_cast<double>(c.micro_steps), /*clip=*/0.5);
  }
  const auto& flat = opt->parameters();
  if (c.stage < 3) {  // the parameters without the layout's padding (which depends on the partitions)
    std::vector<at::Tensor> values;
    for (const auto& slot : flat.slots()) values.push_back(flat.flat().narrow(0, slot.offset, slot.numel));
    return at::cat(values);
  }
  std::vector<at::Tensor> parts;
  for (size_t g = 1; g < flat.groups().size(); ++g) parts.push_back(flat.part(g).clone());
  return at::cat(parts);
}

// This rank's MiCS groups, as the engine makes them: shard groups of
// consecutive ranks, replicas across them (none when the shard is the world;
// no shard group when it is one rank).
struct MicsGroups {
  std::unique_ptr<Comm> shard, replicas;
  Comm* partition = nullptr;
  MicsGroups(Comm& world, int shard_size) {
    const int r = world.rank(), first = r / shard_size * shard_size;
    std::vector<int> group(static_cast<size_t>(shard_size)), reps;
    std::iota(group.begin(), group.end(), first);
    for (int q = r % shard_size; q < world.world_size(); q += shard_size) reps.push_back(q);
    if (shard_size > 1) shard = world.subgroup(group, "mics-shard");
    replicas = world.subgroup(reps, "mics-replicas");
    partition = shard.get();
  }
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class Mics : public ::testing::TestWithParam<Case> {};

// Replicas fed the same gradients as the ranks of the first shard group:
// the parameters are bit for bit those of that shard group trained alone,
// on every rank (each replica steps the same values).
TEST_P(Mics, ReplicasOfTheSameDataStepToTheBitsOfTheirShardGroupAlone) {
  const Case c = GetParam();
  constexpr int kSteps = 3;
  std::vector<at::Tensor> alone(static_cast<size_t>(c.shard));
  std::mutex mu;
  auto run_alone = [&](int rank, Comm* comm) {
    MemoryLedger ledger;
    at::Tensor p = train(c, comm, nullptr, rank, kSteps, ledger);
    std::lock_guard<std::mutex> lock(mu);
    alone[static_cast<size_t>(rank)] = p;
  };
  if (c.shard == 1) run_alone(0, nullptr);
  else testing::on_ranks(c.shard, [&](int rank, Comm& comm) { run_alone(rank, &comm); });
  testing::on_ranks(
      c.world,
      [&](int rank, Comm& world) {
        MicsGroups groups(world, c.shard);
        MemoryLedger ledger;
        const at::Tensor got = train(c, groups.partition, groups.replicas.get(), rank % c.shard, kSteps, ledger);
        EXPECT_TRUE(at::equal(got, alone[static_cast<size_t>(rank % c.shard)]))
            << "rank " << rank << ": " << (got - alone[static_cast<size_t>(rank % c.shard)]).abs().max().item<float>();
      },
      2);
}

// Every rank's own gradients: the parameters are those of 4 ranks without
// MiCS, within the rounding of the sums' other order.
TEST_P(Mics, TrainsAsTheWholeWorldWithoutMics) {
  const Case c = GetParam();
  constexpr int kSteps = 3;
  std::vector<at::Tensor> plain(static_cast<size_t>(c.world));
  std::mutex mu;
  testing::on_ranks(c.world, [&](int rank, Comm& comm) {
    MemoryLedger ledger;
    at::Tensor p = train(c, &comm, nullptr, rank, kSteps, ledger);
    std::lock_guard<std::mutex> lock(mu);
    plain[static_cast<size_t>(rank)] = p;
  });
  testing::on_ranks(
      c.world,
      [&](int rank, Comm& world) {
        MicsGroups groups(world, c.shard);
        MemoryLedger ledger;
        const at::Tensor got = train(c, groups.partition, groups.replicas.get(), rank, kSteps, ledger);
        // The same elements: stage 2's parameters; stage 3's shards are a
        // shard group's S-th against the world's N-th.
        at::Tensor want = plain[static_cast<size_t>(rank)];
        if (c.stage == 3) {
          const int64_t n = got.numel();
          std::vector<at::Tensor> all;
          for (const auto& t : plain) all.push_back(t);
          want = at::cat(all).narrow(0, rank % c.shard * n, n);
        }
        ASSERT_EQ(got.sizes(), want.sizes());
        EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-6)) << "rank " << rank << ": "
                                                         << (got - want).abs().max().item<float>();
        EXPECT_FALSE(at::equal(got, train(c, groups.partition, nullptr, rank, kSteps, ledger)))
            << "without the replicas' sum each shard group trains on its own data";
      },
      2);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, Mics,
    ::testing::Values(Case{"Stage2", 2}, Case{"Stage3", 3}, Case{"Stage2Offload", 2, true},
                      Case{"Stage3Offload", 3, true}, Case{"Stage2Accumulating", 2, false, 2},
                      Case{"Stage3OffloadAccumulating", 3, true, 2}, Case{"Stage2ShardOfOne", 2, false, 1, 1, 2},
                      Case{"Stage3ShardOfOneOffload", 3, true, 1, 1, 2}),
    [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// With shard groups one node each, the gradients cross nodes only in the
// replicas' sum: a rank's chunk of each bucket, all-reduced in a ring of 2
// (its bytes once); the first hop, the norm and the new values' gathers stay
// in the node.
TEST(MicsBytes, OnlyTheReplicasSumCrossesNodes) {
  testing::on_ranks(
      4,
      [&](int rank, Comm& world) {
        MicsGroups groups(world, 2);
        MemoryLedger ledger;
        ZeroOptimizerOptions o;
        o.stage = 2;
        o.bucket_numel = 600;
        auto net = std::make_shared<Net>();
        std::vector<std::pair<std::string, at::Tensor>> named;
        for (const auto& p : net->named_parameters()) named.emplace_back(p.key(), p.value());
        ZeroOptimizer opt(named, optim::FlatOptimizer::create(adamw()), o, ledger, groups.partition,
                          groups.replicas.get());
        const CommBytes start = world.bytes_sent();
        opt.begin_backward(true);
        for (size_t i = kSizes.size(); i-- > 0;) opt.on_grad_ready(i, grad_of(rank, i, 0));
        opt.end_backward();
        const CommBytes backward = world.bytes_sent() - start;
        opt.step({1, 1e-2, 0.9, 0.999}, 1.0, 0.5);
        const CommBytes all = world.bytes_sent() - start;
        int64_t chunks = 0;
        for (const auto& g : opt.parameters().groups()) chunks += g.chunk_numel * 4;
        EXPECT_EQ(backward.across_nodes, chunks) << "rank " << rank;
        EXPECT_GT(backward.within_node, 0);
        EXPECT_EQ(all.across_nodes, chunks) << "rank " << rank << ": the step sends nothing across";
        EXPECT_GT(all.within_node, backward.within_node);
      },
      2);
}

}  // namespace
}  // namespace zero::partition
