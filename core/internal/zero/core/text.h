// Small text helpers shared by config validation and the command-line tools.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace zero {

/// Levenshtein distance between two strings.
size_t edit_distance(const std::string& a, const std::string& b);

/// The candidate closest to `word` by edit distance, if it is close enough to
/// be a plausible typo: within `max_distance` edits, or by default within
/// max(2, |word| / 3). Empty when none is.
std::string nearest(const std::string& word, const std::vector<std::string>& candidates,
                    size_t max_distance = 0);

/// Human-readable bytes: "1.50 GiB".
std::string format_bytes(int64_t nbytes);

/// A byte count as a user writes it: "80e9", "512MiB", "2GiB", "1.5TB", "4096"
/// (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB). Empty when it is not one, or
/// below one byte or past 9e18.
std::optional<int64_t> parse_byte_size(const std::string& text);

}  // namespace zero
