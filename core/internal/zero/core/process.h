// Child processes for the tools that run programs (zero launch, zero tune,
// mingpt --find-max-params): started so that they never outlive the process
// that started them.
#pragma once

#include <sys/types.h>

#include <csignal>

#include <string>
#include <vector>

#include "zero/core/error.h"

namespace zero {

/// PROGRAM could not be executed; err() is the exec's errno (ENOENT, EACCES).
class SpawnError : public IoError {
 public:
  SpawnError(const std::string& program, int err);
  int err() const noexcept { return err_; }

 private:
  int err_;
};

struct SpawnOptions {
  std::vector<std::string> argv;  // argv[0] a path, or a name looked up in PATH
  /// The child's environment ("NAME=VALUE"); this process's when null.
  const std::vector<std::string>* env = nullptr;
  /// Descriptors for the child's stdin, stdout and stderr; -1 keeps ours.
  int stdin_fd = -1, stdout_fd = -1, stderr_fd = -1;
  /// The child leads a process group of its own (pgid == its pid).
  bool own_group = true;
  /// Sent to the child when this thread ends (PR_SET_PDEATHSIG): a parent
  /// killed outright, which can pass nothing on, still ends its children.
  /// SIGTERM by default (they end as they do on a stop); 0 for none.
  int death_signal = SIGTERM;
  /// NOTE [supervised runs]: the child is a small supervisor that runs the
  /// program and answers for all of it (its own children included). The pid
  /// returned is the supervisor's; its exit status is the program's (a
  /// signal the same signal). SIGTERM, SIGINT and SIGHUP sent to it go to
  /// the program's whole process group; SIGUSR1 kills that group
  /// (SIGKILL). When the program ends, whatever it left running is ended
  /// (SIGTERM, then SIGKILL `grace_ms` later), and so is everything when
  /// this thread dies (death_signal's moment; death_signal itself is not
  /// used). The pid's own process group holds only the supervisor.
  bool supervised = false;
  int grace_ms = 5000;
};

/// The signal that makes a supervised child (SpawnOptions::supervised) kill
/// its program's whole process group at once.
constexpr int kSupervisorKill = SIGUSR1;

/// Starts a child (fork + execve: posix_spawn cannot set a parent-death
/// signal) with every signal unblocked and SIGINT, SIGTERM, SIGHUP, SIGPIPE,
/// SIGCHLD at their default actions. Only async-signal-safe calls run
/// between the fork and the exec, so the caller may have threads; the
/// parent-death signal belongs to the calling thread (call it from the
/// thread that lives as long as the child should). Returns the pid once the
/// program is running. Throws SpawnError when it cannot be executed,
/// IoError when fork fails.
pid_t spawn_process(const SpawnOptions& options);

/// The file PROGRAM names: itself when it has a '/', else the first
/// executable of that name in PATH; "" when there is none.
std::string find_program(const std::string& program);

/// Why PROGRAM cannot be run, or "": not found (a name with no '/' looked
/// up in PATH), a folder, not a regular file, or not executable, each said
/// with the way ("chmod +x FILE").
std::string program_problem(const std::string& program);

/// Processors this process may run on (its affinity mask).
int usable_cpus();

}  // namespace zero
