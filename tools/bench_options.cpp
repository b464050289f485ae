#include <unistd.h>

#include <iostream>

#include "bench.h"
#include "zero/runtime/text.h"

namespace zero::tools {

std::string self_dir() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  std::string path(buf, static_cast<size_t>(n));
  return path.substr(0, path.rfind('/'));
}

bool parse_bench_options(const std::string& command, const std::vector<std::string>& args,
                         std::map<std::string, int64_t>& ints, std::string& json_path) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--json" && i + 1 < args.size()) {
      json_path = args[++i];
    } else if (ints.count(a) && i + 1 < args.size()) {
      const std::string& v = args[++i];
      try {
        size_t used = 0;
        const long long x = std::stoll(v, &used);
        if (used != v.size() || x < 1) throw std::invalid_argument(v);
        ints[a] = x;
      } catch (const std::exception&) {
        std::cerr << command << ": " << a << ": expected a positive integer; got \"" << v << "\"\n";
        return false;
      }
    } else {
      std::vector<std::string> known = {"--json"};
      std::string list = "--json FILE";
      for (const auto& [k, v] : ints) {
        known.push_back(k);
        list += " " + k + " N";
      }
      const auto near = zero::nearest(a, known);
      std::cerr << command << ": " << a << ": unknown option or missing value"
                << (near.empty() ? "" : "; did you mean " + near + "?") << "\noptions: " << list << "\n";
      return false;
    }
  }
  return true;
}

}  // namespace zero::tools
