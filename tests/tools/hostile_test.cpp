// What a hostile user found in the checkpoints, the estimator, the config
// check and the searches (issue 24): each case failed on the code before,
// and is a clear refusal, a clean stop or a removed leftover now. The
// binaries run as processes (build/bin/zero, build/bin/mingpt); nothing here
// depends on the machine's speed: a test waits for a file the program
// writes, never for a time.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "tool_test_util.h"

namespace zero::test {
namespace {

const std::string kTiny = " --n_layer 1 --n_embd 32 --n_head 2 --batch_size 16 ";

// A checkpoint of a tiny minGPT in `dir`/ck (latest: global_step2).
std::string train_checkpoint(const TempDir& dir, const std::string& extra = "") {
  const std::string ck = dir.file("ck");
  const Outcome r = run(kBin + "mingpt --config " + kConfigs + "mingpt_zero2.json" + kTiny +
                        "--limit_train_batches 4 --stop_after_steps 2 --save_dir " + ck + " " + extra);
  EXPECT_EQ(r.code, 0) << r.out;
  return ck;
}

// The rank file of a checkpoint is not an output: consolidate refuses it (it
// used to overwrite it and exit 0), as any path into the checkpoint, a link
// to one of its files, and a file it did not write (without --force).
TEST(Hostile, ConsolidateNeverOverwritesTheCheckpointItReads) {
  TempDir dir;
  const std::string ck = train_checkpoint(dir);
  const std::string rank_file = ck + "/global_step2/rank00000.safetensors";
  const std::string before = read_text(rank_file);
  ASSERT_EQ(::symlink(rank_file.c_str(), dir.file("link.safetensors").c_str()), 0);
  ASSERT_EQ(::link((ck + "/global_step2/meta.json").c_str(), dir.file("hard.json").c_str()), 0);
  write(dir, "notes.txt", "my notes\n");
  const std::string c = kBin + "zero checkpoint consolidate " + ck + " ";
  for (const auto& [out, message] : std::vector<std::pair<std::string, std::string>>{
           {rank_file, "lies inside the checkpoint folder DIR " + ck + ", which this command reads whole"},
           {ck + "/new.safetensors", "lies inside the checkpoint folder DIR " + ck},
           {dir.file("link.safetensors"), "lies inside the checkpoint folder DIR"},
           {dir.file("hard.json"), "this command reads that file (the checkpoint's file " + ck + "/global_step2/meta.json)"},
           {dir.file("notes.txt"), "exists and is not a file zero checkpoint consolidate wrote; give --force"},
           {"/dev/full", "is not a regular file"},
           {dir.file("nope/w.safetensors"), "the folder " + dir.file("nope") + " does not exist"}}) {
    const Outcome r = run(c + out);
    EXPECT_EQ(r.code, 2) << out << "\n" << r.out;
    EXPECT_TRUE(has(r.out, message)) << out << "\n" << r.out;
  }
  EXPECT_EQ(read_text(rank_file), before);
  EXPECT_EQ(read_text(dir.file("notes.txt")), "my notes\n");
  EXPECT_EQ(run(kBin + "zero checkpoint verify " + ck).code, 0);
  // An earlier output of consolidate is replaced; another file with --force.
  EXPECT_EQ(run(c + dir.file("w.safetensors")).code, 0);
  EXPECT_EQ(run(c + dir.file("w.safetensors")).code, 0);
  EXPECT_EQ(run(c + dir.file("notes.txt") + " --force").code, 0);
  EXPECT_NE(read_text(dir.file("notes.txt")), "my notes\n");
}

// A full disk (here a file-size limit: fallocate fails with EFBIG) used to
// leave a 0-byte OUT.tmp beside the output.
TEST(Hostile, ConsolidateOntoAFullDiskLeavesNoTemporary) {
  TempDir dir;
  const std::string ck = train_checkpoint(dir);
  TempDir out;
  const Outcome r = run("sh -c 'trap \"\" XFSZ; ulimit -f 8; exec " + kBin + "zero checkpoint consolidate " + ck + " " +
                        out.file("w.safetensors") + "'");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r.out, "w.safetensors.tmp")) << r.out;  // the error names the file
  EXPECT_FALSE(::access(out.file("w.safetensors.tmp").c_str(), F_OK) == 0) << "temporary left behind";
  EXPECT_FALSE(::access(out.file("w.safetensors").c_str(), F_OK) == 0);
}

// verify said "missing" while resume went on without the file: one rule now.
// An empty tag is not "the latest"; a file is not a checkpoint folder.
TEST(Hostile, VerifyAndResumeAgreeAndTagsAreNamed) {
  TempDir dir;
  const std::string ck = train_checkpoint(dir);
  ASSERT_EQ(std::remove((ck + "/global_step2/model.safetensors").c_str()), 0);
  const Outcome v = run(kBin + "zero checkpoint verify " + ck);
  EXPECT_EQ(v.code, 1) << v.out;
  EXPECT_TRUE(has(v.out, "model.safetensors: missing")) << v.out;
  const Outcome resume = run(kBin + "mingpt --config " + kConfigs + "mingpt_zero2.json" + kTiny +
                             "--limit_train_batches 4 --resume " + ck);
  EXPECT_EQ(resume.code, 1) << resume.out;
  EXPECT_TRUE(has(resume.out, "model.safetensors: missing")) << resume.out;
  for (const std::string& cmd : {kBin + "zero checkpoint verify " + ck + " --tag ''",
                                 kBin + "zero checkpoint info " + ck + " --tag ''",
                                 kBin + "mingpt --config " + kConfigs + "mingpt_zero2.json --resume " + ck + " --resume_tag ''"}) {
    const Outcome r = run(cmd);
    EXPECT_EQ(r.code, 2) << cmd << "\n" << r.out;
    EXPECT_TRUE(has(r.out, "got \"\" (leave")) << cmd << "\n" << r.out;
  }
  const Outcome f = run(kBin + "zero checkpoint verify " + ck + "/latest");
  EXPECT_EQ(f.code, 1);
  EXPECT_TRUE(has(f.out, ck + "/latest: not a folder")) << f.out;
}

// A second job saving into the folder of a running one is refused naming
// it (the two used to overwrite each other's files); a file or a folder that
// cannot be written as --save_dir is refused before the first step.
TEST(Hostile, OneWriterPerCheckpointFolder) {
  TempDir dir;
  const std::string ck = dir.file("ck"), log = dir.file("first.log");
  // The first job holds the folder from before its first step until it
  // ends (it trains for long: the test kills it once the second one has
  // been refused).
  run("sh -c '" + kBin + "mingpt --config " + kConfigs + "mingpt_zero2.json" + kTiny + "--max_epochs 1000 --save_dir " +
      ck + " --save_every 1000000 > " + log + " 2>&1 & echo $! > " + dir.file("pid") + "'");
  const pid_t first = std::stoi(read_text(dir.file("pid")));
  for (int i = 0; i < 1200 && !has(read_text(log), "epoch 1/"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_TRUE(has(read_text(log), "epoch 1/")) << read_text(log);
  const Outcome second = run(kBin + "mingpt --config " + kConfigs + "mingpt_zero2.json" + kTiny +
                             "--limit_train_batches 2 --save_dir " + ck);
  ::kill(first, SIGKILL);
  EXPECT_EQ(second.code, 1) << second.out;
  EXPECT_TRUE(has(second.out, "another job is saving checkpoints there (pid " + std::to_string(first))) << second.out;
  EXPECT_FALSE(has(second.out, "epoch 1/")) << "the second job trained before it was refused";
  // Bad folders, before any step.
  write(dir, "afile", "x");
  for (const auto& [save_dir, message] : std::vector<std::pair<std::string, std::string>>{
           {dir.file("afile"), "--save_dir " + dir.file("afile") + ": is a file, not a folder"},
           {dir.file("afile") + "/sub", "cannot make the folder"}}) {
    const Outcome r = run(kBin + "mingpt --config " + kConfigs + "mingpt_zero2.json" + kTiny +
                          "--limit_train_batches 2 --save_dir " + save_dir);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_TRUE(has(r.out, message)) << r.out;
    EXPECT_FALSE(has(r.out, "epoch 1/")) << r.out;
  }
  // The killed job's leftovers go with the next writer.
  for (int i = 0; i < 1200 && running(first); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const Outcome clean = run(kBin + "zero checkpoint verify " + ck + " --clean");  // no checkpoint to verify: 1
  EXPECT_TRUE(has(clean.out, ck + ": nothing left by interrupted saves")) << clean.out;
  EXPECT_TRUE(entries(ck).empty()) << "the lock file of the killed job stayed";
}

// SIGTERM to a rank during a save (as zero launch passes a Ctrl-C on) used to
// leave .global_stepN.incoming with its .tmp files: the save now stops, its
// files go, and the previous checkpoint is whole. What SIGKILL leaves, the
// next save or verify --clean removes.
TEST(Hostile, AnInterruptedSaveLeavesNothingBehind) {
  TempDir dir;
  const std::string ck = dir.file("ck");
  const std::string train = kBin + "zero launch --nproc_per_node 2 -- " + kBin + "mingpt --config " + kConfigs +
                            "mingpt_zero2.json" + kTiny + "--limit_train_batches 8 --save_dir " + ck + " --save_every 2 ";
  const Outcome term = run(train + "--test_kill_save 1:rank_files:2:TERM");
  // Rank 1 dies of the signal (143), rank 0 fails the save with it (1): the
  // launcher reports whichever it sees first.
  EXPECT_TRUE(term.code == 143 || term.code == 1) << term.out;
  EXPECT_TRUE(has(term.out, "SIGTERM to rank 1")) << term.out;
  // (The writer lock's file may stay: zero launch's SIGTERM can end rank 0
  // after its save, before its engine lets go. It is free; the next writer
  // takes it.)
  for (const auto& name : entries(ck))
    if (name != ".zero-lock") {
      EXPECT_NE(name[0], '.') << "left behind: " << name;
    }
  EXPECT_EQ(read_text(ck + "/latest"), "global_step2\n");
  EXPECT_EQ(run(kBin + "zero checkpoint verify " + ck).code, 0);
  // SIGKILL cannot be caught: rank 0, which would remove the folder, is
  // killed, so it stays until the next writer.
  const Outcome kill = run(train + "--test_kill_save 0:rank_files:2");
  EXPECT_NE(kill.code, 0);
  bool left = false;
  for (const auto& name : entries(ck)) left = left || name == ".global_step4.incoming";
  EXPECT_TRUE(left) << "a kill leaves the incoming folder";
  // The next writer removes it (before its first step)...
  const Outcome next = run(train + "--stop_after_steps 1");
  EXPECT_EQ(next.code, 0) << next.out;
  EXPECT_TRUE(has(next.out, "removed what interrupted saves left: .global_step4.incoming")) << next.out;
  EXPECT_EQ(entries(ck).count(".global_step4.incoming"), 0u);
  // ... and so does verify --clean, when no job holds the folder.
  run(train + "--test_kill_save 0:rank_files:2");
  EXPECT_EQ(entries(ck).count(".global_step4.incoming"), 1u);
  const Outcome clean = run(kBin + "zero checkpoint verify " + ck + " --clean");
  EXPECT_EQ(clean.code, 0) << clean.out;
  EXPECT_TRUE(has(clean.out, "removed .global_step4.incoming (left by an interrupted save)")) << clean.out;
  for (const auto& name : entries(ck)) EXPECT_NE(name[0], '.') << "left behind: " << name;
}

// The issue's own case: Ctrl-C (SIGINT) or SIGTERM to zero launch while its
// ranks save. The launcher passes it on, the save stops, its folder goes,
// and the previous checkpoint stays whole. Rank 0 stands still inside the
// save until the signal comes, so the signal lands there on any machine.
TEST(Hostile, AStopToTheLauncherDuringASaveLeavesNoIncomingFolder) {
  for (const char* sig : {"TERM", "INT"}) {
    TempDir dir;
    const std::string ck = dir.file("ck"), marker = dir.file("saving"), log = dir.file("log");
    run("sh -c '" + kBin + "zero launch --nproc_per_node 2 -- " + kBin + "mingpt --config " + kConfigs +
        "mingpt_zero2.json" + kTiny + "--limit_train_batches 8 --save_dir " + ck + " --save_every 2 --test_kill_save "
        "0:rank_files:2:WAIT=" + marker + " > " + log + " 2>&1 & echo $! > " + dir.file("pid") + "'");
    for (int i = 0; i < 1200 && ::access(marker.c_str(), F_OK) != 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_EQ(::access(marker.c_str(), F_OK), 0) << read_text(log);
    const pid_t launcher = std::stoi(read_text(dir.file("pid")));
    ::kill(launcher, std::string(sig) == "TERM" ? SIGTERM : SIGINT);
    EXPECT_TRUE(ended_within_two_minutes(launcher)) << read_text(log);
    const std::string text = read_text(log);
    EXPECT_TRUE(has(text, "SIG" + std::string(sig) + " came during the save; the save was stopped and its files "
                          "removed"))
        << text;
    for (const auto& name : entries(ck))
      if (name != ".zero-lock") {
        EXPECT_NE(name[0], '.') << "left behind: " << name << "\n" << text;
      }
    EXPECT_EQ(read_text(ck + "/latest"), "global_step2\n");
    EXPECT_EQ(run(kBin + "zero checkpoint verify " + ck).code, 0);
  }
}

// mingpt --find-max-params: SIGTERM at any point ends it, its runs and its
// scratch folder within seconds; killed outright, its runs end with it and
// the next search removes its scratch folder.
TEST(Hostile, AMaxParameterSearchStopsAndCleansUp) {
  TempDir dir, tmp;
  const std::string search = "TMPDIR=" + tmp.path() + " OMP_NUM_THREADS=1 " + kBin + "mingpt --config " + kConfigs +
                             "mingpt_zero2.json --find-max-params --nproc 2 --device-memory 64MiB --head_dim 16 "
                             "--batch_size 8";
  auto start = [&](const std::string& log) {
    run("sh -c '" + search + " > " + log + " 2>&1 & echo $! > " + dir.file("pid") + "'");
    for (int i = 0; i < 1200 && !has(read_text(log), "probe 1:"); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_TRUE(has(read_text(log), "probe 1:")) << read_text(log);
    return static_cast<pid_t>(std::stoi(read_text(dir.file("pid"))));
  };
  const pid_t stopped = start(dir.file("term.log"));
  ::kill(stopped, SIGTERM);
  EXPECT_TRUE(ended_within_two_minutes(stopped));
  EXPECT_TRUE(has(read_text(dir.file("term.log")), "interrupted by SIGTERM")) << read_text(dir.file("term.log"));
  EXPECT_TRUE(entries(tmp.path()).empty());

  const pid_t killed = start(dir.file("kill.log"));
  ::kill(killed, SIGKILL);
  EXPECT_TRUE(ended_within_two_minutes(killed));
  EXPECT_FALSE(entries(tmp.path()).empty()) << "a search killed outright cannot remove its folder";
  const pid_t next = start(dir.file("next.log"));
  ::kill(next, SIGTERM);
  EXPECT_TRUE(ended_within_two_minutes(next));
  EXPECT_TRUE(has(read_text(dir.file("next.log")), "the scratch folder of a run that was killed"))
      << read_text(dir.file("next.log"));
  for (int i = 0; i < 1200 && !entries(tmp.path()).empty(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_TRUE(entries(tmp.path()).empty());
}

// zero launch used to die of SIGHUP (status 129) and leave its ranks
// training; it now passes it on as SIGTERM. A launcher killed outright ends
// its ranks too (their parent-death signal).
TEST(Hostile, TheLauncherTakesItsRanksWithItOnSighupAndSigkill) {
  TempDir dir;
  for (const int sig : {SIGHUP, SIGKILL}) {
    const std::string pids = dir.file("pids" + std::to_string(sig));
    run("sh -c '" + kBin + "zero launch --nproc_per_node 2 -- sh -c \"echo \\$\\$ >> " + pids +
        "; exec sleep 600\" > /dev/null 2>&1 & echo $! > " + dir.file("launcher") + "'");
    auto lines = [&] {
      const std::string text = read_text(pids);
      return std::count(text.begin(), text.end(), '\n');
    };
    for (int i = 0; i < 1200 && lines() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const std::string text = read_text(pids);
    ASSERT_EQ(std::count(text.begin(), text.end(), '\n'), 2) << text;
    ::kill(std::stoi(read_text(dir.file("launcher"))), sig);
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) {
      const pid_t rank = std::stoi(line);
      const bool gone = ended_within_two_minutes(rank);
      EXPECT_TRUE(gone) << "rank " << rank << " outlived a launcher given signal " << sig;
      if (!gone) ::kill(rank, SIGKILL);
    }
  }
}

// The searches start at most 4 ranks per processor unless told: 1000 ranks on
// 2 cores used to run for 14 minutes past `timeout`.
TEST(Hostile, SearchesRefuseMoreRanksThanTheMachineRuns) {
  const Outcome find = run(kBin + "mingpt --config " + kConfigs + "mingpt_zero2.json --find-max-params --nproc 1000 "
                           "--device-memory 1GiB");
  EXPECT_EQ(find.code, 2) << find.out;
  EXPECT_TRUE(has(find.out, "--nproc 1000: more than")) << find.out;
  EXPECT_TRUE(has(find.out, "--oversubscribe")) << find.out;
  const Outcome tune = run(kBin + "zero tune --model mingpt:2,64 --device-memory 1GiB --host-memory 1GiB --ranks 1000");
  EXPECT_EQ(tune.code, 2) << tune.out;
  EXPECT_TRUE(has(tune.out, "--ranks 1000: more than")) << tune.out;
}

// zero estimate: counts are whole numbers ("1.5" was read as 1, "0.5"
// refused), each flag once, and rank counts whose figures stay exact (a
// million nodes of a million ranks gave 1,536,000 GB per rank); --json is
// checked before the work and written whole, or the run fails.
TEST(Hostile, EstimatorInputIsExact) {
  TempDir dir;
  const std::string e = kBin + "zero estimate ";
  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"--params 1.5", "--params: expected a whole number of parameters"},
           {"--params 0.5", "--params: expected a whole number of parameters"},
           {"--params 1e17", "--params: expected a whole number of parameters in 1..1e16"},
           {"--params 1e9 --params 2e9", "--params given twice"},
           {"--params 1e9 --stage 2 --stage 3", "--stage given twice"},
           {"--params 1e9 --nodes 1000000 --ranks-per-node 1000000", "is 1000000000000 ranks; at most 1048576"},
           {"--params 1e9 --nodes 2000000", "--nodes: expected an integer in 1..1048576"},
           {"--params 1e9 --nodes 2048 --ranks-per-node 1024", "is 2097152 ranks; at most 1048576"},
           {"--params 1e9 --json " + dir.file("nope/x.json"), "the folder " + dir.file("nope") + " does not exist"},
           {"--params 1e9 --json " + dir.path(), "is a folder; expected a file name"},
           {"--params 1e9 --json /dev/full", "is not a regular file"}}) {
    const Outcome r = run(e + args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    EXPECT_TRUE(has(r.out, message)) << args << "\n" << r.out;
  }
  for (const char* whole : {"1.3B", "1300M", "1.3e9", "1300000000"}) {
    const Outcome r = run(e + "--params " + whole + " --json " + dir.file("e.json"));
    EXPECT_EQ(r.code, 0) << whole << "\n" << r.out;
    EXPECT_TRUE(has(read_text(dir.file("e.json")), "\"num_parameters\": 1300000000")) << whole;
  }
}

// zero config check and training agree on a config with no optimizer
// section (NOTE [client optimizer]): the check accepts it, saying that the
// program must pass its own, and mingpt passes its own (--optimizer);
// comments and a byte-order mark are read as DeepSpeed reads them, with a
// word for the readers that refuse them, in both places.
TEST(Hostile, ConfigCheckAndTrainingAgree) {
  TempDir dir;
  const std::string opt = R"("optimizer": {"type": "AdamW", "params": {"lr": 0.001}})";
  const std::string no_opt = write(dir, "noopt.json", R"({"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": "2"}})");
  const Outcome check = run(kBin + "zero config check " + no_opt);
  EXPECT_EQ(check.code, 0) << check.out;
  EXPECT_TRUE(has(check.out, "optimizer: no optimizer section: the program must pass its own optimizer")) << check.out;
  const Outcome train = run(kBin + "mingpt --config " + no_opt + kTiny + "--limit_train_batches 2");
  EXPECT_EQ(train.code, 0) << train.out;
  EXPECT_TRUE(has(train.out, "optimizer: the program's torch::optim::AdamW")) << train.out;
  for (const auto& [name, text, warning] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"bom.json", "\xEF\xBB\xBF{\"train_micro_batch_size_per_gpu\": 16, " + opt + "}", "byte-order mark"},
           {"comment.json", "{\n// mine\n\"train_micro_batch_size_per_gpu\": 16, " + opt + "}", "line 2 has a comment"},
           {"string_stage.json", "{\"train_micro_batch_size_per_gpu\": 16, \"zero_optimization\": {\"stage\": \"2\"}, " + opt + "}", ""}}) {
    const std::string file = write(dir, name, text);
    const Outcome c = run(kBin + "zero config check " + file);
    const Outcome t = run(kBin + "mingpt --config " + file + kTiny + "--limit_train_batches 2");
    EXPECT_EQ(c.code, 0) << c.out;
    EXPECT_EQ(t.code, 0) << t.out;
    if (!warning.empty()) {
      EXPECT_TRUE(has(c.out, warning)) << c.out;
      EXPECT_TRUE(has(t.out, warning)) << t.out;
    }
  }
}

// 200,000 unknown top-level keys kept the check busy for minutes (a
// quadratic search for repeated warnings); now a linear read, and one line
// for all but the first few.
TEST(Hostile, ManyUnknownKeysAreReadInLinearTimeAndSummed) {
  TempDir dir;
  std::string text = "{\"train_micro_batch_size_per_gpu\": 1, \"optimizer\": {\"type\": \"Adam\"}";
  for (int i = 0; i < 200000; ++i) text += ", \"unknown_key_" + std::to_string(i) + "\": 1";
  const std::string file = write(dir, "many.json", text + "}");
  const Outcome r = run(kBin + "zero config check " + file);  // 60 s: a quadratic read took minutes
  EXPECT_EQ(r.code, 0) << r.out.substr(0, 2000);
  EXPECT_TRUE(has(r.out, "... and 199,980 more unknown top-level keys")) << r.out.substr(0, 2000);
  EXPECT_LT(r.out.size(), 20000u);
  // Nested unknown keys are problems, summed the same way.
  std::string nested = "{\"train_micro_batch_size_per_gpu\": 1, \"optimizer\": {\"type\": \"Adam\"}, \"zero_optimization\": {";
  for (int i = 0; i < 1000; ++i) nested += std::string(i ? ", " : "") + "\"k" + std::to_string(i) + "\": 1";
  const Outcome n = run(kBin + "zero config check " + write(dir, "nested.json", nested + "}}"));
  EXPECT_EQ(n.code, 1);
  EXPECT_TRUE(has(n.out, "zero_optimization: ... and 980 more unknown keys")) << n.out;
}

// A run stopped by --stop_after_steps evaluates nothing: it says so, not "nan%".
TEST(Hostile, AStoppedRunSaysItWasNotEvaluated) {
  const Outcome r = run(kBin + "mingpt --config " + kConfigs + "mingpt_zero2.json" + kTiny + "--stop_after_steps 1");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_FALSE(has(r.out, "nan%")) << r.out;
  EXPECT_TRUE(has(r.out, "Held-out accuracy: not evaluated (no epoch finished)")) << r.out;
}

// DeepSpeed's defaults keep a small model whole at stage 3 and NVMe parameter
// offload in host memory: a new user believed stage 3 was running. The run
// says so, naming the key that changes it.
TEST(Hostile, Stage3OnASmallModelSaysItPartitionsNothing) {
  TempDir dir;
  const std::string opt = R"("train_micro_batch_size_per_gpu": 16, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}})";
  const Outcome whole = run(kBin + "mingpt --config " + write(dir, "s3.json", "{" + opt + R"(, "zero_optimization": {"stage": 3}})") +
                            kTiny + "--limit_train_batches 2");
  EXPECT_EQ(whole.code, 0) << whole.out;
  EXPECT_TRUE(has(whole.out, "ZeRO stage 3 partitions nothing of this model")) << whole.out;
  EXPECT_TRUE(has(whole.out, "stage3_param_persistence_threshold (100000)")) << whole.out;
  const Outcome nvme = run(kBin + "mingpt --config " +
                           write(dir, "nv.json", "{" + opt + R"(, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "offload_param": {"device": "nvme", "nvme_path": ")" + dir.path() + R"("}}})") +
                           kTiny + "--limit_train_batches 2");
  EXPECT_EQ(nvme.code, 0) << nvme.out;
  EXPECT_FALSE(has(nvme.out, "partitions nothing")) << nvme.out;
  EXPECT_TRUE(has(nvme.out, "so nothing goes to disk; lower that key")) << nvme.out;
}

}  // namespace
}  // namespace zero::test
