// The tools on any program (issue 26): zero memcheck holds a program's memory
// to a baseline; zero tune runs the user's program with each candidate's
// config; the engine's run report (NOTE [run report]) carries the figures,
// the budgets and the stop. The program here is mingpt called as a user
// would call their own (its flags, {config}); nothing in it knows the tools.
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tool_test_util.h"

namespace zero::test {
namespace {

int sh(const std::string& cmd) {
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

void write_config(const TempDir& dir, const std::string& name, const std::string& zero) {
  std::ofstream(dir.file(name)) << R"({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": )" << zero << "}";
}

std::string program(const std::string& config) {
  return kBin + "mingpt --config " + config + " --n_layer 2 --n_embd 128 --n_head 4 --limit_train_batches 50";
}

// The engine alone ends a run after ZERO_STOP_AFTER_STEPS steps, each rank
// writing its report; a budget from the environment that the run passes is
// its out-of-memory outcome, with the tier.
TEST(RunReport, TheEnvironmentStopsARunAndSetsItsBudgets) {
  TempDir dir;
  write_config(dir, "s2.json", R"({"stage": 2})");
  const std::string run = "OMP_NUM_THREADS=1 ZERO_RUN_REPORT=" + dir.file("r") + " ZERO_STOP_AFTER_STEPS=2 " + kBin +
                          "zero launch --nproc_per_node 2 -- " + program(dir.file("s2.json"));
  ASSERT_EQ(sh(run + " > " + dir.file("log") + " 2>&1"), 0) << read_text(dir.file("log"));
  for (int rank = 0; rank < 2; ++rank) {
    const auto r = nlohmann::json::parse(read_text(dir.file("r.rank" + std::to_string(rank))));
    EXPECT_EQ(r["outcome"], "stopped");
    EXPECT_EQ(r["steps"], 2);
    EXPECT_EQ(r["rank"], rank);
    EXPECT_EQ(r["world_size"], 2);
    EXPECT_GT(r["peak_bytes"]["device"].get<int64_t>(), 0);
    // NOTE [bytes across nodes]: one node, two ranks, stage 2 in fp32: a
    // step reduces the gradients (Gloo's reduce-scatter an all-reduce: 4 B a
    // parameter sent) and all-gathers the parameters (2 B a parameter sent),
    // besides a few scalars.
    const auto& c = r["collective_bytes"];
    EXPECT_EQ(c["node"], 0);
    EXPECT_EQ(c["steps"], 2);
    EXPECT_EQ(c["across_nodes"], 0);
    const double per_param = c["within_node_per_step"].get<double>() / r["num_parameters"].get<double>();
    EXPECT_GT(per_param, 6.0) << c;
    EXPECT_LT(per_param, 6.3) << c;
  }
  EXPECT_EQ(read_text(dir.file("log")).find("Held-out accuracy"), std::string::npos) << "the run went past its stop";
  // The stop alone, without a report (a person's, not a tool's): mingpt,
  // which ends itself at the stop (InitOptions::program_ends_at_stop),
  // stops there and then does its own end.
  std::string stop_only = run;
  stop_only.replace(stop_only.find("ZERO_RUN_REPORT="), 16 + dir.file("r").size(), "");
  ASSERT_EQ(sh(stop_only + " > " + dir.file("stop.log") + " 2>&1"), 0) << read_text(dir.file("stop.log"));
  EXPECT_NE(read_text(dir.file("stop.log")).find("stopped after step 2"), std::string::npos) << read_text(dir.file("stop.log"));
  EXPECT_NE(read_text(dir.file("stop.log")).find("not evaluated (no epoch finished)"), std::string::npos)
      << read_text(dir.file("stop.log"));

  const int status = sh("ZERO_DEVICE_MEMORY=64KiB " + run + " > " + dir.file("oom.log") + " 2>&1");
  EXPECT_NE(status, 0);
  const std::string log = read_text(dir.file("oom.log"));
  EXPECT_NE(log.find("out of memory on the device"), std::string::npos) << log;
  EXPECT_NE(log.find("set by ZERO_DEVICE_MEMORY"), std::string::npos) << log;

  std::string bad = run;
  bad.replace(bad.find("ZERO_STOP_AFTER_STEPS=2"), 23, "ZERO_STOP_AFTER_STEPS=two");
  EXPECT_NE(sh(bad + " > " + dir.file("bad.log") + " 2>&1"), 0);
  // A report into a folder that is not there is refused when the engine starts, naming it.
  std::string nowhere = run;
  nowhere.replace(nowhere.find("ZERO_RUN_REPORT=") + 16, dir.file("r").size(), dir.file("none/r"));
  EXPECT_NE(sh(nowhere + " > " + dir.file("nowhere.log") + " 2>&1"), 0);
  EXPECT_NE(read_text(dir.file("nowhere.log")).find("ZERO_RUN_REPORT " + dir.file("none/r") + ".rank0: the folder"),
            std::string::npos)
      << read_text(dir.file("nowhere.log"));
  EXPECT_NE(read_text(dir.file("bad.log")).find("ZERO_STOP_AFTER_STEPS: expected a step count"), std::string::npos)
      << read_text(dir.file("bad.log"));
}

// record, then check: the same run passes (at 1%: the check's own noise is
// below that), a config that holds more fails naming the figure.
TEST(Memcheck, HoldsAProgramToItsBaseline) {
  TempDir dir, tmp;
  write_config(dir, "s2.json", R"({"stage": 2})");
  write_config(dir, "s1.json", R"({"stage": 1})");
  const std::string env = "TMPDIR=" + tmp.path() + " OMP_NUM_THREADS=1 ";
  const std::string baseline = dir.file("base.json");
  ASSERT_EQ(sh(env + kBin + "zero memcheck record --baseline " + baseline + " --ranks 2 --steps 2 -- " +
               program(dir.file("s2.json")) + " > " + dir.file("record.log") + " 2>&1"),
            0)
      << read_text(dir.file("record.log"));
  const auto b = nlohmann::json::parse(read_text(baseline));
  EXPECT_EQ(b["world_size"], 2);
  EXPECT_GT(b["ranks"][1]["figures"]["model_states/gradients"].get<int64_t>(), 0);

  ASSERT_EQ(sh(env + kBin + "zero memcheck check --baseline " + baseline + " --ranks 2 --steps 2 --tolerance 1% -- " +
               program(dir.file("s2.json")) + " > " + dir.file("same.log") + " 2>&1"),
            0)
      << read_text(dir.file("same.log"));
  EXPECT_NE(read_text(dir.file("same.log")).find("no figure grew"), std::string::npos) << read_text(dir.file("same.log"));

  EXPECT_EQ(sh(env + kBin + "zero memcheck check --baseline " + baseline + " --ranks 2 --steps 2 -- " +
               program(dir.file("s1.json")) + " > " + dir.file("grew.log") + " 2>&1"),
            1)
      << read_text(dir.file("grew.log"));
  const std::string grew = read_text(dir.file("grew.log"));
  // Stage 1 keeps every gradient; stage 2 a rank's partition of them.
  EXPECT_NE(grew.find("model_states/gradients"), std::string::npos) << grew;
  EXPECT_NE(grew.find("GREW"), std::string::npos) << grew;
  EXPECT_NE(grew.find("memory grew against"), std::string::npos) << grew;
  EXPECT_NE(grew.find("the baseline was recorded from: "), std::string::npos) << "another config: both named\n" << grew;
  EXPECT_EQ(read_text(dir.file("same.log")).find("the baseline was recorded from"), std::string::npos);
  EXPECT_TRUE(entries(tmp.path()).empty()) << "left behind in TMPDIR";

  // Usage: each mistake named.
  EXPECT_EQ(sh(kBin + "zero memcheck check --baseline " + dir.file("none.json") + " -- " + program(dir.file("s2.json")) +
               " > " + dir.file("u1.log") + " 2>&1"),
            1);
  EXPECT_NE(read_text(dir.file("u1.log")).find(dir.file("none.json")), std::string::npos) << read_text(dir.file("u1.log"));
  EXPECT_EQ(sh(kBin + "zero memcheck check --baseline " + baseline + " --tolerance lots -- true > " + dir.file("u2.log") +
               " 2>&1"),
            2);
  EXPECT_NE(read_text(dir.file("u2.log")).find("--tolerance: expected a share such as 5% or 0.05"), std::string::npos);
  EXPECT_EQ(sh(kBin + "zero memcheck check --baseline " + baseline + " --tolerance 5 -- true > " + dir.file("u4.log") +
               " 2>&1"),
            2)
      << "a bare 5 would be 500%";
  EXPECT_EQ(sh(kBin + "zero memcheck check --baseline " + baseline + " --ranks 1 -- true > " + dir.file("u5.log") + " 2>&1"),
            2);
  EXPECT_NE(read_text(dir.file("u5.log")).find("was recorded on 2 rank(s)"), std::string::npos)
      << read_text(dir.file("u5.log"));
  // A baseline with a negative figure is damaged, not a baseline to pass.
  write(dir, "neg.json", read_text(baseline).replace(read_text(baseline).find("\"model_states/gradients\": "),
                                                      std::string("\"model_states/gradients\": ").size(),
                                                      "\"model_states/gradients\": -"));
  EXPECT_EQ(sh(kBin + "zero memcheck check --baseline " + dir.file("neg.json") + " --ranks 2 -- true > " +
               dir.file("u6.log") + " 2>&1"),
            1);
  EXPECT_NE(read_text(dir.file("u6.log")).find("a damaged memory baseline: rank 0's model_states/gradients is -"),
            std::string::npos)
      << read_text(dir.file("u6.log"));
  EXPECT_EQ(sh(kBin + "zero memcheck record --baseline " + baseline + " > " + dir.file("u3.log") + " 2>&1"), 2);
  EXPECT_NE(read_text(dir.file("u3.log")).find("-- PROGRAM ARGS"), std::string::npos);
}

// zero tune on a program: its model read from a first run, the candidates
// run as PROGRAM ARGS with {config} replaced; the config written passes
// zero config check and trains.
TEST(TuneProgram, RunsTheUsersProgramWithEachCandidate) {
  TempDir dir, tmp;
  write_config(dir, "base.json", R"({"stage": 0})");
  const std::string env = "TMPDIR=" + tmp.path() + " OMP_NUM_THREADS=1 ";
  const std::string tune = env + kBin + "zero tune --ranks 2 --device-memory 24MiB --host-memory 1GiB --config " +
                           dir.file("base.json") +
                           " --stages 0,2,3 --offload none,cpu --micro-batches 2,4 --steps 2 --trials 3 --out " +
                           dir.file("best.json") + " --json " + dir.file("tune.json") + " -- " + program("{config}") +
                           " > " + dir.file("log") + " 2>&1";
  ASSERT_EQ(sh(tune), 0) << read_text(dir.file("log"));
  const std::string log = read_text(dir.file("log"));
  EXPECT_NE(log.find("training the program 2 steps at stage 3 with offload to read its model"), std::string::npos) << log;
  EXPECT_NE(log.find("of activations a sample"), std::string::npos) << log;
  EXPECT_TRUE(entries(tmp.path()).empty()) << "left behind in TMPDIR";
  const auto report = nlohmann::json::parse(read_text(dir.file("tune.json")));
  EXPECT_EQ(report["model"]["program"][0], kBin + "mingpt");
  // minGPT 2 x 128 on the addition task (vocabulary 10, context 6), as the estimator counts it.
  ASSERT_EQ(sh(kBin + "zero estimate --model mingpt:2,128,10,6 --json " + dir.file("e.json") + " > /dev/null 2>&1"), 0);
  EXPECT_EQ(report["model"]["num_parameters"], nlohmann::json::parse(read_text(dir.file("e.json")))["num_parameters"]);
  int trained = 0;
  for (const auto& c : report["candidates"]) trained += c["status"] == "trained";
  EXPECT_GE(trained, 1) << log;
  ASSERT_EQ(sh(kBin + "zero config check " + dir.file("best.json") + " --world-size 2 > " + dir.file("check.log") + " 2>&1"),
            0)
      << read_text(dir.file("check.log"));
  const auto best = nlohmann::json::parse(read_text(dir.file("best.json")));
  EXPECT_EQ(best["optimizer"]["params"]["lr"], 1e-3) << "the base config's optimizer kept";
  ASSERT_EQ(sh(env + kBin + "zero launch --nproc_per_node 2 -- " + program(dir.file("best.json")) + " > " +
               dir.file("train.log") + " 2>&1"),
            0)
      << read_text(dir.file("train.log"));

  // A program without {config} in its arguments cannot be given a candidate.
  EXPECT_EQ(sh(kBin + "zero tune --device-memory 1GiB --host-memory 1GiB -- " + program(dir.file("base.json")) + " > " +
               dir.file("u.log") + " 2>&1"),
            2);
  EXPECT_NE(read_text(dir.file("u.log")).find("the program's arguments have no {config}"), std::string::npos)
      << read_text(dir.file("u.log"));
}

}  // namespace
}  // namespace zero::test
