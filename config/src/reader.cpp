#include "reader.h"

#include "zero/core/text.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <sstream>

namespace zero::config::detail {

std::string show(const Json& v) {
  std::string text = v.dump();
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

// ---------------------------------------------------------------- Context

std::string Context::line(const std::string& path, const std::string& text) const {
  if (path.empty()) return name_ + ": " + text;
  // A path of a pathological file (a key of 100k characters) is cut in the middle.
  constexpr size_t kShown = 160;
  if (path.size() > kShown) {
    return name_ + ": " + path.substr(0, kShown / 2) + "..." + path.substr(path.size() - kShown / 2) + " (a path of " +
           std::to_string(path.size()) + " characters): " + text;
  }
  return name_ + ": " + path + ": " + text;
}

void Context::problem(const std::string& path, const std::string& text) {
  problems_.push_back(line(path, text));
}

void Context::warn(const std::string& path, const std::string& text) {
  std::string w = line(path, text);
  if (warned_.insert(w).second) warnings_.push_back(std::move(w));
}

std::string with_commas(size_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

void Context::record(const std::string& path, const Json& value, Origin origin) {
  const std::string text = value.dump();
  auto it = std::find_if(resolved_.begin(), resolved_.end(),
                         [&](const ResolvedValue& r) { return r.path == path; });
  if (it != resolved_.end()) {
    it->value = text;
    it->origin = origin;
  } else {
    resolved_.push_back(ResolvedValue{path, text, origin});
  }
  // Nested objects keyed by the path's parts; nlohmann's object is a
  // std::map, so dump() is key-sorted.
  Json* node = &canonical_;
  size_t start = 0;
  for (;;) {
    const size_t dot = path.find('.', start);
    const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (dot == std::string::npos) {
      (*node)[part] = value;
      break;
    }
    Json& next = (*node)[part];
    if (!next.is_object()) next = Json::object();
    node = &next;
    start = dot + 1;
  }
}

// ---------------------------------------------------------------- conversions

bool to_int(const Json& v, bool allow_string, int64_t& out) {
  if (v.is_number_integer() && !v.is_number_unsigned()) {
    out = v.get<int64_t>();
    return true;
  }
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    out = static_cast<int64_t>(u);
    return true;
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    // 2^63 is exactly representable; anything at or above it is out of range.
    if (!std::isfinite(d) || d != std::floor(d) || d >= 9223372036854775808.0 ||
        d < -9223372036854775808.0) {
      return false;
    }
    out = static_cast<int64_t>(d);
    return true;
  }
  if (allow_string && v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    const char* begin = s.data();
    const char* end = s.data() + s.size();
    if (begin != end && *begin == '+') ++begin;
    auto [ptr, ec] = std::from_chars(begin, end, out);
    return ec == std::errc() && ptr == end && begin != end;
  }
  return false;
}

bool to_double(const Json& v, bool allow_string, double& out) {
  if (v.is_number()) {
    out = v.get<double>();
    return std::isfinite(out);
  }
  if (allow_string && v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    std::istringstream in(s);
    in.imbue(std::locale::classic());
    double d = 0;
    in >> d;
    if (!in.fail() && in.eof() && std::isfinite(d)) {
      out = d;
      return true;
    }
  }
  return false;
}

std::string describe_range(const char* what, const std::optional<Range>& range) {
  std::string text = what;
  if (!range) return text;
  auto number = [](double d) {
    Json j = d == std::floor(d) && std::fabs(d) < 1e15 ? Json(static_cast<int64_t>(d)) : Json(d);
    return j.dump();
  };
  if (range->min && range->max) {
    return text + " in [" + number(*range->min) + ", " + number(*range->max) + "]";
  }
  if (range->min) text += (range->min_exclusive ? " > " : " >= ") + number(*range->min);
  if (range->max) text += (range->max_exclusive ? " < " : " <= ") + number(*range->max);
  return text;
}

bool in_range(double v, const std::optional<Range>& range) {
  if (!range) return true;
  if (range->min && (range->min_exclusive ? v <= *range->min : v < *range->min)) return false;
  if (range->max && (range->max_exclusive ? v >= *range->max : v > *range->max)) return false;
  return true;
}

// ---------------------------------------------------------------- Section

Section::Section(Context& ctx, std::string path, const Json* object, Kind kind,
                 std::optional<std::string> record_path)
    : ctx_(ctx),
      path_(std::move(path)),
      record_path_(record_path ? *record_path : path_),
      object_(object),
      kind_(kind) {}

std::string Section::path_of(const std::string& key) const {
  return path_.empty() ? key : path_ + "." + key;
}

std::string Section::record_path_of(const std::string& key) const {
  return record_path_.empty() ? key : record_path_ + "." + key;
}

void Section::known(std::initializer_list<const char*> keys) {
  for (const char* k : keys) known_.insert(k);
}

const Json* Section::raw(const std::string& key) {
  known_.insert(key);
  if (object_ == nullptr) return nullptr;
  auto it = object_->find(key);
  return it == object_->end() ? nullptr : &*it;
}

bool Section::has(const Key& key) {
  std::string used;
  return find(key, used) != nullptr;
}

const Json* Section::find(const Key& key, std::string& used) {
  const Json* a = raw(key.name);
  const Json* b = key.alias.empty() ? nullptr : raw(key.alias);
  if (a != nullptr && b != nullptr) {
    ctx_.problem(path_of(key.alias), "expected only one of " + key.name + " and " + key.alias +
                                         " (two names of one field); got both");
  }
  used = a != nullptr ? key.name : key.alias;
  return a != nullptr ? a : b;
}

Section Section::child(const std::string& key, Kind kind, std::optional<std::string> record_path) {
  const Json* v = raw(key);
  const std::string child_record = record_path ? *record_path : record_path_of(key);
  if (v != nullptr && !v->is_object() && !v->is_null()) {
    ctx_.problem(path_of(key), "expected an object; got " + show(*v));
    v = nullptr;
  }
  if (v != nullptr && v->is_null()) v = nullptr;
  return Section(ctx_, path_of(key), v, kind, child_record);
}

Got Section::read_value(const Key& key, const std::string& what, const AutoFill& fill, bool record,
                        const std::function<bool(const Json&)>& accept,
                        const std::function<Json()>& current) {
  std::string used;
  const Json* value = find(key, used);
  const std::string path = value != nullptr ? path_of(used) : path_of(key.name);
  const std::string rpath = record_path_of(key.name);
  auto keep_default = [&](Got got) {
    if (record) ctx_.record(rpath, current(), Origin::kDefault);
    return got;
  };
  if (value == nullptr) return keep_default(Got::kAbsent);
  if (value->is_null()) {
    if (kind_ != Kind::kStrict) return keep_default(Got::kAbsent);
    ctx_.problem(path, "expected " + what + "; got null");
    return Got::kBad;
  }
  if (value->is_string() && value->get_ref<const std::string&>() == "auto") {
    if (fill.value) {
      if (!accept(*fill.value)) {
        ctx_.problem(path, "expected " + what + "; got " + show(*fill.value) + " (filled in for \"auto\" from " +
                               (fill.needs != nullptr ? ctx_.auto_hint(fill.needs) : std::string("?")) + ")");
        return Got::kBad;
      }
      if (record) ctx_.record(rpath, current(), ctx_.is_stand_in(fill.needs) ? Origin::kAuto : Origin::kDerived);
      return Got::kFilled;
    }
    if (kind_ == Kind::kStrict) {
      std::string text = "\"auto\" is not resolved, so it is dropped as DeepSpeed does; using the default " +
                         current().dump();
      if (fill.needs != nullptr) text += " (" + ctx_.auto_hint(fill.needs) + " would fill it)";
      ctx_.warn(path, text);
      return keep_default(Got::kDropped);
    }
    if (fill.needs != nullptr) {
      ctx_.problem(path, "expected " + what + "; got \"auto\" (the Hugging Face placeholder, which " +
                             ctx_.auto_hint(fill.needs) + " fills)");
    } else {
      ctx_.problem(path, "expected " + what +
                             "; got \"auto\" (neither DeepSpeed nor the Hugging Face integration fills \"auto\" here)");
    }
    return Got::kBad;
  }
  if (!accept(*value)) {
    ctx_.problem(path, "expected " + what + "; got " + show(*value));
    return Got::kBad;
  }
  if (record) ctx_.record(rpath, current(), Origin::kGiven);
  return Got::kGiven;
}

Got Section::read_bool(const Key& key, bool& out, const AutoFill& fill, bool record) {
  return read_value(
      key, "true or false", fill, record,
      [&](const Json& v) {
        if (!v.is_boolean()) return false;
        out = v.get<bool>();
        return true;
      },
      [&] { return Json(out); });
}

Got Section::read_int(const Key& key, int64_t& out, std::optional<Range> range, const AutoFill& fill,
                      bool record) {
  return read_value(
      key, describe_range("an integer", range), fill, record,
      [&](const Json& v) {
        int64_t i = 0;
        if (!to_int(v, kind_ == Kind::kStrict, i) || !in_range(static_cast<double>(i), range)) return false;
        out = i;
        return true;
      },
      [&] { return Json(out); });
}

Got Section::read_double(const Key& key, double& out, std::optional<Range> range, const AutoFill& fill,
                         bool record) {
  return read_value(
      key, describe_range("a number", range), fill, record,
      [&](const Json& v) {
        double d = 0;
        if (!to_double(v, kind_ == Kind::kStrict, d) || !in_range(d, range)) return false;
        out = d;
        return true;
      },
      [&] { return Json(out); });
}

Got Section::read_string(const Key& key, std::string& out, bool record) {
  return read_value(
      key, "a string", {}, record,
      [&](const Json& v) {
        if (!v.is_string()) return false;
        out = v.get<std::string>();
        return true;
      },
      [&] { return Json(out); });
}

Got Section::read_enum(const Key& key, std::string& out, const std::vector<std::string>& allowed,
                       bool case_sensitive, bool record) {
  std::string list;
  for (const std::string& a : allowed) list += (list.empty() ? "" : ", ") + a;
  auto lower = [](std::string s) {
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
    return s;
  };
  return read_value(
      key, "one of " + list + (case_sensitive ? "" : " (any case)"), {}, record,
      [&](const Json& v) {
        if (!v.is_string()) return false;
        const std::string& s = v.get_ref<const std::string&>();
        for (const std::string& a : allowed) {
          if (case_sensitive ? s == a : lower(s) == lower(a)) {
            out = a;
            return true;
          }
        }
        return false;
      },
      [&] { return Json(out); });
}

void Section::finish(const std::string& unknown_hint) {
  if (object_ == nullptr) return;
  const std::vector<std::string> candidates(known_.begin(), known_.end());
  size_t unknown = 0;
  for (const auto& [key, value] : object_->items()) {
    if (known_.count(key) != 0) continue;
    if (++unknown > kMaxUnknownKeysShown) continue;  // counted below, without a suggestion's cost
    std::string text = "unknown key";
    if (kind_ == Kind::kPlain) text += ", ignored as DeepSpeed does";
    if (auto suggestion = zero::nearest(key, candidates); !suggestion.empty()) {
      text += "; did you mean " + suggestion + "?";
    } else if (!unknown_hint.empty()) {
      text += "; " + unknown_hint;
    }
    if (kind_ == Kind::kPlain) {
      ctx_.warn(path_of(key), text);
    } else {
      ctx_.problem(path_of(key), text);
    }
  }
  if (unknown > kMaxUnknownKeysShown) {
    const std::string more = "... and " + with_commas(unknown - kMaxUnknownKeysShown) + " more unknown keys" +
                             (kind_ == Kind::kPlain ? ", ignored as DeepSpeed does" : "");
    if (kind_ == Kind::kPlain) ctx_.warn(path_, more);
    else ctx_.problem(path_, more);
  }
}

}  // namespace zero::config::detail
