#include "zero/core/process.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

extern char** environ;

namespace zero {

SpawnError::SpawnError(const std::string& program, int err)
    : IoError("cannot execute " + program + ": " + std::strerror(err)), err_(err) {}

std::string find_program(const std::string& program) {
  if (program.empty()) return "";
  if (program.find('/') != std::string::npos) return program;
  const char* path = std::getenv("PATH");
  const std::string dirs = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  for (;;) {
    const size_t colon = dirs.find(':', start);
    std::string dir = dirs.substr(start, colon == std::string::npos ? std::string::npos : colon - start);
    if (dir.empty()) dir = ".";
    const std::string candidate = dir + "/" + program;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    if (colon == std::string::npos) return "";
    start = colon + 1;
  }
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
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int err = errno;
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
    if (o.stdin_fd >= 0 && ::dup2(o.stdin_fd, STDIN_FILENO) < 0) fail(errno);
    if (o.stdout_fd >= 0 && ::dup2(o.stdout_fd, STDOUT_FILENO) < 0) fail(errno);
    if (o.stderr_fd >= 0 && ::dup2(o.stderr_fd, STDERR_FILENO) < 0) fail(errno);
    if (o.death_signal != 0) {
      if (::prctl(PR_SET_PDEATHSIG, o.death_signal) != 0) fail(errno);
      if (::getppid() != parent) ::raise(o.death_signal);  // the parent went before the line above
    }
    ::execve(file.c_str(), argv.data(), envp);
    fail(errno);
  }
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
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  const long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

}  // namespace zero
