// zero/runs/runs.h: how a short run of a search ends (trained, out of
// memory, failed, timed out), told apart from a script standing in for a
// training program and its run reports; a run past its time limit is
// stopped, and one that ignores SIGTERM is killed with its whole process
// group.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "zero/runs/runs.h"

namespace {

// A shell script in `dir` that runs `body`, and a ProbeRun of it.
zero::runs::ProbeRun script_run(const zero::runs::ScratchDir& dir, const std::string& body) {
  const std::string path = dir.path() + "/trainer.sh";
  std::ofstream(path) << "#!/bin/sh\n" << body << "\n";
  ::chmod(path.c_str(), 0755);
  zero::runs::ProbeRun run;
  run.argv = {path};
  run.report_path = dir.path() + "/report";
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

// A run report as the engine writes it (NOTE [run report]), for the script.
std::string report(const std::string& outcome, const std::string& extra) {
  return R"({"format": "zero-run-report", "version": 1, "rank": 0, "world_size": 1, "outcome": ")" + outcome +
         R"(", "steps": 3, "skipped_steps": 0, "step_time_s": [0.5, 0.2, 0.4], "samples_per_step": 8,
             "tokens_per_step": 64, "samples_per_s": 26.7, "tokens_per_s": 213.3,
             "peak_bytes": {"device": 10, "pinned_host": 1, "host": 2, "nvme": 3})" + extra + "}";
}

TEST(Probe, OutcomesAreToldApart) {
  using Outcome = zero::runs::ProbeResult::Outcome;
  zero::runs::ScratchDir dir(zero::runs::temp_parent(), "probe-test");
  auto oom = script_run(dir, "echo 'warning: low memory'; echo 'mingpt: out of memory on the device: 12 MiB asked' >&2; exit 1");
  auto r = zero::runs::run_probe(oom);
  EXPECT_EQ(r.outcome, Outcome::kOutOfMemory);
  EXPECT_EQ(r.message, "mingpt: out of memory on the device: 12 MiB asked");
  EXPECT_EQ(r.oom_tier, "device");

  // Out of memory inside a collective: the rank that ran out says so; its
  // peer's failure is not the story.
  auto in_collective = script_run(
      dir, "echo '[rank 1] mingpt: all_gather of 442368 Float elements on rank 1: out of memory on the device: 1.69 MiB "
           "asked' >&2; echo '[rank 0] mingpt: all_gather failed on rank 0: Connection closed by peer' >&2; exit 1");
  r = zero::runs::run_probe(in_collective);
  EXPECT_EQ(r.outcome, Outcome::kOutOfMemory);
  EXPECT_EQ(r.message, "mingpt: all_gather of 442368 Float elements on rank 1: out of memory on the device: 1.69 MiB asked");

  // Any program: the report says out of memory, and on which tier, though
  // the program printed nothing and caught the error.
  auto said = script_run(dir, "echo '" + report("out_of_memory", R"(, "error": {"tier": "host", "message": "out of memory on the host (pinned and pageable): ..."})") +
                                  "' > \"$ZERO_RUN_REPORT.rank0\"; exit 0");
  r = zero::runs::run_probe(said);
  EXPECT_EQ(r.outcome, Outcome::kOutOfMemory);
  EXPECT_EQ(r.oom_tier, "host");
  EXPECT_NE(r.message.find("rank 0: out of memory on the host"), std::string::npos) << r.message;

  auto failed = script_run(dir, "echo 'a warning about memory'; echo 'mingpt: cannot open data.txt' >&2; exit 1");
  r = zero::runs::run_probe(failed);
  EXPECT_EQ(r.outcome, Outcome::kFailed);
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.message.find("cannot open data.txt"), std::string::npos) << r.message;

  auto no_report = script_run(dir, "exit 0");
  r = zero::runs::run_probe(no_report);
  EXPECT_EQ(r.outcome, Outcome::kFailed);
  EXPECT_NE(r.message.find("rank 0 wrote no run report " + dir.path() + "/report.rank0"), std::string::npos) << r.message;

  // The environment carries the protocol: the report's path, the stop step
  // and the budgets.
  auto trained = script_run(dir, "echo \"$ZERO_STOP_AFTER_STEPS $ZERO_DEVICE_MEMORY $ZERO_HOST_MEMORY\" > " + dir.path() +
                                     "/env; echo '" + report("stopped", "") + "' > \"$ZERO_RUN_REPORT.rank0\"");
  trained.stop_after_steps = 3;
  trained.device_budget = 1000;
  trained.host_budget = 2000;
  r = zero::runs::run_probe(trained);
  EXPECT_EQ(r.outcome, Outcome::kTrained) << r.message;
  EXPECT_DOUBLE_EQ(r.step_s, 0.3);  // the first step left out
  EXPECT_EQ(r.samples_per_step, 8);
  EXPECT_EQ(r.tokens_per_step, 64);
  EXPECT_EQ(r.peak_device, 10);
  EXPECT_EQ(r.peak_host, 3);
  EXPECT_EQ(r.peak_nvme, 3);
  std::ifstream env(dir.path() + "/env");
  std::string line;
  std::getline(env, line);
  EXPECT_EQ(line, "3 1000 2000");
  EXPECT_NE(r.command.find("ZERO_STOP_AFTER_STEPS=3 "), std::string::npos) << r.command;
}

TEST(Probe, ARunPastItsTimeLimitIsStopped) {
  zero::runs::ScratchDir dir(zero::runs::temp_parent(), "probe-test");
  auto run = script_run(dir, "echo 'step 1 of 3'; exec sleep 60");
  run.timeout_s = 10;  // the shell's first line comes well before, loaded or not
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = zero::runs::run_probe(run);
  EXPECT_LT(seconds_since(t0), 45.0);  // not the script's 60 s
  EXPECT_EQ(r.outcome, zero::runs::ProbeResult::Outcome::kTimedOut);
  EXPECT_EQ(r.status, 128 + SIGTERM);
  EXPECT_NE(r.message.find("time limit of 10 s"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("step 1 of 3"), std::string::npos) << r.message;  // the log's last lines

  // No limit: the same kind of run ends on its own.
  auto quick = script_run(dir, "sleep 0.2; exit 1");
  const auto q = zero::runs::run_probe(quick);
  EXPECT_EQ(q.outcome, zero::runs::ProbeResult::Outcome::kFailed);
}

// A run that ignores SIGTERM, with a child of its own: after the grace both
// are killed (SIGKILL to the run's process group), none left running.
TEST(Probe, ARunIgnoringSigtermIsKilledWithItsGroup) {
  zero::runs::ScratchDir dir(zero::runs::temp_parent(), "probe-test");
  const std::string pid_file = dir.path() + "/child.pid";
  auto run = script_run(dir, "trap '' TERM\nsleep 60 &\necho $! > " + pid_file + "\nwait");
  run.timeout_s = 10;  // its trap and pid file come well before
  run.grace_s = 0.5;
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = zero::runs::run_probe(run);
  EXPECT_LT(seconds_since(t0), 45.0);
  EXPECT_EQ(r.outcome, zero::runs::ProbeResult::Outcome::kTimedOut);
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
  zero::runs::ScratchDir dir(zero::runs::temp_parent(), "probe-test");
  const std::string started = dir.path() + "/started", child_pid = dir.path() + "/child.pid";
  auto run = script_run(dir, "trap '' TERM\nsleep 600 &\necho $! > " + child_pid + "\ntouch " + started + "\nwait");
  zero::runs::CatchStopSignals stop;
  std::chrono::steady_clock::time_point signalled;
  std::thread signaller([&] {
    for (int i = 0; i < 1200 && ::access(started.c_str(), F_OK) != 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    signalled = std::chrono::steady_clock::now();
    ::kill(::getpid(), SIGTERM);
  });
  bool interrupted = false;
  try {
    zero::runs::run_probe(run);
  } catch (const zero::runs::Interrupted& e) {
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

// NOTE [supervised runs]: a run's own processes end with it. On a time
// limit the whole group gets SIGTERM (only the program's pid did, and a
// shell script's child kept running); a program that exits leaving a
// process behind has it ended, and the log says so.
TEST(Probe, TheProgramsOwnProcessesEndWithIt) {
  zero::runs::ScratchDir dir(zero::runs::temp_parent(), "probe-test");
  auto wait_gone = [](pid_t pid) {
    for (int i = 0; i < 6000; ++i) {  // returns as soon as it has ended
      if (ended(pid)) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  };
  const std::string pid_file = dir.path() + "/child.pid";
  auto timed = script_run(dir, "sleep 600 &\necho $! > " + pid_file + "\nwait");
  timed.timeout_s = 5;
  auto r = zero::runs::run_probe(timed);
  EXPECT_EQ(r.outcome, zero::runs::ProbeResult::Outcome::kTimedOut);
  pid_t child = 0;
  std::ifstream(pid_file) >> child;
  ASSERT_GT(child, 0);
  EXPECT_TRUE(wait_gone(child)) << "the run's child " << child << " outlived its time limit";
  if (!ended(child)) ::kill(child, SIGKILL);

  auto left = script_run(dir, "sleep 600 &\necho $! > " + pid_file + "\nexit 0");
  r = zero::runs::run_probe(left);
  child = 0;
  std::ifstream(pid_file) >> child;
  ASSERT_GT(child, 0);
  EXPECT_TRUE(wait_gone(child)) << "the process the program left (" << child << ") is still running";
  if (!ended(child)) ::kill(child, SIGKILL);
  std::ifstream log(left.log_path);
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find(") has ended and left processes of its own running: ending them"), std::string::npos) << text;
}

// A program killed by a signal is said to have been, not only shown by the
// last lines of its log.
TEST(Probe, ARunKilledByASignalSaysSo) {
  zero::runs::ScratchDir dir(zero::runs::temp_parent(), "probe-test");
  auto run = script_run(dir, "echo 'step 1'; kill -SEGV $$");
  const auto r = zero::runs::run_probe(run);
  EXPECT_EQ(r.outcome, zero::runs::ProbeResult::Outcome::kFailed);
  EXPECT_EQ(r.status, 128 + SIGSEGV);
  EXPECT_EQ(r.message.rfind("it was killed by SIGSEGV (signal 11", 0), 0u) << r.message;
}

}  // namespace
