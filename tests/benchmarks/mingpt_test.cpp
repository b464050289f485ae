#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <set>

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

// The binary, as the README runs it: a short run writes a summary with the keys scripts rely on.
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

}  // namespace
