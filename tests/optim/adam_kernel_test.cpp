// Every instruction-set path of the fused CPU Adam kernel gives the scalar
// path's results bit for bit, at sizes that hit every vector tail.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "adam_kernel.h"

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
