// The tools that start processes, on the card (CTest label "gpu", issue
// 35): zero tune, mingpt --find-max-params with a device budget, zero
// memcheck.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "gpu_util.h"
#include "zero/snapshots/checkpoint_format.h"

namespace {

using namespace zero_gpu_test;

const std::string kTinyGpt = " --n_layer 2 --n_head 2 --n_embd 64 --dropout 0 --device cuda:0 ";

// zero tune -- mingpt ... --device cuda:0 {config}: the winner trains.
TEST(GpuTools, TunePicksAConfigThatTrains) {
  REQUIRE_CUDA();
  const std::string work = nvme_dir("tune");
  const std::string out = work + "/best.json";
  const std::string cmd = "OMP_NUM_THREADS=1 " + kBin + "zero tune --device-memory 2GiB --host-memory 4GiB --stages 0,2,3 "
                          "--micro-batches 8,16 --steps 3 --trials 3 --out " + out + " -- " + kBin + "mingpt --config {config}" +
                          kTinyGpt + "--limit_train_batches 6 > " + work + "/tune.log 2>&1";
  ASSERT_EQ(sh(cmd), 0) << slurp(work + "/tune.log");
  ASSERT_EQ(sh(kBin + "mingpt --config " + out + kTinyGpt + "--limit_train_batches 6 > " + work + "/train.log 2>&1"), 0)
      << slurp(work + "/train.log");
  zero::ckpt::remove_tree(work);
}

// mingpt --find-max-params with a device budget on the card.
TEST(GpuTools, FindMaxParamsWithADeviceBudget) {
  REQUIRE_CUDA();
  const std::string work = nvme_dir("findmax");
  const std::string cfg = write_file(work + "/z3.json", R"({"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": true},
      "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "zero_optimization": {"stage": 3}})");
  const std::string cmd = "OMP_NUM_THREADS=1 " + kBin + "mingpt --config " + cfg + " --device cuda:0 --vocab_size 256 "
                          "--block_size 64 --find-max-params --device-memory 256MiB --head_dim 32 --probe_steps 2 "
                          "--summary-json " + work + "/s.json > " + work + "/log 2>&1";
  ASSERT_EQ(sh(cmd), 0) << slurp(work + "/log");
  const auto s = nlohmann::json::parse(slurp(work + "/s.json"));
  EXPECT_GT(s["largest"]["num_parameters"].get<int64_t>(), 0) << s.dump(1);
  EXPECT_LE(s["largest"]["peak_bytes"]["device"].get<int64_t>(), int64_t{256} << 20) << s.dump(1);
  zero::ckpt::remove_tree(work);
}

// zero memcheck record, then check, of a run on the card.
TEST(GpuTools, MemcheckRecordThenCheck) {
  REQUIRE_CUDA();
  const std::string work = nvme_dir("memcheck");
  const std::string cfg = write_file(work + "/z2.json", R"({"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": true},
      "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "zero_optimization": {"stage": 2}})");
  const std::string program = " -- " + kBin + "mingpt --config " + cfg + kTinyGpt + "--limit_train_batches 6";
  ASSERT_EQ(sh(kBin + "zero memcheck record --baseline " + work + "/b.json --steps 2" + program + " > " + work +
               "/record.log 2>&1"),
            0)
      << slurp(work + "/record.log");
  ASSERT_EQ(sh(kBin + "zero memcheck check --baseline " + work + "/b.json --steps 2" + program + " > " + work +
               "/check.log 2>&1"),
            0)
      << slurp(work + "/check.log");
  EXPECT_NE(slurp(work + "/check.log").find("no figure grew"), std::string::npos) << slurp(work + "/check.log");
  zero::ckpt::remove_tree(work);
}

}  // namespace
