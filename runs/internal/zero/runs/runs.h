// Runs of a training program in a child process, for the tools that train
// to find out (zero tune, zero memcheck, mingpt --find-max-params): any
// program that calls zero::initialize, on N ranks through zero launch, with
// the budgets and the stop given through the environment and its figures
// read back from the run report the engine writes (NOTE [run report]);
// the outcome told apart: trained, out of memory (with its tier), failed,
// timed out. Also the scratch folders and stop signals such a search needs.
#pragma once

#include <signal.h>

#include <array>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "zero/runs/run_report.h"

namespace zero::runs {

/// A search stopped by SIGINT, SIGTERM or SIGHUP (after its run ended).
class Interrupted : public std::runtime_error {
 public:
  explicit Interrupted(int signal);
  int signal() const noexcept { return signal_; }

 private:
  int signal_;
};

/// While one lives, SIGINT, SIGTERM and SIGHUP do not end this process: the
/// first is recorded, each is passed on to the run in flight (run_logged),
/// and check_stop() or the next run_logged throws Interrupted, so a search's
/// scratch folders go however it is stopped. Long work between runs calls
/// check_stop() now and then. Nests (the outermost resets).
class CatchStopSignals {
 public:
  CatchStopSignals();
  ~CatchStopSignals();
  CatchStopSignals(const CatchStopSignals&) = delete;
  CatchStopSignals& operator=(const CatchStopSignals&) = delete;

 private:
  std::array<struct sigaction, 3> old_{};
};

/// Throws Interrupted when a stop signal came while a CatchStopSignals lived.
void check_stop();

/// A fresh folder `parent/prefix-XXXXXX`, removed with everything in it when
/// this goes (so the runs' logs, summaries and swap files never stay). It
/// holds a lock (flock on its .owner file) while this lives; a process
/// killed outright cannot remove its folder, so each new ScratchDir first
/// removes the `prefix-*` folders in `parent` whose lock nobody holds.
class ScratchDir {
 public:
  ScratchDir(const std::string& parent, const std::string& prefix);
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int lock_fd_ = -1;
};

/// Removes the folders `parent/prefix-*` that a ScratchDir made and whose
/// owner is gone (their lock is free); returns their paths.
std::vector<std::string> remove_abandoned_scratch(const std::string& parent, const std::string& prefix);

/// $TMPDIR, or /tmp.
std::string temp_parent();

/// Runs argv (argv[0] a path, or a name looked up in PATH) in its own
/// process group with stdout and stderr into `log`, and returns its exit
/// status (128 + signal when a signal ended it). SIGINT, SIGTERM and SIGHUP
/// received meanwhile are passed on to the run (a terminal's Ctrl-C reaches
/// only this process: the run has its own group), SIGHUP as SIGTERM; when the
/// run has ended, Interrupted is thrown, so the caller's ScratchDir goes
/// (CatchStopSignals). A run still going min(`grace_s`, 10 s) after a stop
/// signal gets SIGKILL to its process group. With `timeout_s` > 0 a run
/// still going after that long gets SIGTERM (zero launch passes it to its
/// ranks and ends them), and SIGKILL to its process group `grace_s` later;
/// `*timed_out` then says so. The run gets SIGTERM if this process dies
/// (its parent-death signal), and zero launch's ranks get it if the launcher
/// dies: a search killed outright leaves no run going.
/// `env` (may be null): the run's environment, NAME=VALUE entries.
/// The program runs supervised (NOTE [supervised runs]): signals reach its
/// whole process group, and what it leaves running when it ends is ended.
/// `*killed_by` (may be null): the signal that ended the run, or 0.
int run_logged(const std::vector<std::string>& argv, const std::string& log, double timeout_s = 0,
               double grace_s = 20, bool* timed_out = nullptr, const std::vector<std::string>* env = nullptr,
               int* killed_by = nullptr);

/// "SIGSEGV (signal 11, Segmentation fault)".
std::string signal_name(int sig);

/// What to run: `argv` (a program and its arguments), on `nproc` ranks
/// through `launcher launch --nproc_per_node N --` when nproc > 1, with
/// ZERO_RUN_REPORT set to `report_path` and the budgets and stop step in
/// the environment (NOTE [run report]).
struct ProbeRun {
  std::string launcher;  // the zero binary
  int64_t nproc = 1;  // ranks a node
  /// Nodes of nproc ranks, all on this machine (zero launch --emulate_nodes).
  int64_t nnodes = 1;
  std::vector<std::string> argv;
  std::string report_path, log_path;
  std::optional<int64_t> stop_after_steps;
  std::optional<int64_t> device_budget, host_budget, nvme_budget;  // ZERO_DEVICE_MEMORY, ...
  std::vector<std::string> env;  // more NAME=VALUE entries
  /// A run whose every step was skipped (fp16 overflow) fails: its peak
  /// lacks an optimizer step. false: it trained (a run that reads the model).
  bool need_applied_step = true;
  double timeout_s = 0;  // a run longer than this is stopped (kTimedOut); 0: no limit
  double grace_s = 20;   // then SIGTERM, and SIGKILL this much later
};

struct ProbeResult {
  enum class Outcome { kTrained, kOutOfMemory, kFailed, kTimedOut };
  Outcome outcome = Outcome::kFailed;
  int status = 0;
  std::string message;            // out of memory: the error's line; failed, timed out: the log's last lines
  std::string oom_tier;           // out of memory: device, pinned_host, host, nvme ("" when not said)
  std::string command;            // the command line, for messages
  std::vector<double> step_times;  // seconds, every optimizer step (rank 0's)
  double step_s = 0;               // mean over the steps after the first (the first, if only one)
  int64_t samples_per_step = 0;    // the global batch
  int64_t tokens_per_step = 0;     // global batch x tokens per sample (0: the program did not say)
  int64_t peak_device = 0, peak_host = 0, peak_nvme = 0;  // the largest over ranks; host: pinned + pageable
  /// NOTE [bytes across nodes]: a step's bytes sent within nodes and
  /// across them, summed over the ranks, and the most that one node's ranks
  /// sent across together.
  double within_node_per_step = 0, across_nodes_per_step = 0, busiest_node_across_per_step = 0;
  /// false when a rank's report has no such counts (a program built with
  /// an older zero): the sums above then leave it out.
  bool bytes_counted = true;
  std::vector<RunReport> reports;  // by rank, when every rank wrote one
  double seconds = 0;              // the run's wall time
  double samples_per_s() const { return step_s > 0 ? static_cast<double>(samples_per_step) / step_s : 0; }
  double tokens_per_s() const { return step_s > 0 ? static_cast<double>(tokens_per_step) / step_s : 0; }
};

/// The exit status mingpt and llama give an out-of-memory error (and c10's).
constexpr int kOutOfMemoryStatus = 3;

ProbeResult run_probe(const ProbeRun& run);

/// `s` as one word for a shell, quoted only when it needs it.
std::string shell_word(const std::string& s);

/// This process's environment without the run report's variables
/// (ZERO_RUN_REPORT, ZERO_STOP_AFTER_STEPS, the budgets): for runs that are
/// not told them (a bench's), so an exported one does not stop or cap them.
std::vector<std::string> environment_without_protocol();

/// Why `path`, an output file named by option `flag`, cannot be written
/// ("--out x/y.json: the folder x does not exist"), or "" when it can:
/// checked before a long run, not found out after it.
std::string output_path_problem(const std::string& flag, const std::string& path);

/// Why `n` ranks on this machine (option `flag`) are refused, or "": more
/// than four per usable processor starts a run that thrashes for minutes
/// (each rank loads LibTorch), unless `oversubscribe` says it is meant.
std::string too_many_ranks(const std::string& flag, int64_t n, bool oversubscribe);

/// The last `max_lines` lines of a run's output that say something: no
/// progress redraws (up to a carriage return), no empty lines.
std::string last_lines(const std::string& text, size_t max_lines);

}  // namespace zero::runs
