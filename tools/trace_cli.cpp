// zero trace merge OUT IN...: the per-rank files of ZERO_TRACE as one trace
// (NOTE [trace]). Each rank's events keep their pid (the rank) and their
// timestamps (the system clock), so the ranks line up in one view.
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench.h"
#include "zero/core/command_files.h"
#include "zero/core/error.h"
#include "zero/snapshots/checkpoint_format.h"

namespace zero::tools {

namespace {

const char* kTraceUsage = R"(usage: zero trace merge OUT IN...

Joins the files ZERO_TRACE=FILE wrote, one a rank (FILE.rank0.json,
FILE.rank1.json, ...), into OUT: one Chrome trace with a row of threads per
rank, on one time axis. Open it in https://ui.perfetto.dev or chrome://tracing.
OUT may not be one of the INs.
)";

int fail(const std::string& message) {
  std::cerr << "zero trace: " << message << "\n(run zero trace --help for the usage)\n";
  return 2;
}

}  // namespace

namespace {

// Why event `i` of IN is not one a Chrome trace holds (NOTE [trace]: every
// event is an object with a one-letter "ph", a "name", integer "pid" and
// "tid", and a "ts" but for metadata), or "".
std::string event_problem(const nlohmann::json& e, size_t i, const std::set<int64_t>& of_file) {
  const std::string head = "event " + std::to_string(i) + " of traceEvents ";
  if (!e.is_object()) return head + "is " + e.dump().substr(0, 40) + ", not an event (an object with ph, name, pid, tid and ts)";
  if (!e.contains("ph") || !e["ph"].is_string() || e["ph"].get<std::string>().size() != 1)
    return head + "has no one-letter \"ph\" (its phase)";
  if (!e.contains("name") || !e["name"].is_string()) return head + "has no \"name\" string";
  for (const char* key : {"pid", "tid"})
    if (!e.contains(key) || !e[key].is_number_integer()) return head + "has no integer \"" + key + "\"";
  if (e["ph"] != "M" && (!e.contains("ts") || !e["ts"].is_number())) return head + "has no \"ts\" number (its time)";
  if (of_file.count(e["pid"].get<int64_t>()) == 0)
    return head + "is of pid " + std::to_string(e["pid"].get<int64_t>()) + ", a rank the file does not name (otherData)";
  return "";
}

}  // namespace

int trace_command(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      std::cout << kTraceUsage;
      return 0;
    }
  if (args.empty() || args[0] != "merge") return fail("expected 'zero trace merge OUT IN...'");
  if (args.size() < 3) return fail("merge: expected OUT and at least one IN");
  const std::string out = args[1];
  const std::vector<std::string> ins(args.begin() + 2, args.end());
  // Regular files only: a pipe would hang the read, a folder reads as nothing.
  for (const auto& in : ins)
    if (const std::string problem = input_file_problem("IN", in); !problem.empty()) return fail(problem);
  CommandFiles files;
  for (const auto& in : ins) files.reads("IN", in);
  files.writes("OUT", out);
  if (const std::string problem = files.problem(); !problem.empty()) return fail(problem);
  if (const std::string problem = ckpt::output_file_problem("OUT", out); !problem.empty()) return fail(problem);

  nlohmann::json merged = {{"displayTimeUnit", "ms"}, {"traceEvents", nlohmann::json::array()}};
  nlohmann::json ranks = nlohmann::json::array();
  std::set<int64_t> seen;
  int64_t dropped = 0;
  for (const auto& in : ins) {
    std::ifstream f(in);
    if (!f) return fail("IN " + in + ": cannot open it: " + std::strerror(errno) + " (errno " + std::to_string(errno) + ")");
    nlohmann::json t;
    try {
      t = nlohmann::json::parse(f);
    } catch (const nlohmann::json::exception& e) {
      return fail(in + ": not a trace (not valid JSON: " + std::string(e.what()) + ")");
    }
    if (!t.is_object() || !t.contains("traceEvents") || !t["traceEvents"].is_array())
      return fail(in + ": not a trace (no traceEvents array)");
    const auto other = t.value("otherData", nlohmann::json::object());
    // A rank's file names its rank; a merged one, its ranks.
    std::vector<int64_t> of_file;
    auto rank_of = [&](const nlohmann::json& r) {
      if (!r.is_number_integer() || r.get<int64_t>() < 0) return false;
      of_file.push_back(r.get<int64_t>());
      return true;
    };
    if (other.contains("rank") && !rank_of(other["rank"]))
      return fail(in + ": otherData.rank is " + other["rank"].dump() + "; expected a rank (an integer, 0 or more)");
    if (other.contains("ranks")) {
      if (!other["ranks"].is_array()) return fail(in + ": otherData.ranks is not a list of ranks");
      for (const auto& r : other["ranks"])
        if (!rank_of(r)) return fail(in + ": otherData.ranks holds " + r.dump() + "; expected ranks (integers, 0 or more)");
    }
    if (of_file.empty())
      return fail(in + ": names no rank (otherData.rank, or otherData.ranks of a merged file); merge takes the files "
                       "ZERO_TRACE writes, FILE.rankR.json, each once");
    for (const int64_t rank : of_file) {
      if (!seen.insert(rank).second)
        return fail(in + ": a second trace of rank " + std::to_string(rank) + " (each rank once among the INs)");
      ranks.push_back(rank);
    }
    if (other.contains("dropped_events")) {
      if (!other["dropped_events"].is_number_integer() || other["dropped_events"].get<int64_t>() < 0)
        return fail(in + ": otherData.dropped_events is " + other["dropped_events"].dump() + "; expected a count");
      dropped += other["dropped_events"].get<int64_t>();
    }
    const std::set<int64_t> mine(of_file.begin(), of_file.end());
    auto& events = t["traceEvents"];
    for (size_t i = 0; i < events.size(); ++i)
      if (const std::string problem = event_problem(events[i], i, mine); !problem.empty()) return fail(in + ": " + problem);
    for (auto& e : events) merged["traceEvents"].push_back(std::move(e));
  }
  merged["otherData"] = {{"writer", "zero trace merge"}, {"ranks", ranks}, {"dropped_events", dropped}};
  try {
    ckpt::write_file_atomically(out, merged.dump() + "\n");
  } catch (const Error& e) {
    return fail(e.what());
  }
  std::cout << "zero trace: " << merged["traceEvents"].size() << " events of " << ranks.size() << " rank(s) in " << out
            << (dropped > 0 ? " (" + std::to_string(dropped) + " dropped by the ranks, otherData.dropped_events)" : "")
            << "\n";
  return 0;
}

}  // namespace zero::tools
