// zero::error_text: LibTorch's errors without their C++ stack trace, also
// where one is quoted inside another message; the trace with ZERO_DEBUG=1.
#include <stdlib.h>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "zero/core/error.h"

namespace zero {
namespace {

std::string what_of_a_torch_check() {
  try {
    TORCH_CHECK(false, "dropout probability has to be between 0 and 1, but got 2");
  } catch (const c10::Error& e) {
    return e.what();
  }
  return "";
}

TEST(ErrorText, DropsLibTorchsStackTraceUnlessZeroDebug) {
  ::unsetenv("ZERO_DEBUG");
  ::unsetenv("TORCH_SHOW_CPP_STACKTRACES");
  const std::string what = what_of_a_torch_check();
  ASSERT_NE(what.find("frame #"), std::string::npos) << "LibTorch gave no trace to drop:\n" << what;
  EXPECT_EQ(error_text(what), "dropout probability has to be between 0 and 1, but got 2");
  // Quoted inside another message, with text after the trace: the text stays.
  const std::string wrapped = "creating the Gloo group failed on rank 1: " + what + "\n  (is the port free?)";
  EXPECT_EQ(error_text(wrapped),
            "creating the Gloo group failed on rank 1: dropout probability has to be between 0 and 1, but got 2\n"
            "  (is the port free?)");
  const IoError plain("read /x at offset 0: Input/output error (errno 5)");
  EXPECT_EQ(error_text(plain), plain.what());
  ::setenv("ZERO_DEBUG", "1", 1);
  EXPECT_EQ(error_text(what), what);
  ::unsetenv("ZERO_DEBUG");
}

}  // namespace
}  // namespace zero
