// A 16-bit master and 16-bit states (NOTE [16-bit master]): stochastic
// rounding, and steps over bf16/fp16 masters and bf16 states.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include <torch/torch.h>

#include "zero/config/config.h"
#include "zero/optim/flat_optimizer.h"

namespace {

using zero::optim::Rounding;

// The same bits, but for NaN payloads (ATen's and the kernel's NaN differ): NaN where the other is.
bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  const auto nan = a.to(torch::kFloat).isnan();
  if (!torch::equal(nan, b.to(torch::kFloat).isnan())) return false;
  return torch::equal(a.view(torch::kShort).masked_select(nan.logical_not()), b.view(torch::kShort).masked_select(nan.logical_not()));
}

torch::Tensor awkward_values(int64_t n) {
  torch::manual_seed(3);
  auto x = torch::randn({n}) * torch::exp(torch::randn({n}) * 8);  // every scale from 1e-15 to 1e15
  x[0] = 0.0f;
  x[1] = -0.0f;
  x[2] = std::numeric_limits<float>::infinity();
  x[3] = -std::numeric_limits<float>::infinity();
  x[4] = std::numeric_limits<float>::quiet_NaN();
  x[5] = 1e-40f;   // fp32 subnormal
  x[6] = 3e-8f;    // below fp16's smallest step (2^-24)
  x[7] = 1e-6f;    // fp16 subnormal
  x[8] = 65519.0f; // fp16's largest and the step above it
  x[9] = 3.4e38f;  // next to fp32's largest
  return x;
}

// The device's ATen path gives the CPU loop's bits, for bf16 and fp16,
// stochastic and to nearest, whatever the index's high word, NaN included.
TEST(StochasticRounding, AtenPathEqualsTheCpuLoopBitForBit) {
  const auto x = awkward_values(20000);
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    for (bool stochastic : {true, false}) {
      for (uint64_t index : {uint64_t{0}, uint64_t{123456789}, (uint64_t{7} << 32) - 5000}) {
        const Rounding r{stochastic, index, 17};
        const auto cpu = zero::optim::round_to(x, dtype, r, 2);
        const auto aten = zero::optim::round_to(x, dtype, r, 2, /*aten=*/true);
        ASSERT_EQ(cpu.scalar_type(), dtype);
        EXPECT_TRUE(torch::equal(cpu.view(torch::kShort), aten.view(torch::kShort)))  // NaN's bits too
            << c10::toString(dtype) << " stochastic " << stochastic << " index " << index;
      }
    }
  }
}

// Each value goes to one of its two 16-bit neighbours; to nearest is
// Tensor::to; NaN stays NaN and infinities stay.
TEST(StochasticRounding, GivesANeighbourAndKeepsSpecials) {
  const auto x = awkward_values(20000);
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    const auto nearest = zero::optim::round_to(x, dtype, Rounding{false, 0, 1});
    EXPECT_TRUE(same_bits(nearest, x.to(dtype))) << c10::toString(dtype);
    const auto sr = zero::optim::round_to(x, dtype, Rounding{true, 0, 1}).to(torch::kFloat);
    // Within one 16-bit step of x (a step that passes the largest finite value is inf, as to nearest's).
    const auto finite = torch::isfinite(x).logical_and(torch::isfinite(sr));
    const auto err = (sr - x).abs().masked_select(finite);
    const auto ulp = (x.abs().masked_select(finite) * (dtype == torch::kBFloat16 ? 1.0 / 128 : 1.0 / 1024))
                         .clamp_min(dtype == torch::kBFloat16 ? 1e-38 : 6e-8);
    EXPECT_TRUE((err <= ulp * 1.0001).all().item<bool>()) << c10::toString(dtype);
    EXPECT_TRUE(std::isnan(sr[4].item<float>()));
    EXPECT_EQ(sr[2].item<float>(), std::numeric_limits<float>::infinity());
    EXPECT_EQ(sr[3].item<float>(), -std::numeric_limits<float>::infinity());
  }
}

// Unbiased: a value between two bf16 (or fp16) neighbours rounds up with
// the probability of its fraction of the step, so the mean over many
// elements is the value; to nearest it is the lower neighbour every time.
TEST(StochasticRounding, IsUnbiasedWhereRoundingToNearestIsNot) {
  const int64_t n = 200000;
  for (auto [dtype, value] : {std::pair{torch::kBFloat16, 1.0 + 0.3 / 128}, std::pair{torch::kHalf, 1.0 + 0.3 / 1024},
                              std::pair{torch::kHalf, 1.3 * std::ldexp(1.0, -24)}, std::pair{torch::kBFloat16, -3e-30}}) {
    const auto x = torch::full({n}, value, torch::kFloat);
    const double want = x[0].item<double>();
    const auto sr = zero::optim::round_to(x, dtype, Rounding{true, 99, 5}).to(torch::kDouble);
    const double mean = sr.mean().item<double>();
    const double step = std::abs(sr.max().item<double>() - sr.min().item<double>());
    ASSERT_GT(step, 0.0) << "both neighbours appear";
    // Binomial: the fraction is within 4 standard deviations (0.0041 at n = 200000).
    EXPECT_NEAR((mean - sr.min().item<double>()) / step, (want - sr.min().item<double>()) / step, 0.005)
        << c10::toString(dtype) << " " << value;
    const auto rn = zero::optim::round_to(x, dtype, Rounding{false, 99, 5}).to(torch::kDouble);
    EXPECT_EQ(rn.max().item<double>(), rn.min().item<double>());
  }
  // Another step or tensor draws other words.
  const auto x = torch::full({4096}, 1.0 + 0.5 / 128, torch::kFloat);
  const auto a = zero::optim::round_to(x, torch::kBFloat16, Rounding{true, 0, 1}, 0);
  EXPECT_FALSE(torch::equal(a.view(torch::kShort), zero::optim::round_to(x, torch::kBFloat16, Rounding{true, 0, 2}, 0).view(torch::kShort)));
  EXPECT_FALSE(torch::equal(a.view(torch::kShort), zero::optim::round_to(x, torch::kBFloat16, Rounding{true, 0, 1}, 1).view(torch::kShort)));
}

zero::config::OptimizerConfig adamw(bool bf16_states, double lr = 1e-3) {
  zero::config::OptimizerConfig c;
  c.lr = lr;
  c.weight_decay = 0.01;
  c.bf16_states = bf16_states;
  return c;
}

// A bf16 master and bf16 states on the CPU (windows widened in cache) and
// through ATen operations (the device's path, here on strided views) give
// the same bits, parameter groups and all, and the model's copy is the
// master's bits.
TEST(SixteenBitMaster, CpuWindowsEqualTheAtenPathBitForBit) {
  const int64_t n = 100000;  // several windows and a tail
  torch::manual_seed(1);
  // fp32 gradients, and bf16 ones as bf16_master_weights_and_grads keeps them
  // (the CPU widens them a window at a time).
  for (const auto grad_dtype : {torch::kFloat, torch::kBFloat16})
  for (bool bf16_states : {true, false}) {
    SCOPED_TRACE(std::string("gradients ") + c10::toString(grad_dtype) + (bf16_states ? ", bf16 states" : ", fp32 states"));
    auto opt = zero::optim::FlatOptimizer::create(adamw(bf16_states));
    const auto st = bf16_states ? torch::kBFloat16 : torch::kFloat;
    auto p0 = torch::randn({n}).to(torch::kBFloat16);
    auto m0 = (torch::randn({n}) * 0.01).to(st);
    auto v0 = (torch::rand({n}) * 1e-4).to(st);
    std::vector<zero::optim::FlatOptimizer::Run> runs{{0, 40000, {}}, {40000, n - 40000, {}}};
    runs[0].params.step = runs[1].params.step = 3;
    runs[1].params.lr = 1e-2;
    runs[1].params.weight_decay = 0.0;
    // CPU: contiguous.
    auto p = p0.clone();
    std::vector<torch::Tensor> s{m0.clone(), v0.clone()};
    auto low = torch::empty({n}, torch::kBFloat16);
    const Rounding r{true, 1000, 3};
    for (int step = 0; step < 3; ++step) {
      auto g = torch::randn({n}, torch::TensorOptions().dtype(torch::kFloat).requires_grad(false)).to(grad_dtype);
      // ATen: every tensor a strided view.
      auto pb = torch::empty({2 * n}, torch::kBFloat16);
      auto pa = pb.slice(0, 0, 2 * n, 2);
      pa.copy_(p);
      auto mb = torch::empty({2 * n}, st), vb = torch::empty({2 * n}, st);
      // (fp32 states as they are: ATen's own Adam is not the fused kernel's bits)
      std::vector<torch::Tensor> sa{bf16_states ? mb.slice(0, 0, 2 * n, 2) : torch::empty({n}),
                                    bf16_states ? vb.slice(0, 0, 2 * n, 2) : torch::empty({n})};
      sa[0].copy_(s[0]);
      sa[1].copy_(s[1]);
      auto lowa = torch::empty({2 * n}, torch::kBFloat16).slice(0, 0, 2 * n, 2);
      zero::optim::update_stored(*opt, runs, p, g, s, &low, r);
      zero::optim::update_stored(*opt, runs, pa, g, sa, &lowa, r);
      ASSERT_TRUE(torch::equal(p.view(torch::kShort), pa.contiguous().view(torch::kShort))) << "step " << step;
      ASSERT_TRUE(torch::equal(s[0], sa[0].contiguous()));
      ASSERT_TRUE(torch::equal(s[1], sa[1].contiguous()));
      EXPECT_TRUE(torch::equal(low.view(torch::kShort), p.view(torch::kShort)));
      EXPECT_TRUE(torch::equal(lowa.contiguous().view(torch::kShort), p.view(torch::kShort)));
    }
    EXPECT_FALSE(torch::equal(p.view(torch::kShort), p0.view(torch::kShort)));
  }
}

// NOTE [16-bit gradients]: a bf16 or fp16 gradient widened and unscaled
// inside the CPU pass gives the bits of widening and unscaling it first
// (g.to(fp32).mul_(f), the step's old path) for an fp32 master with fp32
// states (with and without the model's 16-bit copy in the same pass), and
// for a bf16 master and states; the gradient is left as it was. An fp32
// gradient with a factor takes the same windows.
TEST(SixteenBitGradients, WidenedInThePassEqualWideningFirst) {
  const int64_t n = 100000;  // several windows and a tail
  torch::manual_seed(5);
  const double factor = 1.0 / 3072.0 * 1.37;  // 1 / (loss scale x clip ratio), not a power of two
  for (const auto grad_dtype : {torch::kBFloat16, torch::kHalf, torch::kFloat})
  for (const auto master : {torch::kFloat, torch::kBFloat16})
  for (const bool with_low : {false, true}) {
    SCOPED_TRACE(std::string("gradients ") + c10::toString(grad_dtype) + ", master " + c10::toString(master) +
                 (with_low ? ", with the 16-bit copy" : ""));
    auto opt = zero::optim::FlatOptimizer::create(adamw(master == torch::kBFloat16));
    const auto st = master == torch::kBFloat16 ? torch::kBFloat16 : torch::kFloat;
    std::vector<zero::optim::FlatOptimizer::Run> runs{{0, 40000, {}}, {40000, n - 40000, {}}};
    runs[0].params.step = runs[1].params.step = 2;
    runs[1].params.lr = 1e-2;
    auto p = torch::randn({n}).to(master), pr = p.clone();
    std::vector<torch::Tensor> s{(torch::randn({n}) * 0.01).to(st), (torch::rand({n}) * 1e-4).to(st)};
    std::vector<torch::Tensor> sr{s[0].clone(), s[1].clone()};
    auto low = torch::empty({n}, torch::kBFloat16), lowr = torch::empty({n}, torch::kBFloat16);
    const Rounding r{true, 77, 2};
    const auto g = (torch::randn({n}) * 3000).to(grad_dtype);
    const auto g0 = g.clone();
    zero::optim::update_stored(*opt, runs, p, g, s, with_low ? &low : nullptr, r, static_cast<float>(factor));
    const auto wide = g.to(torch::kFloat, /*non_blocking=*/false, /*copy=*/true).mul_(factor);
    zero::optim::update_stored(*opt, runs, pr, wide, sr, with_low ? &lowr : nullptr, r);
    EXPECT_TRUE(torch::equal(p.view(torch::kShort), pr.view(torch::kShort)));
    EXPECT_TRUE(torch::equal(s[0], sr[0]));
    EXPECT_TRUE(torch::equal(s[1], sr[1]));
    if (with_low) EXPECT_TRUE(torch::equal(low.view(torch::kShort), lowr.view(torch::kShort)));
    EXPECT_TRUE(torch::equal(g.view(torch::kShort), g0.view(torch::kShort))) << "the gradient is left as it was";
  }
}

// The same with 8-bit moments (block-wise, NOTE [8-bit states]) under an
// fp32 master: the window path steps the blocks as the whole-piece pass.
TEST(SixteenBitGradients, WidenedInThePassEqualWideningFirstWithEightBitStates) {
  const int64_t n = 100000;
  const int64_t blocks = (n + 255) / 256;
  torch::manual_seed(6);
  const double factor = 1.0 / 777.0;
  for (const auto grad_dtype : {torch::kBFloat16, torch::kFloat}) {
    SCOPED_TRACE(std::string("gradients ") + c10::toString(grad_dtype));
    zero::config::OptimizerConfig c = adamw(false);
    c.optim_bits = 8;
    auto opt = zero::optim::FlatOptimizer::create(c);
    std::vector<zero::optim::FlatOptimizer::Run> runs{{0, n, {}}};
    runs[0].params.step = 1;
    auto p = torch::randn({n}), pr = p.clone();
    std::vector<torch::Tensor> s{torch::zeros({n}, torch::kUInt8), torch::zeros({blocks}), torch::zeros({n}, torch::kUInt8),
                                 torch::zeros({blocks})};
    std::vector<torch::Tensor> sr;
    for (const auto& t : s) sr.push_back(t.clone());
    for (int step = 1; step <= 3; ++step) {
      runs[0].params.step = step;
      const auto g = (torch::randn({n}) * 500).to(grad_dtype);
      zero::optim::update_stored(*opt, runs, p, g, s, nullptr, Rounding{false, 0, step}, static_cast<float>(factor));
      zero::optim::update_stored(*opt, runs, pr, g.to(torch::kFloat, false, true).mul_(factor), sr, nullptr,
                                 Rounding{false, 0, step});
    }
    EXPECT_TRUE(torch::equal(p, pr));
    for (size_t i = 0; i < s.size(); ++i) EXPECT_TRUE(torch::equal(s[i], sr[i])) << "state " << i;
    EXPECT_FALSE(torch::equal(s[0], torch::zeros({n}, torch::kUInt8))) << "the moments moved";
  }
}

// The norm's sum of squares over 16-bit values, widened a block at a time,
// has the bits of the fp32 sum over their widened copy.
TEST(SixteenBitGradients, SumOfSquaresEqualsTheWidenedSum) {
  for (const int64_t n : {int64_t{1}, int64_t{37}, (int64_t{1} << 16) + 9, int64_t{1048576 + 3}})
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    torch::manual_seed(static_cast<uint64_t>(n));
    const auto x = (torch::randn({n}) * 50).to(dtype);
    const auto wide = x.to(torch::kFloat);
    EXPECT_EQ(zero::optim::sum_of_squares_fp64(static_cast<const uint16_t*>(x.data_ptr()), n, dtype == torch::kBFloat16),
              zero::optim::sum_of_squares_fp64(wide.data_ptr<float>(), n))
        << "n " << n << " " << c10::toString(dtype);
  }
}

// Why stochastic rounding is on: at a learning rate whose updates are a
// fraction of a bf16 step, a master rounded to nearest never moves, while a
// stochastically rounded one follows fp32's on average.
TEST(SixteenBitMaster, SmallUpdatesSurviveOnlyWithStochasticRounding) {
  const int64_t n = 50000;
  const double lr = 1e-3;  // Adam's step is about lr: 1/8 of bf16's step at 1.0-2.0 (2^-7)
  auto opt = zero::optim::FlatOptimizer::create(adamw(false, lr));
  const auto start = torch::full({n}, 1.5f);
  const auto grad = torch::full({n}, 0.25f);  // a constant gradient: Adam's steps are lr each
  auto run = [&](at::ScalarType dtype, bool stochastic) {
    auto p = start.to(dtype, /*non_blocking=*/false, /*copy=*/true);
    std::vector<torch::Tensor> s{torch::zeros({n}), torch::zeros({n})};
    for (int64_t step = 1; step <= 40; ++step) {
      zero::optim::FlatOptimizer::Run run{0, n, {}};
      run.params.step = step;
      run.params.lr = lr;
      run.params.weight_decay = 0.0;
      zero::optim::update_stored(*opt, {run}, p, grad, s, nullptr, Rounding{stochastic, 0, step});
    }
    return p.to(torch::kDouble).mean().item<double>();
  };
  const double fp32 = run(torch::kFloat, false);
  const double nearest = run(torch::kBFloat16, false);
  const double sr = run(torch::kBFloat16, true);
  const double fp16_sr = run(torch::kHalf, true);
  std::printf("after 40 steps of lr %.0e from 1.5: fp32 %.6f, bf16 to nearest %.6f, bf16 stochastic %.6f, fp16 stochastic %.6f\n",
              lr, fp32, nearest, sr, fp16_sr);
  EXPECT_NEAR(fp32, 1.5 - 40 * lr, 1e-4);
  EXPECT_EQ(nearest, 1.5) << "to nearest, every update is lost";
  EXPECT_NEAR(sr, fp32, 0.05 * (1.5 - fp32)) << "stochastic rounding keeps them on average";
  EXPECT_NEAR(fp16_sr, fp32, 0.05 * (1.5 - fp32));
}

// A state's spec says its dtype; bf16 states are element-wise, 4 bytes a
// parameter for Adam's two.
TEST(SixteenBitMaster, Bf16StatesAreElementWiseTwoBytesEach) {
  auto opt = zero::optim::FlatOptimizer::create(adamw(true));
  for (const auto& spec : opt->state_specs()) {
    EXPECT_EQ(spec.dtype, torch::kBFloat16);
    EXPECT_EQ(spec.per_block, 0);
  }
  EXPECT_TRUE(opt->elementwise_states());
  EXPECT_EQ(opt->state_bytes_per_param(), 4.0);
}

}  // namespace

