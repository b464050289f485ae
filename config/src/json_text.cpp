#include "json_text.h"

#include <algorithm>
#include <cctype>
#include <set>
#include <string_view>

#include "zero/core/error.h"

namespace zero::config::detail {
namespace {

using Json = nlohmann::json;

struct LineColumn {
  size_t line = 1;
  size_t column = 1;
};

// 1-based line and column of byte `offset` (a CR before the LF is one more
// column of the previous line, which is what editors show for CRLF files).
LineColumn line_column(const std::string& text, size_t offset) {
  LineColumn lc;
  for (size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++lc.line;
      lc.column = 1;
    } else {
      ++lc.column;
    }
  }
  return lc;
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// Builds the DOM like nlohmann's own SAX DOM parser, and also remembers the
// keys of every open object to report duplicates with their JSON path.
class DuplicateCheckingSax : public nlohmann::json_sax<Json> {
 public:
  DuplicateCheckingSax(const std::string& name, std::vector<std::string>& problems)
      : name_(name), problems_(problems) {}

  bool null() override { return put(Json(nullptr)); }
  bool boolean(bool v) override { return put(Json(v)); }
  bool number_integer(number_integer_t v) override { return put(Json(v)); }
  bool number_unsigned(number_unsigned_t v) override { return put(Json(v)); }
  bool number_float(number_float_t v, const string_t&) override { return put(Json(v)); }
  bool string(string_t& v) override { return put(Json(v)); }
  bool binary(binary_t& v) override { return put(Json::binary(v)); }

  bool start_object(std::size_t) override {
    Json* ref = place(Json::object());
    frames_.push_back(Frame{ref, {}, {}, 0});
    return true;
  }
  bool key(string_t& k) override {
    Frame& f = frames_.back();
    f.key = k;
    if (!f.keys.insert(k).second) problems_.push_back(name_ + ": " + path() + ": duplicate key");
    return true;
  }
  bool end_object() override {
    frames_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    Json* ref = place(Json::array());
    frames_.push_back(Frame{ref, {}, {}, 0});
    return true;
  }
  bool end_array() override {
    frames_.pop_back();
    return true;
  }
  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::detail::exception& ex) override {
    error_position_ = position;
    error_text_ = ex.what();
    error_path_ = frames_.empty() ? std::string() : path();
    return false;
  }

  Json& root() { return root_; }
  /// Bytes read when parsing failed: just past the offending character.
  size_t error_position() const { return error_position_; }
  const std::string& error_text() const { return error_text_; }
  const std::string& error_path() const { return error_path_; }

 private:
  struct Frame {
    Json* container;
    std::set<std::string> keys;
    std::string key;
    size_t index;
  };

  // The JSON path of the current key or array element.
  std::string path() const {
    std::string p;
    for (const Frame& f : frames_) {
      if (f.container->is_object()) {
        if (!p.empty()) p += '.';
        p += f.key;
      } else {
        p += '[' + std::to_string(f.index == 0 ? 0 : f.index - 1) + ']';
      }
    }
    return p;
  }

  Json* place(Json value) {
    if (frames_.empty()) {
      root_ = std::move(value);
      return &root_;
    }
    Frame& f = frames_.back();
    if (f.container->is_object()) {
      Json& slot = (*f.container)[f.key];
      slot = std::move(value);  // last value wins, as in Python's dict
      return &slot;
    }
    f.container->push_back(std::move(value));
    ++f.index;
    return &f.container->back();
  }
  bool put(Json value) {
    place(std::move(value));
    return true;
  }

  const std::string& name_;
  std::vector<std::string>& problems_;
  Json root_;
  std::vector<Frame> frames_;
  size_t error_position_ = 0;
  std::string error_text_;
  std::string error_path_;
};

// nlohmann's message without its "[json.exception...] parse error at line 2,
// column 5: " prefix, whose position we report ourselves.
// The quoted token of a long message (a number of 100k digits) is cut to its
// first and last characters with its length.
std::string parse_error_detail(const std::string& what) {
  std::string detail;
  if (const size_t at = what.find("syntax error"); at != std::string::npos) {
    detail = what.substr(at);
  } else if (const size_t colon = what.find(": "); colon != std::string::npos) {
    detail = what.substr(colon + 2);
  } else if (what.rfind("[json.exception.", 0) == 0 && what.find("] ") != std::string::npos) {
    detail = what.substr(what.find("] ") + 2);  // "[json.exception.out_of_range.406] number overflow ..."
  } else {
    detail = what;
  }
  constexpr size_t kToken = 40;
  const size_t open = detail.find('\'');
  const size_t close = open == std::string::npos ? std::string::npos : detail.find('\'', open + 1);
  if (close != std::string::npos && close - open - 1 > kToken) {
    const size_t n = close - open - 1;
    detail = detail.substr(0, open + 1) + detail.substr(open + 1, kToken / 2) + "..." +
             detail.substr(close - kToken / 2, kToken / 2) + "' (" + std::to_string(n) + " characters)" +
             detail.substr(close + 1);
  }
  return detail;
}

// Deeper nesting than a config has any use for is refused before parsing:
// the parser, the DOM and its destructor recurse per level.
constexpr int kMaxDepth = 256;


// Walks text[0, end) in order, skipping the insides of JSON string literals
// (escapes included): `visit(i)` is called for every index outside a string,
// including each opening quote, and returns the index to go on from (usually
// i + 1); `text` may be changed behind the walk. Returns whether `end` falls
// inside a string, and where that string opened.
template <typename Visit>
bool scan_outside_strings(const std::string& text, size_t end, Visit visit, size_t* open_quote = nullptr) {
  bool in_string = false;
  for (size_t i = 0; i < end && i < text.size();) {
    if (in_string) {
      if (text[i] == '\\') ++i;
      else if (text[i] == '"') in_string = false;
      ++i;
      continue;
    }
    if (text[i] == '"') {
      in_string = true;
      if (open_quote != nullptr) *open_quote = i;
      ++i;
      continue;
    }
    i = visit(i);
  }
  return in_string;
}

}  // namespace

size_t line_of(const std::string& text, size_t offset) {
  return static_cast<size_t>(std::count(text.begin(), text.begin() + std::min(offset, text.size()), '\n')) + 1;
}

bool strip_relaxed_syntax(const std::string& text, std::string& out, std::string& error, RelaxedSyntax* found) {
  RelaxedSyntax unused;
  RelaxedSyntax& f = found != nullptr ? *found : unused;
  f.bom = text.size() >= 3 && static_cast<unsigned char>(text[0]) == 0xEF &&
          static_cast<unsigned char>(text[1]) == 0xBB && static_cast<unsigned char>(text[2]) == 0xBF;
  out = text;
  // Pass 1: comments. Blank them, keeping line breaks.
  bool unterminated = false;
  scan_outside_strings(out, out.size(), [&](size_t i) -> size_t {
    const char c = out[i];
    const bool opens = c == '#' || (c == '/' && i + 1 < out.size() && (out[i + 1] == '/' || out[i + 1] == '*'));
    if (opens && f.comment == std::string::npos) f.comment = i;
    if (c == '#' || (c == '/' && i + 1 < out.size() && out[i + 1] == '/')) {
      while (i < out.size() && out[i] != '\n' && out[i] != '\r') out[i++] = ' ';
      return i;
    }
    if (c == '/' && i + 1 < out.size() && out[i + 1] == '*') {
      const size_t close = out.find("*/", i + 2);
      if (close == std::string::npos) {
        const LineColumn lc = line_column(text, i);
        error = "line " + std::to_string(lc.line) + ", column " + std::to_string(lc.column) +
                ": syntax error: expected the end \"*/\" of this comment; got the end of the file";
        unterminated = true;
        return out.size();
      }
      for (; i < close + 2; ++i) {
        if (out[i] != '\n' && out[i] != '\r') out[i] = ' ';
      }
      return i;
    }
    return i + 1;
  });
  if (unterminated) return false;
  // Pass 2: trailing commas before '}' or ']'.
  scan_outside_strings(out, out.size(), [&](size_t i) -> size_t {
    if (out[i] == ',') {
      size_t j = i + 1;
      while (j < out.size() && is_space(out[j])) ++j;
      if (j < out.size() && (out[j] == '}' || out[j] == ']')) {
        out[i] = ' ';
        if (f.trailing_comma == std::string::npos) f.trailing_comma = i;
      }
    }
    return i + 1;
  });
  return true;
}

Json parse_relaxed(const std::string& text, const std::string& name,
                   std::vector<std::string>& problems, RelaxedSyntax* found) {
  std::string stripped;
  std::string error;
  if (!strip_relaxed_syntax(text, stripped, error, found)) throw ConfigError({name + ": " + error});

  int depth = 0;
  size_t too_deep = std::string::npos;
  scan_outside_strings(stripped, stripped.size(), [&](size_t i) -> size_t {
    const char c = stripped[i];
    if (c == '[' || c == '{') {
      if (++depth > kMaxDepth) {
        too_deep = i;
        return stripped.size();
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
    return i + 1;
  });
  if (too_deep != std::string::npos) {
    const LineColumn lc = line_column(text, too_deep);
    throw ConfigError({name + ": line " + std::to_string(lc.line) + ", column " + std::to_string(lc.column) +
                       ": nesting deeper than " + std::to_string(kMaxDepth) +
                       " levels of objects and arrays (a DeepSpeed config has a few)"});
  }

  DuplicateCheckingSax sax(name, problems);
  if (Json::sax_parse(stripped, &sax)) return std::move(sax.root());

  // The lexer stops just after the offending character. Find the token it
  // belongs to: a string (point at its opening quote) or a bare word.
  const size_t error_at = std::min(sax.error_position() == 0 ? 0 : sax.error_position() - 1, stripped.size());
  size_t string_start = 0;
  const bool in_string =
      scan_outside_strings(stripped, error_at, [](size_t i) { return i + 1; }, &string_start);
  auto is_word = [&](size_t i) {
    return i < stripped.size() && (std::isalnum(static_cast<unsigned char>(stripped[i])) != 0 || stripped[i] == '_');
  };
  size_t offset = error_at;
  std::string word;
  if (in_string && error_at < stripped.size() && stripped[error_at] == '"') {
    offset = string_start;  // an unexpected string
  } else if (!in_string && (is_word(error_at) || (error_at > 0 && is_word(error_at - 1)))) {
    size_t start = is_word(error_at) ? error_at : error_at - 1;
    while (start > 0 && is_word(start - 1)) --start;
    size_t end = start;
    while (is_word(end)) ++end;
    offset = start;
    word = stripped.substr(start, end - start);
  }
  const LineColumn lc = line_column(text, offset);
  std::string message = name + ": line " + std::to_string(lc.line) + ", column " +
                        std::to_string(lc.column) + ": ";
  // A bare word (hjson's quoteless string, or a template placeholder such as
  // CONFIG_BATCH_SIZE) gets a message naming the word and the key.
  const bool bare_word = !word.empty() && std::isalpha(static_cast<unsigned char>(word[0])) != 0 &&
                         word != "true" && word != "false" && word != "null";
  if (bare_word) {
    message += "syntax error";
    if (!sax.error_path().empty()) message += " in " + sax.error_path();
    message += ": expected a JSON value; got bare word " + word +
               " (quote strings; an unfilled template placeholder?)";
  } else {
    message += parse_error_detail(sax.error_text());
    if (!sax.error_path().empty()) message += " (after " + sax.error_path() + ")";
  }
  throw ConfigError({message});
}

}  // namespace zero::config::detail
