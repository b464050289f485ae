// Linked into every test binary (tests/CMakeLists.txt): a test that crashes
// prints NOTE [crash report] (signal, faulting address and its mapping, the
// thread, the installed handlers) before it ends, also on the GPU machine.
#include "zero/core/crash_report.h"

namespace {

const bool installed = [] {
  zero::install_crash_reporter("test");
  return true;
}();

}  // namespace
