// NOTE [trace]: the recorder on its own: nothing recorded when off, a name
// built only when on, a track per thread, the cap counted, the file whole.
#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "zero/core/trace.h"

namespace zero {
namespace {

std::string temp_path(const std::string& name) {
  const char* tmp = std::getenv("TMPDIR");
  return std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/zero_trace_test_" + std::to_string(::getpid()) +
         "_" + name;
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

std::multiset<std::string> names_of(const nlohmann::json& t, const std::string& phase) {
  std::multiset<std::string> out;
  for (const auto& e : t["traceEvents"])
    if (e["ph"] == phase) out.insert(e["name"].get<std::string>());
  return out;
}

TEST(Trace, OffRecordsNothingAndBuildsNoName) {
  trace::stop();
  int built = 0;
  {
    const trace::Span span("cat", [&] {
      ++built;
      return std::string("never");
    });
  }
  trace::OpenSpan open;
  open.open();
  EXPECT_FALSE(open.is_open());
  EXPECT_EQ(built, 0);
  EXPECT_FALSE(trace::on());
  EXPECT_TRUE(trace::flush());  // nothing to write, nowhere
}

TEST(Trace, SpansOfEachThreadOnTheirOwnTrackInAWholeFile) {
  const std::string path = temp_path("spans.json");
  trace::start(path, 3, 4);
  {
    const trace::Span outer("phase", "outer", 7);
    const trace::Span inner("copy", [] { return std::string("host to \"device\""); }, 4096);
  }
  std::thread([] {
    trace::name_thread("io");
    const trace::Span span("wait", "on another thread");
  }).join();
  trace::OpenSpan layer;
  layer.open();
  int other_tid = 0;
  std::thread([&] { layer.close("layer", [] { return std::string("closed elsewhere"); }, 2); }).join();
  trace::async_done("nvme", "NVMe read", trace::detail::now_us() - 10, 1 << 20);
  ASSERT_TRUE(trace::flush());
  const auto t = read_json(path);  // escapes and all: valid JSON
  trace::stop();
  ::unlink(path.c_str());

  EXPECT_EQ(t["otherData"]["rank"], 3);
  EXPECT_EQ(t["otherData"]["world_size"], 4);
  EXPECT_EQ(t["otherData"]["dropped_events"], 0);
  EXPECT_EQ(names_of(t, "X"), (std::multiset<std::string>{"outer", "host to \"device\"", "on another thread",
                                                           "closed elsewhere"}));
  int main_tid = -1, io_tid = -1;
  const nlohmann::json* outer = nullptr;
  const nlohmann::json* inner = nullptr;
  for (const auto& e : t["traceEvents"]) {
    EXPECT_EQ(e["pid"], 3);
    if (e["ph"] == "M" && e["name"] == "thread_name" && e["args"]["name"] == "io") io_tid = e["tid"];
    if (e["ph"] == "M" && e["name"] == "thread_name" && e["args"]["name"] == "training") main_tid = e["tid"];
    if (e["ph"] != "X") continue;
    if (e["name"] == "outer") outer = &e;
    if (e["name"] == "host to \"device\"") inner = &e;
    if (e["name"] == "on another thread") other_tid = e["tid"];
    if (e["name"] == "closed elsewhere") EXPECT_EQ(e["tid"], main_tid) << "drawn where it was opened";
  }
  ASSERT_NE(outer, nullptr);
  ASSERT_NE(inner, nullptr);
  EXPECT_EQ((*outer)["tid"], main_tid);
  EXPECT_EQ((*outer)["args"]["n"], 7);
  EXPECT_EQ((*inner)["args"]["n"], 4096);
  EXPECT_LE((*outer)["ts"].get<int64_t>(), (*inner)["ts"].get<int64_t>());  // nested in time
  EXPECT_GE((*outer)["ts"].get<int64_t>() + (*outer)["dur"].get<int64_t>(),
            (*inner)["ts"].get<int64_t>() + (*inner)["dur"].get<int64_t>());
  EXPECT_EQ(other_tid, io_tid);
  EXPECT_NE(io_tid, main_tid);
  // The NVMe request: a begin and an end with one id, the end not before the begin.
  std::map<std::string, const nlohmann::json*> pair;
  for (const auto& e : t["traceEvents"])
    if (e["ph"] == "b" || e["ph"] == "e") pair[e["ph"].get<std::string>()] = &e;
  ASSERT_EQ(pair.size(), 2u);
  EXPECT_EQ((*pair["b"])["id2"]["local"], (*pair["e"])["id2"]["local"]);
  EXPECT_LE((*pair["b"])["ts"].get<int64_t>(), (*pair["e"])["ts"].get<int64_t>());
}

TEST(Trace, PastTheCapEventsAreCountedNotKept) {
  const std::string path = temp_path("cap.json");
  trace::start(path, 0, 1, /*max_events=*/10);
  for (int i = 0; i < 25; ++i) const trace::Span span("cat", "one");
  ASSERT_TRUE(trace::flush());
  const auto t = read_json(path);
  trace::stop();
  ::unlink(path.c_str());
  EXPECT_EQ(names_of(t, "X").size(), 10u);
  EXPECT_EQ(t["otherData"]["dropped_events"], 15);
}

TEST(Trace, AFileThatCannotBeWrittenIsSaidAndLeavesNothing) {
  const std::string dir = temp_path("missing_folder");
  trace::start(dir + "/t.json", 0, 1);
  { const trace::Span span("cat", "one"); }
  ::testing::internal::CaptureStderr();
  EXPECT_FALSE(trace::flush());
  const std::string err = ::testing::internal::GetCapturedStderr();
  trace::stop();
  EXPECT_NE(err.find(dir + "/t.json.tmp."), std::string::npos) << err;
  EXPECT_NE(err.find("errno 2"), std::string::npos) << err;
  EXPECT_NE(err.find("was not written to " + dir + "/t.json"), std::string::npos) << err;
}

TEST(Trace, EachRankItsOwnFile) {
  EXPECT_EQ(trace::trace_path_for_rank("/x/t.json", 0, 1), "/x/t.json");
  EXPECT_EQ(trace::trace_path_for_rank("/x/t.json", 1, 2), "/x/t.rank1.json");
  EXPECT_EQ(trace::trace_path_for_rank("/x/trace", 3, 4), "/x/trace.rank3.json");
}

}  // namespace
}  // namespace zero
