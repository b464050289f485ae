#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <set>
#include <sstream>

#include "bench.h"
#include "zero/runs/runs.h"
#include "zero/core/error.h"
#include "zero/core/text.h"
#include "zero/snapshots/checkpoint_format.h"

namespace zero::tools {

std::string self_dir() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  std::string path(buf, static_cast<size_t>(n));
  return path.substr(0, path.rfind('/'));
}

ScratchDir::ScratchDir(const std::string& name) : dir_(zero::runs::temp_parent(), "zero-bench-" + name) {}

ScratchDir::~ScratchDir() {
  for (const auto& p : extra_) {
    try {
      ckpt::remove_tree(p);
    } catch (const std::exception& e) {
      std::cerr << "warning: could not remove " << p << ": " << error_text(e) << "\n";
    }
  }
}

namespace {
// The last lines of a failed run's log that say something, indented.
std::string log_tail(const std::string& path, size_t max_lines) {
  std::ifstream in(path);
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  std::istringstream lines(zero::runs::last_lines(text, max_lines));
  std::string out;
  for (std::string line; std::getline(lines, line);) out += "  | " + line + "\n";
  return out.empty() ? "  (the run printed nothing)\n" : out;
}
}  // namespace

nlohmann::json mingpt_bench_config(int64_t micro_batch, nlohmann::json zero) {
  return {{"train_micro_batch_size_per_gpu", micro_batch},
          {"gradient_clipping", 1.0},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
          {"zero_optimization", std::move(zero)}};
}

std::vector<std::string> mingpt_bench_args(int64_t n_layer, int64_t n_embd, int64_t steps,
                                           std::vector<std::string> more) {
  std::vector<std::string> a = {"--n_layer",   std::to_string(n_layer), "--n_head", "4", "--n_embd",
                                std::to_string(n_embd), "--dropout", "0", "--max_epochs", "1",
                                "--limit_train_batches", std::to_string(steps)};
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

std::optional<nlohmann::json> run_mingpt_ranks(const std::string& command, const std::string& dir,
                                               const std::string& name, int64_t nproc, const nlohmann::json& config,
                                               const std::vector<std::string>& mingpt_args) {
  const std::string base = dir + "/" + name;
  ckpt::write_file_atomically(base + ".json", config.dump());
  const std::string bin = self_dir();
  std::vector<std::string> argv = {bin + "/zero", "launch", "--nproc_per_node", std::to_string(nproc), "--",
                                   bin + "/mingpt", "--config", base + ".json"};
  argv.insert(argv.end(), mingpt_args.begin(), mingpt_args.end());
  argv.insert(argv.end(), {"--summary-json", base + ".summary.json"});
  std::fprintf(stderr, "%s: running %s on %lld ranks ...\n", command.c_str(), name.c_str(), static_cast<long long>(nproc));
  // Not told a stop or a budget: one exported in this shell must not end or cap the bench's runs.
  const auto env = zero::runs::environment_without_protocol();
  if (const int status = zero::runs::run_logged(argv, base + ".log", 0, 20, nullptr, &env); status != 0) {
    std::cerr << command << ": the run " << name << " failed with exit status " << status
              << "; the end of its output:\n" << log_tail(base + ".log", 15);
    return std::nullopt;
  }
  std::ifstream in(base + ".summary.json");
  auto j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded()) {
    std::cerr << command << ": the run " << name << " wrote no readable summary; the end of its output:\n"
              << log_tail(base + ".log", 15);
    return std::nullopt;
  }
  return j;
}

std::optional<int64_t> parse_size(const std::string& s) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  const std::string unit = s.substr(used);
  const std::pair<const char*, double> units[] = {{"", 1},          {"B", 1},       {"KiB", 1024.0}, {"MiB", 1048576.0},
                                                   {"GiB", 1073741824.0}, {"KB", 1e3}, {"MB", 1e6},    {"GB", 1e9}};
  for (const auto& [name, mult] : units) {
    if (unit != name) continue;
    const double bytes = v * mult;
    if (!(bytes >= 1) || bytes > 9.2e18) return std::nullopt;  // "0.5" is not a count, nor a size in bytes; nor "nan"
    return static_cast<int64_t>(bytes);
  }
  return std::nullopt;
}

double seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void write_json_output(const std::string& path, const nlohmann::json& j) {
  ckpt::write_file_atomically(path, j.dump(2) + "\n");
}

bool parse_bench_options(const std::string& command, const std::vector<std::string>& args,
                         std::map<std::string, int64_t>& ints, std::string& json_path) {
  std::set<std::string> seen;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if ((a == "--json" || ints.count(a)) && !seen.insert(a).second) {
      std::cerr << command << ": " << a << " given twice: give it once\n";
      return false;
    }
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
  // The output is checked before the runs, not found unwritable after them.
  if (!json_path.empty())
    if (const std::string problem = ckpt::output_file_problem("--json", json_path); !problem.empty()) {
      std::cerr << command << ": " << problem << "\n";
      return false;
    }
  return true;
}

std::optional<double> parse_run_timeout(const std::string& v) {
  char* end = nullptr;
  errno = 0;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || errno != 0 || !(x >= 0) || x > 1e7) return std::nullopt;
  return x;
}

std::string option_problem(const std::string& a, const std::vector<std::string>& known, std::set<std::string>& seen) {
  if (std::find(known.begin(), known.end(), a) == known.end()) {
    const auto near = nearest(a, known);
    return a + ": unknown option" + (near.empty() ? "" : "; did you mean " + near + "?");
  }
  if (!seen.insert(a).second) return a + " given twice: give it once";
  return "";
}

}  // namespace zero::tools
