// The run report's format (NOTE [run report] in zero/runs/run_report.h): the
// environment's settings, and a report read back by the tools. The engine
// writes it (runtime/src/run_reporter.cpp).
#include "zero/runs/run_report.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "zero/core/command_files.h"
#include "zero/core/error.h"
#include "zero/snapshots/checkpoint_format.h"

namespace zero {

RunReportSettings RunReportSettings::from_environment() {
  RunReportSettings s;
  if (const char* v = std::getenv("ZERO_RUN_REPORT")) s.path = v;
  if (const char* v = std::getenv("ZERO_STOP_AFTER_STEPS"); v != nullptr && *v != '\0') {
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(v, &end, 10);
    if (*end != '\0' || errno != 0 || n < 0 || n > (int64_t{1} << 40))
      throw UsageError(std::string("ZERO_STOP_AFTER_STEPS: expected a step count (0 or more); got \"") + v + "\"");
    s.stop_after_steps = n;
  }
  return s;
}

std::string run_report_path(const std::string& base, int64_t rank) { return run_report_file(base, rank); }

int64_t RunReport::peak(const std::string& tier) const { return json.at("peak_bytes").value(tier, int64_t{0}); }

int64_t RunReport::ledger_peak(const std::string& tier, const std::string& kind) const {
  return json.at("ledger").at(tier).at(kind).at("peak").get<int64_t>();
}

std::vector<ParameterShape> RunReport::parameters() const {
  std::vector<ParameterShape> out;
  for (const auto& p : json.value("parameters", nlohmann::json::array()))
    out.push_back({p.at("name").get<std::string>(), p.at("numel").get<int64_t>(), p.at("layer").get<int>(),
                   p.value("frozen", false)});
  return out;
}

RunReport read_run_report(const std::string& file) {
  RunReport r;
  try {
    r.json = nlohmann::json::parse(ckpt::read_small_file(file));
    if (r.json.value("format", "") != "zero-run-report")
      throw IoError(file + ": not a zero run report (its \"format\" is not \"zero-run-report\")");
    if (const int64_t v = r.json.value("version", int64_t{1}); v != 1)
      throw IoError(file + ": a run report of version " + std::to_string(v) + "; this zero reads version 1 (" +
                    (v > 1 ? "written by a newer zero: run it again with this one" : "a damaged report") + ")");
    r.outcome = r.json.at("outcome").get<std::string>();
    if (r.json.contains("error")) {
      r.error_tier = r.json.at("error").value("tier", "");
      r.error_message = r.json.at("error").value("message", "");
    }
    r.rank = r.json.at("rank").get<int64_t>();
    r.world_size = r.json.at("world_size").get<int64_t>();
    r.steps = r.json.at("steps").get<int64_t>();
    r.skipped_steps = r.json.at("skipped_steps").get<int64_t>();
    r.step_time_s = r.json.at("step_time_s").get<std::vector<double>>();
    r.samples_per_step = r.json.at("samples_per_step").get<int64_t>();
    r.tokens_per_step = r.json.at("tokens_per_step").get<int64_t>();
    r.samples_per_s = r.json.at("samples_per_s").get<double>();
    r.tokens_per_s = r.json.at("tokens_per_s").get<double>();
    // Nonsense is refused, naming the key and value, not clamped or used.
    auto bad = [&](const std::string& key, const nlohmann::json& v, const std::string& expected) {
      throw IoError(file + ": " + key + ": expected " + expected + "; got " + v.dump() + " (a damaged or hand-made run report)");
    };
    if (r.world_size < 1) bad("world_size", r.json.at("world_size"), "1 or more");
    if (r.rank < 0 || r.rank >= r.world_size) bad("rank", r.json.at("rank"), "0.." + std::to_string(r.world_size - 1));
    if (r.steps < 0) bad("steps", r.json.at("steps"), "0 or more");
    if (r.skipped_steps < 0 || r.skipped_steps > r.steps) bad("skipped_steps", r.json.at("skipped_steps"), "0..steps");
    if (r.samples_per_step < 0) bad("samples_per_step", r.json.at("samples_per_step"), "0 or more");
    if (r.tokens_per_step < 0) bad("tokens_per_step", r.json.at("tokens_per_step"), "0 or more");
    for (double t : r.step_time_s)
      if (!std::isfinite(t) || t < 0) bad("step_time_s", r.json.at("step_time_s"), "times of 0 s or more");
    for (const auto& [tier, v] : r.json.at("peak_bytes").items())
      if (!v.is_number_integer() || v.get<int64_t>() < 0) bad("peak_bytes." + tier, v, "a byte count, 0 or more");
    if (r.json.contains("config") && r.json.at("config").contains("train_micro_batch_size_per_gpu")) {
      const auto& mb = r.json.at("config").at("train_micro_batch_size_per_gpu");
      if (!mb.is_number_integer() || mb.get<int64_t>() < 1) bad("config.train_micro_batch_size_per_gpu", mb, "1 or more");
    }
    int64_t total = 0;
    for (const auto& p : r.json.value("parameters", nlohmann::json::array())) {
      const auto& n = p.at("numel");
      if (!n.is_number_integer() || n.get<int64_t>() < 0 || __builtin_add_overflow(total, n.get<int64_t>(), &total))
        bad("parameters[" + p.value("name", std::string("?")) + "].numel", n, "an element count, 0 or more");
    }
  } catch (const nlohmann::json::exception& e) {
    throw IoError(file + ": a damaged run report: " + e.what());
  }
  return r;
}

}  // namespace zero
