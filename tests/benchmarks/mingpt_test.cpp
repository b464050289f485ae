#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <sys/wait.h>
#include <tuple>

#include <nlohmann/json.hpp>
#include <torch/utils.h>

#include "data.h"
#include "model.h"

namespace {

struct Shape {
  int64_t L, H, C, V, T;
};

class ParameterCount : public ::testing::TestWithParam<Shape> {};

TEST_P(ParameterCount, MatchesTheBenchmarkFormula) {
  const auto s = GetParam();
  mingpt::GPTConfig c;
  c.n_layer = s.L;
  c.n_head = s.H;
  c.n_embd = s.C;
  c.vocab_size = s.V;
  c.block_size = s.T;
  mingpt::GPT model(c);
  int64_t counted = 0;
  for (const auto& p : model->parameters()) counted += p.numel();
  const int64_t formula = s.L * (12 * s.C * s.C + 13 * s.C) + s.C * (2 * s.V + s.T + 2);
  EXPECT_EQ(counted, formula);
  EXPECT_EQ(c.num_parameters(), formula);
}

INSTANTIATE_TEST_SUITE_P(Shapes, ParameterCount,
                         ::testing::Values(Shape{1, 1, 8, 10, 6}, Shape{2, 4, 64, 65, 128},
                                           Shape{3, 3, 48, 10, 6}, Shape{4, 8, 256, 256, 64}),
                         [](const auto& info) {
                           const Shape& s = info.param;
                           return "L" + std::to_string(s.L) + "_C" + std::to_string(s.C) + "_V" +
                                  std::to_string(s.V) + "_T" + std::to_string(s.T);
                         });

TEST(MinGPT, ForwardShapesAndCausality) {
  mingpt::GPTConfig c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 16;
  c.vocab_size = 10;
  c.block_size = 8;
  c.embd_pdrop = c.resid_pdrop = c.attn_pdrop = 0;
  torch::manual_seed(0);
  mingpt::GPT model(c);
  auto x = torch::randint(0, 10, {3, 8}, torch::kLong);
  auto y = model->forward(x);
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{3, 8, 10}));
  // Changing the last token must not change earlier positions' logits.
  auto x2 = x.clone();
  x2.index_put_({torch::indexing::Slice(), 7}, (x.select(1, 7) + 1) % 10);
  auto y2 = model->forward(x2);
  EXPECT_TRUE(torch::allclose(y.narrow(1, 0, 7), y2.narrow(1, 0, 7)));
  EXPECT_FALSE(torch::allclose(y.select(1, 7), y2.select(1, 7)));
}

TEST(MinGPTData, EpochOrderIsAPermutationFixedBySeedAndEpoch) {
  auto a = mingpt::epoch_order(1000, 42, 3);
  auto b = mingpt::epoch_order(1000, 42, 3);
  auto c = mingpt::epoch_order(1000, 42, 4);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_EQ(std::set<int64_t>(a.begin(), a.end()).size(), 1000u);
}

// N ranks with micro-batch m see, together, exactly the samples that one rank
// with micro-batch m*N sees: the global batch does not depend on the world size.
TEST(MinGPTData, RanksSplitTheGlobalBatch) {
  auto order = mingpt::epoch_order(4096, 1, 0);
  for (int64_t ws : {2, 4}) {
    for (int64_t step = 0; step < 3; ++step) {
      std::multiset<int64_t> many, one;
      for (int64_t micro = 0; micro < 2; ++micro)
        for (int64_t r = 0; r < ws; ++r)
          for (auto i : mingpt::micro_batch_indices(order, step, micro, r, 8, 2, ws)) many.insert(i);
      for (int64_t micro = 0; micro < 2; ++micro)
        for (auto i : mingpt::micro_batch_indices(order, step, micro, 0, 8 * ws, 2, 1)) one.insert(i);
      EXPECT_EQ(many, one) << "world size " << ws << " step " << step;
    }
  }
}

TEST(MinGPTData, AdditionTargetsAreTheReversedSum) {
  auto task = mingpt::make_addition_task(2);
  EXPECT_EQ(task->block_size(), 6);
  auto b = task->train_batch({0, 1, 2, 3, 4});
  auto x = b.x.accessor<int64_t, 2>();
  auto y = b.y.accessor<int64_t, 2>();
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(y[i][0], -1);
    EXPECT_EQ(y[i][2], -1);
    const int64_t a = x[i][0] * 10 + x[i][1], bb = x[i][2] * 10 + x[i][3];
    const int64_t c = y[i][3] + 10 * y[i][4] + 100 * y[i][5];
    EXPECT_EQ(a + bb, c);
    EXPECT_EQ(x[i][4], y[i][3]);  // inputs are the targets shifted by one
  }
}

TEST(MinGPTData, TextTaskRejectsAMissingFileByName) {
  try {
    mingpt::make_text_task("/nonexistent/input.txt", 32);
    FAIL();
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/input.txt"), std::string::npos);
  }
}

// The binary, as docs/mingpt.md runs it: a short run writes a summary with the keys scripts rely on.
TEST(MinGPTBinary, WritesTheSummaryJson) {
  const std::string bin = std::string(ZERO_BINARY_DIR) + "/bin/mingpt";
  const std::string out = std::string(ZERO_BINARY_DIR) + "/tests/mingpt_summary_test.json";
  const std::string cfg = std::string(ZERO_SOURCE_DIR) + "/configs/mingpt_zero0.json";
  std::remove(out.c_str());
  const std::string cmd = bin + " --config " + cfg +
                          " --n_layer 1 --n_embd 32 --n_head 2 --limit_train_batches 8 --max_epochs 2"
                          " --summary-json " + out + " > /dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(out);
  ASSERT_TRUE(in.good());
  auto j = nlohmann::json::parse(in);
  for (const char* key : {"world_size", "zero_stage", "num_parameters", "steps", "final_loss",
                          "param_l2", "avg_epoch_time_s", "peak_bytes", "model_state_bytes",
                          "ranks", "eval_accuracy"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  for (const char* tier : {"device", "pinned_host", "host", "nvme"}) EXPECT_TRUE(j["peak_bytes"].contains(tier));
  for (const char* kind : {"parameters", "gradients", "optimizer_states"})
    EXPECT_GT(j["model_state_bytes"][kind].get<int64_t>(), 0) << kind;
  EXPECT_EQ(j["steps"].get<int64_t>(), 16);
  EXPECT_EQ(j["num_parameters"].get<int64_t>(), 1 * (12 * 32 * 32 + 13 * 32) + 32 * (2 * 10 + 6 + 2));
  EXPECT_GT(j["peak_bytes"]["device"].get<int64_t>(), 0);
  EXPECT_EQ(j["ranks"].size(), 1u);
}

TEST(MinGPTBinary, UnknownFlagSuggestsTheNearestOne) {
  const std::string bin = std::string(ZERO_BINARY_DIR) + "/bin/mingpt";
  const std::string log = std::string(ZERO_BINARY_DIR) + "/tests/mingpt_badflag.log";
  const std::string cmd = bin + " --config x.json --n_layr 2 > " + log + " 2>&1";
  EXPECT_NE(std::system(cmd.c_str()), 0);
  std::ifstream in(log);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("did you mean --n_layer"), std::string::npos) << text;
}

// The first progress line comes before any optimizer step has a loss: it shows
// none rather than "loss nan" (gradient_accumulation_steps 2: the first
// micro-batch ends no step).
TEST(MinGPTBinary, NoLossIsShownBeforeTheFirstStep) {
  const std::string bin = std::string(ZERO_BINARY_DIR) + "/bin/mingpt";
  const std::string dir = std::string(ZERO_BINARY_DIR) + "/tests";
  const std::string cfg = dir + "/mingpt_gas2_test.json", log = dir + "/mingpt_gas2_test.log";
  {
    std::ofstream c(cfg);
    c << R"({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
             "optimizer": {"type": "AdamW", "params": {"lr": 5e-4}}, "steps_per_print": 1000})";
  }
  const std::string cmd = bin + " --config " + cfg +
                          " --n_layer 1 --n_embd 32 --n_head 2 --limit_train_batches 3 > " + log + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(log);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("epoch 1/1 ["), std::string::npos) << text;  // a progress line was drawn
  EXPECT_NE(text.find("loss "), std::string::npos) << text;         // and a loss once there was one
  EXPECT_EQ(text.find("nan"), std::string::npos) << text;
  std::remove(cfg.c_str());
  std::remove(log.c_str());
}

// Runs `args` through the shell with output to a log; the exit status and the log.
std::pair<int, std::string> run_logged(const std::string& args, const std::string& name) {
  const std::string log = std::string(ZERO_BINARY_DIR) + "/tests/" + name + ".log";
  const int rc = std::system((args + " > " + log + " 2>&1").c_str());
  std::ifstream in(log);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::remove(log.c_str());
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : 128 + WTERMSIG(rc), text};
}

const std::string kMingpt = std::string(ZERO_BINARY_DIR) + "/bin/mingpt";
const std::string kConfigs = std::string(ZERO_SOURCE_DIR) + "/benchmarks/max_params/";
const std::string kTiny = " --n_layer 2 --n_embd 64 --n_head 2 --batch_size 4 --limit_train_batches 2";

// A budget too small: exit status 3 and a message naming the tier, the bytes
// asked, the cap and the config keys that would help.
TEST(MinGPTBudgets, DeviceBudgetTooSmallNamesTheTierCapAndKeys) {
  auto [rc, text] = run_logged(kMingpt + " --config " + kConfigs + "ddp.json" + kTiny + " --device-memory 1MiB", "budget_dev");
  EXPECT_EQ(rc, 3) << text;
  EXPECT_NE(text.find("out of memory on the device"), std::string::npos) << text;
  EXPECT_NE(text.find("asked"), std::string::npos) << text;
  EXPECT_NE(text.find("limit 1.00 MiB"), std::string::npos) << text;
  EXPECT_NE(text.find("device_memory_limit_bytes"), std::string::npos) << text;
  EXPECT_NE(text.find("zero_optimization.stage 3"), std::string::npos) << text;
}

TEST(MinGPTBudgets, HostBudgetTooSmallNamesNvmeOffload) {
  auto [rc, text] =
      run_logged(kMingpt + " --config " + kConfigs + "zero3_offload.json" + kTiny + " --host-memory 64KiB", "budget_host");
  EXPECT_EQ(rc, 3) << text;
  EXPECT_NE(text.find("out of memory on the host (pinned and pageable)"), std::string::npos) << text;
  EXPECT_NE(text.find("limit 64.00 KiB"), std::string::npos) << text;
  EXPECT_NE(text.find("offload_optimizer.device \"nvme\""), std::string::npos) << text;
}

TEST(MinGPTBudgets, BudgetsThatFitChangeNothing) {
  auto [rc, text] = run_logged(kMingpt + " --config " + kConfigs + "zero3_offload.json" + kTiny +
                                   " --device-memory 1GiB --host-memory 1GiB --nvme-bytes 1GiB",
                               "budget_fit");
  EXPECT_EQ(rc, 0) << text;
}

TEST(MinGPTBudgets, BadByteCountsAreUsageErrors) {
  auto [rc, text] = run_logged(kMingpt + " --config x.json --device-memory 12XB", "budget_bad");
  EXPECT_EQ(rc, 2) << text;
  EXPECT_NE(text.find("--device-memory: expected a byte count"), std::string::npos) << text;
  std::tie(rc, text) = run_logged(kMingpt + " --config " + kConfigs + "ddp.json --find-max-params", "find_nodev");
  EXPECT_EQ(rc, 2) << text;
  EXPECT_NE(text.find("needs --device-memory"), std::string::npos) << text;
  std::tie(rc, text) = run_logged(kMingpt + " --config " + kConfigs + "ddp.json --find-max-params --n_embd 64 --device-memory 1GiB", "find_embd");
  EXPECT_EQ(rc, 2) << text;
  EXPECT_NE(text.find("--n_embd does not go with --find-max-params"), std::string::npos) << text;
  std::tie(rc, text) = run_logged(kMingpt + " --config " + kConfigs + "ddp.json --nproc 2", "find_nproc");
  EXPECT_EQ(rc, 2) << text;
  EXPECT_NE(text.find("--nproc goes with --find-max-params only"), std::string::npos) << text;
  std::tie(rc, text) = run_logged(kMingpt + " --config " + kConfigs + "ddp.json --probe_timeout 60", "find_timeout");
  EXPECT_EQ(rc, 2) << text;
  EXPECT_NE(text.find("--probe_timeout goes with --find-max-params only"), std::string::npos) << text;
}

// The search on 2 ranks: the size it reports trains, one layer more at that
// width does not (it was tried), and its peak is within the budget.
TEST(MinGPTFindMaxParams, FindsTheLargestThatTrainsOnTwoRanks) {
  const std::string report = std::string(ZERO_BINARY_DIR) + "/tests/find_max_test.json";
  std::remove(report.c_str());
  auto [rc, text] = run_logged(kMingpt + " --config " + kConfigs + "zero3.json --find-max-params --nproc 2 --head_dim 32"
                                   " --batch_size 4 --probe_steps 2 --device-memory 40MiB --summary-json " + report,
                               "find_max");
  ASSERT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("find-max-params: probe 1:"), std::string::npos) << text;  // progress, per probe
  EXPECT_NE(text.find("largest: n_layer"), std::string::npos) << text;
  std::ifstream in(report);
  ASSERT_TRUE(in.good()) << text;
  const auto j = nlohmann::json::parse(in);
  const auto& best = j["largest"];
  const int64_t L = best["n_layer"], C = best["n_embd"];
  EXPECT_EQ(best["n_head"].get<int64_t>(), C / 32);
  EXPECT_GT(best["step_time_s"].get<double>(), 0);
  EXPECT_LE(best["peak_bytes"]["device"].get<int64_t>(), 40 << 20);
  EXPECT_GT(best["peak_bytes"]["device"].get<int64_t>(), 20 << 20);  // the budget binds
  bool next_layer_tried = false;
  for (const auto& p : j["probes"]) {
    if (p["n_embd"] == C && p["n_layer"] == L + 1) {
      next_layer_tried = true;
      EXPECT_FALSE(p["fits"].get<bool>());
      EXPECT_NE(p["out_of_memory"].get<std::string>().find("out of memory on the device"), std::string::npos);
    }
    if (p["fits"].get<bool>()) {
      EXPECT_LE(p["num_parameters"], best["num_parameters"]);
    }
  }
  EXPECT_TRUE(next_layer_tried) << j.dump(1);
  const double ratio = j["capacity"]["ratio"];
  EXPECT_GT(ratio, 0.3);
  EXPECT_LE(ratio, 1.0);
  std::remove(report.c_str());
}

}  // namespace
