#include "zero/core/error.h"

#include <sstream>

namespace zero {
namespace {
std::string join_problems(const std::vector<std::string>& problems) {
  std::ostringstream out;
  if (problems.size() > 1) out << problems.size() << " problems in the DeepSpeed config:\n";
  for (size_t i = 0; i < problems.size(); ++i) {
    if (i) out << '\n';
    out << (problems.size() > 1 ? "  " : "") << problems[i];
  }
  return out.str();
}
}  // namespace

ConfigError::ConfigError(std::vector<std::string> problems)
    : Error(ErrorKind::kConfig, join_problems(problems)), problems_(std::move(problems)) {}

namespace detail {
void throw_internal(const char* file, int line, const char* condition, const std::string& message) {
  std::ostringstream out;
  out << "internal error at " << file << ":" << line << ": check '" << condition << "' failed";
  if (!message.empty()) out << ": " << message;
  out << " (this is a bug in zero; please report it)";
  throw InternalError(out.str());
}
}  // namespace detail
}  // namespace zero
