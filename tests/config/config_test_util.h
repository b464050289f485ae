// Helpers shared by the config tests: the problems a config produces, and a
// printable join of them for failure messages.
#pragma once

#include <string>
#include <vector>

#include "zero/config/config.h"
#include "zero/core/error.h"

namespace zero::config::test {

/// The problems of JSON text (named "ds.json" in messages); empty when it loads.
inline std::vector<std::string> problems_of(const std::string& text, const LoadOptions& options = {}) {
  try {
    load_string(text, options, "ds.json");
  } catch (const ConfigError& e) {
    return e.problems();
  }
  return {};
}

/// The same for text resolved at `world_size`.
inline std::vector<std::string> problems_of(const std::string& text, int64_t world_size) {
  LoadOptions o;
  o.world_size = world_size;
  return problems_of(text, o);
}

/// The problems of a config file; empty when it loads.
inline std::vector<std::string> problems_of_file(const std::string& path, const LoadOptions& options = {}) {
  try {
    load_file(path, options);
  } catch (const ConfigError& e) {
    return e.problems();
  }
  return {};
}

inline std::string joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& l : lines) out += l + "\n";
  return out;
}

}  // namespace zero::config::test
