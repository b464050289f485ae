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

#include <ATen/ATen.h>

#include "mics_harness.h"
#include "ranks.h"

namespace zero::partition {
namespace {

using namespace mics_test;

class Mics : public ::testing::TestWithParam<Case> {};

// Replicas fed the same gradients as the ranks of the first shard group:
// the parameters and every step's gradient norm (the average over all
// ranks, summed over the shard group) are bit for bit those of that shard
// group trained alone, on every rank (each replica steps the same values).
TEST_P(Mics, ReplicasOfTheSameDataStepToTheBitsOfTheirShardGroupAlone) {
  const Case c = GetParam();
  constexpr int kSteps = 3;
  std::vector<Trained> alone(static_cast<size_t>(c.shard));
  std::mutex mu;
  auto run_alone = [&](int rank, Comm* comm) {
    MemoryLedger ledger;
    Trained t = train(c, comm, nullptr, rank, kSteps, ledger);
    std::lock_guard<std::mutex> lock(mu);
    alone[static_cast<size_t>(rank)] = t;
  };
  if (c.shard == 1) run_alone(0, nullptr);
  else testing::on_ranks(c.shard, [&](int rank, Comm& comm) { run_alone(rank, &comm); });
  testing::on_ranks(
      c.world,
      [&](int rank, Comm& world) {
        const MicsGroups groups = make_mics_groups(world, c.shard);
        MemoryLedger ledger;
        const Trained got = train(c, groups.partition, groups.replicas, rank % c.shard, kSteps, ledger);
        const Trained& want = alone[static_cast<size_t>(rank % c.shard)];
        EXPECT_TRUE(at::equal(got.params, want.params))
            << "rank " << rank << ": " << (got.params - want.params).abs().max().item<float>();
        EXPECT_EQ(got.norms, want.norms) << "rank " << rank;
      },
      2);
}

// Every rank's own gradients: the parameters and the norms are those of 4
// ranks without MiCS, within the rounding of the sums' other order.
TEST_P(Mics, TrainsAsTheWholeWorldWithoutMics) {
  const Case c = GetParam();
  constexpr int kSteps = 3;
  std::vector<Trained> plain(static_cast<size_t>(c.world));
  std::mutex mu;
  testing::on_ranks(c.world, [&](int rank, Comm& comm) {
    MemoryLedger ledger;
    Trained t = train(c, &comm, nullptr, rank, kSteps, ledger);
    std::lock_guard<std::mutex> lock(mu);
    plain[static_cast<size_t>(rank)] = t;
  });
  testing::on_ranks(
      c.world,
      [&](int rank, Comm& world) {
        const MicsGroups groups = make_mics_groups(world, c.shard);
        MemoryLedger ledger;
        const Trained trained = train(c, groups.partition, groups.replicas, rank, kSteps, ledger);
        const at::Tensor& got = trained.params;
        // The same elements: stage 2's parameters; stage 3's shards are a
        // shard group's S-th against the world's N-th.
        at::Tensor want = plain[static_cast<size_t>(rank)].params;
        if (c.stage == 3) {
          const int64_t n = got.numel();
          std::vector<at::Tensor> all;
          for (const auto& t : plain) all.push_back(t.params);
          want = at::cat(all).narrow(0, rank % c.shard * n, n);
        }
        for (int i = 0; i < kSteps; ++i)
          EXPECT_NEAR(trained.norms[static_cast<size_t>(i)], plain[0].norms[static_cast<size_t>(i)],
                      1e-6 * plain[0].norms[static_cast<size_t>(i)])
              << "rank " << rank << " step " << i + 1;
        ASSERT_EQ(got.sizes(), want.sizes());
        EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-6)) << "rank " << rank << ": "
                                                         << (got - want).abs().max().item<float>();
        if (c.shard < c.world) {
          EXPECT_FALSE(at::equal(got, train(c, groups.partition, nullptr, rank, kSteps, ledger).params))
              << "without the replicas' sum each shard group trains on its own data";
        }
      },
      2);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, Mics,
    ::testing::Values(Case{"Stage2", 2}, Case{"Stage3", 3}, Case{"Stage2Offload", 2, true},
                      Case{"Stage3Offload", 3, true}, Case{"Stage2Accumulating", 2, false, 2},
                      Case{"Stage3OffloadAccumulating", 3, true, 2}, Case{"Stage2ShardOfOne", 2, false, 1, 1, 2},
                      Case{"Stage3ShardOfOneOffload", 3, true, 1, 1, 2},
                      Case{"Stage2BoundaryWithoutBackward", 2, false, 2, 2, 4, true},
                      Case{"Stage3HierarchicalGather", 3, false, 1, 4, 4, false, true},
                      Case{"Stage3HierarchicalGatherOffload", 3, true, 1, 4, 4, false, true}),
    [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// With shard groups one node each, the gradients cross nodes only in the
// replicas' sum: a rank's chunk of each bucket, all-reduced in a ring of 2
// (its bytes once); the first hop, the norm and the new values' gathers stay
// in the node.
TEST(MicsBytes, OnlyTheReplicasSumCrossesNodes) {
  testing::on_ranks(
      4,
      [&](int rank, Comm& world) {
        const MicsGroups groups = make_mics_groups(world, 2);
        MemoryLedger ledger;
        ZeroOptimizerOptions o;
        o.stage = 2;
        o.bucket_numel = 600;
        auto net = std::make_shared<Net>();
        std::vector<std::pair<std::string, at::Tensor>> named;
        for (const auto& p : net->named_parameters()) named.emplace_back(p.key(), p.value());
        ZeroOptimizer opt(named, optim::FlatOptimizer::create(adamw()), o, ledger, groups.partition,
                          groups.replicas);
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
