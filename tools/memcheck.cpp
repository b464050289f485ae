// zero memcheck: memory-regression checks of any training program. `record`
// runs it a few steps and writes every rank's memory figures (the engine's
// run report: peaks per tier and kind, model-state bytes) as a baseline;
// `check` runs it again and exits 1, with the table, when a figure grew past
// the tolerance. The comparison is zero/testing/memory.h's.
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <set>
#include <string>
#include <vector>

#include "bench.h"
#include "zero/core/command_files.h"
#include "zero/core/error.h"
#include "zero/core/process.h"
#include "zero/core/text.h"
#include "zero/snapshots/checkpoint_format.h"
#include "zero/runs/runs.h"
#include "zero/testing/memory.h"

namespace zero::tools {
namespace {

const char* kMemcheckUsage = R"(usage: zero memcheck record --baseline FILE [options] -- PROGRAM ARGS...
       zero memcheck check --baseline FILE [--tolerance 5%] [options] -- PROGRAM ARGS...

Holds a training program's memory to a baseline. record runs PROGRAM ARGS
(any program that calls zero::initialize) for a few optimizer steps and
writes every rank's figures from the engine's run report: the peak of each
memory tier (device, pinned_host, host, nvme), the ledger's peak of each kind
on each tier (parameters, gradients, optimizer_states, activations,
comm_buffers) and the model-state bytes. check runs it the same way and
prints every figure beside the baseline's; it exits 1 when one grew past the
tolerance (naming rank, tier and kind), 0 when none did.

  --baseline FILE      the baseline to write (record) or to hold the run to (check)
  --ranks N            ranks, through zero launch (default 1; at most 4 per
                       processor unless --oversubscribe)
  --steps N            optimizer steps the program runs before it is stopped
                       (ZERO_STOP_AFTER_STEPS; default 3)
  --tolerance T        check: how much a figure may grow, 5% or 0.05 (default 5%)
  --slack B            check: growth of at most B bytes is let pass (default 0)
  --run-timeout S      a run still going after S seconds is stopped (default 1800; 0: no limit)
  --force              record: write over an existing baseline (without it, record refuses one)

No output may be a file the run reads: record refuses a --baseline that is
the program, or a file named among its arguments (its --config, say).
)";

std::optional<double> parse_tolerance(std::string v) {
  bool percent = !v.empty() && v.back() == '%';
  if (percent) v.pop_back();
  char* end = nullptr;
  errno = 0;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || errno != 0 || !std::isfinite(x) || x < 0) return std::nullopt;
  // A bare 5 would be 500%: a share is below 1, or a percentage says so.
  if (!percent && x >= 1) return std::nullopt;
  const double t = percent ? x / 100 : x;
  if (t > 100) return std::nullopt;
  return t;
}

}  // namespace

int memcheck(const std::vector<std::string>& args) {
  auto fail = [](const std::string& m) {
    std::cerr << "zero memcheck: " << m << "\n(zero memcheck --help for the options)\n";
    return 2;
  };
  if (args.empty()) return fail("expected record or check");
  if (args[0] == "-h" || args[0] == "--help") {
    std::cout << kMemcheckUsage;
    return 0;
  }
  const std::string mode = args[0];
  if (mode != "record" && mode != "check") {
    const auto near = nearest(mode, {"record", "check"});
    return fail(mode + ": expected record or check" + (near.empty() ? "" : "; did you mean " + near + "?"));
  }
  std::string baseline_path;
  int64_t ranks = 1, steps = 3, slack = 0;
  double tolerance = 0.05, run_timeout = 1800;
  bool oversubscribe = false, force = false, replacing = false;
  std::vector<std::string> program;
  std::set<std::string> seen;
  const std::vector<std::string> known = {"--baseline", "--ranks", "--steps", "--tolerance", "--slack", "--run-timeout",
                                          "--oversubscribe", "--force"};
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      program.assign(args.begin() + static_cast<std::ptrdiff_t>(i) + 1, args.end());
      break;
    }
    if (a == "-h" || a == "--help") {
      std::cout << kMemcheckUsage;
      return 0;
    }
    if (const std::string problem = option_problem(a, known, seen); !problem.empty()) return fail(problem);
    if (a == "--oversubscribe" || a == "--force") {
      if (a == "--force" && mode != "record") return fail("--force goes with record");
      (a == "--force" ? force : oversubscribe) = true;
      continue;
    }
    if (i + 1 >= args.size() || args[i + 1] == "--") return fail(a + ": expected a value");
    const std::string& v = args[++i];
    if (a == "--baseline") {
      baseline_path = v;
    } else if (a == "--ranks" || a == "--steps") {
      char* end = nullptr;
      errno = 0;
      const long long x = std::strtoll(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || errno != 0 || x < 1 || x > (a == "--ranks" ? 1024 : 100000))
        return fail(a + ": expected a positive integer; got \"" + v + "\"");
      (a == "--ranks" ? ranks : steps) = x;
    } else if (a == "--tolerance") {
      if (mode != "check") return fail("--tolerance goes with check");
      const auto t = parse_tolerance(v);
      if (!t) return fail("--tolerance: expected a share such as 5% or 0.05 (below 1 without %); got \"" + v + "\"");
      tolerance = *t;
    } else if (a == "--slack") {
      if (mode != "check") return fail("--slack goes with check");
      // 0 (the default) is a count too, though not a size parse_byte_size takes.
      const auto b = v == "0" || v == "0B" ? std::optional<int64_t>(0) : parse_byte_size(v);
      if (!b || *b < 0) return fail("--slack: expected a byte count such as 0, 4096 or 64KiB; got \"" + v + "\"");
      slack = *b;
    } else {  // --run-timeout
      const auto x = parse_run_timeout(v);
      if (!x) return fail("--run-timeout: expected seconds, 0 to 1e7 (0: no limit); got \"" + v + "\"");
      run_timeout = *x;
    }
  }
  if (baseline_path.empty()) return fail("--baseline FILE is required");
  if (program.empty()) return fail("-- PROGRAM ARGS (the program to run) is required");
  if (const std::string problem = runs::too_many_ranks("--ranks", ranks, oversubscribe); !problem.empty())
    return fail(problem);
  if (const std::string problem = program_problem(program[0]); !problem.empty()) return fail(problem);
  const std::string found = find_program(program[0]);
  if (mode == "record") {
    // NOTE [outputs and inputs]: not over the program or a file it reads.
    CommandFiles files;
    files.reads_program_arguments(program);
    files.writes("--baseline", baseline_path);
    if (const std::string problem = files.problem(); !problem.empty()) return fail(problem);
    if (const std::string problem = runs::output_path_problem("--baseline", baseline_path); !problem.empty())
      return fail(problem);
    replacing = ckpt::path_exists(baseline_path);
    if (replacing && !force)
      return fail("--baseline " + baseline_path + ": a file is there already (an earlier baseline?); record writes "
                  "over it only with --force");
  }
  std::vector<std::string> argv = program;
  argv[0] = found;

  try {
    std::optional<testing::Baseline> baseline;
    if (mode == "check") {  // before the run: a bad file, or another world size, is found at once
      baseline = testing::read_baseline(baseline_path);
      if (baseline->world_size != ranks) {
        std::cerr << "zero memcheck: " << baseline_path << " was recorded on " << baseline->world_size
                  << " rank(s); --ranks " << ranks << " runs on " << ranks << ": give --ranks "
                  << baseline->world_size << ", or record a baseline at this size\n";
        return 2;
      }
    }
    runs::CatchStopSignals stop;
    runs::ScratchDir scratch(runs::temp_parent(), "zero-memcheck");
    runs::ProbeRun run;
    run.launcher = self_dir() + "/zero";
    run.nproc = ranks;
    run.argv = argv;
    run.report_path = scratch.path() + "/run.report";
    run.log_path = scratch.path() + "/run.log";
    run.stop_after_steps = steps;
    run.timeout_s = run_timeout;
    std::fprintf(stderr, "zero memcheck: running %s on %lld rank(s) for %lld step(s) ...", program[0].c_str(),
                 static_cast<long long>(ranks), static_cast<long long>(steps));
    std::fflush(stderr);
    const auto r = runs::run_probe(run);
    if (r.outcome != runs::ProbeResult::Outcome::kTrained) {
      std::fprintf(stderr, " %s\n", r.outcome == runs::ProbeResult::Outcome::kOutOfMemory ? "out of memory"
                                    : r.outcome == runs::ProbeResult::Outcome::kTimedOut  ? "timed out"
                                                                                          : "failed");
      std::cerr << "zero memcheck: the run did not train its " << steps << " step(s) (" << r.command << "):\n"
                << r.message << "\n";
      return 1;
    }
    std::fprintf(stderr, " %.1f s\n", r.seconds);
    std::vector<testing::MemoryFigures> now;
    for (const auto& rep : r.reports) now.push_back(testing::figures_of(rep));
    if (mode == "record") {
      testing::Baseline b;
      b.world_size = ranks;
      b.ranks = now;
      b.command = program;
      testing::write_baseline(baseline_path, b);
      int64_t figures = 0;
      for (const auto& f : now)
        for (const auto& [k, v] : f) figures += v != 0;
      std::printf("zero memcheck: %lld non-zero figure(s) of %lld rank(s) written to %s%s (peak device %s, host %s)\n",
                  static_cast<long long>(figures), static_cast<long long>(ranks), baseline_path.c_str(),
                  replacing ? ", replacing the earlier baseline (--force)" : "", format_bytes(r.peak_device).c_str(),
                  format_bytes(r.peak_host).c_str());
      return 0;
    }
    // A check compares two runs; when the baseline came from another command
    // (the point, after a config change), both are named above the table.
    const auto joined = [](const std::vector<std::string>& argv) {
      std::string out;
      for (const auto& a : argv) out += (out.empty() ? "" : " ") + a;
      return out;
    };
    if (!baseline->command.empty() && baseline->command != program)
      std::printf("the baseline was recorded from: %s\nthis check ran:                %s\n",
                  joined(baseline->command).c_str(), joined(program).c_str());
    const auto c = testing::compare(*baseline, now, tolerance, slack);
    std::printf("%s", c.message.c_str());
    if (!c.ok) {
      std::printf("zero memcheck: memory grew against %s\n", baseline_path.c_str());
      return 1;
    }
    std::printf("zero memcheck: no figure grew against %s\n", baseline_path.c_str());
    return 0;
  } catch (const runs::Interrupted& e) {
    std::cerr << "zero memcheck: " << e.what() << "; the run was ended and its files removed\n";
    return 128 + e.signal();
  } catch (const std::exception& e) {
    std::cerr << "zero memcheck: " << error_text(e) << "\n";
    return 1;
  }
}

}  // namespace zero::tools
