// Comm over Gloo with ranks as threads (tests/support/ranks.h): every
// collective's result, the control group's exchanges, and a disagreement
// between ranks named by check_same.
#include <vector>

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

// NOTE [bytes across nodes]: 4 ranks on 2 nodes of 2, over Gloo, whose
// all-gather sends to the next rank and whose all-reduce (and so its
// reduce-scatter) to the previous one. Each collective adds its ring share
// on the side of that neighbour's node.
TEST(Comm, CountsTheBytesEachCollectiveSendsWithinAndAcrossNodes) {
  std::vector<zero::CommBytes> sent(4);
  std::vector<int> next(4), previous(4);
  zero::testing::on_ranks(
      4,
      [&](int rank, zero::Comm& comm) {
        EXPECT_EQ(comm.node(), rank / 2);
        next[static_cast<size_t>(rank)] = comm.next_node();
        previous[static_cast<size_t>(rank)] = comm.previous_node();
        const zero::CommBytes start = comm.bytes_sent();
        EXPECT_EQ(start.within_node + start.across_nodes, 0) << "nothing counted before the first collective";
        at::Tensor out = at::empty({4 * 1000});                        // 16000 bytes out: 12000 sent, to the next
        comm.all_gather(out, at::full({1000}, 1.0f)).wait();
        at::Tensor t = at::full({500}, 1.0f);                           // 2000 bytes: 2 x 1500, to the previous
        comm.all_reduce_sum(t).wait();
        at::Tensor m = at::full({250}, static_cast<float>(rank));      // 1000 bytes: 2 x 750
        comm.all_reduce_max(m).wait();
        at::Tensor in = at::ones({4 * 250}), mine = at::empty({250});  // 4000 bytes in: an all-reduce's 6000
        comm.reduce_scatter_sum(mine, in).wait();
        at::Tensor b = at::zeros({100});                                // 400 bytes to the next, from rank 2 on
        comm.broadcast(b, 2).wait();
        sent[static_cast<size_t>(rank)] = comm.bytes_sent();
        EXPECT_TRUE(comm.reduce_scatter_copies_input());
      },
      /*per_node=*/2);
  EXPECT_EQ(next, (std::vector<int>{0, 1, 1, 0}));
  EXPECT_EQ(previous, (std::vector<int>{1, 0, 0, 1}));
  const int64_t to_next = 12000, to_previous = 3000 + 1500 + 6000;
  EXPECT_EQ(sent[0].within_node, to_next + 400);  // to rank 1
  EXPECT_EQ(sent[0].across_nodes, to_previous);   // to rank 3
  EXPECT_EQ(sent[1].within_node, to_previous);    // the rank before the root sends none of the broadcast
  EXPECT_EQ(sent[1].across_nodes, to_next);
  EXPECT_EQ(sent[2].within_node, to_next + 400);
  EXPECT_EQ(sent[2].across_nodes, to_previous);
  EXPECT_EQ(sent[3].within_node, to_previous);
  EXPECT_EQ(sent[3].across_nodes, to_next + 400);
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
