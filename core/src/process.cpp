#include "zero/core/process.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

extern char** environ;

namespace zero {

namespace {

// execve's errno with what it means here: EACCES is said of a folder and of
// a file without the execute bit alike.
std::string spawn_reason(const std::string& program, int err) {
  std::string text = std::strerror(err);
  struct stat st {};
  const std::string found = find_program(program);
  if (err == EACCES && !found.empty() && ::stat(found.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) text += " (it is a folder; expected a program, an executable file)";
    else if (S_ISREG(st.st_mode) && ::access(found.c_str(), X_OK) != 0) text += " (it is not executable: chmod +x " + found + ")";
  }
  return text;
}

}  // namespace

SpawnError::SpawnError(const std::string& program, int err)
    : IoError("cannot execute " + program + ": " + spawn_reason(program, err)), err_(err) {}

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

std::string program_problem(const std::string& program) {
  if (program.empty()) return "expected a PROGRAM to run; got \"\"";
  const std::string found = find_program(program);
  if (found.empty()) return program + ": no such program (no file of that name in PATH; give its path, such as ./" + program + ")";
  struct stat st {};
  if (::stat(found.c_str(), &st) != 0)
    return program + ": no such program (" + std::strerror(errno) + ", errno " + std::to_string(errno) + ")";
  if (S_ISDIR(st.st_mode)) return program + ": is a folder; expected a program to run (an executable file)";
  if (!S_ISREG(st.st_mode)) return program + ": is not a regular file (a device, pipe or socket); expected a program";
  if (::access(found.c_str(), X_OK) != 0)
    return program + ": is not executable (" + std::strerror(errno) + "); make it so (chmod +x " + found + ")";
  return "";
}

namespace {

// A fork without the atfork handlers (glibc's fork runs them, and they are
// not async-signal-safe in a child of a threaded process).
pid_t plain_fork() { return static_cast<pid_t>(::syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0)); }

void put(const char* s) {
  size_t n = 0;
  while (s[n] != '\0') ++n;
  while (n > 0) {
    const ssize_t w = ::write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w;
    n -= static_cast<size_t>(w);
  }
}

void put_number(long long v) {
  char buf[24];
  int k = 0;
  unsigned long long u = v < 0 ? 0ULL - static_cast<unsigned long long>(v) : static_cast<unsigned long long>(v);
  do {
    buf[k++] = static_cast<char>('0' + u % 10);
    u /= 10;
  } while (u != 0);
  char out[26];
  int m = 0;
  if (v < 0) out[m++] = '-';
  while (k > 0) out[m++] = buf[--k];
  out[m] = '\0';
  put(out);
}

long long now_ms() {
  struct timespec t {};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<long long>(t.tv_sec) * 1000 + t.tv_nsec / 1000000;
}

// A decimal number of at most 19 digits into `out` (NUL-terminated); its length.
int format_number(long long v, char* out) {
  char tmp[24];
  int k = 0;
  do {
    tmp[k++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v > 0);
  int n = 0;
  while (k > 0) out[n++] = tmp[--k];
  out[n] = '\0';
  return n;
}

// Calls `fn(name)` for each entry of the folder `path` whose name is a
// number (a pid in /proc, a descriptor in /proc/self/fd), by raw getdents64
// (opendir's allocations are not safe in a forked child of a threaded
// process).
template <typename Fn>
void for_each_number_in(const char* path, Fn fn) {
  const int dir = ::open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) return;
  alignas(8) char buf[8192];
  for (;;) {
    const long got = ::syscall(SYS_getdents64, dir, buf, sizeof buf);
    if (got <= 0) break;
    for (long off = 0; off < got;) {
      struct Entry {  // linux_dirent64
        uint64_t ino;
        int64_t off;
        unsigned short reclen;
        unsigned char type;
        char name[1];
      };
      const auto* e = reinterpret_cast<const Entry*>(buf + off);
      long long n = 0;
      bool digits = e->name[0] != '\0';
      for (const char* c = e->name; *c != '\0'; ++c) {
        if (*c < '0' || *c > '9') {
          digits = false;
          break;
        }
        n = n * 10 + (*c - '0');
      }
      if (digits) fn(n, dir);
      off += e->reclen;
    }
  }
  ::close(dir);
}

// Field 5 of /proc/PID/stat (the process group), or -1.
long long group_of(pid_t pid) {
  char path[48] = "/proc/";
  int n = 6 + format_number(pid, path + 6);
  const char* tail = "/stat";
  for (int i = 0; tail[i] != '\0'; ++i) path[n++] = tail[i];
  path[n] = '\0';
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  char buf[512];
  const ssize_t got = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (got <= 0) return -1;
  buf[got] = '\0';
  // "pid (comm) state ppid pgrp ...": after the last ')'.
  const char* p = nullptr;
  for (ssize_t i = got - 1; i >= 0; --i)
    if (buf[i] == ')') {
      p = buf + i + 1;
      break;
    }
  if (p == nullptr) return -1;
  for (int field = 0; field < 3 && *p != '\0'; ++field) {  // skip " state", " ppid"; stop before pgrp
    while (*p == ' ') ++p;
    if (field == 2) break;
    while (*p != ' ' && *p != '\0') ++p;
  }
  long long g = 0;
  bool any = false;
  while (*p >= '0' && *p <= '9') g = g * 10 + (*p++ - '0'), any = true;
  return any ? g : -1;
}

// Sends `sig` to every process of this supervisor's group but itself, and
// to every child it has (what was reparented here, the subreaper, from a
// group of its own). The group is this process's own (its pid), so no other
// group can be hit however long the run: a pid is not reused while a
// process of it lives. A catchable signal goes to the group at once (this
// process has it blocked and skips its own copy); SIGKILL, which it cannot
// block, goes process by process.
void signal_all(int sig) {
  const pid_t self = ::getpid();
  if (sig != SIGKILL) {
    ::kill(-self, sig);
  } else {
    for_each_number_in("/proc", [&](long long n, int) {
      const auto pid = static_cast<pid_t>(n);
      if (pid != self && group_of(pid) == self) ::kill(pid, SIGKILL);
    });
  }
  // The children: /proc/self/task/<tid>/children, read whole.
  char path[64] = "/proc/self/task/";
  int n = 16 + format_number(static_cast<long long>(::syscall(SYS_gettid)), path + 16);
  const char* tail = "/children";
  for (int i = 0; tail[i] != '\0'; ++i) path[n++] = tail[i];
  path[n] = '\0';
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  char buf[4096];
  long long pid = 0;
  bool in = false;
  for (;;) {
    const ssize_t got = ::read(fd, buf, sizeof buf);
    if (got <= 0) break;
    for (ssize_t i = 0; i < got; ++i) {
      if (buf[i] >= '0' && buf[i] <= '9') {
        pid = pid * 10 + (buf[i] - '0');
        in = true;
      } else {
        if (in) ::kill(static_cast<pid_t>(pid), sig);  // a number ends at its separator
        pid = 0;
        in = false;
      }
    }
  }
  ::close(fd);
}

// Closes the descriptors an exec would have closed (FD_CLOEXEC) but `keep`:
// the supervisor never execs, and must not hold the tool's locks, pipes or
// device files for as long as the run goes on.
void close_exec_descriptors(int keep) {
  int fds[1024];
  int count = 0;
  for_each_number_in("/proc/self/fd", [&](long long fd, int dir) {
    if (fd != dir && fd != keep && count < 1024) fds[count++] = static_cast<int>(fd);
  });
  for (int i = 0; i < count; ++i) {
    const int flags = ::fcntl(fds[i], F_GETFD);
    if (flags >= 0 && (flags & FD_CLOEXEC)) ::close(fds[i]);
  }
}

// NOTE [supervised runs]
// zero tune, memcheck and mingpt --find-max-params run a user's program,
// which may start processes of its own (a shell script's mingpt, a
// launcher's ranks). Ending the program's pid alone leaves those running:
// on a time limit, when the program exits and leaves them behind, and when
// the tool itself is killed outright (kill -9), when no code of the tool
// runs at all. So the tool's child is a supervisor, forked from the tool
// and never exec'd (only system calls from here on, and the descriptors an
// exec would close are closed): the leader of a process group of its own,
// in which it starts the program, and a child subreaper (every descendant
// whose parent dies becomes its child, so it knows when none is left). It
// stays until the program and everything it started have ended. It passes
// SIGTERM, SIGINT and SIGHUP on to the group (it has them blocked and skips
// its own copies), kills the group on SIGUSR1, ends what the program left
// when the program ends (SIGTERM, SIGKILL after the grace), and does the same
// when the tool dies (its parent-death signal, SIGRTMIN+2 so it is not
// mistaken for the tool's SIGTERM). The group's id is its own pid, alive for
// as long as it signals the group, so no other process is ever hit. It then
// exits as the program did (a signal the same signal, without a core of its
// own).
[[noreturn]] void supervise(const std::string& file, char* const* argv, char* const* envp, int status_fd,
                            pid_t parent, int grace_ms) {
  auto fail = [&](int err) {
    while (::write(status_fd, &err, sizeof err) < 0 && errno == EINTR) {
    }
    ::_exit(127);
  };
  close_exec_descriptors(status_fd);
  ::setpgid(0, 0);  // the program's group is this process's
  const int death = SIGRTMIN + 2;
  sigset_t watched;
  sigemptyset(&watched);
  for (int sig : {SIGCHLD, SIGTERM, SIGINT, SIGHUP, kSupervisorKill, death}) sigaddset(&watched, sig);
  ::sigprocmask(SIG_BLOCK, &watched, nullptr);
  const int sfd = ::signalfd(-1, &watched, SFD_CLOEXEC | SFD_NONBLOCK);
  if (sfd < 0) fail(errno);
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);
  if (::prctl(PR_SET_PDEATHSIG, death) != 0) fail(errno);
  const bool parent_gone = ::getppid() != parent;
  const pid_t self = ::getpid();
  const pid_t c = plain_fork();
  if (c < 0) fail(errno);
  if (c == 0) {  // the program, in the supervisor's group
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // a supervisor killed outright takes the program along
    sigset_t empty;
    sigemptyset(&empty);
    ::sigprocmask(SIG_SETMASK, &empty, nullptr);
    ::execve(file.c_str(), argv, envp);
    fail(errno);
  }
  ::close(status_fd);
  bool c_done = false;
  int c_status = 0;
  int phase = 0;  // 0: running; 1: SIGTERM sent to what is left; 2: SIGKILL sent
  long long deadline = 0;
  auto end_all = [&](int sig, int next_phase) {
    signal_all(sig);
    phase = next_phase;
    deadline = now_ms() + grace_ms;
  };
  if (parent_gone) end_all(SIGTERM, 1);
  for (;;) {
    // Reap; once the program is done, wait for what it left, or end it.
    for (;;) {
      int st = 0;
      const pid_t w = ::waitpid(-1, &st, WNOHANG);
      if (w > 0) {
        if (w == c) c_done = true, c_status = st;
        continue;
      }
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && c_done) {  // ECHILD: nothing of the program's is left
        if (WIFEXITED(c_status)) ::_exit(WEXITSTATUS(c_status));
        const int sig = WTERMSIG(c_status);
        ::prctl(PR_SET_DUMPABLE, 0);  // the program's signal, not a core of this copy of the tool
        struct sigaction dfl {};
        dfl.sa_handler = SIG_DFL;
        ::sigaction(sig, &dfl, nullptr);
        sigset_t one;
        sigemptyset(&one);
        sigaddset(&one, sig);
        ::sigprocmask(SIG_UNBLOCK, &one, nullptr);
        ::kill(self, sig);
        ::_exit(128 + sig);
      }
      break;
    }
    if (c_done && phase == 0) {
      put("[zero] the program (pid ");
      put_number(c);
      put(") has ended and left processes of its own running: ending them (SIGTERM, SIGKILL after ");
      put_number(grace_ms / 1000);
      put(" s)\n");
      end_all(SIGTERM, 1);
    }
    int timeout = -1;
    if (phase == 1) timeout = static_cast<int>(std::max<long long>(0, deadline - now_ms()));
    if (phase == 2) timeout = 100;
    struct pollfd pfd = {sfd, POLLIN, 0};
    if (::poll(&pfd, 1, timeout) > 0) {
      struct signalfd_siginfo si {};
      while (::read(sfd, &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
        const int sig = static_cast<int>(si.ssi_signo);
        if (static_cast<pid_t>(si.ssi_pid) == self) continue;  // its own copy of what it sent the group
        if (sig == SIGTERM || sig == SIGINT || sig == SIGHUP) {
          signal_all(sig);
        } else if (sig == kSupervisorKill) {
          signal_all(SIGKILL);
          phase = 2;
        } else if (sig == death) {
          if (phase == 0) end_all(SIGTERM, 1);
        }
        // SIGCHLD: reaped at the top
      }
    }
    if (phase == 1 && now_ms() >= deadline) {
      signal_all(SIGKILL);
      phase = 2;
    }
    if (phase == 2) signal_all(SIGKILL);  // whatever came since
  }
}

}  // namespace

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
    for (int sig : {SIGPIPE, SIGCHLD, SIGINT, SIGTERM, SIGHUP, kSupervisorKill}) ::sigaction(sig, &dfl, nullptr);
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
    if (o.supervised) supervise(file, argv.data(), envp, status[1], parent, o.grace_ms);
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
