// Every instruction-set path of the fused CPU Adam kernel gives the scalar
// path's results bit for bit, at sizes that hit every vector tail.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <torch/torch.h>

#include <tbb/task_arena.h>

#include "adam_kernel.h"
#include "zero/optim/flat_optimizer.h"

namespace {

using zero::optim::detail::AdamScalars;
using zero::optim::detail::Isa;

bool cpu_has(Isa isa) {
  __builtin_cpu_init();
  if (isa == Isa::kAvx512) return __builtin_cpu_supports("avx512f");
  if (isa == Isa::kAvx2) return __builtin_cpu_supports("avx2");
  return true;
}

class AdamKernelIsa : public ::testing::TestWithParam<std::tuple<Isa, int64_t, bool>> {};

TEST_P(AdamKernelIsa, BitIdenticalToScalar) {
  const auto [isa, n, decoupled] = GetParam();
  if (!cpu_has(isa)) GTEST_SKIP() << "this CPU has no " << zero::optim::detail::to_string(isa);
  std::mt19937 rng(static_cast<unsigned>(n));
  std::normal_distribution<float> normal;
  std::vector<float> p(n), m(n), v(n), g(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = normal(rng);
    m[i] = 0.1f * normal(rng);
    v[i] = std::abs(0.01f * normal(rng));
  }
  auto p2 = p, m2 = m, v2 = v;
  for (int step = 1; step <= 5; ++step) {
    for (auto& x : g) x = normal(rng);
    const AdamScalars s{0.9f, 0.1f, 0.999f, 0.001f, 1e-8f, 0.01f, 1.0f - 1e-3f * 0.01f,
                        static_cast<float>(std::sqrt(1 - std::pow(0.999, step))),
                        static_cast<float>(-1e-3 / (1 - std::pow(0.9, step))), decoupled};
    zero::optim::detail::adam_fused_fp32(p.data(), g.data(), m.data(), v.data(), n, s, Isa::kScalar);
    zero::optim::detail::adam_fused_fp32(p2.data(), g.data(), m2.data(), v2.data(), n, s, isa);
  }
  EXPECT_EQ(std::memcmp(p.data(), p2.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(m.data(), m2.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(v.data(), v2.data(), n * sizeof(float)), 0);
}

INSTANTIATE_TEST_SUITE_P(
    Paths, AdamKernelIsa,
    ::testing::Combine(::testing::Values(Isa::kAvx2, Isa::kAvx512),
                       ::testing::Values<int64_t>(1, 7, 15, 17, 22, 33, 1048576 + 7),
                       ::testing::Bool()),
    [](const auto& info) {
      return std::string(zero::optim::detail::to_string(std::get<0>(info.param))) + "_n" +
             std::to_string(std::get<1>(info.param)) + (std::get<2>(info.param) ? "_adamw" : "_l2");
    });

}  // namespace

namespace {

// The kernel's fp16/bf16 conversions equal LibTorch's casts bit for bit.
TEST(AdamKernel, SixteenBitCopiesEqualTorchCasts) {
  std::vector<float> values = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.0f, 65520.0f, 1e6f, -1e6f,
                               6.1e-5f, 5.96e-8f, 2.98e-8f, 3e-8f, 1e-10f, 1e30f, 3.0e38f,
                               std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN()};
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> exponent(-30.0f, 20.0f);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  for (int i = 0; i < 200000; ++i) values.push_back(mantissa(rng) * std::pow(2.0f, exponent(rng)));
  auto t = torch::from_blob(values.data(), {static_cast<int64_t>(values.size())}, torch::kFloat);
  auto half = t.to(torch::kHalf), bf = t.to(torch::kBFloat16);
  const auto* h = static_cast<const uint16_t*>(half.data_ptr());
  const auto* b = static_cast<const uint16_t*>(bf.data_ptr());
  int64_t bad_half = 0, bad_bf = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const bool nan = std::isnan(values[i]);
    if (nan ? (zero::optim::detail::to_fp16(values[i]) & 0x7fff) <= 0x7c00 : zero::optim::detail::to_fp16(values[i]) != h[i]) ++bad_half;
    if (nan ? (zero::optim::detail::to_bf16(values[i]) & 0x7fff) <= 0x7f80 : zero::optim::detail::to_bf16(values[i]) != b[i]) ++bad_bf;
  }
  EXPECT_EQ(bad_half, 0);
  EXPECT_EQ(bad_bf, 0);
}

// The 16-bit copy written in the pass equals casting the fp32 result.
TEST(AdamKernel, FusedSixteenBitOutputEqualsCastingTheResult) {
  for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
    const int64_t n = 1048576 + 7;
    zero::config::OptimizerConfig cfg;
    auto opt = zero::optim::FlatOptimizer::create(cfg);
    auto param = torch::randn({n}), grad = torch::randn({n});
    std::vector<at::Tensor> states{torch::zeros({n}), torch::zeros({n})};
    auto low = torch::empty({n}, dtype);
    opt->update({1, 1e-3, 0.9, 0.999}, param, grad, states, &low);
    EXPECT_TRUE(torch::equal(low, param.to(dtype))) << c10::toString(dtype);
  }
}

}  // namespace

namespace {

using zero::optim::detail::AdagradScalars;
using zero::optim::detail::LionScalars;

// Adagrad and Lion have the same structure as Adam: every ISA equals the
// scalar loop bit for bit, and the scalar loop matches the ATen operations
// (the path for other devices and layouts) to 1e-6 relative (ATen's vector
// kernels fuse a multiply and an add where ours round twice).
class OtherKernelsIsa : public ::testing::TestWithParam<std::tuple<Isa, int64_t>> {};

TEST_P(OtherKernelsIsa, AdagradAndLionBitIdenticalToScalar) {
  const auto [isa, n] = GetParam();
  if (!cpu_has(isa)) GTEST_SKIP() << "this CPU has no " << zero::optim::detail::to_string(isa);
  std::mt19937 rng(static_cast<unsigned>(n) + 1);
  std::normal_distribution<float> normal;
  std::vector<float> p(n), s(n), g(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = normal(rng);
    s[i] = std::abs(0.1f * normal(rng));
  }
  auto p2 = p, s2 = s, p3 = p, m3 = s, p4 = p, m4 = s;
  for (int step = 1; step <= 5; ++step) {
    for (auto& x : g) x = (step == 3 && &x == &g[0]) ? 0.0f : normal(rng);  // a zero: sign(0) = 0
    const AdagradScalars a{0.01f, true, 1e-10f, -0.01f};
    zero::optim::detail::adagrad_fused_fp32(p.data(), g.data(), s.data(), n, a, Isa::kScalar);
    zero::optim::detail::adagrad_fused_fp32(p2.data(), g.data(), s2.data(), n, a, isa);
    const LionScalars l{1.0f - 1e-4f * 0.1f, true, 0.9f, 0.1f, 0.99f, 0.01f, -1e-4f};
    zero::optim::detail::lion_fused_fp32(p3.data(), g.data(), m3.data(), n, l, Isa::kScalar);
    zero::optim::detail::lion_fused_fp32(p4.data(), g.data(), m4.data(), n, l, isa);
  }
  EXPECT_EQ(std::memcmp(p.data(), p2.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(s.data(), s2.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(p3.data(), p4.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(m3.data(), m4.data(), n * sizeof(float)), 0);
}

INSTANTIATE_TEST_SUITE_P(Paths, OtherKernelsIsa,
                         ::testing::Combine(::testing::Values(Isa::kAvx2, Isa::kAvx512),
                                            ::testing::Values<int64_t>(1, 7, 15, 17, 22, 33, 1048576 + 7)),
                         [](const auto& info) {
                           return std::string(zero::optim::detail::to_string(std::get<0>(info.param))) + "_n" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(OtherKernels, ScalarLoopsMatchTheAtenOperations) {
  const int64_t n = 100003;
  torch::manual_seed(3);
  auto p = torch::randn({n}), s = torch::rand({n}) * 0.1, g = torch::randn({n});
  const double lr = 0.01, wd = 0.01, eps = 1e-10;
  // Adagrad as FlatAdagrad's ATen path.
  auto pa = p.clone(), sa = s.clone();
  auto ga = g.add(pa, wd);
  sa.addcmul_(ga, ga, 1.0);
  pa.addcdiv_(ga, sa.sqrt().add_(eps), -lr);
  auto pf = p.clone(), sf = s.clone();
  zero::optim::detail::adagrad_fused_fp32(pf.data_ptr<float>(), g.data_ptr<float>(), sf.data_ptr<float>(), n,
                                          {static_cast<float>(wd), true, static_cast<float>(eps),
                                           static_cast<float>(-lr)},
                                          Isa::kScalar);
  EXPECT_TRUE(torch::allclose(pa, pf, 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(sa, sf, 1e-6, 1e-7));
  // Lion as FlatLion's ATen path.
  const double b1 = 0.9, b2 = 0.99, lr2 = 1e-4, wd2 = 0.1;
  auto pl = p.clone(), ml = s.clone();
  pl.mul_(1 - lr2 * wd2);
  auto u = ml.mul(b1).add_(g, 1 - b1).sign_();
  pl.add_(u, -lr2);
  ml.mul_(b2).add_(g, 1 - b2);
  auto pk = p.clone(), mk = s.clone();
  zero::optim::detail::lion_fused_fp32(pk.data_ptr<float>(), g.data_ptr<float>(), mk.data_ptr<float>(), n,
                                       {static_cast<float>(1 - lr2 * wd2), true, static_cast<float>(b1),
                                        static_cast<float>(1 - b1), static_cast<float>(b2),
                                        static_cast<float>(1 - b2), static_cast<float>(-lr2)},
                                       Isa::kScalar);
  EXPECT_TRUE(torch::allclose(pl, pk, 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(ml, mk, 1e-6, 1e-7));
}

}  // namespace

namespace {

// The gradient norm's sum (NOTE [gradient norm]): every instruction set and
// any number of threads give the same bits, at sizes that hit the tails,
// within fp64 rounding of the exact sum.
TEST(SumOfSquares, SameBitsOnEveryIsaAndThreadCountAndNearlyExact) {
  for (const int64_t n : {int64_t{1}, int64_t{15}, int64_t{22}, (int64_t{1} << 16) + 7, int64_t{1048576 + 7}}) {
    torch::manual_seed(static_cast<uint64_t>(n));
    const auto x = torch::randn({n}) * 3;
    const float* p = x.data_ptr<float>();
    const double scalar = zero::optim::sum_of_squares_fp64(p, n, 1);
    for (int isa : {2, 3}) {
      if ((isa == 2 && !__builtin_cpu_supports("avx2")) || (isa == 3 && !__builtin_cpu_supports("avx512f"))) continue;
      EXPECT_EQ(zero::optim::sum_of_squares_fp64(p, n, isa), scalar) << "n " << n << " isa " << isa;
    }
    for (int threads : {1, 2, 3}) {
      tbb::task_arena arena(threads);
      double got = 0;
      arena.execute([&] { got = zero::optim::sum_of_squares_fp64(p, n); });
      EXPECT_EQ(got, scalar) << "n " << n << " threads " << threads;
    }
    long double exact = 0;
    for (int64_t i = 0; i < n; ++i) exact += static_cast<long double>(p[i]) * p[i];
    EXPECT_LE(std::abs(static_cast<long double>(scalar) - exact) / exact, 1e-13L) << "n " << n;
  }
}

}  // namespace
