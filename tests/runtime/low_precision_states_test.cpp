// Low-precision optimizer states through the engine, on one process: 8-bit
// Adam moments (NOTE [8-bit states]) and DeepSpeed's 16-bit master and
// states (NOTE [16-bit master]). On every tier (the device, host memory,
// NVMe swap files) they step alike, bit for bit; the ledger holds their
// formulas' bytes; they train as fp32 states within their rounding; and
// their checkpoints resume, bit for bit at the same layout and converted
// (requantized, widened or narrowed) at another.
#include <gtest/gtest.h>

#include <numeric>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data.h"
#include "tiny_gpt.h"
#include "zero/core/error.h"
#include "zero/offload/aio.h"
#include "zero/snapshots/checkpoint_io.h"
#include "zero/testing/memory.h"
#include "zero/zero.h"

namespace {

using zero::test::flat_params;
using zero::test::loss_of;
using zero::test::make_model;
using zero::test::quiet;

}  // namespace

namespace {

// 8-bit optimizer states (optimizer.params.optim_bits 8, NOTE [8-bit states]);
// min_8bit_size 1000 keeps the tiny model's biases, norms and embeddings'
// blocks in fp32 and its matrices' (1024 and 4096 elements) in 8 bits.
std::string config_8bit(const std::string& zero_section, int64_t mbs = 16, int64_t min_8bit_size = 1000) {
  return R"({"train_micro_batch_size_per_gpu": )" + std::to_string(mbs) +
         R"(, "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-8, )"
         R"("weight_decay": 0.01, "optim_bits": 8, "min_8bit_size": )" + std::to_string(min_8bit_size) +
         R"(}}, "zero_optimization": )" + zero_section + "}";
}

// Removes the 8-bit keys of a config_8bit: fp32 states.
std::string without_8bit(std::string config) {
  const auto a = config.find(R"(, "optim_bits": 8)"), b = config.find("}}", a);
  return config.erase(a, b - a);
}

struct Run8 {
  std::vector<torch::Tensor> params;
  std::vector<double> losses;
  zero::ModelStateBytes states;
  int64_t num_parameters = 0;
};

Run8 run_8bit(const std::string& config, int steps, int first_step = 0,
              const std::function<void(zero::Engine&, int)>& at_step = nullptr) {
  auto model = make_model(7);
  auto engine = zero::initialize(model.ptr(), config, quiet());
  auto task = mingpt::make_addition_task(2);
  auto order = mingpt::epoch_order(task->train_size(), 1, 0);
  Run8 out;
  for (int s = first_step; s < steps; ++s) {
    if (at_step) at_step(engine, s);
    auto b = task->train_batch(mingpt::micro_batch_indices(order, s, 0, 0, 16, 1, 1));
    auto loss = loss_of(model, b);
    out.losses.push_back(loss.item<double>());
    engine.backward(loss);
    engine.step();
  }
  out.params = flat_params(model);
  out.states = engine.model_state_bytes();
  out.num_parameters = engine.num_parameters();
  return out;
}

// run_8bit's at_step: at step 3, a checkpoint saved in `dir` as `tag`, or loaded from it.
std::function<void(zero::Engine&, int)> save_at3(const std::string& dir, const std::string& tag) {
  return [dir, tag](zero::Engine& e, int s) {
    if (s == 3) e.save_checkpoint(dir, tag);
  };
}
std::function<void(zero::Engine&, int)> load_at3(const std::string& dir, const std::string& tag) {
  return [dir, tag](zero::Engine& e, int s) {
    if (s == 3) e.load_checkpoint(dir, tag);
  };
}

// A run resumed at step 3 goes on as `whole`: its first loss the same
// (the parameters are the master's, exactly), each next within `rel`.
void expect_goes_on_as(const Run8& resumed, const Run8& whole, double rel, const std::string& what = "") {
  ASSERT_GE(whole.losses.size(), 3 + resumed.losses.size()) << what;
  ASSERT_FALSE(resumed.losses.empty()) << what;
  EXPECT_EQ(resumed.losses[0], whole.losses[3]) << what;
  for (size_t i = 1; i < resumed.losses.size(); ++i)
    EXPECT_NEAR(resumed.losses[i], whole.losses[3 + i], rel * whole.losses[3 + i]) << what << " step " << 3 + i;
}

void expect_same_bits(const Run8& a, const Run8& b, const std::string& what) {
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) EXPECT_TRUE(torch::equal(a.params[i], b.params[i])) << what << ": parameter " << i;
}

// Runs 4 steps of `config_of(zero_section)` at stages 1-3 with sub-groups
// of 3000 elements with the states on the device, in host memory and in NVMe
// swap files; expects the same bits on every tier (`stage3_layers`: stage 3
// partitions the blocks' matrices, layer by layer).
void expect_every_tier_steps_alike(const std::function<std::string(const std::string&)>& config_of,
                                   const std::string& name, bool stage3_layers) {
  const std::string dir = std::string(ZERO_BINARY_DIR) + "/tests/engine_" + name + "_" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  for (int stage : {1, 2, 3}) {
    const std::string base = R"({"stage": )" + std::to_string(stage) + R"(, "sub_group_size": 3000)" +
                             (stage == 3 && stage3_layers ? R"(, "stage3_param_persistence_threshold": 100)" : "");
    const Run8 device = run_8bit(config_of(base + "}"), 4);
    const Run8 cpu = run_8bit(config_of(base + R"(, "offload_optimizer": {"device": "cpu"}})"), 4);
    const Run8 nvme = run_8bit(config_of(base + R"(, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir +
                                         R"(", "buffer_count": 2, "pipeline_read": true}})"),
                               4);
    expect_same_bits(device, cpu, name + " stage " + std::to_string(stage) + " cpu");
    expect_same_bits(device, nvme, name + " stage " + std::to_string(stage) + " nvme");
    EXPECT_LT(device.losses.back(), device.losses.front());
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir));
  std::filesystem::remove(dir);
}

// The states on the device, in host memory and in NVMe swap files (whose
// files hold the codes and scales) step alike, bit for bit, at stages 1-3,
// with sub-groups that split the blocks of a group unevenly.
TEST(EightBitStates, EveryTierStepsAlike) {
  expect_every_tier_steps_alike([](const std::string& z) { return config_8bit(z); }, "8bit", false);
}

// The ledger's optimizer states: two 8-bit moments with their block scales
// (2 + 8/256 bytes a parameter, against fp32 moments' 8) and, offloaded, the
// fp32 master (4; without offload the fp32 parameters on one rank are the
// master); the engine's figures match the formula's (zero/testing).
// With min_8bit_size, the blocks kept in fp32 add 8 bytes an element of
// theirs, as the estimator (the formula) counts them.
TEST(EightBitStates, LedgerHoldsTwoBytesAParameterOfMoments) {
  for (const char* offload : {"", R"(, "offload_optimizer": {"device": "cpu"})"}) {
    for (const int64_t min_8bit : {0, 1000, 4096}) {
      const double want = (*offload ? 4.0 : 0.0) + 2.0 + 8.0 / 256;
      auto model = make_model(1);
      auto engine =
          zero::initialize(model.ptr(), config_8bit(std::string(R"({"stage": 2)") + offload + "}", 16, min_8bit), quiet());
      const double psi = static_cast<double>(engine.num_parameters());
      const double per_param = static_cast<double>(engine.model_state_bytes().optimizer_states) / psi;
      if (min_8bit == 0) EXPECT_NEAR(per_param, want, 0.05 * want) << offload;
      else EXPECT_GT(per_param, want + 0.5) << offload << min_8bit;  // the tiny model's many small tensors
      const auto check = zero::testing::expect_model_states_near_formula(engine, 0.02);
      EXPECT_TRUE(check) << min_8bit << check.message;
    }
  }
}

// Every parameter under min_8bit_size: every block keeps fp32 moments, and
// training is fp32 states' to the bit, at stages 1-3, on the device and
// offloaded (and all parameters above it: the 8-bit run's bits, whatever
// min_8bit_size 0 or 1 says).
TEST(EightBitStates, SmallTensorsKeepFp32States) {
  for (int stage : {1, 2, 3}) {
    for (const char* offload : {"", R"(, "offload_optimizer": {"device": "cpu"})"}) {
      const std::string z = R"({"stage": )" + std::to_string(stage) + R"(, "sub_group_size": 3000)" + offload + "}";
      const std::string what = "stage " + std::to_string(stage) + offload;
      expect_same_bits(run_8bit(config_8bit(z, 16, int64_t{1} << 40), 3), run_8bit(without_8bit(config_8bit(z)), 3),
                       what);
    }
  }
  expect_same_bits(run_8bit(config_8bit(R"({"stage": 2})", 16, 0), 3), run_8bit(config_8bit(R"({"stage": 2})", 16, 1), 3),
                   "min_8bit_size 0 and 1");
  // load_weights starts the states afresh, the fp32 blocks marked again.
  const std::string file = std::string(ZERO_BINARY_DIR) + "/tests/engine_8bit_weights_" + std::to_string(getpid()) +
                           ".safetensors";
  const std::string z = R"({"stage": 2, "offload_optimizer": {"device": "cpu"}})";
  run_8bit(without_8bit(config_8bit(z)), 2, 0, [&](zero::Engine& e, int s) {
    if (s == 1) e.save_16bit_model(file);
  });
  auto from_file = [&](zero::Engine& e, int s) {
    if (s == 0) e.load_weights(file);
  };
  expect_same_bits(run_8bit(config_8bit(z, 16, int64_t{1} << 40), 3, 0, from_file),
                   run_8bit(without_8bit(config_8bit(z)), 3, 0, from_file), "after load_weights");
  std::remove(file.c_str());
}

// Against fp32 moments on the same data: training follows the same path
// within the quantization's error (amplified by 30 steps of feedback: the
// kernel alone, on fixed gradients, is 4.6% off after 30 steps).
TEST(EightBitStates, TrainsAsFp32StatesWithinTheQuantizationError) {
  const Run8 q = run_8bit(config_8bit(R"({"stage": 2})"), 30);
  const auto fp32_config = without_8bit(config_8bit(R"({"stage": 2})"));
  const Run8 f = run_8bit(fp32_config, 30);
  auto initial_model = make_model(7);
  const auto init = flat_params(initial_model);
  double diff = 0, moved = 0;
  for (size_t i = 0; i < q.params.size(); ++i) {
    diff += (q.params[i] - f.params[i]).pow(2).sum().item<double>();
    moved += (f.params[i] - init[i]).pow(2).sum().item<double>();
  }
  const double rel = std::sqrt(diff / moved);
  std::printf("8-bit vs fp32 states after 30 steps: parameters' change differs by %.2f%%; loss %.4f vs %.4f\n",
              100 * rel, q.losses.back(), f.losses.back());
  EXPECT_GT(rel, 0.0);
  EXPECT_LT(rel, 0.3);
  EXPECT_NEAR(q.losses.back(), f.losses.back(), 0.05 * f.losses.back());
}

// A checkpoint keeps the codes and scales as they are: a resumed run steps
// on bit for bit; a run laid out otherwise requantizes them and steps on
// within their error; fp32 states load from it dequantized, and 8-bit states
// from an fp32 checkpoint quantized.
TEST(EightBitStates, CheckpointResumesBitForBitAndRequantizesForAnotherLayout) {
  const std::string dir = std::string(ZERO_BINARY_DIR) + "/tests/engine_8bit_ckpt_" + std::to_string(getpid());
  ASSERT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
  const std::string config = config_8bit(R"({"stage": 2, "sub_group_size": 3000, "offload_optimizer": {"device": "cpu"}})");
  const Run8 whole = run_8bit(config, 6, 0, save_at3(dir, "at3"));
  const Run8 resumed = run_8bit(config, 6, 3, load_at3(dir, "at3"));
  expect_same_bits(whole, resumed, "resumed");
  {  // The codes are saved as bytes: the file is smaller than fp32 moments'.
    std::ifstream meta(dir + "/at3/meta.json");
    const auto j = nlohmann::json::parse(meta);
    EXPECT_EQ(j.at("states").size(), 7u);
    EXPECT_EQ(j.at("state_blocks").at("sub_group_size").get<int64_t>(), 3000);
    EXPECT_EQ(j.at("state_blocks").at("min_8bit_size").get<int64_t>(), 1000);
  }
  // Another sub_group_size, or other groups (buckets): the moments are
  // dequantized and quantized again in this run's blocks, and training goes
  // on as the uninterrupted run within the requantization's error.
  // Another min_8bit_size: other blocks in fp32.
  for (const auto& [other, min_8bit] : std::vector<std::pair<const char*, int64_t>>{
           {R"({"stage": 2, "sub_group_size": 5000, "offload_optimizer": {"device": "cpu"}})", 1000},
           {R"({"stage": 2, "sub_group_size": 3000, "reduce_bucket_size": 20000, )"
            R"("allgather_bucket_size": 20000, "offload_optimizer": {"device": "cpu"}})", 1000},
           {R"({"stage": 2, "sub_group_size": 3000, "offload_optimizer": {"device": "cpu"}})", 0},
           {R"({"stage": 2, "sub_group_size": 3000, "offload_optimizer": {"device": "cpu"}})", 5000}}) {
    const Run8 relaid = run_8bit(config_8bit(other, 16, min_8bit), 6, 3, load_at3(dir, "at3"));
    ASSERT_EQ(relaid.losses.size(), 3u);
    expect_goes_on_as(relaid, whole, 0.01, other);
    double diff = 0, norm = 0;
    for (size_t i = 0; i < whole.params.size(); ++i) {
      diff += (relaid.params[i] - whole.params[i]).pow(2).sum().item<double>();
      norm += whole.params[i].pow(2).sum().item<double>();
    }
    // One step moves the parameters by about 1.5% of their norm here (lr
    // 0.003, Adam's steps of about lr an element): a third of one step's.
    EXPECT_LT(std::sqrt(diff / norm), 5e-3) << other;
    EXPECT_GT(diff, 0.0) << other << ": requantized, not the same bits";
  }
  // fp32 states from the 8-bit checkpoint: dequantized, with a warning; and
  // 8-bit states from an fp32 checkpoint: quantized. The first loss is the
  // saved run's (the parameters are the master's), the next follow it.
  const auto fp32 = without_8bit(config);
  testing::internal::CaptureStderr();
  const Run8 widened = run_8bit(fp32, 6, 3, load_at3(dir, "at3"));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("they are dequantized"), std::string::npos) << err;
  expect_goes_on_as(widened, whole, 0.01);
  const Run8 f = run_8bit(fp32, 6, 0, save_at3(dir, "fp32"));
  const Run8 quantized = run_8bit(config, 6, 3, load_at3(dir, "fp32"));
  expect_goes_on_as(quantized, f, 0.01);
  {  // Another optimizer's states are refused, saying what to do.
    auto model = make_model(7);
    const std::string lion = R"({"train_micro_batch_size_per_gpu": 16, "optimizer": {"type": "Lion", "params": {"lr": 0.001}}, )"
                             R"("zero_optimization": {"stage": 2, "sub_group_size": 3000, "offload_optimizer": {"device": "cpu"}}})";
    auto engine = zero::initialize(model.ptr(), lion, quiet());
    try {
      engine.load_checkpoint(dir, "at3");
      ADD_FAILURE() << "expected a ConfigError";
    } catch (const zero::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("engine.load_weights"), std::string::npos) << e.what();
    }
  }
  ASSERT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
}

// The fp32 blocks' moments convert exactly: with every block fp32 (every
// parameter under min_8bit_size) a checkpoint loads at another
// sub_group_size and buckets (requantized: each value from its saved
// sub-group's fp32 states into this run's), into fp32 states and from them,
// and training goes on bit for bit.
TEST(EightBitStates, Fp32BlocksConvertExactlyOnLoad) {
  const std::string dir = std::string(ZERO_BINARY_DIR) + "/tests/engine_8bit_fp32blocks_" + std::to_string(getpid());
  ASSERT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
  const int64_t all = int64_t{1} << 40;
  const std::string z = R"({"stage": 2, "sub_group_size": 3000, "offload_optimizer": {"device": "cpu"}})";
  const std::string other = R"({"stage": 2, "sub_group_size": 5000, "reduce_bucket_size": 20000, )"
                            R"("allgather_bucket_size": 20000, "offload_optimizer": {"device": "cpu"}})";
  const Run8 whole = run_8bit(config_8bit(z, 16, all), 6, 0, save_at3(dir, "q8"));
  expect_same_bits(whole, run_8bit(config_8bit(other, 16, all), 6, 3, load_at3(dir, "q8")), "requantized");
  expect_same_bits(whole, run_8bit(without_8bit(config_8bit(z)), 6, 3, load_at3(dir, "q8")), "into fp32 states");
  run_8bit(without_8bit(config_8bit(z)), 4, 0, save_at3(dir, "fp32"));
  expect_same_bits(whole, run_8bit(config_8bit(other, 16, all), 6, 3, load_at3(dir, "fp32")), "from fp32 states");
  ASSERT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
}

// A checkpoint from before min_8bit_size (five states: every block in 8
// bits, no min_8bit_size in state_blocks) loads into a run with
// min_8bit_size 0 as it is (bit for bit), and into one that keeps some
// blocks in fp32 requantized, with the warning; training goes on.
TEST(EightBitStates, CheckpointFromBeforeMin8bitSizeLoads) {
  const std::string dir = std::string(ZERO_BINARY_DIR) + "/tests/engine_8bit_old_" + std::to_string(getpid());
  ASSERT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
  const std::string z = R"({"stage": 2, "offload_optimizer": {"device": "cpu"}})";
  const Run8 whole = run_8bit(config_8bit(z, 16, 0), 5, 0, save_at3(dir, "at3"));
  {  // the checkpoint as it was written then: no fp32-block states in the
     // rank files, nor in meta.json (an edited meta.json alone is refused:
     // its files hold a state it does not list)
    nlohmann::json meta;
    {
      std::ifstream in(dir + "/at3/meta.json");
      meta = nlohmann::json::parse(in);
    }
    auto states = meta.at("states").get<std::vector<std::string>>();
    ASSERT_EQ(states.size(), 7u);
    states.resize(5);
    meta["states"] = states;
    meta["state_blocks"].erase("min_8bit_size");
    const std::string tag_dir = dir + "/at3";
    auto reader = zero::ckpt::PieceReader::checkpoint(tag_dir, meta, {});
    zero::offload::AioEngine aio(zero::offload::AioOptions{});
    for (const auto& [file, entry] : meta.at("files").items()) {
      if (file.rfind("rank", 0) != 0) continue;
      zero::ckpt::Layout kept;
      std::vector<at::Tensor> values;
      for (const auto& t : reader->file_layout(file).tensors) {
        if (t.name.find("fp32_blocks") != std::string::npos) continue;
        kept.tensors.push_back({t.name, t.dtype, t.shape});
        values.push_back(reader->read_tensor(file, t.name));
      }
      kept.metadata = reader->file_layout(file).metadata;
      const std::string stem = tag_dir + "/" + file.substr(0, file.size() - 12);  // less ".safetensors"
      zero::ckpt::TensorFileWriter w(stem + ".old.safetensors", kept, aio);
      for (size_t i = 0; i < values.size(); ++i) w.append(i, values[i]);
      const auto c = w.commit(stem + ".old.sums");
      zero::ckpt::rename_path(stem + ".old.safetensors", stem + ".safetensors");
      zero::ckpt::rename_path(stem + ".old.sums", stem + ".sums");
      meta["files"][file] = {{"bytes", c.bytes}, {"header_crc", c.header_crc}, {"sums_crc", c.sums_crc}};
    }
    reader.reset();
    std::ofstream(tag_dir + "/meta.json") << meta.dump(1);
  }
  const Run8 as_saved = run_8bit(config_8bit(z, 16, 0), 5, 3, load_at3(dir, "at3"));
  expect_same_bits(whole, as_saved, "min_8bit_size 0");
  testing::internal::CaptureStderr();
  const Run8 resumed = run_8bit(config_8bit(z), 5, 3, load_at3(dir, "at3"));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("quantized again"), std::string::npos) << err;
  ASSERT_EQ(resumed.losses.size(), 2u);
  expect_goes_on_as(resumed, whole, 0.01);
  ASSERT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
}

}  // namespace

namespace {

// DeepSpeed's low-precision master and states (NOTE [16-bit master] in
// optim/): bf16 master weights and grads, bf16 optimizer states.
constexpr const char* kMasterAndStates = R"(, "bf16_master_weights_and_grads": true, "bf16_optimizer_states": true)";
std::string config_16(const std::string& zero_section, const std::string& bf16_keys = kMasterAndStates) {
  return R"({"train_micro_batch_size_per_gpu": 16, "bf16": {"enabled": true)" + bf16_keys +
         R"(}, "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-8, )"
         R"("weight_decay": 0.01}}, "zero_optimization": )" + zero_section + "}";
}

// The master and states on the device, in host memory and in NVMe swap
// files of their 16-bit size step alike, bit for bit, at stages 1-3 (stage
// 3 layer by layer): the stochastic rounding's words follow the flat index
// and the step, not the tier, the sub-group or the thread.
TEST(SixteenBitMaster, EveryTierStepsAlike) {
  expect_every_tier_steps_alike([](const std::string& z) { return config_16(z); }, "16bit", true);
}

// A bf16 master with 8-bit states (bf16_master_weights_and_grads and
// optim_bits 8): block-wise states under a 16-bit master step alike on every
// tier too, and train.
TEST(SixteenBitMaster, WithEightBitStatesEveryTierStepsAlike) {
  expect_every_tier_steps_alike(
      [](const std::string& z) {
        std::string c = config_16(z, R"(, "bf16_master_weights_and_grads": true)");
        const std::string wd = R"("weight_decay": 0.01})";
        return c.replace(c.find(wd), wd.size(), R"("weight_decay": 0.01, "optim_bits": 8, "min_8bit_size": 1000})");
      },
      "16bit_8bit", true);
}

// fp16.fp16_master_weights_and_grads: an fp16 master (fp32 states) under
// dynamic loss scaling steps alike on the device and offloaded, and trains.
TEST(SixteenBitMaster, Fp16MasterStepsAlikeOnEveryTier) {
  auto config = [](const std::string& zero_section) {
    return R"({"train_micro_batch_size_per_gpu": 16, "fp16": {"enabled": true, "fp16_master_weights_and_grads": true, )"
           R"("initial_scale_power": 8}, "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "betas": [0.9, 0.95], )"
           R"("weight_decay": 0.01}}, "zero_optimization": )" + zero_section + "}";
  };
  const Run8 device = run_8bit(config(R"({"stage": 2})"), 8);
  const Run8 cpu = run_8bit(config(R"({"stage": 2, "offload_optimizer": {"device": "cpu"}})"), 8);
  expect_same_bits(device, cpu, "fp16 master, cpu");
  EXPECT_LT(device.losses.back(), device.losses.front());
  EXPECT_NEAR(static_cast<double>(device.states.optimizer_states) / static_cast<double>(device.num_parameters), 10.0, 0.5);
}

// The ledger's bytes a parameter (one rank, stage 2): a bf16 master 2, bf16
// moments 2 + 2 (fp32 ones 8), gradients in bf16 (2) on the device and
// offloaded, against fp32's 4 + 8 and fp32 gradients; and the estimator's
// formulas agree (zero/testing).
TEST(SixteenBitMaster, LedgerHoldsTheFormulasBytes) {
  struct Case {
    std::string bf16_keys;
    double states, grads;
    std::string top;  // more top-level keys
  };
  for (const Case& c : {Case{kMasterAndStates, 6.0, 2.0}, Case{R"(, "bf16_master_weights_and_grads": true)", 10.0, 2.0},
                        Case{"", 12.0, 4.0},
                        // data_types.grad_accum_dtype is honoured on every tier
                        Case{kMasterAndStates, 6.0, 4.0, R"(, "data_types": {"grad_accum_dtype": "fp32"})"}}) {
    for (const char* offload : {"", R"(, "offload_optimizer": {"device": "cpu"})"}) {
      auto model = make_model(1);
      auto engine = zero::initialize(model.ptr(), config_16(std::string(R"({"stage": 2)") + offload + "}" + c.top, c.bf16_keys),
                                     quiet());
      const double psi = static_cast<double>(engine.num_parameters());
      const auto bytes = engine.model_state_bytes();
      EXPECT_NEAR(static_cast<double>(bytes.optimizer_states) / psi, c.states, 0.05 * c.states) << c.bf16_keys << offload;
      EXPECT_NEAR(static_cast<double>(bytes.gradients) / psi, c.grads, 0.05 * c.grads) << c.bf16_keys << offload;
      const auto check = zero::testing::expect_model_states_near_formula(engine, 0.02);
      EXPECT_TRUE(check) << c.bf16_keys << offload << ": " << check.message;
    }
  }
}

// NOTE [16-bit gradients]: stage 3 in bf16 (an fp32 master) keeps its
// gradient partition in bf16, on the device and in host memory: 2 bytes a
// parameter, 16 of model states with Adam, not 18;
// data_types.grad_accum_dtype "fp32" keeps 4. One rank, one micro-step: a
// gradient is exact in 16 bits, so both give the same bits on every tier,
// the unscale and the clip widened inside the CPU pass (fp16: with its loss
// scale). With accumulation each sum rounds in bf16: the tiers still agree,
// and fp32's run stays close.
TEST(SixteenBitGradients, Stage3KeepsTheComputeDtypeOnEveryTier) {
  const std::string dir = std::string(ZERO_BINARY_DIR) + "/tests/engine_grad16_" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  const std::string base = R"({"stage": 3, "sub_group_size": 3000, "stage3_param_persistence_threshold": 100)";
  const std::string tiers[] = {"}", R"(, "offload_optimizer": {"device": "cpu"}})",
                               R"(, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir + R"(", "buffer_count": 2}})"};
  const std::string fp32_grads = R"(, "data_types": {"grad_accum_dtype": "fp32"})";
  struct Case {
    const char* name;
    std::string precision;  // the precision section
    int gas;
  };
  const Case cases[] = {
      {"bf16", R"("bf16": {"enabled": true})", 1},
      {"fp16", R"("fp16": {"enabled": true, "initial_scale_power": 8})", 1},
      {"bf16_gas2", R"("bf16": {"enabled": true})", 2},
  };
  for (const Case& c : cases) {
    auto config = [&](const std::string& tier, const std::string& top) {
      return R"({"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": )" + std::to_string(c.gas) +
             R"(, "gradient_clipping": 0.3, )" + c.precision +
             R"(, "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}}, "zero_optimization": )" +
             base + tier + top + "}";
    };
    std::vector<Run8> runs;
    for (const auto& tier : tiers) {
      runs.push_back(run_8bit(config(tier, ""), 4 * c.gas));
      const double psi = static_cast<double>(runs.back().num_parameters);
      EXPECT_NEAR(static_cast<double>(runs.back().states.gradients) / psi, 2.0, 0.1) << c.name << tier;
      if (tier == "}")
        EXPECT_NEAR(static_cast<double>(runs.back().states.total()) / psi, 16.0, 0.5) << c.name;
    }
    expect_same_bits(runs[0], runs[1], std::string(c.name) + " cpu");
    expect_same_bits(runs[0], runs[2], std::string(c.name) + " nvme");
    EXPECT_LT(runs[0].losses.back(), runs[0].losses.front()) << c.name;
    const Run8 wide = run_8bit(config("}", fp32_grads), 4 * c.gas);
    const Run8 wide_cpu = run_8bit(config(tiers[1], fp32_grads), 4 * c.gas);
    const double psi = static_cast<double>(wide.num_parameters);
    EXPECT_NEAR(static_cast<double>(wide.states.gradients) / psi, 4.0, 0.2) << c.name;
    EXPECT_NEAR(static_cast<double>(wide_cpu.states.gradients) / psi, 4.0, 0.2) << c.name;
    expect_same_bits(wide, wide_cpu, std::string(c.name) + " fp32 gradients, cpu");
    if (c.gas == 1) {
      expect_same_bits(runs[0], wide, std::string(c.name) + " against fp32 gradients");
    } else {
      for (size_t i = 0; i < wide.params.size(); ++i)
        EXPECT_TRUE(torch::allclose(runs[0].params[i].to(torch::kFloat), wide.params[i].to(torch::kFloat), 0.05, 0.05))
            << "parameter " << i;
    }
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir));
  std::filesystem::remove(dir);
}

// Against an fp32 master and states on the same data (bf16 compute both):
// 30 steps with a bf16 master, stochastically rounded, and bf16 states end
// at the fp32 run's loss within 5%, as does the mixed case (fp32 states).
// The loss compared is the mean over the last 5 steps' batches (the same
// batches in every run): one batch of 16 samples is too noisy a reading
// (on an AVX-512 Xeon, whose ATen bf16 kernels round otherwise than AVX2's,
// the bf16 run's last batch alone was 6.0% above the fp32 run's; the mean of
// the five, 1.6%).
TEST(SixteenBitMaster, TrainsAsAnFp32MasterWithinRounding) {
  auto tail = [](const Run8& r) {
    return std::accumulate(r.losses.end() - 5, r.losses.end(), 0.0) / 5;
  };
  const Run8 f = run_8bit(config_16(R"({"stage": 2})", ""), 30);
  const Run8 b = run_8bit(config_16(R"({"stage": 2})"), 30);
  const Run8 mixed = run_8bit(config_16(R"({"stage": 2, "offload_optimizer": {"device": "cpu"}})",
                                        R"(, "bf16_master_weights_and_grads": true)"),
                              30);
  std::printf("after 30 steps, the last 5 steps' mean loss: fp32 master %.4f, bf16 master + states %.4f, bf16 "
              "master + fp32 states %.4f\n",
              tail(f), tail(b), tail(mixed));
  EXPECT_NEAR(tail(b), tail(f), 0.05 * tail(f));
  EXPECT_NEAR(tail(mixed), tail(f), 0.05 * tail(f));
  EXPECT_LT(b.losses.back(), b.losses.front());
}

// A checkpoint keeps the 16-bit master and states in their dtype: a resumed
// run steps on bit for bit. An fp32 checkpoint loads into a bf16 master
// (rounded to nearest, with a warning) and a bf16 one into fp32 (exactly).
TEST(SixteenBitMaster, CheckpointResumesBitForBitAndConvertsPrecision) {
  const std::string dir = std::string(ZERO_BINARY_DIR) + "/tests/engine_16bit_ckpt_" + std::to_string(getpid());
  ASSERT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
  const std::string zero_section = R"({"stage": 2, "sub_group_size": 3000, "offload_optimizer": {"device": "cpu"}})";
  const std::string config = config_16(zero_section);
  const Run8 whole = run_8bit(config, 6, 0, save_at3(dir, "at3"));
  const Run8 resumed = run_8bit(config, 6, 3, load_at3(dir, "at3"));
  expect_same_bits(whole, resumed, "resumed");
  {
    std::ifstream meta(dir + "/at3/meta.json");
    const auto j = nlohmann::json::parse(meta);
    EXPECT_EQ(j.at("precision"), (nlohmann::json{{"master", "bf16"}, {"states", "bf16"}}));
  }
  // fp32 master and states from the bf16 checkpoint: widened exactly, so
  // the first loss is the same; then each goes its own way, close.
  const Run8 widened = run_8bit(config_16(zero_section, ""), 6, 3, load_at3(dir, "at3"));
  expect_goes_on_as(widened, whole, 0.02);
  // An fp32 checkpoint into a bf16 master: the model's bf16 values were the
  // fp32 master rounded to nearest, as the load rounds it, so the first loss
  // is the same too.
  const Run8 fp32 = run_8bit(config_16(zero_section, ""), 6, 0, save_at3(dir, "fp32"));
  testing::internal::CaptureStderr();
  const Run8 narrowed = run_8bit(config, 6, 3, load_at3(dir, "fp32"));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("they are converted as they are read"), std::string::npos) << err;
  expect_goes_on_as(narrowed, fp32, 0.02);
  ASSERT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
}

}  // namespace
