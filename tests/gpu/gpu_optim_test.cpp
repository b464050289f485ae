// Optimizers on the card (CTest label "gpu"): the device's ATen paths of
// Adam (fp32, bf16 master, 8-bit states) against the CPU's fused kernels,
// bit for bit.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "gpu_util.h"
#include "zero/optim/flat_optimizer.h"

namespace {

using namespace zero_gpu_test;


// 8-bit Adam states on the device run the ATen path (NOTE [8-bit states]):
// separate element-wise kernels (no multiply-add contracted across them),
// divisions by tensors, sqrt through fp64, E4M3 through c10's conversion;
// so its codes, scales, parameters and bf16 copy equal the CPU's fused
// pass, bit for bit, over steps and three parameter groups.
TEST(GpuOptim, EightBitStatesOnTheDeviceEqualTheCpuKernel) {
  REQUIRE_CUDA();
  zero::config::OptimizerConfig cfg;
  cfg.type = zero::config::OptimizerType::kAdamW;
  cfg.weight_decay = 0.1;
  cfg.optim_bits = 8;
  const auto opt = zero::optim::FlatOptimizer::create(cfg);
  const int64_t n = 100003, blocks = (n + 255) / 256;
  torch::manual_seed(5);
  auto p_cpu = torch::randn({n});
  auto p_dev = p_cpu.to(kCuda);
  std::vector<at::Tensor> s_cpu{torch::zeros({n}, torch::kUInt8), torch::zeros({blocks}), torch::zeros({n}, torch::kUInt8),
                                torch::zeros({blocks})};
  std::vector<at::Tensor> s_dev;
  for (const auto& t : s_cpu) s_dev.push_back(t.to(kCuda));
  auto low_cpu = torch::empty({n}, torch::kBFloat16), low_dev = low_cpu.to(kCuda);
  const auto scale = torch::logspace(-4, 0, n);  // gradients of very different sizes within a block
  for (int64_t step = 1; step <= 5; ++step) {
    const auto g = torch::randn({n}) * scale;
    std::vector<zero::optim::FlatOptimizer::Run> runs;
    for (int r = 0; r < 3; ++r) {
      zero::optim::StepParams sp;
      sp.step = step;
      sp.lr = 1e-3 * (r + 1);
      sp.weight_decay = 0.1 * r;
      runs.push_back({r * (n / 3), r < 2 ? n / 3 : n - 2 * (n / 3), sp});
    }
    opt->update_runs(runs, p_cpu, g, s_cpu, &low_cpu);
    const auto g_dev = g.to(kCuda);
    opt->update_runs(runs, p_dev, g_dev, s_dev, &low_dev);
  }
  EXPECT_TRUE(p_cpu.equal(p_dev.cpu())) << (p_cpu - p_dev.cpu()).abs().max().item<float>();
  for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(s_cpu[i].equal(s_dev[i].cpu())) << "state " << i;
  EXPECT_TRUE(low_cpu.equal(low_dev.cpu()));
}

// min_8bit_size on the device: the blocks marked fp32 step as fp32 Adam in
// ATen operations (within their rounding of the CPU's fused pass), the
// 8-bit blocks as the CPU's, bit for bit; the marks stay.
TEST(GpuOptim, EightBitStatesWithFp32BlocksOnTheDevice) {
  REQUIRE_CUDA();
  zero::config::OptimizerConfig cfg;
  cfg.type = zero::config::OptimizerType::kAdamW;
  cfg.optim_bits = 8;
  const auto opt = zero::optim::FlatOptimizer::create(cfg);
  const auto specs = opt->state_specs();
  const int64_t n = 10003, blocks = (n + 255) / 256;
  const std::vector<int64_t> fp32_blocks{0, 1, 7, 20, blocks - 1};
  torch::manual_seed(6);
  auto p_cpu = torch::randn({n});
  auto p_dev = p_cpu.to(kCuda);
  std::vector<at::Tensor> s_cpu{torch::zeros({n}, torch::kUInt8), torch::zeros({blocks}),
                                torch::zeros({n}, torch::kUInt8), torch::zeros({blocks}),
                                torch::zeros({specs[4].side_numel(5)}), torch::zeros({specs[5].side_numel(5)})};
  s_cpu[0].fill_(7);  // codes the marking zeroes in its blocks (under a zero scale they stand for 0)
  s_cpu[2].fill_(7);
  std::vector<at::Tensor> s_dev;
  for (const auto& t : s_cpu) s_dev.push_back(t.to(kCuda));
  zero::optim::mark_fp32_blocks(fp32_blocks, s_cpu);  // the device's: index_copy_ and index_fill_ there
  zero::optim::mark_fp32_blocks(fp32_blocks, s_dev);
  for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(s_cpu[i].equal(s_dev[i].cpu())) << "marked state " << i;
  for (int64_t step = 1; step <= 4; ++step) {
    const auto g = torch::randn({n});
    zero::optim::StepParams sp;
    sp.step = step;
    opt->update_runs({{0, n, sp}}, p_cpu, g, s_cpu, nullptr);
    const auto g_dev = g.to(kCuda);
    opt->update_runs({{0, n, sp}}, p_dev, g_dev, s_dev, nullptr);
  }
  const auto p_back = p_dev.cpu();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t a = b * 256, len = std::min<int64_t>(256, n - a);
    const bool fp32 = std::find(fp32_blocks.begin(), fp32_blocks.end(), b) != fp32_blocks.end();
    if (fp32) EXPECT_TRUE(torch::allclose(p_cpu.narrow(0, a, len), p_back.narrow(0, a, len), 1e-6, 1e-7)) << b;
    else EXPECT_TRUE(p_cpu.narrow(0, a, len).equal(p_back.narrow(0, a, len))) << b;
  }
  for (size_t i : {0, 1, 2, 3}) EXPECT_TRUE(s_cpu[i].equal(s_dev[i].cpu())) << "state " << i;  // codes, scales and marks
  EXPECT_EQ(s_dev[1].lt(0).sum().item<int64_t>(), static_cast<int64_t>(fp32_blocks.size()));
}

// A bf16 master and bf16 states on the device (NOTE [16-bit master]): the
// stochastic rounding's words on the GPU are the CPU's (the same bits from
// the same fp32 values), and a step of update_stored there tracks the CPU's
// (whose inner fp32 Adam differs by ATen's rounding) within a bf16 step.
TEST(GpuOptim, Bf16MasterOnTheDeviceRoundsAsTheCpu) {
  REQUIRE_CUDA();
  torch::manual_seed(6);
  const int64_t n = 1 << 20;
  const auto x = torch::randn({n}) * torch::exp(torch::randn({n}) * 4);
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    const zero::optim::Rounding r{true, (uint64_t{3} << 32) - 1000, 9};
    const auto cpu = zero::optim::round_to(x, dtype, r, 1);
    const auto dev = zero::optim::round_to(x.to(kCuda), dtype, r, 1);
    EXPECT_TRUE(cpu.view(torch::kShort).equal(dev.cpu().view(torch::kShort))) << c10::toString(dtype);
  }
  zero::config::OptimizerConfig cfg;
  cfg.type = zero::config::OptimizerType::kAdamW;
  cfg.weight_decay = 0.1;
  cfg.bf16_states = true;
  const auto opt = zero::optim::FlatOptimizer::create(cfg);
  auto p_cpu = torch::randn({n}).to(torch::kBFloat16);
  auto p_dev = p_cpu.to(kCuda);
  std::vector<at::Tensor> s_cpu{torch::zeros({n}, torch::kBFloat16), torch::zeros({n}, torch::kBFloat16)};
  std::vector<at::Tensor> s_dev{s_cpu[0].to(kCuda), s_cpu[1].to(kCuda)};
  auto low_dev = torch::empty({n}, torch::TensorOptions().dtype(torch::kBFloat16).device(kCuda));
  for (int64_t step = 1; step <= 5; ++step) {
    const auto g = torch::randn({n});
    zero::optim::FlatOptimizer::Run run{0, n, {}};
    run.params.step = step;
    const zero::optim::Rounding r{true, 0, step};
    zero::optim::update_stored(*opt, {run}, p_cpu, g, s_cpu, nullptr, r);
    const auto g_dev = g.to(kCuda);
    zero::optim::update_stored(*opt, {run}, p_dev, g_dev, s_dev, &low_dev, r);
  }
  EXPECT_TRUE(low_dev.equal(p_dev)) << "the model's copy is the master's bits";
  const auto diff = (p_cpu.to(torch::kFloat) - p_dev.cpu().to(torch::kFloat)).abs();
  const auto step = p_cpu.to(torch::kFloat).abs() / 128 + 1e-30;
  const double beyond = diff.gt(step * 1.01).to(torch::kFloat).mean().item<double>();
  EXPECT_LT(beyond, 1e-3) << "elements more than a bf16 step apart";
  EXPECT_GT(diff.eq(0).to(torch::kFloat).mean().item<double>(), 0.9) << "most elements the same bits";
}

// NOTE [device Adam]: one fp32 Adam step on the device equals the fused CPU
// pass bit for bit, decoupled (AdamW) and L2 (Adam), over steps.
TEST(GpuOptim, Fp32AdamOnTheDeviceEqualsTheCpuKernel) {
  REQUIRE_CUDA();
  const int64_t n = 100003;
  for (const bool adamw : {true, false}) {
    zero::config::OptimizerConfig cfg;
    cfg.type = adamw ? zero::config::OptimizerType::kAdamW : zero::config::OptimizerType::kAdam;
    cfg.adam_w_mode = adamw;
    cfg.weight_decay = 0.1;
    const auto opt = zero::optim::FlatOptimizer::create(cfg);
    auto p_cpu = torch::randn({n});
    auto p_dev = p_cpu.to(kCuda);
    std::vector<at::Tensor> s_cpu{torch::zeros({n}), torch::zeros({n})};
    std::vector<at::Tensor> s_dev{s_cpu[0].to(kCuda), s_cpu[1].to(kCuda)};
    for (int64_t step = 1; step <= 5; ++step) {
      const auto g = torch::randn({n}) * 0.01;
      zero::optim::StepParams sp{step, 3e-3, 0.9, 0.95};
      opt->update(sp, p_cpu, g, s_cpu);
      const auto g_dev = g.to(kCuda);
      opt->update(sp, p_dev, g_dev, s_dev);
    }
    EXPECT_TRUE(p_cpu.equal(p_dev.cpu())) << (adamw ? "AdamW" : "Adam");
    EXPECT_TRUE(s_cpu[0].equal(s_dev[0].cpu()));
    EXPECT_TRUE(s_cpu[1].equal(s_dev[1].cpu()));
  }
}

}  // namespace
