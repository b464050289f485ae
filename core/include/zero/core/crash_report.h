// A crash report that needs no debugger (NOTE [crash report]).
#pragma once

namespace zero {

/// Installs a handler for the fatal signals (SIGSEGV, SIGBUS, SIGILL, SIGFPE,
/// SIGABRT, SIGTRAP, SIGSYS) that writes a short report to stderr and then
/// raises the signal again with its default action, so the process ends as
/// it would have (exit status 128 + signal, a core file where enabled).
///
/// The report names the signal and its code, the faulting address
/// (`si_addr`), the program counter from the signal's context and the line
/// of /proc/self/maps that holds it (or "unmapped"), the return address on
/// the stack when the program counter is unmapped (a call through a null or
/// stale pointer), the thread's name and id, and every installed signal
/// handler with the object it lives in. `ZERO_DEBUG=1` adds glibc's
/// backtrace. `program` heads the report ("mingpt", "zero"); the pointer is
/// kept, so pass a string that lives for the whole process.
///
/// A signal whose action is not the default when this is called (a handler
/// of the program's own, or one it ignores) is left as it is. Runs on an
/// alternate signal stack in the calling thread, so a stack overflow there
/// reports too. Call it once, early in main(); later calls only change
/// `program`. Thread-safe with respect to other threads' signals.
void install_crash_reporter(const char* program);

}  // namespace zero
