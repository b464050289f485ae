// Hardening, round 5 (issue 51): every output under the one rule (NOTE
// [outputs and inputs]), the environment's (ZERO_TRACE, ZERO_RUN_REPORT)
// included; streams (/dev/stdout) written where they stand; bind mounts
// compared by device and inode; exports that cannot fail after training for
// a mount; `zero trace merge` reading only traces; --help on every command.
// The probe is a table: each output of each program against each kind of
// input, refused before any work and naming both, the input's bytes
// unchanged. The binaries run as processes, as a user runs them.
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tiny_llama.h"
#include "tool_test_util.h"

namespace zero::test {
namespace {

// Whether a private mount namespace can be had here (root, or user
// namespaces): the bind-mount cases run inside one, or are skipped.
bool mount_namespaces() {
  TempDir probe;
  return run("unshare -m --propagation private mount -t tmpfs -o size=4k tmpfs " + probe.path()).code == 0;
}

// Every file under `dir` with its bytes, to show nothing a user gave changed.
std::map<std::string, std::string> snapshot(const std::string& dir) {
  std::map<std::string, std::string> out;
  const Outcome r = run("find " + dir + " -type f");
  EXPECT_EQ(r.code, 0) << r.out;
  std::istringstream names(r.out);
  for (std::string name; std::getline(names, name);) out[name] = read_text(name);
  EXPECT_FALSE(out.empty()) << dir;
  return out;
}

// A tiny Llama exported (DIR/model), minGPT's config and a checkpoint of one
// step (DIR/ck), for the cases that need them.
struct Made {
  TempDir dir;
  Made() {
    make_llama(dir, 300);
    write(dir, "mingpt.json", read_text(kConfigs + "mingpt_zero2.json"));
    const Outcome r = run(kBin + "mingpt --config " + dir.file("mingpt.json") + kTiny +
                "--limit_train_batches 4 --stop_after_steps 1 --save_dir " + dir.file("ck"),
            300);
    EXPECT_EQ(r.code, 0) << r.out;
  }
};

// ---- 1. the environment's outputs and every other output, as a table --------

TEST(Round5, NoOutputOfAnyProgramOrVariableLandsOnWhatTheRunReads) {
  Made made;
  const TempDir& d = made.dir;
  const std::string m = d.file("model"), ck = d.file("ck");
  const std::string mingpt = kBin + "mingpt --config " + d.file("mingpt.json") + kTiny + "--limit_train_batches 2 ";
  const std::string tag = read_text(ck + "/latest").substr(0, read_text(ck + "/latest").find('\n'));
  struct Case {
    std::string env, command, message;
  };
  const std::vector<Case> cases = {
      // ZERO_TRACE over each kind of input.
      {"ZERO_TRACE=" + d.file("mingpt.json"), mingpt, "ZERO_TRACE's file for rank 0 " + d.file("mingpt.json") +
                                                          ": this command reads that file (--config"},
      {"ZERO_TRACE=" + d.file("tok.bin"), llama_train(d, m, ""), "this command reads that file (--data"},
      {"ZERO_TRACE=" + m + "/model.safetensors", llama_train(d, m, ""), "this command reads that file (--model's weights"},
      {"ZERO_TRACE=" + m + "/config.json", llama_train(d, m, ""), "this command reads that file (--model's config.json"},
      {"ZERO_TRACE=" + m + "/model.safetensors", mingpt + "--load_weights " + m + "/model.safetensors",
       "this command reads that file (--load_weights"},
      {"ZERO_TRACE=" + ck + "/latest", mingpt + "--resume " + ck, "this command reads that file (--resume"},
      {"ZERO_TRACE=" + ck + "/" + tag + "/rank0.pt", mingpt + "--resume " + ck, "which this command reads whole"},
      {"ZERO_TRACE=" + d.file("s.json"), mingpt + "--summary-json " + d.file("s.json"), "is also ZERO_TRACE's file for rank 0"},
      {"ZERO_TRACE=" + d.file("out/config.json"), llama_train(d, m, "--save_hf " + d.file("out")),
       "which this command writes as a whole"},
      {"ZERO_TRACE=" + d.file("l.safetensors"),
       kBin + "llama logits --model " + m + " --tokens 1,2 --out " + d.file("l.safetensors"),
       "is also ZERO_TRACE's file for rank 0"},
      // ZERO_RUN_REPORT: rank R writes PREFIX.rankR.
      {"ZERO_RUN_REPORT=" + ck + "/" + tag + "/x", mingpt + "--resume " + ck, "which this command reads whole"},
      {"ZERO_RUN_REPORT=" + ck + "/global_step9/r", mingpt + "--save_dir " + ck,
       "under the name global_step9, which a save there replaces"},
      {"ZERO_RUN_REPORT=" + d.file("s") + " ZERO_TRACE=" + d.file("s.rank0"), mingpt, "is also ZERO_RUN_REPORT's file"},
      // The programs' own outputs at one place.
      {"", mingpt + "--summary-json " + d.file("both") + " --save_dir " + d.file("both"), "is also --save_dir"},
      // A program's folder argument: its files are inputs (zero tune --out).
      {"", kBin + "zero tune --device-memory 1GiB --host-memory 1GiB --config " + d.file("ds.json") + " --out " + m +
               "/model.safetensors -- " + kBin + "llama train --model " + m + " --config {config} --data " +
               d.file("tok.bin") + " --block_size 8 --steps 1",
       "lies in the program's argument (a folder) " + m},
  };
  const auto before = snapshot(d.path());
  for (const auto& c : cases) {
    if (c.message.empty()) continue;
    const Outcome r = run("env OMP_NUM_THREADS=1 " + c.env + " " + c.command);
    EXPECT_EQ(r.code, 2) << c.env << " " << c.command << "\n" << r.out;
    EXPECT_TRUE(has(r.out, c.message)) << c.env << " " << c.command << "\n" << r.out;
    EXPECT_FALSE(has(r.out, "step 1")) << "refused only after work: " << c.command;
  }
  EXPECT_EQ(snapshot(d.path()), before) << "a refused run changed a file";
}

// ---- 2. streams: written where they stand, the link never replaced ----------

TEST(Round5, DevStdoutIsTheStreamEvenWhenItIsAFile) {
  Made made;
  const TempDir& d = made.dir;
  TempDir out;
  const std::string captured = out.file("captured.txt");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {kBin + "zero estimate --params 1e9 --json /dev/stdout", "\"configurations\""},
      {kBin + "mingpt --config " + d.file("mingpt.json") + kTiny + "--limit_train_batches 2 --summary-json /dev/stdout",
       "\"final_loss\""},
      {"env ZERO_TRACE=/dev/stdout " + kBin + "mingpt --config " + d.file("mingpt.json") + kTiny +
           "--limit_train_batches 2",
       "\"traceEvents\""},
  };
  struct stat st {};
  const bool link = ::lstat("/dev/stdout", &st) == 0 && S_ISLNK(st.st_mode);
  for (const auto& [command, expect] : cases) {
    write(out, "captured.txt", "a line before\n");
    const Outcome r = run(command + " >> " + captured, 300);
    EXPECT_EQ(r.code, 0) << command << "\n" << r.out;
    const std::string text = read_text(captured);
    EXPECT_EQ(text.rfind("a line before\n", 0), 0u) << command << ": what the stream held is kept";
    EXPECT_TRUE(has(text, expect)) << command << "\n" << text.substr(0, 400);
    if (link) {
      ASSERT_EQ(::lstat("/dev/stdout", &st), 0);
      EXPECT_TRUE(S_ISLNK(st.st_mode)) << command << ": /dev/stdout was replaced";
    }
    // One whole document, once: it parses from its first brace.
    const auto brace = text.find(expect == "\"traceEvents\"" ? "{\"displayTimeUnit\"" : "{\n");
    ASSERT_NE(brace, std::string::npos) << text.substr(0, 300);
    std::istringstream doc(text.substr(brace));
    nlohmann::json j;
    EXPECT_NO_THROW(doc >> j) << command << "\n" << text.substr(brace, 300);
    EXPECT_EQ(text.find(expect, text.find(expect) + 1), std::string::npos) << command << ": written twice";
  }
  // A variable that names a file per rank is no stream.
  const Outcome report = run("env ZERO_RUN_REPORT=/dev/stdout " + kBin + "mingpt --config " + d.file("mingpt.json") + kTiny);
  EXPECT_EQ(report.code, 2) << report.out;
  EXPECT_TRUE(has(report.out, "ZERO_RUN_REPORT=/dev/stdout: a stream; the variable names a file name prefix")) << report.out;
  // Other places under /dev and /proc are refused before any work.
  for (const std::string& path : {std::string("/dev/null"), std::string("/dev/zero-out.json"), std::string("/proc/self/comm")}) {
    const Outcome r = run(kBin + "zero estimate --params 1e9 --json " + path);
    EXPECT_EQ(r.code, 2) << path << "\n" << r.out;
    EXPECT_TRUE(has(r.out, "is under /") || has(r.out, "is not a regular file")) << path << "\n" << r.out;
  }
  EXPECT_FALSE(run("test -e /dev/zero-out.json").code == 0);
}

// ---- 3. bind mounts: the same folder by device and inode; exports that do
// not fail after training for a mount --------------------------------------

TEST(Round5, ABindMountedFolderIsTheFolderItShowsAndTakesAnExport) {
  if (!mount_namespaces()) GTEST_SKIP() << "no private mount namespace here (unshare -m, mount refused): bind mounts not tried";
  Made made;
  const TempDir& d = made.dir;
  TempDir t;
  ::mkdir(t.file("real").c_str(), 0755);
  ::mkdir(t.file("view").c_str(), 0755);
  const std::string ck = d.file("ck");
  // The resumed checkpoint through a bind mount: its rank file is an input.
  const std::string tag = read_text(ck + "/latest").substr(0, read_text(ck + "/latest").find('\n'));
  const auto before = snapshot(ck);
  Outcome r = run("unshare -m --propagation private sh -c 'mount --bind " + ck + " " + t.file("view") + " && " + kBin +
                      "mingpt --config " + d.file("mingpt.json") + kTiny + "--limit_train_batches 2 --resume " + ck +
                      " --summary-json " + t.file("view/" + tag + "/rank0.pt") + "'",
                  300);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "which this command reads whole")) << r.out;
  EXPECT_EQ(snapshot(ck), before);
  // --save_hf into a bind mount (rename(2) across it says EXDEV): the
  // export lands, nothing is left beside it.
  r = run("unshare -m --propagation private sh -c 'mount --bind " + t.file("real") + " " + t.file("view") + " && " +
              llama_train(d, d.file("model"), "--save_hf " + t.file("view")) + "'",
          300);
  EXPECT_EQ(r.code, 0) << r.out;
  const auto files = entries(t.file("real"));
  EXPECT_TRUE(files.count("model.safetensors")) << r.out;
  EXPECT_TRUE(files.count("config.json")) << r.out;
  for (const auto& name : entries(t.path())) EXPECT_EQ(name.find(".zero-"), std::string::npos) << name;
  for (const auto& name : files) EXPECT_EQ(name.find(".zero-new"), std::string::npos) << name;
  // An export that the file system has no room for is refused before
  // training, not found short after it (a 16 KiB tmpfs).
  r = run("unshare -m --propagation private sh -c 'mount -t tmpfs -o size=16k tmpfs " + t.file("view") + " && " +
              llama_train(d, d.file("model"), "--save_hf " + t.file("view") + "/out") + "'",
          300);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "--save_hf " + t.file("view") + "/out: the export needs about")) << r.out;
  EXPECT_FALSE(has(r.out, "step 1")) << r.out;
}

// ---- 4. zero trace merge reads traces only -----------------------------------

TEST(Round5, TraceMergeReadsOnlyRegularFilesOfTraces) {
  TempDir t;
  const std::string good =
      R"({"otherData": {"rank": 0}, "traceEvents": [{"ph": "X", "name": "step", "pid": 0, "tid": 1, "ts": 5, "dur": 2}]})";
  write(t, "r0.json", good);
  write(t, "bad.json", R"({"otherData": {"rank": 1}, "traceEvents": [1, "x", null]})");
  write(t, "norank.json", R"({"traceEvents": [{"ph": "X", "name": "s", "pid": 0, "tid": 1, "ts": 5, "dur": 2}]})");
  write(t, "pid.json", R"({"otherData": {"rank": 1}, "traceEvents": [{"ph": "X", "name": "s", "pid": 4, "tid": 1, "ts": 5}]})");
  ::mkdir(t.file("folder").c_str(), 0755);
  ASSERT_EQ(::mkfifo(t.file("fifo").c_str(), 0644), 0);
  const std::string merge = kBin + "zero trace merge " + t.file("all.json") + " ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {t.file("fifo"), "IN " + t.file("fifo") + ": is not a regular file"},
      {t.file("folder"), "IN " + t.file("folder") + ": is a folder"},
      {t.file("r0.json") + " " + t.file("bad.json"), "event 0 of traceEvents is 1, not an event"},
      {t.file("norank.json") + " " + t.file("norank.json"), "names no rank (otherData.rank"},
      {t.file("pid.json"), "is of pid 4, a rank the file does not name"},
  };
  for (const auto& [ins, message] : cases) {
    const Outcome r = run(merge + ins, 120);
    EXPECT_EQ(r.code, 2) << ins << "\n" << r.out;
    EXPECT_TRUE(has(r.out, message)) << ins << "\n" << r.out;
  }
  EXPECT_FALSE(entries(t.path()).count("all.json"));
  const Outcome r = run(merge + t.file("r0.json"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "1 events of 1 rank(s)")) << r.out;
}

// ---- 5. --help on every command and subcommand; sizes said plainly ----------

TEST(Round5, EveryCommandAndSubcommandTakesHelp) {
  const std::vector<std::string> commands = {
      "zero", "zero config check", "zero config", "zero bench", "zero bench aio", "zero bench engine",
      "zero bench offload", "zero bench checkpoint-io", "zero nvme-tune", "zero checkpoint consolidate",
      "zero checkpoint export", "zero checkpoint info", "zero checkpoint verify", "zero trace merge", "zero launch",
      "zero tune", "zero estimate", "zero memcheck record", "zero memcheck check", "llama", "llama train",
      "llama logits", "mingpt", "moe train"};
  for (const auto& c : commands)
    for (const char* flag : {" --help", " -h"}) {
      const Outcome r = run(kBin + c + flag, 120);
      EXPECT_EQ(r.code, 0) << c << flag << "\n" << r.out;
      EXPECT_TRUE(has(r.out, "usage")) << c << flag << "\n" << r.out;
    }
  const Outcome big = run(kBin + "zero nvme-tune --path /tmp --size 100TB");
  EXPECT_EQ(big.code, 2) << big.out;
  EXPECT_TRUE(has(big.out, "free under --path /tmp")) << big.out;
  const Outcome unit = run(kBin + "zero nvme-tune --path /tmp --size 100tb");
  EXPECT_TRUE(has(unit.out, "with a unit of B, KB, MB, GB, TB")) << unit.out;
}

// ---- 6. errors that said too little now name the cause and the way --------

TEST(Round5, UnclearErrorsNameTheCauseAndTheWay) {
  TempDir t;
  for (const auto& [name, target, message] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"dangling", "gone.safetensors", "a dangling link (to gone.safetensors"},
           {"loop", "model.safetensors", "a loop of symbolic links"}}) {
    ::mkdir(t.file(name).c_str(), 0755);
    write(t, name + "/config.json", kLlamaConfig);
    ASSERT_EQ(::symlink(target.c_str(), t.file(name + "/model.safetensors").c_str()), 0);
    const Outcome r = run(kBin + "llama logits --model " + t.file(name) + " --tokens 1,2 --out " + t.file("l.safetensors"));
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_TRUE(has(r.out, message)) << r.out;
  }
  ::mkdir(t.file("folder").c_str(), 0755);
  Outcome r = run(kBin + "zero tune --device-memory 1GiB --host-memory 1GiB -- " + t.file("folder") + " --config {config}");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, t.file("folder") + ": is a folder; expected a program to run")) << r.out;
  r = run(kBin + "zero memcheck record --baseline " + t.file("b.json") + " -- " + t.file("folder"));
  EXPECT_TRUE(has(r.out, t.file("folder") + ": is a folder; expected a program to run")) << r.out;
  r = run(kBin + "zero tune --model mingpt:1,32 --device-memory 1GiB --host-memory 1GiB --nodes 2 --ranks 1 "
                 "--allow-quantized-communication --out " + t.file("o.json"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "none would be tried; give --ranks 2 or more")) << r.out;
  // consolidate --state of 8-bit states says why, not which names it has.
  write(t, "bits.json", R"({"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "optim_bits": 8}}})");
  r = run(kBin + "mingpt --config " + t.file("bits.json") + kTiny + "--limit_train_batches 2 --stop_after_steps 1 "
                 "--lr 0.5 --save_dir " + t.file("ck8"), 300);
  ASSERT_EQ(r.code, 0) << r.out;
  // A program's --lr that the config overrides is said unused.
  EXPECT_TRUE(has(r.out, "--lr is not used: " + t.file("bits.json") + " gives optimizer.params.lr = 0.001")) << r.out;
  r = run(kBin + "zero checkpoint consolidate " + t.file("ck8") + " " + t.file("m.safetensors") + " --state exp_avg");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "holds 8-bit Adam states")) << r.out;
}

}  // namespace
}  // namespace zero::test
