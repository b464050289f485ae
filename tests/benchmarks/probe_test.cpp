// probe.h: how a short run of a search ends (trained, out of memory, failed,
// timed out), told apart from a script standing in for mingpt; a run past its
// time limit is stopped, and one that ignores SIGTERM is killed with its
// whole process group.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "probe.h"

namespace {

// A shell script in `dir` that runs `body`, and a ProbeRun of it.
mingpt::ProbeRun script_run(const mingpt::ScratchDir& dir, const std::string& body) {
  const std::string path = dir.path() + "/trainer.sh";
  std::ofstream(path) << "#!/bin/sh\n" << body << "\n";
  ::chmod(path.c_str(), 0755);
  mingpt::ProbeRun run;
  run.trainer = path;
  run.summary_path = dir.path() + "/summary.json";
  run.log_path = dir.path() + "/log";
  return run;
}

// Whether process `pid` has ended: no such process, or a zombie (an orphan
// waits for init to reap it, which in a container may never come).
bool ended(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  const auto paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z';
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

TEST(Probe, OutcomesAreToldApart) {
  mingpt::ScratchDir dir(mingpt::temp_parent(), "probe-test");
  auto oom = script_run(dir, "echo 'warning: low memory'; echo 'mingpt: out of memory on the device: 12 MiB asked' >&2; exit 1");
  auto r = mingpt::run_probe(oom);
  EXPECT_EQ(r.outcome, mingpt::ProbeResult::Outcome::kOutOfMemory);
  EXPECT_EQ(r.message, "out of memory on the device: 12 MiB asked");

  // Out of memory inside a collective: mingpt's line names the collective first.
  auto in_collective = script_run(
      dir, "echo '[rank 1] mingpt: all_gather of 442368 Float elements on rank 1: out of memory on the device: 1.69 MiB "
           "asked' >&2; echo '[rank 0] mingpt: all_gather failed on rank 0: Connection closed by peer' >&2; exit 1");
  r = mingpt::run_probe(in_collective);
  EXPECT_EQ(r.outcome, mingpt::ProbeResult::Outcome::kOutOfMemory);
  EXPECT_EQ(r.message, "all_gather of 442368 Float elements on rank 1: out of memory on the device: 1.69 MiB asked");

  auto failed = script_run(dir, "echo 'a warning about memory'; echo 'mingpt: cannot open data.txt' >&2; exit 1");
  r = mingpt::run_probe(failed);
  EXPECT_EQ(r.outcome, mingpt::ProbeResult::Outcome::kFailed);
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.message.find("cannot open data.txt"), std::string::npos) << r.message;

  auto no_summary = script_run(dir, "exit 0");
  r = mingpt::run_probe(no_summary);
  EXPECT_EQ(r.outcome, mingpt::ProbeResult::Outcome::kFailed);
  EXPECT_NE(r.message.find("wrote no summary"), std::string::npos) << r.message;

  // The summary's path is the argument after --summary-json.
  auto trained = script_run(
      dir, "while [ \"$1\" != --summary-json ]; do shift; done\n"
           "echo '{\"steps\": 3, \"skipped_steps\": 0, \"step_time_s\": [0.5, 0.2, 0.4], \"tokens_per_step\": 64,"
           " \"ranks\": [{\"peak_bytes\": {\"device\": 10, \"pinned_host\": 1, \"host\": 2, \"nvme\": 3}}]}' > \"$2\"");
  r = mingpt::run_probe(trained);
  EXPECT_EQ(r.outcome, mingpt::ProbeResult::Outcome::kTrained) << r.message;
  EXPECT_DOUBLE_EQ(r.step_s, 0.3);  // the first step left out
  EXPECT_EQ(r.peak_device, 10);
  EXPECT_EQ(r.peak_host, 3);
  EXPECT_EQ(r.peak_nvme, 3);
}

TEST(Probe, ARunPastItsTimeLimitIsStopped) {
  mingpt::ScratchDir dir(mingpt::temp_parent(), "probe-test");
  auto run = script_run(dir, "echo 'step 1 of 3'; exec sleep 60");
  run.timeout_s = 10;  // the shell's first line comes well before, loaded or not
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = mingpt::run_probe(run);
  EXPECT_LT(seconds_since(t0), 45.0);  // not the script's 60 s
  EXPECT_EQ(r.outcome, mingpt::ProbeResult::Outcome::kTimedOut);
  EXPECT_EQ(r.status, 128 + SIGTERM);
  EXPECT_NE(r.message.find("time limit of 10 s"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("step 1 of 3"), std::string::npos) << r.message;  // the log's last lines

  // No limit: the same kind of run ends on its own.
  auto quick = script_run(dir, "sleep 0.2; exit 1");
  const auto q = mingpt::run_probe(quick);
  EXPECT_EQ(q.outcome, mingpt::ProbeResult::Outcome::kFailed);
}

// A run that ignores SIGTERM, with a child of its own: after the grace both
// are killed (SIGKILL to the run's process group), none left running.
TEST(Probe, ARunIgnoringSigtermIsKilledWithItsGroup) {
  mingpt::ScratchDir dir(mingpt::temp_parent(), "probe-test");
  const std::string pid_file = dir.path() + "/child.pid";
  auto run = script_run(dir, "trap '' TERM\nsleep 60 &\necho $! > " + pid_file + "\nwait");
  run.timeout_s = 10;  // its trap and pid file come well before
  run.grace_s = 0.5;
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = mingpt::run_probe(run);
  EXPECT_LT(seconds_since(t0), 45.0);
  EXPECT_EQ(r.outcome, mingpt::ProbeResult::Outcome::kTimedOut);
  EXPECT_EQ(r.status, 128 + SIGKILL);
  pid_t child = 0;
  std::ifstream(pid_file) >> child;
  ASSERT_GT(child, 0);
  // SIGKILL is delivered at once, but give the kernel a moment.
  bool gone = false;
  for (int i = 0; i < 1500 && !gone; ++i) {
    gone = ended(child);
    if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(gone) << "the run's child " << child << " is still running";
  if (!gone) ::kill(child, SIGKILL);
}

// A stop signal ends the search within seconds whatever its run does: a run
// that ignores the SIGTERM passed on is killed with its group 10 s later
// (1000 ranks on 2 cores used to keep a search going for 14 minutes).
TEST(Probe, AStopSignalEndsARunThatIgnoresIt) {
  mingpt::ScratchDir dir(mingpt::temp_parent(), "probe-test");
  const std::string started = dir.path() + "/started", child_pid = dir.path() + "/child.pid";
  auto run = script_run(dir, "trap '' TERM\nsleep 600 &\necho $! > " + child_pid + "\ntouch " + started + "\nwait");
  mingpt::CatchStopSignals stop;
  std::chrono::steady_clock::time_point signalled;
  std::thread signaller([&] {
    for (int i = 0; i < 1200 && ::access(started.c_str(), F_OK) != 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    signalled = std::chrono::steady_clock::now();
    ::kill(::getpid(), SIGTERM);
  });
  bool interrupted = false;
  try {
    mingpt::run_probe(run);
  } catch (const mingpt::Interrupted& e) {
    interrupted = e.signal() == SIGTERM;
  }
  signaller.join();
  EXPECT_TRUE(interrupted);
  // The 10 s grace, not the run's 600 s (the bound only a hang would pass).
  EXPECT_LT(seconds_since(signalled), 120.0);
  pid_t child = 0;
  std::ifstream(child_pid) >> child;
  ASSERT_GT(child, 0);
  bool gone = false;
  for (int i = 0; i < 1500 && !gone; ++i) {
    gone = ended(child);
    if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(gone) << "the run's child " << child << " outlived the stopped search";
}

}  // namespace
