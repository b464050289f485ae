// The engine's side of the run report (NOTE [run report]): step times, the
// stop after ZERO_STOP_AFTER_STEPS, the file written at the end.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "zero/runtime/engine.h"
#include "zero/runs/run_report.h"

namespace zero::detail {

class RunReporter {
 public:
  /// The reporter of `engine` when ZERO_RUN_REPORT asks for one and no
  /// other engine of this process reports; else null. Installs a terminate
  /// handler that writes the report of an uncaught exception.
  static std::unique_ptr<RunReporter> start(Engine::Impl& engine);
  ~RunReporter();
  RunReporter(const RunReporter&) = delete;
  RunReporter& operator=(const RunReporter&) = delete;

  /// At the end of initialize: ZERO_STOP_AFTER_STEPS=0 writes and exits
  /// (a program that ends itself at the stop is left to do so).
  void after_initialize();
  /// After each optimizer step: its time; the stop when it is the N-th.
  void after_step();
  /// ZERO_STOP_AFTER_STEPS' steps are taken (Engine::stop_requested).
  bool stop_due() const;
  /// From the engine's destructor: completed, out_of_memory or failed.
  void at_engine_end();
  /// Writes this rank's report with `outcome` and `error` (may be "").
  void write(const std::string& outcome, const std::string& error);

 private:
  RunReporter(Engine::Impl& engine, RunReportSettings settings);
  [[noreturn]] void stop();
  bool program_ends() const;

  Engine::Impl& engine_;
  RunReportSettings settings_;
  std::chrono::steady_clock::time_point last_boundary_;
  std::vector<double> step_times_;
  bool written_ = false;
  bool stopped_ = false;  // the stop came, and the program ends itself
  int64_t ooms_at_start_ = 0;  // out_of_memory_count() when the engine was made
};

/// Engine::peak_bytes(Tier::kDevice) of an engine's state.
int64_t device_peak_bytes(const Engine::Impl& engine);

/// The parameters as the engine laid them out (zero::testing::parameter_shapes).
std::vector<ParameterShape> parameter_shapes(const Engine::Impl& engine);

}  // namespace zero::detail
