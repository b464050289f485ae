// `zero launch`: a local launcher in the manner of torchrun (one node, no
// elastic restarts). It starts N ranks of a program with torchrun's
// environment, prefixes their output with the rank, and tears every rank down
// when one of them fails. See NOTE [launch shutdown] in launch.cpp.
#pragma once

#include <string>
#include <vector>

namespace zero::tools {

/// zero launch [--nproc_per_node N] [--master_addr A] [--master_port P]
///             [--kill-timeout SECONDS] [--] PROGRAM ARGS...
///
/// Starts N local ranks of PROGRAM, each in its own process group, with RANK,
/// LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK,
/// MASTER_ADDR and MASTER_PORT set (and OMP_NUM_THREADS when the caller has
/// not set it). Every line a rank writes is re-emitted on the same stream
/// prefixed with "[rank K] ". Blocks until every rank has exited.
///
/// Returns the process exit code: 0 when every rank exited 0; otherwise the
/// status of the first rank that failed (128 + signal number for a rank killed
/// by a signal), 127 when PROGRAM cannot be executed, 128 + signal when the
/// launcher itself was interrupted and no rank failed, 2 for a usage error,
/// 1 when a system call the launcher needs fails. Errors are printed to
/// stderr; nothing is thrown.
///
/// Call from the main thread of a process that has not started other threads
/// (it blocks SIGINT, SIGTERM and SIGCHLD in the calling thread to read them
/// through a signalfd; see NOTE [launch signals]). Restores the signal mask
/// and dispositions it changed before returning.
int launch(const std::vector<std::string>& args);

}  // namespace zero::tools
