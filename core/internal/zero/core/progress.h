// A progress line for long work: done/total, rate, ETA and a caller's note.
// On a terminal it redraws one line in place (at most ~5 times a second); when
// stderr is not a terminal (CI, a log file) it prints a line at each quarter
// and at the end, so logs stay short. Not thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace zero {

class ProgressLine {
 public:
  /// `label` starts the line ("epoch 3/20"); `unit` names what is counted ("batches").
  ProgressLine(std::string label, int64_t total, std::string unit);
  /// Sets the count of finished items and the trailing note ("loss 0.123").
  void update(int64_t done, const std::string& note = "");
  /// Prints the final state with the total elapsed time and ends the line.
  void finish(const std::string& note = "");

 private:
  void draw(bool final_line);

  std::string label_, unit_, note_;
  int64_t total_, done_ = 0;
  int next_quarter_ = 1;
  bool tty_;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace zero
