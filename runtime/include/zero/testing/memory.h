// Memory-regression checks for users' own tests, with any test framework:
// a run's memory figures (peaks per tier and per kind, model-state bytes)
// held to a baseline recorded earlier, and an engine's model states held to
// the ZeRO formulas (zero::estimate_model_states). `zero memcheck` is the
// same comparison from the command line.
//
//   auto c = zero::testing::expect_model_states_near_formula(engine, 0.05);
//   EXPECT_TRUE(c) << c.message;                      // GoogleTest
//   auto r = zero::testing::compare_with_baseline(engine, "mem.json", 0.05);
//   REQUIRE(r.ok);                                    // Catch2, or if (!r) ...
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "zero/runtime/engine.h"
#include "zero/runtime/estimate.h"

namespace zero::testing {

/// One rank's figures, by name: "peak/<tier>" (device measured; pinned_host,
/// host, nvme from the ledger), "ledger/<tier>/<kind>" (the ledger's peak of
/// that kind: parameters, gradients, optimizer_states, activations,
/// comm_buffers) and "model_states/<kind>" (bytes now).
using MemoryFigures = std::map<std::string, int64_t>;

/// This rank's figures now (a run report's, zero memcheck's, are the same).
MemoryFigures figures_of(Engine& engine);

/// A baseline file: every rank's figures and how they were made.
struct Baseline {
  int64_t world_size = 1;
  std::vector<MemoryFigures> ranks;  // by rank
  std::vector<std::string> command;  // what ran (zero memcheck record), or empty
};
/// Writes `path` atomically. Throws IoError.
void write_baseline(const std::string& path, const Baseline& baseline);
/// Throws IoError naming the file (missing, damaged, not a baseline).
Baseline read_baseline(const std::string& path);

/// One figure of one rank, compared.
struct MemoryRow {
  int64_t rank = 0;
  std::string figure;  // as in MemoryFigures
  int64_t baseline = 0, now = 0;
  bool grew = false;   // past the tolerance
  double change() const;  // now / baseline - 1 (inf when the baseline is 0)
};

/// What a comparison found; true when nothing grew past the tolerance.
struct MemoryComparison {
  bool ok = true;
  std::vector<MemoryRow> rows;  // every figure non-zero in either
  std::string message;          // the table, or why nothing was compared
  explicit operator bool() const { return ok; }
  /// A table of every row: rank, figure, baseline, now, change, and GREW
  /// against those that grew.
  std::string table() const;
};

/// `now` (by rank) against `baseline`: a figure grew when it is above the
/// baseline by more than `tolerance` (0.05: 5%) of it and by more than
/// `slack_bytes`; a figure absent from the baseline grew when it is not 0.
/// Another world size is not compared (ok false, said in message).
MemoryComparison compare(const Baseline& baseline, const std::vector<MemoryFigures>& now, double tolerance,
                         int64_t slack_bytes = 0);

/// This rank's figures now against rank `engine.rank()` of the baseline file.
/// Throws IoError for an unreadable baseline.
MemoryComparison compare_with_baseline(Engine& engine, const std::string& path, double tolerance,
                                       int64_t slack_bytes = 0);

/// The parameters as the engine lays them out, at their full size, with
/// their stage-3 layer (-1 below stage 3, and for those always gathered):
/// what zero::estimate_model_states takes.
std::vector<ParameterShape> parameter_shapes(Engine& engine);

/// A check's outcome: true when it holds; `message` says what was compared.
struct Check {
  bool ok = true;
  std::string message;
  explicit operator bool() const { return ok; }
};

/// The engine's model-state bytes (the ledger's, per tier and kind) against
/// the ZeRO formulas for its config and parameters (estimate_model_states):
/// each within `tolerance` of the formula's, or both under a hundredth of a
/// byte per parameter.
Check expect_model_states_near_formula(Engine& engine, double tolerance);

}  // namespace zero::testing
