#include "zero/core/log.h"

#include <iostream>
#include <mutex>
#include <set>

namespace zero::log {
namespace {
struct State {
  std::mutex mu;
  std::string prefix;
  Level level = Level::kInfo;
  std::set<std::string> seen;
};
State& state() {
  // Never destroyed: code that runs at exit (the trace's last flush, NOTE
  // [trace]) may still log after static destructors have run.
  static State* s = new State();
  return *s;
}
const char* tag(Level l) {
  switch (l) {
    case Level::kDebug: return "debug: ";
    case Level::kInfo: return "";
    case Level::kWarning: return "warning: ";
    case Level::kError: return "error: ";
  }
  return "";
}
}  // namespace

void set_rank_prefix(std::string prefix) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().prefix = std::move(prefix);
}

void set_level(Level level) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().level = level;
}

void write(Level level, const std::string& message) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (level < s.level) return;
  std::cerr << s.prefix << "[zero] " << tag(level) << message << std::endl;
}

void warning_once(const std::string& key, const std::string& message) {
  {
    auto& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.seen.insert(key).second) return;
  }
  warning(message);
}

}  // namespace zero::log
