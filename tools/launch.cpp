// zero launch: N local ranks of a program with torchrun's environment.
//
// One thread runs everything: a poll() loop over a signalfd (SIGCHLD, SIGINT,
// SIGTERM, SIGHUP) and the pipes that carry the ranks' stdout and stderr. With a
// single writer, lines from different ranks cannot interleave mid-line, and no
// lock or second thread is needed.
//
// NOTE [launch signals]
// SIGINT, SIGTERM, SIGHUP and SIGCHLD are blocked in the calling thread and
// read from a signalfd, so a signal is an ordinary poll() event rather than a
// handler.
// This needs every other thread of the process to block them too; the `zero`
// binary runs launch() from main() before anything starts a thread. SIGCHLD is
// set to its default (an inherited SIG_IGN would make the kernel reap the
// ranks before we see their status) and SIGPIPE is ignored (a reader of our
// stdout that goes away must not kill the launcher and orphan the ranks).
// The ranks start with an empty signal mask and SIGPIPE/SIGCHLD at default,
// and with a parent-death signal (PR_SET_PDEATHSIG, SIGTERM): a launcher
// killed with SIGKILL, which can forward nothing, still ends its ranks (the
// rank's own process; what it started hears of it from the rank). The same
// holds one level up: zero tune and mingpt --find-max-params start zero
// launch with it.
//
// NOTE [launch shutdown]
// Each rank leads its own process group (pgid == its pid), so a signal to the
// group also reaches whatever the program started. A rank's exit is noticed
// with waitid(WNOWAIT): it stays a zombie, unreaped, until every rank has
// exited. While the zombie exists its pid cannot be handed to a new process,
// so signalling the group id never hits an unrelated process.
//   - The first rank that exits non-zero (or is killed) is reported; every
//     rank still running gets SIGTERM; --kill-timeout later, SIGKILL.
//   - SIGINT/SIGTERM to the launcher are forwarded to every group, followed by
//     the same timeout and SIGKILL; a second one sends SIGKILL at once. SIGHUP
//     (a closed terminal or ssh session) is forwarded as SIGTERM: the ranks
//     would otherwise outlive the launcher that died of it.
//   - When every rank's leader has exited, what is left in the groups gets
//     SIGKILL, the ranks are reaped, and the pipes are drained (up to
//     kDrainTimeout, in case something escaped its group and holds a pipe).
#include "launch.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "zero/core/error.h"
#include "zero/core/process.h"
#include "zero/core/text.h"

extern char** environ;

namespace zero::tools {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr milliseconds kDefaultKillTimeout{5000};
constexpr milliseconds kDrainTimeout{1000};
// A rank's line longer than this is emitted in pieces rather than buffered
// without bound.
constexpr size_t kMaxLineBytes = 64 * 1024;

const char* kLaunchUsage = R"(usage: zero launch [OPTIONS] [--] PROGRAM ARGS...

Starts N local ranks of PROGRAM, as torchrun does on a node: each rank gets
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE,
ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and OMP_NUM_THREADS if
unset). Output lines are prefixed with "[rank K] ". When a rank fails, the
others get SIGTERM, then SIGKILL after the kill timeout; the exit code is the
failing rank's (128 + signal if it was killed). Processes the ranks leave
behind in their process groups are killed when the ranks exit. SIGINT and
SIGTERM are passed on to the ranks, SIGHUP as SIGTERM; a launcher that is
killed outright ends its ranks too (each gets SIGTERM). Several nodes: run
one launcher per node with the same --nnodes, --master_addr (node 0's
address) and --master_port, and each node's --node_rank; or, to try a
multi-node config on one machine, one launcher with --emulate_nodes.

options:
  --nproc_per_node N      ranks to start on this node (default 1)
  --nnodes N              nodes in the job (default 1)
  --node_rank K           this node's index, 0..N-1 (default 0): its ranks are
                          K*nproc_per_node ... (K+1)*nproc_per_node-1
  --master_addr ADDR      MASTER_ADDR (default 127.0.0.1; required with --nnodes
                          but for --emulate_nodes)
  --master_port PORT      MASTER_PORT (default: one node or --emulate_nodes, a
                          free port on 127.0.0.1; several, 29500 as torchrun's)
  --emulate_nodes         start every node's ranks here, over loopback: rank R
                          is on node R / nproc_per_node (its GROUP_RANK, as that
                          node's own launcher would give it), so the node-aware
                          keys (zero_hpz_partition_size, mics_shard_size, the
                          bytes across nodes) act as on --nnodes machines; not
                          with --node_rank or --master_addr. On GPUs rank R
                          takes cuda:LOCAL_RANK, as another node's rank does
                          (NCCL refuses that: ZERO_DIST_BACKEND=gloo, or the
                          CPU); the default pinned-memory limit is then half
                          the memory over one node's ranks, not all of them
  --kill-timeout SECONDS  SIGTERM-to-SIGKILL grace period (default 5)
  -h, --help              this text
)";

// ---------------------------------------------------------------- errors

// A command line that cannot be used; launch() prints it with the usage, exit 2.
class UsageError : public std::runtime_error {
 public:
  explicit UsageError(const std::string& message) : std::runtime_error(message) {}
};

[[noreturn]] void throw_system(const std::string& operation, int err) {
  throw IoError(operation + ": " + std::strerror(err));
}

// ---------------------------------------------------------------- small RAII

// A file descriptor that closes itself. Move-only.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

struct Pipe {
  UniqueFd read;
  UniqueFd write;
};

// Both ends close-on-exec: the child gets its end through a dup2 onto 1 or 2,
// which clears the flag, and no rank inherits another rank's pipes.
Pipe make_pipe(const std::string& what) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw_system("pipe2 for " + what, errno);
  return {UniqueFd(fds[0]), UniqueFd(fds[1])};
}

// Writes all of `data` to `fd`. Our own stdout or stderr going away (EPIPE) is
// not a reason to stop the ranks, so write errors drop the data.
void write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

// "SIGKILL", or "signal 42" for one without a name.
std::string signal_name(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev != nullptr ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

// See NOTE [launch signals]. Blocks SIGINT/SIGTERM/SIGHUP/SIGCHLD in the calling
// thread and reads them through a signalfd; restores the mask and the
// SIGCHLD/SIGPIPE dispositions on destruction. One per launch() call.
class SignalScope {
 public:
  SignalScope() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGHUP);
    sigaddset(&set, SIGCHLD);
    // The only call here that can fail for a reason other than a bug goes
    // first, so that a throw leaves nothing to undo.
    fd_ = UniqueFd(::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK));
    if (fd_.get() < 0) throw_system("signalfd for SIGINT, SIGTERM, SIGHUP, SIGCHLD", errno);
    struct sigaction dfl = {};
    dfl.sa_handler = SIG_DFL;
    ::sigaction(SIGCHLD, &dfl, &old_sigchld_);
    struct sigaction ign = {};
    ign.sa_handler = SIG_IGN;
    ::sigaction(SIGPIPE, &ign, &old_sigpipe_);
    ::pthread_sigmask(SIG_BLOCK, &set, &old_mask_);
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;
  ~SignalScope() {
    fd_.reset();
    ::sigaction(SIGCHLD, &old_sigchld_, nullptr);
    ::sigaction(SIGPIPE, &old_sigpipe_, nullptr);
    ::pthread_sigmask(SIG_SETMASK, &old_mask_, nullptr);
  }

  int fd() const { return fd_.get(); }

  // The signals received since the last call, in order.
  std::vector<int> take() {
    std::vector<int> signals;
    signalfd_siginfo info;
    while (::read(fd_.get(), &info, sizeof info) == static_cast<ssize_t>(sizeof info)) {
      signals.push_back(static_cast<int>(info.ssi_signo));
    }
    return signals;
  }

 private:
  UniqueFd fd_;
  struct sigaction old_sigchld_ = {};
  struct sigaction old_sigpipe_ = {};
  sigset_t old_mask_;
};

// ---------------------------------------------------------------- ranks

// How a rank ended.
struct ExitStatus {
  bool signaled = false;
  int value = 0;  // exit status, or the signal number when signaled
  bool core_dumped = false;

  bool ok() const { return !signaled && value == 0; }
  int exit_code() const { return signaled ? 128 + value : value; }
};

// One rank: a child process leading its own process group, stdout and stderr
// redirected to the given descriptors. Move-only. The destructor SIGKILLs the
// group and reaps the child unless reap() already did. Exits are observed
// without reaping (NOTE [launch shutdown]). Not thread-safe.
class ChildProcess {
 public:
  // Starts argv[0], searched in PATH, with environment `env`, leading its
  // own process group, with SIGTERM as its parent-death signal (NOTE
  // [launch signals]). Throws SpawnError when the program cannot be
  // executed, IoError when fork or the setup fails.
  static ChildProcess spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                            int stdout_fd, int stderr_fd) {
    SpawnOptions o;
    o.argv = argv;
    o.env = &env;
    o.stdout_fd = stdout_fd;
    o.stderr_fd = stderr_fd;
    o.death_signal = SIGTERM;
    return ChildProcess(spawn_process(o));
  }

  ChildProcess(ChildProcess&& other) noexcept
      : pid_(std::exchange(other.pid_, -1)), exited_(other.exited_), status_(other.status_) {}
  ChildProcess& operator=(ChildProcess&&) = delete;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess() {
    if (pid_ < 0) return;
    ::kill(-pid_, SIGKILL);
    ::kill(pid_, SIGKILL);
    reap();
  }

  pid_t pid() const { return pid_; }
  bool exited() const { return exited_; }
  const ExitStatus& status() const { return status_; }

  // True once the child has exited (checked without blocking, without reaping).
  bool poll_exit() {
    if (exited_) return true;
    siginfo_t info = {};
    if (::waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | WNOWAIT) != 0) {
      if (errno == EINTR) return false;
      throw_system("waitid for pid " + std::to_string(pid_), errno);
    }
    if (info.si_pid != pid_) return false;
    exited_ = true;
    status_.signaled = info.si_code != CLD_EXITED;
    status_.core_dumped = info.si_code == CLD_DUMPED;
    status_.value = info.si_status;
    return true;
  }

  // Sends `sig` to the child's process group (ESRCH, an empty group, is fine).
  void signal_group(int sig) {
    if (pid_ >= 0) ::kill(-pid_, sig);
  }

  // Waits for the child and releases its pid. Blocks until it exits.
  void reap() {
    if (pid_ < 0) return;
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
  }

 private:
  explicit ChildProcess(pid_t pid) : pid_(pid) {}

  pid_t pid_ = -1;  // -1 once reaped
  bool exited_ = false;
  ExitStatus status_;
};

// ---------------------------------------------------------------- output

// Re-emits the ranks' output line by line with a "[rank K] " prefix: stdout
// lines on our stdout, stderr lines on our stderr; a partial last line is
// completed with a newline at EOF. Owns the pipes' read ends. The launcher's
// own messages go through message() so they never split a rank's line. Only
// the launcher's loop thread calls it.
class OutputPump {
 public:
  void add(int rank, UniqueFd fd, int target_fd) {
    streams_.push_back({std::move(fd), target_fd, "[rank " + std::to_string(rank) + "] ", {}});
  }

  // One pollfd per stream still open, after `into`'s existing entries.
  void append_pollfds(std::vector<pollfd>& into) const {
    for (const Stream& s : streams_) {
      if (s.fd.get() >= 0) into.push_back({s.fd.get(), POLLIN, 0});
    }
  }

  // Reads every stream that poll() marked in `ready` (entries of other fds
  // are ignored).
  void service(const std::vector<pollfd>& ready) {
    for (const pollfd& p : ready) {
      if ((p.revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      for (Stream& s : streams_) {
        if (s.fd.get() == p.fd) read_once(s);
      }
    }
  }

  bool any_open() const {
    return std::any_of(streams_.begin(), streams_.end(), [](const Stream& s) { return s.fd.get() >= 0; });
  }

  // Emits every partial line and closes every stream.
  void close_all() {
    for (Stream& s : streams_) finish(s);
  }

  // Writes "zero launch: LINE" to our stderr.
  void message(const std::string& line) { write_all(STDERR_FILENO, "zero launch: " + line + "\n"); }

 private:
  struct Stream {
    UniqueFd fd;
    int target_fd;
    std::string prefix;
    std::string partial;  // bytes after the last newline
  };

  void read_once(Stream& s) {
    char buffer[65536];
    ssize_t n = ::read(s.fd.get(), buffer, sizeof buffer);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n <= 0) {  // EOF, or an error that ends the stream just the same
      finish(s);
      return;
    }
    std::string out;
    size_t begin = 0;
    size_t search = s.partial.size();
    s.partial.append(buffer, static_cast<size_t>(n));
    for (size_t nl; (nl = s.partial.find('\n', search)) != std::string::npos; search = begin) {
      out += s.prefix;
      out.append(s.partial, begin, nl + 1 - begin);
      begin = nl + 1;
    }
    s.partial.erase(0, begin);
    if (s.partial.size() >= kMaxLineBytes) {
      out += s.prefix + s.partial + "\n";
      s.partial.clear();
    }
    write_all(s.target_fd, out);
  }

  void finish(Stream& s) {
    if (!s.partial.empty()) write_all(s.target_fd, s.prefix + s.partial + "\n");
    s.partial.clear();
    s.fd.reset();
  }

  std::vector<Stream> streams_;
};

// ---------------------------------------------------------------- options

struct LaunchOptions {
  bool help = false;
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  bool emulate_nodes = false;  // every node's ranks on this machine
  std::string master_addr = "127.0.0.1";
  std::optional<int> master_port;
  milliseconds kill_timeout = kDefaultKillTimeout;
  std::vector<std::string> command;  // PROGRAM ARGS...
};

int parse_int(const std::string& option, const std::string& value, int min, int max,
              const std::string& expected) {
  int result = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), result);
  if (ec != std::errc() || end != value.data() + value.size() || result < min || result > max) {
    throw UsageError(option + ": expected " + expected + "; got \"" + value + "\"");
  }
  return result;
}

milliseconds parse_seconds(const std::string& option, const std::string& value) {
  char* end = nullptr;
  errno = 0;
  double seconds = std::strtod(value.c_str(), &end);
  if (value.empty() || *end != '\0' || errno != 0 || !std::isfinite(seconds) || seconds < 0 ||
      seconds > 1e6) {
    throw UsageError(option + ": expected a number of seconds >= 0; got \"" + value + "\"");
  }
  return milliseconds(static_cast<int64_t>(std::llround(seconds * 1000)));
}

// "--nproc-per-node" and "--nproc_per_node" are the same option (torchrun
// takes both spellings); options are compared in the underscore form.
std::string canonical(const std::string& option) {
  std::string c = option;
  std::replace(c.begin() + std::min<size_t>(2, c.size()), c.end(), '-', '_');
  return c;
}

LaunchOptions parse_options(const std::vector<std::string>& args) {
  const std::vector<std::string> kNames = {"--nproc_per_node", "--nnodes", "--node_rank", "--master_addr",
                                           "--master_port", "--kill-timeout", "--emulate_nodes", "--help"};
  std::vector<std::string> given;
  LaunchOptions options;
  size_t i = 0;
  bool dashes = false;  // PROGRAM follows "--", or (as torchrun) is the first non-option
  for (; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      dashes = true;
      break;
    }
    if (arg == "-h" || arg == "--help") {
      options.help = true;
      return options;
    }
    if (arg.rfind("--", 0) != 0) break;
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(0, eq);
    const std::string key = canonical(name);
    auto known =
        std::find_if(kNames.begin(), kNames.end(), [&](const std::string& n) { return canonical(n) == key; });
    if (known == kNames.end()) {
      std::vector<std::string> candidates;  // compared in the canonical form, shown as spelled in kNames
      for (const std::string& n : kNames) candidates.push_back(canonical(n));
      const std::string near = zero::nearest(key, candidates);
      const auto at = std::find(candidates.begin(), candidates.end(), near) - candidates.begin();
      throw UsageError(name + ": unknown option" +
                       (near.empty() ? "" : "; did you mean " + kNames[static_cast<size_t>(at)] + "?"));
    }
    if (std::find(given.begin(), given.end(), *known) != given.end()) throw UsageError(*known + " given twice: give it once");
    given.push_back(*known);
    if (*known == "--emulate_nodes") {  // a flag
      if (eq != std::string::npos) throw UsageError("--emulate_nodes takes no value; got \"" + arg + "\"");
      if (i + 1 < args.size() && !args[i + 1].empty() &&
          std::all_of(args[i + 1].begin(), args[i + 1].end(), [](unsigned char c) { return std::isdigit(c); }))
        throw UsageError("--emulate_nodes takes no value; got \"" + args[i + 1] +
                         "\" after it (the nodes are --nnodes N)");
      options.emulate_nodes = true;
      continue;
    }
    std::string value;
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
    } else if (i + 1 < args.size() && args[i + 1] != "--") {
      value = args[++i];
    } else {
      throw UsageError(*known + ": expected a value");
    }
    if (*known == "--nproc_per_node") {
      options.nproc_per_node = parse_int(*known, value, 1, 1 << 16, "a number of ranks >= 1");
    } else if (*known == "--nnodes") {
      options.nnodes = parse_int(*known, value, 1, 1 << 16, "a number of nodes >= 1");
    } else if (*known == "--node_rank") {
      options.node_rank = parse_int(*known, value, 0, (1 << 16) - 1, "a node index >= 0");
    } else if (*known == "--master_addr") {
      if (value.empty()) throw UsageError("--master_addr: expected an address; got \"\"");
      options.master_addr = value;
    } else if (*known == "--master_port") {
      options.master_port = parse_int(*known, value, 1, 65535, "a port number in 1..65535");
    } else if (*known == "--kill-timeout") {
      options.kill_timeout = parse_seconds(*known, value);
    }
  }
  auto was_given = [&](const char* name) { return std::find(given.begin(), given.end(), name) != given.end(); };
  if (options.emulate_nodes && options.nnodes == 1)
    throw UsageError("--emulate_nodes goes with --nnodes N (N > 1): the nodes to start here");
  if (options.emulate_nodes && (was_given("--node_rank") || was_given("--master_addr")))
    throw UsageError(std::string("--emulate_nodes starts every node here, on 127.0.0.1: drop ") +
                     (was_given("--node_rank") ? "--node_rank" : "--master_addr"));
  if (options.nnodes > 1 && !options.emulate_nodes && !was_given("--master_addr"))
    throw UsageError("--nnodes " + std::to_string(options.nnodes) +
                     ": give --master_addr, node 0's address, the same on every node (127.0.0.1 when the nodes are "
                     "one machine)");
  if (options.node_rank >= options.nnodes)
    throw UsageError("--node_rank " + std::to_string(options.node_rank) + ": expected 0.." +
                     std::to_string(options.nnodes - 1) + " (--nnodes " + std::to_string(options.nnodes) + ")");
  if (static_cast<int64_t>(options.nnodes) * options.nproc_per_node > (1 << 20))
    throw UsageError("--nnodes x --nproc_per_node: at most " + std::to_string(1 << 20) + " ranks in all");
  if (i == args.size()) throw UsageError("expected PROGRAM ARGS... (or -- PROGRAM ARGS...) after the options");
  options.command.assign(args.begin() + static_cast<std::ptrdiff_t>(i) + (dashes ? 1 : 0), args.end());
  if (options.command.empty()) throw UsageError("expected a PROGRAM after --");
  return options;
}

// ---------------------------------------------------------------- environment

// A port nobody listens on now: bind port 0 on 127.0.0.1, read the port the
// kernel chose, close. (Rank 0's store binds it soon after; torchrun does the
// same and accepts the small race.)
int pick_free_port() {
  UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (s.get() < 0) throw_system("MASTER_PORT: socket(AF_INET, SOCK_STREAM) to pick a free port", errno);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (::bind(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    throw_system("MASTER_PORT: bind 127.0.0.1:0 to pick a free port", errno);
  }
  socklen_t len = sizeof addr;
  if (::getsockname(s.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throw_system("MASTER_PORT: getsockname on 127.0.0.1:0", errno);
  }
  return ntohs(addr.sin_port);
}

const std::vector<std::string> kRankVariables = {
    "RANK",      "LOCAL_RANK",      "WORLD_SIZE",  "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"};

// Our environment without the variables each rank gets its own value of.
std::vector<std::string> inherited_environment() {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry = *e;
    std::string name = entry.substr(0, entry.find('='));
    if (std::find(kRankVariables.begin(), kRankVariables.end(), name) == kRankVariables.end()) {
      env.push_back(std::move(entry));
    }
  }
  return env;
}

std::string describe(int rank, pid_t pid, const ExitStatus& status) {
  std::string head = "rank " + std::to_string(rank) + " (pid " + std::to_string(pid) + ") ";
  if (!status.signaled) return head + "exited with status " + std::to_string(status.value);
  return head + "was killed by signal " + signal_name(status.value) +
         (status.core_dumped ? " (core dumped)" : "");
}

// "1.5 s"
std::string format_seconds(milliseconds d) {
  char text[32];
  std::snprintf(text, sizeof text, "%g s", static_cast<double>(d.count()) / 1000.0);
  return text;
}

// ---------------------------------------------------------------- the run

int run(const LaunchOptions& options) {
  SignalScope signals;
  OutputPump pump;
  const int local_world = options.nproc_per_node;
  const int world_size = options.nnodes * local_world;
  const int first_rank = options.node_rank * local_world;
  // The ranks this launcher starts: its node's, or with --emulate_nodes every node's.
  const int started = options.emulate_nodes ? world_size : local_world;
  // One node picks a free port; the nodes of a job must agree on one, so
  // without --master_port they take torchrun's default.
  const int port = options.master_port                              ? *options.master_port
                   : options.nnodes > 1 && !options.emulate_nodes ? 29500
                                                                    : pick_free_port();

  std::vector<std::string> base_env = inherited_environment();
  // Emulated nodes: ZERO_NODE_ID, which overrides GROUP_RANK, would put every rank on one node.
  if (options.emulate_nodes)
    base_env.erase(std::remove_if(base_env.begin(), base_env.end(),
                                  [](const std::string& e) { return e.rfind("ZERO_NODE_ID=", 0) == 0; }),
                   base_env.end());
  // Configuration from the environment belongs to distributed start-up (STYLE.md); this is it.
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    const int cpus = usable_cpus();
    const int threads = std::max(1, cpus / started);
    pump.message("OMP_NUM_THREADS is not set; setting it to " + std::to_string(threads) + " for each rank (" +
                 std::to_string(cpus) + " CPUs / " + std::to_string(started) +
                 (options.emulate_nodes ? " ranks of every node on this machine" : " ranks on this node") +
                 "); set it yourself to choose another value");
    base_env.push_back("OMP_NUM_THREADS=" + std::to_string(threads));
  }
  auto add = [](std::vector<std::string>& env, const std::string& name, const std::string& value) {
    env.push_back(name + "=" + value);
  };
  add(base_env, "WORLD_SIZE", std::to_string(world_size));
  add(base_env, "LOCAL_WORLD_SIZE", std::to_string(local_world));
  add(base_env, "GROUP_WORLD_SIZE", std::to_string(options.nnodes));
  add(base_env, "ROLE_WORLD_SIZE", std::to_string(world_size));
  add(base_env, "MASTER_ADDR", options.master_addr);
  add(base_env, "MASTER_PORT", std::to_string(port));

  std::vector<ChildProcess> ranks;
  ranks.reserve(static_cast<size_t>(started));
  std::optional<int> exit_code;  // the first failure's
  for (int k = 0; k < started; ++k) {
    const int rank = first_rank + k;
    std::vector<std::string> env = base_env;
    add(env, "RANK", std::to_string(rank));
    add(env, "LOCAL_RANK", std::to_string(rank % local_world));
    add(env, "GROUP_RANK", std::to_string(rank / local_world));
    add(env, "ROLE_RANK", std::to_string(rank));
    const std::string which = "rank " + std::to_string(rank);
    Pipe out = make_pipe(which + "'s stdout");
    Pipe err = make_pipe(which + "'s stderr");
    try {
      ranks.push_back(ChildProcess::spawn(options.command, env, out.write.get(), err.write.get()));
    } catch (const SpawnError& e) {
      pump.message(zero::error_text(e));
      exit_code = 127;
      break;
    }
    pump.add(rank, std::move(out.read), STDOUT_FILENO);
    pump.add(rank, std::move(err.read), STDERR_FILENO);
    // The write ends close here: the pipes reach EOF when the rank's side closes.
  }

  bool shutting_down = false;
  bool killed = false;
  int launcher_signal = 0;
  Clock::time_point deadline;
  auto signal_running = [&](int sig) {
    for (ChildProcess& r : ranks) {
      if (!r.exited()) r.signal_group(sig);
    }
  };
  auto begin_shutdown = [&](int sig) {
    if (shutting_down) return;
    shutting_down = true;
    deadline = Clock::now() + options.kill_timeout;
    signal_running(sig);
  };
  if (exit_code) begin_shutdown(SIGTERM);

  auto all_exited = [&] {
    return std::all_of(ranks.begin(), ranks.end(), [](const ChildProcess& r) { return r.exited(); });
  };
  std::vector<pollfd> fds;
  while (!all_exited()) {
    int timeout_ms = -1;
    if (shutting_down && !killed) {
      auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now()).count();
      timeout_ms = static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
    }
    fds.clear();
    fds.push_back({signals.fd(), POLLIN, 0});
    pump.append_pollfds(fds);
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) throw_system("poll", errno);

    for (int sig : signals.take()) {
      if (sig != SIGINT && sig != SIGTERM && sig != SIGHUP) continue;  // SIGCHLD: the exits are checked below
      if (!shutting_down) {
        pump.message("received " + signal_name(sig) +
                     (sig == SIGHUP ? "; forwarding SIGTERM to the ranks" : "; forwarding it to the ranks"));
        launcher_signal = sig;
        begin_shutdown(sig == SIGHUP ? SIGTERM : sig);
      } else if (!killed) {
        pump.message("received " + signal_name(sig) + " again; sending SIGKILL to the ranks");
        signal_running(SIGKILL);
        killed = true;
      }
    }
    pump.service(fds);
    for (size_t k = 0; k < ranks.size(); ++k) {
      ChildProcess& r = ranks[k];
      if (r.exited() || !r.poll_exit()) continue;
      // Exits caused by our own signals are not the failure to report.
      if (!r.status().ok() && !shutting_down) {
        pump.message(describe(first_rank + static_cast<int>(k), r.pid(), r.status()));
        exit_code = r.status().exit_code();
        begin_shutdown(SIGTERM);
      }
    }
    if (shutting_down && !killed && Clock::now() >= deadline && !all_exited()) {
      pump.message("ranks still running " + format_seconds(options.kill_timeout) +
                   " after SIGTERM; sending SIGKILL");
      signal_running(SIGKILL);
      killed = true;
    }
  }

  for (ChildProcess& r : ranks) r.signal_group(SIGKILL);  // leftovers, NOTE [launch shutdown]
  for (ChildProcess& r : ranks) r.reap();
  const Clock::time_point drain_deadline = Clock::now() + kDrainTimeout;
  while (pump.any_open()) {
    auto left = std::chrono::ceil<milliseconds>(drain_deadline - Clock::now()).count();
    if (left <= 0) break;
    fds.clear();
    pump.append_pollfds(fds);
    if (::poll(fds.data(), fds.size(), static_cast<int>(left)) < 0 && errno != EINTR)
      throw_system("poll", errno);
    pump.service(fds);
  }
  pump.close_all();

  if (exit_code) return *exit_code;
  if (launcher_signal != 0) return 128 + launcher_signal;
  return 0;
}

}  // namespace

int launch(const std::vector<std::string>& args) {
  LaunchOptions options;
  try {
    options = parse_options(args);
  } catch (const UsageError& e) {
    std::cerr << "zero launch: " << zero::error_text(e) << "\n\n" << kLaunchUsage;
    return 2;
  }
  if (options.help) {
    std::cout << kLaunchUsage;
    return 0;
  }
  std::cout.flush();
  try {
    return run(options);
  } catch (const Error& e) {
    // The ranks were stopped by ChildProcess's destructor on the way out.
    write_all(STDERR_FILENO, std::string("zero launch: ") + zero::error_text(e) + "\n");
    return 1;
  }
}

}  // namespace zero::tools
