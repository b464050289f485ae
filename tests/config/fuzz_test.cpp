// Seeded fuzzing of the config reader (issue 14): 3000 mutants of
// configs/ and tests/config/ds_configs/ (bytes cut, inserted and repeated;
// values replaced by odd ones; keys renamed, dropped and added; nesting made
// deep) go through load_string. None may crash, hang or throw anything but
// zero's errors, and every refusal names the file and a key or a line.
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <typeinfo>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "zero/config/config.h"
#include "zero/core/error.h"

namespace zero::config {
namespace {

std::vector<std::string> seeds() {
  std::vector<std::string> out;
  for (const std::string& dir : {std::string(ZERO_SOURCE_DIR) + "/configs/",
                                std::string(ZERO_SOURCE_DIR) + "/tests/config/ds_configs/"}) {
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) continue;
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name.size() < 5 || name.substr(name.size() - 5) != ".json") continue;
      std::ifstream in(dir + name);
      std::stringstream s;
      s << in.rdbuf();
      out.push_back(s.str());
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());  // readdir's order is the file system's
  return out;
}

// Values that have broken readers before: wrong types, edges, huge ones.
nlohmann::json odd_value(std::mt19937& rng) {
  static const std::vector<nlohmann::json> values = {
      -1, 0, 1, 3, 4097, 1e30, -1e30, 1.5, 9223372036854775807LL, 18446744073709551615ULL, "auto", "", "cpu",
      "nvme", "AdamW", std::string(5000, 'x'), nullptr, true, false, nlohmann::json::array(),
      nlohmann::json::object(), {1, 2}, {{"enabled", true}}, {{"device", "nvme"}, {"nvme_path", ""}},
      std::string("a\0b", 3), "1e9", -0.0};
  return values[rng() % values.size()];
}

// A random path into `j` (objects and arrays), as pointers to its nodes.
std::vector<nlohmann::json*> nodes_of(nlohmann::json& j) {
  std::vector<nlohmann::json*> out{&j};
  for (size_t i = 0; i < out.size(); ++i) {
    nlohmann::json& n = *out[i];
    if (n.is_object() || n.is_array())
      for (auto& child : n) out.push_back(&child);
  }
  return out;
}

std::string mutate(const std::string& text, std::mt19937& rng) {
  const int kind = static_cast<int>(rng() % 8);
  auto pos = [&](size_t n) { return n == 0 ? 0 : rng() % n; };
  if (kind <= 3) {
    // Structural: change a value, rename or drop a key, add an unknown one.
    nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/true);
    if (!j.is_discarded()) {
      auto nodes = nodes_of(j);
      nlohmann::json& n = *nodes[pos(nodes.size())];
      if (kind == 0 || !n.is_object() || n.empty()) {
        n = odd_value(rng);
      } else {
        auto it = n.begin();
        std::advance(it, static_cast<long>(pos(n.size())));
        const std::string key = it.key();
        nlohmann::json v = it.value();
        if (kind == 1) {  // a typo of the key
          std::string typo = key;
          if (!typo.empty()) typo[pos(typo.size())] = static_cast<char>('a' + rng() % 26);
          n.erase(key);
          n[typo] = v;
        } else if (kind == 2) {
          n.erase(key);
        } else {
          n["unknown_" + std::to_string(rng() % 100)] = odd_value(rng);
        }
      }
      return j.dump();
    }
  }
  std::string s = text;
  switch (kind) {
    case 4: {  // cut a range
      const size_t a = pos(s.size()), n = 1 + rng() % 16;
      s.erase(a, n);
      break;
    }
    case 5: {  // insert troublesome characters
      static const std::string chars = "{}[],:\"\\0123456789eE+-. \n/#*atrunlx\x01\xff";
      const size_t a = pos(s.size());
      std::string ins;
      for (size_t i = 0, n = 1 + rng() % 6; i < n; ++i) ins += chars[rng() % chars.size()];
      s.insert(a, ins);
      break;
    }
    case 6: {  // deep nesting, or a huge number, where a value starts
      const size_t colon = s.find(':', pos(s.size()));
      if (colon == std::string::npos) break;
      const size_t depth = rng() % 2 ? 300 + rng() % 2000 : 10;
      const std::string value = rng() % 2 ? std::string(depth, '[') + std::string(depth, ']')
                                          : std::string(200 + rng() % 5000, '7');
      s.insert(colon + 1, value + ",");  // usually malformed: fine
      break;
    }
    default:  // truncate
      s.resize(pos(s.size()));
  }
  return s;
}

// Where a hang would be: the mutant being read when the alarm went off.
const std::string* g_current = nullptr;
void on_alarm(int) {
  const char m[] = "config fuzz: a mutant took more than 30 s (a hang)\n";
  (void)!::write(2, m, sizeof m - 1);
  if (g_current != nullptr) (void)!::write(2, g_current->data(), std::min<size_t>(g_current->size(), 2000));
  ::_exit(3);
}

TEST(ConfigFuzz, NoCrashNoHangEveryRefusalNamesFileAndKeyOrLine) {
  const auto corpus = seeds();
  ASSERT_GE(corpus.size(), 10u);
  std::mt19937 rng(20261123);
  ::signal(SIGALRM, on_alarm);
  int accepted = 0, refused = 0;
  const auto start = std::chrono::steady_clock::now();
  constexpr int kMutants = 3000;
  for (int i = 0; i < kMutants; ++i) {
    std::string text = corpus[rng() % corpus.size()];
    for (int k = 0, n = rng() % 4 == 0 ? 2 : 1; k < n; ++k) text = mutate(text, rng);
    const std::string name = "mutant_" + std::to_string(i) + ".json";
    LoadOptions options;
    options.world_size = 1 + static_cast<int64_t>(rng() % 4);
    options.auto_stand_ins = rng() % 4 != 0;
    g_current = &text;
    ::alarm(30);
    try {
      (void)load_string(text, options, name);
      ++accepted;
    } catch (const ConfigError& e) {
      ++refused;
      for (const auto& p : e.problems()) {
        EXPECT_EQ(p.rfind(name + ": ", 0), 0u) << "a problem that does not name the file:\n" << p;
        const std::string rest = p.substr(name.size() + 2);
        // "line L, column C: ...", or "json.path: ..." (a key's name, or a
        // key as the file spells it), or the top level's one message.
        const size_t colon = rest.find(": ");
        const bool line = rest.rfind("line ", 0) == 0;
        const std::string path = colon == std::string::npos ? "" : rest.substr(0, colon);
        const std::string first = path.substr(0, path.find_first_of(".["));
        const bool identifier = !first.empty() && first.find_first_not_of(
            "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_") == std::string::npos;
        const bool key = !first.empty() && (identifier || text.find("\"" + first + "\"") != std::string::npos ||
                                            first.rfind("AutoValues::", 0) == 0);
        const bool top = rest.rfind("expected a JSON object at the top level", 0) == 0;
        EXPECT_TRUE(line || key || top) << "a problem that names no key or line:\n" << p;
        EXPECT_LT(p.size(), 1200u) << p.substr(0, 300);
      }
    } catch (const Error& e) {
      ADD_FAILURE() << name << ": a " << typeid(e).name() << " where a ConfigError was due: " << e.what() << "\n" << text.substr(0, 500);
    } catch (const std::exception& e) {
      ADD_FAILURE() << name << ": an exception that is not zero's: " << typeid(e).name() << ": " << e.what() << "\n"
                    << text.substr(0, 500);
    }
    ::alarm(0);
  }
  g_current = nullptr;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("config fuzz: %d mutants, %d accepted, %d refused, %.2f s\n", kMutants, accepted, refused, seconds);
  EXPECT_GT(refused, kMutants / 4);
  EXPECT_GT(accepted, kMutants / 50);  // mutants of values the reader takes are still read
  EXPECT_LT(seconds, 60);
}

}  // namespace
}  // namespace zero::config
