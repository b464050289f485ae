// zero: the command-line tool.
//   zero config check FILE [--world-size N --auto K=V]   validate and resolve a DeepSpeed config
//   zero bench engine ...                     engine vs a plain LibTorch loop
//   zero launch --nproc_per_node N -- PROG    N local ranks with torchrun's environment
//   zero checkpoint consolidate DIR OUT       full weights of an engine checkpoint
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench.h"
#include "launch.h"
#include "zero/runs/runs.h"
#include "zero/config/config.h"
#include "zero/core/crash_report.h"
#include "zero/core/error.h"
#include "zero/core/text.h"

namespace {

const char* kUsage = R"(usage: zero COMMAND ...

commands:
  config check FILE [--world-size N] [--auto KEY=VALUE ...] [--no-auto]
      Reads a DeepSpeed config as zero::initialize would, prints every
      resolved value (marked given, default, derived or auto) and the
      warnings, and exits 0; or prints every problem of the file and exits 1.
      An "auto" the program fills at initialize is checked with a stand-in
      (micro-batch 1, lr 1e-3, 1000 steps, hidden size 1024, fp32) or with the
      value given by --auto: train_micro_batch_size_per_gpu,
      gradient_accumulation_steps, gradient_clipping, lr, eps, weight_decay,
      total_num_steps, warmup_num_steps, precision (fp32|fp16|bf16),
      hidden_size. --no-auto: an "auto" nobody fills is a problem, as for a
      program that supplies no AutoValues.
  bench overlap [--nproc N --n_layer N --n_embd N --batch_size N --steps N --bucket N] [--json FILE]
      minGPT on N ranks: stage 2 step time against stage 0, and the share of
      gradient communication hidden behind backward.
  bench stage3 [--nproc N --n_layer N --n_embd N --batch_size N --steps N --prefetch N] [--json FILE]
      minGPT on N ranks at stage 3 with prefetch off and on (and stage 2):
      step time and the time spent waiting for parameter gathers.
  bench aio --path DIR [--size 1GiB --block-size 1MiB --queue-depth N --threads N --rounds N --buffer 8MiB --mode fresh|overwrite] [--json FILE]
      The AIO engine's sequential O_DIRECT write and read throughput on a file
      in DIR, side by side with fio on the same file and options; writes to
      a freshly allocated file, or (overwrite) rewrites of a written one.
  bench offload --path DIR [--stage 2 --nproc N --n_layer N --n_embd N --batch_size N --steps N --sub_group N --buffers N] [--json FILE]
      minGPT on N ranks with the optimizer states (stage 3: and the layer
      shards) in CPU memory and in NVMe swap files under DIR, the swap
      pipeline off and on: step time, the waits for the disk, the share hidden.
  bench adam [--numel N --steps N] [--json FILE]
      zero's CPU Adam against torch::optim::Adam and the machine's memory
      bandwidth (stream triad), on the same sizes.
  bench transfer [--bytes N --rounds N] [--json FILE]
      Host-to-device and device-to-host GB/s on the engine's copy stream from
      the pinned tier, LibTorch's pinned allocator and pageable memory, each
      said page-locked or not as the driver reports it (cuda:0; a GPU only).
  bench checkpoint [--n_layer N --n_embd N --n_head N --block_size N --batch_size N --steps N] [--json FILE]
      minGPT's activation memory peak and step time without activation
      checkpointing, with it, and with cpu_checkpointing.
  bench checkpoint-io --path DIR [--nproc N --stage N --n_layer N --n_embd N --rounds N] [--json FILE]
      Engine checkpoints of minGPT on N ranks (mingpt --save_dir, --resume):
      save and load GB/s per rank and for the job, beside zero bench aio's
      (and fio's) write and read rates on the same folder.
  bench engine [--n_layer N --n_head N --n_embd N --batch_size N --steps N --rounds N] [--json FILE]
      Training steps of minGPT through zero's engine against a plain LibTorch
      loop (torch::optim::AdamW, clip_grad_norm_) on the same model and data.
  nvme-tune --path DIR [--size 256MiB --rounds N] [--json FILE]
      Sweeps the aio settings (block size, queue depth, threads,
      single_submit, overlap_events) on a file in DIR, shows the fastest and
      prints the best "aio" section to paste into the config.
  checkpoint consolidate|export|verify|info DIR ...
      Engine checkpoints: full weights in one safetensors file (streamed),
      every checksum checked, what one holds. 'zero checkpoint --help'.
  estimate (--params P | --model mingpt:L,C[,V,T] | --hf-config FILE | --weights FILE | --calibrate REPORT) [--ranks-per-node G ...]
      Model-state memory per rank on the device, the host and NVMe for each
      ZeRO configuration, and with --device-memory/--host-memory/--nvme-bytes
      the largest model whose states fit each. 'zero estimate --help'.
  tune --device-memory B --host-memory B [--config BASE --nvme-path DIR --ranks N ...] -- PROGRAM ARGS...
  tune --model mingpt:L,C[,V,T] --device-memory B --host-memory B [...]
      The fastest config that fits: candidates the estimator says fit, the
      ones no other beats by construction trained a few steps on real ranks
      (your program with {config} in ARGS replaced, or minGPT); writes
      ds_config.json and a table of what it ran. 'zero tune --help'.
  memcheck record|check --baseline FILE [--ranks N --steps N --tolerance 5%] -- PROGRAM ARGS...
      Memory-regression checks: record writes a program's memory peaks per
      tier and kind; check runs it again and exits 1, with the table, when
      one grew past the tolerance. 'zero memcheck --help'.
  trace merge OUT IN...
      Joins the per-rank Chrome traces that ZERO_TRACE=FILE wrote
      (FILE.rankR.json) into one, the ranks on one time axis.
  launch [--nproc_per_node N --master_addr A --master_port P --kill-timeout S] [--] PROGRAM ARGS...
      Starts N local ranks of PROGRAM with torchrun's environment (RANK,
      WORLD_SIZE, MASTER_ADDR, ...), prefixes their output with the rank, and
      stops every rank when one fails. 'zero launch --help' for details.
)";

int usage_error(const std::string& message) {
  std::cerr << "zero: " << message << "\n\n" << kUsage;
  return 2;
}

// --auto KEY=VALUE into `av`; returns an error message or "".
std::string set_auto(zero::config::AutoValues& av, const std::string& kv) {
  const auto eq = kv.find('=');
  if (eq == std::string::npos) return "--auto: expected KEY=VALUE; got \"" + kv + "\"";
  const std::string key = kv.substr(0, eq), value = kv.substr(eq + 1);
  auto integer = [&](std::optional<int64_t>& out) -> std::string {
    int64_t x = 0;
    const auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), x);
    if (ec != std::errc() || ptr != value.data() + value.size() || value.empty())
      return "--auto " + key + ": expected an integer; got \"" + value + "\"";
    out = x;
    return "";
  };
  auto number = [&](std::optional<double>& out) -> std::string {
    try {
      size_t used = 0;
      const double d = std::stod(value, &used);
      if (used == value.size() && std::isfinite(d)) {
        out = d;
        return "";
      }
    } catch (const std::exception&) {
    }
    return "--auto " + key + ": expected a number; got \"" + value + "\"";
  };
  if (key == "train_micro_batch_size_per_gpu") return integer(av.train_micro_batch_size_per_gpu);
  if (key == "gradient_accumulation_steps") return integer(av.gradient_accumulation_steps);
  if (key == "total_num_steps") return integer(av.total_num_steps);
  if (key == "warmup_num_steps") return integer(av.warmup_num_steps);
  if (key == "hidden_size") return integer(av.hidden_size);
  if (key == "gradient_clipping") return number(av.gradient_clipping);
  if (key == "lr") return number(av.lr);
  if (key == "eps") return number(av.eps);
  if (key == "weight_decay") return number(av.weight_decay);
  if (key == "precision") {
    av.precision = value;  // checked by the loader with the other values
    return "";
  }
  const std::vector<std::string> keys = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                         "gradient_clipping", "lr", "eps", "weight_decay", "total_num_steps",
                                         "warmup_num_steps", "precision", "hidden_size"};
  const auto near = zero::nearest(key, keys);
  return "--auto: unknown key \"" + key + "\"" + (near.empty() ? "" : "; did you mean " + near + "?");
}

// `zero COMMAND --help`: the part of the usage that begins with `command`
// ("bench aio", "config check"), its description with it.
int command_help(const std::string& command) {
  std::istringstream lines(kUsage);
  std::string out;
  bool in = false;
  for (std::string line; std::getline(lines, line);) {
    const bool head = line.size() > 2 && line.compare(0, 2, "  ") == 0 && line[2] != ' ';
    if (head) in = line.compare(2, command.size(), command) == 0 &&
                   (line.size() == 2 + command.size() || line[2 + command.size()] == ' ' || line[2 + command.size()] == '|');
    else if (line.empty() || line[0] != ' ') in = false;
    if (in) out += head ? "usage: zero " + line.substr(2) + "\n\n" : line.substr(std::min<size_t>(line.size(), 6)) + "\n";
  }
  std::cout << (out.empty() ? std::string(kUsage) : out);
  return 0;
}

bool wants_help(const std::vector<std::string>& args, size_t from) {
  for (size_t i = from; i < args.size(); ++i) {
    if (args[i] == "--") return false;
    if (args[i] == "--help" || args[i] == "-h") return true;
  }
  return false;
}

int config_check(const std::vector<std::string>& args) {
  std::string file;
  zero::config::LoadOptions options;
  options.auto_stand_ins = true;
  options.for_training = true;  // the rules zero::initialize applies
  options.auto_hint = [](const std::string& name) {
    return name == "betas" ? std::string("a value written in the config (--auto has no betas)") : "--auto " + name + "=VALUE";
  };
  for (size_t i = 0; i < args.size(); ++i) {
    std::string a = args[i], v;
    const auto eq = a.find('=');
    const std::string name = a.rfind("--", 0) == 0 && eq != std::string::npos ? a.substr(0, eq) : a;
    if (name == "--world-size" || name == "--auto") {
      if (eq != std::string::npos && a.rfind("--", 0) == 0) {
        v = a.substr(eq + 1);
      } else {
        if (i + 1 >= args.size()) return usage_error(name + ": expected a value");
        v = args[++i];
      }
    }
    if (name == "--world-size") {
      int64_t ws = 0;
      const auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), ws);
      if (ec != std::errc() || ptr != v.data() + v.size() || v.empty() || ws < 1 || ws > (1 << 24))
        return usage_error("--world-size: expected an integer in 1..16777216; got \"" + v + "\"");
      options.world_size = ws;
    } else if (name == "--auto") {
      if (auto error = set_auto(options.auto_values, v); !error.empty()) return usage_error(error);
    } else if (a == "--no-auto") {
      options.auto_stand_ins = false;
    } else if (!a.empty() && a[0] == '-') {
      auto near = zero::nearest(name, {"--world-size", "--auto", "--no-auto"});
      return usage_error(a + ": unknown option" + (near.empty() ? "" : "; did you mean " + near + "?"));
    } else if (file.empty()) {
      file = a;
    } else {
      return usage_error("config check takes one FILE; got \"" + file + "\" and \"" + a + "\"");
    }
  }
  if (file.empty()) return usage_error("config check: expected a FILE");
  try {
    auto config = zero::config::load_file(file, options);
    std::cout << zero::config::describe(config);
    std::cout << file << ": OK (world size " << options.world_size << ")\n";
    return 0;
  } catch (const zero::Error& e) {
    std::cerr << zero::error_text(e) << "\n";
    return 1;
  }
}

}  // namespace

int run(const std::vector<std::string>& args);

int main(int argc, char** argv) {
  zero::install_crash_reporter("zero");  // NOTE [crash report]
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const std::exception& e) {
    std::cerr << "zero: " << zero::error_text(e) << "\n";
    return 1;
  }
}

int run(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    std::cout << kUsage;
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "config") {
    if (wants_help(args, 1)) return command_help("config check");
    if (args.size() < 2 || args[1] != "check") return usage_error("expected 'zero config check FILE'");
    return config_check({args.begin() + 2, args.end()});
  }
  if (args[0] == "nvme-tune") return zero::tools::nvme_tune({args.begin() + 1, args.end()});
  if (args[0] == "bench") {
    if (wants_help(args, 1)) return command_help(args.size() > 2 && args[1][0] != '-' ? "bench " + args[1] : "bench");
    // The benches that run other programs (minGPT on ranks, fio): a stop
    // signal ends the run in flight and then the bench, its scratch files
    // removed (bench.h).
    using Bench = int (*)(const std::vector<std::string>&);
    for (const auto& [name, bench] : std::vector<std::pair<std::string, Bench>>{
             {"overlap", zero::tools::bench_overlap}, {"stage3", zero::tools::bench_stage3},
             {"offload", zero::tools::bench_offload}, {"checkpoint-io", zero::tools::bench_checkpoint_io},
             {"aio", zero::tools::bench_aio}}) {
      if (args.size() < 2 || args[1] != name) continue;
      try {
        zero::runs::CatchStopSignals stop;
        const int status = bench({args.begin() + 2, args.end()});
        zero::runs::check_stop();  // one that came after the last run
        return status;
      } catch (const zero::runs::Interrupted& e) {
        std::cerr << "zero bench " << name << ": " << e.what() << "; its runs are ended and their files removed\n";
        return 128 + e.signal();
      }
    }
    if (args.size() >= 2 && args[1] == "engine") return zero::tools::bench_engine({args.begin() + 2, args.end()});
    if (args.size() >= 2 && args[1] == "checkpoint") return zero::tools::bench_checkpoint({args.begin() + 2, args.end()});
    if (args.size() >= 2 && args[1] == "adam") return zero::tools::bench_adam({args.begin() + 2, args.end()});
    if (args.size() >= 2 && args[1] == "transfer") return zero::tools::bench_transfer({args.begin() + 2, args.end()});
    return usage_error("expected 'zero bench engine|overlap|stage3|aio|offload|checkpoint|checkpoint-io|adam|transfer'");
  }
  if (args[0] == "launch") return zero::tools::launch({args.begin() + 1, args.end()});
  if (args[0] == "estimate") return zero::tools::estimate({args.begin() + 1, args.end()});
  if (args[0] == "tune") return zero::tools::tune({args.begin() + 1, args.end()});
  if (args[0] == "memcheck") return zero::tools::memcheck({args.begin() + 1, args.end()});
  if (args[0] == "checkpoint") return zero::tools::checkpoint_command({args.begin() + 1, args.end()});
  if (args[0] == "trace") return zero::tools::trace_command({args.begin() + 1, args.end()});
  auto near = zero::nearest(args[0], {"config", "bench", "launch", "nvme-tune", "checkpoint", "estimate", "tune", "memcheck",
                                      "trace"});
  return usage_error("unknown command \"" + args[0] + "\"" +
                     (near.empty() ? "" : "; did you mean " + near + "?"));
}
