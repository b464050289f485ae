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

#include "zero/runs/memory_baseline.h"
#include "zero/runtime/engine.h"
#include "zero/runtime/estimate.h"

namespace zero::testing {

// MemoryFigures, Baseline, MemoryComparison and compare():
// zero/runs/memory_baseline.h.

/// This rank's figures now (a run report's, zero memcheck's, are the same).
MemoryFigures figures_of(Engine& engine);

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
  bool ok = true;       ///< Whether the check holds.
  std::string message;  ///< What was compared, with the numbers (also when it holds).
  /// True when the check holds (`ok`).
  explicit operator bool() const { return ok; }
};

/// The engine's model-state bytes (the ledger's, per tier and kind) against
/// the ZeRO formulas for its config and parameters (estimate_model_states):
/// each within `tolerance` of the formula's, or both under a hundredth of a
/// byte per parameter.
Check expect_model_states_near_formula(Engine& engine, double tolerance);

}  // namespace zero::testing
