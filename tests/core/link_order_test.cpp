// NOTE [standard library first]: a program linking zero binds std::filesystem to
// libstdc++, not to LibTorch's copies, whose remove_all of a folder that
// holds anything jumps to address 0 (the gpu tests' crash of 2026-11-27).
#include <dlfcn.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

namespace {

std::string object_of(const void* fn) {
  Dl_info info{};
  return ::dladdr(fn, &info) != 0 && info.dli_fname != nullptr ? info.dli_fname : "(none)";
}

TEST(LinkOrder, StdFilesystemIsLibstdcxxs) {
  using RemoveAll = std::uintmax_t (*)(const std::filesystem::path&);
  const auto remove_all = static_cast<RemoveAll>(&std::filesystem::remove_all);
  EXPECT_NE(object_of(reinterpret_cast<const void*>(remove_all)).find("libstdc++"), std::string::npos)
      << "std::filesystem::remove_all is bound to " << object_of(reinterpret_cast<const void*>(remove_all));
}

// The call itself, in a child so that today's crash fails this test alone.
TEST(LinkOrder, RemoveAllOfAFolderThatHoldsFilesRemovesThem) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        const char* tmp = std::getenv("TMPDIR");
        std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/zero-link-XXXXXX";
        if (::mkdtemp(dir.data()) == nullptr) std::_Exit(2);
        std::filesystem::create_directories(dir + "/a/b");
        std::ofstream(dir + "/a/b/file") << "x";
        const auto n = std::filesystem::remove_all(dir);
        std::_Exit(n == 4 && !std::filesystem::exists(dir) ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
