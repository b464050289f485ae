// 8-bit Adam (NOTE [8-bit states] in optim/src/adam_kernel.h): the E4M3 codec
// against torch's float8_e4m3fn, every instruction set against the scalar
// loop, the ATen path and an independent PyTorch script against the fused
// pass to the last code, and the result against fp32 Adam within the
// quantization's error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "adam_kernel.h"
#include "zero/optim/flat_optimizer.h"

namespace {

namespace d = zero::optim::detail;
using d::Isa;

bool cpu_has(Isa isa) {
  __builtin_cpu_init();
  if (isa == Isa::kAvx512) return __builtin_cpu_supports("avx512f");
  if (isa == Isa::kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return true;
}

TEST(E4m3, DecodesAsTorch) {
  auto codes = torch::arange(256, torch::kInt32).to(torch::kUInt8);
  auto ref = codes.view(torch::kFloat8_e4m3fn).to(torch::kFloat);
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;  // NaN: never produced (NOTE [8-bit states])
    const float want = ref[c].item<float>();
    const float got = d::from_e4m3(static_cast<uint8_t>(c));
    EXPECT_EQ(std::memcmp(&want, &got, 4), 0) << "code " << c << ": " << got << " vs " << want;
  }
}

TEST(E4m3, EncodesAsTorchIncludingTiesAndSubnormals) {
  std::vector<float> xs;
  // Every code's value, the midpoints between neighbours (ties to even), and
  // a float on each side of them.
  for (int c = 0; c < 0x7e; ++c) {
    const float a = d::from_e4m3(static_cast<uint8_t>(c)), b = d::from_e4m3(static_cast<uint8_t>(c + 1));
    const float mid = (a + b) / 2;
    for (float x : {a, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1000.0f)}) {
      xs.push_back(x);
      xs.push_back(-x);
    }
  }
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> expo(-14, 9);
  for (int i = 0; i < 20000; ++i) xs.push_back(std::ldexp(1.0f + 0.001f * static_cast<float>(i % 997), static_cast<int>(expo(rng))) * (i % 2 ? 1 : -1));
  for (auto& x : xs) x = std::min(std::max(x, -460.0f), 460.0f);
  auto t = torch::from_blob(xs.data(), {static_cast<int64_t>(xs.size())}, torch::kFloat).clone();
  auto ref = t.to(torch::kFloat8_e4m3fn).view(torch::kUInt8);
  int bad = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const uint8_t want = ref[static_cast<int64_t>(i)].item<uint8_t>(), got = d::to_e4m3(xs[i]);
    if (want != got && ++bad < 10) ADD_FAILURE() << xs[i] << ": " << int(got) << " vs torch " << int(want);
  }
  EXPECT_EQ(bad, 0);
}

// A case: parameters, gradients for each step, and runs that split blocks.
struct Case {
  int64_t n;
  int steps;
  std::vector<float> p;
  std::vector<std::vector<float>> grads;
  std::vector<std::vector<d::AdamRun>> runs;  // per step
};

d::AdamScalars scalars(int step, double lr, double wd, bool decoupled) {
  const double bc1 = 1 - std::pow(0.9, step), bc2 = 1 - std::pow(0.999, step);
  return {0.9f, 0.1f, 0.999f, 0.001f, 1e-8f, static_cast<float>(wd), static_cast<float>(1 - lr * wd),
          static_cast<float>(std::sqrt(bc2)), static_cast<float>(-lr / bc1), decoupled};
}

Case make_case(int64_t n, int steps, unsigned seed) {
  Case c{n, steps, {}, {}, {}};
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  c.p.resize(n);
  for (auto& x : c.p) x = normal(rng);
  // Gradients of very different sizes within a block (a scale of 1e-4..1 by
  // element), and some exact zeros.
  std::vector<float> mag(n);
  for (int64_t i = 0; i < n; ++i) mag[i] = std::pow(10.0f, -4.0f * static_cast<float>((i * 37) % 101) / 100.0f);
  for (int s = 0; s < steps; ++s) {
    std::vector<float> g(n);
    for (int64_t i = 0; i < n; ++i) g[i] = (i % 97 == 5) ? 0.0f : mag[i] * (0.3f + normal(rng));
    c.grads.push_back(std::move(g));
    // Three parameter groups: split at 1/3 (inside a block) and at n - 5.
    std::vector<d::AdamRun> runs;
    const int64_t a = n / 3, b = std::max(a, n - 5);
    if (a > 0) runs.push_back({0, a, scalars(s + 1, 1e-3, 0.1, true)});
    if (b > a) runs.push_back({a, b - a, scalars(s + 1, 3e-3, 0.0, true)});
    if (n > b) runs.push_back({b, n - b, scalars(s + 1, 1e-3, 0.01, false)});
    c.runs.push_back(std::move(runs));
  }
  return c;
}

struct State8 {
  std::vector<float> p;
  std::vector<uint8_t> mc, vc;
  std::vector<float> ma, va;
  std::vector<uint16_t> low;
};

State8 run_kernel(const Case& c, Isa isa) {
  const int64_t blocks = (c.n + d::kQuantBlock - 1) / d::kQuantBlock;
  State8 s{c.p, std::vector<uint8_t>(c.n), std::vector<uint8_t>(c.n), std::vector<float>(blocks),
           std::vector<float>(blocks), std::vector<uint16_t>(c.n)};
  for (int step = 0; step < c.steps; ++step) {
    const auto& runs = c.runs[static_cast<size_t>(step)];
    d::adam_fused_8bit(s.p.data(), c.grads[static_cast<size_t>(step)].data(), {s.mc.data(), s.ma.data()},
                       {s.vc.data(), s.va.data()}, c.n, runs.data(), static_cast<int64_t>(runs.size()), isa,
                       s.low.data(), d::LowPrecision::kBf16);
  }
  return s;
}

template <typename T>
bool same(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

class Adam8Isa : public ::testing::TestWithParam<std::tuple<Isa, int64_t>> {};

TEST_P(Adam8Isa, BitIdenticalToScalar) {
  const auto [isa, n] = GetParam();
  if (!cpu_has(isa)) GTEST_SKIP() << "this CPU has no " << d::to_string(isa);
  const Case c = make_case(n, 4, static_cast<unsigned>(n));
  const State8 a = run_kernel(c, Isa::kScalar), b = run_kernel(c, isa);
  EXPECT_TRUE(same(a.p, b.p));
  EXPECT_TRUE(same(a.mc, b.mc));
  EXPECT_TRUE(same(a.vc, b.vc));
  EXPECT_TRUE(same(a.ma, b.ma));
  EXPECT_TRUE(same(a.va, b.va));
  EXPECT_TRUE(same(a.low, b.low));
}

INSTANTIATE_TEST_SUITE_P(Paths, Adam8Isa,
                         ::testing::Combine(::testing::Values(Isa::kAvx2, Isa::kAvx512),
                                            ::testing::Values<int64_t>(1, 7, 255, 256, 257, 1000, 70000 + 13)));

// The vector decoders (F16C) give each of the 256 codes the scalar
// decoder's value: one step from states holding every code of each moment,
// on every path, with decoupled and with L2 decay, under scales from
// subnormal factors to huge ones, and under scales that are not finite
// (states damaged or made elsewhere: the general encoder, on every path).
TEST(Adam8, EveryCodeStepsAsTheScalarPath) {
  constexpr int64_t n = 4 * d::kQuantBlock;
  constexpr float kInf = std::numeric_limits<float>::infinity(), kNan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> p0(n), g(n);
  std::vector<uint8_t> mc0(n), vc0(n);
  for (int64_t i = 0; i < n; ++i) {
    p0[i] = 0.01f * static_cast<float>(i % 13) - 0.05f;
    g[i] = (i % 5 == 0) ? 0.0f : 1e-3f * static_cast<float>(i % 7) - 3e-3f;
    mc0[i] = static_cast<uint8_t>(i % 256);
    vc0[i] = static_cast<uint8_t>((i * 7 + 3) % 256);  // every code too, in another order
  }
  const std::vector<std::pair<std::vector<float>, std::vector<float>>> scales = {
      {{1.0f, 448.0f, 3e-38f, 2e30f}, {0.5f, 1e-20f, 448.0f, 1e10f}},  // 3e-38 / 448: a subnormal factor
      {{1.0f, kInf, 2.0f, kNan}, {kInf, 1.0f, kNan, 0.25f}}};
  for (bool decoupled : {true, false}) {
    const d::AdamRun run{0, n, scalars(3, 1e-3, 0.1, decoupled)};
    for (const auto& [ma0, va0] : scales) {
      auto step = [&](Isa isa) {
        State8 s{p0, mc0, vc0, ma0, va0, std::vector<uint16_t>(n)};
        d::adam_fused_8bit(s.p.data(), g.data(), {s.mc.data(), s.ma.data()}, {s.vc.data(), s.va.data()}, n, &run,
                           1, isa, s.low.data(), d::LowPrecision::kBf16);
        return s;
      };
      const State8 want = step(Isa::kScalar);
      for (Isa isa : {Isa::kAvx2, Isa::kAvx512}) {
        if (!cpu_has(isa)) continue;
        const State8 got = step(isa);
        const std::string where = std::string(d::to_string(isa)) + (decoupled ? ", decoupled" : ", L2") +
                                  ", scales from " + std::to_string(ma0[1]);
        EXPECT_TRUE(same(want.p, got.p)) << where;
        EXPECT_TRUE(same(want.mc, got.mc)) << where;
        EXPECT_TRUE(same(want.vc, got.vc)) << where;
        EXPECT_TRUE(same(want.ma, got.ma)) << where;
        EXPECT_TRUE(same(want.va, got.va)) << where;
        EXPECT_TRUE(same(want.low, got.low)) << where;
      }
    }
  }
}

std::vector<zero::optim::FlatOptimizer::Run> runs_of(const std::vector<d::AdamRun>& rs, int step) {
  // The optimizer's runs whose scalars are make_case's: lr and weight decay per run.
  std::vector<zero::optim::FlatOptimizer::Run> out;
  for (const auto& r : rs) {
    zero::optim::StepParams p;
    p.step = step;
    p.lr = -static_cast<double>(r.s.neg_step_size) * (1 - std::pow(0.9, step));
    p.weight_decay = static_cast<double>(r.s.weight_decay);
    out.push_back({r.start, r.numel, p});
  }
  return out;
}

// The engine's path (FlatOptimizer with optim_bits 8) on contiguous CPU
// tensors (the fused pass) and adam_8bit_aten (what device states run) give
// the same bits.
TEST(Adam8, AtenPathEqualsFusedPass) {
  for (const bool decoupled : {true, false}) {
    zero::config::OptimizerConfig cfg;
    cfg.type = decoupled ? zero::config::OptimizerType::kAdamW : zero::config::OptimizerType::kAdam;
    cfg.adam_w_mode = decoupled;
    cfg.optim_bits = 8;
    auto opt = zero::optim::FlatOptimizer::create(cfg);
    ASSERT_FALSE(opt->elementwise_states());
    EXPECT_NEAR(opt->state_bytes_per_param(), 2.0 + 8.0 / 256, 1e-12);  // (the fp32 blocks' are the layout's)
    const Case c = make_case(3000, 5, 11);
    const int64_t blocks = (c.n + 255) / 256;
    auto fresh = [&] {
      return std::vector<at::Tensor>{torch::zeros({c.n}, torch::kUInt8), torch::zeros({blocks}),
                                     torch::zeros({c.n}, torch::kUInt8), torch::zeros({blocks})};
    };
    auto p1 = torch::from_blob(const_cast<float*>(c.p.data()), {c.n}).clone(), p2 = p1.clone();
    auto s1 = fresh(), s2 = fresh();
    auto l1 = torch::empty({c.n}, torch::kBFloat16), l2 = l1.clone();
    for (int step = 1; step <= c.steps; ++step) {
      auto g = torch::from_blob(const_cast<float*>(c.grads[static_cast<size_t>(step - 1)].data()), {c.n}).clone();
      auto runs = runs_of(c.runs[static_cast<size_t>(step - 1)], step);
      opt->update_runs(runs, p1, g, s1, &l1);
      zero::optim::adam_8bit_aten(runs, cfg, p2, g, s2, &l2);
    }
    EXPECT_TRUE(p1.equal(p2)) << (p1 - p2).abs().max().item<float>();
    for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(s1[i].equal(s2[i])) << "state " << i;
    EXPECT_TRUE(l1.equal(l2));
    EXPECT_GT(s1[0].ne(0).sum().item<int64_t>(), c.n / 2);  // the states are not all zero
  }
}

// min_8bit_size (NOTE [8-bit states]): blocks marked fp32 step as fp32 Adam
// over their side states, the others as the 8-bit pass over the whole (each
// block is its own), on the fused pass and on the ATen path (a strided
// parameter), with several runs; the marks stay.
TEST(Adam8, BlocksMarkedFp32StepAsFp32AdamAndTheRestAsEightBits) {
  zero::config::OptimizerConfig cfg;
  cfg.type = zero::config::OptimizerType::kAdamW;
  cfg.optim_bits = 8;
  auto opt = zero::optim::FlatOptimizer::create(cfg);
  zero::config::OptimizerConfig cfg32 = cfg;
  cfg32.optim_bits = 32;
  auto opt32 = zero::optim::FlatOptimizer::create(cfg32);
  const auto specs = opt->state_specs();
  ASSERT_EQ(specs.size(), 6u);
  EXPECT_TRUE(specs[4].side && specs[5].side);
  EXPECT_EQ(specs[4].side_numel(0), 256);  // at least one block's
  const Case c = make_case(3000, 4, 3);     // 12 blocks, the last partial
  const int64_t blocks = (c.n + 255) / 256;
  const std::vector<int64_t> fp32_blocks{1, 2, 5, 11};
  for (const bool aten : {false, true}) {
    std::vector<at::Tensor> st{torch::zeros({c.n}, torch::kUInt8), torch::zeros({blocks}),
                               torch::zeros({c.n}, torch::kUInt8), torch::zeros({blocks}),
                               torch::zeros({specs[4].side_numel(4)}), torch::zeros({specs[5].side_numel(4)})};
    zero::optim::mark_fp32_blocks(fp32_blocks, st);
    std::vector<at::Tensor> st8{torch::zeros({c.n}, torch::kUInt8), torch::zeros({blocks}),
                                torch::zeros({c.n}, torch::kUInt8), torch::zeros({blocks})};
    std::vector<at::Tensor> st32{torch::zeros({c.n}), torch::zeros({c.n})};
    // The ATen path: every second element of a buffer twice as long (the
    // references too: ATen's fp32 Adam is not the fused pass to the bit).
    auto make_p = [&] {
      at::Tensor t = aten ? torch::zeros({2 * c.n}).slice(0, 0, 2 * c.n, 2) : torch::empty({c.n});
      t.copy_(torch::from_blob(const_cast<float*>(c.p.data()), {c.n}));
      return t;
    };
    at::Tensor p = make_p(), p8 = make_p(), p32 = make_p();
    for (int step = 1; step <= c.steps; ++step) {
      auto g = torch::from_blob(const_cast<float*>(c.grads[static_cast<size_t>(step - 1)].data()), {c.n}).clone();
      auto runs = runs_of(c.runs[static_cast<size_t>(step - 1)], step);
      opt->update_runs(runs, p, g, st, nullptr);
      opt->update_runs(runs, p8, g, st8, nullptr);
      opt32->update_runs(runs, p32, g, st32, nullptr);
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t a = b * 256, len = std::min<int64_t>(256, c.n - a);
      const auto it = std::find(fp32_blocks.begin(), fp32_blocks.end(), b);
      if (it != fp32_blocks.end()) {
        const int64_t j = it - fp32_blocks.begin();
        EXPECT_TRUE(p.narrow(0, a, len).equal(p32.narrow(0, a, len))) << "aten " << aten << " fp32 block " << b;
        EXPECT_TRUE(st[4].narrow(0, 256 * j, len).equal(st32[0].narrow(0, a, len))) << b;
        EXPECT_TRUE(st[5].narrow(0, 256 * j, len).equal(st32[1].narrow(0, a, len))) << b;
        EXPECT_EQ(st[1][b].item<float>(), static_cast<float>(-(j + 1)));
        EXPECT_EQ(st[3][b].item<float>(), static_cast<float>(-(j + 1)));
      } else {
        EXPECT_TRUE(p.narrow(0, a, len).equal(p8.narrow(0, a, len))) << "aten " << aten << " 8-bit block " << b;
        EXPECT_TRUE(st[0].narrow(0, a, len).equal(st8[0].narrow(0, a, len))) << b;
        EXPECT_TRUE(st[2].narrow(0, a, len).equal(st8[2].narrow(0, a, len))) << b;
        EXPECT_EQ(st[1][b].item<float>(), st8[1][b].item<float>()) << b;
        EXPECT_GT(st[1][b].item<float>(), 0.0f) << b;
      }
    }
    EXPECT_FALSE(p.equal(p8));  // the fp32 blocks differ from 8-bit ones
  }
  // store_8bit: values into marked and 8-bit blocks, as a checkpoint loads them.
  std::vector<float> m(static_cast<size_t>(c.n)), v(m.size()), sq(m.size());
  for (size_t i = 0; i < m.size(); ++i) {
    m[i] = 0.01f * static_cast<float>(static_cast<int64_t>(i % 17) - 8);
    v[i] = 1e-4f * static_cast<float>(i % 13 + 1);
    sq[i] = static_cast<float>(std::sqrt(static_cast<double>(v[i])));
  }
  std::vector<at::Tensor> st{torch::empty({c.n}, torch::kUInt8), torch::empty({blocks}),
                             torch::empty({c.n}, torch::kUInt8), torch::empty({blocks}),
                             torch::empty({specs[4].side_numel(4)}), torch::empty({specs[5].side_numel(4)})};
  zero::optim::store_8bit(m.data(), sq.data(), v.data(), c.n, fp32_blocks, st);
  for (size_t j = 0; j < fp32_blocks.size(); ++j) {
    const int64_t a = fp32_blocks[j] * 256, len = std::min<int64_t>(256, c.n - a);
    EXPECT_EQ(st[1][fp32_blocks[j]].item<float>(), -static_cast<float>(j + 1));
    for (int64_t t = 0; t < len; ++t) {
      EXPECT_EQ(st[4][static_cast<int64_t>(j) * 256 + t].item<float>(), m[static_cast<size_t>(a + t)]);
      EXPECT_EQ(st[5][static_cast<int64_t>(j) * 256 + t].item<float>(), v[static_cast<size_t>(a + t)]);
    }
  }
  const float m0 = zero::optim::dequantize_8bit(st[0][0].item<uint8_t>(), st[1][0].item<float>());
  EXPECT_NEAR(m0, m[0], 0.07 * std::abs(m[0]));
  // The marking's indexed path (what device states take): strided codes.
  std::vector<at::Tensor> strided{torch::full({2 * c.n}, 7, torch::kUInt8).slice(0, 0, 2 * c.n, 2), torch::ones({blocks}),
                                  torch::full({2 * c.n}, 7, torch::kUInt8).slice(0, 0, 2 * c.n, 2), torch::ones({blocks}),
                                  torch::zeros({specs[4].side_numel(4)}), torch::zeros({specs[5].side_numel(4)})};
  zero::optim::mark_fp32_blocks(fp32_blocks, strided);
  for (int64_t b = 0; b < blocks; ++b) {
    const bool fp32 = std::find(fp32_blocks.begin(), fp32_blocks.end(), b) != fp32_blocks.end();
    const int64_t a = b * 256, len = std::min<int64_t>(256, c.n - a);
    for (const size_t i : {size_t{0}, size_t{2}})
      EXPECT_TRUE(strided[i].narrow(0, a, len).eq(fp32 ? 0 : 7).all().item<bool>()) << "block " << b << " state " << i;
    EXPECT_EQ(strided[1][b].item<float>() < 0, fp32) << b;
  }
}

// An independent reference written in PyTorch (tests/optim/adam8_reference.py)
// gives the fused pass's codes, scales and parameters to the last bit.
TEST(Adam8, EqualsThePyTorchReferenceToTheLastCode) {
  const Case c = make_case(4099, 6, 5);
  const std::string dir = testing::TempDir() + "adam8_ref_" + std::to_string(::getpid());
  ASSERT_EQ(std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str()), 0);
  nlohmann::json runs = nlohmann::json::array();
  for (size_t r = 0; r < c.runs[0].size(); ++r) {
    nlohmann::json per_step = nlohmann::json::array();
    for (int s = 0; s < c.steps; ++s) {
      const auto& x = c.runs[static_cast<size_t>(s)][r].s;
      per_step.push_back({x.beta1, x.one_minus_beta1, x.beta2, x.one_minus_beta2, x.eps, x.weight_decay, x.decay,
                          x.bias_correction2_sqrt, x.neg_step_size, x.decoupled});
    }
    runs.push_back({{"start", c.runs[0][r].start}, {"numel", c.runs[0][r].numel}, {"scalars", per_step}});
  }
  std::ofstream(dir + "/case.json") << nlohmann::json{{"n", c.n}, {"steps", c.steps}, {"runs", runs}}.dump();
  std::ofstream(dir + "/param.f32", std::ios::binary).write(reinterpret_cast<const char*>(c.p.data()), c.n * 4);
  {
    std::ofstream g(dir + "/grads.f32", std::ios::binary);
    for (const auto& x : c.grads) g.write(reinterpret_cast<const char*>(x.data()), c.n * 4);
  }
  const std::string cmd = "python3 " + std::string(ZERO_SOURCE_DIR) + "/tests/optim/adam8_reference.py " + dir;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const State8 ours = run_kernel(c, d::best_isa());
  auto load = [&](const std::string& name, auto& out) {
    std::ifstream f(dir + "/" + name, std::ios::binary);
    f.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(out.size() * sizeof(out[0])));
    ASSERT_TRUE(f.good()) << name;
  };
  State8 ref = ours;
  load("param.out.f32", ref.p);
  load("m.codes", ref.mc);
  load("v.codes", ref.vc);
  load("m.absmax.f32", ref.ma);
  load("v.absmax.f32", ref.va);
  int64_t code_diffs = 0;
  for (int64_t i = 0; i < c.n; ++i) code_diffs += (ours.mc[i] != ref.mc[i]) + (ours.vc[i] != ref.vc[i]);
  EXPECT_EQ(code_diffs, 0);
  EXPECT_TRUE(same(ours.ma, ref.ma));
  EXPECT_TRUE(same(ours.va, ref.va));
  EXPECT_TRUE(same(ours.p, ref.p));
  std::system(("rm -rf " + dir).c_str());
}

// Against fp32 Adam on the same gradients: the parameters' change differs by
// the quantization's error, a few percent, not more.
TEST(Adam8, WithinQuantizationErrorOfFp32Adam) {
  const int64_t n = 20000;
  const int steps = 30;
  const Case c = make_case(n, steps, 7);
  State8 q = {c.p, std::vector<uint8_t>(n), std::vector<uint8_t>(n), std::vector<float>((n + 255) / 256),
              std::vector<float>((n + 255) / 256), std::vector<uint16_t>(n)};
  std::vector<float> p32 = c.p, m(n), v(n);
  for (int s = 0; s < steps; ++s) {
    const auto& runs = c.runs[static_cast<size_t>(s)];
    d::adam_fused_8bit(q.p.data(), c.grads[static_cast<size_t>(s)].data(), {q.mc.data(), q.ma.data()},
                       {q.vc.data(), q.va.data()}, n, runs.data(), static_cast<int64_t>(runs.size()));
    for (const auto& r : runs)
      d::adam_fused_fp32(p32.data() + r.start, c.grads[static_cast<size_t>(s)].data() + r.start, m.data() + r.start,
                         v.data() + r.start, r.numel, r.s);
  }
  double diff = 0, change = 0;
  for (int64_t i = 0; i < n; ++i) {
    diff += std::pow(static_cast<double>(q.p[i]) - p32[i], 2);
    change += std::pow(static_cast<double>(p32[i]) - c.p[i], 2);
  }
  const double rel = std::sqrt(diff / change);
  std::printf("8-bit vs fp32 Adam after %d steps: parameter change differs by %.2f%%\n", steps, 100 * rel);
  EXPECT_LT(rel, 0.05);
  EXPECT_GT(rel, 0.0);  // it is quantized
  // The first moment as a whole, dequantized, against fp32's.
  double mdiff = 0, mnorm = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double mq = d::from_e4m3(q.mc[i]) * (q.ma[i / 256] / 448.0f);
    mdiff += (mq - m[i]) * (mq - m[i]);
    mnorm += static_cast<double>(m[i]) * m[i];
  }
  std::printf("first moment differs by %.2f%%\n", 100 * std::sqrt(mdiff / mnorm));
  EXPECT_LT(std::sqrt(mdiff / mnorm), 0.1);
}

}  // namespace

namespace {

// A block whose first moment has decayed below ~1e-36 (its gradients
// stopped long ago): 448 / scale is not finite, so the block's scale and
// codes become zero, alike on every instruction set and the ATen path (not
// E4M3's NaN code, which decodes as NaN on a device).
TEST(Adam8, AScaleTooSmallToInvertBecomesZeroOnEveryPath) {
  const int64_t n = 1000, blocks = 4;
  std::mt19937 rng(9);
  std::normal_distribution<float> normal;
  std::vector<float> p0(n), g(n);
  for (int64_t i = 0; i < n; ++i) {
    p0[i] = normal(rng);
    g[i] = i >= 256 && i < 512 ? 0.0f : 0.01f * normal(rng);
  }
  auto start_states = [&] {
    State8 s{p0, std::vector<uint8_t>(n, 0x38), std::vector<uint8_t>(n, 0x38), std::vector<float>(blocks, 0.5f),
             std::vector<float>(blocks, 0.1f), std::vector<uint16_t>(n)};
    s.ma[1] = 1e-37f;  // block 1: a first moment of about 2e-40, no gradient
    s.va[1] = 1e-30f;
    return s;
  };
  const d::AdamRun run{0, n, scalars(3, 1e-3, 0.0, true)};
  std::vector<State8> results;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!cpu_has(isa)) continue;
    State8 s = start_states();
    d::adam_fused_8bit(s.p.data(), g.data(), {s.mc.data(), s.ma.data()}, {s.vc.data(), s.va.data()}, n, &run, 1, isa,
                       s.low.data(), d::LowPrecision::kBf16);
    EXPECT_EQ(s.ma[1], 0.0f) << d::to_string(isa);
    for (int64_t i = 256; i < 512; ++i) ASSERT_EQ(s.mc[i] & 0x7f, 0) << d::to_string(isa) << " element " << i;
    results.push_back(std::move(s));
  }
  for (size_t k = 1; k < results.size(); ++k) {
    EXPECT_TRUE(same(results[0].p, results[k].p));
    EXPECT_TRUE(same(results[0].mc, results[k].mc));
    EXPECT_TRUE(same(results[0].ma, results[k].ma));
  }
  // The ATen path against the fused pass, from the same states and step values.
  zero::config::OptimizerConfig cfg;
  cfg.optim_bits = 8;
  const auto opt = zero::optim::FlatOptimizer::create(cfg);
  zero::optim::StepParams sp;
  sp.step = 3;
  sp.lr = 1e-3;
  sp.weight_decay = 0.0;
  State8 fused = start_states(), aten = start_states();
  auto tensors = [](State8& x) {
    auto t8 = [](std::vector<uint8_t>& v) { return torch::from_blob(v.data(), {static_cast<int64_t>(v.size())}, torch::kUInt8); };
    auto t32 = [](std::vector<float>& v) { return torch::from_blob(v.data(), {static_cast<int64_t>(v.size())}); };
    return std::vector<at::Tensor>{t8(x.mc), t32(x.ma), t8(x.vc), t32(x.va)};
  };
  auto sf = tensors(fused), sa = tensors(aten);
  at::Tensor grad = torch::from_blob(g.data(), {n});
  at::Tensor pf = torch::from_blob(fused.p.data(), {n}), pa = torch::from_blob(aten.p.data(), {n});
  opt->update_runs({{0, n, sp}}, pf, grad, sf, nullptr);
  zero::optim::adam_8bit_aten({{0, n, sp}}, cfg, pa, grad, sa, nullptr);
  EXPECT_EQ(fused.ma[1], 0.0f);
  EXPECT_EQ(aten.ma[1], 0.0f);
  EXPECT_TRUE(same(fused.mc, aten.mc));
  EXPECT_TRUE(same(fused.ma, aten.ma));
  EXPECT_TRUE(same(fused.p, aten.p));
}

}  // namespace

namespace {

// A NaN gradient: its lane codes as E4M3's NaN (0x7f with a sign) and the
// block's scale skips it, alike on every instruction set and the ATen path;
// the block's other codes stay what they were without it.
TEST(Adam8, ANanLaneIsSkippedByTheScaleOnEveryPath) {
  const int64_t n = 600;
  std::mt19937 rng(4);
  std::normal_distribution<float> normal;
  std::vector<float> p0(n), g(n);
  for (int64_t i = 0; i < n; ++i) p0[i] = normal(rng), g[i] = 0.01f * normal(rng);
  g[300] = std::numeric_limits<float>::quiet_NaN();
  zero::config::OptimizerConfig cfg;
  cfg.optim_bits = 8;
  zero::optim::StepParams sp;
  sp.step = 1;
  const d::AdamRun run{0, n, scalars(1, 1e-3, 0.0, true)};
  std::vector<State8> results;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!cpu_has(isa)) continue;
    State8 s{p0, std::vector<uint8_t>(n), std::vector<uint8_t>(n), std::vector<float>(3), std::vector<float>(3),
             std::vector<uint16_t>(n)};
    d::adam_fused_8bit(s.p.data(), g.data(), {s.mc.data(), s.ma.data()}, {s.vc.data(), s.va.data()}, n, &run, 1, isa);
    EXPECT_TRUE(std::isfinite(s.ma[1]) && s.ma[1] > 0) << d::to_string(isa);
    EXPECT_EQ(s.mc[300] & 0x7f, 0x7f) << d::to_string(isa);
    EXPECT_EQ(s.vc[300] & 0x7f, 0x7f) << d::to_string(isa);
    results.push_back(std::move(s));
  }
  for (size_t k = 1; k < results.size(); ++k) {
    EXPECT_TRUE(same(results[0].mc, results[k].mc));
    EXPECT_TRUE(same(results[0].vc, results[k].vc));
    EXPECT_TRUE(same(results[0].ma, results[k].ma));
    EXPECT_TRUE(same(results[0].va, results[k].va));
  }
  // The ATen path: the same scales and the same codes but for the NaN's sign.
  std::vector<float> p = p0;
  std::vector<at::Tensor> st{torch::zeros({n}, torch::kUInt8), torch::zeros({3}), torch::zeros({n}, torch::kUInt8),
                             torch::zeros({3})};
  at::Tensor pt = torch::from_blob(p.data(), {n}), gt = torch::from_blob(g.data(), {n});
  zero::optim::adam_8bit_aten({{0, n, sp}}, cfg, pt, gt, st, nullptr);
  for (int64_t b = 0; b < 3; ++b) {
    EXPECT_EQ(st[1][b].item<float>(), results[0].ma[b]) << "block " << b;
    EXPECT_EQ(st[3][b].item<float>(), results[0].va[b]) << "block " << b;
  }
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(st[0][i].item<uint8_t>() & 0x7f, results[0].mc[i] & 0x7f) << i;
    if (i != 300) {
      ASSERT_EQ(st[0][i].item<uint8_t>(), results[0].mc[i]) << i;
    }
  }
}

}  // namespace
