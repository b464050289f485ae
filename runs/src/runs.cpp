#include "zero/runs/runs.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <array>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <iterator>
#include <sstream>

#include <nlohmann/json.hpp>

#include "zero/core/error.h"
#include "zero/core/process.h"
#include "zero/snapshots/checkpoint_format.h"


namespace zero::runs {
namespace {

// The run in flight and the first stop signal seen while it runs (the
// handler may only touch these).
volatile sig_atomic_t g_child = 0;
volatile sig_atomic_t g_signal = 0;

// A run still going this long after a stop signal was passed on is killed
// (its process group; zero launch's ranks by their parent-death signal).
constexpr double kStopGraceS = 10;

// Every stop signal is passed on (a second Ctrl-C reaches zero launch,
// which then ends its ranks at once), SIGHUP as SIGTERM: zero launch ends
// its ranks on SIGINT and SIGTERM, and would die of a SIGHUP, leaving them.
void forward_signal(int sig) {
  if (g_signal == 0) g_signal = sig;
  if (g_child > 0) ::kill(static_cast<pid_t>(g_child), sig == SIGHUP ? SIGTERM : sig);
}

// The last line of a run's output that reports running out of memory (a
// program's own error line, "[rank N] mingpt: out of memory on the device:
// ...", or an uncaught error's), without its "[rank N] " prefix; "" when
// there is none. A warning that mentions memory is not one.
std::string out_of_memory_line(const std::string& text) {
  std::istringstream in(text);
  std::string found;
  for (std::string line; std::getline(in, line);) {
    if (line.find("out of memory") == std::string::npos && out_of_memory_tier(line).empty()) continue;
    if (line.find("warning") != std::string::npos) continue;
    if (line.rfind("[rank ", 0) == 0) {
      const auto close = line.find("] ");
      if (close != std::string::npos) line = line.substr(close + 2);
    }
    found = line;
  }
  return found;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

std::string shell_word(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./=:,+@%") ==
                        std::string::npos)
    return s;
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

constexpr std::array<int, 3> kStopSignals = {SIGINT, SIGTERM, SIGHUP};

CatchStopSignals::CatchStopSignals() {
  struct sigaction sa {};
  sa.sa_handler = forward_signal;
  sigemptyset(&sa.sa_mask);
  for (size_t i = 0; i < kStopSignals.size(); ++i) ::sigaction(kStopSignals[i], &sa, &old_[i]);
  if (old_[0].sa_handler != forward_signal) g_signal = 0;  // the outermost: a fresh start
}

CatchStopSignals::~CatchStopSignals() {
  for (size_t i = 0; i < kStopSignals.size(); ++i) ::sigaction(kStopSignals[i], &old_[i], nullptr);
}

void check_stop() {
  if (g_signal != 0) throw Interrupted(g_signal);
}

Interrupted::Interrupted(int signal)
    : std::runtime_error(std::string("interrupted by ") + (signal == SIGINT ? "SIGINT" : signal == SIGTERM ? "SIGTERM" : "SIGHUP")),
      signal_(signal) {}

std::string temp_parent() {
  const char* tmp = std::getenv("TMPDIR");
  return tmp && *tmp ? tmp : "/tmp";
}

namespace {
constexpr const char* kScratchLock = ".owner";

// Takes the exclusive lock of `dir`'s owner file without waiting; -1 when
// another process holds it (or there is no such file: a folder being made).
int lock_scratch(const std::string& dir, bool create) {
  const std::string path = dir + "/" + kScratchLock;
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | (create ? O_CREAT : 0), 0644);
  if (fd < 0) return -1;
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}
}  // namespace

std::vector<std::string> remove_abandoned_scratch(const std::string& parent, const std::string& prefix) {
  std::vector<std::string> removed;
  std::vector<std::string> names;
  try {
    names = ckpt::list_folder(parent);
  } catch (const std::exception&) {
    return removed;
  }
  for (const auto& name : names) {
    if (name.rfind(prefix + "-", 0) != 0 || name.size() != prefix.size() + 7) continue;  // prefix-XXXXXX
    const std::string dir = parent + "/" + name;
    const int fd = lock_scratch(dir, /*create=*/false);
    if (fd < 0) continue;  // its owner lives (or is making it)
    try {
      ckpt::remove_tree(dir);
      removed.push_back(dir);
    } catch (const std::exception&) {
    }
    ::close(fd);
  }
  return removed;
}

ScratchDir::ScratchDir(const std::string& parent, const std::string& prefix) {
  for (const auto& dir : remove_abandoned_scratch(parent, prefix))
    std::fprintf(stderr, "removed %s, the scratch folder of a run that was killed\n", dir.c_str());
  std::string pattern = parent + "/" + prefix + "-XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr)
    throw IoError("cannot make a scratch folder " + pattern + ": " + std::strerror(errno));
  path_ = pattern;
  lock_fd_ = lock_scratch(path_, /*create=*/true);
  if (lock_fd_ < 0) {
    const int err = errno;
    ::rmdir(path_.c_str());
    throw IoError("cannot lock the scratch folder " + path_ + ": " + std::strerror(err));
  }
}

ScratchDir::~ScratchDir() {
  try {
    ckpt::remove_tree(path_);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cannot remove the scratch folder %s: %s\n", path_.c_str(), e.what());
  }
  if (lock_fd_ >= 0) ::close(lock_fd_);
}

std::string signal_name(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  const char* what = ::sigdescr_np(sig);
  return (abbrev != nullptr ? "SIG" + std::string(abbrev) : "signal " + std::to_string(sig)) + " (signal " +
         std::to_string(sig) + (what != nullptr ? ", " + std::string(what) : std::string()) + ")";
}

std::string output_path_problem(const std::string& flag, const std::string& path) {
  return ckpt::output_file_problem(flag, path);
}

std::string too_many_ranks(const std::string& flag, int64_t n, bool oversubscribe) {
  const int cpus = usable_cpus();
  const int64_t limit = int64_t{4} * cpus;
  if (oversubscribe || n <= limit) return "";
  return flag + " " + std::to_string(n) + ": more than " + std::to_string(limit) + " ranks (4 per processor; this "
         "machine runs this process on " + std::to_string(cpus) + ") would thrash; give --oversubscribe if you mean it";
}

std::string last_lines(const std::string& text, size_t max_lines) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (const auto cr = line.rfind('\r'); cr != std::string::npos) line = line.substr(cr + 1);  // a progress redraw
    if (!line.empty()) lines.push_back(line);
  }
  std::string out;
  for (size_t i = lines.size() > max_lines ? lines.size() - max_lines : 0; i < lines.size(); ++i) out += lines[i] + "\n";
  return out;
}

int run_logged(const std::vector<std::string>& argv, const std::string& log, double timeout_s, double grace_s,
               bool* timed_out, const std::vector<std::string>* env, int* killed_by) {
  if (timed_out != nullptr) *timed_out = false;
  if (killed_by != nullptr) *killed_by = 0;
  CatchStopSignals stop;
  check_stop();  // one that came before this run
  const int in = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  const int out = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (in < 0 || out < 0) {
    const int err = errno;
    if (in >= 0) ::close(in);
    if (out >= 0) ::close(out);
    throw IoError("open " + (in < 0 ? std::string("/dev/null") : log) + ": " + std::strerror(err));
  }
  SpawnOptions so;
  so.argv = argv;
  so.env = env;
  so.stdin_fd = in;
  so.stdout_fd = so.stderr_fd = out;
  // Its own group: a terminal's Ctrl-C reaches us only, and we pass it on
  // once. Supervised (NOTE [supervised runs]): the signals we send reach the
  // program's whole process group, what the program leaves running when it
  // ends is ended, and all of it ends if this process is killed outright.
  so.own_group = true;
  so.supervised = true;
  so.grace_ms = static_cast<int>(std::min(grace_s, kStopGraceS) * 1000);
  pid_t pid = 0;
  try {
    pid = spawn_process(so);
  } catch (...) {
    ::close(in);
    ::close(out);
    throw;
  }
  ::close(in);
  ::close(out);
  g_child = pid;
  if (g_signal != 0) ::kill(pid, g_signal == SIGHUP ? SIGTERM : g_signal);  // arrived while it was being started
  // A poll every 20 ms: past the limit SIGTERM, past the grace SIGKILL to
  // the run's group (through its supervisor). A stop signal (passed on by
  // the handler) gets the same grace, counted from its arrival, so a search
  // ends within it whatever its run does; a launcher killed so ends its
  // ranks by their parent-death signal.
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  std::optional<Clock::time_point> stop_seen, kill_sent;
  enum { kRunning, kTermSent, kKillSent } stage = kRunning;
  int status = 0;
  for (;;) {
    const pid_t got = ::waitpid(pid, &status, WNOHANG);
    if (got == pid) break;
    if (got < 0 && errno != EINTR) {
      g_child = 0;
      throw IoError(std::string("waitpid: ") + std::strerror(errno));
    }
    const auto now = Clock::now();
    const double waited = std::chrono::duration<double>(now - start).count();
    if (g_signal != 0 && !stop_seen) stop_seen = now;
    const bool stop_overdue =
        stop_seen && std::chrono::duration<double>(now - *stop_seen).count() >= std::min(grace_s, kStopGraceS);
    if (stage == kRunning && timeout_s > 0 && waited >= timeout_s) {
      if (timed_out != nullptr) *timed_out = true;
      ::kill(pid, SIGTERM);  // the supervisor passes it to the whole group
      stage = kTermSent;
    } else if (stage != kKillSent && (stop_overdue || (stage == kTermSent && waited >= timeout_s + grace_s))) {
      ::kill(pid, kSupervisorKill);  // SIGKILL to the program's group
      stage = kKillSent;
      kill_sent = now;
    } else if (stage == kKillSent && std::chrono::duration<double>(now - *kill_sent).count() > 5) {
      ::kill(-pid, SIGKILL);  // a supervisor that did not end: the last resort
    }
    const struct timespec tick = {0, 20 * 1000 * 1000};
    ::nanosleep(&tick, nullptr);
  }
  g_child = 0;
  if (g_signal != 0) throw Interrupted(g_signal);
  if (WIFSIGNALED(status) && killed_by != nullptr) *killed_by = WTERMSIG(status);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::vector<std::string> environment_without_protocol() {
  const std::vector<std::string> ours = {"ZERO_RUN_REPORT", "ZERO_STOP_AFTER_STEPS", "ZERO_DEVICE_MEMORY",
                                         "ZERO_HOST_MEMORY", "ZERO_NVME_BYTES"};
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    if (std::find(ours.begin(), ours.end(), entry.substr(0, entry.find('='))) == ours.end()) env.push_back(entry);
  }
  return env;
}

ProbeResult run_probe(const ProbeRun& run) {
  ProbeResult r;
  std::vector<std::string> argv;
  const int64_t world = run.nproc * run.nnodes;
  if (run.nnodes > 1)
    argv = {run.launcher, "launch", "--nnodes", std::to_string(run.nnodes), "--nproc_per_node", std::to_string(run.nproc),
            "--emulate_nodes", "--"};
  else if (run.nproc > 1)
    argv = {run.launcher, "launch", "--nproc_per_node", std::to_string(run.nproc), "--"};
  argv.insert(argv.end(), run.argv.begin(), run.argv.end());
  // This process's environment less the protocol's variables, then the run's.
  std::vector<std::string> env = environment_without_protocol(), told;
  told.push_back("ZERO_RUN_REPORT=" + run.report_path);
  if (run.stop_after_steps) told.push_back("ZERO_STOP_AFTER_STEPS=" + std::to_string(*run.stop_after_steps));
  if (run.device_budget) told.push_back("ZERO_DEVICE_MEMORY=" + std::to_string(*run.device_budget));
  if (run.host_budget) told.push_back("ZERO_HOST_MEMORY=" + std::to_string(*run.host_budget));
  if (run.nvme_budget) told.push_back("ZERO_NVME_BYTES=" + std::to_string(*run.nvme_budget));
  told.insert(told.end(), run.env.begin(), run.env.end());
  env.insert(env.end(), told.begin(), told.end());
  for (const auto& e : told) r.command += shell_word(e) + " ";
  for (size_t i = 0; i < argv.size(); ++i) r.command += (i ? " " : "") + shell_word(argv[i]);
  for (int64_t rank = 0; rank < world; ++rank) std::remove(run_report_path(run.report_path, rank).c_str());
  const auto t0 = std::chrono::steady_clock::now();
  bool timed_out = false;
  int killed_by = 0;
  r.status = run_logged(argv, run.log_path, run.timeout_s, run.grace_s, &timed_out, &env, &killed_by);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string text = read_text(run.log_path);
  if (timed_out) {
    char limit[32];
    std::snprintf(limit, sizeof limit, "%g", run.timeout_s);
    r.outcome = ProbeResult::Outcome::kTimedOut;
    r.message = std::string("still running after its time limit of ") + limit + " s, so it was stopped\n" +
                last_lines(text, 15);
    return r;
  }
  // Every rank's report; a rank that ran out of memory says so in its own
  // (the launcher's status is the first failing rank's, which may be a
  // peer's that lost it in a collective).
  std::string report_problem;
  for (int64_t rank = 0; rank < world; ++rank) {
    const std::string path = run_report_path(run.report_path, rank);
    if (!ckpt::path_exists(path)) {
      if (report_problem.empty()) report_problem = "rank " + std::to_string(rank) + " wrote no run report " + path;
      continue;
    }
    try {
      r.reports.push_back(read_run_report(path));
    } catch (const IoError& e) {
      if (report_problem.empty()) report_problem = e.what();
    }
  }
  for (const auto& rep : r.reports)
    if (rep.outcome == "out_of_memory") {
      r.outcome = ProbeResult::Outcome::kOutOfMemory;
      r.oom_tier = rep.error_tier;
      r.message = "rank " + std::to_string(rep.rank) + ": " + rep.error_message;
      return r;
    }
  const std::string oom_line = out_of_memory_line(text);
  if (r.status != 0 && (r.status == kOutOfMemoryStatus || !oom_line.empty())) {
    r.outcome = ProbeResult::Outcome::kOutOfMemory;
    r.message = oom_line.empty() ? "out of memory" : oom_line;
    r.oom_tier = out_of_memory_tier(r.message);
    return r;
  }
  if (r.status != 0) {
    // A program killed by a signal says so (its log may end mid-line).
    if (killed_by != 0) r.message = "it was killed by " + signal_name(killed_by) + "\n";
    r.message += last_lines(text, 15);
    return r;
  }
  if (!report_problem.empty()) {
    r.message = "it ended with status 0 but " + report_problem +
                " (does the program call zero::initialize and keep its engine to the end?)\n" + last_lines(text, 15);
    r.reports.clear();
    return r;
  }
  const RunReport& first = r.reports.front();
  r.step_times = first.step_time_s;
  r.samples_per_step = first.samples_per_step;
  r.tokens_per_step = first.tokens_per_step;
  double sum = 0;
  size_t count = 0;
  for (size_t i = r.step_times.size() > 1 ? 1 : 0; i < r.step_times.size(); ++i) sum += r.step_times[i], ++count;
  r.step_s = count ? sum / static_cast<double>(count) : 0;
  std::map<int64_t, double> node_across;
  for (const auto& rep : r.reports) {
    r.peak_device = std::max(r.peak_device, rep.peak("device"));
    // The peak of pinned and pageable together (older reports: the sum of their peaks).
    const int64_t host = rep.json.at("peak_bytes").contains("host_total") ? rep.peak("host_total")
                                                                           : rep.peak("pinned_host") + rep.peak("host");
    r.peak_host = std::max(r.peak_host, host);
    r.peak_nvme = std::max(r.peak_nvme, rep.peak("nvme"));
    const auto b = rep.json.find("collective_bytes");
    auto number = [&](const char* k) { return b->contains(k) && b->at(k).is_number(); };
    if (b == rep.json.end() || !b->is_object() || !number("node") || !number("across_nodes_per_step") ||
        !number("within_node_per_step")) {
      r.bytes_counted = false;
      continue;
    }
    const double across = b->at("across_nodes_per_step").get<double>();
    r.within_node_per_step += b->at("within_node_per_step").get<double>();
    r.across_nodes_per_step += across;
    node_across[b->at("node").get<int64_t>()] += across;
  }
  for (const auto& [node, bytes] : node_across) r.busiest_node_across_per_step = std::max(r.busiest_node_across_per_step, bytes);
  if (run.stop_after_steps && *run.stop_after_steps == 0) {  // a description run: nothing to train
    r.outcome = ProbeResult::Outcome::kTrained;
    return r;
  }
  if (r.step_times.empty()) {
    r.message = "it trained no optimizer step\n" + last_lines(text, 15);
    return r;
  }
  // fp16's first steps may all overflow and be skipped: then no optimizer
  // step ran (no CPU Adam, no swap of states) and the peak is short of one.
  if (run.need_applied_step && first.skipped_steps >= static_cast<int64_t>(r.step_times.size())) {
    r.message = "every optimizer step was skipped (fp16 overflow), so its peak lacks an optimizer step: run more "
                "steps or lower fp16.initial_scale_power";
    return r;
  }
  r.outcome = ProbeResult::Outcome::kTrained;
  return r;
}

}  // namespace zero::runs
