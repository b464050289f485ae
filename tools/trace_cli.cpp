// zero trace merge OUT IN...: the per-rank files of ZERO_TRACE as one trace
// (NOTE [trace]). Each rank's events keep their pid (the rank) and their
// timestamps (the system clock), so the ranks line up in one view.
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

int trace_command(const std::vector<std::string>& args) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    std::cout << kTraceUsage;
    return 0;
  }
  if (args.empty() || args[0] != "merge") return fail("expected 'zero trace merge OUT IN...'");
  if (args.size() < 3) return fail("merge: expected OUT and at least one IN");
  const std::string out = args[1];
  const std::vector<std::string> ins(args.begin() + 2, args.end());
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
    if (!f) return fail(in + ": cannot be read");
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
    if (other.contains("rank") && other["rank"].is_number_integer()) of_file.push_back(other["rank"].get<int64_t>());
    if (other.contains("ranks") && other["ranks"].is_array())
      for (const auto& r : other["ranks"])
        if (r.is_number_integer()) of_file.push_back(r.get<int64_t>());
    for (const int64_t rank : of_file) {
      if (!seen.insert(rank).second)
        return fail(in + ": a second trace of rank " + std::to_string(rank) + " (each rank once among the INs)");
      ranks.push_back(rank);
    }
    if (other.contains("dropped_events") && other["dropped_events"].is_number_integer())
      dropped += other["dropped_events"].get<int64_t>();
    for (auto& e : t["traceEvents"]) merged["traceEvents"].push_back(std::move(e));
  }
  merged["otherData"] = {{"writer", "zero trace merge"}, {"ranks", ranks}, {"dropped_events", dropped}};
  try {
    ckpt::write_file_atomically(out, merged.dump() + "\n");
  } catch (const Error& e) {
    return fail(e.what());
  }
  std::cout << "zero trace: " << merged["traceEvents"].size() << " events of " << ins.size() << " rank(s) in " << out
            << (dropped > 0 ? " (" + std::to_string(dropped) + " dropped by the ranks, otherData.dropped_events)" : "")
            << "\n";
  return 0;
}

}  // namespace zero::tools
