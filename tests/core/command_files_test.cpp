// NOTE [outputs and inputs]: the one rule every program and tool asks before
// any work, case by case.
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "zero/core/command_files.h"

namespace {

using ::testing::HasSubstr;

class CommandFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TMPDIR");
    dir_ = std::string(tmp != nullptr ? tmp : "/tmp") + "/zero-files-XXXXXX";
    ASSERT_NE(::mkdtemp(dir_.data()), nullptr);
    ::mkdir((dir_ + "/model").c_str(), 0755);
    std::ofstream(dir_ + "/model/config.json") << "{}";
    std::ofstream(dir_ + "/model/model.safetensors") << "w";
    std::ofstream(dir_ + "/ds.json") << "{}";
    std::ofstream(dir_ + "/tok.bin") << "t";
  }
  void TearDown() override { ASSERT_EQ(std::system(("rm -rf '" + dir_ + "'").c_str()), 0); }
  std::string p(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
};

struct Case {
  const char* name;
  std::function<void(zero::CommandFiles&, const std::function<std::string(const std::string&)>&)> setup;
  const char* expect;  // a part of the problem, or "" for none
};

TEST_F(CommandFilesTest, Cases) {
  const std::vector<Case> cases = {
      {"logits over the weights",
       [](auto& f, auto p) {
         f.reads("--model's weights", p("model/model.safetensors"));
         f.writes("--out", p("model/model.safetensors"));
       },
       "this command reads that file (--model's weights"},
      {"logits beside the weights",
       [](auto& f, auto p) {
         f.reads("--model's weights", p("model/model.safetensors"));
         f.writes("--out", p("model/logits.safetensors"));
       },
       ""},
      {"an export into the model's folder",
       [](auto& f, auto p) {
         f.reads("--model's config.json", p("model/config.json"));
         f.writes_folder("--save_hf", p("model"));
       },
       "holds --model's config.json"},
      {"an export into a parent of the model's folder",
       [](auto& f, auto p) {
         f.reads("--model's config.json", p("model/config.json"));
         f.writes_folder("--save_hf", p(""));
       },
       "holds --model's config.json"},
      {"an export into a new folder inside a checkpoint read whole",
       [](auto& f, auto p) {
         f.reads_folder("DIR", p("model"));
         f.writes_folder("OUT_DIR", p("model/new/hf"));
       },
       "lies inside DIR"},
      {"the same file by another spelling",
       [](auto& f, auto p) {
         f.reads("--config", p("ds.json"));
         f.writes("--summary-json", p("model/../ds.json"));
       },
       "this command reads that file (--config"},
      {"the same file through a link",
       [](auto& f, auto p) {
         ::symlink(p("ds.json").c_str(), p("link.json").c_str());
         f.reads("--config", p("link.json"));
         f.writes("--summary-json", p("ds.json"));
       },
       "this command reads that file"},
      {"the same file by a hard link",
       [](auto& f, auto p) {
         ::link(p("tok.bin").c_str(), p("hard.bin").c_str());
         f.reads("--data", p("tok.bin"));
         f.writes("--summary-json", p("hard.bin"));
       },
       "this command reads that file (--data"},
      {"a relative output over an absolute input",
       [](auto& f, auto p) {
         f.reads("--data", p("tok.bin"));
         char cwd[4096];
         ASSERT_NE(::getcwd(cwd, sizeof cwd), nullptr);
         ASSERT_EQ(::chdir(p("model").c_str()), 0);
         f.writes("--summary-json", "../tok.bin");
         ASSERT_EQ(::chdir(cwd), 0);
       },
       "(--data"},
      {"a checkpoint folder that holds what a resume reads",
       [](auto& f, auto p) {
         f.reads("--resume's latest", p("model/config.json"));
         f.adds_to_folder("--save_dir", p("model"));
       },
       ""},
      {"a checkpoint folder that is an input file",
       [](auto& f, auto p) {
         f.reads("--data", p("tok.bin"));
         f.adds_to_folder("--save_dir", p("tok.bin"));
       },
       "this command reads that file"},
      {"two outputs at one path",
       [](auto& f, auto p) {
         f.writes("--summary-json", p("out.json"));
         f.writes("--json", p("./out.json"));
       },
       "is also --json"},
      {"a file inside an export folder",
       [](auto& f, auto p) {
         f.writes_folder("--save_hf", p("hf"));
         f.writes("--summary-json", p("hf/summary.json"));
       },
       "lies inside --save_hf"},
      {"a baseline over the program's config",
       [](auto& f, auto p) {
         f.reads_program_arguments({"/bin/true", "--config", p("ds.json"), "--data=" + p("tok.bin"), "{config}"});
         f.writes("--baseline", p("ds.json"));
       },
       "this command reads that file (the program's argument"},
      {"a baseline over a program's --flag=FILE",
       [](auto& f, auto p) {
         f.reads_program_arguments({"/bin/true", "--data=" + p("tok.bin")});
         f.writes("--baseline", p("tok.bin"));
       },
       "the program's argument --data"},
      {"a baseline over the program itself",
       [](auto& f, auto p) {
         f.reads_program_arguments({"true"});
         f.writes("--baseline", "/bin/true");
       },
       "(the program"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    zero::CommandFiles files;
    c.setup(files, [this](const std::string& n) { return p(n); });
    const std::string problem = files.problem();
    if (std::string(c.expect).empty()) {
      EXPECT_EQ(problem, "");
    } else {
      EXPECT_THAT(problem, HasSubstr(c.expect));
    }
  }
}

TEST_F(CommandFilesTest, TheRefusalNamesBothPathsAndFlags) {
  zero::CommandFiles files;
  files.reads("--model's weights", p("model/model.safetensors"));
  files.writes("--out", p("model/model.safetensors"));
  EXPECT_EQ(files.problem(), "--out " + p("model/model.safetensors") + ": this command reads that file (--model's weights " +
                                 p("model/model.safetensors") +
                                 "); writing --out there would destroy it. Choose another path for --out");
}

TEST_F(CommandFilesTest, PathsThatDoNotExistAreResolvedByTheirDeepestFolder) {
  ::symlink(p("model").c_str(), p("alias").c_str());
  const std::string real_dir = zero::resolved_path(p("model"));
  EXPECT_EQ(zero::resolved_path(p("alias/new/x.json")), real_dir + "/new/x.json");
  EXPECT_EQ(zero::resolved_path(p("alias/new/../y.json")), real_dir + "/y.json");
  EXPECT_EQ(zero::resolved_path(p("alias/./z")), real_dir + "/z");
}

}  // namespace
