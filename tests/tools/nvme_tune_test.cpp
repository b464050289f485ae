// zero nvme-tune: the sweep runs to the end on a small file, leaves nothing
// in the folder, and prints an aio section that zero's own config check
// accepts as it stands.
#include <gtest/gtest.h>

#include <dirent.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "tool_test_util.h"

namespace {

using zero::test::read_text;
using zero::test::TempDir;

const std::string kZero = std::string(ZERO_BINARY_DIR) + "/bin/zero";

std::set<std::string> entries(const std::string& dir) {
  std::set<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") out.insert(n);
    }
    ::closedir(d);
  }
  return out;
}

TEST(NvmeTune, PrintsAnAioSectionTheConfigCheckAccepts) {
  TempDir swap, work;
  const std::string out = work.file("out.txt"), json = work.file("tune.json");
  const int rc = std::system(
      (kZero + " nvme-tune --path " + swap.path() + " --size 1MiB --rounds 1 --json " + json + " > " + out + " 2>&1")
          .c_str());
  const std::string text = read_text(out);
  ASSERT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("sweep"), std::string::npos) << "no progress shown:\n" << text;
  const auto at = text.find("\"aio\": {");
  ASSERT_NE(at, std::string::npos) << text;
  const std::string section = text.substr(at, text.find('\n', at) - at);
  EXPECT_TRUE(entries(swap.path()).empty()) << "the tuner's file was left behind";
  const std::string config = work.file("ds.json");
  std::ofstream(config) << "{\"train_batch_size\": 8, \"optimizer\": {\"type\": \"AdamW\"}, " << section << "}";
  const int check = std::system((kZero + " config check " + config + " > " + work.file("check.txt") + " 2>&1").c_str());
  EXPECT_EQ(check, 0) << section << "\n" << read_text(work.file("check.txt"));
  EXPECT_NE(read_text(json).find("\"best_aio\""), std::string::npos);
}

TEST(NvmeTune, MissingPathAndUnknownOptionsAreClearErrors) {
  TempDir work;
  const std::string out = work.file("out.txt");
  EXPECT_EQ(WEXITSTATUS(std::system((kZero + " nvme-tune > " + out + " 2>&1").c_str())), 2);
  EXPECT_NE(read_text(out).find("--path DIR is required"), std::string::npos) << read_text(out);
  EXPECT_EQ(WEXITSTATUS(std::system((kZero + " nvme-tune --pth /tmp > " + out + " 2>&1").c_str())), 2);
  EXPECT_NE(read_text(out).find("did you mean --path?"), std::string::npos) << read_text(out);
  EXPECT_EQ(WEXITSTATUS(std::system((kZero + " nvme-tune --path /tmp --rounds 0.5 > " + out + " 2>&1").c_str())), 2);
  EXPECT_NE(read_text(out).find("--rounds: expected a whole number of rounds"), std::string::npos) << read_text(out);
  EXPECT_EQ(WEXITSTATUS(std::system((kZero + " nvme-tune --path /no/such/dir > " + out + " 2>&1").c_str())), 2);
  EXPECT_NE(read_text(out).find("--path /no/such/dir: no such folder"), std::string::npos) << read_text(out);
}

}  // namespace
