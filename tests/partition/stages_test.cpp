// ZeRO stages 0, 1, 2 on 2 and 4 real ranks (zero launch, Gloo over loopback)
// against the single-process run with the same global batch, and the per-rank
// model-state bytes against the ZeRO formulas.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include <unistd.h>

#include <nlohmann/json.hpp>

namespace {

const std::string kBin = std::string(ZERO_BINARY_DIR) + "/bin/";
const std::string kWork = std::string(ZERO_BINARY_DIR) + "/tests/stages/";

struct RunSpec {
  int world = 1;
  int stage = 0;
  int gas = 1;
  double clip = 0.0;
  std::string precision = "32";
  int steps = 20;
  int n_embd = 64;
  bool checkpoint = false;
  bool offload = false;
  bool nvme = false;  // with offload: the optimizer states on NVMe (a folder under the build tree)
  bool tie = false;
  bool deferred = false;  // --cpu_copy_mode deferred (NOTE [device streams])
  std::string zero_extra = "{}";  // JSON merged into zero_optimization
};

// Each test runs in its own process (CTest), possibly beside others: the pid
// keeps their files apart.
std::string name_of(const RunSpec& r) {
  std::ostringstream s;
  s << getpid() << "_w" << r.world << "_s" << r.stage << "_gas" << r.gas << "_clip" << r.clip << "_p" << r.precision
    << "_c" << r.n_embd << "_n" << r.steps << (r.checkpoint ? "_ckpt" : "") << (r.offload ? "_offload" : "") << (r.nvme ? "_nvme" : "")
    << (r.tie ? "_tie" : "") << (r.deferred ? "_deferred" : "") << "_x" << std::hash<std::string>{}(r.zero_extra);
  return s.str();
}

// Global batch 32 whatever the world size: micro-batch 32 / (world * gas).
std::string write_config(const RunSpec& r) {
  const std::string path = kWork + name_of(r) + ".json";
  nlohmann::json c = {
      {"train_batch_size", 32},
      {"gradient_accumulation_steps", r.gas},
      {"gradient_clipping", r.clip},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.003}, {"betas", {0.9, 0.95}}, {"weight_decay", 0.01}}}}},
      {"zero_optimization", {{"stage", r.stage}, {"reduce_bucket_size", 20000}, {"allgather_bucket_size", 20000}}},
  };
  if (r.precision == "16") c["fp16"] = {{"enabled", true}, {"initial_scale_power", 12}};
  if (r.offload) c["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}, {"pin_memory", true}};
  if (r.offload && r.nvme) {
    std::system(("mkdir -p " + kWork + "nvme").c_str());
    c["zero_optimization"]["offload_optimizer"] = {{"device", "nvme"}, {"nvme_path", kWork + "nvme"},
                                                   {"buffer_count", 3}, {"pipeline_read", true},
                                                   {"pipeline_write", true}};
  }
  if (r.offload && r.stage == 3) c["zero_optimization"]["offload_param"] = {{"device", "cpu"}, {"pin_memory", true}};
  // Stage 3: weights partitioned, LayerNorm parameters (64) kept whole.
  if (r.stage == 3) c["zero_optimization"]["stage3_param_persistence_threshold"] = 100;
  const nlohmann::json extra = nlohmann::json::parse(r.zero_extra);  // named: items() must not outlive it
  for (const auto& [k, v] : extra.items()) {
    const std::string top = "_top";  // "key_top": a top-level key instead
    if (k.size() > top.size() && k.compare(k.size() - top.size(), top.size(), top) == 0)
      c[k.substr(0, k.size() - top.size())] = v;
    else
      c["zero_optimization"][k] = v;
  }
  std::ofstream(path) << c.dump(2);
  return path;
}

// Runs mingpt on r.world ranks and returns its summary (rank 0's).
nlohmann::json run_mingpt(const RunSpec& r) {
  static std::map<std::string, nlohmann::json> cache;
  const std::string name = name_of(r);
  if (auto it = cache.find(name); it != cache.end()) return it->second;
  std::system(("mkdir -p " + kWork).c_str());
  const std::string summary = kWork + name + ".summary.json";
  const std::string log = kWork + name + ".log";
  std::remove(summary.c_str());
  std::ostringstream cmd;
  cmd << "OMP_NUM_THREADS=1 ";
  if (r.world > 1) cmd << kBin << "zero launch --nproc_per_node " << r.world << " -- ";
  cmd << kBin << "mingpt --config " << write_config(r) << " --n_layer 2 --n_head 2 --n_embd " << r.n_embd
      << " --dropout 0 --max_epochs 1 --limit_train_batches " << r.steps * r.gas
      << " --precision " << r.precision << (r.checkpoint ? " --checkpoint" : "") << (r.tie ? " --tie_weights" : "")
      << (r.deferred ? " --cpu_copy_mode deferred" : "")
      << " --summary-json " << summary
      << " > " << log << " 2>&1";
  const int rc = std::system(cmd.str().c_str());
  EXPECT_EQ(rc, 0) << cmd.str() << "\n(see " << log << ")";
  std::ifstream in(summary);
  if (!in) {
    ADD_FAILURE() << "no summary from " << name << " (see " << log << ")";
    return {};
  }
  auto j = nlohmann::json::parse(in);
  cache[name] = j;
  return j;
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-12); }

struct Case {
  int world, stage, gas;
  double clip;
};

class StageMatchesSingleProcess : public ::testing::TestWithParam<Case> {};

TEST_P(StageMatchesSingleProcess, Fp32LossCurveAndParameters) {
  const Case c = GetParam();
  RunSpec single{1, 0, c.gas, c.clip};
  RunSpec many{c.world, c.stage, c.gas, c.clip};
  auto ref = run_mingpt(single);
  auto got = run_mingpt(many);
  ASSERT_FALSE(ref.empty());
  ASSERT_FALSE(got.empty());
  EXPECT_EQ(got["world_size"].get<int>(), c.world);
  EXPECT_EQ(got["zero_stage"].get<int>(), c.stage);
  EXPECT_EQ(got["steps"], ref["steps"]);
  // The issue's bar: 1e-5 relative on the parameter norm after 20 steps.
  EXPECT_LT(rel(got["param_l2"].get<double>(), ref["param_l2"].get<double>()), 1e-5);
  const auto& a = ref["loss_curve"];
  const auto& b = got["loss_curve"];
  ASSERT_EQ(a.size(), b.size());
  // Each step's loss within 1e-4: the ranks sum smaller micro-batches in a
  // different order, and 20 steps of training carry that rounding forward.
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_LT(rel(b[i].get<double>(), a[i].get<double>()), 1e-4) << "step " << i + 1;
}

INSTANTIATE_TEST_SUITE_P(
    Stages, StageMatchesSingleProcess,
    ::testing::Values(Case{2, 0, 1, 0.0}, Case{2, 1, 1, 0.0}, Case{2, 2, 1, 0.0},
                      Case{2, 0, 2, 0.05}, Case{2, 1, 2, 0.05}, Case{2, 2, 2, 0.05},
                      Case{4, 0, 1, 0.0}, Case{4, 1, 1, 0.0}, Case{4, 2, 1, 0.0},
                      Case{4, 2, 2, 0.05}, Case{2, 3, 1, 0.0}, Case{2, 3, 2, 0.05}, Case{4, 3, 1, 0.0},
                      Case{4, 3, 2, 0.05}),
    [](const auto& info) {
      const Case& c = info.param;
      return "world" + std::to_string(c.world) + "_stage" + std::to_string(c.stage) + "_gas" +
             std::to_string(c.gas) + (c.clip > 0 ? "_clip" : "");
    });

// Optimizer offload (CPU) at stages 1 and 2 on two ranks equals one process
// without offload; the device tier then holds only the 16-bit parameters and
// (stage 1) gradients, everything else is on the host tiers.
class OffloadMatchesSingleProcess : public ::testing::TestWithParam<int> {};

TEST_P(OffloadMatchesSingleProcess, Fp32Parameters) {
  RunSpec single{1, 0, 1, 0.05};
  RunSpec many{2, GetParam(), 1, 0.05};
  many.offload = true;
  auto ref = run_mingpt(single);
  auto got = run_mingpt(many);
  ASSERT_FALSE(got.empty());
  EXPECT_LT(rel(got["param_l2"].get<double>(), ref["param_l2"].get<double>()), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Stages, OffloadMatchesSingleProcess, ::testing::Values(1, 2),
                         [](const auto& info) { return "stage" + std::to_string(info.param); });

TEST_P(OffloadMatchesSingleProcess, Fp16DeviceTierHoldsOnly16BitParametersAndGradients) {
  const int stage = GetParam();
  RunSpec r{2, stage, 1, 1.0, "16", 1, 128};
  r.offload = true;
  auto got = run_mingpt(r);
  ASSERT_FALSE(got.empty());
  const double psi = got["num_parameters"].get<double>();
  for (const auto& rank : got["ranks"]) {
    const auto& dev = rank["model_state_bytes_by_tier"]["device"];
    const auto& host = rank["model_state_bytes_by_tier"]["host"];
    EXPECT_EQ(dev["optimizer_states"].get<double>(), 0.0);
    EXPECT_NEAR(dev["parameters"].get<double>() / psi, 2.0, 0.1);
    // stage 1 keeps full 16-bit gradients on the device; stage 2 none (its partition is on the host)
    EXPECT_NEAR(dev["gradients"].get<double>() / psi, stage == 1 ? 2.0 : 0.0, 0.1);
    EXPECT_NEAR(host["optimizer_states"].get<double>() / psi, 12.0 / 2, 0.3);
    EXPECT_NEAR(host["gradients"].get<double>() / psi, stage == 2 ? 4.0 / 2 : 0.0, 0.1);
  }
}

// Activation checkpointing combines with partitioning: stage 2 on two ranks,
// every block checkpointed, equals one process without checkpointing.
TEST(StageMatchesSingleProcess, Stage2WithActivationCheckpointing) {
  RunSpec single{1, 0, 1, 0.0};
  RunSpec many{2, 2, 1, 0.0};
  many.checkpoint = true;
  auto ref = run_mingpt(single);
  auto got = run_mingpt(many);
  ASSERT_FALSE(got.empty());
  EXPECT_LT(rel(got["param_l2"].get<double>(), ref["param_l2"].get<double>()), 1e-5);
}

// Stage 3 with every block checkpointed: the recompute in backward runs while
// the pre-backward gather holds the block's parameters.
TEST(StageMatchesSingleProcess, Stage3WithActivationCheckpointing) {
  RunSpec single{1, 0, 1, 0.0};
  RunSpec many{2, 3, 1, 0.0};
  many.checkpoint = true;
  auto ref = run_mingpt(single);
  auto got = run_mingpt(many);
  ASSERT_FALSE(got.empty());
  EXPECT_LT(rel(got["param_l2"].get<double>(), ref["param_l2"].get<double>()), 1e-5);
}

// fp16 on two ranks against fp16 on one: the gradients are summed in fp16 in
// a different order (per rank, then across ranks), so the documented
// tolerance is 1e-3 relative on the parameter norm and 2e-3 on each loss.
TEST(StageMatchesSingleProcess, Fp16Stage2WithinDocumentedTolerance) {
  RunSpec single{1, 0, 1, 1.0, "16", 6};
  RunSpec many{2, 2, 1, 1.0, "16", 6};
  auto ref = run_mingpt(single);
  auto got = run_mingpt(many);
  ASSERT_FALSE(got.empty());
  EXPECT_LT(rel(got["param_l2"].get<double>(), ref["param_l2"].get<double>()), 1e-3);
  for (size_t i = 0; i < ref["loss_curve"].size(); ++i)
    EXPECT_LT(rel(got["loss_curve"][i].get<double>(), ref["loss_curve"][i].get<double>()), 2e-3);
}

// Memory regression: per-rank model-state bytes measured by the ledger against
// the ZeRO formulas for fp16 with Adam (K = 12): stage 0 16, stage 1
// 4 + 12/N, stage 2 2 + 14/N bytes per parameter, within 5% (the padding of
// this model is under 1%).
struct MemCase {
  int world, stage;
};
class ModelStateFormula : public ::testing::TestWithParam<MemCase> {};

TEST_P(ModelStateFormula, Fp16BytesPerParameterPerRank) {
  const MemCase c = GetParam();
  RunSpec r{c.world, c.stage, 1, 1.0, "16", 1, 128};
  auto got = run_mingpt(r);
  ASSERT_FALSE(got.empty());
  const double psi = got["num_parameters"].get<double>();
  const double n = c.world;
  // Stage 3: 16/N plus the live gathered layers, none at the end of a step
  // but the always-gathered position embedding (0.4% here).
  const double expected = c.stage == 0 ? 16.0 : c.stage == 1 ? 4.0 + 12.0 / n : c.stage == 2 ? 2.0 + 14.0 / n : 16.0 / n;
  ASSERT_EQ(got["ranks"].size(), static_cast<size_t>(c.world));
  for (const auto& rank : got["ranks"]) {
    const auto& b = rank["model_state_bytes"];
    const double total = b["parameters"].get<double>() + b["gradients"].get<double>() +
                         b["optimizer_states"].get<double>();
    EXPECT_NEAR(total / psi, expected, 0.05 * expected)
        << "rank " << rank["rank"] << ": parameters " << b["parameters"] << ", gradients "
        << b["gradients"] << ", optimizer states " << b["optimizer_states"];
  }
}

INSTANTIATE_TEST_SUITE_P(Formulas, ModelStateFormula,
                         ::testing::Values(MemCase{2, 0}, MemCase{2, 1}, MemCase{2, 2}, MemCase{4, 0},
                                           MemCase{4, 1}, MemCase{4, 2}, MemCase{2, 3}, MemCase{4, 3}),
                         [](const auto& info) {
                           return "world" + std::to_string(info.param.world) + "_stage" +
                                  std::to_string(info.param.stage);
                         });

// Stage 3 with the head tied to the token embedding (one parameter used by
// two layers) equals one process with the same tied model.
class Stage3Tied : public ::testing::TestWithParam<Case> {};

TEST_P(Stage3Tied, MatchesOneProcess) {
  const Case c = GetParam();
  RunSpec single{1, 0, c.gas, c.clip};
  single.tie = true;
  RunSpec many{c.world, 3, c.gas, c.clip};
  many.tie = true;
  auto ref = run_mingpt(single);
  auto got = run_mingpt(many);
  ASSERT_FALSE(got.empty());
  EXPECT_EQ(got["num_parameters"], ref["num_parameters"]);
  EXPECT_LT(rel(got["param_l2"].get<double>(), ref["param_l2"].get<double>()), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Worlds, Stage3Tied, ::testing::Values(Case{2, 3, 1, 0.0}, Case{4, 3, 2, 0.05}),
                         [](const auto& info) {
                           return "world" + std::to_string(info.param.world) + "_gas" + std::to_string(info.param.gas);
                         });

// stage3_max_live_parameters bounds the gathered elements: set low, the
// ledger's peak of gathered parameter bytes stays within it plus one layer;
// with the default it does not (so the bound is what holds it).
TEST(Stage3Memory, MaxLiveParametersBoundsTheLedgerPeak) {
  // A block of C=64 is 12*64^2+13*64 = 49984 elements, padded to 50176 on 2
  // ranks; all layers together are about 102k.
  const double layer = 50176, limit = 30000;
  RunSpec low{2, 3, 1, 0.0, "32", 3, 64};
  low.zero_extra = R"({"stage3_max_live_parameters": 30000, "stage3_prefetch_bucket_size": 50000})";
  RunSpec dflt{2, 3, 1, 0.0, "32", 3, 64};
  auto got = run_mingpt(low);
  auto ref = run_mingpt(dflt);
  ASSERT_FALSE(got.empty());
  ASSERT_FALSE(ref.empty());
  for (const auto& rank : got["ranks"]) {
    const double peak_elems = rank["peak_gathered_bytes"].get<double>() / 4;
    EXPECT_LE(peak_elems, limit + layer) << rank.dump();
    EXPECT_LE(rank["peak_live_parameters"].get<double>(), limit + layer);
    EXPECT_GT(peak_elems, 0.0);
  }
  EXPECT_GT(ref["ranks"][0]["peak_gathered_bytes"].get<double>() / 4, limit + layer);
  EXPECT_LT(rel(got["param_l2"].get<double>(), ref["param_l2"].get<double>()), 1e-9);
}

// Stage 3 with the optimizer and the parameters offloaded to the CPU equals
// one process; the device tier then holds no optimizer states or shards.
TEST(Stage3Offload, MatchesOneProcessWithStatesOnTheHost) {
  RunSpec single{1, 0, 1, 0.05};
  RunSpec many{2, 3, 1, 0.05};
  many.offload = true;
  auto ref = run_mingpt(single);
  auto got = run_mingpt(many);
  ASSERT_FALSE(got.empty());
  EXPECT_LT(rel(got["param_l2"].get<double>(), ref["param_l2"].get<double>()), 1e-5);
  const double psi = got["num_parameters"].get<double>();
  for (const auto& rank : got["ranks"]) {
    const auto& dev = rank["model_state_bytes_by_tier"]["device"];
    const auto& host = rank["model_state_bytes_by_tier"]["host"];
    EXPECT_EQ(dev["optimizer_states"].get<double>(), 0.0);
    EXPECT_EQ(dev["gradients"].get<double>(), 0.0);
    // On the device only the always-gathered group: the position embedding and
    // the LayerNorm and attention biases under the persistence threshold
    // (1664 parameters, padded to 2048, fp32).
    EXPECT_EQ(dev["parameters"].get<double>(), 2048.0 * 4);
    EXPECT_NEAR(host["parameters"].get<double>() / psi, 4.0 / 2, 0.1);
    EXPECT_NEAR(host["optimizer_states"].get<double>() / psi, 12.0 / 2, 0.3);
    EXPECT_NEAR(host["gradients"].get<double>() / psi, 4.0 / 2, 0.1);
  }
}

// Runs `nvme` and `cpu` (the same but offloaded to CPU memory) and one process
// without offload; expects the NVMe run to equal the CPU-offload run bit for
// bit and the single process to the stage tests' tolerance, and nothing left
// in the swap folder. Returns the NVMe run's summary (empty on failure).
nlohmann::json expect_nvme_equals_cpu_offload(const RunSpec& cpu, const RunSpec& nvme) {
  auto ref = run_mingpt(RunSpec{1, 0, 1, 0.05});
  auto base = run_mingpt(cpu);
  auto got = run_mingpt(nvme);
  if (got.empty() || base.empty()) return {};
  EXPECT_EQ(got["param_l2"].get<double>(), base["param_l2"].get<double>());
  EXPECT_EQ(got["loss_curve"], base["loss_curve"]);
  EXPECT_LT(rel(got["param_l2"].get<double>(), ref["param_l2"].get<double>()), 1e-5);
  const std::string left = kWork + "nvme";
  EXPECT_EQ(std::system(("test -z \"$(ls -A " + left + ")\"").c_str()), 0) << "files left in " << left;
  return got;
}

// Optimizer states on NVMe (NOTE [optimizer swapping]) at stages 1-3 on two
// ranks: the same arithmetic as CPU offload on states that went through the
// swap files, so the run equals the CPU-offload run bit for bit, and one
// process without offload to the stage tests' tolerance. Small sub-groups
// (about 13 per rank) exercise the read-ahead / write-behind pipeline; the
// NVMe tier then holds the 12 bytes per parameter of master and moments, 1/N
// per rank, and the host only the gradient partition and the buffers.
class NvmeMatchesCpuOffload : public ::testing::TestWithParam<int> {};

TEST_P(NvmeMatchesCpuOffload, BitForBitAndStatesOnTheNvmeTier) {
  const int stage = GetParam();
  RunSpec cpu{2, stage, 1, 0.05};
  cpu.offload = true;
  cpu.zero_extra = R"({"sub_group_size": 4000})";
  RunSpec nvme = cpu;
  nvme.nvme = true;
  auto got = expect_nvme_equals_cpu_offload(cpu, nvme);
  ASSERT_FALSE(got.empty());
  const double psi = got["num_parameters"].get<double>();
  for (const auto& rank : got["ranks"]) {
    const auto& by_tier = rank["model_state_bytes_by_tier"];
    EXPECT_EQ(by_tier["device"]["optimizer_states"].get<double>(), 0.0);
    // 12/N bytes per parameter, and each sub-group 4 KiB-aligned in each file.
    const double on_nvme = by_tier["nvme"]["optimizer_states"].get<double>() / psi;
    EXPECT_GE(on_nvme, 12.0 / 2);
    EXPECT_LE(on_nvme, 12.0 / 2 * 1.15);
    EXPECT_NEAR(by_tier["host"]["gradients"].get<double>() / psi, stage == 1 ? 0.0 : 4.0 / 2, 0.1);
    // Three buffers of one sub-group (4,000 elements) of the three tensors,
    // plus up to 4 KiB to align them for O_DIRECT.
    EXPECT_LE(by_tier["host"]["optimizer_states"].get<double>(), 3 * 3 * 4 * 4096.0 + 4096);
  }
  const auto& nv = got["nvme"];
  EXPECT_GT(nv["bytes_read"].get<double>(), 0);
  EXPECT_GT(nv["bytes_written"].get<double>(), nv["bytes_read"].get<double>());  // the initial write too
}

INSTANTIATE_TEST_SUITE_P(Stages, NvmeMatchesCpuOffload, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "stage" + std::to_string(info.param); });

// Stage 3 with the parameter shards on NVMe too (NOTE [parameter swapping]):
// with max_in_cpu 0 every layer's shard is read from disk for each gather,
// through 2 buffers (fewer than the prefetch window wants, so buffers are
// reclaimed from finished gathers and read-aheads), and written back after
// each step. Equal to CPU offload bit for bit; with a max_in_cpu that keeps
// some layers in memory, too.
class Stage3NvmeParams : public ::testing::TestWithParam<int64_t> {};

TEST_P(Stage3NvmeParams, EqualCpuOffloadBitForBit) {
  const int64_t max_in_cpu = GetParam();
  RunSpec cpu{2, 3, 1, 0.05};
  cpu.offload = true;
  cpu.zero_extra = R"({"sub_group_size": 4000})";
  RunSpec nvme = cpu;
  nvme.nvme = true;
  nlohmann::json extra = {{"sub_group_size", 4000},
                          {"offload_param",
                           {{"device", "nvme"},
                            {"nvme_path", kWork + "nvme"},
                            {"buffer_count", 1},  // fewer buffers than shards: they are read again
                            {"buffer_size", 100000},
                            {"max_in_cpu", max_in_cpu}}}};
  nvme.zero_extra = extra.dump();
  auto got = expect_nvme_equals_cpu_offload(cpu, nvme);
  ASSERT_FALSE(got.empty());
  const double psi = got["num_parameters"].get<double>();
  for (const auto& rank : got["ranks"]) {
    const auto& by_tier = rank["model_state_bytes_by_tier"];
    const double on_nvme = by_tier["nvme"]["parameters"].get<double>() / psi;
    if (max_in_cpu == 0) {
      // Every layer shard: fp32, 1/2 per rank, less the small always-gathered group.
      EXPECT_NEAR(on_nvme, 4.0 / 2, 0.15);
    } else {
      EXPECT_GT(on_nvme, 0.1);
      EXPECT_LT(on_nvme, 4.0 / 2 - 0.3);  // some layers stayed in memory
    }
    EXPECT_EQ(by_tier["device"]["optimizer_states"].get<double>(), 0.0);
  }
  const double read = got["nvme"]["param_bytes_read"].get<double>();
  const double cached = got["nvme"]["param_bytes_cached"].get<double>();
  // More shards than the buffer: some come from the disk, some are still in
  // the buffer (the last layer at the turn from forward to backward).
  EXPECT_GT(read, 0);
  EXPECT_GT(cached, 0);
}

INSTANTIATE_TEST_SUITE_P(MaxInCpu, Stage3NvmeParams, ::testing::Values(0, 30000),
                         [](const auto& info) { return "max_in_cpu" + std::to_string(info.param); });

// NOTE [device streams] on two ranks: with every device-host transfer held
// back until it is waited for (the shards copied from host memory that the
// all-gathers send, reduced chunks on their way to the host over two
// accumulated micro-batches, new values on their way to the device before
// their all-gather), offloaded training gives the same bits as with the
// copies done at once. A missing wait would send or add stale values, or
// fail on a buffer written while a copy could still read it.
// Runs `base` and `other`; expects the same parameters and losses, bit for
// bit. Returns `other`'s summary and sets `base_out` to base's (empty on failure).
nlohmann::json expect_same_run(const RunSpec& base, const RunSpec& other, nlohmann::json* base_out = nullptr) {
  auto a = run_mingpt(base);
  auto b = run_mingpt(other);
  if (base_out != nullptr) *base_out = a;
  if (a.empty() || b.empty()) {
    ADD_FAILURE() << "a run gave no summary";
    return {};
  }
  EXPECT_EQ(b["param_l2"].get<double>(), a["param_l2"].get<double>());
  EXPECT_EQ(b["loss_curve"], a["loss_curve"]);
  return b;
}

class DeferredCopiesOnTwoRanks : public ::testing::TestWithParam<std::string> {};

TEST_P(DeferredCopiesOnTwoRanks, EqualImmediateCopiesBitForBit) {
  const std::string v = GetParam();
  RunSpec immediate{2, v[5] - '0', 2, 0.05};
  immediate.steps = 6;
  immediate.offload = true;
  nlohmann::json extra = {{"sub_group_size", 4000}};
  if (v == "stage3_nvme_params") {
    extra["offload_param"] = {{"device", "nvme"}, {"nvme_path", kWork + "nvme"}, {"buffer_count", 2},
                              {"buffer_size", 100000}, {"max_in_cpu", 0}};
    std::system(("mkdir -p " + kWork + "nvme").c_str());
  }
  immediate.zero_extra = extra.dump();
  RunSpec deferred = immediate;
  deferred.deferred = true;
  expect_same_run(immediate, deferred);
}

// The keys that shape the reduction reach it (NOTE [gradient path]), on two
// ranks at stage 2: reduce_scatter false and an fp32 communication_data_type
// give the same bits as the default; prescale_gradients and
// gradient_predivide_factor move the division (so only rounding differs);
// bf16 reductions round (so the run differs, slightly).
struct KeyCase {
  const char* name;
  const char* extra;
  double max_rel;  // 0: bit for bit
  bool differs;    // must not be bit for bit
};

class ReductionKeysOnTwoRanks : public ::testing::TestWithParam<KeyCase> {};

TEST_P(ReductionKeysOnTwoRanks, ChangeTheRunAsTheyShould) {
  const KeyCase c = GetParam();
  RunSpec base{2, 2, 1, 0.05};
  base.steps = 8;
  RunSpec with_key = base;
  with_key.zero_extra = c.extra;
  auto ref = run_mingpt(base);
  auto got = run_mingpt(with_key);
  ASSERT_FALSE(ref.empty());
  ASSERT_FALSE(got.empty());
  const double a = got["param_l2"].get<double>(), b = ref["param_l2"].get<double>();
  if (c.max_rel == 0) {
    EXPECT_EQ(a, b);
  } else {
    EXPECT_LT(rel(a, b), c.max_rel);
  }
  if (c.differs) EXPECT_NE(a, b);
}

INSTANTIATE_TEST_SUITE_P(
    Stage2, ReductionKeysOnTwoRanks,
    ::testing::Values(KeyCase{"reduce_scatter_false", R"({"reduce_scatter": false})", 0, false},
                      KeyCase{"contiguous_gradients_false", R"({"contiguous_gradients": false})", 0, false},
                      KeyCase{"predivide", R"({"gradient_predivide_factor_top": 2.0})", 1e-6, false},
                      KeyCase{"prescale", R"({"prescale_gradients_top": true})", 1e-6, false},
                      KeyCase{"bf16_reductions", R"({"communication_data_type_top": "bf16"})", 1e-2, true}),
    [](const auto& info) { return std::string(info.param.name); });

// NOTE [partial offload] on two ranks, copies held back until waited for:
// offload_optimizer.ratio 0.3 (the device keeps the first groups' states and
// gradients, reduced there, stepped in place; here group 0 and the first of
// two blocks, the host the last block, which is at least 0.3 of them) gives
// the bits of ratio 1, over two accumulated micro-batches with clipping; each
// tier holds its share.
TEST(PartialOffloadOnTwoRanks, EqualsAllOnTheHostBitForBit) {
  RunSpec all{2, 3, 2, 0.05};
  all.steps = 6;
  all.deferred = true;
  all.zero_extra = R"({"sub_group_size": 4000, "offload_optimizer": {"device": "cpu"}})";
  RunSpec half = all;
  half.zero_extra = R"({"sub_group_size": 4000, "offload_optimizer": {"device": "cpu", "ratio": 0.3}})";
  nlohmann::json base;
  const auto got = expect_same_run(all, half, &base);
  ASSERT_FALSE(got.empty());
  // The device's share crosses to the host no more: fewer bytes moved
  // (rank 0's; gradients down and new values up, the same dtype each way).
  EXPECT_GT(got["transfer_bytes"].get<double>(), 0);
  EXPECT_LT(got["transfer_bytes"].get<double>(), 0.7 * base["transfer_bytes"].get<double>());
  const double psi = got["num_parameters"].get<double>();
  for (size_t r = 0; r < 2; ++r) {
    const auto& by_tier = got["ranks"][r]["model_state_bytes_by_tier"];
    const auto& all_tier = base["ranks"][r]["model_state_bytes_by_tier"];
    const double dev = by_tier["device"]["optimizer_states"].get<double>() / psi;
    const double host = by_tier["host"]["optimizer_states"].get<double>() / psi;
    EXPECT_EQ(all_tier["device"]["optimizer_states"].get<double>(), 0.0);
    // 12 bytes a parameter over 2 ranks, split between the tiers: the
    // host's about half, and at least 0.3.
    EXPECT_NEAR(dev + host, 12.0 / 2, 0.3);
    EXPECT_GE(host, 0.3 * 12.0 / 2);
    EXPECT_GT(dev, 0.4 * 12.0 / 2);
    EXPECT_GT(by_tier["device"]["gradients"].get<double>(), all_tier["device"]["gradients"].get<double>());
  }
}

INSTANTIATE_TEST_SUITE_P(Offload, DeferredCopiesOnTwoRanks,
                         ::testing::Values("stage1", "stage2", "stage3", "stage3_nvme_params"),
                         [](const auto& info) { return info.param; });

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Ranks started with different configs fail together, naming the config.
TEST(Distributed, RanksWithDifferentConfigsFailWithAClearMessage) {
  std::system(("mkdir -p " + kWork).c_str());
  RunSpec a{2, 1, 1, 0.0};
  RunSpec b{2, 2, 1, 0.0};
  const std::string ca = write_config(a), cb = write_config(b);
  const std::string log = kWork + "mismatch.log";
  const std::string cmd = "OMP_NUM_THREADS=1 " + kBin + "zero launch --nproc_per_node 2 -- sh -c 'if [ \"$RANK\" = 1 ]; then c=" +
                          cb + "; else c=" + ca + "; fi; exec " + kBin +
                          "mingpt --config $c --n_layer 1 --n_embd 32 --limit_train_batches 2' > " + log + " 2>&1";
  EXPECT_NE(std::system(cmd.c_str()), 0);
  const std::string text = slurp(log);
  EXPECT_NE(text.find("ranks disagree on the DeepSpeed config"), std::string::npos) << text;
}

// A peer that never joins does not leave the others waiting forever.
TEST(Distributed, MissingPeerTimesOutNamingTheRendezvous) {
  std::system(("mkdir -p " + kWork).c_str());
  const std::string cfg = write_config(RunSpec{2, 2, 1, 0.0});
  const std::string log = kWork + "timeout.log";
  const std::string cmd = "ZERO_COMM_TIMEOUT_S=3 OMP_NUM_THREADS=1 " + kBin +
                          "zero launch --nproc_per_node 2 --kill-timeout 1 -- sh -c 'if [ \"$RANK\" = 1 ]; then sleep 300; else exec " +
                          kBin + "mingpt --config " + cfg + " --n_layer 1 --n_embd 32 --limit_train_batches 2; fi' > " + log + " 2>&1";
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_NE(std::system(cmd.c_str()), 0);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 120.0);  // not the 300 s the missing rank sleeps, however slow the start
  const std::string text = slurp(log);
  EXPECT_NE(text.find("join within 3 s (ZERO_COMM_TIMEOUT_S)"), std::string::npos) << text;
  EXPECT_NE(text.find("rendezvous at 127.0.0.1"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 0 of 2"), std::string::npos) << text;
}

}  // namespace

namespace {

// A rank that hangs in the middle of training (stopped with SIGSTOP) makes the
// others fail within ZERO_COMM_TIMEOUT_S, naming the collective and the rank.
TEST(Distributed, HungRankTimesOutNamingTheCollective) {
  std::system(("mkdir -p " + kWork).c_str());
  const std::string cfg = write_config(RunSpec{2, 2, 1, 0.0});
  const std::string log = kWork + std::to_string(getpid()) + "_hang.log";
  const std::string cmd =
      "ZERO_COMM_TIMEOUT_S=10 OMP_NUM_THREADS=1 " + kBin +
      "zero launch --nproc_per_node 2 --kill-timeout 1 -- sh -c 'if [ \"$RANK\" = 1 ]; then "
      "(i=0; while [ $i -lt 1200 ] && ! grep -q \"epoch 1/\" " + log + "; do sleep 0.1; i=$((i+1)); done; kill -STOP $$) & "
      "fi; exec " +
      kBin + "mingpt --config " + cfg + " --n_layer 1 --n_embd 32 --max_epochs 100' > " + log + " 2>&1";
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_NE(std::system(cmd.c_str()), 0);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 120.0);  // not the 100 epochs
  const std::string text = slurp(log);
  EXPECT_NE(text.find("failed on rank 0 (collective timeout 10 s"), std::string::npos) << text;
  const bool names_collective = text.find("all_reduce of") != std::string::npos ||
                                text.find("reduce_scatter of") != std::string::npos ||
                                text.find("all_gather of") != std::string::npos;
  EXPECT_TRUE(names_collective) << text;
}

}  // namespace
