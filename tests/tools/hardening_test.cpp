// Bad input as a hostile new user gives it (issue 14): each case is a clear
// error at once, naming what is wrong, with no abort, no silent wrong run and
// nothing left behind (support/leak_check.cpp checks the last part for every
// test). The binaries run as processes: build/bin/zero and build/bin/mingpt.
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tool_test_util.h"

namespace zero::test {
namespace {

const std::string kSmall = "--n_layer 1 --n_embd 32 --n_head 2 --limit_train_batches 2 ";

// Two ranks started with different models used to abort inside Gloo
// ("Received data size doesn't match expected size", SIGABRT).
TEST(Hardening, RanksWithDifferentModelsFailWithTheFirstDifference) {
  TempDir dir;
  for (int stage : {0, 2, 3}) {
    const std::string cfg =
        write(dir, "s" + std::to_string(stage) + ".json",
              R"({"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
                  "zero_optimization": {"stage": )" + std::to_string(stage) + "}}");
    const int port = free_port();
    Outcome r1;
    std::thread other([&] {
      r1 = run(rank_env(1, 2, port) + kBin + "mingpt --config " + cfg + " --n_layer 3 --n_embd 32 --n_head 2 "
               "--limit_train_batches 2");
    });
    Outcome r0 = run(rank_env(0, 2, port) + kBin + "mingpt --config " + cfg +
                       " --n_layer 2 --n_embd 32 --n_head 2 --limit_train_batches 2");
    other.join();
    for (const Outcome* r : {&r0, &r1}) {
      EXPECT_EQ(r->code, 1) << "stage " << stage << ":\n" << r->out;
      EXPECT_TRUE(has(r->out, "ranks disagree on the model")) << r->out;
      EXPECT_TRUE(has(r->out, "rank 0 has \"parameter ln_f.weight [32] Float\", rank 1 has \"parameter "
                              "blocks.2.ln1.weight [32] Float\""))
          << r->out;
      EXPECT_FALSE(has(r->out, "terminate called")) << r->out;
    }
  }
}

// Integers used to be parsed as doubles and cast: 2^63 layers trained a
// model with L=-2^63 and exited 0.
TEST(Hardening, IntegerFlagsAreIntegersInRange) {
  const std::string base = kBin + "mingpt --config " + kConfigs + "mingpt_zero0.json --limit_train_batches 2 ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--n_layer 9223372036854775808", "--n_layer: expected an integer in 1..100000; got 9223372036854775808"},
      {"--n_layer inf", "--n_layer: expected an integer in 1..100000 (decimal digits); got \"inf\""},
      {"--n_layer 4294967297", "--n_layer: expected an integer in 1..100000; got 4294967297"},
      {"--max_epochs 18446744073709551617", "--max_epochs: expected an integer in 1..1099511627776"},
      {"--batch_size 1e3", "--batch_size: expected an integer in 1..16777216 (decimal digits); got \"1e3\""},
      {"--seed 0x10", "--seed: expected an integer in 0..9223372036854775807 (decimal digits); got \"0x10\""},
      {"--n_embd 2000000", "--n_embd: expected an integer in 1..1048576; got 2000000"},
      {"--n_embd 2.0", "(decimal digits); got \"2.0\""},
      {"--dropout 2", "--dropout: expected a number in [0, 1); got 2"},
      {"--ndigit 9", "--ndigit: expected an integer in 1..4; got 9"},
      {"--n_embd 32 --n_head 64", "--n_embd 32 must be a multiple of --n_head 64"},
  };
  for (const auto& [flags, message] : cases) {
    const Outcome r = run(base + flags);
    EXPECT_EQ(r.code, 2) << flags << "\n" << r.out;
    EXPECT_TRUE(has(r.out, message)) << flags << "\n" << r.out;
  }
  // A batch larger than the data names the numbers, not the config file.
  const Outcome r = run(base + "--batch_size 16777216", 60);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "an optimizer step takes 16777216 samples (micro-batch 16777216")) << r.out;
  EXPECT_TRUE(has(r.out, "lower --batch_size")) << r.out;
}

TEST(Hardening, SmallerFlagMistakesAreNamed) {
  TempDir dir;
  const std::string base = kBin + "mingpt --config " + kConfigs + "mingpt_zero0.json " + kSmall;
  Outcome r = run(base + "--config " + kConfigs + "mingpt_zero2.json");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(has(r.out, "--config given twice")) << r.out;
  r = run(base + "--block_size 16");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(has(r.out, "--block_size applies to --data and --vocab_size only")) << r.out;
  r = run(base + "--data " + dir.path());
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(has(r.out, "expected a regular text file; got a directory")) << r.out;
}

// Outputs are checked before training, not found unwritable after it; a
// failed summary leaves no .tmp file.
TEST(Hardening, SummaryOutputIsCheckedUpFront) {
  TempDir dir;
  const std::string base = kBin + "mingpt --config " + kConfigs + "mingpt_zero0.json --limit_train_batches 100000 ";
  Outcome r = run(base + "--summary-json " + dir.path() + "/missing/summary.json");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(has(r.out, "the folder " + dir.path() + "/missing does not exist")) << r.out;
  EXPECT_FALSE(has(r.out, "epoch 1/")) << "the output was checked after training:\n" << r.out;
  r = run(base + "--summary-json " + dir.path());
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(has(r.out, "is a folder; expected a file name")) << r.out;
  struct stat st {};
  EXPECT_NE(::stat((dir.path() + ".tmp").c_str(), &st), 0) << "a .tmp file was left";
}

// /dev/zero, /dev/urandom and a FIFO with no writer used to be read forever.
TEST(Hardening, ConfigCheckReadsOnlyRegularFilesOfBoundedSize) {
  TempDir dir;
  const std::string fifo = dir.file("fifo.json");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const auto& [path, kind] : std::vector<std::pair<std::string, std::string>>{
           {"/dev/zero", "a character device"}, {"/dev/urandom", "a character device"},
           {fifo, "a pipe"}, {dir.path(), "a directory"}}) {
    const Outcome r = run(kBin + "zero config check " + path);
    EXPECT_EQ(r.code, 1) << path << "\n" << r.out;
    EXPECT_TRUE(has(r.out, path + ": expected a regular JSON file; got " + kind)) << r.out;
  }
  {
    std::ofstream big(dir.file("big.json"));
    big << "{\"x\": \"" << std::string(17 << 20, 'a') << "\"}";
  }
  const Outcome r = run(kBin + "zero config check " + dir.file("big.json"));
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(has(r.out, "a config is at most 16777216 bytes")) << r.out.substr(0, 500);
}

// The check and training apply the same rules; values that cannot work are
// refused, values far below sensible warned about with their cost.
TEST(Hardening, ConfigCheckAndTrainingApplyTheSameRules) {
  TempDir dir;
  auto config = [&](const std::string& name, const std::string& zero, const std::string& extra = "") {
    return write(dir, name,
                 R"({"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
                     "zero_optimization": )" + zero + extra + "}");
  };
  const std::string nvme = R"("nvme_path": ")" + dir.path() + R"(")";
  const std::vector<std::pair<std::string, std::string>> refused = {
      {config("bc.json", R"({"stage": 3, "offload_param": {"device": "nvme", "buffer_count": 0, )" + nvme + "}}"),
       "zero_optimization.offload_param.buffer_count: expected an integer >= 1; got 0"},
      {config("bs.json", R"({"stage": 3, "offload_param": {"device": "nvme", "buffer_size": 0, )" + nvme + "}}"),
       "zero_optimization.offload_param.buffer_size: expected an integer >= 1; got 0"},
      {config("obc.json", R"({"stage": 2, "offload_optimizer": {"device": "nvme", "buffer_count": 0, )" + nvme + "}}"),
       "zero_optimization.offload_optimizer.buffer_count: expected an integer >= 1; got 0"},
      {config("sg.json", R"({"stage": 2, "sub_group_size": 1, "offload_optimizer": {"device": "nvme", )" + nvme + "}}"),
       "zero_optimization.sub_group_size: expected at least 1024 with offload_optimizer nvme; got 1"},
      {config("ab.json", R"({"stage": 2})", R"(, "aio": {"block_size": 1})"),
       "aio.block_size: expected a multiple of 4096 bytes"},
      {config("np.json", R"({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "a\u0000b"}})"),
       "zero_optimization.offload_optimizer.nvme_path: expected a folder path; got \"a\\u0000b\" (a NUL character"},
  };
  for (const auto& [file, message] : refused) {
    const Outcome check = run(kBin + "zero config check " + file);
    EXPECT_EQ(check.code, 1) << file << "\n" << check.out;
    EXPECT_TRUE(has(check.out, message)) << check.out;
    const Outcome train = run(kBin + "mingpt --config " + file + " " + kSmall, 60);
    EXPECT_EQ(train.code, 1) << file << "\n" << train.out;
    EXPECT_TRUE(has(train.out, message)) << train.out;
  }
  const std::vector<std::pair<std::string, std::string>> warned = {
      {config("sgw.json", R"({"stage": 2, "sub_group_size": 1, "offload_optimizer": {"device": "cpu"}})"),
       "zero_optimization.sub_group_size: 1 is far below the default 1e9"},
      {config("sg0.json", R"({"stage": 2, "sub_group_size": 0})"),
       "zero_optimization.sub_group_size: 0 (DeepSpeed: one sub-group per parameter) is read as the default 1e9"},
      {config("abw.json", R"({"stage": 2})", R"(, "aio": {"block_size": 8192})"),
       "aio.block_size: 8192 bytes is far below the default 1048576"},
  };
  for (const auto& [file, message] : warned) {
    const Outcome check = run(kBin + "zero config check " + file);
    EXPECT_EQ(check.code, 0) << file << "\n" << check.out;
    EXPECT_TRUE(has(check.out, message)) << check.out;
  }
  // A pseudo file system is refused with its reason, not "No such file or directory".
  const std::string proc =
      config("proc.json", R"({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/proc"}})");
  const Outcome r = run(kBin + "mingpt --config " + proc + " " + kSmall, 60);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r.out, "/proc is on procfs (/proc), a kernel interface that holds no files")) << r.out;
}

// The shipped configs use "auto": the check fills it with stand-ins (or the
// values given) and passes; --no-auto is the strict reading.
TEST(Hardening, ShippedConfigsPassTheCheck) {
  for (const char* name : {"mingpt_zero0.json", "mingpt_zero2.json"}) {
    const Outcome r = run(kBin + "zero config check " + kConfigs + name);
    EXPECT_EQ(r.code, 0) << name << "\n" << r.out;
    EXPECT_TRUE(has(r.out, ": OK (world size 1)")) << r.out;
  }
  Outcome r = run(kBin + "zero config check " + kConfigs + "mingpt_zero2.json");
  EXPECT_TRUE(has(r.out, "auto: the program fills it at initialize")) << r.out;
  r = run(kBin + "zero config check " + kConfigs + "mingpt_zero2.json --auto lr=0.02 --auto train_micro_batch_size_per_gpu=4 --world-size 2");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "0.02")) << r.out;
  EXPECT_TRUE(has(r.out, "train_batch_size")) << r.out;
  EXPECT_TRUE(has(r.out, "OK (world size 2)")) << r.out;
  r = run(kBin + "zero config check " + kConfigs + "mingpt_zero2.json --no-auto");
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(has(r.out, "the Hugging Face placeholder, which --auto lr=VALUE fills")) << r.out;
  r = run(kBin + "zero config check " + kConfigs + "mingpt_zero2.json --auto lrr=1");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(has(r.out, "did you mean lr?")) << r.out;
}

TEST(Hardening, PathologicalJsonGivesAShortMessage) {
  TempDir dir;
  const std::string deep = write(dir, "deep.json",
                                 "{\"zero_optimization\": " + std::string(1000000, '[') + std::string(1000000, ']') + "}");
  Outcome r = run(kBin + "zero config check " + deep);
  EXPECT_EQ(r.code, 1) << r.out.substr(0, 300);
  EXPECT_TRUE(has(r.out, "nesting deeper than 256 levels")) << r.out.substr(0, 300);
  EXPECT_LT(r.out.size(), 1000u);
  const std::string big = write(dir, "big.json", "{\"train_batch_size\": " + std::string(100000, '9') + "}");
  r = run(kBin + "zero config check " + big);
  EXPECT_EQ(r.code, 1);
  EXPECT_LT(r.out.size(), 500u) << r.out.substr(0, 500);
  EXPECT_TRUE(has(r.out, "(100000 characters)")) << r.out;
  EXPECT_FALSE(has(r.out, "[json.exception")) << r.out;
  const std::string key = write(dir, "key.json", "{\"train_batch_size\": 8, \"optimizer\": {\"type\": \"Adam\"}, \"" +
                                                    std::string(100000, 'k') + "\": 1}");
  r = run(kBin + "zero config check " + key);
  EXPECT_EQ(r.code, 0);
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) EXPECT_LT(line.size(), 400u) << line.substr(0, 400);
  EXPECT_TRUE(has(r.out, "(a path of 100000 characters)")) << r.out;
}

// (LibTorch's stack traces: tests/core/error_test.cpp, in-process; a process
// case needs an allocation that fails, which depends on the host's overcommit.)

// Waiting for peers says for whom, and fails once at the timeout.
TEST(Hardening, RendezvousSaysWhoItWaitsFor) {
  int port = free_port();
  const std::string train = kBin + "mingpt --config " + kConfigs + "mingpt_zero0.json " + kSmall;
  Outcome r = run(rank_env(0, 2, port, 7) + train, 60);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r.out, "rank 0 of 2: 1 of 2 ranks joined at 127.0.0.1:" + std::to_string(port))) << r.out;
  EXPECT_TRUE(has(r.out, "rank 0 of 2 saw 1 of 2 ranks join within 7 s (ZERO_COMM_TIMEOUT_S); missing: rank 1")) << r.out;
  EXPECT_LT(r.seconds, 30);  // the 7 s timeout, once: not twice, and LibTorch starting on a loaded machine
  port = free_port();
  r = run(rank_env(1, 2, port, 7) + train, 60);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r.out, "rank 1 of 2: waiting for the store at 127.0.0.1:" + std::to_string(port))) << r.out;
  EXPECT_TRUE(has(r.out, "found no store at 127.0.0.1:" + std::to_string(port))) << r.out;
  EXPECT_FALSE(has(r.out, "socket")) << "c10d's connection warnings:\n" << r.out;
  EXPECT_LT(r.seconds, 30);  // the 7 s timeout, once: not twice, and LibTorch starting on a loaded machine
}

// A collective that times out names the rank that stopped answering.
TEST(Hardening, CollectiveTimeoutNamesTheStoppedRank) {
  TempDir dir;
  const int port = free_port();
  const std::string train = kBin + "mingpt --config " + kConfigs + "mingpt_zero0.json --n_layer 1 --n_embd 32 "
                            "--n_head 2 --max_epochs 100000";
  const std::string pid_file = dir.file("rank1.pid"), log0 = dir.file("rank0.log");
  Outcome r1;
  std::thread other([&] {
    r1 = run("sh -c 'echo $$ > " + pid_file + "; exec " + rank_env(1, 2, port, 12) + train + "'", 120);
  });
  std::thread stopper([&] {
    // Stop rank 1 once training is under way (rank 0 has finished an epoch), not while joining.
    for (int i = 0; i < 600 && !has(read_text(log0), "epoch 2/"); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const std::string pid = read_text(pid_file);
    if (!pid.empty()) ::kill(static_cast<pid_t>(std::stol(pid)), SIGSTOP);
  });
  run("sh -c '" + rank_env(0, 2, port, 12) + train + " > " + log0 + " 2>&1'", 120);
  stopper.join();
  const std::string pid = read_text(pid_file);
  if (!pid.empty()) ::kill(static_cast<pid_t>(std::stol(pid)), SIGKILL);
  other.join();
  const std::string out = read_text(log0);
  EXPECT_TRUE(has(out, "failed on rank 0 (collective timeout 12 s")) << out.substr(out.size() > 3000 ? out.size() - 3000 : 0);
  EXPECT_TRUE(has(out, "not answering: rank 1 (killed, crashed or stopped")) << out.substr(out.size() > 3000 ? out.size() - 3000 : 0);
}

// zero bench aio on a disk without room refuses up front and leaves no file;
// a failed bench run prints the run's error and removes its folder.
TEST(Hardening, BenchesFailCleanly) {
  TempDir dir;
  Outcome r = run(kBin + "zero bench aio --path " + dir.path() + " --size 100000000GiB");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r.out, "free; the test file needs")) << r.out;
  r = run(kBin + "zero bench offload --path " + dir.path() + " --nproc 2 --n_layer 1 --n_embd 32 --steps 2 --sub_group 1",
          120);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "sub_group_size: expected at least 1024 with offload_optimizer nvme")) << r.out;
}

// A bench that runs ranks, on a folder whose name has a space, stopped by
// SIGTERM: the run in flight ends, then the bench (143), and neither its
// scratch folder nor its checkpoints stay; the same for zero bench aio.
TEST(Hardening, ABenchStoppedBySigtermLeavesNothing) {
  TempDir dir, tmp;
  const std::string spaced = dir.path() + "/a folder";
  ASSERT_EQ(::mkdir(spaced.c_str(), 0755), 0);
  // SIGTERM once the bench runs (it says so after its stop handler is in
  // place), however long the machine takes to get there.
  const std::string blog = dir.file("bench.log");
  const std::string script = write(dir, "stop.sh",
                                   "TMPDIR=" + tmp.path() + " " + kBin + "zero bench checkpoint-io --path '" + spaced +
                                       "' --nproc 2 --n_layer 1 --n_embd 64 --rounds 8 > " + blog + " 2>&1 & pid=$!\n"
                                       "i=0; until grep -q 'running save' " + blog + " || [ $i -ge 1200 ]; do sleep 0.1; "
                                       "i=$((i+1)); done\n"
                                       "kill -TERM $pid; wait $pid; echo \"status $?\"; cat " + blog + "\n");
  const Outcome r = run("sh " + script, 300);
  EXPECT_TRUE(has(r.out, "status 143")) << r.out;
  EXPECT_TRUE(has(r.out, "interrupted by SIGTERM; its runs are ended and their files removed")) << r.out;
  for (const std::string& d : {tmp.path(), spaced}) {
    DIR* listing = ::opendir(d.c_str());
    ASSERT_NE(listing, nullptr) << d;
    int left = 0;
    while (dirent* e = ::readdir(listing)) left += std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0;
    ::closedir(listing);
    EXPECT_EQ(left, 0) << "left behind in " << d;
  }
  // zero bench aio on its own, stopped between or inside its rounds (its own
  // I/O, or fio's): its test file and fio's log go too.
  const std::string alog = dir.file("aio.log");
  const std::string aio = write(dir, "stop_aio.sh",
                                kBin + "zero bench aio --path '" + spaced + "' --size 64MiB --rounds 200 > " + alog +
                                    " 2>&1 & pid=$!\n"
                                    "i=0; until grep -q 'queue depth' " + alog + " || [ $i -ge 1200 ]; do sleep 0.1; "
                                    "i=$((i+1)); done\n"
                                    "kill -TERM $pid; wait $pid; echo \"status $?\"; cat " + alog + "\n");
  const Outcome a = run("sh " + aio, 300);
  EXPECT_TRUE(has(a.out, "status 143")) << a.out;
  EXPECT_TRUE(has(a.out, "zero bench aio: interrupted by SIGTERM")) << a.out;
  DIR* listing = ::opendir(spaced.c_str());
  ASSERT_NE(listing, nullptr);
  int left = 0;
  while (dirent* e = ::readdir(listing)) left += std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0;
  ::closedir(listing);
  EXPECT_EQ(left, 0) << "zero bench aio left files in " << spaced;
  ::rmdir(spaced.c_str());
}

}  // namespace
}  // namespace zero::test
