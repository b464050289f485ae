// Comm over Gloo with ranks as threads (tests/support/ranks.h): every
// collective's result, the control group's exchanges, and a disagreement
// between ranks named by check_same.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "ranks.h"  // tests/support
#include "zero/core/error.h"

namespace {

TEST(Comm, CollectivesOnThreeRanks) {
  zero::testing::on_ranks(3, [](int rank, zero::Comm& comm) {
    EXPECT_EQ(comm.rank(), rank);
    EXPECT_EQ(comm.world_size(), 3);
    at::Tensor t = at::full({4}, static_cast<float>(rank + 1));
    comm.all_reduce_sum(t).wait();
    EXPECT_TRUE(at::equal(t, at::full({4}, 6.0f)));
    at::Tensor m = at::full({2}, static_cast<float>(rank));
    comm.all_reduce_max(m).wait();
    EXPECT_TRUE(at::equal(m, at::full({2}, 2.0f)));
    // all_gather: rank r's piece lands in chunk r.
    at::Tensor out = at::empty({6});
    comm.all_gather(out, at::full({2}, static_cast<float>(rank))).wait();
    EXPECT_TRUE(at::equal(out, at::tensor({0.f, 0.f, 1.f, 1.f, 2.f, 2.f})));
    // reduce_scatter: rank r gets the sum of every rank's chunk r.
    at::Tensor in = at::arange(6, at::kFloat) * (rank + 1);
    at::Tensor mine = at::empty({2});
    comm.reduce_scatter_sum(mine, in).wait();
    EXPECT_TRUE(at::equal(mine, at::arange(6, at::kFloat).narrow(0, 2 * rank, 2) * 6));
    at::Tensor b = at::full({3}, static_cast<float>(rank));
    comm.broadcast(b, 1).wait();
    EXPECT_TRUE(at::equal(b, at::full({3}, 1.0f)));
    comm.barrier();
    EXPECT_EQ(comm.exchange(10 * rank, "test"), (std::vector<int64_t>{0, 10, 20}));
    comm.check_same("answer", "42");  // all agree: no error
  });
}

TEST(Comm, CheckSameNamesTheRanksThatDiffer) {
  std::vector<std::string> messages(2);
  zero::testing::on_ranks(2, [&](int rank, zero::Comm& comm) {
    try {
      comm.check_same("model fingerprint", rank == 0 ? "a" : "b");
      ADD_FAILURE() << "rank " << rank << ": expected a ConfigError";
    } catch (const zero::ConfigError& e) {
      messages[static_cast<size_t>(rank)] = e.what();
    }
  });
  for (const auto& m : messages)
    EXPECT_NE(m.find("ranks disagree on the model fingerprint: rank 1 differ"), std::string::npos) << m;
}

}  // namespace
