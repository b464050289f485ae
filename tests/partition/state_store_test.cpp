// The state store (NOTE [state store]) on every tier: the master starts as
// the parameters' chunks and the states at the optimizer's initial values;
// what a visit writes, the next visit reads back, sub-group by sub-group, at
// sub-group sizes that do not divide the groups (and, on NVMe, through the
// swap files). And the flat layout (NOTE [flat layout]) the store follows.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include <ATen/ATen.h>

#include "zero/core/memory_ledger.h"
#include "zero/optim/flat_optimizer.h"
#include "zero/partition/flat_parameters.h"
#include "zero/partition/stage3_rules.h"
#include "zero/partition/state_store.h"

namespace {

using zero::Tier;
using zero::partition::FlatParameters;
using zero::partition::StateStore;
using zero::partition::StoreOptions;

std::vector<std::pair<std::string, at::Tensor>> params() {
  return {{"a", at::arange(700, at::kFloat).div_(7).requires_grad_()},
          {"b", at::arange(2500, at::kFloat).mul_(-0.5).requires_grad_()},
          {"c", at::full({3}, 2.5f).requires_grad_()}};
}

zero::config::OptimizerConfig adagrad(double initial) {
  zero::config::OptimizerConfig c;
  c.type = zero::config::OptimizerType::kAdagrad;
  c.initial_accumulator_value = initial;
  return c;
}

struct TierCase {
  const char* name;
  bool offload, pin, nvme;
  int64_t sub_group;
  double ratio = 1.0;  // offload_optimizer.ratio (NOTE [partial offload])
  int64_t max_in_cpu = 0;  // with nvme (NOTE [state placement])
};

class StoreTiers : public ::testing::TestWithParam<TierCase> {};

TEST_P(StoreTiers, InitialValuesAndWritesRoundTrip) {
  const TierCase c = GetParam();
  zero::MemoryLedger ledger;
  auto ps = params();
  FlatParameters flat(ps, at::kFloat, at::kCPU, /*world_size=*/2, /*group_numel=*/1000, ledger);
  auto opt = zero::optim::FlatOptimizer::create(adagrad(0.25));
  StoreOptions o;
  o.offload = c.offload;
  o.pin_memory = c.pin;
  o.sub_group_size = c.sub_group;
  o.grad_partition = true;
  o.ratio = c.ratio;
  o.max_in_cpu = c.max_in_cpu;
  const std::string dir = std::string(ZERO_BINARY_DIR) + "/tests/store_" + std::to_string(getpid()) + "_" + c.name;
  if (c.nvme) {
    std::filesystem::create_directories(dir);
    zero::partition::SwapOptions so;
    so.nvme_path = dir;
    so.buffer_count = 2;
    o.nvme = so;
  }
  {
    StateStore store(flat, *opt, o, ledger);
    const int rank = 1;
    store.init([&](size_t g) { return flat.chunk_of(flat.flat(), g, rank); }, [](size_t) {});
    EXPECT_EQ(store.names(), (std::vector<std::string>{"fp32_master", "sum"}));
    // Each group on one tier (state_tiers(): a partial offload's device
    // share, host memory within max_in_cpu, NVMe).
    std::vector<int64_t> chunks;
    for (const auto& grp : flat.groups()) chunks.push_back(grp.chunk_numel);
    const auto tier_of = zero::partition::state_tiers(chunks, c.ratio, c.nvme, c.max_in_cpu);
    const bool on_disk = std::count(tier_of.begin(), tier_of.end(), zero::partition::kStatesOnNvme) > 0;
    EXPECT_EQ(store.tier(), on_disk ? Tier::kNvme : !c.offload ? Tier::kDevice : c.pin ? Tier::kPinnedHost : Tier::kHost);
    // Sub-groups cover every chunk in order, none across two groups.
    int64_t covered = 0;
    for (const auto& sg : store.sub_groups()) {
      EXPECT_LE(sg.numel, c.sub_group);
      EXPECT_LE(sg.start + sg.numel, flat.groups()[sg.group].chunk_numel);
      covered += sg.numel;
    }
    EXPECT_EQ(covered, flat.owned_numel());
    // (Each case with a ratio, or a max_in_cpu short of the partition, uses
    // two tiers or more.)
    int tiers_used = 0;
    for (char t = 0; t < 3; ++t) tiers_used += std::count(tier_of.begin(), tier_of.end(), t) > 0 ? 1 : 0;
    if (c.ratio < 1.0 || (c.max_in_cpu > 0 && c.max_in_cpu < flat.owned_numel())) {
      EXPECT_GE(tiers_used, 2);
    }
    if (c.nvme && c.max_in_cpu >= flat.owned_numel()) {
      EXPECT_FALSE(on_disk);
    }
    for (size_t g = 0; g < flat.groups().size(); ++g) {
      EXPECT_EQ(store.on_host(g), c.offload && tier_of[g] != zero::partition::kStatesOnDevice) << "group " << g;
      EXPECT_EQ(store.on_nvme(g), c.offload && tier_of[g] == zero::partition::kStatesOnNvme) << "group " << g;
      EXPECT_EQ(store.grad(g).numel(), flat.groups()[g].chunk_numel);
      if (store.on_nvme(g)) continue;
      EXPECT_EQ(store.master(g).numel(), flat.groups()[g].chunk_numel);
    }
    EXPECT_EQ(ledger.get(Tier::kNvme).current_bytes > 0, on_disk);
    if (c.ratio < 1.0) {
      EXPECT_GT(ledger.get(Tier::kDevice, zero::Kind::kOptimizerStates).current_bytes, 0);
      EXPECT_GT(ledger.get(Tier::kDevice, zero::Kind::kGradients).current_bytes, 0);
    }
    // First visit: the master is rank 1's chunk, the states the initial value; write new values.
    store.visit(true, [&](size_t k, at::Tensor m, std::vector<at::Tensor> s) {
      const auto& sg = store.sub_groups()[k];
      EXPECT_TRUE(at::equal(m, flat.chunk_of(flat.flat(), sg.group, rank).narrow(0, sg.start, sg.numel)))
          << "sub-group " << k;
      ASSERT_EQ(s.size(), 1u);
      EXPECT_TRUE(at::equal(s[0], at::full({sg.numel}, 0.25f))) << "sub-group " << k;
      m.add_(static_cast<float>(k));
      s[0].fill_(static_cast<float>(k) * 3);
    });
    // Second visit reads what the first wrote.
    store.visit(false, [&](size_t k, at::Tensor m, std::vector<at::Tensor> s) {
      const auto& sg = store.sub_groups()[k];
      const at::Tensor want = flat.chunk_of(flat.flat(), sg.group, rank).narrow(0, sg.start, sg.numel) + k;
      EXPECT_TRUE(at::equal(m, want)) << "sub-group " << k;
      EXPECT_TRUE(at::equal(s[0], at::full({sg.numel}, static_cast<float>(k) * 3))) << "sub-group " << k;
    });
    // The gradient partition: fp32, zero, and zeroed again.
    for (size_t g = 0; g < flat.groups().size(); ++g) EXPECT_EQ(store.grad(g).abs().sum().item<float>(), 0.0f);
    store.grad(0).fill_(1);
    store.zero_grads();
    EXPECT_EQ(store.grad(0).abs().sum().item<float>(), 0.0f);
  }
  if (c.nvme) {
    EXPECT_TRUE(std::filesystem::is_empty(dir)) << "swap files left";
    std::filesystem::remove_all(dir);
  }
  EXPECT_EQ(ledger.get(Tier::kNvme).current_bytes, 0);
  EXPECT_EQ(ledger.get(Tier::kPinnedHost).current_bytes + ledger.get(Tier::kHost).current_bytes, 0)
      << "the store's host buffers are counted while it lives only";
}

INSTANTIATE_TEST_SUITE_P(Tiers, StoreTiers,
                         ::testing::Values(TierCase{"device", false, false, false, 1000000},
                                           TierCase{"device_small", false, false, false, 333},
                                           TierCase{"pinned", true, true, false, 777},
                                           TierCase{"pageable", true, false, false, 1000000},
                                           TierCase{"nvme", true, true, true, 500},
                                           TierCase{"partial", true, true, false, 333, 0.25},
                                           TierCase{"nvme_in_cpu", true, true, true, 500, 1.0, 900},
                                           TierCase{"nvme_partial", true, false, true, 333, 0.5, 500},
                                           TierCase{"nvme_all_in_cpu", true, true, true, 500, 1.0, 100000}),
                         [](const auto& info) { return std::string(info.param.name); });

// NOTE [partial offload]: the host takes groups from the last while it holds
// less than the ratio; the device keeps the rest.
TEST(PartialOffload, HostGroupsAreTheLastUpToTheRatio) {
  using zero::partition::host_groups;
  const std::vector<int64_t> four{100, 100, 100, 100};
  EXPECT_EQ(host_groups(four, 1.0), (std::vector<char>{1, 1, 1, 1}));
  EXPECT_EQ(host_groups(four, 0.0), (std::vector<char>{0, 0, 0, 0}));
  EXPECT_EQ(host_groups(four, 0.25), (std::vector<char>{0, 0, 0, 1}));
  EXPECT_EQ(host_groups(four, 0.3), (std::vector<char>{0, 0, 1, 1}));
  EXPECT_EQ(host_groups(four, 0.75), (std::vector<char>{0, 1, 1, 1}));
  EXPECT_EQ(host_groups({10, 300, 50}, 0.1), (std::vector<char>{0, 0, 1}));
  EXPECT_EQ(host_groups({10, 300, 50}, 0.2), (std::vector<char>{0, 1, 1}));
  EXPECT_EQ(host_groups({}, 0.5), (std::vector<char>{}));
}

// NOTE [state placement]: the device's share as above; with nvme, host
// memory keeps the first offloaded groups while they fit max_in_cpu, and
// from the first that does not, every later one is on NVMe.
TEST(StatePlacement, DeviceThenHostMemoryThenNvme) {
  using zero::partition::state_tiers;
  const std::vector<int64_t> four{100, 100, 100, 100};
  EXPECT_EQ(state_tiers(four, 1.0, false, 250), (std::vector<char>{1, 1, 1, 1}));  // (no NVMe: all in memory)
  EXPECT_EQ(state_tiers(four, 1.0, true, 0), (std::vector<char>{2, 2, 2, 2}));
  EXPECT_EQ(state_tiers(four, 1.0, true, 250), (std::vector<char>{1, 1, 2, 2}));
  EXPECT_EQ(state_tiers(four, 0.75, true, 100), (std::vector<char>{0, 1, 2, 2}));
  EXPECT_EQ(state_tiers(four, 0.5, true, 1000), (std::vector<char>{0, 0, 1, 1}));
  EXPECT_EQ(state_tiers(four, 0.0, true, 0), (std::vector<char>{0, 0, 0, 0}));
  // A smaller group after one that did not fit goes to NVMe too.
  EXPECT_EQ(state_tiers({100, 300, 50}, 1.0, true, 200), (std::vector<char>{1, 2, 2}));
}

// 8-bit Adam's min_8bit_size (NOTE [8-bit states]): each rank's store marks
// exactly the blocks of each sub-group (from its first element) that hold
// an element of a parameter under the size, found here independently by
// writing 1 through the small parameters' own views into the flat buffer;
// on the device and on NVMe (whose files take each sub-group's length), at
// sub-groups that split blocks and groups after the first.
TEST(StateStore, MarksTheBlocksOfSmallParametersFp32) {
  for (const int mode : {0, 1, 2}) {  // in memory; on NVMe; group 0 in memory (max_in_cpu), the rest on NVMe
    const bool nvme = mode > 0;
    for (const int64_t rank : {0, 1}) {
      zero::MemoryLedger ledger;
      std::vector<std::pair<std::string, at::Tensor>> ps{
          {"w0", at::zeros({1500}).requires_grad_()}, {"b0", at::zeros({30}).requires_grad_()},
          {"w1", at::zeros({2000}).requires_grad_()}, {"b1", at::zeros({300}).requires_grad_()},
          {"n1", at::zeros({5}).requires_grad_()},    {"w2", at::zeros({1200}).requires_grad_()},
          {"b2", at::zeros({700}).requires_grad_()},  {"w3", at::zeros({3000}).requires_grad_()}};
      FlatParameters flat(ps, at::kFloat, at::kCPU, /*world_size=*/2, /*group_numel=*/4000, ledger);
      ASSERT_GE(flat.groups().size(), 2u);
      zero::config::OptimizerConfig c;
      c.type = zero::config::OptimizerType::kAdamW;
      c.optim_bits = 8;
      c.min_8bit_size = 1000;
      auto opt = zero::optim::FlatOptimizer::create(c);
      // 1 where an element is a small parameter's, through the parameters' views.
      flat.flat().detach().zero_();
      for (auto& slot : flat.slots())
        if (slot.numel < 1000) slot.param.detach().fill_(1);
      StoreOptions o;
      o.sub_group_size = 700;
      o.layout_rank = rank;
      const std::string dir = std::string(ZERO_BINARY_DIR) + "/tests/store_marks_" + std::to_string(getpid());
      if (nvme) {
        std::filesystem::create_directories(dir);
        zero::partition::SwapOptions so;
        so.nvme_path = dir;
        so.buffer_count = 2;
        o.offload = true;
        o.nvme = so;
        if (mode == 2) o.max_in_cpu = flat.groups()[0].chunk_numel;
      }
      {
        StateStore store(flat, *opt, o, ledger);
        if (mode == 2) {
          EXPECT_TRUE(!store.on_nvme(0) && store.on_nvme(1));
        }
        store.init([&](size_t g) { return flat.chunk_of(flat.flat(), g, rank); }, [](size_t) {});
        int64_t marked = 0;
        store.visit(false, [&](size_t k, at::Tensor m, std::vector<at::Tensor> st) {
          ASSERT_EQ(st.size(), 6u);
          std::vector<int64_t> want;
          for (int64_t b = 0; b * 256 < m.numel(); ++b)
            if (m.narrow(0, b * 256, std::min<int64_t>(256, m.numel() - b * 256)).max().item<float>() > 0)
              want.push_back(b);
          EXPECT_EQ(store.fp32_blocks(k), want) << "rank " << rank << " sub-group " << k;
          EXPECT_EQ(st[4].numel(), 256 * std::max<int64_t>(1, static_cast<int64_t>(want.size())));
          for (int64_t b = 0; b < st[1].numel(); ++b) {
            const auto it = std::find(want.begin(), want.end(), b);
            const float mark = it == want.end() ? 0.0f : -static_cast<float>(it - want.begin() + 1);
            EXPECT_EQ(st[1][b].item<float>(), mark) << "sub-group " << k << " block " << b;
            EXPECT_EQ(st[3][b].item<float>(), mark) << "sub-group " << k << " block " << b;
          }
          marked += static_cast<int64_t>(want.size());
        });
        // Rank 0 holds b0 (group 0); rank 1 b1 and n1 (group 0) and b2 (group 1).
        EXPECT_GE(marked, rank == 0 ? 1 : 4) << "rank " << rank;
      }
      if (nvme) ASSERT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
    }
  }
}

// fp32 parameters in one partition: the master is the parameters themselves.
TEST(StateStore, TheMasterCanBeTheParameters) {
  zero::MemoryLedger ledger;
  auto ps = params();
  FlatParameters flat(ps, at::kFloat, at::kCPU, 1, 1000, ledger);
  auto opt = zero::optim::FlatOptimizer::create(adagrad(0.0));
  StateStore store(flat, *opt, {}, ledger, [&](size_t g) { return flat.chunk_of(flat.flat(), g, 0); });
  store.init([](size_t) -> at::Tensor { ADD_FAILURE() << "nothing to copy"; return {}; }, [](size_t) {});
  EXPECT_TRUE(store.master_is_param());
  EXPECT_EQ(ledger.get(Tier::kDevice, zero::Kind::kOptimizerStates).current_bytes,
            flat.owned_numel() * 4) << "one state (Adagrad's sum), no master copy";
  store.visit(true, [](size_t, at::Tensor m, std::vector<at::Tensor>) { m.fill_(9); });
  EXPECT_EQ(ps[0].second.detach().min().item<float>(), 9.0f) << "the parameters were the master";
}

// NOTE [flat layout]: groups padded to a multiple of world_size * 256, rank r
// owning chunk r of each; a tied parameter once; parameters rebound to views.
TEST(FlatLayout, GroupsPadChunksAndViews) {
  zero::MemoryLedger ledger;
  auto ps = params();
  ps.push_back({"a_again", ps[0].second});  // tied: laid out once
  FlatParameters flat(ps, at::kFloat, at::kCPU, 3, 1000, ledger);
  ASSERT_EQ(flat.slots().size(), 3u);
  EXPECT_EQ(flat.numel(), 700 + 2500 + 3);
  // a (700) alone; b (2500) alone (larger than a group); c (3) alone.
  ASSERT_EQ(flat.groups().size(), 3u);
  int64_t owned = 0;
  for (const auto& g : flat.groups()) {
    EXPECT_EQ(g.padded_numel % (3 * zero::partition::kPartitionAlignNumel), 0);
    EXPECT_EQ(g.chunk_numel * 3, g.padded_numel);
    EXPECT_EQ(g.owned_offset, owned);
    owned += g.chunk_numel;
  }
  EXPECT_EQ(flat.owned_numel(), owned);
  EXPECT_EQ(flat.groups()[1].padded_numel, 3072);  // 2500 up to a multiple of 768
  // The parameter is a view of the flat buffer; padding is zero.
  ps[1].second.detach().fill_(5);
  EXPECT_EQ(flat.group_of(flat.flat(), 1).narrow(0, 0, 2500).min().item<float>(), 5.0f);
  EXPECT_EQ(flat.group_of(flat.flat(), 1).narrow(0, 2500, 572).abs().sum().item<float>(), 0.0f);
  // chunk r of a group is its r-th third.
  EXPECT_TRUE(at::equal(flat.chunk_of(flat.flat(), 1, 2), flat.group_of(flat.flat(), 1).narrow(0, 2048, 1024)));
}

}  // namespace
