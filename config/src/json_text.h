// Internal: DeepSpeed config text -> nlohmann::json, as leniently as
// DeepSpeed's hjson reader where it matters (comments, trailing commas) and
// strictly where DeepSpeed is strict (duplicate keys).
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace zero::config::detail {

/// Blanks `//`, `#` and `/* */` comments and trailing commas (outside strings)
/// with spaces, keeping every newline, so line and column numbers of the
/// result are those of `text`. Returns false and sets `error` (a problem line
/// without the file name) for an unterminated block comment.
bool strip_relaxed_syntax(const std::string& text, std::string& out, std::string& error);

/// Parses `text` (after strip_relaxed_syntax). Duplicate keys, at any depth,
/// are appended to `problems` as "<name>: <json.path>: duplicate key" (the last
/// value wins, so validation can go on). A syntax error throws
/// zero::ConfigError with one problem naming `name`, line and column.
nlohmann::json parse_relaxed(const std::string& text, const std::string& name,
                             std::vector<std::string>& problems);

}  // namespace zero::config::detail
