// ZeRO++'s qwZ and hpZ on stage 3's coordinator, 4 ranks as threads on 2
// nodes of 2 (ranks.h): the quantized gather's error against its arithmetic
// (NOTE [quantized gather]), its bytes, and the secondary partition's gathers
// staying in the node with the bits of the first gather (NOTE [hpZ]).
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/nn/modules/linear.h>

#include "ranks.h"
#include "zero/partition/flat_parameters.h"
#include "zero/partition/quantized_gather.h"
#include "zero/partition/quantized_reduce.h"
#include "zero/partition/stage3.h"

namespace zero::partition {
namespace {

constexpr int kWorld = 4, kPerNode = 2;

// A layer whose rows differ in scale by 10^3, so that blocks have their own
// maxima; the same values on every rank.
struct Layer {
  torch::nn::Linear linear{torch::nn::LinearOptions(48, 50)};
  at::Tensor exact;  // its parameters laid end to end, before partitioning
  MemoryLedger ledger;
  std::unique_ptr<FlatParameters> flat;
  std::shared_ptr<Stage3Coordinator> coordinator;

  Layer(Comm& comm, Stage3Options options) {
    {
      // Not from the random generator, which the ranks' threads share.
      at::NoGradGuard no_grad;
      const at::Tensor rows = at::pow(10.0, at::linspace(-2, 1, 50)).unsqueeze(1);
      linear->weight.copy_(at::sin(at::arange(50 * 48, at::kFloat) * 0.37f).view({50, 48}) * rows);
      linear->bias.copy_(at::cos(at::arange(50, at::kFloat) * 1.3f));
    }
    exact = at::cat({linear->weight.detach().reshape(-1), linear->bias.detach()});
    std::vector<GroupSpec> groups(2);
    groups[1].name = "fc";
    for (const auto& p : linear->named_parameters()) groups[1].params.emplace_back(p.key(), p.value());
    flat = std::make_unique<FlatParameters>(std::move(groups), at::kFloat, at::kCPU, comm.world_size(), comm.rank(),
                                            Tier::kDevice, ledger);
    Stage3Unit unit{"fc", linear.ptr(), {1}};
    options.prefetch_bucket_numel = 0;
    options.max_reuse_distance = 0;  // released after each use: every use gathers
    coordinator = Stage3Coordinator::create(*flat, {unit}, options, at::kCPU, &comm, ledger);
  }
  at::Tensor gathered() const {
    return at::cat({linear->weight.detach().reshape(-1), linear->bias.detach()}).clone();
  }
};

// Each element of the gathered layer is within half a quantization step of
// its value, max|x| / 254 of its block (a rank's chunk cut in blocks), plus
// fp32's rounding of code * scale; every rank decodes the same bits; the
// all-gather sends codes and scales, a quarter of the fp32 bytes and 4 a
// block; an exact gather (what saving the model reads) is the shards' values.
TEST(QuantizedGather, EachElementIsWithinHalfAStepOfItsBlock) {
  constexpr int64_t kBlock = 64;
  std::vector<at::Tensor> seen(kWorld);
  std::mutex mu;
  testing::on_ranks(
      kWorld,
      [&](int rank, Comm& comm) {
        Stage3Options o;
        o.quantize_weights = true;
        o.quant_block = kBlock;
        Layer layer(comm, o);
        const auto& info = layer.flat->groups()[1];
        const CommBytes before = comm.bytes_sent();
        layer.coordinator->pre_forward(0);
        const CommBytes sent = comm.bytes_sent() - before;
        const at::Tensor got = layer.gathered();
        {
          std::lock_guard<std::mutex> lock(mu);
          seen[static_cast<size_t>(rank)] = got;
        }
        // The bound, block by block of each rank's chunk.
        at::Tensor padded = at::zeros({info.padded_numel});
        padded.narrow(0, 0, layer.exact.numel()).copy_(layer.exact);
        const int64_t chunk = info.chunk_numel, blocks = (chunk + kBlock - 1) / kBlock;
        at::Tensor bound = at::empty_like(padded);
        for (int64_t r = 0; r < kWorld; ++r)
          for (int64_t b = 0; b < blocks; ++b) {
            const int64_t begin = r * chunk + b * kBlock, len = std::min(kBlock, chunk - b * kBlock);
            const at::Tensor x = padded.narrow(0, begin, len);
            bound.narrow(0, begin, len).fill_(x.abs().max().item<float>() / 254.0f);
          }
        bound = bound.narrow(0, 0, layer.exact.numel());
        const at::Tensor err = (got - layer.exact).abs();
        const at::Tensor slack = bound * 1e-6 + layer.exact.abs() * 1.2e-7;  // fp32's rounding of q * s
        EXPECT_TRUE(at::all(err <= bound + slack).item<bool>())
            << "rank " << rank << ": worst excess " << (err - bound).max().item<float>();
        EXPECT_GT(err.max().item<float>(), 0.0f) << "nothing was quantized";
        const int64_t payload = quantized_payload_bytes(chunk, kBlock);
        EXPECT_EQ(payload, chunk + blocks * 4);
        EXPECT_EQ(sent.within_node + sent.across_nodes, payload * kWorld * (kWorld - 1) / kWorld);
        EXPECT_LT(payload * 3, chunk * 4) << "the codes are not much smaller than fp32";
        layer.coordinator->post_forward(0);
        layer.coordinator->end_backward();
        layer.coordinator->with_gathered(1, [&] { EXPECT_TRUE(at::equal(layer.gathered(), layer.exact)); });
      },
      kPerNode);
  for (int r = 1; r < kWorld; ++r) EXPECT_TRUE(at::equal(seen[0], seen[static_cast<size_t>(r)])) << "rank " << r;
}

// A block of zeros has codes 0 and scale 0; a shard's last block may be
// short; the payloads of several ranks decode each into its place.
TEST(QuantizedGather, ZeroBlocksAndAShortLastBlock) {
  const int64_t n = 10, block = 4;
  at::Tensor a = at::tensor({0.f, 0.f, 0.f, 0.f, 1.f, -2.f, 0.5f, 0.25f, 3.f, -3.f});
  at::Tensor b = at::zeros({n});
  const int64_t bytes = quantized_payload_bytes(n, block);
  EXPECT_EQ(bytes, 3 * 4 + 3 * 4);
  at::Tensor gathered = at::empty({2 * bytes}, at::kByte);
  at::Tensor pa = gathered.narrow(0, 0, bytes), pb = gathered.narrow(0, bytes, bytes);
  quantize_shard(a, pa, block);
  quantize_shard(b, pb, block);
  at::Tensor full = at::full({2 * n}, 9.f);
  dequantize_gathered(gathered, full, 2, block);
  EXPECT_TRUE(at::equal(full.narrow(0, 10, 10), b));
  EXPECT_TRUE(at::equal(full.narrow(0, 0, 4), at::zeros({4})));
  EXPECT_EQ(full[5].item<float>(), -2.f);
  EXPECT_EQ(full[8].item<float>(), 3.f);
  EXPECT_EQ(full[9].item<float>(), -3.f);
  EXPECT_NEAR(full[6].item<float>(), 0.5f, 2.f / 254);
}

// qgZ's two hops (NOTE [quantized gradients]) on M nodes of L ranks (2 x 2,
// 3 x 2, 2 x 3, one node of 4, 4 nodes of one): each rank's reduced chunk
// is the sum over the ranks within the bound of the arithmetic: each
// source's first-hop quantization (max|x| / 254 of its block) plus each
// node's second-hop one (of its partial sum); only the second hop crosses
// nodes, one int8 chunk to each other node.
class QuantizedGradients : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(QuantizedGradients, TwoHopsSumWithinTheQuantizationBound) {
  const int world = GetParam().first, per_node = GetParam().second;
  const int64_t kChunk = 300, kBlock = 64, M = world / per_node, L = per_node;
  // Rank s's bucket: `world` chunks, scales apart by 10^3 across it.
  auto input = [&](int64_t s) {
    const at::Tensor i = at::arange(world * kChunk, at::kFloat);
    return at::sin(i * 0.11f + static_cast<float>(s)) * at::pow(10.0, at::linspace(-2, 1, world * kChunk));
  };
  // The error bound of each element of chunk r.
  auto bound_of = [&](int64_t r) {
    const int64_t m = r / L, l = r % L;
    at::Tensor total = at::zeros({kChunk});
    auto block_max = [&](const at::Tensor& row) {  // max|x| of each element's block in `row`
      at::Tensor out = at::empty_like(row);
      for (int64_t b = 0; b < row.numel(); b += kBlock) {
        const int64_t len = std::min(kBlock, row.numel() - b);
        out.narrow(0, b, len).fill_(row.narrow(0, b, len).abs().max().item<float>());
      }
      return out;
    };
    for (int64_t node = 0; node < M; ++node) {
      at::Tensor hop1 = at::zeros({kChunk}), partial = at::zeros({kChunk});
      for (int64_t peer = 0; peer < L; ++peer) {
        // Source node*L + peer sends local rank l the chunks m'' L + l, one row.
        const at::Tensor in = input(node * L + peer).view({M, L, kChunk});
        const at::Tensor row = in.select(1, l).reshape({-1});
        hop1 += block_max(row).narrow(0, m * kChunk, kChunk) / 254;
        partial += in[m][l];
      }
      total += hop1 + block_max(partial.abs() + hop1) / 254;
    }
    return total;
  };
  testing::on_ranks(
      world,
      [&](int rank, Comm& comm) {
        QuantizedReduceScatter q(comm, kBlock);
        at::Tensor exact = at::zeros({kChunk});
        for (int64_t s = 0; s < world; ++s) exact += input(s).narrow(0, rank * kChunk, kChunk);
        const CommBytes before = comm.bytes_sent();
        auto pending = q.start(input(rank));
        at::Tensor out = at::empty({kChunk});
        q.finish(pending, out);
        const CommBytes sent = comm.bytes_sent() - before;
        const at::Tensor err = (out - exact).abs(), bound = bound_of(rank);
        EXPECT_TRUE(at::all(err <= bound * 1.0001 + exact.abs() * 1e-6).item<bool>())
            << "rank " << rank << ": worst excess " << (err - bound).max().item<float>();
        EXPECT_GT(err.max().item<float>(), 0.0f) << "nothing was quantized";
        EXPECT_EQ(sent.across_nodes, (M - 1) * quantized_payload_bytes(kChunk, kBlock));
        EXPECT_EQ(sent.within_node, (L - 1) * quantized_payload_bytes(M * kChunk, kBlock));
      },
      per_node);
}

INSTANTIATE_TEST_SUITE_P(Nodes, QuantizedGradients,
                         ::testing::Values(std::pair{4, 2}, std::pair{6, 2}, std::pair{6, 3}, std::pair{4, 4},
                                           std::pair{4, 1}),
                         [](const ::testing::TestParamInfo<std::pair<int, int>>& i) {
                           return std::to_string(i.param.first / i.param.second) + "x" +
                                  std::to_string(i.param.second);
                         });

// hpZ over nodes of 2: backward's gather of the layer comes from the node's
// secondary partition, sends nothing across nodes, and gives the bits the
// forward's gather gave (qwZ's values too: nothing is quantized twice); the
// secondary partition is a half of the layer, in the ledger, until the step.
class Hpz : public ::testing::TestWithParam<bool> {};

TEST_P(Hpz, BackwardGathersStayInTheNodeWithTheForwardBits) {
  const bool quantized = GetParam();
  testing::on_ranks(
      kWorld,
      [&](int rank, Comm& comm) {
        Stage3Options o;
        o.hpz_partition_size = kPerNode;
        o.quantize_weights = quantized;
        o.quant_block = 64;
        Layer layer(comm, o);
        const int64_t at_rest = layer.ledger.get(Tier::kDevice, Kind::kParameters).current_bytes;
        const CommBytes start = comm.bytes_sent();
        layer.coordinator->pre_forward(0);
        const CommBytes forward = comm.bytes_sent() - start;
        const at::Tensor first = layer.gathered();
        layer.coordinator->post_forward(0);
        const int64_t half = layer.flat->groups()[1].padded_numel / kPerNode * 4;
        EXPECT_EQ(layer.coordinator->secondary_bytes(), half);
        EXPECT_EQ(layer.ledger.get(Tier::kDevice, Kind::kParameters).current_bytes, at_rest + half)
            << "the shards, group 0 and the secondary partition; the layer released";
        if (comm.next_node() != comm.node()) EXPECT_GT(forward.across_nodes, 0);  // the ring's link between nodes
        const CommBytes mid = comm.bytes_sent();
        layer.coordinator->pre_backward(0);
        const CommBytes backward = comm.bytes_sent() - mid;
        EXPECT_TRUE(at::equal(layer.gathered(), first)) << "rank " << rank;
        EXPECT_EQ(backward.across_nodes, 0);
        EXPECT_EQ(backward.within_node, layer.flat->groups()[1].padded_numel * 4 / kPerNode);
        if (!quantized) EXPECT_TRUE(at::equal(first, layer.exact));
        layer.coordinator->post_backward(0);
        layer.coordinator->end_backward();
        EXPECT_EQ(layer.coordinator->secondary_bytes(), half) << "kept for the next micro-step";
        // What saving reads is the shards' values, not the node's copy of qwZ's.
        layer.coordinator->with_gathered(1, [&] { EXPECT_TRUE(at::equal(layer.gathered(), layer.exact)); });
        EXPECT_EQ(layer.coordinator->secondary_bytes(), half);
        layer.coordinator->after_step();
        EXPECT_EQ(layer.coordinator->secondary_bytes(), 0) << "the step changed the shards";
      },
      kPerNode);
}

INSTANTIATE_TEST_SUITE_P(Quantized, Hpz, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "QwZ" : "Exact"; });

// NOTE [hierarchical gather] on 2 nodes of 2: the layer's bits are a flat
// gather's (qwZ's decoded values too); each rank sends one shard across
// nodes, where the flat ring sends three from the rank at a node's edge and
// none from the other, and the two within-node gathers send the rest.
class HierarchicalGather : public ::testing::TestWithParam<bool> {};

TEST_P(HierarchicalGather, TheBitsOfAFlatGatherOneShardARankAcrossNodes) {
  const bool quantized = GetParam();
  testing::on_ranks(
      kWorld,
      [&](int rank, Comm& comm) {
        std::vector<at::Tensor> gathered;
        std::vector<CommBytes> bytes;
        at::Tensor exact;
        for (const bool hierarchical : {false, true}) {
          Stage3Options o;
          o.hierarchical_gather = hierarchical;
          o.quantize_weights = quantized;
          o.quant_block = 64;
          Layer layer(comm, o);
          const CommBytes start = comm.bytes_sent();
          layer.coordinator->pre_forward(0);
          bytes.push_back(comm.bytes_sent() - start);
          gathered.push_back(layer.gathered());
          layer.coordinator->post_forward(0);
          if (hierarchical && !quantized) {  // the other node's shard and this rank's, staged
            EXPECT_GE(layer.ledger.get(Tier::kDevice, Kind::kCommBuffers).peak_bytes,
                      2 * layer.flat->groups()[1].chunk_numel * 4);
          }
          exact = layer.exact;
        }
        EXPECT_TRUE(at::equal(gathered[0], gathered[1])) << "rank " << rank;
        if (!quantized) {
          EXPECT_TRUE(at::equal(gathered[1], exact));
        }
        const int64_t sent = bytes[0].within_node + bytes[0].across_nodes;  // a flat ring: 3 shards
        EXPECT_EQ(bytes[1].across_nodes, sent / 3) << "rank " << rank << ": one shard across";
        EXPECT_EQ(bytes[1].within_node, 2 * sent / 3) << "rank " << rank << ": one shard within, per node's block";
        EXPECT_EQ(bytes[0].across_nodes, comm.next_node() != comm.node() ? sent : 0);
      },
      kPerNode);
}

INSTANTIATE_TEST_SUITE_P(Quantized, HierarchicalGather, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "QwZ" : "Exact"; });

}  // namespace
}  // namespace zero::partition
