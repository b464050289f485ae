#include "zero/core/progress.h"

#include <unistd.h>

#include <cstdio>

namespace zero {
namespace {
std::string format_duration(double s) {
  if (!(s >= 0) || s > 1e7) return "--:--";
  const long total = static_cast<long>(s + 0.5);
  char buf[32];
  if (total >= 3600) std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", total / 3600, total / 60 % 60, total % 60);
  else std::snprintf(buf, sizeof buf, "%ld:%02ld", total / 60, total % 60);
  return buf;
}
}  // namespace

ProgressLine::ProgressLine(std::string label, int64_t total, std::string unit)
    : label_(std::move(label)), unit_(std::move(unit)), total_(total),
      tty_(isatty(STDERR_FILENO) != 0), start_(std::chrono::steady_clock::now()), last_draw_(start_) {}

void ProgressLine::update(int64_t done, const std::string& note) {
  done_ = done;
  note_ = note;
  const auto now = std::chrono::steady_clock::now();
  if (tty_) {
    if (now - last_draw_ > std::chrono::milliseconds(200)) {
      last_draw_ = now;
      draw(false);
    }
  } else if (total_ > 0 && next_quarter_ < 4 && done_ * 4 >= total_ * next_quarter_) {
    ++next_quarter_;
    draw(false);
  }
}

void ProgressLine::finish(const std::string& note) {
  if (!note.empty()) note_ = note;
  draw(true);
}

void ProgressLine::draw(bool final_line) {
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double rate = elapsed > 0 ? static_cast<double>(done_) / elapsed : 0.0;
  const int width = 20;
  const int filled = total_ > 0 ? static_cast<int>(width * std::min<int64_t>(done_, total_) / total_) : width;
  std::string bar(static_cast<size_t>(filled), '#');
  bar.append(static_cast<size_t>(width - filled), '.');
  const std::string time = final_line ? "in " + format_duration(elapsed)
                                      : "ETA " + format_duration(rate > 0 ? (total_ - done_) / rate : -1);
  std::fprintf(stderr, "%s%s [%s] %lld/%lld %s | %.1f %s/s | %s%s%s%s", tty_ ? "\r" : "",
               label_.c_str(), bar.c_str(), static_cast<long long>(done_),
               static_cast<long long>(total_), unit_.c_str(), rate, unit_.c_str(), time.c_str(),
               note_.empty() ? "" : " | ", note_.c_str(), tty_ && !final_line ? "\033[K" : "\n");
  std::fflush(stderr);
}

}  // namespace zero
