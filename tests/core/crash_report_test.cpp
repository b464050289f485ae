// NOTE [crash report]: a planted fault prints the signal, the faulting
// address, the program counter and its mapping (or the call that jumped to
// an unmapped one), the thread's name and the installed handlers, then ends
// the process with the signal, as it would have ended without the report.
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "zero/core/crash_report.h"

namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

void on_usr1(int) {}

// The GPU run's crash (2026-11-27): a call to address 0 (a weak symbol of
// LibTorch's that was never bound), from a thread with a name, with a
// handler of the test's own installed.
[[noreturn]] void call_null_from_named_thread() {
  zero::install_crash_reporter("crash-probe");
  struct sigaction sa {};
  sa.sa_handler = on_usr1;
  ::sigaction(SIGUSR1, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  std::thread t([] {
    ::pthread_setname_np(::pthread_self(), "zero-probe-t");
    using Fn = void (*)();
    volatile Fn fn = nullptr;
    fn();
  });
  t.join();
  std::exit(0);
}

TEST(CrashReport, ANullCallNamesTheSignalTheCallerTheThreadAndTheHandlers) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(call_null_from_named_thread(), ::testing::KilledBySignal(SIGSEGV),
              AllOf(HasSubstr("[crash-probe] fatal signal SIGSEGV (11, SEGV_MAPERR"),
                    HasSubstr("in thread \"zero-probe-t\""),
                    HasSubstr("fault address (si_addr): 0x0\n"),
                    HasSubstr("program counter: 0x0 (unmapped)"),
                    // the caller: this test binary (its lambda)
                    HasSubstr("return address (the call that jumped there): 0x"),
                    HasSubstr("core_tests"),
                    HasSubstr("signal handlers installed:"),
                    ::testing::ContainsRegex("SIGUSR1 0x[0-9a-f]+ in [^\n]*core_tests"),
                    ::testing::ContainsRegex("SIGSEGV 0x[0-9a-f]+ in [^\n]*core_tests"),
                    ::testing::ContainsRegex("ignored:[^\n]* SIGPIPE"),
                    Not(HasSubstr("backtrace (ZERO_DEBUG=1)"))));
}

// A mapped code address names its /proc/self/maps line and object.
[[noreturn]] void write_to_read_only_page() {
  zero::install_crash_reporter("crash-probe");
  void* page = ::mmap(nullptr, 4096, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  *static_cast<volatile int*>(page) = 1;
  std::exit(0);
}

TEST(CrashReport, AFaultInMappedCodeNamesItsMappingAndTheAccess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(write_to_read_only_page(), ::testing::KilledBySignal(SIGSEGV),
              AllOf(HasSubstr("SEGV_ACCERR, the mapping does not allow the access"),
                    ::testing::ContainsRegex("mapping: [0-9a-f]+-[0-9a-f]+ r-xp [^\n]*core_tests"),
                    ::testing::ContainsRegex("code: in [^\n]*core_tests")));
}

// A file shortened under its mapping: the kernel's SIGBUS, named for what it
// most likely is.
[[noreturn]] void read_past_a_truncated_mapping() {
  zero::install_crash_reporter("crash-probe");
  char path[] = "/tmp/zero-crash-XXXXXX";
  const int fd = ::mkstemp(path);
  if (fd < 0 || ::ftruncate(fd, 8192) != 0) std::exit(3);
  auto* p = static_cast<volatile char*>(::mmap(nullptr, 8192, PROT_READ, MAP_SHARED, fd, 0));
  ::ftruncate(fd, 0);
  ::unlink(path);
  (void)p[4096];
  std::exit(0);
}

TEST(CrashReport, ATruncatedMappingIsABusErrorNamedAsSuch) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(read_past_a_truncated_mapping(), ::testing::KilledBySignal(SIGBUS),
              HasSubstr("fatal signal SIGBUS (7, BUS_ADRERR, no backing page (a mapped file shortened under the "
                        "mapping?))"));
}

// ZERO_DEBUG=1 adds glibc's backtrace; abort() is reported as sent by raise().
[[noreturn]] void abort_with_debug() {
  ::setenv("ZERO_DEBUG", "1", 1);
  zero::install_crash_reporter("crash-probe");
  std::abort();
}

TEST(CrashReport, AbortWithDebugAddsTheBacktrace) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(abort_with_debug(), ::testing::KilledBySignal(SIGABRT),
              AllOf(HasSubstr("fatal signal SIGABRT (6, sent by tgkill() or raise())"), HasSubstr("sent by pid "),
                    HasSubstr("backtrace (ZERO_DEBUG=1):")));
}

}  // namespace
