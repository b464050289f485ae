// Engine checkpoints across processes (zero launch, Gloo over loopback),
// through mingpt's --save_dir, --resume and --stop_after_steps:
//  - exact resume on two ranks: ten steps in one run equal five, a save, and
//    five more in a new process group, bit for bit, for stages 0-3, fp32 and
//    bf16, with and without CPU and NVMe offload;
//  - other world sizes (2->1, 2->4, 4->2, 3->2): every state as saved after
//    the load, each rank reading its share, and training continuing with the
//    loss of the run at the saved size;
//  - a rank killed in the middle of a save leaves the previous checkpoint,
//    which resumes to the uninterrupted result.
// The single-process cases are in tests/runtime/engine_checkpoint_test.cpp.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

namespace {

const std::string kBin = std::string(ZERO_BINARY_DIR) + "/bin/";
const std::string kWork = std::string(ZERO_BINARY_DIR) + "/tests/resume_" + std::to_string(getpid()) + "/";

struct Job {
  std::string name;
  int stage = 2;
  std::string precision = "32";  // 32 | bf16
  std::string offload;           // "" | cpu | nvme
  int64_t n_embd = 64;
  double dropout = 0.1;
  int optim_bits = 32;  // 8: 8-bit Adam states (NOTE [8-bit states])
  bool master16 = false;  // bf16 master weights and states (NOTE [16-bit master])
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Global batch 24 at every world size (1, 2, 3, 4 ranks), one micro-step.
std::string write_config(const Job& j) {
  nlohmann::json c = {
      {"train_batch_size", 24},
      {"gradient_accumulation_steps", 1},
      {"gradient_clipping", 0.5},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.003}, {"betas", {0.9, 0.95}}, {"weight_decay", 0.01}}}}},
      {"scheduler", {{"type", "WarmupDecayLR"}, {"params", {{"warmup_num_steps", 3}, {"total_num_steps", 10}}}}},
      {"zero_optimization", {{"stage", j.stage}, {"reduce_bucket_size", 20000}, {"allgather_bucket_size", 20000}}},
  };
  if (j.precision == "bf16") c["bf16"] = {{"enabled", true}};
  if (j.optim_bits == 8) {  // the matrices in 8 bits, the rest's blocks in fp32 (min_8bit_size)
    c["optimizer"]["params"]["optim_bits"] = 8;
    c["optimizer"]["params"]["min_8bit_size"] = 1000;
  }
  if (j.master16)
    c["bf16"] = {{"enabled", true}, {"bf16_master_weights_and_grads", true}, {"bf16_optimizer_states", true}};
  auto& z = c["zero_optimization"];
  if (j.stage == 3) z["stage3_param_persistence_threshold"] = 100;
  const std::string nvme = kWork + "nvme";
  std::system(("mkdir -p " + nvme).c_str());
  if (j.offload == "cpu") {
    z["offload_optimizer"] = {{"device", "cpu"}};
    if (j.stage == 3) z["offload_param"] = {{"device", "cpu"}};
  } else if (j.offload == "nvme") {
    z["sub_group_size"] = 20000;
    z["offload_optimizer"] = {{"device", "nvme"}, {"nvme_path", nvme}, {"pipeline_read", true}};
    if (j.stage == 3)
      z["offload_param"] = {{"device", "nvme"}, {"nvme_path", nvme}, {"max_in_cpu", 0}, {"buffer_size", 100000}};
  }
  const std::string path = kWork + j.name + ".json";
  std::ofstream(path) << c.dump(2);
  return path;
}

// Runs mingpt on `world` ranks for (at most) ten steps; returns its exit code.
int run(const Job& j, int world, const std::string& label, const std::string& extra, nlohmann::json* summary) {
  std::system(("mkdir -p " + kWork).c_str());
  const std::string log = kWork + j.name + "_" + label + ".log";
  const std::string sum = kWork + j.name + "_" + label + ".summary.json";
  std::remove(sum.c_str());
  std::ostringstream cmd;
  cmd << "OMP_NUM_THREADS=1 ";
  if (world > 1) cmd << kBin << "zero launch --nproc_per_node " << world << " -- ";
  cmd << kBin << "mingpt --config " << write_config(j) << " --n_layer 2 --n_head 2 --n_embd " << j.n_embd
      << " --dropout " << j.dropout << " --max_epochs 1 --limit_train_batches 10 --precision " << j.precision << " --summary-json " << sum
      << " " << extra << " > " << log << " 2>&1";
  const int rc = std::system(cmd.str().c_str());
  if (summary != nullptr) {
    std::ifstream in(sum);
    if (in) *summary = nlohmann::json::parse(in);
    else ADD_FAILURE() << "no summary from " << label << " (rc " << rc << ", see " << log << ")";
  }
  return rc;
}

// The tensors of a safetensors file by name: (dtype, shape, bytes).
std::map<std::string, std::string> tensors_of(const std::string& path) {
  const std::string data = slurp(path);
  EXPECT_GE(data.size(), 8u) << path;
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<uint8_t>(data[i])) << (8 * i);
  const auto header = nlohmann::json::parse(data.substr(8, n));
  std::map<std::string, std::string> out;
  for (const auto& [name, t] : header.items()) {
    if (name == "__metadata__") continue;
    const auto off = t["data_offsets"];
    out[name] = t["dtype"].get<std::string>() + t["shape"].dump() + ":" +
                data.substr(8 + n + off[0].get<size_t>(), off[1].get<size_t>() - off[0].get<size_t>());
  }
  return out;
}

// Every state of checkpoint DIR/TAG, consolidated with `zero checkpoint`.
std::map<std::string, std::map<std::string, std::string>> states_of(const std::string& dir, const std::string& tag) {
  std::map<std::string, std::map<std::string, std::string>> out;
  for (const char* state : {"fp32_master", "exp_avg", "exp_avg_sq"}) {
    const std::string file = dir + "." + tag + "." + state + ".safetensors";
    const std::string cmd = kBin + "zero checkpoint consolidate " + dir + " " + file + " --tag " + tag + " --state " +
                            state + " > " + file + ".log 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    out[state] = tensors_of(file);
  }
  return out;
}

void expect_same_states(const std::map<std::string, std::map<std::string, std::string>>& got,
                        const std::map<std::string, std::map<std::string, std::string>>& want) {
  for (const auto& [state, tensors] : want) {
    ASSERT_EQ(got.at(state).size(), tensors.size()) << state;
    for (const auto& [name, bytes] : tensors) EXPECT_TRUE(got.at(state).at(name) == bytes) << state << " of " << name;
  }
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-12); }

void PrintTo(const Job& j, std::ostream* os) { *os << j.name; }

class ExactResumeOnTwoRanks : public ::testing::TestWithParam<Job> {};

// Ten steps, saving at step 5 and at the end; a new process group resuming
// from step 5: the same losses, parameters and states, bit for bit (the RNG
// states too: dropout is on).
TEST_P(ExactResumeOnTwoRanks, EqualsTheUninterruptedRunBitForBit) {
  const Job j = GetParam();
  const std::string full = kWork + j.name + "_full", resumed = kWork + j.name + "_resumed";
  nlohmann::json a, b;
  ASSERT_EQ(run(j, 2, "full", "--save_dir " + full + " --save_every 5", &a), 0);
  ASSERT_EQ(run(j, 2, "resumed", "--resume " + full + " --resume_tag global_step5 --save_dir " + resumed, &b), 0);
  ASSERT_EQ(a["loss_curve"].size(), 10u);
  ASSERT_EQ(b["loss_curve"].size(), 5u);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(b["loss_curve"][i], a["loss_curve"][5 + i]) << "step " << 6 + i;
  EXPECT_EQ(b["param_l2"], a["param_l2"]);
  EXPECT_EQ(b["steps"], 10);
  expect_same_states(states_of(resumed, "global_step10"), states_of(full, "global_step10"));
}

std::vector<Job> resume_jobs() {
  std::vector<Job> jobs;
  for (int stage = 0; stage <= 3; ++stage)
    for (const char* precision : {"32", "bf16"})
      for (const char* offload : {"", "cpu", "nvme"}) {
        if (stage == 0 && offload[0] != '\0') continue;  // offload needs a partition (stage 1-3)
        Job j;
        j.stage = stage;
        j.precision = precision;
        j.offload = offload;
        j.name = "stage" + std::to_string(stage) + "_" + (precision[0] == '3' ? "fp32" : "bf16") +
                 (offload[0] != '\0' ? std::string("_") + offload : "");
        jobs.push_back(j);
      }
  return jobs;
}

INSTANTIATE_TEST_SUITE_P(Stages, ExactResumeOnTwoRanks, ::testing::ValuesIn(resume_jobs()),
                         [](const auto& info) { return info.param.name; });

// Saved at step 5 of 10 on two ranks and resumed on two: the resumed run's
// losses and parameters are the uninterrupted run's, bit for bit.
void expect_exact_resume(const Job& j) {
  const std::string full = kWork + j.name + "_full";
  nlohmann::json a, b;
  ASSERT_EQ(run(j, 2, "full", "--save_dir " + full + " --save_every 5", &a), 0) << j.name;
  ASSERT_EQ(run(j, 2, "resumed", "--resume " + full + " --resume_tag global_step5", &b), 0) << j.name;
  ASSERT_EQ(b["loss_curve"].size(), 5u);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(b["loss_curve"][i], a["loss_curve"][5 + i]) << j.name << " step " << 6 + i;
  EXPECT_EQ(b["param_l2"], a["param_l2"]) << j.name;
}

// Saved at 2 ranks and loaded at 1: the losses go on within 1% of the 2-rank
// run's; the one-rank run's log has `said`.
void expect_elastic_resume(const Job& j, const std::string& said) {
  const std::string full = kWork + j.name + "_full";
  nlohmann::json a, b;
  ASSERT_EQ(run(j, 2, "full", "--save_dir " + full + " --save_every 5", &a), 0);
  ASSERT_EQ(run(j, 1, "one", "--resume " + full + " --resume_tag global_step5", &b), 0);
  if (!said.empty()) {
    EXPECT_NE(slurp(kWork + j.name + "_one.log").find(said), std::string::npos) << j.name;
  }
  ASSERT_EQ(b["loss_curve"].size(), 5u);
  for (size_t i = 0; i < 5; ++i)
    EXPECT_NEAR(b["loss_curve"][i].get<double>(), a["loss_curve"][5 + i].get<double>(),
                0.01 * a["loss_curve"][5 + i].get<double>())
        << j.name << " step " << 6 + i;
}

// 8-bit Adam states on two ranks: at stage 0 (rank 0's file holds every
// state; rank 1 reads it) and stage 2 + CPU offload, exact; saved at 2 ranks
// and loaded at 1 (stage 2), the moments requantized in the new blocks.
TEST(ExactResumeOnTwoRanks8bit, EqualsTheUninterruptedRunBitForBit) {
  for (const int stage : {0, 2}) {
    Job j;
    j.stage = stage;
    j.precision = "bf16";
    j.offload = stage == 0 ? "" : "cpu";
    j.optim_bits = 8;
    j.name = "stage" + std::to_string(stage) + "_8bit";
    expect_exact_resume(j);
  }
  Job j;
  j.precision = "bf16";
  j.offload = "cpu";
  j.optim_bits = 8;
  j.dropout = 0;
  j.name = "stage2_8bit_elastic";
  expect_elastic_resume(j, "dequantized and quantized again");
}

struct Elastic {
  Job job;
  int from, to;
};
void PrintTo(const Elastic& e, std::ostream* os) { *os << e.job.name; }

class ElasticResume : public ::testing::TestWithParam<Elastic> {};

// Saved at N ranks, loaded at M: after the load every state is what was
// saved, bit for bit (saved again at M, consolidated); each rank read its
// share and little more; training goes on with the losses of the run that
// stayed at N (the reductions sum in another order: 1e-6). No dropout: its
// masks depend on how the batch is split across ranks.
TEST_P(ElasticResume, LoadsEveryStateAndTrainsOn) {
  const Elastic e = GetParam();
  const Job& j = e.job;
  const std::string saved = kWork + j.name + "_saved", again = kWork + j.name + "_again";
  nlohmann::json at_n, loaded, going_on;
  ASSERT_EQ(run(j, e.from, "at_n", "--save_dir " + saved + " --save_every 5", &at_n), 0);
  ASSERT_EQ(run(j, e.to, "loaded",
                "--resume " + saved + " --resume_tag global_step5 --stop_after_steps 5 --save_dir " + again, &loaded),
            0);
  ASSERT_EQ(loaded["world_size"], e.to);
  expect_same_states(states_of(again, "global_step5"), states_of(saved, "global_step5"));

  // Bytes read: each rank's share is its chunk's parameter elements (in the
  // layout at M, as saved again) times three fp32 states.
  const auto meta = nlohmann::json::parse(slurp(again + "/global_step5/meta.json"));
  const int64_t parts = meta["layout"]["partitions"].get<int64_t>();
  for (int r = 0; r < e.to; ++r) {
    int64_t elements = 0;
    for (const auto& g : meta["layout"]["groups"]) {
      const int64_t chunk = g["chunk_numel"].get<int64_t>();
      const int64_t lo = parts == 1 ? 0 : r * chunk, hi = parts == 1 ? chunk * 1 : lo + chunk;
      for (const auto& p : g["params"]) {
        int64_t n = 1;
        for (const auto& d : p["shape"]) n *= d.get<int64_t>();
        const int64_t a = std::max(lo, p["offset"].get<int64_t>()), b = std::min(hi, p["offset"].get<int64_t>() + n);
        if (b > a) elements += b - a;
      }
    }
    const double share = 12.0 * static_cast<double>(elements);
    const double read = loaded["ranks"][r]["checkpoint"]["load_bytes"].get<double>();
    EXPECT_GE(read, share) << "rank " << r;
    EXPECT_LE(read, 1.1 * share) << "rank " << r << " read " << read << " bytes for a share of " << share;
  }

  ASSERT_EQ(run(j, e.to, "going_on", "--resume " + saved + " --resume_tag global_step5", &going_on), 0);
  ASSERT_EQ(going_on["loss_curve"].size(), 5u);
  for (size_t i = 0; i < 5; ++i)
    EXPECT_LT(rel(going_on["loss_curve"][i].get<double>(), at_n["loss_curve"][5 + i].get<double>()), 1e-6)
        << "step " << 6 + i;
  EXPECT_LT(rel(going_on["param_l2"].get<double>(), at_n["param_l2"].get<double>()), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(
    WorldSizes, ElasticResume,
    ::testing::Values(Elastic{{"2to1_stage2", 2, "32", "", 96, 0.0}, 2, 1},
                      Elastic{{"2to1_stage1_cpu", 1, "32", "cpu", 96, 0.0}, 2, 1},
                      Elastic{{"2to4_stage3", 3, "32", "", 96, 0.0}, 2, 4},
                      Elastic{{"2to4_stage2_nvme", 2, "32", "nvme", 96, 0.0}, 2, 4},
                      Elastic{{"4to2_stage1", 1, "32", "", 96, 0.0}, 4, 2},
                      Elastic{{"4to2_stage3_cpu", 3, "32", "cpu", 96, 0.0}, 4, 2},
                      Elastic{{"3to2_stage2", 2, "32", "", 96, 0.0}, 3, 2},
                      Elastic{{"3to2_stage3_nvme", 3, "32", "nvme", 96, 0.0}, 3, 2},
                      Elastic{{"2to1_stage0", 0, "32", "", 96, 0.0}, 2, 1}),
    [](const auto& info) { return info.param.job.name; });

struct Kill {
  const char* name;
  const char* at;  // RANK:POINT:N for --test_kill_save
};
void PrintTo(const Kill& k, std::ostream* os) { *os << k.name; }

class KilledSave : public ::testing::TestWithParam<Kill> {};

// A rank killed in its second save (step 4): the job fails, latest still
// names step 2, whose files all check out, and resuming from it gives the
// uninterrupted run's result bit for bit.
TEST_P(KilledSave, LeavesThePreviousCheckpointToResumeFrom) {
  const Kill k = GetParam();
  Job j;
  j.name = std::string("killed_") + k.name;
  j.stage = 2;
  j.offload = "nvme";
  const std::string dir = kWork + j.name;
  nlohmann::json whole, resumed;
  ASSERT_EQ(run(j, 2, "whole", "", &whole), 0);
  EXPECT_NE(run(j, 2, "killed", "--save_dir " + dir + " --save_every 2 --test_kill_save " + std::string(k.at), nullptr), 0);
  EXPECT_EQ(slurp(dir + "/latest"), "global_step2\n");
  EXPECT_NE(std::system(("test -e " + dir + "/global_step4").c_str()), 0) << "a partial checkpoint became visible";
  EXPECT_EQ(std::system((kBin + "zero checkpoint verify " + dir + " > " + dir + ".verify.log 2>&1").c_str()), 0)
      << slurp(dir + ".verify.log");
  ASSERT_EQ(run(j, 2, "resumed", "--resume " + dir, &resumed), 0);
  EXPECT_EQ(resumed["param_l2"], whole["param_l2"]);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(resumed["loss_curve"][i], whole["loss_curve"][2 + i]) << "step " << 3 + i;
}

INSTANTIATE_TEST_SUITE_P(Points, KilledSave,
                         ::testing::Values(Kill{"rank1_writing", "1:rank_files:2"}, Kill{"rank0_committing", "0:meta:2"}),
                         [](const auto& info) { return std::string(info.param.name); });

// A bf16 master and bf16 states on two ranks (NOTE [16-bit master]): at
// stage 2 + CPU offload and stage 3 + CPU offload, exact (the stochastic
// rounding's words depend on the element and the step, nothing else); saved
// at 2 ranks and loaded at 1, within 1%.
TEST(ExactResumeOnTwoRanks16bit, EqualsTheUninterruptedRunBitForBit) {
  for (const int stage : {2, 3}) {
    Job j;
    j.stage = stage;
    j.precision = "bf16";
    j.offload = "cpu";
    j.master16 = true;
    j.name = "stage" + std::to_string(stage) + "_16bit";
    expect_exact_resume(j);
  }
  Job j;
  j.precision = "bf16";
  j.offload = "cpu";
  j.master16 = true;
  j.dropout = 0;
  j.name = "stage2_16bit_elastic";
  expect_elastic_resume(j, "");
}

}  // namespace
