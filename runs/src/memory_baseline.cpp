// zero/runs/memory_baseline.h: memory figures, baselines and their comparison
// (zero memcheck's, and zero/testing/memory.h's for an engine).
#include "zero/runs/memory_baseline.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "zero/core/error.h"
#include "zero/core/text.h"
#include "zero/runs/run_report.h"
#include "zero/snapshots/checkpoint_format.h"

namespace zero::testing {
namespace {

constexpr const char* kTiers[] = {"device", "pinned_host", "host", "nvme"};
constexpr const char* kStateKinds[] = {"parameters", "gradients", "optimizer_states"};

// "1.23 MiB", "+4.1%".
std::string percent(double change) {
  if (std::isinf(change)) return "new";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%+.1f%%", 100 * change);
  return buf;
}

}  // namespace

MemoryFigures figures_of(const RunReport& report) {
  MemoryFigures f;
  try {
    for (const char* t : kTiers) f[std::string("peak/") + t] = report.peak(t);
    for (const auto& [tier, kinds] : report.json.at("ledger").items())
      for (const auto& [kind, v] : kinds.items()) f["ledger/" + tier + "/" + kind] = v.at("peak").get<int64_t>();
    for (const char* k : kStateKinds)
      f[std::string("model_states/") + k] = report.json.at("model_state_bytes").at(k).get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    throw IoError("a run report of rank " + std::to_string(report.rank) + " lacks a memory figure: " + e.what());
  }
  return f;
}

void write_baseline(const std::string& path, const Baseline& b) {
  nlohmann::json ranks = nlohmann::json::array();
  for (size_t r = 0; r < b.ranks.size(); ++r) ranks.push_back({{"rank", r}, {"figures", b.ranks[r]}});
  const nlohmann::json j = {{"format", "zero-memcheck-baseline"},
                            {"version", 1},
                            {"world_size", b.world_size},
                            {"command", b.command},
                            {"ranks", ranks}};
  ckpt::write_file_atomically(path, j.dump(2) + "\n");
}

Baseline read_baseline(const std::string& path) {
  Baseline b;
  try {
    const auto j = nlohmann::json::parse(ckpt::read_small_file(path));
    if (j.value("format", "") != "zero-memcheck-baseline")
      throw IoError(path + ": not a memory baseline (its \"format\" is not \"zero-memcheck-baseline\"; "
                           "zero memcheck record writes one)");
    if (const int64_t v = j.value("version", int64_t{1}); v != 1)
      throw IoError(path + ": a memory baseline of version " + std::to_string(v) + "; this zero reads version 1 (" +
                    (v > 1 ? "record it again with this zero" : "a damaged file") + ")");
    b.world_size = j.at("world_size").get<int64_t>();
    b.command = j.value("command", std::vector<std::string>{});
    for (const auto& r : j.at("ranks")) b.ranks.push_back(r.at("figures").get<MemoryFigures>());
  } catch (const nlohmann::json::exception& e) {
    throw IoError(path + ": a damaged memory baseline: " + e.what());
  }
  if (b.world_size < 1 || b.world_size > (int64_t{1} << 20))
    throw IoError(path + ": a damaged memory baseline: world_size " + std::to_string(b.world_size) +
                  "; expected 1 or more");
  for (size_t r = 0; r < b.ranks.size(); ++r)
    for (const auto& [name, bytes] : b.ranks[r])
      if (bytes < 0 || bytes > (int64_t{1} << 56))
        throw IoError(path + ": a damaged memory baseline: rank " + std::to_string(r) + "'s " + name + " is " +
                      std::to_string(bytes) + " bytes; expected 0 to 2^56");
  if (static_cast<int64_t>(b.ranks.size()) != b.world_size)
    throw IoError(path + ": a damaged memory baseline: " + std::to_string(b.ranks.size()) + " ranks' figures for world size " +
                  std::to_string(b.world_size));
  return b;
}

double MemoryRow::change() const {
  if (baseline == 0) return now == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return static_cast<double>(now) / static_cast<double>(baseline) - 1;
}

std::string MemoryComparison::table() const {
  std::ostringstream out;
  char line[256];
  std::snprintf(line, sizeof line, "%-5s %-36s %12s %12s %8s\n", "rank", "figure", "baseline", "now", "change");
  out << line;
  for (const auto& r : rows) {
    std::snprintf(line, sizeof line, "%-5lld %-36s %12s %12s %8s%s\n", static_cast<long long>(r.rank), r.figure.c_str(),
                  format_bytes(r.baseline).c_str(), format_bytes(r.now).c_str(), percent(r.change()).c_str(),
                  r.grew ? "  GREW" : "");
    out << line;
  }
  return out.str();
}

MemoryComparison compare(const Baseline& baseline, const std::vector<MemoryFigures>& now, double tolerance,
                         int64_t slack_bytes) {
  MemoryComparison c;
  if (static_cast<int64_t>(now.size()) != baseline.world_size) {
    c.ok = false;
    c.message = "the baseline was recorded on " + std::to_string(baseline.world_size) + " rank(s), this run has " +
                std::to_string(now.size()) + ": record a baseline at this world size";
    return c;
  }
  int grew = 0;
  for (size_t r = 0; r < now.size(); ++r) {
    std::set<std::string> names;
    for (const auto& [k, v] : baseline.ranks[r]) names.insert(k);
    for (const auto& [k, v] : now[r]) names.insert(k);
    for (const auto& name : names) {
      MemoryRow row;
      row.rank = static_cast<int64_t>(r);
      row.figure = name;
      const auto b = baseline.ranks[r].find(name);
      const auto n = now[r].find(name);
      row.baseline = b == baseline.ranks[r].end() ? 0 : b->second;
      row.now = n == now[r].end() ? 0 : n->second;
      if (row.baseline == 0 && row.now == 0) continue;
      const double allowed = static_cast<double>(row.baseline) * (1 + tolerance);
      row.grew = static_cast<double>(row.now) > allowed && row.now - row.baseline > slack_bytes;
      grew += row.grew;
      c.rows.push_back(row);
    }
  }
  c.ok = grew == 0;
  char head[160];
  std::snprintf(head, sizeof head, "%d figure(s) grew past the tolerance of %.1f%%%s\n", grew, 100 * tolerance,
                slack_bytes > 0 ? (" and " + format_bytes(slack_bytes)).c_str() : "");
  c.message = std::string(head) + c.table();
  return c;
}

}  // namespace zero::testing
