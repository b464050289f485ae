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
/// Where `text` left strict JSON (RFC 8259), as strip_relaxed_syntax found it.
struct RelaxedSyntax {
  bool bom = false;                           // a UTF-8 byte-order mark first
  size_t comment = std::string::npos;         // the first comment's offset
  size_t trailing_comma = std::string::npos;  // the first trailing comma's offset
};
bool strip_relaxed_syntax(const std::string& text, std::string& out, std::string& error,
                          RelaxedSyntax* found = nullptr);
/// 1-based line of byte `offset` of `text`.
size_t line_of(const std::string& text, size_t offset);

/// Parses `text` (after strip_relaxed_syntax). Duplicate keys, at any depth,
/// are appended to `problems` as "<name>: <json.path>: duplicate key" (the last
/// value wins, so validation can go on). A syntax error throws
/// zero::ConfigError with one problem naming `name`, line and column.
nlohmann::json parse_relaxed(const std::string& text, const std::string& name,
                             std::vector<std::string>& problems, RelaxedSyntax* found = nullptr);

}  // namespace zero::config::detail
