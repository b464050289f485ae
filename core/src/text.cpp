#include "zero/core/text.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace zero {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1] ? 1 : 0)});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string nearest(const std::string& word, const std::vector<std::string>& candidates,
                    size_t max_distance) {
  std::string best;
  size_t best_d = (max_distance > 0 ? max_distance : std::max<size_t>(2, word.size() / 3)) + 1;
  for (const auto& c : candidates) {
    const size_t d = edit_distance(word, c);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

std::string format_bytes(int64_t nbytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(nbytes);
  int u = 0;
  while (std::abs(v) >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

std::optional<int64_t> parse_byte_size(const std::string& text) {
  static const std::pair<const char*, double> kUnits[] = {
      {"", 1},          {"B", 1},          {"KB", 1e3},           {"MB", 1e6},
      {"GB", 1e9},      {"TB", 1e12},      {"KiB", 1024.0},       {"MiB", 1048576.0},
      {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
  const auto digits_end = text.find_first_not_of("0123456789.eE+-");
  const std::string number = text.substr(0, digits_end), unit = digits_end == std::string::npos ? "" : text.substr(digits_end);
  if (number.empty() || number.find_first_of("0123456789") == std::string::npos) return std::nullopt;
  double v = 0;
  try {
    size_t used = 0;
    v = std::stod(number, &used);
    if (used != number.size()) return std::nullopt;
  } catch (const std::exception&) {
    return std::nullopt;
  }
  for (const auto& [name, mult] : kUnits) {
    if (unit != name) continue;
    const double bytes = v * mult;
    if (!(bytes >= 1) || bytes > 9e18) return std::nullopt;
    return static_cast<int64_t>(bytes);
  }
  return std::nullopt;
}

}  // namespace zero
