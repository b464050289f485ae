// NOTE [outputs and inputs]: the one rule every program and tool asks before
// any work, case by case.
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
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

TEST_F(CommandFilesTest, StreamsAreWrittenWhereTheyStandAndOtherDevicesAreRefused) {
  EXPECT_EQ(zero::stream_output_fd("/dev/stdout"), 1);
  EXPECT_EQ(zero::stream_output_fd("/dev/stderr"), 2);
  EXPECT_EQ(zero::stream_output_fd("/proc/self/fd/2"), 2);
  EXPECT_EQ(zero::stream_output_fd("/dev/fd/0"), -1);  // stdin is no output
  EXPECT_EQ(zero::stream_output_fd("/dev/fd/987"), -1);  // not open
  ASSERT_EQ(::symlink("/dev/stdout", p("out").c_str()), 0);
  EXPECT_EQ(zero::stream_output_fd(p("out")), 1);  // a link to a stream is the stream
  EXPECT_EQ(zero::stream_output_fd(p("ds.json")), -1);

  EXPECT_EQ(zero::output_place_problem("--json", "/dev/stdout"), "");
  EXPECT_EQ(zero::output_place_problem("--json", p("new.json")), "");
  EXPECT_THAT(zero::output_place_problem("--json", "/dev/null"), HasSubstr("--json /dev/null: is not a regular file"));
  EXPECT_THAT(zero::output_place_problem("--json", "/dev/new.json"), HasSubstr("is under /dev"));
  EXPECT_THAT(zero::output_place_problem("--json", "/proc/self/comm"), HasSubstr("is under /proc"));
  ASSERT_EQ(::symlink("/dev/null", p("null").c_str()), 0);
  EXPECT_THAT(zero::output_place_problem("--json", p("null")), HasSubstr("is not a regular file"));
  ASSERT_EQ(::symlink("/dev/new.json", p("to-dev").c_str()), 0);
  EXPECT_THAT(zero::output_place_problem("--json", p("to-dev")), HasSubstr("is under /dev (it is /dev/new.json)"));
  ASSERT_EQ(::mkfifo(p("fifo").c_str(), 0644), 0);
  EXPECT_THAT(zero::output_place_problem("--json", p("fifo")), HasSubstr("is not a regular file (a device, pipe or socket)"));

  // A stream takes part in no clash: two outputs may both go to stdout.
  zero::CommandFiles files;
  files.reads("--config", p("ds.json"));
  files.writes("--summary-json", "/dev/stdout");
  files.writes("--json", "/dev/stdout");
  EXPECT_EQ(files.problem(), "");
}

TEST_F(CommandFilesTest, TheEnvironmentsOutputsAreHeldToTheRule) {
  struct Env {
    Env(const char* name, const std::string& value) : name(name) { ::setenv(name, value.c_str(), 1); }
    ~Env() { ::unsetenv(name); }
    const char* name;
  };
  {
    Env trace("ZERO_TRACE", p("tok.bin"));
    zero::CommandFiles files;
    files.reads("--data", p("tok.bin"));
    files.writes_environment_outputs(0, 1);
    EXPECT_THAT(files.problem(), HasSubstr("ZERO_TRACE's file for rank 0 " + p("tok.bin") +
                                           ": this command reads that file (--data"));
    // Of several ranks, each writes FILE.rankR.json.
    zero::CommandFiles two;
    two.reads("--data", p("tok.bin"));
    two.writes_environment_outputs(1, 2);
    EXPECT_EQ(two.problem(), "");
  }
  {
    std::ofstream(p("model/r.rank1")) << "x";
    Env report("ZERO_RUN_REPORT", p("model/r"));
    zero::CommandFiles files;
    files.reads_folder("--resume's tag folder", p("model"));
    files.writes_environment_outputs(1, 2);
    EXPECT_THAT(files.problem(), HasSubstr("ZERO_RUN_REPORT's file for rank 1 " + p("model/r.rank1") + ": lies inside"));
  }
  {  // A stream cannot be a prefix, nor every rank's trace: said by problem().
    Env report("ZERO_RUN_REPORT", "/dev/stdout");
    zero::CommandFiles files;
    files.writes_environment_outputs(0, 1);
    EXPECT_THAT(files.problem(), HasSubstr("ZERO_RUN_REPORT=/dev/stdout: a stream; the variable names a file name prefix"));
    ::unsetenv("ZERO_RUN_REPORT");
    Env trace("ZERO_TRACE", "/dev/stdout");
    zero::CommandFiles one, two;
    one.writes_environment_outputs(0, 1);
    EXPECT_EQ(one.problem(), "");  // one rank: written to the stream
    two.writes_environment_outputs(1, 2);
    EXPECT_THAT(two.problem(), HasSubstr("ZERO_TRACE=/dev/stdout: a stream, and each of the 2 ranks"));
  }
  {  // The two variables against each other.
    Env trace("ZERO_TRACE", p("same"));
    Env report("ZERO_RUN_REPORT", p("same"));
    ::setenv("ZERO_TRACE", p("same.rank0").c_str(), 1);
    zero::CommandFiles files;
    files.writes_environment_outputs(0, 1);
    EXPECT_THAT(files.problem(), HasSubstr("is also ZERO_RUN_REPORT's file for rank 0"));
  }
  {  // What a program declared is what the engine checks again.
    zero::CommandFiles program;
    program.reads("--model's weights", p("model/model.safetensors"));
    zero::CommandFiles::declare(program);
    Env trace("ZERO_TRACE", p("model/model.safetensors"));
    zero::CommandFiles engine = zero::CommandFiles::declared();
    engine.writes_environment_outputs(0, 1);
    EXPECT_THAT(engine.problem(), HasSubstr("this command reads that file (--model's weights"));
    // A program that declared the environment's outputs itself: the
    // engine's second adding of them is no clash with the first.
    ::setenv("ZERO_TRACE", p("trace.json").c_str(), 1);
    zero::CommandFiles with_env = program;
    with_env.writes_environment_outputs(0, 1);
    zero::CommandFiles::declare(with_env);
    zero::CommandFiles again = zero::CommandFiles::declared();
    again.writes_environment_outputs(0, 1);
    EXPECT_EQ(again.problem(), "");
    zero::CommandFiles::declare(zero::CommandFiles());
  }
}

TEST_F(CommandFilesTest, OutputsAtOnePlaceAndFoldersAProgramIsGiven) {
  zero::CommandFiles same_place;
  same_place.writes("--summary-json", p("x"));
  same_place.adds_to_folder("--save_dir", p("x"));
  EXPECT_THAT(same_place.problem(), HasSubstr("--summary-json " + p("x") + ": is also --save_dir"));

  // `zero tune --out DIR/model.safetensors -- llama train --model DIR`.
  zero::CommandFiles tune;
  tune.reads_program_arguments({"true", "--model", p("model")});
  tune.writes("--out", p("model/model.safetensors"));
  EXPECT_THAT(tune.problem(), HasSubstr("lies in the program's argument (a folder) " + p("model")));
  zero::CommandFiles beside;  // a new name in the folder is not read
  beside.reads_program_arguments({"true", "--save_dir=" + p("model")});
  beside.writes("--out", p("model/tuned.json"));
  EXPECT_EQ(beside.problem(), "");
  zero::CommandFiles over;  // an export over the folder
  over.reads_program_arguments({"true", "--model", p("model")});
  over.writes_folder("--save_hf", p("model"));
  EXPECT_THAT(over.problem(), HasSubstr("holds the program's argument (a folder)"));
}

// Bind mounts need a private mount namespace: the case runs in a child
// process under `unshare -m`, or is skipped saying why.
TEST_F(CommandFilesTest, ABindMountIsTheFolderItShows) {
  if (std::getenv("ZERO_TEST_IN_MOUNT_NAMESPACE") == nullptr) {
    const std::string cmd = "ZERO_TEST_IN_MOUNT_NAMESPACE=1 unshare -m --propagation private /proc/" +
                            std::to_string(::getpid()) +
                            "/exe --gtest_filter=CommandFilesTest.ABindMountIsTheFolderItShows > " + p("child.log") +
                            " 2>&1";
    if (std::system("unshare -m --propagation private true > /dev/null 2>&1") != 0)
      GTEST_SKIP() << "no private mount namespace here (unshare -m refused): bind mounts not tried";
    const int rc = std::system(cmd.c_str());
    std::ifstream log(p("child.log"));
    const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    ASSERT_EQ(rc, 0) << text;
    ASSERT_THAT(text, HasSubstr("[  PASSED  ] 1 test")) << text;
    return;
  }
  // In the namespace: `view` shows `model`.
  ASSERT_EQ(::mkdir(p("view").c_str(), 0755), 0);
  ASSERT_EQ(::mount(p("model").c_str(), p("view").c_str(), nullptr, MS_BIND, nullptr), 0) << std::strerror(errno);
  zero::CommandFiles files;
  files.reads_folder("--resume's tag folder", p("model"));
  files.writes("--summary-json", p("view/model.safetensors"));
  EXPECT_THAT(files.problem(), HasSubstr("lies inside --resume's tag folder"));
  zero::CommandFiles save;
  save.adds_to_folder("--save_dir", p("model"));
  save.writes("--summary-json", p("view/latest"));
  EXPECT_THAT(save.problem(), HasSubstr("under the name latest"));
  zero::CommandFiles export_over;
  export_over.reads("--model's config.json", p("model/config.json"));
  export_over.writes_folder("--save_hf", p("view"));
  EXPECT_THAT(export_over.problem(), HasSubstr("holds --model's config.json"));
  ::umount(p("view").c_str());
}

}  // namespace
