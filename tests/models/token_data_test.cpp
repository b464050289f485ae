// llama train's token data (models/programs/token_data.h): read a window at
// a time, never mapped. A file shortened under a mapping ended the process
// with SIGBUS and no word (issue 34); a file that changes under the run now
// ends it with an error naming the file and what changed.
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "token_data.h"
#include "zero/core/error.h"

namespace {

class TokenDataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TMPDIR");
    path_ = std::string(tmp != nullptr ? tmp : "/tmp") + "/zero-tokens-XXXXXX";
    const int fd = ::mkstemp(path_.data());
    ASSERT_GE(fd, 0);
    ::close(fd);
    std::ofstream out(path_, std::ios::binary);
    for (int i = 0; i < 1000; ++i) {
      const uint16_t t = static_cast<uint16_t>(i % 50);
      out.write(reinterpret_cast<const char*>(&t), 2);
    }
  }
  void TearDown() override { ::unlink(path_.c_str()); }
  std::string path_;
};

TEST_F(TokenDataTest, WindowsAreTheFilesTokens) {
  llama::TokenData d(path_, 2, 8);
  EXPECT_EQ(d.tokens(), 1000);
  const auto s = d.samples(3, 2, 50);
  ASSERT_EQ(s.sizes(), (std::vector<int64_t>{2, 9}));
  for (int64_t j = 0; j < 2; ++j)
    for (int64_t t = 0; t <= 8; ++t) EXPECT_EQ(s[j][t].item<int64_t>(), ((3 + j) * 8 + t) % 50);
}

TEST_F(TokenDataTest, AFileShortenedUnderTheRunEndsItNamingTheFile) {
  llama::TokenData d(path_, 2, 8);
  (void)d.samples(0, 4, 50);
  ASSERT_EQ(::truncate(path_.c_str(), 100), 0);
  try {
    (void)d.samples(100, 4, 50);  // windows past the new end: a mapping would have raised SIGBUS here
    FAIL() << "read a shortened file";
  } catch (const zero::IoError& e) {
    EXPECT_NE(std::string(e.what()).find(path_ + " (the token data, --data): the file changed under the run: shortened "
                                         "from 2000 to 100 bytes"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(TokenDataTest, AFileReplacedUnderTheRunEndsIt) {
  llama::TokenData d(path_, 2, 8);
  ASSERT_EQ(::unlink(path_.c_str()), 0);
  std::ofstream(path_, std::ios::binary) << std::string(2000, '\0');
  try {
    (void)d.samples(0, 1, 50);
    FAIL() << "read a replaced file";
  } catch (const zero::IoError& e) {
    EXPECT_NE(std::string(e.what()).find("replaced or removed"), std::string::npos) << e.what();
  }
}

}  // namespace
