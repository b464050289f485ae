// NOTE [crash report]
// A fatal signal explains itself without a debugger.
// The GPU machine is lent now and then, for minutes; a crash there must say
// what it can in its first report. glibc's backtrace() cannot: a jump
// through a null or stale pointer leaves a program counter with no unwind
// information, and the unwinder stops at the signal frame. So the report
// reads what the kernel hands the handler instead:
// - the signal, its code and si_addr;
// - the program counter from the ucontext, and the /proc/self/maps line that
//   holds it, or "unmapped". When it is unmapped (a call to address 0, to a
//   symbol that was never bound, or into an unloaded object), the word at the
//   stack pointer is the caller's return address: its object and symbol
//   (dladdr) name the call that jumped;
// - the thread's name and id (LibTorch, NCCL and CUDA name their threads);
// - every installed signal handler with the object it lives in, so a handler
//   left behind by some library is seen.
// Then the signal is raised again at its default action: the exit status
// and any core file are what they would have been.
//
// The handler uses only calls that are safe in a signal handler (write,
// open, read, sigaction, prctl), except dladdr, which takes the loader's
// lock: a crash inside the loader itself could hang there, which is why the
// report is written before and after the dladdr parts. Every line is
// formatted into a fixed buffer on the (alternate) signal stack.
#include "zero/core/crash_report.h"

#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace zero {
namespace {

constexpr int kFatal[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT, SIGTRAP, SIGSYS};

std::atomic<const char*> g_program{"zero"};
std::atomic<bool> g_debug{false};
std::atomic<long> g_reporting{0};  // the thread id writing a report, or 0

// A line assembled in a fixed buffer and written with write(2).
class Line {
 public:
  Line& operator<<(const char* s) {
    while (s != nullptr && *s != '\0' && n_ < sizeof buf_ - 1) buf_[n_++] = *s++;
    return *this;
  }
  Line& dec(long long v) {
    char tmp[24];
    int k = 0;
    const bool neg = v < 0;
    unsigned long long u = neg ? 0ULL - static_cast<unsigned long long>(v) : static_cast<unsigned long long>(v);
    do {
      tmp[k++] = static_cast<char>('0' + u % 10);
      u /= 10;
    } while (u != 0);
    if (neg) *this << "-";
    while (k > 0 && n_ < sizeof buf_ - 1) buf_[n_++] = tmp[--k];
    return *this;
  }
  Line& hex(uintptr_t v) {
    char tmp[20];
    int k = 0;
    do {
      tmp[k++] = "0123456789abcdef"[v & 15];
      v >>= 4;
    } while (v != 0);
    *this << "0x";
    while (k > 0 && n_ < sizeof buf_ - 1) buf_[n_++] = tmp[--k];
    return *this;
  }
  void flush() {
    buf_[n_++] = '\n';
    size_t done = 0;
    while (done < n_) {
      const ssize_t w = ::write(STDERR_FILENO, buf_ + done, n_ - done);
      if (w <= 0) break;
      done += static_cast<size_t>(w);
    }
    n_ = 0;
  }

 private:
  char buf_[640];
  size_t n_ = 0;
};

const char* signal_name(int sig) {
  static const char* const kNames[] = {
      "SIG0",    "SIGHUP",  "SIGINT",    "SIGQUIT", "SIGILL",  "SIGTRAP", "SIGABRT", "SIGBUS",  "SIGFPE",
      "SIGKILL", "SIGUSR1", "SIGSEGV",   "SIGUSR2", "SIGPIPE", "SIGALRM", "SIGTERM", "SIGSTKFLT", "SIGCHLD",
      "SIGCONT", "SIGSTOP", "SIGTSTP",   "SIGTTIN", "SIGTTOU", "SIGURG",  "SIGXCPU", "SIGXFSZ", "SIGVTALRM",
      "SIGPROF", "SIGWINCH", "SIGIO",    "SIGPWR",  "SIGSYS"};
  return sig >= 0 && sig < static_cast<int>(sizeof kNames / sizeof kNames[0]) ? kNames[sig] : nullptr;
}

Line& name_signal(Line& l, int sig) {
  if (const char* n = signal_name(sig)) return l << n;
  l << "SIGRTMIN+";
  return l.dec(sig - SIGRTMIN);
}

const char* code_text(int sig, int code) {
  if (code == SI_USER) return "sent by kill()";
  if (code == SI_TKILL) return "sent by tgkill() or raise()";
  if (code == SI_QUEUE) return "sent by sigqueue()";
  if (sig == SIGSEGV) return code == SEGV_MAPERR ? "SEGV_MAPERR, no mapping at the address"
                             : code == SEGV_ACCERR ? "SEGV_ACCERR, the mapping does not allow the access"
                                                   : "";
  if (sig == SIGBUS)
    return code == BUS_ADRALN   ? "BUS_ADRALN, misaligned address"
           : code == BUS_ADRERR ? "BUS_ADRERR, no backing page (a mapped file shortened under the mapping?)"
           : code == BUS_OBJERR ? "BUS_OBJERR, hardware error"
                                : "";
  if (sig == SIGFPE) return code == FPE_INTDIV ? "FPE_INTDIV, integer division by zero" : "";
  if (sig == SIGILL) return code == ILL_ILLOPC ? "ILL_ILLOPC, illegal opcode" : "";
  return "";
}

// The /proc/self/maps line holding `addr`, copied into `out` (empty when
// none); its permissions' first letter in `readable`.
void find_mapping(uintptr_t addr, char* out, size_t cap, bool* readable) {
  out[0] = '\0';
  *readable = false;
  const int fd = ::open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  char chunk[4096], line[512];
  size_t len = 0;
  bool done = false;
  auto consider = [&]() {
    line[len] = '\0';
    uintptr_t lo = 0, hi = 0;
    size_t i = 0;
    auto hexdigit = [](char c) {
      return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    };
    for (; i < len && hexdigit(line[i]) >= 0; ++i) lo = lo * 16 + static_cast<uintptr_t>(hexdigit(line[i]));
    if (i < len && line[i] == '-') ++i;
    for (; i < len && hexdigit(line[i]) >= 0; ++i) hi = hi * 16 + static_cast<uintptr_t>(hexdigit(line[i]));
    if (addr >= lo && addr < hi) {
      size_t k = 0;
      for (; k + 1 < cap && k < len; ++k) out[k] = line[k];
      out[k] = '\0';
      *readable = i + 1 < len && line[i + 1] == 'r';
      done = true;
    }
  };
  for (;;) {
    const ssize_t n = ::read(fd, chunk, sizeof chunk);
    if (n <= 0) break;
    for (ssize_t i = 0; i < n && !done; ++i) {
      if (chunk[i] == '\n') {
        consider();
        len = 0;
      } else if (len < sizeof line - 1) {
        line[len++] = chunk[i];
      }
    }
    if (done) break;
  }
  ::close(fd);
}

// "in OBJECT (SYMBOL+0xOFF)" for a code address, through dladdr.
void describe_code(Line& l, uintptr_t addr) {
  Dl_info info{};
  if (addr == 0 || ::dladdr(reinterpret_cast<void*>(addr), &info) == 0 || info.dli_fname == nullptr) {
    l << "in no loaded object";
    return;
  }
  l << "in " << info.dli_fname;
  if (info.dli_sname != nullptr) {
    l << " (" << info.dli_sname << "+";
    l.hex(addr - reinterpret_cast<uintptr_t>(info.dli_saddr)) << ")";
  } else {
    l << " (+";
    l.hex(addr - reinterpret_cast<uintptr_t>(info.dli_fbase)) << ")";
  }
}

void report_handlers(Line& l) {
  l << "  signal handlers installed:";
  l.flush();
  Line ignored;
  ignored << "    ignored:";
  bool any_ignored = false;
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig == SIGKILL || sig == SIGSTOP) continue;
    struct sigaction sa {};
    if (::sigaction(sig, nullptr, &sa) != 0) continue;
    const uintptr_t fn = (sa.sa_flags & SA_SIGINFO) ? reinterpret_cast<uintptr_t>(sa.sa_sigaction)
                                                    : reinterpret_cast<uintptr_t>(sa.sa_handler);
    if (!(sa.sa_flags & SA_SIGINFO) && sa.sa_handler == SIG_DFL) continue;
    if (!(sa.sa_flags & SA_SIGINFO) && sa.sa_handler == SIG_IGN) {
      ignored << " ";
      name_signal(ignored, sig);
      any_ignored = true;
      continue;
    }
    l << "    ";
    name_signal(l, sig) << " ";
    l.hex(fn) << " ";
    describe_code(l, fn);
    l.flush();
  }
  if (any_ignored) ignored.flush();
}

void on_fatal_signal(int sig, siginfo_t* info, void* context) {
  // Another thread crashing meanwhile lets the first report finish; a fault
  // of the report itself (this thread again: the fatal signals are blocked
  // while it runs, so only a signal sent to it comes here) ends at once.
  const long tid = static_cast<long>(::syscall(SYS_gettid));
  long none = 0;
  if (!g_reporting.compare_exchange_strong(none, tid)) {
    if (none != tid)
      while (true) ::pause();
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    ::sigaction(sig, &dfl, nullptr);
    ::raise(sig);
    return;
  }
  Line l;
  const char* program = g_program.load();
  char thread[17] = {};
  ::prctl(PR_GET_NAME, thread, 0, 0, 0);
  l << "[" << program << "] fatal signal ";
  name_signal(l, sig) << " (";
  l.dec(sig);
  if (const char* c = code_text(sig, info->si_code); *c != '\0') l << ", " << c;
  l << ") in thread \"" << thread << "\" (tid ";
  l.dec(static_cast<long long>(::syscall(SYS_gettid))) << ", pid ";
  l.dec(::getpid()) << ")";
  l.flush();
  if (info->si_code == SI_USER || info->si_code == SI_TKILL || info->si_code == SI_QUEUE) {
    l << "  sent by pid ";
    l.dec(info->si_pid) << " (uid ";
    l.dec(info->si_uid) << ")";
    l.flush();
  } else {
    l << "  fault address (si_addr): ";
    l.hex(reinterpret_cast<uintptr_t>(info->si_addr));
    l.flush();
  }
  uintptr_t pc = 0, sp = 0;
  const auto* uc = static_cast<const ucontext_t*>(context);
#if defined(__x86_64__)
  pc = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RIP]);
  sp = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RSP]);
#elif defined(__aarch64__)
  pc = static_cast<uintptr_t>(uc->uc_mcontext.pc);
  sp = static_cast<uintptr_t>(uc->uc_mcontext.sp);
  const uintptr_t lr = static_cast<uintptr_t>(uc->uc_mcontext.regs[30]);
#else
  (void)uc;
#endif
  char mapping[512];
  bool readable = false;
  find_mapping(pc, mapping, sizeof mapping, &readable);
  l << "  program counter: ";
  l.hex(pc);
  if (mapping[0] == '\0') {
    l << " (unmapped)";
    l.flush();
    // A call through a null or stale pointer: the caller is the return
    // address (x86-64: the word at the stack pointer; AArch64: the link register).
    uintptr_t ret = 0;
#if defined(__x86_64__)
    char stack_map[512];
    bool stack_readable = false;
    find_mapping(sp, stack_map, sizeof stack_map, &stack_readable);
    if (stack_readable) ret = *reinterpret_cast<const uintptr_t*>(sp);
#elif defined(__aarch64__)
    ret = lr;
#endif
    if (ret != 0) {
      l << "  return address (the call that jumped there): ";
      l.hex(ret) << " ";
      describe_code(l, ret);
      l.flush();
    }
  } else {
    l.flush();
    l << "  mapping: " << mapping;
    l.flush();
    l << "  code: ";
    describe_code(l, pc);
    l.flush();
  }
  report_handlers(l);
  if (g_debug.load()) {
    void* frames[64];
    const int n = ::backtrace(frames, 64);
    l << "  backtrace (ZERO_DEBUG=1):";
    l.flush();
    ::backtrace_symbols_fd(frames, n, STDERR_FILENO);
  }
  // Again at the default action: blocked while this handler runs, it ends
  // the process as soon as the handler returns (a fault would otherwise
  // repeat its instruction, a raised signal not come again).
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(sig, &dfl, nullptr);
  ::raise(sig);
}

}  // namespace

void install_crash_reporter(const char* program) {
  g_program.store(program != nullptr ? program : "zero");
  const char* debug = std::getenv("ZERO_DEBUG");
  g_debug.store(debug != nullptr && std::strcmp(debug, "1") == 0);
  static std::atomic<bool> installed{false};
  if (installed.exchange(true)) return;
  // An alternate stack, so that a stack overflow in this thread reports too.
  static char alt_stack[64 * 1024];
  stack_t ss{};
  ss.ss_sp = alt_stack;
  ss.ss_size = sizeof alt_stack;
  ::sigaltstack(&ss, nullptr);
  if (g_debug.load()) {  // backtrace() loads libgcc on first use: not inside the handler
    void* frame[1];
    ::backtrace(frame, 1);
  }
  for (int sig : kFatal) {
    struct sigaction now {};
    if (::sigaction(sig, nullptr, &now) != 0) continue;
    if ((now.sa_flags & SA_SIGINFO) || now.sa_handler != SIG_DFL) continue;  // the program's own
    struct sigaction sa {};
    sa.sa_sigaction = on_fatal_signal;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    // Every fatal signal blocked while a report is written: a fault inside
    // it (reading a bad stack, dladdr) then ends the process at once.
    sigemptyset(&sa.sa_mask);
    for (int other : kFatal) sigaddset(&sa.sa_mask, other);
    ::sigaction(sig, &sa, nullptr);
  }
}

}  // namespace zero
