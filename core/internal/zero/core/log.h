// Logging: one line per message on stderr, prefixed with the rank when there
// is more than one. Thread-safe (a mutex serialises whole lines).
#pragma once

#include <string>

namespace zero::log {

enum class Level { kDebug, kInfo, kWarning, kError };

/// Sets the prefix printed before every line ("[rank 1] "); empty for none.
void set_rank_prefix(std::string prefix);
/// Messages below this level are dropped. Default kInfo.
void set_level(Level level);

void write(Level level, const std::string& message);
inline void info(const std::string& m) { write(Level::kInfo, m); }
inline void warning(const std::string& m) { write(Level::kWarning, m); }
inline void error(const std::string& m) { write(Level::kError, m); }
inline void debug(const std::string& m) { write(Level::kDebug, m); }

/// Logs a warning only the first time `key` is seen in this process, so a
/// condition met every step is reported once.
void warning_once(const std::string& key, const std::string& message);

}  // namespace zero::log
