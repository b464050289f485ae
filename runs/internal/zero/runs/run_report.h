// The run report: what a training run did and held, written by the engine
// itself when the environment asks, so a tool can run any program that
// calls zero::initialize (zero tune, zero memcheck, mingpt
// --find-max-params) without the program knowing.
//
// NOTE [run report]
// The environment of a run (every rank's):
//   ZERO_RUN_REPORT=FILE        each rank writes FILE.rank<R> (JSON): when
//                               its first engine goes, when
//                               ZERO_STOP_AFTER_STEPS ends the run, and when
//                               an exception nobody catches ends the process;
//   ZERO_STOP_AFTER_STEPS=N     after the N-th optimizer step of the
//                               process's first engine it writes the report
//                               (if asked), waits for the other ranks and
//                               ends the process with status 0 (0: right
//                               after initialize, nothing trained);
//   ZERO_DEVICE_MEMORY, ZERO_HOST_MEMORY, ZERO_NVME_BYTES: per-rank budgets
//                               (512MiB, 2GiB, 80e9), as InitOptions'
//                               device_memory_limit_bytes,
//                               host_memory_limit_bytes and nvme_limit_bytes
//                               where the program set none.
// Only the first engine of a process reports and stops (a second one, beside
// it or after it, an evaluation engine say, does neither). A report says:
//   outcome             "completed" (the engine went), "stopped"
//                       (ZERO_STOP_AFTER_STEPS), "out_of_memory" (an
//                       OutOfMemoryError was made: "error" has its tier and
//                       message), "failed" (an uncaught exception: "error")
//   steps, skipped_steps, step_time_s  optimizer steps of this process and
//                       the wall time of each (boundary to boundary; the
//                       first from initialize; on a GPU the engine waits
//                       for the device at each boundary while it reports,
//                       so a step's time is its work, not its launches)
//   samples_per_step, tokens_per_step (0 without InitOptions::
//                       tokens_per_sample), samples_per_s, tokens_per_s (the
//                       steps after the first)
//   peak_bytes          device (measured), pinned_host, host, nvme (ledger);
//                       host_total: pinned and pageable together, the peak
//                       of their sum
//   ledger              per tier, per kind: current and peak bytes
//   model_state_bytes, model_state_bytes_by_tier
//   process_peak_rss_bytes  VmHWM (since the process began, unless the
//                       program reset it: llama does before load_weights)
//   config              stage, precision, micro-batch, accumulation, offload;
//                       "resolved": the whole config as the engine read it
// A zero::OutOfMemoryError is seen wherever it is caught; CUDA's
// c10::OutOfMemoryError only when nobody catches it (the terminate handler):
// a program that catches it and exits reports "failed", and the tools read
// its log's out-of-memory line.
//   parameters          [{name, numel, layer}]: every trainable parameter at
//                       its full size, with its stage-3 layer (-1: always
//                       gathered), as zero::estimate takes them
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "zero/runs/estimate.h"
#include "zero/runs/memory_baseline.h"

namespace zero {

/// The environment's run-report settings (NOTE [run report]).
struct RunReportSettings {
  std::string path;                         // ZERO_RUN_REPORT ("": none)
  std::optional<int64_t> stop_after_steps;  // ZERO_STOP_AFTER_STEPS
  /// Reads them; throws UsageError naming the variable for a bad value.
  static RunReportSettings from_environment();
};

/// `base`.rank<R>: where rank `rank` writes the report ZERO_RUN_REPORT=base asks for.
std::string run_report_path(const std::string& base, int64_t rank);

/// One rank's report, read back.
struct RunReport {
  nlohmann::json json;  // all of it
  std::string outcome;  // completed, stopped, out_of_memory, failed
  std::string error_tier, error_message;
  int64_t rank = 0, world_size = 1, steps = 0, skipped_steps = 0;
  std::vector<double> step_time_s;
  int64_t samples_per_step = 0, tokens_per_step = 0;
  double samples_per_s = 0, tokens_per_s = 0;
  /// peak_bytes: device, pinned_host, host, nvme.
  int64_t peak(const std::string& tier) const;
  /// The ledger's peak of `kind` on `tier` ("host", "parameters").
  int64_t ledger_peak(const std::string& tier, const std::string& kind) const;
  std::vector<ParameterShape> parameters() const;
};

/// Reads `file`; throws IoError naming it (missing, not a report, damaged).
RunReport read_run_report(const std::string& file);

}  // namespace zero

namespace zero::testing {
/// A run report's memory figures, as figures_of(engine) gives them.
MemoryFigures figures_of(const RunReport& report);
}  // namespace zero::testing
