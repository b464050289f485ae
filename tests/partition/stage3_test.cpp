// ZeRO stage 3 on 2 and 4 real ranks: the stage-3 worker program
// (stage3_worker.cpp) against plain runs, partitioned construction under a
// host cap, a change of layer order, ranks that run different layers, and
// saving the gathered 16-bit weights.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include <unistd.h>

#include <nlohmann/json.hpp>

namespace {

const std::string kBin = std::string(ZERO_BINARY_DIR) + "/bin/";
const std::string kWorker = std::string(ZERO_BINARY_DIR) + "/tests/stage3_worker";
const std::string kWork = std::string(ZERO_BINARY_DIR) + "/tests/stage3/";

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-12); }

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The names in a folder, one per line ("" when it is empty or missing).
std::string slurp_dir(const std::string& folder) {
  const std::string list = kWork + std::to_string(getpid()) + "_ls.txt";
  std::system(("ls -A " + folder + " > " + list + " 2>/dev/null").c_str());
  return slurp(list);
}

std::string write_config(const std::string& name, nlohmann::json zero_section) {
  std::system(("mkdir -p " + kWork).c_str());
  const std::string path = kWork + std::to_string(getpid()) + "_" + name + ".json";
  nlohmann::json c = {
      {"train_batch_size", 16},
      {"gradient_accumulation_steps", 1},
      {"optimizer", {{"type", "Adam"}, {"params", {{"lr", 0.01}}}}},
      {"zero_optimization", zero_section},
  };
  std::ofstream(path) << c.dump(2);
  return path;
}

struct Run {
  int rc = 0;
  nlohmann::json out;
  std::string log;
};

Run run_worker(const std::string& name, int world, const std::string& config, const std::string& args) {
  const std::string base = kWork + std::to_string(getpid()) + "_" + name;
  const std::string out = base + ".out.json", log = base + ".log";
  std::remove(out.c_str());
  std::ostringstream cmd;
  cmd << "OMP_NUM_THREADS=1 ZERO_COMM_TIMEOUT_S=60 ";
  if (world > 1) cmd << kBin << "zero launch --nproc_per_node " << world << " -- ";
  cmd << kWorker << " --config " << config << " --out " << out << " " << args << " > " << log << " 2>&1";
  Run r;
  r.rc = std::system(cmd.str().c_str());
  r.log = slurp(log);
  std::ifstream in(out);
  if (in) r.out = nlohmann::json::parse(in);
  return r;
}

nlohmann::json stage3(nlohmann::json extra = nlohmann::json::object()) {
  nlohmann::json z = {{"stage", 3}, {"stage3_param_persistence_threshold", 0}, {"reduce_bucket_size", 5000}};
  for (auto& [k, v] : extra.items()) z[k] = v;
  return z;
}

// Partitioned construction: 4 ranks build an MLP whose fp32 size is twice the
// cap on the host tier (where offload_param keeps the shards); construction
// never holds more than a fraction of the model; one step trains, and the
// initial and trained parameters equal those of the same model built whole.
TEST(Stage3, PartitionedConstructionUnderAHostCapMatchesTheWholeModel) {
  const std::string whole = write_config("init_ref", {{"stage", 0}});
  const std::string part = write_config(
      "init", stage3({{"offload_param", {{"device", "cpu"}, {"pin_memory", false}}}}));
  const std::string shape = "--layers 8 --dim 256 --steps 2";
  const int64_t full = 8 * (256 * 256 + 256) * 4;
  auto ref = run_worker("init_ref", 1, whole, "--mode plain " + shape);
  auto got = run_worker("init", 4, part, "--mode init --cap_bytes " + std::to_string(full / 2) + " " + shape);
  ASSERT_EQ(ref.rc, 0) << ref.log;
  ASSERT_EQ(got.rc, 0) << got.log;
  EXPECT_EQ(got.out["full_fp32_bytes"].get<int64_t>(), full);
  // Shards (a quarter) plus the one layer being built (an eighth), far under the model.
  EXPECT_LT(got.out["construction_peak_bytes"].get<double>(), 0.5 * full) << got.out.dump();
  EXPECT_LT(got.out["host_peak_bytes"].get<double>(), full / 2.0);
  // The same values (the norm is summed in double in a different order).
  EXPECT_LT(rel(got.out["param_l2_initial"].get<double>(), ref.out["param_l2_initial"].get<double>()), 1e-12);
  EXPECT_LT(rel(got.out["param_l2"].get<double>(), ref.out["param_l2"].get<double>()), 1e-5);
}

// The same model built whole on 4 ranks does not fit that cap: the cap is real.
TEST(Stage3, WholeModelOnOneRankPassesTheCap) {
  const std::string cfg = write_config("nocap", stage3({{"offload_param", {{"device", "cpu"}, {"pin_memory", false}}}}));
  const int64_t full = 8 * (256 * 256 + 256) * 4;
  auto got = run_worker("nocap", 1, cfg, "--mode init --layers 8 --dim 256 --steps 1 --cap_bytes " + std::to_string(full / 2));
  EXPECT_NE(got.rc, 0);
  EXPECT_NE(got.log.find("the test's host cap"), std::string::npos) << got.log;
}

// Partitioned construction with offload_param nvme and max_in_cpu 0: each
// layer's shard goes to disk as the layer is built, so host memory holds one
// layer at a time, never the rank's partition. Under a host cap of a quarter
// of the model, which the same run with offload_param cpu passes (each of the
// 2 ranks keeps half the model in host memory), it builds, trains, matches
// the model built whole, and leaves nothing under nvme_path.
TEST(Stage3, PartitionedConstructionToNvmeHoldsOneLayerInHostMemory) {
  const std::string shape = "--layers 8 --dim 256 --steps 2";
  const int64_t full = 8 * (256 * 256 + 256) * 4;
  const std::string cap = " --cap_bytes " + std::to_string(full / 4) + " ";
  const std::string folder = kWork + std::to_string(getpid()) + "_init_nvme_swap";
  std::system(("rm -rf " + folder + " && mkdir -p " + folder).c_str());
  const nlohmann::json nvme = {{"device", "nvme"},  {"nvme_path", folder},     {"pin_memory", false},
                               {"max_in_cpu", 0},   {"buffer_count", 2},       {"buffer_size", 100000}};
  auto ref = run_worker("init_nvme_ref", 1, write_config("init_nvme_ref", {{"stage", 0}}), "--mode plain " + shape);
  auto got = run_worker("init_nvme", 2, write_config("init_nvme", stage3({{"offload_param", nvme}})),
                        "--mode init" + cap + shape);
  ASSERT_EQ(ref.rc, 0) << ref.log;
  ASSERT_EQ(got.rc, 0) << got.log;
  // The layer being built (an eighth) and its shard on its way to disk.
  EXPECT_LT(got.out["construction_peak_bytes"].get<double>(), 0.25 * full) << got.out.dump();
  EXPECT_LT(got.out["host_peak_bytes"].get<double>(), full / 4.0);
  EXPECT_LT(rel(got.out["param_l2_initial"].get<double>(), ref.out["param_l2_initial"].get<double>()), 1e-12);
  EXPECT_LT(rel(got.out["param_l2"].get<double>(), ref.out["param_l2"].get<double>()), 1e-5);
  EXPECT_EQ(slurp_dir(folder), "") << "swap files left behind";
  // The cap is real: the shards in host memory pass it.
  auto cpu = run_worker("init_cpu_cap", 2,
                        write_config("init_cpu_cap", stage3({{"offload_param", {{"device", "cpu"}, {"pin_memory", false}}}})),
                        "--mode init" + cap + shape);
  EXPECT_NE(cpu.rc, 0);
  EXPECT_NE(cpu.log.find("the test's host cap"), std::string::npos) << cpu.log;
  std::system(("rm -rf " + folder).c_str());
}

// A Sequential's entries are layers without any change to the model's code;
// stage 3 on 2 ranks equals stage 0 on one.
TEST(Stage3, SequentialLayersMatchOneProcess) {
  auto ref = run_worker("seq_ref", 1, write_config("seq_ref", {{"stage", 0}}), "--mode plain --steps 6");
  auto got = run_worker("seq", 2, write_config("seq", stage3()), "--mode plain --steps 6");
  ASSERT_EQ(got.rc, 0) << got.log;
  EXPECT_LT(rel(got.out["param_l2"].get<double>(), ref.out["param_l2"].get<double>()), 1e-5);
  EXPECT_TRUE(got.out["trace_valid"].get<bool>());
  EXPECT_GT(got.out["prefetched_gathers"].get<int64_t>(), 0);
}

// Every rank changes the order of two layers at step 3: the trace is
// rebuilt (prefetch follows the new order) and training stays exact.
TEST(Stage3, ChangedLayerOrderRebuildsTheTrace) {
  auto ref = run_worker("branch_ref", 1, write_config("branch_ref", {{"stage", 0}}), "--mode branch --steps 6");
  auto got = run_worker("branch", 2, write_config("branch", stage3()), "--mode branch --steps 6");
  ASSERT_EQ(got.rc, 0) << got.log;
  EXPECT_LT(rel(got.out["param_l2"].get<double>(), ref.out["param_l2"].get<double>()), 1e-5);
  EXPECT_NE(got.log.find("different order than the recorded trace"), std::string::npos) << got.log;
  EXPECT_TRUE(got.out["trace_valid"].get<bool>());
}

// Rank 1 alone changes the order: both ranks fail naming the two layers,
// instead of exchanging the wrong shards or hanging. (Gathered on demand: with
// every layer prefetched the gathers would still pair up, and the result be right.)
TEST(Stage3, RanksRunningDifferentLayersFailNamingThem) {
  auto got = run_worker("diverge", 2,
                        write_config("diverge", stage3({{"stage3_prefetch_bucket_size", 0}, {"stage3_max_reuse_distance", 0}})),
                        "--mode diverge --steps 6");
  EXPECT_NE(got.rc, 0);
  EXPECT_NE(got.log.find("ranks run different layers"), std::string::npos) << got.log;
  EXPECT_NE(got.log.find("layer layers.1"), std::string::npos) << got.log;
  EXPECT_NE(got.log.find("layer layers.2"), std::string::npos) << got.log;
}

// Saving gathers the layers one at a time; rank 0's file holds every
// parameter, equal (as 16-bit) to what the one-process run trains.
TEST(Stage3, Save16BitModelNeedsTheConfigKeyAndWritesEveryParameter) {
  auto refused = run_worker("save_refused", 2, write_config("save_refused", stage3()),
                            "--mode save16 --steps 2 --save " + kWork + "refused.pt");
  EXPECT_NE(refused.rc, 0);
  EXPECT_NE(refused.log.find("stage3_gather_16bit_weights_on_model_save"), std::string::npos) << refused.log;
  const std::string path = kWork + std::to_string(getpid()) + "_model.pt";
  auto got = run_worker("save", 2, write_config("save", stage3({{"stage3_gather_16bit_weights_on_model_save", true}})),
                        "--mode save16 --steps 2 --save " + path);
  ASSERT_EQ(got.rc, 0) << got.log;
  // The file is a pickled dict of every parameter (read back by the worker's --mode check).
  auto check = run_worker("save_check", 1, write_config("save_check", {{"stage", 0}}),
                          "--mode load16 --steps 2 --save " + path);
  ASSERT_EQ(check.rc, 0) << check.log;
  EXPECT_EQ(check.out["loaded_tensors"].get<int64_t>(), 8);
  EXPECT_LT(check.out["max_abs_diff"].get<double>(), 1e-5);
}

// NOTE [user backward]: a backward the program starts itself gives the bits
// of engine.backward at every stage on 2 ranks: loss.backward() in fp32,
// engine.scale(loss).backward() in fp16 (the loss scale is the program's
// to apply, as in DeepSpeed), with gradient accumulation over 2 micro-steps.
TEST(UserBackward, LossBackwardGivesTheBitsOfEngineBackward) {
  for (int stage = 0; stage <= 3; ++stage) {
    for (const bool fp16 : {false, true}) {
      std::system(("mkdir -p " + kWork).c_str());
      const std::string name = "user_backward_" + std::to_string(stage) + (fp16 ? "_fp16" : "_fp32");
      const std::string cfg = kWork + std::to_string(getpid()) + "_" + name + ".json";
      nlohmann::json c = {{"train_batch_size", 16},
                          {"gradient_accumulation_steps", 2},
                          {"optimizer", {{"type", "Adam"}, {"params", {{"lr", 0.01}}}}},
                          {"zero_optimization", {{"stage", stage}, {"stage3_param_persistence_threshold", 0}}}};
      if (fp16) c["fp16"] = {{"enabled", true}, {"initial_scale_power", 8}};
      std::ofstream(cfg) << c.dump(2);
      const std::string shape = "--mode plain --layers 3 --dim 32 --steps 6 ";
      const auto ref = run_worker(name + "_engine", 2, cfg, shape + "--backward engine");
      const auto got = run_worker(name + "_user", 2, cfg, shape + (fp16 ? "--backward scaled" : "--backward plain"));
      ASSERT_EQ(ref.rc, 0) << ref.log;
      ASSERT_EQ(got.rc, 0) << got.log;
      EXPECT_EQ(got.out["losses"], ref.out["losses"]) << name;
      EXPECT_EQ(got.out["param_l2"].get<double>(), ref.out["param_l2"].get<double>()) << name;
      EXPECT_NE(got.out["param_l2"].get<double>(), got.out["param_l2_initial"].get<double>()) << name;
    }
  }
}

// NOTE [speculative step]: offload_optimizer.super_offload on 2 ranks equals
// the same run without it, bit for bit (each rank's master and states, every
// loss, the parameters' norm): unclipped steps accepted as speculated, clipped
// ones redone, fp16 overflows undone, with gradient accumulation.
TEST(SuperOffload, TwoRanksGiveTheBitsOfThePlainOffloadStep) {
  struct Case {
    const char* name;
    nlohmann::json top;  // keys beside zero_optimization
    int gas;
  };
  const Case cases[] = {
      {"fp32_unclipped", nlohmann::json::object(), 1},
      {"bf16_clipped_gas2", {{"bf16", {{"enabled", true}}}, {"gradient_clipping", 0.05}}, 2},
      {"fp16_overflows", {{"fp16", {{"enabled", true}, {"initial_scale_power", 20}, {"hysteresis", 1}}},
                          {"gradient_clipping", 1.0}}, 1},
  };
  for (const auto& c : cases) {
    std::map<bool, struct Run> runs;
    for (const bool super : {false, true}) {
      std::system(("mkdir -p " + kWork).c_str());
      const std::string name = std::string("super_offload_") + c.name + (super ? "_on" : "_off");
      const std::string cfg = kWork + std::to_string(getpid()) + "_" + name + ".json";
      nlohmann::json j = {{"train_batch_size", 16},
                          {"gradient_accumulation_steps", c.gas},
                          {"optimizer", {{"type", "Adam"}, {"params", {{"lr", 0.01}}}}},
                          {"zero_optimization",
                           stage3({{"sub_group_size", 700},
                                   {"offload_optimizer", {{"device", "cpu"}, {"super_offload", super}}}})}};
      for (auto& [k, v] : c.top.items()) j[k] = v;
      std::ofstream(cfg) << j.dump(2);
      runs[super] = run_worker(name, 2, cfg, "--mode plain --layers 3 --dim 32 --steps 6");
      ASSERT_EQ(runs[super].rc, 0) << runs[super].log;
    }
    const auto& off = runs[false].out;
    const auto& on = runs[true].out;
    SCOPED_TRACE(c.name);
    EXPECT_EQ(on["losses"], off["losses"]);
    EXPECT_EQ(on["param_l2"].get<double>(), off["param_l2"].get<double>());
    EXPECT_EQ(on["states_digest"], off["states_digest"]);
    EXPECT_EQ(on["skipped_steps"], off["skipped_steps"]);
    EXPECT_EQ(off["speculation"]["planned"].get<int64_t>(), 0);
    const auto& s = on["speculation"];
    const int64_t steps = 6 / c.gas, skipped = on["skipped_steps"].get<int64_t>();
    EXPECT_EQ(s["planned"].get<int64_t>(), steps);
    EXPECT_EQ(s["undone"].get<int64_t>(), skipped);
    EXPECT_EQ(s["validated"].get<int64_t>() + s["redone"].get<int64_t>(), steps - skipped);
    if (std::string(c.name) == "fp32_unclipped") EXPECT_EQ(s["validated"].get<int64_t>(), steps);
    if (std::string(c.name) == "fp16_overflows") EXPECT_GE(skipped, 1);
  }
}

// NOTE [frozen groups]: frozen bases partitioned in their layers train to
// the bits of the same model with the bases whole (outside every layer; the
// trainable layout is the same), on 2 and 4 ranks, with offload_param cpu
// and nvme; each rank holds its share; an adapter changed half way through
// GatheredParameters by one rank reaches every rank and the states.
TEST(Stage3, FrozenBasesPartitionedTrainToTheBitsOfWholeOnes) {
  for (const int world : {2, 4}) {
    for (const std::string op : {"none", "cpu", "nvme"}) {
      SCOPED_TRACE(std::to_string(world) + " ranks, offload_param " + op);
      nlohmann::json z = stage3();
      if (op != "none") z["offload_param"] = {{"device", op}};
      if (op == "nvme") z["offload_param"].update({{"nvme_path", kWork}, {"max_in_cpu", 0}});
      const auto cfg = write_config("frozen_" + op, z);
      const std::string args = "--layers 3 --dim 64 --steps 6";
      auto ref = run_worker("frozen_whole", world, cfg, "--mode frozen_whole " + args);
      auto got = run_worker("frozen", world, cfg, "--mode frozen " + args);
      ASSERT_EQ(ref.rc, 0) << ref.log;
      ASSERT_EQ(got.rc, 0) << got.log;
      EXPECT_EQ(got.out["losses"], ref.out["losses"]);
      EXPECT_EQ(got.out["param_l2"], ref.out["param_l2"]);
      EXPECT_EQ(got.out["states_digest"], ref.out["states_digest"]);
      // The changed adapter is the same on every rank, and not what it was.
      const auto sums = got.out["gathered_sums"];
      for (const auto& v : sums) EXPECT_EQ(v, sums[0]);
      EXPECT_EQ(got.out["gathered_sums"], ref.out["gathered_sums"]);
      // Rank 0's share of the bases: 3 layers of 64 x 64 fp32 over `world` ranks.
      const std::string tier = op == "none" ? "device" : op == "cpu" ? "pinned_host" : "nvme";
      EXPECT_EQ(got.out["frozen_bytes"][tier].get<int64_t>(), 3 * 64 * 64 * 4 / world) << got.out.dump();
      EXPECT_EQ(ref.out["frozen_bytes"]["device"].get<int64_t>(), 3 * 64 * 64 * 4) << "whole on every rank";
    }
  }
}

// The share of the frozen bases is real memory: the same model on 2 ranks
// with its 512 MiB of bases partitioned holds half of them less in resident
// memory, within 5%, than with them whole (the same stage-3 machinery in
// both). glibc's malloc maps every block of 64 KiB or more on its own
// (MALLOC_MMAP_THRESHOLD_), so what the run freed is not kept resident.
TEST(Stage3, FrozenBasesPartitionedSaveTheirShareOfResidentMemory) {
  const auto cfg = write_config("frozen_rss", stage3());
  const std::string args = "--layers 8 --dim 4096 --steps 2";
  auto run = [&](const std::string& mode) {
    const std::string base = kWork + std::to_string(getpid()) + "_rss_" + mode;
    const std::string cmd = "OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 ZERO_COMM_TIMEOUT_S=60 " + kBin +
                            "zero launch --nproc_per_node 2 -- " + kWorker + " --config " + cfg + " --out " + base +
                            ".json --mode " + mode + " " + args + " > " + base + ".log 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << slurp(base + ".log");
    return nlohmann::json::parse(slurp(base + ".json"));
  };
  const auto whole = run("frozen_whole"), part = run("frozen");
  const double half = 8.0 * 4096 * 4096 * 4 / 2;
  for (int r = 0; r < 2; ++r) {
    const double saved = whole["resident_bytes"][r].get<double>() - part["resident_bytes"][r].get<double>();
    std::printf("rank %d: %.2f MB less resident memory with the bases partitioned; half the bases is %.2f MB\n", r,
                saved / 1e6, half / 1e6);
    EXPECT_NEAR(saved, half, 0.05 * half);
  }
}

}  // namespace
