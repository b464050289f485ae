#include "zero/core/error.h"

#include <cstdlib>
#include <mutex>
#include <sstream>
#include <string_view>

namespace zero {
namespace {
std::string join_problems(const std::vector<std::string>& problems, const std::string& subject) {
  std::ostringstream out;
  if (problems.size() > 1) out << problems.size() << " problems in " << subject << ":\n";
  for (size_t i = 0; i < problems.size(); ++i) {
    if (i) out << '\n';
    out << (problems.size() > 1 ? "  " : "") << problems[i];
  }
  return out.str();
}
}  // namespace

ConfigError::ConfigError(std::vector<std::string> problems, const std::string& subject)
    : Error(ErrorKind::kConfig, join_problems(problems, subject)), problems_(std::move(problems)) {}

namespace {
std::mutex g_oom_mutex;
std::string g_last_oom;
int64_t g_oom_count = 0;
}  // namespace

OutOfMemoryError::OutOfMemoryError(const std::string& message) : Error(ErrorKind::kOutOfMemory, message) {
  std::lock_guard<std::mutex> lock(g_oom_mutex);
  g_last_oom = message;
  ++g_oom_count;
}

int64_t out_of_memory_count() {
  std::lock_guard<std::mutex> lock(g_oom_mutex);
  return g_oom_count;
}

std::string last_out_of_memory() {
  std::lock_guard<std::mutex> lock(g_oom_mutex);
  return g_last_oom;
}

std::string out_of_memory_tier(const std::string& m) {
  // The ledger's words ("out of memory on the host (pinned and pageable)",
  // "... on the pinned_host tier"), the emulated device's, CUDA's.
  const auto on = m.find("out of memory on the ");
  if (on != std::string::npos) {
    const std::string rest = m.substr(on + 21, 16);
    for (const char* t : {"device", "pinned_host", "host", "nvme"})
      if (rest.rfind(t, 0) == 0) return t;
  }
  if (m.find("CUDA out of memory") != std::string::npos || m.find("CUDA error: out of memory") != std::string::npos)
    return "device";
  if (m.find("cannot page-lock") != std::string::npos) return "pinned_host";
  if (m.find("DefaultCPUAllocator: not enough memory") != std::string::npos) return "host";
  return "";
}

namespace {
bool env_on(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}
}  // namespace

std::string error_text(const std::string& what) {
  if (env_on("ZERO_DEBUG") || env_on("TORCH_SHOW_CPP_STACKTRACES")) return what;
  std::string out;
  size_t begin = 0;
  bool after_trace = false;  // the blank line that ends a trace goes with it
  while (begin <= what.size()) {
    size_t end = what.find('\n', begin);
    if (end == std::string::npos) end = what.size();
    const std::string_view line(what.data() + begin, end - begin);
    const bool trace = line.rfind("Exception raised from ", 0) == 0 || line.rfind("frame #", 0) == 0;
    const bool skip = trace || (after_trace && line.empty());
    after_trace = trace || (after_trace && line.empty());
    if (!skip) {
      if (!out.empty()) out += '\n';
      out += line;
    }
    begin = end + 1;
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

std::string error_text(const std::exception& e) { return error_text(std::string(e.what())); }

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
