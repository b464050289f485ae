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

namespace {

const std::string kZero = std::string(ZERO_BINARY_DIR) + "/bin/zero";

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

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
  const std::string dir = std::string(ZERO_BINARY_DIR) + "/tests/nvme_tune_" + std::to_string(getpid());
  ASSERT_EQ(std::system(("mkdir -p " + dir).c_str()), 0);
  const std::string out = dir + "/out.txt", json = dir + "/tune.json";
  const int rc = std::system((kZero + " nvme-tune --path " + dir + " --size 1MiB --rounds 1 --json " + json + " > " +
                              out + " 2>&1").c_str());
  const std::string text = read_text(out);
  ASSERT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("sweep"), std::string::npos) << "no progress shown:\n" << text;
  const auto at = text.find("\"aio\": {");
  ASSERT_NE(at, std::string::npos) << text;
  const std::string section = text.substr(at, text.find('\n', at) - at);
  EXPECT_EQ(entries(dir), (std::set<std::string>{"out.txt", "tune.json"})) << "the tuner's file was left behind";
  const std::string config = dir + "/ds.json";
  std::ofstream(config) << "{\"train_batch_size\": 8, " << section << "}";
  const int check = std::system((kZero + " config check " + config + " > " + dir + "/check.txt 2>&1").c_str());
  EXPECT_EQ(check, 0) << section << "\n" << read_text(dir + "/check.txt");
  EXPECT_NE(read_text(json).find("\"best_aio\""), std::string::npos);
  std::system(("rm -rf " + dir).c_str());
}

TEST(NvmeTune, MissingPathAndUnknownOptionsAreClearErrors) {
  const std::string out = std::string(ZERO_BINARY_DIR) + "/tests/nvme_tune_err_" + std::to_string(getpid());
  EXPECT_EQ(WEXITSTATUS(std::system((kZero + " nvme-tune > " + out + " 2>&1").c_str())), 2);
  EXPECT_NE(read_text(out).find("--path DIR is required"), std::string::npos) << read_text(out);
  EXPECT_EQ(WEXITSTATUS(std::system((kZero + " nvme-tune --pth /tmp > " + out + " 2>&1").c_str())), 2);
  EXPECT_NE(read_text(out).find("did you mean --path?"), std::string::npos) << read_text(out);
  EXPECT_EQ(WEXITSTATUS(std::system((kZero + " nvme-tune --path /no/such/dir > " + out + " 2>&1").c_str())), 1);
  EXPECT_NE(read_text(out).find("/no/such/dir"), std::string::npos) << read_text(out);
  std::remove(out.c_str());
}

}  // namespace
