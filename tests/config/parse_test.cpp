// The text layer: hjson-style comments and trailing commas, duplicate keys,
// syntax errors with line and column, CRLF and tabs, unreadable files.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "config_test_util.h"
#include "zero/config/config.h"
#include "zero/core/error.h"

namespace zero::config {
namespace {

using test::joined;
using test::problems_of;
using test::problems_of_file;

struct TextCase {
  const char* name;
  const char* text;
  int64_t tbs;
};

class Relaxed : public ::testing::TestWithParam<TextCase> {};

TEST_P(Relaxed, ReadsWhatHjsonReads) {
  Config c;
  ASSERT_NO_THROW(c = load_string(GetParam().text)) << joined(problems_of(GetParam().text));
  EXPECT_EQ(c.batch.train_batch_size, GetParam().tbs);
}

INSTANTIATE_TEST_SUITE_P(
    Text, Relaxed,
    ::testing::Values(
        TextCase{"line_comment", "{\n  // batch\n  \"train_batch_size\": 8 // eight\n}", 8},
        TextCase{"hash_comment", "# a DeepSpeed config\n{\"train_batch_size\": 8} # end", 8},
        TextCase{"block_comment", "{/* multi\nline */ \"train_batch_size\": /* inline */ 8}", 8},
        TextCase{"trailing_comma_object", "{\"train_batch_size\": 8,\n}", 8},
        TextCase{"trailing_comma_array",
                 "{\"train_batch_size\": 8, \"optimizer\": {\"type\": \"Adam\", \"params\": {\"betas\": [0.9, 0.99,]}}}",
                 8},
        TextCase{"trailing_comma_before_comment", "{\"train_batch_size\": 8, // last\n}", 8},
        TextCase{"comment_markers_in_strings",
                 "{\"train_batch_size\": 8, \"zero_optimization\": {\"stage\": 3, \"offload_param\": {\"device\": "
                 "\"nvme\", \"nvme_path\": \"/mnt/a//b#c/*d*/,}\"}}}",
                 8},
        TextCase{"crlf", "{\r\n  \"train_batch_size\": 16,\r\n  \"gradient_accumulation_steps\": 2\r\n}\r\n", 16},
        TextCase{"tabs", "{\n\t\"train_batch_size\":\t32\n}", 32},
        TextCase{"whitespace_around", "\n   \n  {\"train_batch_size\": 4}  \n  \n", 4}),
    [](const ::testing::TestParamInfo<TextCase>& info) { return std::string(info.param.name); });

TEST(Parse, CommentMarkersInsideStringsAreKept) {
  const Config c = load_string(
      "{\"train_batch_size\": 8, \"zero_optimization\": {\"stage\": 3, \"offload_param\": {\"device\": \"nvme\", "
      "\"nvme_path\": \"/mnt/a//b#c/*d*/,}\"}}}");
  EXPECT_EQ(c.zero.offload_param.nvme_path, "/mnt/a//b#c/*d*/,}");
}

TEST(Parse, DuplicateKeyAtTopLevel) {
  const auto problems = problems_of("{\"train_batch_size\": 8, \"train_batch_size\": 8}");
  ASSERT_EQ(problems.size(), 1u) << joined(problems);
  EXPECT_EQ(problems[0], "ds.json: train_batch_size: duplicate key");
}

TEST(Parse, DuplicateKeysNestedAreAllReportedWithPaths) {
  const auto problems = problems_of(R"({
    "train_batch_size": 8,
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "device": "cpu"}, "stage": 2},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "lr": 2e-3}}
  })");
  const std::string all = joined(problems);
  EXPECT_NE(all.find("ds.json: zero_optimization.offload_optimizer.device: duplicate key"), std::string::npos) << all;
  EXPECT_NE(all.find("ds.json: zero_optimization.stage: duplicate key"), std::string::npos) << all;
  EXPECT_NE(all.find("ds.json: optimizer.params.lr: duplicate key"), std::string::npos) << all;
  EXPECT_EQ(problems.size(), 3u) << all;
}

TEST(Parse, SameKeyInDifferentObjectsIsNotADuplicate) {
  EXPECT_NO_THROW(load_string(R"({"train_batch_size": 8, "fp16": {"enabled": false}, "bf16": {"enabled": false}})"));
}

TEST(Parse, DuplicateInsideArrayOfObjectsNamesTheIndex) {
  const auto problems = problems_of(R"({"train_batch_size": 8, "x": [{"a": 1}, {"a": 1, "a": 2}]})");
  ASSERT_EQ(problems.size(), 1u) << joined(problems);
  EXPECT_EQ(problems[0], "ds.json: x[1].a: duplicate key");
}

TEST(Parse, SyntaxErrorNamesFileLineAndColumn) {
  const auto problems = problems_of("{\n  \"train_batch_size\": 8\n  \"steps_per_print\": 1\n}");
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].rfind("ds.json: line 3, column 3: ", 0), 0u) << problems[0];
  EXPECT_NE(problems[0].find("syntax error"), std::string::npos) << problems[0];
}

TEST(Parse, SyntaxErrorColumnsCountTabsAsOneAndLinesAfterCrlf) {
  const auto problems = problems_of("{\r\n\t\"train_batch_size\": 8,\r\n\t\"fp16\": {\"enabled\": tru}\r\n}");
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].rfind("ds.json: line 3, column 22: ", 0), 0u) << problems[0];
}

TEST(Parse, BareWordNamesTheWordAndTheKey) {
  const auto problems = problems_of("{\n  \"fp16\": {\"enabled\": CONFIG_FP16}\n}");
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0],
            "ds.json: line 2, column 23: syntax error in fp16.enabled: expected a JSON value; got bare word "
            "CONFIG_FP16 (quote strings; an unfilled template placeholder?)");
}

TEST(Parse, UnterminatedBlockComment) {
  const auto problems = problems_of("{\"train_batch_size\": 8 /* oops\n}");
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].rfind("ds.json: line 1, column 24: syntax error", 0), 0u) << problems[0];
}

TEST(Parse, EmptyTextIsASyntaxError) {
  const auto problems = problems_of("");
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].rfind("ds.json: line 1, column 1: ", 0), 0u) << problems[0];
}

TEST(Parse, TopLevelMustBeAnObject) {
  const auto problems = problems_of("[1, 2]");
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0], "ds.json: expected a JSON object at the top level; got [1,2]");
}

TEST(Parse, ConfigErrorWhatJoinsAllProblems) {
  try {
    load_string(R"({"train_batch_size": 8, "train_batch_size": 8, "fp16": {"enabled": 1}})", {}, "x.json");
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    ASSERT_EQ(e.problems().size(), 2u);
    const std::string what = e.what();
    EXPECT_NE(what.find("x.json: train_batch_size: duplicate key"), std::string::npos) << what;
    EXPECT_NE(what.find("x.json: fp16.enabled: expected true or false; got 1"), std::string::npos) << what;
    EXPECT_EQ(e.kind(), ErrorKind::kConfig);
  }
}

TEST(LoadFile, MissingFileIsAnIoErrorNamingPathAndReason) {
  const std::string path = std::string(ZERO_BINARY_DIR) + "/no/such/ds_config.json";
  try {
    load_file(path);
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path), std::string::npos) << what;
    EXPECT_NE(what.find("No such file or directory"), std::string::npos) << what;
  }
}

TEST(LoadFile, DirectoryIsAnIoError) {
  try {
    load_file(ZERO_BINARY_DIR);
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(std::string(ZERO_BINARY_DIR) + ": expected a regular JSON file; got a directory"),
              std::string::npos)
        << e.what();
  }
}

TEST(LoadFile, MessagesUseThePathAsGiven) {
  const std::string path = std::string(ZERO_BINARY_DIR) + "/config_parse_test_tmp.json";
  {
    std::ofstream out(path);
    out << "{\"train_batch_size\": 8, \"zero_optimization\": {\"stag\": 1}}";
  }
  try {
    load_file(path);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    ASSERT_EQ(e.problems().size(), 1u);
    EXPECT_EQ(e.problems()[0], path + ": zero_optimization.stag: unknown key; did you mean stage?");
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace zero::config
