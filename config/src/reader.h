// Internal: typed reading of one JSON object of a DeepSpeed config, with the
// coercions, "auto" handling and unknown-key checks DeepSpeed applies.
//
// NOTE [config problems]
// Nothing here throws on a user mistake: every problem is appended to the
// Context (one line, "<file>: <json.path>: expected <what>; got <found>") and
// reading goes on with the default, so load_string reports all problems of a
// file at once. Only the end of load_string throws ConfigError.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>

#include "zero/config/config.h"

namespace zero::config::detail {

using Json = nlohmann::json;

/// `v` as short JSON text for messages ("ssd" keeps its quotes).
std::string show(const Json& v);

/// Collects problems, warnings and resolved values while a config is read.
class Context {
 public:
  Context(std::string name, const LoadOptions& options) : name_(std::move(name)), options_(options) {}

  const std::string& name() const { return name_; }
  const LoadOptions& options() const { return options_; }
  const AutoValues& auto_values() const { return options_.auto_values; }
  /// Whether AutoValues::`needs` holds a stand-in (LoadOptions::auto_stand_ins).
  bool is_stand_in(const char* needs) const { return needs != nullptr && stand_ins_.count(needs) != 0; }
  /// How the caller fills AutoValues::`needs` (LoadOptions::auto_hint).
  std::string auto_hint(const char* needs) const {
    return options_.auto_hint ? options_.auto_hint(needs) : std::string("AutoValues::") + needs;
  }
  void set_stand_ins(std::set<std::string> names) { stand_ins_ = std::move(names); }

  /// "<file>: <path>: <text>"; path may be empty.
  void problem(const std::string& path, const std::string& text);
  void warn(const std::string& path, const std::string& text);
  /// Records (or replaces) the resolved value at `path`.
  void record(const std::string& path, const Json& value, Origin origin);

  std::vector<std::string>& problems() { return problems_; }
  std::vector<std::string>& warnings() { return warnings_; }
  std::vector<ResolvedValue>& resolved() { return resolved_; }
  const Json& canonical() const { return canonical_; }

 private:
  std::string line(const std::string& path, const std::string& text) const;

  std::string name_;
  const LoadOptions& options_;
  std::vector<std::string> problems_;
  std::vector<std::string> warnings_;
  std::unordered_set<std::string> warned_;  // warnings_ as a set: each said once, in linear time
  std::vector<ResolvedValue> resolved_;
  Json canonical_ = Json::object();
  std::set<std::string> stand_ins_;
};

/// Unknown keys of one object named one by one, with a suggestion; the
/// rest are counted in one line ("... and 199,990 more unknown keys"), so a
/// file of a million wrong keys is read in time linear in its size and says
/// what is wrong in a screenful.
inline constexpr size_t kMaxUnknownKeysShown = 20;
/// "199,990": a count with thousands separators.
std::string with_commas(size_t n);

/// What a section does with unknown keys and with "auto".
enum class Kind {
  kStrict,  // pydantic model: unknown key = error, unresolved "auto" dropped (default used)
  kPlain,   // plain dict: unknown key ignored with a warning, unresolved "auto" an error
  kKwargs,  // constructor kwargs (optimizer/scheduler params): unknown key and "auto" errors
};

/// The value the Hugging Face integration would put in place of "auto".
struct AutoFill {
  std::optional<Json> value;  // none: not known (the program gave no AutoValues member)
  const char* needs = nullptr;  // the AutoValues member to supply; null: HF does not fill this key
};

/// A key and its accepted alias (a stage3_* name and its bare field name).
/// `name` is the spelling recorded in Config::resolved.
struct Key {
  Key(const char* n) : name(n) {}  // NOLINT(google-explicit-constructor): keys read as literals
  Key(const char* n, const char* a) : name(n), alias(a) {}
  std::string name;
  std::string alias;
};

/// Inclusive/exclusive bounds for a number.
struct Range {
  std::optional<double> min;
  bool min_exclusive = false;
  std::optional<double> max;
  bool max_exclusive = false;
  static Range at_least(double v) { return Range{v, false, std::nullopt, false}; }
  static Range above(double v) { return Range{v, true, std::nullopt, false}; }
  static Range between(double lo, double hi) { return Range{lo, false, hi, false}; }
};

/// How a read went.
enum class Got {
  kAbsent,   // key missing (or null in a plain section): default kept
  kGiven,    // value from the file
  kFilled,   // "auto" resolved from AutoValues
  kDropped,  // "auto" dropped: default kept (strict sections)
  kBad,      // a problem was reported: default kept
};

/// One JSON object of the config (or an absent one, which reads as defaults).
class Section {
 public:
  /// `path`: the JSON path used in messages ("" for the top level);
  /// `record_path`: the prefix of Config::resolved entries (the canonical
  /// name, e.g. "bf16" when the file says "bfloat16").
  Section(Context& ctx, std::string path, const Json* object, Kind kind,
          std::optional<std::string> record_path = std::nullopt);

  bool present() const { return object_ != nullptr; }
  const std::string& path() const { return path_; }
  std::string path_of(const std::string& key) const;
  std::string record_path_of(const std::string& key) const;
  Context& context() { return ctx_; }

  /// Declares keys valid here that this reader does not read itself.
  void known(std::initializer_list<const char*> keys);
  /// The raw value of `key` (declaring it known); nullptr when absent.
  const Json* raw(const std::string& key);
  /// True if `key` or its alias is present (declaring both known). Reports a
  /// problem when both spellings are given.
  bool has(const Key& key);

  /// The nested object `key` as a section. A non-object value is a problem
  /// (and reads as absent); JSON null reads as absent.
  Section child(const std::string& key, Kind kind,
                std::optional<std::string> record_path = std::nullopt);

  // Typed reads. `out` holds the default on entry and keeps it unless a
  // valid value is found. Each read records its value in Config::resolved
  // unless `record` is false.
  Got read_bool(const Key& key, bool& out, const AutoFill& fill = {}, bool record = true);
  Got read_int(const Key& key, int64_t& out, std::optional<Range> range = std::nullopt,
               const AutoFill& fill = {}, bool record = true);
  Got read_double(const Key& key, double& out, std::optional<Range> range = std::nullopt,
                  const AutoFill& fill = {}, bool record = true);
  Got read_string(const Key& key, std::string& out, bool record = true);
  /// One of `allowed`; case-insensitive matching stores the allowed spelling.
  Got read_enum(const Key& key, std::string& out, const std::vector<std::string>& allowed,
                bool case_sensitive, bool record = true);

  /// The shared part of every typed read: presence, null, "auto", and the
  /// "expected <what>; got <found>" problem when `accept` refuses the value.
  /// `current` gives the value now in `out`, for recording.
  Got read_value(const Key& key, const std::string& what, const AutoFill& fill, bool record,
                 const std::function<bool(const Json&)>& accept,
                 const std::function<Json()>& current);

  /// Reports keys nobody declared: errors with a suggestion (strict, kwargs),
  /// warnings (plain).
  void finish(const std::string& unknown_hint = "");

 private:
  // Finds the present spelling of `key`; returns nullptr when absent.
  const Json* find(const Key& key, std::string& used);
  Context& ctx_;
  std::string path_;
  std::string record_path_;
  const Json* object_;
  Kind kind_;
  std::set<std::string> known_;
};

/// Integer from an integer or an integral float (pydantic's int_from_float);
/// strict sections also take an integer string ("3").
bool to_int(const Json& v, bool allow_string, int64_t& out);
bool to_double(const Json& v, bool allow_string, double& out);
/// "an integer >= 0" for messages.
std::string describe_range(const char* what, const std::optional<Range>& range);
bool in_range(double v, const std::optional<Range>& range);

}  // namespace zero::config::detail
