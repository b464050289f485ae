// Memory figures and baselines: one rank's figures by name, a baseline file
// of every rank's, and the comparison that zero memcheck and
// zero/testing/memory.h make. No engine here: the tools read the figures
// from run reports (zero/runs/run_report.h).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace zero::testing {

/// One rank's figures, by name: "peak/<tier>" (device measured; pinned_host,
/// host, nvme from the ledger), "ledger/<tier>/<kind>" (the ledger's peak of
/// that kind: parameters, gradients, optimizer_states, activations,
/// comm_buffers) and "model_states/<kind>" (bytes now).
using MemoryFigures = std::map<std::string, int64_t>;

/// A baseline file: every rank's figures and how they were made.
struct Baseline {
  int64_t world_size = 1;  ///< Ranks of the run recorded; ranks holds as many.
  std::vector<MemoryFigures> ranks;  ///< by rank
  std::vector<std::string> command;  ///< what ran (zero memcheck record), or empty
};
/// Writes `path` atomically. Throws IoError.
void write_baseline(const std::string& path, const Baseline& baseline);
/// Throws IoError naming the file (missing, damaged, not a baseline).
Baseline read_baseline(const std::string& path);

/// One figure of one rank, compared.
struct MemoryRow {
  int64_t rank = 0;  ///< The rank whose figure this is.
  std::string figure;  ///< as in MemoryFigures
  /// @var baseline
  /// The figure in the baseline, bytes (0 when the baseline lacks it).
  /// @var now
  /// The figure now, bytes (0 when this run lacks it).
  int64_t baseline = 0, now = 0;
  bool grew = false;   ///< past the tolerance
  double change() const;  ///< now / baseline - 1 (inf when the baseline is 0 and now is not)
};

/// What a comparison found; true when nothing grew past the tolerance.
struct MemoryComparison {
  bool ok = true;  ///< Nothing grew, and the world sizes matched.
  std::vector<MemoryRow> rows;  ///< every figure non-zero in either
  std::string message;          ///< how many grew and the table, or why nothing was compared
  /// Returns `ok`.
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

}  // namespace zero::testing
