// zero tune (issue 16): candidates the estimator says fit, the frontier run on
// two real ranks, the fastest written as a config; a run that fails or runs
// out of memory is reported and skipped; nothing stays behind, Ctrl-C
// included. The trainer is mingpt, or a script in front of it that fails or
// hangs on chosen runs.
#include <sys/stat.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tool_test_util.h"

namespace zero::test {
namespace {


int sh(const std::string& cmd) {
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

// A trainer in front of mingpt: `cases` is a shell case body on "$*".
std::string write_trainer(const TempDir& dir, const std::string& cases) {
  const std::string path = dir.file("trainer.sh");
  std::ofstream(path) << "#!/bin/sh\ncase \"$*\" in\n" << cases << "\nesac\nexec " << kBin << "mingpt \"$@\"\n";
  ::chmod(path.c_str(), 0755);
  return path;
}

// A small grid on 2 ranks: micro-batches 2 and 8 (stages and offload as each
// test says). 12 MiB of device memory per rank holds micro-batch 2 only.
const std::string kGrid =
    " --model mingpt:2,128,64,64 --ranks 2 --device-memory 12MiB --host-memory 1GiB"
    " --checkpointing none --micro-batches 2,8 --steps 2 --gradients host";

TEST(Tune, RunsTheFrontierWritesTheFastestAndLeavesNothing) {
  TempDir dir, tmp;
  const std::string cmd = "TMPDIR=" + tmp.path() + " OMP_NUM_THREADS=1 " + kBin + "zero tune" + kGrid +
                          " --stages 0,3 --offload none,cpu --out " + dir.file("ds_config.json") + " --json " + dir.file("report.json") + " > " +
                          dir.file("log") + " 2>&1";
  ASSERT_EQ(sh(cmd), 0) << read_text(dir.file("log"));
  const std::string log = read_text(dir.file("log"));
  EXPECT_NE(log.find("zero tune: run 1 ("), std::string::npos) << log;  // progress, a line per run
  EXPECT_NE(log.find("best: "), std::string::npos) << log;
  EXPECT_TRUE(entries(tmp.path()).empty()) << "left behind in TMPDIR";

  const auto report = nlohmann::json::parse(read_text(dir.file("report.json")));
  const auto config = nlohmann::json::parse(read_text(dir.file("ds_config.json")));
  double best = 0;
  int trained = 0, dominated = 0, not_fitting = 0;
  for (const auto& c : report["candidates"]) {
    const std::string status = c["status"];
    if (status == "trained") {
      ++trained;
      EXPECT_LE(c["measured"]["peak_bytes"]["device"].get<int64_t>(), 12 << 20) << c.dump();
      best = std::max(best, c["measured"]["tokens_per_s"].get<double>());
    }
    dominated += status == "dominated";
    not_fitting += status == "does not fit (estimate)";
    EXPECT_EQ(c["fits_estimate"].get<bool>(), status != "does not fit (estimate)") << c.dump();
  }
  EXPECT_GE(trained, 2);
  EXPECT_GE(not_fitting, 1);  // micro-batch 8
  EXPECT_GE(dominated, 1);    // stage 3 at micro-batch 2, with or without CPU offload
  EXPECT_LT(report["runs"].get<int>(), static_cast<int>(report["fit_estimate"].get<int64_t>()));
  EXPECT_DOUBLE_EQ(report["best"]["tokens_per_s"].get<double>(), best);
  // The winner as a config: it loads, and trains as it was measured.
  const int best_order = report["best"]["run_order"];
  for (const auto& c : report["candidates"])
    if (c["run_order"] == best_order) {
      EXPECT_EQ(config["train_micro_batch_size_per_gpu"], c["micro_batch"]);
      EXPECT_EQ(config["zero_optimization"]["stage"], c["stage"]);
      EXPECT_EQ(config["zero_optimization"]["reduce_bucket_size"], c["bucket_size"]);
    }
  EXPECT_EQ(sh(kBin + "zero config check " + dir.file("ds_config.json") + " --world-size 2 > " + dir.file("check") +
               " 2>&1"),
            0)
      << read_text(dir.file("check"));
}

// Run 1 (stage 3) fails, run 2 (stage 3 + NVMe offload) runs out of memory:
// each is reported and skipped, the one without offload ends, the NVMe one
// goes on with smaller buckets (run 3), and its swap files go with the
// tuner's scratch folder under --nvme-path.
TEST(Tune, ReportsAndSkipsFailedRunsAndRemovesSwapFiles) {
  TempDir dir, tmp, nvme;
  const std::string trainer = write_trainer(
      dir, "  *run1.json*) echo 'mingpt: something else broke' >&2; exit 1 ;;\n"
           "  *run2.json*) echo 'mingpt: out of memory on the device: a test said so' >&2; exit 3 ;;");
  const std::string cmd = "TMPDIR=" + tmp.path() + " OMP_NUM_THREADS=1 " + kBin + "zero tune" + kGrid +
                          " --stages 3 --offload none,nvme --nvme-path " + nvme.path() + " --nvme-bytes 1GiB --trainer " +
                          trainer + " --out " + dir.file("ds_config.json") + " --json " + dir.file("report.json") +
                          " > " + dir.file("log") + " 2>&1";
  ASSERT_EQ(sh(cmd), 0) << read_text(dir.file("log"));
  const std::string log = read_text(dir.file("log"));
  EXPECT_NE(log.find("failed (skipped), exit status 1"), std::string::npos) << log;
  EXPECT_NE(log.find("something else broke"), std::string::npos) << log;
  EXPECT_NE(log.find("out of memory (skipped): mingpt: out of memory on the device: a test said so"), std::string::npos)
      << log;
  EXPECT_TRUE(entries(tmp.path()).empty());
  EXPECT_TRUE(entries(nvme.path()).empty()) << "swap files left under --nvme-path";
  const auto report = nlohmann::json::parse(read_text(dir.file("report.json")));
  std::map<int, std::string> by_order;
  for (const auto& c : report["candidates"])
    if (c["run_order"].get<int>() > 0) by_order[c["run_order"].get<int>()] = c["status"];
  ASSERT_GE(by_order.size(), 3u) << log;
  EXPECT_EQ(by_order[1], "failed");
  EXPECT_EQ(by_order[2], "out of memory");
  EXPECT_EQ(by_order[3], "trained");
  EXPECT_EQ(report["best"]["run_order"].get<int>(), 3);
  // The config written names the user's folder, not the scratch one.
  const std::string written = read_text(dir.file("ds_config.json"));
  EXPECT_EQ(written.find("zero-tune-swap"), std::string::npos) << written;
}

// A fake run that reports figures at once: each rank's run report as the
// engine writes it (NOTE [run report]), so the tuner's other runs take no
// time that a loaded machine could stretch past a limit.
const char* kFakeRun =
    "  *) echo '{\"format\": \"zero-run-report\", \"version\": 1, \"rank\": '\"$RANK\"', \"world_size\": 2,"
    " \"outcome\": \"stopped\", \"steps\": 2, \"skipped_steps\": 0, \"step_time_s\": [0.2, 0.1],"
    " \"samples_per_step\": 4, \"tokens_per_step\": 128, \"samples_per_s\": 40, \"tokens_per_s\": 1280,"
    " \"peak_bytes\": {\"device\": 1000, \"pinned_host\": 0, \"host\": 0, \"nvme\": 0}}'"
    " > \"$ZERO_RUN_REPORT.rank$RANK\"; exit ;;";

// SIGTERM while a run is in flight: the run is ended, the scratch folders
// removed, no config written, exit status 128 + 15. The signal comes once
// run 1 has started (it says so in a file), whatever the machine's speed.
TEST(Tune, InterruptedLeavesNothing) {
  TempDir dir, tmp, nvme;
  const std::string started = dir.file("started");
  const std::string trainer = write_trainer(dir, "  *run1.json*) touch " + started + "; exec sleep 600 ;;");
  const std::string cmd = "TMPDIR=" + tmp.path() + " OMP_NUM_THREADS=1 " + kBin + "zero tune" + kGrid +
                          " --stages 0,3 --nvme-path " + nvme.path() + " --trainer " + trainer + " --out " +
                          dir.file("ds_config.json") + " > " + dir.file("log") + " 2>&1 & pid=$!; i=0; while [ ! -e " +
                          started + " ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done; kill -TERM $pid;"
                          " wait $pid; echo $? > " + dir.file("status");
  sh(cmd);
  EXPECT_EQ(read_text(dir.file("status")), "143\n") << read_text(dir.file("log"));
  EXPECT_NE(read_text(dir.file("log")).find("interrupted by SIGTERM"), std::string::npos) << read_text(dir.file("log"));
  EXPECT_TRUE(entries(tmp.path()).empty());
  EXPECT_TRUE(entries(nvme.path()).empty());
  EXPECT_FALSE(std::ifstream(dir.file("ds_config.json")).good());
}

// Run 1 hangs: past --run-timeout it is stopped (zero launch ends its
// ranks), reported and skipped, and the tuner goes on to the next. The
// other runs are fake ones that report at once, so only the hung run can
// reach the limit, on any machine.
TEST(Tune, ARunPastItsTimeLimitIsStoppedAndSkipped) {
  TempDir dir, tmp;
  const std::string trainer =
      write_trainer(dir, std::string("  *run1.json*) echo 'mingpt: stuck'; exec sleep 600 ;;\n") + kFakeRun);
  const std::string cmd = "TMPDIR=" + tmp.path() + " OMP_NUM_THREADS=1 " + kBin + "zero tune" + kGrid +
                          " --stages 0,3 --run-timeout 20 --trainer " + trainer + " --out " + dir.file("ds_config.json") +
                          " --json " + dir.file("report.json") + " > " + dir.file("log") + " 2>&1";
  ASSERT_EQ(sh(cmd), 0) << read_text(dir.file("log"));
  const std::string log = read_text(dir.file("log"));
  EXPECT_NE(log.find("timed out (skipped; --run-timeout): still running after its time limit of 20 s"), std::string::npos)
      << log;
  EXPECT_NE(log.find("mingpt: stuck"), std::string::npos) << log;  // the run's last lines
  EXPECT_TRUE(entries(tmp.path()).empty());
  const auto report = nlohmann::json::parse(read_text(dir.file("report.json")));
  std::map<int, std::string> by_order;
  for (const auto& c : report["candidates"])
    if (c["run_order"].get<int>() > 0) by_order[c["run_order"].get<int>()] = c["status"];
  EXPECT_EQ(by_order[1], "timed out");
  for (const auto& [order, status] : by_order) {
    if (order > 1) {
      EXPECT_EQ(status, "trained") << "run " << order;
    }
  }
  EXPECT_GT(report["best"]["run_order"].get<int>(), 1);
}

// Killed outright (SIGKILL: nothing can be passed on), the tuner leaves no
// run going: zero launch has SIGTERM as its parent-death signal and passes
// it to its ranks. Its scratch folders stay, and the next tuner removes them.
TEST(Tune, KilledOutrightLeavesNoRunAndTheNextTunerRemovesItsFolders) {
  TempDir dir, tmp, nvme;
  const std::string pids = dir.file("pids");
  const std::string trainer = write_trainer(dir, "  *) echo $$ >> " + pids + "; exec sleep 600 ;;");
  const std::string tune = "TMPDIR=" + tmp.path() + " OMP_NUM_THREADS=1 " + kBin + "zero tune" + kGrid +
                           " --stages 0 --nvme-path " + nvme.path() + " --trainer " + trainer + " --out " +
                           dir.file("ds_config.json");
  auto wait_for_ranks = [&] {  // both ranks of the first run have started
    for (int i = 0; i < 1200; ++i) {
      std::istringstream in(read_text(pids));
      int n = 0;
      for (std::string line; std::getline(in, line);) ++n;
      if (n >= 2) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  };
  sh(tune + " > " + dir.file("log1") + " 2>&1 & echo $! > " + dir.file("tuner"));
  ASSERT_TRUE(wait_for_ranks()) << read_text(dir.file("log1"));
  const pid_t tuner = std::stoi(read_text(dir.file("tuner")));
  ::kill(tuner, SIGKILL);
  std::vector<pid_t> ranks;
  {
    std::istringstream in(read_text(pids));
    for (std::string line; std::getline(in, line);) ranks.push_back(std::stoi(line));
  }
  for (pid_t pid : ranks) {
    const bool gone = ended_within_two_minutes(pid);
    EXPECT_TRUE(gone) << "rank " << pid << " outlived the tuner killed with SIGKILL";
    if (!gone) ::kill(pid, SIGKILL);
  }
  EXPECT_FALSE(entries(tmp.path()).empty()) << "a tuner killed outright cannot remove its scratch folder";
  // The next tuner removes them; stopped in its first run, it leaves nothing.
  std::remove(pids.c_str());
  sh(tune + " > " + dir.file("log2") + " 2>&1 & echo $! > " + dir.file("tuner"));
  ASSERT_TRUE(wait_for_ranks()) << read_text(dir.file("log2"));
  ::kill(std::stoi(read_text(dir.file("tuner"))), SIGTERM);
  for (int i = 0; i < 1200 && !(entries(tmp.path()).empty() && entries(nvme.path()).empty()); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_TRUE(entries(tmp.path()).empty()) << read_text(dir.file("log2"));
  EXPECT_TRUE(entries(nvme.path()).empty()) << read_text(dir.file("log2"));
  EXPECT_NE(read_text(dir.file("log2")).find("the scratch folder of a run that was killed"), std::string::npos)
      << read_text(dir.file("log2"));
}
// NOTE [state placement]: with the optimizer on NVMe, host memory keeps the
// offloaded groups its budget holds (max_in_cpu), the disk the rest; under
// a generous budget every group, under a smaller one some.
TEST(Tune, TheHostKeepsTheNvmeStatesItsBudgetHolds) {
  TempDir dir, tmp, nvme;
  // (Sub-groups of 20000 elements: the swap buffers, 4 of them, are small
  // beside a layer's states.)
  std::ofstream(dir.file("base.json"))
      << R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0,
             "zero_optimization": {"stage3_param_persistence_threshold": 1000, "sub_group_size": 20000}})";
  auto tune = [&](const std::string& tag, const std::string& host) {
    const std::string cmd = "TMPDIR=" + tmp.path() + " OMP_NUM_THREADS=1 " + kBin + "zero tune --config " +
                            dir.file("base.json") +
                            " --model mingpt:2,128,64,64 --ranks 1 --checkpointing none --micro-batches 2 --bucket-sizes 1e6 "
                            "--steps 2 --stages 3 --offload nvme --ratios 1 --gradients host --nvme-path " + nvme.path() +
                            " --nvme-bytes 1GiB --device-memory 1GiB --host-memory " + host + " --out " +
                            dir.file(tag + ".json") + " --json " + dir.file("r" + tag + ".json") + " > " +
                            dir.file(tag + ".log") + " 2>&1";
    EXPECT_EQ(sh(cmd), 0) << read_text(dir.file(tag + ".log"));
    return nlohmann::json::parse(read_text(dir.file("r" + tag + ".json")));
  };
  const auto all = tune("a", "1GiB");
  ASSERT_FALSE(all["candidates"].empty()) << all.dump();
  const auto& c0 = all["candidates"][0];
  const int64_t everything = c0["max_in_cpu"].get<int64_t>();
  EXPECT_GT(everything, 0) << c0.dump();
  // (The parameters' swap file is all that is on NVMe.)
  const int64_t params_on_disk = c0["estimate_bytes"]["nvme"].get<int64_t>();
  // A budget that holds part of the states: a block's fp32 master and
  // moments (12 bytes each of about 197K elements) less.
  const int64_t host = c0["estimate_bytes"]["host"].get<int64_t>() - 2000000;
  const auto some = tune("b", std::to_string(host));
  bool trained = false;
  for (const auto& c : some["candidates"]) {
    EXPECT_LT(c["max_in_cpu"].get<int64_t>(), everything) << c.dump();
    EXPECT_GT(c["estimate_bytes"]["nvme"].get<int64_t>(), params_on_disk) << c.dump();
    EXPECT_LE(c["estimate_bytes"]["host"].get<int64_t>(), host) << c.dump();
    trained = trained || c["status"] == "trained";
  }
  EXPECT_TRUE(trained) << some.dump();
  const auto config = nlohmann::json::parse(read_text(dir.file("b.json")));
  const auto& oo = config["zero_optimization"]["offload_optimizer"];
  ASSERT_TRUE(oo.contains("max_in_cpu")) << config.dump();
  EXPECT_GT(oo["max_in_cpu"].get<int64_t>(), 0) << config.dump();
  EXPECT_LT(oo["max_in_cpu"].get<int64_t>(), everything) << config.dump();
  EXPECT_TRUE(entries(tmp.path()).empty()) << "left behind in TMPDIR";
  EXPECT_TRUE(entries(nvme.path()).empty()) << "swap files left under --nvme-path";
}

// NOTE [device gradients]: with the optimizer offloaded, the gradient
// partition on the device is a candidate (--gradients host,device), beaten
// by host gradients wherever those fit, and proposed where only it does: a
// device between it and no offload, a host between it and host gradients.
TEST(Tune, GradientsOnTheDeviceWhereHostGradientsDoNotFit) {
  TempDir dir, tmp;
  auto tune = [&](const std::string& tag, const std::string& device, const std::string& host) {
    const std::string cmd = "TMPDIR=" + tmp.path() + " OMP_NUM_THREADS=1 " + kBin +
                            "zero tune --model mingpt:2,128,64,64 --ranks 2 --checkpointing none --micro-batches 2 "
                            "--bucket-sizes 1e6 --steps 2 --stages 2 --offload none,cpu --gradients host,device "
                            "--device-memory " + device + " --host-memory " + host + " --out " + dir.file(tag + ".json") +
                            " --json " + dir.file("r" + tag + ".json") + " > " + dir.file(tag + ".log") + " 2>&1";
    EXPECT_EQ(sh(cmd), 0) << read_text(dir.file(tag + ".log"));
    return nlohmann::json::parse(read_text(dir.file("r" + tag + ".json")));
  };
  const auto first = tune("a", "1GiB", "1GiB");
  int64_t none_device = -1, on_device[2] = {-1, -1}, on_host[2] = {-1, -1};  // [0] device bytes, [1] host bytes
  for (const auto& c : first["candidates"]) {
    const int64_t d = c["estimate_bytes"]["device"].get<int64_t>(), h = c["estimate_bytes"]["host"].get<int64_t>();
    if (c["offload_optimizer"] == "none") none_device = d;
    else if (c["gradients_on_device"].get<bool>()) on_device[0] = d, on_device[1] = h;
    else on_host[0] = d, on_host[1] = h;
  }
  ASSERT_GT(on_device[0], on_host[0]) << first.dump();
  ASSERT_LT(on_device[1], on_host[1]) << first.dump();
  ASSERT_LT(on_device[0], none_device) << first.dump();
  const std::string device = std::to_string((on_device[0] + none_device) / 2);
  // A device that needs the offload and a generous host: host gradients
  // beat the device's (no more work), which is not run, and the config
  // written keeps DeepSpeed's layout.
  const auto roomy = tune("c", device, "1GiB");
  bool host_trained = false;
  for (const auto& c : roomy["candidates"]) {
    if (c["offload_optimizer"] != "cpu") continue;
    if (c["gradients_on_device"].get<bool>()) {
      EXPECT_EQ(c["status"], "dominated") << c.dump();
    } else {
      host_trained = host_trained || c["status"] == "trained";
    }
  }
  EXPECT_TRUE(host_trained) << roomy.dump();
  const auto roomy_config = nlohmann::json::parse(read_text(dir.file("c.json")));
  EXPECT_EQ(roomy_config["zero_optimization"]["offload_optimizer"]["device"], "cpu") << roomy_config.dump();
  EXPECT_FALSE(roomy_config["zero_optimization"]["offload_optimizer"].contains("gradients_on_device"))
      << roomy_config.dump();
  // And a host between the two: only the device's gradients fit.
  const auto second = tune("b", device, std::to_string((on_device[1] + on_host[1]) / 2));
  bool trained = false;
  for (const auto& c : second["candidates"]) {
    if (c["fits_estimate"].get<bool>()) {
      EXPECT_TRUE(c["gradients_on_device"].get<bool>()) << c.dump();
    }
    trained = trained || (c["status"] == "trained" && c["gradients_on_device"].get<bool>());
  }
  EXPECT_TRUE(trained) << second.dump();
  const auto config = nlohmann::json::parse(read_text(dir.file("b.json")));
  EXPECT_EQ(config["zero_optimization"]["offload_optimizer"]["gradients_on_device"], true) << config.dump();
  EXPECT_NE(read_text(dir.file("b.log")).find("gradients on the device"), std::string::npos) << read_text(dir.file("b.log"));
  EXPECT_EQ(sh(kBin + "zero config check " + dir.file("b.json") + " --world-size 2 > " + dir.file("check") + " 2>&1"), 0)
      << read_text(dir.file("check"));
  EXPECT_TRUE(entries(tmp.path()).empty()) << "left behind in TMPDIR";
}

// zero tune of minGPT 2 x 128 at stage 2, offloaded or not, with
// --allow-low-precision-states (and `extra`), its scratch in `tmp`: run at
// the budgets given, the config to `dir`/<tag>.json, the report (returned)
// to r<tag>.json, the log to <tag>.log.
struct LowPrecisionTune {
  TempDir dir, tmp;
  std::string extra;
  nlohmann::json run(const std::string& tag, const std::string& device, const std::string& host) {
    const std::string cmd = "TMPDIR=" + tmp.path() + " OMP_NUM_THREADS=1 " + kBin +
                            "zero tune --model mingpt:2,128,64,64 --ranks 2 --checkpointing none --micro-batches 2 "
                            "--steps 2 --stages 2 --offload none,cpu --gradients host --allow-low-precision-states " + extra +
                            " --device-memory " + device + " --host-memory " + host + " --out " + config_path(tag) +
                            " --json " + dir.file("r" + tag + ".json") + " > " + log_path(tag) + " 2>&1";
    EXPECT_EQ(sh(cmd), 0) << read_text(log_path(tag));
    return nlohmann::json::parse(read_text(dir.file("r" + tag + ".json")));
  }
  std::string config_path(const std::string& tag) { return dir.file(tag + ".json"); }
  std::string log_path(const std::string& tag) { return dir.file(tag + ".log"); }
  // The config proposed at `tag` loads, and the scratch is gone.
  void expect_config_loads(const std::string& tag) {
    EXPECT_EQ(sh(kBin + "zero config check " + config_path(tag) + " --world-size 2 > " + dir.file("check") + " 2>&1"), 0)
        << read_text(dir.file("check"));
    EXPECT_TRUE(entries(tmp.path()).empty()) << "left behind in TMPDIR";
  }
};

// --allow-low-precision-states: 8-bit Adam states are candidates too, beaten
// by their fp32 twins wherever those fit (the first run, generous budgets:
// none is run), and proposed where only they fit (the second: a device that
// needs offload, a host budget between the two offloaded estimates): the
// config written has optim_bits 8 and loads.
TEST(Tune, EightBitStatesOnlyWhereFp32StatesDoNotFit) {
  LowPrecisionTune tune;
  const auto first = tune.run("a", "1GiB", "1GiB");
  std::map<std::pair<std::string, int>, nlohmann::json> est;  // (offload, bits) -> estimate
  for (const auto& c : first["candidates"]) {
    est[{c["offload_optimizer"].get<std::string>(), c["optim_bits"].get<int>()}] = c["estimate_bytes"];
    if (c["optim_bits"] == 8) {
      EXPECT_NE(c["status"], "trained") << c.dump();
    }
  }
  ASSERT_EQ(est.size(), 4u) << first.dump();
  EXPECT_FALSE(nlohmann::json::parse(read_text(tune.config_path("a")))["optimizer"]["params"].contains("optim_bits"));
  auto at = [&](const char* off, int bits, const char* tier) { return est[{off, bits}][tier].get<int64_t>(); };
  const int64_t device = (std::max(at("cpu", 32, "device"), at("cpu", 8, "device")) +
                          std::min(at("none", 32, "device"), at("none", 8, "device"))) / 2;
  const int64_t host = (at("cpu", 32, "host") + at("cpu", 8, "host")) / 2;
  ASSERT_LT(at("cpu", 8, "host"), host);
  ASSERT_LT(std::max(at("cpu", 32, "device"), at("cpu", 8, "device")), device);
  tune.run("b", std::to_string(device), std::to_string(host));
  const auto config = nlohmann::json::parse(read_text(tune.config_path("b")));
  EXPECT_EQ(config["optimizer"]["params"]["optim_bits"], 8) << config.dump();
  EXPECT_EQ(config["zero_optimization"]["offload_optimizer"]["device"], "cpu") << config.dump();
  EXPECT_NE(read_text(tune.log_path("b")).find("8-bit Adam states"), std::string::npos) << read_text(tune.log_path("b"));
  tune.expect_config_loads("b");
}

// Budgets under which, offloaded, only the candidates `kind` picks fit: the
// device between offloaded and not, the host between the largest estimate
// of `kind`'s candidates and the smallest of those with more host bytes.
std::pair<int64_t, int64_t> budgets_for(const nlohmann::json& report,
                                        const std::function<bool(const nlohmann::json&)>& kind) {
  int64_t host_kind = 0, host_more = int64_t{1} << 40, device_offloaded = 0, device_not = int64_t{1} << 40;
  for (const auto& c : report["candidates"]) {
    const int64_t d = c["estimate_bytes"]["device"].get<int64_t>(), h = c["estimate_bytes"]["host"].get<int64_t>();
    if (c["offload_optimizer"] == "cpu") {
      if (kind(c)) host_kind = std::max(host_kind, h);
      device_offloaded = std::max(device_offloaded, d);
    } else {
      device_not = std::min(device_not, d);
    }
  }
  int others_within = 0;  // offloaded candidates of other kinds that would fit too
  for (const auto& c : report["candidates"]) {
    const int64_t h = c["estimate_bytes"]["host"].get<int64_t>();
    if (c["offload_optimizer"] != "cpu" || kind(c)) continue;
    if (h > host_kind) host_more = std::min(host_more, h);
    else ++others_within;
  }
  EXPECT_GT(host_kind, 0) << report.dump();
  EXPECT_EQ(others_within, 0) << "another kind needs no more host memory: " << report.dump();
  EXPECT_LT(device_offloaded, device_not);
  return {(device_offloaded + device_not) / 2, (host_kind + host_more) / 2};
}

// In bf16, --allow-low-precision-states also tries a bf16 master and bf16
// states (NOTE [16-bit master]), whose offloaded host bytes are fewer than
// every fp32 master's (2 + 4 + 2 a parameter against 8-bit states' 4 + 2.03
// + 4): with a host budget between those, only the 16-bit masters fit (bf16
// states, and 8-bit ones under a bf16 master, the next test's); both are
// run, and the faster is proposed with DeepSpeed's keys and loads.
TEST(Tune, Bf16MasterAndStatesWhereOnlyTheyFit) {
  LowPrecisionTune tune;
  tune.extra = "--precision bf16";
  const auto first = tune.run("a", "1GiB", "1GiB");
  const auto [device, host] = budgets_for(first, [](const nlohmann::json& c) { return c["master"] != "fp32"; });
  const auto second = tune.run("b", std::to_string(device), std::to_string(host));
  bool trained = false;
  for (const auto& c : second["candidates"]) {
    if (c["master"] == "fp32" && c["offload_optimizer"] == "cpu") EXPECT_FALSE(c["fits_estimate"].get<bool>()) << c.dump();
    trained = trained || (c["optim_bits"] == 16 && c["status"] == "trained");
  }
  EXPECT_TRUE(trained) << second.dump();
  const auto config = nlohmann::json::parse(read_text(tune.config_path("b")));
  EXPECT_EQ(config["bf16"]["bf16_master_weights_and_grads"], true) << config.dump();
  EXPECT_NE(read_text(tune.log_path("b")).find("bf16 master and states"), std::string::npos)
      << read_text(tune.log_path("b"));
  tune.expect_config_loads("b");
}

// A bf16 master with 8-bit moments (2 + 2.03 + 2 bytes a parameter on the
// host, the fewest): with a host budget under every other kind's, only it
// fits and is proposed; the config has bf16_master_weights_and_grads and
// optim_bits 8 (no bf16 states) and loads.
TEST(Tune, Bf16MasterAndEightBitStatesWhereOnlyTheyFit) {
  LowPrecisionTune tune;
  tune.extra = "--precision bf16";
  const auto first = tune.run("a", "1GiB", "1GiB");
  int kinds = 0;
  for (const auto& c : first["candidates"]) kinds += c["optim_bits"] == 8 && c["master"] == "bf16";
  ASSERT_GT(kinds, 0) << first.dump();
  const auto [device, host] = budgets_for(
      first, [](const nlohmann::json& c) { return c["optim_bits"] == 8 && c["master"] == "bf16"; });
  tune.run("b", std::to_string(device), std::to_string(host));
  const auto config = nlohmann::json::parse(read_text(tune.config_path("b")));
  EXPECT_EQ(config["bf16"]["bf16_master_weights_and_grads"], true) << config.dump();
  EXPECT_FALSE(config["bf16"].contains("bf16_optimizer_states")) << config.dump();
  EXPECT_EQ(config["optimizer"]["params"]["optim_bits"], 8) << config.dump();
  EXPECT_NE(read_text(tune.log_path("b")).find("16-bit master and 8-bit Adam states"), std::string::npos)
      << read_text(tune.log_path("b"));
  tune.expect_config_loads("b");
}

// NOTE [partial offload]: stage 3 + optimizer cpu at each --ratios value.
// With a device budget between stage 3's estimate without offload and with
// a quarter offloaded, only the offloaded candidates fit; the partial one
// beats the whole offload by construction (less moved and stepped on the
// CPU), is run and proposed with its ratio, and its config loads.
TEST(Tune, APartialOffloadWhereTheDeviceHoldsPartOfTheStates) {
  TempDir dir, tmp;
  // The layers' matrices partitioned (groups of a layer each: a group lives
  // on one tier whole); the base config's key is kept.
  std::ofstream(dir.file("base.json"))
      << R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0,
             "zero_optimization": {"stage3_param_persistence_threshold": 1000}})";
  auto tune = [&](const std::string& tag, const std::string& device) {
    const std::string cmd = "TMPDIR=" + tmp.path() + " OMP_NUM_THREADS=1 " + kBin + "zero tune --config " +
                            dir.file("base.json") +
                            " --model mingpt:2,128,64,64 --ranks 2 --checkpointing none --micro-batches 2 "
                            "--steps 2 --stages 3 --offload none,cpu --gradients host --ratios 0.25,1 --host-memory 1GiB "
                            "--device-memory " +
                            device + " --out " + dir.file(tag + ".json") + " --json " + dir.file("r" + tag + ".json") +
                            " > " + dir.file(tag + ".log") + " 2>&1";
    EXPECT_EQ(sh(cmd), 0) << read_text(dir.file(tag + ".log"));
    return nlohmann::json::parse(read_text(dir.file("r" + tag + ".json")));
  };
  const auto first = tune("a", "1GiB");
  int64_t none = int64_t{1} << 40, partial = 0, whole = 0;
  for (const auto& c : first["candidates"]) {
    const int64_t d = c["estimate_bytes"]["device"].get<int64_t>();
    if (c["offload_optimizer"] == "none") none = std::min(none, d);
    else if (c["offload_ratio"].get<double>() < 1) partial = std::max(partial, d);
    else whole = std::max(whole, d);
  }
  ASSERT_GT(partial, whole) << first.dump();
  ASSERT_LT(partial, none) << first.dump();
  const auto second = tune("b", std::to_string((partial + none) / 2));
  bool partial_trained = false;
  for (const auto& c : second["candidates"]) {
    if (c["offload_optimizer"] == "none") EXPECT_FALSE(c["fits_estimate"].get<bool>()) << c.dump();
    if (c["offload_ratio"].get<double>() == 1 && c["offload_optimizer"] == "cpu") EXPECT_NE(c["status"], "trained") << c.dump();
    partial_trained = partial_trained || (c["offload_ratio"].get<double>() < 1 && c["status"] == "trained");
  }
  EXPECT_TRUE(partial_trained) << second.dump();
  const auto config = nlohmann::json::parse(read_text(dir.file("b.json")));
  EXPECT_EQ(config["zero_optimization"]["offload_optimizer"]["ratio"], 0.25) << config.dump();
  EXPECT_NE(read_text(dir.file("b.log")).find("offload ratio 0.25"), std::string::npos) << read_text(dir.file("b.log"));
  EXPECT_EQ(sh(kBin + "zero config check " + dir.file("b.json") + " --world-size 2 > " + dir.file("check") + " 2>&1"), 0)
      << read_text(dir.file("check"));
  EXPECT_TRUE(entries(tmp.path()).empty()) << "left behind in TMPDIR";
}

// On 2 emulated nodes of 2 ranks (issue 38): the winner at stage 3 is run
// with each key of more than one node; each run's bytes across nodes are
// its own counters', and with a slow enough network (100 KB/s a rank: the
// bytes' seconds far beyond any step here, however loaded the machine) the
// fewest bytes across the busiest node win. The layers are gathered
// (persistence threshold 0), so hpZ and qwZ change what crosses.
TEST(Tune, OnTwoNodesTheWinnerIsTriedWithEachKeyAndTheBytesAcrossRankIt) {
  TempDir dir, tmp;
  std::ofstream(dir.file("base.json"))
      << R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
             "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "mics_shard_size": 4}})";
  const std::string cmd = "TMPDIR=" + tmp.path() + " OMP_NUM_THREADS=1 " + kBin +
                          "zero tune --model mingpt:2,128,64,64 --config " + dir.file("base.json") +
                          " --ranks 2 --nodes 2 --device cpu --device-memory 24MiB --host-memory 1GiB --checkpointing none"
                          " --micro-batches 2 --steps 2 --gradients host --stages 3 --offload none --bucket-sizes 26000"
                          " --allow-quantized-communication --inter-node-bandwidth 100KB --out " +
                          dir.file("ds_config.json") + " --json " + dir.file("report.json") + " > " + dir.file("log") +
                          " 2>&1";
  ASSERT_EQ(sh(cmd), 0) << read_text(dir.file("log"));
  const std::string log = read_text(dir.file("log"));
  EXPECT_NE(log.find("on 2 nodes x 2 ranks (emulated here"), std::string::npos) << log;
  EXPECT_NE(log.find("the base config's mics_shard_size are the tuner's to choose"), std::string::npos) << log;
  EXPECT_TRUE(entries(tmp.path()).empty()) << "left behind in TMPDIR";
  const auto report = nlohmann::json::parse(read_text(dir.file("report.json")));
  EXPECT_EQ(report["nodes"], 2);
  EXPECT_EQ(report["ranks"], 4);
  // keys -> the measured row: none, MiCS, hpZ, MiCS + qwZ, hpZ + qwZ, hpZ + qwZ + qgZ.
  std::map<std::string, nlohmann::json> by_keys;
  for (const auto& c : report["candidates"]) {
    ASSERT_EQ(c["status"], "trained") << c.dump();
    const std::string k = std::to_string(c["mics_shard_size"].get<int>()) + "/" +
                          std::to_string(c["zero_hpz_partition_size"].get<int>()) + "/" +
                          (c["zero_quantized_weights"].get<bool>() ? "w" : "-") +
                          (c["zero_quantized_gradients"].get<bool>() ? "g" : "-");
    EXPECT_TRUE(by_keys.emplace(k, c).second) << "twice: " << k;
    EXPECT_LE(c["measured"]["peak_bytes"]["device"].get<int64_t>(), 24 << 20) << c.dump();
    const auto& b = c["measured"]["bytes_per_step"];
    EXPECT_NEAR(c["measured"]["network_s"].get<double>(), b["busiest_node_across_nodes"].get<double>() / (2 * 100e3),
                1e-9)
        << c.dump();
  }
  ASSERT_EQ(by_keys.size(), 6u) << report.dump(1);
  auto across = [&](const std::string& k) {
    return by_keys.at(k)["measured"]["bytes_per_step"]["across_nodes"].get<double>();
  };
  const double plain = across("0/0/--");
  EXPECT_GT(plain, 0);
  EXPECT_LT(across("2/0/--"), 0.5 * plain);         // MiCS: only the replicas' sum crosses
  EXPECT_LT(across("0/2/--"), 0.9 * plain);         // hpZ: backward's gathers stay in the node
  EXPECT_LT(across("0/2/w-"), 0.9 * across("0/2/--"));  // qwZ: forward's gathers in int8
  EXPECT_LT(across("0/2/wg"), 0.5 * across("0/2/w-"));  // qgZ: the gradients in int8, across once
  EXPECT_EQ(across("2/0/w-"), across("2/0/--"));    // MiCS's gathers never cross: qwZ saves within
  // The winner sends the fewest bytes across its busiest node, and is written.
  const auto& fewest = *std::min_element(report["candidates"].begin(), report["candidates"].end(), [](const nlohmann::json& a, const nlohmann::json& b) {
    return a["measured"]["bytes_per_step"]["busiest_node_across_nodes"].get<double>() <
           b["measured"]["bytes_per_step"]["busiest_node_across_nodes"].get<double>();
  });
  EXPECT_EQ(report["best"]["run_order"], fewest["run_order"]);
  // Ranked by the measured step plus the bytes' seconds.
  const auto& fm = fewest["measured"];
  EXPECT_DOUBLE_EQ(report["best"]["tokens_per_s"].get<double>(),
                   fm["tokens_per_step"].get<double>() / (fm["step_time_s"].get<double>() + fm["network_s"].get<double>()));
  EXPECT_GT(fm["bytes_per_step"]["within_node"].get<double>(), 0);
  const auto config = nlohmann::json::parse(read_text(dir.file("ds_config.json")));
  const auto& z = config["zero_optimization"];
  EXPECT_EQ(z.value("mics_shard_size", 0), fewest["mics_shard_size"].get<int>()) << z.dump();  // the base's 4 gone
  EXPECT_EQ(z.value("zero_hpz_partition_size", 0), fewest["zero_hpz_partition_size"].get<int>()) << z.dump();
  EXPECT_EQ(z.value("zero_quantized_weights", false), fewest["zero_quantized_weights"].get<bool>()) << z.dump();
  EXPECT_EQ(z.value("zero_quantized_gradients", false), fewest["zero_quantized_gradients"].get<bool>()) << z.dump();
  EXPECT_EQ(sh(kBin + "zero config check " + dir.file("ds_config.json") + " --world-size 4 > " + dir.file("check") +
               " 2>&1"),
            0)
      << read_text(dir.file("check"));

  // On one node the base config's keys stay, and the report says they ran.
  std::ofstream(dir.file("one.json"))
      << R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
             "zero_optimization": {"stage": 3, "mics_shard_size": 2}})";
  ASSERT_EQ(sh("TMPDIR=" + tmp.path() + " OMP_NUM_THREADS=1 " + kBin + "zero tune --model mingpt:2,128,64,64 --config " +
               dir.file("one.json") + " --ranks 2 --device cpu --device-memory 24MiB --host-memory 1GiB"
               " --checkpointing none --micro-batches 2 --steps 2 --stages 3 --offload none --bucket-sizes 26000 --out " +
               dir.file("one.config.json") + " --json " + dir.file("one.report.json") + " > " + dir.file("one.log") +
               " 2>&1"),
            0)
      << read_text(dir.file("one.log"));
  const auto one = nlohmann::json::parse(read_text(dir.file("one.report.json")));
  ASSERT_EQ(one["candidates"].size(), 1u);
  EXPECT_EQ(one["candidates"][0]["mics_shard_size"], 2);
  EXPECT_EQ(nlohmann::json::parse(read_text(dir.file("one.config.json")))["zero_optimization"]["mics_shard_size"], 2);
}

TEST(Tune, UsageErrorsNameTheOption) {
  TempDir dir;
  const std::string t = kBin + "zero tune ";
  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"--device-memory 1GiB --host-memory 1GiB", "--model mingpt:L,C[,V,T] is required"},
           {"--model mingpt:2,64 --host-memory 1GiB", "--device-memory and --host-memory are required"},
           {"--model mingpt:2,64 --device-memory 1GiB --host-memory 1GiB --offload nvme", "--offload nvme needs --nvme-path"},
           {"--model mingpt:2,64 --device-memory 1GiB --host-memory 1GiB --offload disk", "--offload: expected none, cpu or nvme"},
           {"--model mingpt:2,64 --device-memory 1GiB --host-memory 1GiB --stages 4", "--stages: expected stages 0 to 3"},
           {"--model mingpt:2,64 --device-memory 1GiB --host-memory 1GiB --n_head 3", "--n_head 3 must divide the width 64"},
           {"--model mingpt:2,64 --device-memory 1GiB --host-memory 1GiB --micro-batches 2,,4", "--micro-batches: expected"},
           {"--model mingpt:2,64 --device-memory 1GiB --host-memory 1GiB --ranks 2 --ranks 2", "--ranks given twice"},
           {"--model mingpt:2,64 --device-memory 1GiB --host-memory 1GiB --out /no/such/dir/c.json",
            "--out /no/such/dir/c.json: the folder /no/such/dir does not exist"},
           {"--model mingpt:2,64 --device-memory 1GiB --host-memory 1GiB --run-timeout -1", "--run-timeout: expected seconds"},
           {"--model mingpt:2,64 --device-memory 1GiB --host-memory 1GiB --ratios 0.5,1.5", "--ratios: expected shares in (0, 1]"},
           {"--model mingpt:2,64 --device-memory 1GiB --host-memory 1GiB --gradients gpu", "--gradients: expected host, device or both; got \"gpu\""},
           {"--model mingpt:2,64 --devise-memory 1GiB", "did you mean --device-memory?"},
           {"--model mingpt:2,64 --device-memory 1GiB --host-memory 1GiB --inter-node-bandwidth 25GB",
            "--inter-node-bandwidth goes with --nodes M (M > 1)"},
           {"--model mingpt:2,64 --device-memory 1GiB --host-memory 1GiB --nodes 2 --inter-node-bandwidth fast",
            "--inter-node-bandwidth: expected bytes a second"},
           {"--model mingpt:2,64 --device-memory 1GiB --host-memory 1GiB --allow-quantized-communication",
            "--allow-quantized-communication goes with --nodes M (M > 1)"},
           {"--model mingpt:2,64 --device-memory 1GiB --host-memory 1GiB --nodes 2 --device cuda",
            "tune them on the CPU: --device cpu"}}) {
    EXPECT_EQ(sh(t + args + " > " + dir.file("u.log") + " 2>&1"), 2) << args;
    EXPECT_NE(read_text(dir.file("u.log")).find(message), std::string::npos) << args << "\n" << read_text(dir.file("u.log"));
  }
  // Budgets nothing fits: said, with what would help, and no config.
  EXPECT_EQ(sh(t + "--model mingpt:2,64,64,32 --device-memory 64KiB --host-memory 1GiB --out " + dir.file("c.json") +
               " > " + dir.file("n.log") + " 2>&1"),
            1);
  EXPECT_NE(read_text(dir.file("n.log")).find("nothing fits"), std::string::npos) << read_text(dir.file("n.log"));
  EXPECT_FALSE(std::ifstream(dir.file("c.json")).good());
}

}  // namespace
}  // namespace zero::test
