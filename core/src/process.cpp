#include "zero/core/process.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

extern char** environ;

namespace zero {

SpawnError::SpawnError(const std::string& program, int err)
    : IoError("cannot execute " + program + ": " + std::strerror(err)), err_(err) {}

std::string find_program(const std::string& program) {
  if (program.empty()) return "";
  if (program.find('/') != std::string::npos) return program;
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + program;
    struct stat st {};
    if (::stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(candidate.c_str(), X_OK) == 0)
      return candidate;
  }
  return "";
}

pid_t spawn_process(const SpawnOptions& o) {
  if (o.argv.empty()) throw SpawnError("(no program)", ENOENT);
  const std::string file = find_program(o.argv[0]);
  if (file.empty()) throw SpawnError(o.argv[0], ENOENT);
  std::vector<char*> argv;
  for (const std::string& a : o.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> env;
  if (o.env != nullptr) {
    for (const std::string& e : *o.env) env.push_back(const_cast<char*>(e.c_str()));
    env.push_back(nullptr);
  }
  char* const* envp = o.env != nullptr ? env.data() : environ;
  // The exec's errno comes back through this pipe; a successful exec closes it.
  int status[2];
  if (::pipe2(status, O_CLOEXEC) != 0) {
    const int err = errno;
    throw IoError("pipe2 to start " + o.argv[0] + ": " + std::strerror(err));
  }
  const pid_t parent = ::getpid();
  // Every signal blocked across the fork (as glibc's posix_spawn does): no
  // handler of ours may run in the child before its dispositions are reset.
  sigset_t all, before;
  sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &before);
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int err = errno;
    ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
    ::close(status[0]);
    ::close(status[1]);
    throw IoError("fork to start " + o.argv[0] + ": " + std::strerror(err));
  }
  if (pid == 0) {  // async-signal-safe calls only from here to the exec
    auto fail = [&](int err) {
      while (::write(status[1], &err, sizeof err) < 0 && errno == EINTR) {
      }
      ::_exit(127);
    };
    if (o.own_group) ::setpgid(0, 0);
    struct sigaction dfl = {};
    dfl.sa_handler = SIG_DFL;
    for (int sig : {SIGPIPE, SIGCHLD, SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &dfl, nullptr);
    sigset_t empty;
    sigemptyset(&empty);
    ::sigprocmask(SIG_SETMASK, &empty, nullptr);
    // A descriptor already in place keeps its close-on-exec flag through
    // dup2 (a no-op): clear it, or the program would start without it.
    auto place = [&](int fd, int target) {
      if (fd < 0) return;
      if (fd == target) {
        const int flags = ::fcntl(fd, F_GETFD);
        if (flags < 0 || ::fcntl(fd, F_SETFD, flags & ~FD_CLOEXEC) < 0) fail(errno);
      } else if (::dup2(fd, target) < 0) {
        fail(errno);
      }
    };
    place(o.stdin_fd, STDIN_FILENO);
    place(o.stdout_fd, STDOUT_FILENO);
    place(o.stderr_fd, STDERR_FILENO);
    if (o.death_signal != 0) {
      if (::prctl(PR_SET_PDEATHSIG, o.death_signal) != 0) fail(errno);
      if (::getppid() != parent) ::raise(o.death_signal);  // the parent went before the line above
    }
    ::execve(file.c_str(), argv.data(), envp);
    fail(errno);
  }
  ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
  ::close(status[1]);
  if (o.own_group) ::setpgid(pid, pid);  // also here: no signal to the group can come before it exists
  int err = 0;
  ssize_t n;
  while ((n = ::read(status[0], &err, sizeof err)) < 0 && errno == EINTR) {
  }
  ::close(status[0]);
  if (n == static_cast<ssize_t>(sizeof err)) {  // the exec failed; the child has exited with 127
    int ignored = 0;
    while (::waitpid(pid, &ignored, 0) < 0 && errno == EINTR) {
    }
    throw SpawnError(o.argv[0], err);
  }
  return pid;
}

int usable_cpus() {
  int n = 0;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0) n = CPU_COUNT(&set);
  if (n <= 0) n = static_cast<int>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)));
  // A container's CPU quota (cgroup v2 cpu.max: "QUOTA PERIOD", or "max"),
  // which the affinity mask does not show.
  std::ifstream in("/sys/fs/cgroup/cpu.max");
  std::string quota;
  long long period = 0;
  if (in >> quota >> period && quota != "max" && period > 0) {
    const long long q = std::atoll(quota.c_str());
    if (q > 0) n = std::min<int>(n, static_cast<int>(std::max(1LL, (q + period - 1) / period)));
  }
  return n;
}

}  // namespace zero
