// DeepSpeed's checkpoints in and out (NOTE [deepspeed checkpoints]), against
// DeepSpeed itself on CPU ranks (DS_ACCELERATOR=cpu, Gloo, torchrun):
//  - in: DeepSpeed trains TinyNet 4 steps on 2 ranks at stage 2 and 3,
//    saves, and goes on 3 steps; zero resumes the checkpoint on 1, 2 and 4
//    ranks at the same stage and at the other, and its next 3 losses equal
//    DeepSpeed's own continuation (to 1e-6; today bit for bit); the
//    universal form ds_to_universal writes resumes the same way;
//  - out: zero resumes a DeepSpeed checkpoint, trains 2 steps and saves;
//    export-deepspeed writes it at stage 2, at stage 3 and in the universal
//    form; DeepSpeed resumes each (the universal one on 1 rank) with the
//    losses zero's own resume gives, and zero_to_fp32.py consolidates the
//    stage-2 export to the tensors `zero checkpoint consolidate` writes;
//  - bf16 and CPU-offload checkpoints consolidate as zero_to_fp32.py does and resume;
//  - import-deepspeed: a zero checkpoint that verifies and resumes the same;
//  - bad input: a pickle naming a foreign global (never run), a truncated
//    file, a missing rank file, a checkpoint of another model, each named.
// Each case skips, saying why, when python3 cannot import deepspeed
// (scripts/setup.sh installs it).
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

namespace {

const std::string kBin = std::string(ZERO_BINARY_DIR) + "/bin/";
const std::string kTiny = std::string(ZERO_BINARY_DIR) + "/tests/ds_tiny";
const std::string kTrain = std::string(ZERO_SOURCE_DIR) + "/tests/deepspeed/ds_train.py";
const std::string kWork = std::string(ZERO_BINARY_DIR) + "/tests/deepspeed_" + std::to_string(getpid()) + "/";
// Python's environment: DeepSpeed on CPU ranks; torch's and DeepSpeed's
// temporary files (torchelastic_*, torchinductor_*) in the work folder.
const std::string kPython = "DS_ACCELERATOR=cpu TMPDIR=" + kWork + "tmp";

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int run(const std::string& cmd, const std::string& log) {
  const int rc = std::system((cmd + " > " + log + " 2>&1").c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

// Why DeepSpeed cannot run here, or "".
std::string deepspeed_missing() {
  static const std::string why = [] {
    const std::string log = kWork + "probe.log";
    const int rc = run(kPython + " python3 -c 'import deepspeed, torch.distributed.run'", log);
    const std::string text = slurp(log);
    std::remove(log.c_str());
    return rc == 0 ? std::string() : "python3 cannot import deepspeed (pip install deepspeed; scripts/setup.sh does): " +
                                         text.substr(text.size() > 300 ? text.size() - 300 : 0);
  }();
  return why;
}


// DeepSpeed on `ranks` CPU ranks: ds_train.py with `args`; its losses. (torchrun
// --standalone takes a free port: cases run side by side.)
std::vector<double> deepspeed(int ranks, const std::string& args, const std::string& name) {
  const std::string losses = kWork + name + ".losses.json", log = kWork + name + ".log";
  const std::string cmd = "cd " + kWork + " && " + kPython + " OMP_NUM_THREADS=1 timeout 300 python3 -m torch.distributed.run "
                          "--standalone --nproc_per_node " + std::to_string(ranks) + " " + kTrain + " " + args + " --losses " + losses;
  const int rc = run(cmd, log);
  EXPECT_EQ(rc, 0) << cmd << "\n" << slurp(log).substr(0, 6000);
  if (rc != 0) return {};
  return nlohmann::json::parse(slurp(losses)).at("losses").get<std::vector<double>>();
}

std::string zero_config(int stage, int ranks) {
  return R"({"train_micro_batch_size_per_gpu": )" + std::to_string(8 / ranks) + R"(, "gradient_accumulation_steps": 1,
 "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
 "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5,
                                              "warmup_type": "linear"}},
 "gradient_clipping": 1.0, "zero_optimization": {"stage": )" + std::to_string(stage) + "}}";
}

// zero on `ranks` ranks: ds_tiny with `args`; its losses (empty when it failed; `log` has why).
std::vector<double> zero(int ranks, int stage, const std::string& args, const std::string& name, bool expect_ok = true) {
  const std::string cfg = kWork + name + ".json", losses = kWork + name + ".losses.json", log = kWork + name + ".log";
  std::ofstream(cfg) << zero_config(stage, ranks);
  const std::string cmd = "cd " + kWork + " && OMP_NUM_THREADS=1 timeout 300 " + kBin + "zero launch --nproc_per_node " +
                          std::to_string(ranks) + " -- " + kTiny + " --config " + cfg + " " + args + " --losses " + losses;
  const int rc = run(cmd, log);
  if (expect_ok) EXPECT_EQ(rc, 0) << cmd << "\n" << slurp(log).substr(0, 6000);
  if (rc != 0) return {};
  return nlohmann::json::parse(slurp(losses)).at("losses").get<std::vector<double>>();
}

void expect_losses(const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_LE(std::abs(got[i] - want[i]), 1e-6) << what << ": step " << i << " " << got[i] << " vs " << want[i];
}

class DeepSpeedCheckpoints : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { std::system(("mkdir -p " + kWork + "tmp").c_str()); }
  // The work folder stays when a case failed (its logs say why).
  static void TearDownTestSuite() {
    if (::testing::UnitTest::GetInstance()->failed_test_count() == 0) std::system(("rm -rf " + kWork).c_str());
  }
  void SetUp() override {
    if (const std::string why = deepspeed_missing(); !why.empty()) GTEST_SKIP() << why;
  }
  // DeepSpeed's checkpoint at `stage` (4 steps on 2 ranks) and its next 5 losses, made once.
  static const std::vector<double>& reference(int stage) {
    static std::map<int, std::vector<double>> made;
    if (made.count(stage) == 0)
      made[stage] = deepspeed(2, "--stage " + std::to_string(stage) + " --steps 4 --save ds" + std::to_string(stage) +
                                     " --extra 5", "ds" + std::to_string(stage));
    return made[stage];
  }
};

TEST_F(DeepSpeedCheckpoints, ZeroResumesThemAtAnyWorldSizeAndStage) {
  for (int ds_stage : {2, 3}) {
    const auto& want = reference(ds_stage);
    ASSERT_EQ(want.size(), 5u);
    const std::vector<double> next(want.begin(), want.begin() + 3);
    for (int ranks : {1, 2, 4})
      for (int stage : {2, 3}) {
        const std::string name = "in" + std::to_string(ds_stage) + "_r" + std::to_string(ranks) + "_s" + std::to_string(stage);
        const auto got = zero(ranks, stage, "--load ds" + std::to_string(ds_stage) + " --first 4 --steps 3", name);
        expect_losses(got, next, "DeepSpeed stage " + std::to_string(ds_stage) + " -> zero stage " +
                                     std::to_string(stage) + " on " + std::to_string(ranks) + " ranks");
        if (ranks == 2 && stage == ds_stage) {
          const std::string log = slurp(kWork + name + ".log");
          EXPECT_NE(log.find("is a DeepSpeed checkpoint (DeepSpeed"), std::string::npos) << log;
        }
      }
  }
}

// bf16 runs (the ZeRO optimizer's fp32 master beside bf16 weights) and CPU
// offload: zero's consolidation of DeepSpeed's checkpoint equals
// zero_to_fp32.py's, bit for bit, and zero resumes it.
TEST_F(DeepSpeedCheckpoints, Bf16AndOffloadCheckpointsReadAsZeroToFp32ReadsThem) {
  for (const std::string& flags : {"--stage 2 --bf16", "--stage 3 --offload"}) {
    const std::string name = flags.find("bf16") != std::string::npos ? "bf16" : "offload";
    ASSERT_EQ(deepspeed(2, flags + " --steps 3 --save " + name, name).size(), 0u);
    ASSERT_EQ(run("cd " + kWork + " && " + kPython + " python3 -m deepspeed.utils.zero_to_fp32 " + name + " " + name +
                      "_fp32 --safe_serialization",
                  kWork + name + "_fp32.log"), 0)
        << slurp(kWork + name + "_fp32.log");
    ASSERT_EQ(run(kBin + "zero checkpoint consolidate " + kWork + name + " " + kWork + name + ".safetensors",
                  kWork + name + "_cons.log"), 0)
        << slurp(kWork + name + "_cons.log");
    const std::string py = "python3 -c \"from safetensors.torch import load_file as l; a = l('" + kWork + name +
                           "_fp32/model.safetensors'); b = l('" + kWork + name + ".safetensors'); "
                           "assert sorted(a) == sorted(b); bad = [k for k in a if not a[k].float().equal(b[k].float())]; "
                           "assert not bad, bad; print('same', len(a))\"";
    ASSERT_EQ(run(py, kWork + name + "_compare.log"), 0) << slurp(kWork + name + "_compare.log");
    EXPECT_EQ(zero(2, 3, "--load " + name + " --first 3 --steps 2", name + "_zero").size(), 2u);
  }
}

// import-deepspeed: a zero checkpoint that verify checks and that resumes as the original does.
TEST_F(DeepSpeedCheckpoints, ImportGivesAZeroCheckpointThatResumesTheSame) {
  const auto& want = reference(3);
  ASSERT_EQ(want.size(), 5u);
  ASSERT_EQ(run(kBin + "zero checkpoint import-deepspeed " + kWork + "ds3 " + kWork + "im3", kWork + "import.log"), 0)
      << slurp(kWork + "import.log");
  ASSERT_EQ(run(kBin + "zero checkpoint verify " + kWork + "im3", kWork + "import_verify.log"), 0)
      << slurp(kWork + "import_verify.log");
  EXPECT_NE(slurp(kWork + "import_verify.log").find("OK"), std::string::npos);
  expect_losses(zero(4, 2, "--load im3 --first 4 --steps 3", "import_r4"), {want[0], want[1], want[2]}, "imported -> 4 ranks");
}

TEST_F(DeepSpeedCheckpoints, ZeroResumesTheUniversalForm) {
  const auto& want = reference(2);
  ASSERT_EQ(want.size(), 5u);
  const std::string cmd = "cd " + kWork + " && " + kPython + " python3 -m deepspeed.checkpoint.ds_to_universal "
                          "--input_folder ds2/global_step4 --output_folder uni/global_step4_universal "
                          "--inject_missing_state";  // (it writes uni/latest_universal)
  ASSERT_EQ(run(cmd, kWork + "to_universal.log"), 0) << slurp(kWork + "to_universal.log");
  expect_losses(zero(1, 2, "--load uni --first 4 --steps 3", "uni_r1"), {want[0], want[1], want[2]}, "universal -> 1 rank");
  expect_losses(zero(4, 3, "--load uni --first 4 --steps 3", "uni_r4"), {want[0], want[1], want[2]}, "universal -> 4 ranks");
  // Stage 3's universal form: bare tensors, no step.pt, a model file per rank.
  const auto& want3 = reference(3);
  ASSERT_EQ(want3.size(), 5u);
  const std::string cmd3 = "cd " + kWork + " && " + kPython + " python3 -m deepspeed.checkpoint.ds_to_universal "
                           "--input_folder ds3/global_step4 --output_folder uni3/global_step4_universal";
  ASSERT_EQ(run(cmd3, kWork + "to_universal3.log"), 0) << slurp(kWork + "to_universal3.log");
  expect_losses(zero(2, 2, "--load uni3 --first 4 --steps 3", "uni3_r2"), {want3[0], want3[1], want3[2]},
                "stage-3 universal -> 2 ranks");
}

TEST_F(DeepSpeedCheckpoints, DeepSpeedResumesZerosExport) {
  const auto& want = reference(2);
  ASSERT_EQ(want.size(), 5u);
  // zero: the DeepSpeed checkpoint resumed, 2 steps, a save; its own resume's next 3 losses.
  ASSERT_FALSE(zero(2, 2, "--load ds2 --first 4 --steps 2 --save zc", "out_train").empty());
  const auto next = zero(2, 2, "--load zc --first 6 --steps 3", "out_zero_resume");
  expect_losses(next, {want[2], want[3], want[4]}, "zero's own resume");
  for (const std::string& form : {"2", "3", "universal"}) {
    const std::string out = "ex" + form;
    const std::string flags = form == "universal" ? "--universal" : "--stage " + form;
    ASSERT_EQ(run(kBin + "zero checkpoint export-deepspeed " + kWork + "zc " + kWork + out + " " + flags,
                  kWork + out + ".export.log"), 0)
        << slurp(kWork + out + ".export.log");
    // DeepSpeed's load returns the client state zero saved.
    const std::string args = (form == "universal" ? "--stage 2 --universal --load " + out
                                                  : "--stage " + form + " --load " + out) + " --expect-next-step 6";
    const auto got = deepspeed(form == "universal" ? 1 : 2, args + " --steps 3", "resume_" + form);
    expect_losses(got, next, "DeepSpeed resuming the export (" + form + ")");
  }
  // zero_to_fp32.py: the tensors zero's consolidate writes.
  ASSERT_EQ(run("cd " + kWork + " && " + kPython + " python3 -m deepspeed.utils.zero_to_fp32 ex2 fp32 --safe_serialization",
                kWork + "fp32.log"), 0)
      << slurp(kWork + "fp32.log");
  ASSERT_EQ(run(kBin + "zero checkpoint consolidate " + kWork + "zc " + kWork + "zc.safetensors", kWork + "cons.log"), 0)
      << slurp(kWork + "cons.log");
  const std::string py = "python3 -c \"from safetensors.torch import load_file as l; a = l('" + kWork +
                         "fp32/model.safetensors'); b = l('" + kWork + "zc.safetensors'); "
                         "assert sorted(a) == sorted(b), (sorted(a), sorted(b)); "
                         "assert all(a[k].dtype == b[k].dtype and a[k].equal(b[k]) for k in a); print('same', len(a))\"";
  ASSERT_EQ(run(py, kWork + "compare.log"), 0) << slurp(kWork + "compare.log");
  EXPECT_NE(slurp(kWork + "compare.log").find("same 7"), std::string::npos) << slurp(kWork + "compare.log");
}

TEST_F(DeepSpeedCheckpoints, BadInputIsNamed) {
  ASSERT_EQ(reference(2).size(), 5u);
  auto copy = [&](const std::string& name) {
    std::system(("rm -rf " + kWork + name + " && cp -r " + kWork + "ds2 " + kWork + name).c_str());
    return kWork + name + "/global_step4/";
  };
  // A pickle that names a global outside the list: refused by name, never run.
  {
    const std::string dir = copy("foreign");
    const std::string marker = kWork + "foreign_ran";
    const std::string py = "import torch, os\nclass Evil:\n    def __reduce__(self):\n        return (os.system, ('touch " +
                           marker + "',))\nsd = torch.load('" + dir + "mp_rank_00_model_states.pt', weights_only=False)\n"
                           "sd['my_state'] = Evil()\ntorch.save(sd, '" + dir + "mp_rank_00_model_states.pt')\n";
    std::ofstream(kWork + "evil.py") << py;
    ASSERT_EQ(run(kPython + " python3 " + kWork + "evil.py", kWork + "evil.log"), 0) << slurp(kWork + "evil.log");
    EXPECT_TRUE(zero(1, 2, "--load foreign --first 4 --steps 1", "foreign", false).empty());
    const std::string log = slurp(kWork + "foreign.log");
    EXPECT_NE(log.find("mp_rank_00_model_states.pt"), std::string::npos) << log;
    EXPECT_NE(log.find("names the global posix.system"), std::string::npos) << log;
    EXPECT_NE(access(marker.c_str(), F_OK), 0) << "the pickle's global ran";
    // The CLI says the same, and exports nothing.
    EXPECT_EQ(run(kBin + "zero checkpoint info " + kWork + "foreign", kWork + "foreign_info.log"), 1);
    EXPECT_NE(slurp(kWork + "foreign_info.log").find("posix.system"), std::string::npos) << slurp(kWork + "foreign_info.log");
  }
  // A truncated optimizer file.
  {
    const std::string dir = copy("truncated");
    const std::string file = dir + "zero_pp_rank_1_mp_rank_00_optim_states.pt";
    struct stat st{};
    ASSERT_EQ(stat(file.c_str(), &st), 0);
    ASSERT_EQ(truncate(file.c_str(), st.st_size / 2), 0);
    EXPECT_TRUE(zero(2, 2, "--load truncated --first 4 --steps 1", "truncated", false).empty());
    const std::string log = slurp(kWork + "truncated.log");
    EXPECT_NE(log.find("zero_pp_rank_1_mp_rank_00_optim_states.pt"), std::string::npos) << log;
    // verify reads every file of a whole one, and names the damaged one.
    EXPECT_EQ(run(kBin + "zero checkpoint verify " + kWork + "ds2", kWork + "verify_whole.log"), 0)
        << slurp(kWork + "verify_whole.log");
    EXPECT_NE(slurp(kWork + "verify_whole.log").find("a DeepSpeed checkpoint: 3 files"), std::string::npos)
        << slurp(kWork + "verify_whole.log");
    EXPECT_EQ(run(kBin + "zero checkpoint verify " + kWork + "truncated", kWork + "verify_truncated.log"), 1);
    EXPECT_NE(slurp(kWork + "verify_truncated.log").find("zero_pp_rank_1_mp_rank_00_optim_states.pt"), std::string::npos)
        << slurp(kWork + "verify_truncated.log");
  }
  // A missing rank file.
  {
    const std::string dir = copy("missing");
    ASSERT_EQ(std::remove((dir + "zero_pp_rank_1_mp_rank_00_optim_states.pt").c_str()), 0);
    EXPECT_TRUE(zero(1, 2, "--load missing --first 4 --steps 1", "missing", false).empty());
    const std::string log = slurp(kWork + "missing.log");
    EXPECT_NE(log.find("zero_pp_rank_1_mp_rank_00_optim_states.pt: missing: the checkpoint was saved by 2 ranks"),
              std::string::npos) << log;
  }
  // A checkpoint of another model: a parameter renamed in param_shapes.
  {
    const std::string dir = copy("other_model");
    const std::string py = "import torch, collections\np = '" + dir + "mp_rank_00_model_states.pt'\n"
                           "sd = torch.load(p, weights_only=False)\n"
                           "sd['param_shapes'] = [collections.OrderedDict((k.replace('fc2', 'head'), v) "
                           "for k, v in sd['param_shapes'][0].items())]\ntorch.save(sd, p)\n";
    std::ofstream(kWork + "other.py") << py;
    ASSERT_EQ(run(kPython + " python3 " + kWork + "other.py", kWork + "other.log"), 0) << slurp(kWork + "other.log");
    EXPECT_TRUE(zero(1, 2, "--load other_model --first 4 --steps 1", "other_model", false).empty());
    const std::string log = slurp(kWork + "other_model.log");
    EXPECT_NE(log.find("has no parameter fc2.weight: a checkpoint of another model"), std::string::npos) << log;
  }
  // export-deepspeed reads zero's checkpoints: given DeepSpeed's, it says so and writes nothing.
  EXPECT_EQ(run(kBin + "zero checkpoint export-deepspeed " + kWork + "ds2 " + kWork + "never", kWork + "none.log"), 1);
  EXPECT_NE(slurp(kWork + "none.log").find("meta.json"), std::string::npos) << slurp(kWork + "none.log");
  EXPECT_NE(access((kWork + "never").c_str(), F_OK), 0);
}

}  // namespace
