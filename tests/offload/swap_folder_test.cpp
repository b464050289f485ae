// Swap files (NOTE [swap files]): the checks on nvme_path before anything is
// written, the up-front space check, and nothing left behind.
#include <gtest/gtest.h>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <functional>
#include <string>
#include <vector>

#include "zero/offload/swap_folder.h"
#include "zero/core/error.h"

namespace {

using zero::offload::create_swap_files;
using zero::offload::SwapFileSpec;

const std::string kKey = "zero_optimization.offload_optimizer.nvme_path";

std::string fresh_dir(const std::string& name) {
  const std::string d = std::string(ZERO_BINARY_DIR) + "/tests/swap_" + std::to_string(getpid()) + "_" + name;
  ::mkdir(d.c_str(), 0700);
  return d;
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") out.push_back(n);
    }
    ::closedir(d);
  }
  return out;
}

template <typename E>
std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

TEST(SwapFiles, AreSizedOpenAndLeaveNothingUnderThePath) {
  const std::string dir = fresh_dir("ok");
  {
    auto files = create_swap_files(dir, kKey, "rank0", "a test", {{"a.swp", 10000}, {"b.swp", 4096}});
    ASSERT_EQ(files.size(), 2u);
    struct stat st {};
    ASSERT_EQ(::fstat(files[0]->buffered_fd(), &st), 0);
    EXPECT_EQ(st.st_size, 10000);  // allocated up front
    EXPECT_EQ(st.st_nlink, 0u);    // unlinked: the space returns when it closes
    EXPECT_TRUE(entries(dir).empty()) << "the per-run folder is gone once its files are open";
  }
  EXPECT_TRUE(entries(dir).empty());
  ::rmdir(dir.c_str());
}

TEST(SwapFiles, MissingPathIsAConfigErrorNamingTheKey) {
  const std::string msg = message_of<zero::ConfigError>(
      [] { create_swap_files("/nonexistent/nvme", kKey, "rank0", "a test", {{"a.swp", 1}}); });
  EXPECT_NE(msg.find(kKey), std::string::npos) << msg;
  EXPECT_NE(msg.find("/nonexistent/nvme"), std::string::npos) << msg;
  EXPECT_NE(msg.find("No such file or directory"), std::string::npos) << msg;
}

TEST(SwapFiles, AFileIsNotAFolder) {
  const std::string dir = fresh_dir("notdir");
  const std::string file = dir + "/plain";
  ::close(::open(file.c_str(), O_CREAT | O_WRONLY, 0600));
  const std::string msg =
      message_of<zero::ConfigError>([&] { create_swap_files(file, kKey, "rank0", "a test", {{"a.swp", 1}}); });
  EXPECT_NE(msg.find("is not a folder"), std::string::npos) << msg;
  ::unlink(file.c_str());
  ::rmdir(dir.c_str());
}

// /sys refuses new folders to everyone, root included (and an unprivileged
// user fails the writability check before that): either way a ConfigError
// that names the key and the path.
TEST(SwapFiles, UnwritablePathIsAConfigErrorNamingTheKey) {
  const std::string msg =
      message_of<zero::ConfigError>([] { create_swap_files("/sys", kKey, "rank0", "a test", {{"a.swp", 1}}); });
  EXPECT_NE(msg.find(kKey), std::string::npos) << msg;
  EXPECT_NE(msg.find("/sys"), std::string::npos) << msg;
}

TEST(SwapFiles, TooLittleSpaceFailsBeforeWritingNamingNeedAndFree) {
  const std::string dir = fresh_dir("full");
  const int64_t petabyte = int64_t{1} << 50;
  const std::string msg = message_of<zero::IoError>(
      [&] { create_swap_files(dir, kKey, "rank0", "the states of rank 0", {{"a.swp", petabyte}}); });
  EXPECT_NE(msg.find(kKey), std::string::npos) << msg;
  EXPECT_NE(msg.find("free"), std::string::npos) << msg;
  EXPECT_NE(msg.find("need 1024.00 TiB"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the states of rank 0"), std::string::npos) << msg;
  EXPECT_TRUE(entries(dir).empty()) << "nothing written";
  ::rmdir(dir.c_str());
}

}  // namespace
