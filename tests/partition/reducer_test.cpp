// The gradient reducers (NOTE [gradient path]) in one process: two ranks as
// threads over Gloo, gradients handed in directly, the reduced owned chunks
// checked against the sums computed here. Also the keys that shape the
// reduction: communication_data_type, the pre-scale of prescale_gradients and
// gradient_predivide_factor, gradient_allreduce_op, reduce_scatter,
// contiguous_gradients.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include <ATen/ATen.h>

#include "ranks.h"  // tests/support
#include "zero/core/memory_ledger.h"
#include "zero/optim/flat_optimizer.h"
#include "zero/partition/zero_optimizer.h"

namespace {

using zero::partition::ZeroOptimizer;
using zero::partition::ZeroOptimizerOptions;

constexpr int kWorld = 2;
const std::vector<int64_t> kSizes = {300, 1000, 50};  // with 600-element buckets: three groups

std::vector<std::pair<std::string, at::Tensor>> make_params() {
  std::vector<std::pair<std::string, at::Tensor>> ps;
  for (size_t i = 0; i < kSizes.size(); ++i)
    ps.emplace_back("p" + std::to_string(i), at::linspace(-1, 1, kSizes[i], at::kFloat).requires_grad_());
  return ps;
}

// Rank r's gradient of parameter i: values with low bits set (bf16 rounding shows).
at::Tensor grad_of(int rank, size_t i, double magnitude = 1.0) {
  auto gen = at::detail::createCPUGenerator(1000 * static_cast<uint64_t>(rank) + i + 1);
  return at::randn({kSizes[i]}, gen) * magnitude + 1.0 / 3.0;
}

zero::config::OptimizerConfig adam() {
  zero::config::OptimizerConfig c;
  c.type = zero::config::OptimizerType::kAdamW;
  c.lr = 1e-3;
  return c;
}

ZeroOptimizerOptions options(int stage) {
  ZeroOptimizerOptions o;
  o.stage = stage;
  o.bucket_numel = 600;
  o.reduction.overlap_comm = true;
  return o;
}

// One backward on rank r of `opt`: gradients in reverse order, as autograd produces them.
void backward(ZeroOptimizer& opt, int rank, double magnitude = 1.0, at::ScalarType dtype = at::kFloat) {
  opt.begin_backward(/*boundary=*/true);
  for (size_t i = kSizes.size(); i-- > 0;) opt.on_grad_ready(i, grad_of(rank, i, magnitude).to(dtype));
  opt.end_backward();
}

// The flat sum over ranks of the gradients, laid out like `opt`'s parameters.
at::Tensor expected_flat(const ZeroOptimizer& opt, double magnitude = 1.0,
                         std::optional<at::ScalarType> through = std::nullopt) {
  const auto& flat = opt.parameters();
  at::Tensor sum = at::zeros({flat.padded_numel()}, at::kFloat);
  for (const auto& slot : flat.slots()) {
    const size_t i = static_cast<size_t>(std::stoi(slot.name.substr(1)));
    at::Tensor total = at::zeros({slot.numel}, at::kFloat);
    for (int r = 0; r < kWorld; ++r) {
      at::Tensor g = grad_of(r, i, magnitude);
      total += through ? g.to(*through).to(at::kFloat) : g;
    }
    sum.narrow(0, slot.offset, slot.numel).copy_(through ? total.to(*through).to(at::kFloat) : total);
  }
  return sum;
}

struct StageCase {
  int stage;
  bool offload;
  int64_t staging = 0;  // host_staging_numel (0: the default)
};

class Reducer : public ::testing::TestWithParam<StageCase> {};

// Each rank's owned chunk is the sum over ranks of that chunk: stage 1
// (all-reduce), stage 2 (reduce-scatter), stage 2 offloaded (the chunks
// go to the host through the pinned staging buffers).
TEST_P(Reducer, OwnedChunksAreTheSumOverRanks) {
  const auto c = GetParam();
  zero::testing::on_ranks(kWorld, [&](int rank, zero::Comm& comm) {
    zero::MemoryLedger ledger;
    auto o = options(c.stage);
    o.offload_optimizer = c.offload;
    if (c.staging > 0) o.reduction.host_staging_numel = c.staging;
    ZeroOptimizer opt(make_params(), zero::optim::FlatOptimizer::create(adam()), o, ledger, &comm);
    backward(opt, rank);
    const at::Tensor want = expected_flat(opt);
    for (size_t g = 0; g < opt.parameters().groups().size(); ++g) {
      const at::Tensor got = opt.reducer().owned(g).to(at::kFloat);
      const at::Tensor exp = opt.parameters().chunk_of(want, g, rank);
      EXPECT_TRUE(at::allclose(got, exp, 1e-6, 1e-6)) << "rank " << rank << " group " << g;
    }
    EXPECT_EQ(opt.reducer().owned_in_store(), c.stage >= 2);
  });
}

INSTANTIATE_TEST_SUITE_P(Stages, Reducer,
                         ::testing::Values(StageCase{1, false}, StageCase{2, false}, StageCase{2, true},
                                           StageCase{1, true}, StageCase{2, true, 7}),
                         [](const auto& info) {
                           return "stage" + std::to_string(info.param.stage) + (info.param.offload ? "_offload" : "") +
                                  (info.param.staging ? "_pieces" + std::to_string(info.param.staging) : "");
                         });

// communication_data_type bf16: the reduction runs in bf16, so every reduced
// element is a bf16 value (the bf16 sum of the bf16-rounded gradients); in
// fp32 (unset) most are not.
TEST(ReducerKeys, CommunicationDataTypeBf16ReducesInBf16) {
  for (const int stage : {1, 2}) {
    zero::testing::on_ranks(kWorld, [&](int rank, zero::Comm& comm) {
      for (const bool bf16 : {false, true}) {
        zero::MemoryLedger ledger;
        auto o = options(stage);
        if (bf16) o.reduction.comm_dtype = at::kBFloat16;
        ZeroOptimizer opt(make_params(), zero::optim::FlatOptimizer::create(adam()), o, ledger, &comm);
        backward(opt, rank);
        int64_t representable = 0, total = 0;
        for (size_t g = 0; g < opt.parameters().groups().size(); ++g) {
          const at::Tensor got = opt.reducer().owned(g).to(at::kFloat);
          representable += at::eq(got, got.to(at::kBFloat16).to(at::kFloat)).sum().item<int64_t>();
          total += got.numel();
          if (bf16) {
            const at::Tensor exp = opt.parameters().chunk_of(expected_flat(opt, 1.0, at::kBFloat16), g, rank);
            EXPECT_TRUE(at::allclose(got, exp, 1e-2, 1e-2)) << "stage " << stage << " group " << g;
          }
        }
        if (bf16) EXPECT_EQ(representable, total) << "stage " << stage << ": reduced in bf16";
        else EXPECT_LT(representable, total / 2) << "stage " << stage << ": reduced in fp32";
      }
    });
  }
}

// gradient_predivide_factor (a pre-scale of 1/f before the sum) keeps fp16
// buckets whose sum would overflow finite: 40000 + 40000 passes fp16's 65504,
// 20000 + 20000 does not. The step divides the rest out, so the gradient
// norm (a power-of-two factor: exactly) is that of the unscaled sum.
TEST(ReducerKeys, PredivideKeepsAnFp16SumFiniteAndTheStepDividesTheRestOut) {
  zero::testing::on_ranks(kWorld, [&](int rank, zero::Comm& comm) {
    std::vector<double> norms;
    for (const double pre : {1.0, 0.5}) {
      zero::MemoryLedger ledger;
      auto o = options(2);
      o.compute_dtype = at::kHalf;
      o.grad_accum_dtype = at::kHalf;
      o.reduction.pre_scale = pre;
      o.check_overflow = true;
      ZeroOptimizer opt(make_params(), zero::optim::FlatOptimizer::create(adam()), o, ledger, &comm);
      // Gradients near 40000: their sum over two ranks overflows fp16.
      opt.begin_backward(true);
      for (size_t i = kSizes.size(); i-- > 0;) opt.on_grad_ready(i, at::full({kSizes[i]}, 40000.0f).to(at::kHalf));
      opt.end_backward();
      const bool finite = at::isfinite(opt.reducer().owned(1).to(at::kFloat)).all().item<bool>();
      EXPECT_EQ(finite, pre != 1.0) << "pre-scale " << pre;
      const auto out = opt.step({1, 1e-3, 0.9, 0.999}, /*loss_scale=*/1.0, /*clip=*/0.0);
      EXPECT_EQ(out.applied, pre != 1.0) << "an overflowing step is skipped";
      if (out.applied) norms.push_back(out.grad_norm);
    }
    ASSERT_EQ(norms.size(), 1u);
    // Each element averages to 40000 over the 1350 parameters (the norm is summed in fp32).
    EXPECT_NEAR(norms[0], 40000.0 * std::sqrt(1350.0), 1e-6 * 40000.0 * std::sqrt(1350.0));
  });
}

// prescale_gradients divides by the world size before the sum; the norm the
// step sees is the average's, as without it (exactly, for a power of two).
TEST(ReducerKeys, PrescaleAndGradientAllreduceOpSum) {
  zero::testing::on_ranks(kWorld, [&](int rank, zero::Comm& comm) {
    std::vector<double> norms;
    for (const int variant : {0, 1, 2}) {  // plain, prescale, sum instead of mean
      zero::MemoryLedger ledger;
      auto o = options(2);
      if (variant == 1) o.reduction.pre_scale = 1.0 / kWorld;
      if (variant == 2) o.average_gradients = false;
      ZeroOptimizer opt(make_params(), zero::optim::FlatOptimizer::create(adam()), o, ledger, &comm);
      backward(opt, rank);
      norms.push_back(opt.step({1, 1e-3, 0.9, 0.999}, 1.0, 0.0).grad_norm);
    }
    EXPECT_DOUBLE_EQ(norms[1], norms[0]) << "prescale_gradients averages the same";
    EXPECT_DOUBLE_EQ(norms[2], norms[0] * kWorld) << "gradient_allreduce_op sum does not divide by the world size";
  });
}

// reduce_scatter false all-reduces each bucket and keeps this rank's chunk:
// the same bits as the reduce-scatter (Gloo sums the same numbers).
TEST(ReducerKeys, ReduceScatterFalseGivesTheSameChunks) {
  zero::testing::on_ranks(kWorld, [&](int rank, zero::Comm& comm) {
    std::vector<std::vector<at::Tensor>> owned(2);
    for (const bool rs : {true, false}) {
      zero::MemoryLedger ledger;
      auto o = options(2);
      o.reduction.reduce_scatter = rs;
      ZeroOptimizer opt(make_params(), zero::optim::FlatOptimizer::create(adam()), o, ledger, &comm);
      backward(opt, rank);
      backward(opt, rank);  // two micro-steps accumulate
      for (size_t g = 0; g < opt.parameters().groups().size(); ++g)
        owned[rs ? 0 : 1].push_back(opt.reducer().owned(g).clone());
    }
    for (size_t g = 0; g < owned[0].size(); ++g) EXPECT_TRUE(at::equal(owned[0][g], owned[1][g])) << "group " << g;
  });
}

// contiguous_gradients keeps the bucket buffers for the next micro-step;
// false frees each once it is reduced.
TEST(ReducerKeys, ContiguousGradientsKeepsTheBucketBuffers) {
  zero::testing::on_ranks(kWorld, [&](int rank, zero::Comm& comm) {
    for (const bool keep : {true, false}) {
      zero::MemoryLedger ledger;
      auto o = options(2);
      o.reduction.reuse_buckets = keep;
      ZeroOptimizer opt(make_params(), zero::optim::FlatOptimizer::create(adam()), o, ledger, &comm);
      backward(opt, rank);
      // A finished c10d work may drop its tensors a moment after its wait
      // returns (Gloo's worker thread lets go last): wait for it, up to two minutes.
      auto held = [&] { return ledger.get(zero::Tier::kDevice, zero::Kind::kCommBuffers).current_bytes; };
      for (int i = 0; i < 12000 && !keep && held() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      if (keep) EXPECT_GT(held(), 0);
      else EXPECT_EQ(held(), 0);
    }
  });
}

// NOTE [buffer pools]: the comm_buffers a reduction holds are set by how many
// buckets its bookkeeping had in use at once, not by when Gloo's worker lets
// go of a tensor: every bucket made stays in the pool (the held bytes equal
// the peak after a backward), and later backwards make none (the peak does
// not move), on every rank alike. zero memcheck holds the figure to its
// baseline, and an unchanged run's grew 9% on a loaded machine before.
TEST(ReducerKeys, BucketMemoryIsSetByTheBookkeepingNotByTiming) {
  std::vector<int64_t> peaks(kWorld);
  zero::testing::on_ranks(kWorld, [&](int rank, zero::Comm& comm) {
    zero::MemoryLedger ledger;
    ZeroOptimizer opt(make_params(), zero::optim::FlatOptimizer::create(adam()), options(2), ledger, &comm);
    auto figure = [&] { return ledger.get(zero::Tier::kDevice, zero::Kind::kCommBuffers); };
    backward(opt, rank);
    const int64_t first = figure().peak_bytes;
    EXPECT_EQ(figure().current_bytes, first) << "rank " << rank << ": a bucket made was let go";
    for (int i = 0; i < 4; ++i) backward(opt, rank);
    EXPECT_EQ(figure().peak_bytes, first) << "rank " << rank << ": later backwards made buckets";
    EXPECT_EQ(figure().current_bytes, first);
    peaks[static_cast<size_t>(rank)] = first;
  });
  EXPECT_EQ(peaks[0], peaks[1]);
  EXPECT_GT(peaks[0], 0);
}

}  // namespace

namespace {

// The new values go to the device, and gradients that stay on the device
// while the states are offloaded (stage 1's; stage 2's partition with
// gradients_on_device, NOTE [device gradients]) come to the host, a piece
// at a time through two pinned buffers (NOTE [offload transfers]): pieces
// of 256 elements cutting each rank's 300-element chunks give the bits of
// whole sub-groups, with fp32 and 8-bit states, and stage 2's gradients on
// the device the bits of its partition in host memory; the pinned rings
// hold two pieces each, not two sub-groups.
TEST(ReducerKeys, PiecesToAndFromTheDeviceStepAsWholeSubGroups) {
  for (const int bits : {32, 8}) {
    zero::testing::on_ranks(kWorld, [&](int rank, zero::Comm& comm) {
      for (const int stage : {1, 2}) {
        std::vector<at::Tensor> results;
        for (const bool on_device : {false, true}) {
          if (stage == 1 && !on_device) continue;  // stage 1's gradients are on the device
          for (const int64_t staging : {int64_t{0}, int64_t{256}}) {
            SCOPED_TRACE("stage " + std::to_string(stage) + (on_device ? ", on the device" : "") + ", staging " +
                         std::to_string(staging) + ", optim_bits " + std::to_string(bits));
            zero::MemoryLedger ledger;
            auto o = options(stage);
            o.offload_optimizer = true;
            o.grads_on_device = on_device;
            if (staging > 0) o.reduction.host_staging_numel = staging;
            auto cfg = adam();
            cfg.optim_bits = bits;
            ZeroOptimizer opt(make_params(), zero::optim::FlatOptimizer::create(cfg), o, ledger, &comm);
            for (int64_t step = 1; step <= 2; ++step) {
              backward(opt, rank);
              opt.step({step, 1e-3, 0.9, 0.999}, 1.0, 0.5);
            }
            results.push_back(opt.parameters().flat().clone());
            if (stage == 2) {
              const int64_t host_grads = ledger.get(zero::Tier::kPinnedHost, zero::Kind::kGradients).current_bytes +
                                         ledger.get(zero::Tier::kHost, zero::Kind::kGradients).current_bytes;
              EXPECT_EQ(host_grads == 0, on_device);
              EXPECT_EQ(ledger.get(zero::Tier::kDevice, zero::Kind::kGradients).current_bytes > 0, on_device);
            }
            if (staging > 0) {
              EXPECT_LE(ledger.get(zero::Tier::kPinnedHost, zero::Kind::kCommBuffers).peak_bytes +
                            ledger.get(zero::Tier::kHost, zero::Kind::kCommBuffers).peak_bytes,
                        2 * 2 * 256 * 4);
            }
          }
        }
        for (size_t i = 1; i < results.size(); ++i)
          EXPECT_TRUE(results[0].equal(results[i])) << "stage " << stage << " run " << i << " rank " << rank;
      }
    });
  }
}

}  // namespace
