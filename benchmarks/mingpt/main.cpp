// mingpt: trains minGPT with a DeepSpeed config through zero, with the flags
// of the minGPT max-parameter benchmark. See README.md ("The main job").
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/cuda.h>
#include <torch/utils.h>

#include "data.h"
#include "find_max.h"
#include "model.h"
#include "zero/runs/runs.h"
#include "zero/core/command_files.h"
#include "zero/core/crash_report.h"
#include "zero/core/progress.h"
#include "zero/core/text.h"
#include "zero/snapshots/checkpoint_format.h"
#include "zero/snapshots/checkpoint_io.h"
#include "zero/runtime/engine_internal.h"
#include "zero/runtime/estimate.h"
#include "zero/runtime/run_summary.h"
#include "zero/zero.h"

namespace {

const char* kUsage = R"(usage: mingpt --config FILE [options]

Trains minGPT through zero with a DeepSpeed config. Default task: 2-digit
addition (no download); --data FILE trains a character-level model on a text file;
--vocab_size V trains on random tokens (throughput and memory at any shape).

  --config FILE            DeepSpeed JSON config (required)
  --n_layer N              transformer blocks (default 2)
  --n_head N               attention heads (default 4)
  --n_embd N               embedding width (default 128)
  --block_size N           context length (default: the task's; 128 for --data and --vocab_size)
  --batch_size N           micro-batch per rank; fills "auto" train_micro_batch_size_per_gpu (default 64)
  --limit_train_batches N  micro-batches per epoch at most (default: the whole training set)
  --max_epochs N           epochs (default 1)
  --precision 32|16|bf16   compute precision; fills "auto" fp16/bf16 (default: as the config says)
  --lr X                   fills "auto" optimizer lr, and is the lr of --optimizer (default 5e-4)
  --optimizer NAME         adamw, adam or adagrad: the program's own torch::optim optimizer,
                           passed to zero::initialize as a DeepSpeed client optimizer; used
                           when the config has no optimizer section (default adamw then; a
                           config's own section wins, with a warning)
  --weight_decay X         --optimizer's weight decay (default 0.1)
  --data FILE              character-level text task instead of addition
  --vocab_size V           random tokens of a vocabulary of V (2 to 1048576), 65536 samples
                           an epoch, instead of addition (what zero tune's runs train)
  --ndigit N               digits per operand of the addition task (default 2, at most 4)
  --seed N                 initialisation and data order (default 42)
  --summary-json FILE      write the run's summary (rank 0)
  --dropout X              dropout of embeddings, attention and residuals, in [0, 1) (default 0.1)
  --tie_weights            tie the head to the token embedding (GPT-2 style)
  --checkpoint             activation checkpointing of every block (configured by the
                           config's activation_checkpointing section)
  --device DEV             cpu, cuda or cuda:N (default: cuda:LOCAL_RANK when CUDA is available, else cpu;
                           ZERO_DIST_BACKEND=gloo lets several ranks share one GPU with --device cuda:0)
  --cpu_copy_mode MODE     immediate (default) or deferred: on the CPU, hold every device-host
                           transfer back until it is waited for (a test of the stream logic)
  --save_dir DIR           save engine checkpoints to DIR (docs/checkpoints.md): every
                           --save_every steps and at the end
  --save_every N           optimizer steps between checkpoints (default 0: only at the end)
  --resume DIR             continue from DIR's latest checkpoint: states, counters, RNG and
                           the data position (at any world size with the same global batch)
  --resume_tag TAG         with --resume: that checkpoint instead of the latest
  --load_weights FILE      start from full weights in a safetensors file (as `zero checkpoint
                           consolidate` writes them), each rank reading only its partition
  --stop_after_steps N     end the run after N optimizer steps in all (the schedule is still
                           the whole run's): a stop to --resume from; 0 with --load_weights or
                           --resume and --save_dir: save what was loaded, train nothing
  --device-memory BYTES    per-rank budgets ("512MiB", "80e9", "2GiB"): past one, the run ends
  --host-memory BYTES      with an out-of-memory error (exit status 3) naming the tier, the
  --nvme-bytes BYTES       bytes asked, the cap and the config keys that would help. Device: on
                           CUDA the caching allocator's memory fraction, on the CPU every CPU
                           tensor not on a host tier; host: pinned and pageable together; NVMe:
                           the swap files
  --find-max-params        search for the largest model that trains with --config and the
                           budgets (on the CPU --device-memory is required): runs a few steps
                           of each size tried, printing a line per probe; --summary-json FILE
                           writes the search's report (README.md, "The max-parameter benchmark")
  --nproc N                with --find-max-params: ranks per probe (zero launch; default 1;
                           at most 4 per processor unless --oversubscribe)
  --probe_steps N          with --find-max-params: optimizer steps per probe (default 3)
  --probe_timeout S        with --find-max-params: a probe still running after S seconds
                           is stopped and ends the search (default 1800; 0: no limit)
  --head_dim N             with --find-max-params: n_embd moves in steps of N, n_head = n_embd / N
                           (default 64); --n_layer fixes the depth (default n_embd / N)
  -h, --help               this text

Integers are decimal digits (not 1e3 or 0x10), each within its range: --n_layer
up to 100000, --n_head and --n_embd up to 1048576, --block_size up to 1048576,
--batch_size up to 16777216. Each option is given once.
)";

struct Args {
  std::string config;
  int64_t n_layer = 2, n_head = 4, n_embd = 128;
  std::optional<int64_t> block_size;
  int64_t batch_size = 64;
  bool batch_size_given = false;
  std::optional<int64_t> limit_train_batches;
  int64_t max_epochs = 1;
  std::optional<std::string> precision;
  double lr = 5e-4;
  std::optional<std::string> optimizer;
  double weight_decay = 0.1;
  std::string data;
  std::optional<int64_t> vocab_size;
  int64_t ndigit = 2;
  uint64_t seed = 42;
  std::string summary_json;
  double dropout = 0.1;
  bool checkpoint = false;
  bool tie_weights = false;
  std::optional<std::string> device;
  zero::CopyMode cpu_copy_mode = zero::CopyMode::kImmediate;
  std::string save_dir, resume, resume_tag, load_weights;
  int64_t save_every = 0;
  std::optional<int64_t> stop_after_steps;
  std::optional<int64_t> device_memory, host_memory, nvme_bytes;
  bool find_max = false, oversubscribe = false;
  int64_t nproc = 1, probe_steps = 3, head_dim = 64;
  double probe_timeout = 1800;
  bool n_layer_given = false, n_embd_given = false, n_head_given = false;
  std::vector<std::string> forward;  // flags a --find-max-params probe gets as given
  // Test seam (not in --help): "RANK:POINT:N" kills rank RANK at point POINT
  // of its N-th save (CheckpointHooks::at), as a crash would.
  std::string test_kill_save;
};

[[noreturn]] void usage_error(const std::string& message) {
  std::cerr << "mingpt: " << message << "\n(run mingpt --help for the options)\n";
  std::exit(2);
}

// Integers are decimal digits (an optional '-'), in range: "1e3", "0x10",
// "2.0" and values past the range are refused naming the flag, never cast.
int64_t parse_int(const std::string& flag, const std::string& v, int64_t min_value, int64_t max_value) {
  const auto range = "an integer in " + std::to_string(min_value) + ".." + std::to_string(max_value);
  int64_t x = 0;
  const char* end = v.data() + v.size();
  const auto [ptr, ec] = std::from_chars(v.data(), end, x);
  const bool digits = !v.empty() && v.find_first_not_of("-0123456789") == std::string::npos;
  if (!digits || ptr != end) usage_error(flag + ": expected " + range + " (decimal digits); got \"" + v + "\"");
  if (ec == std::errc::result_out_of_range || x < min_value || x > max_value)
    usage_error(flag + ": expected " + range + "; got " + v);
  return x;
}

// A finite number in [min_value, max_value] (below_max: max_value itself excluded).
double parse_double(const std::string& flag, const std::string& v, double min_value, double max_value,
                    bool below_max = false) {
  std::ostringstream range;
  range << "a number in [" << min_value << ", " << max_value << (below_max ? ")" : "]");
  double d = NAN;
  try {
    size_t used = 0;
    d = std::stod(v, &used);
    if (used != v.size() || !std::isfinite(d)) d = NAN;
  } catch (const std::exception&) {
  }
  if (std::isnan(d)) usage_error(flag + ": expected " + range.str() + "; got \"" + v + "\"");
  if (d < min_value || d > max_value || (below_max && d == max_value))
    usage_error(flag + ": expected " + range.str() + "; got " + v);
  return d;
}

// Upper bounds of the model and run flags: far above what trains on any
// machine, low enough that sizes computed from them cannot overflow.
constexpr int64_t kMaxLayers = 100000, kMaxWidth = 1 << 20, kMaxBatch = 1 << 24, kMaxBlock = 1 << 20;
constexpr int64_t kMaxCount = int64_t{1} << 40;  // epochs, batches, steps
constexpr int64_t kMaxDigits = 4;  // the addition task enumerates (10^n)^2 pairs
// zero/runs/runs.h's kOutOfMemoryStatus: the searches tell "does not fit" from other failures by it.
using zero::runs::kOutOfMemoryStatus;

// An output file is checked before the run, not found unwritable after it:
// its folder exists and takes files, and the name is not a folder.
void check_writable(const std::string& flag, const std::string& path) {
  if (const std::string problem = zero::runs::output_path_problem(flag, path); !problem.empty()) usage_error(problem);
}

Args parse_args(int argc, char** argv) {
  Args a;
  const std::vector<std::string> flags = {
      "--config", "--n_layer", "--n_head", "--n_embd", "--block_size", "--batch_size",
      "--limit_train_batches", "--max_epochs", "--precision", "--lr", "--data", "--vocab_size", "--ndigit",
      "--seed", "--summary-json", "--dropout", "--checkpoint", "--tie_weights", "--device", "--cpu_copy_mode",
      "--save_dir", "--save_every", "--resume", "--resume_tag", "--load_weights", "--stop_after_steps", "--test_kill_save",
      "--device-memory", "--host-memory", "--nvme-bytes", "--find-max-params", "--nproc", "--probe_steps", "--probe_timeout", "--head_dim",
      "--optimizer", "--weight_decay"};
  // What a --find-max-params probe is given as the user gave it.
  const std::vector<std::string> forwarded = {"--batch_size", "--precision", "--lr", "--data", "--vocab_size", "--ndigit", "--seed",
                                              "--dropout", "--device", "--cpu_copy_mode", "--block_size", "--optimizer",
                                              "--weight_decay"};
  std::map<std::string, std::string> seen;  // flag -> the value given first
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i], value;
    if (flag == "--checkpoint") {
      a.checkpoint = true;
      a.forward.push_back(flag);
      continue;
    }
    if (flag == "--tie_weights") {
      a.tie_weights = true;
      a.forward.push_back(flag);
      continue;
    }
    if (flag == "--find-max-params" || flag == "--oversubscribe") {
      if (auto [it, fresh] = seen.emplace(flag, ""); !fresh) usage_error(flag + " given twice: give it once");
      (flag == "--find-max-params" ? a.find_max : a.oversubscribe) = true;
      continue;
    }
    if (flag == "-h" || flag == "--help") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (auto eq = flag.find('='); eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    } else if (std::find(flags.begin(), flags.end(), flag) != flags.end()) {
      if (i + 1 >= argc) usage_error(flag + ": expected a value");
      value = argv[++i];
    }
    if (std::find(flags.begin(), flags.end(), flag) != flags.end()) {
      if (auto [it, fresh] = seen.emplace(flag, value); !fresh)
        usage_error(flag + " given twice (\"" + it->second + "\" and \"" + value + "\"): give it once");
    }
    if (std::find(forwarded.begin(), forwarded.end(), flag) != forwarded.end()) a.forward.insert(a.forward.end(), {flag, value});
    if (flag == "--config") {
      try {
        a.config = zero::config_file_argument(flag, value);
      } catch (const zero::UsageError& e) {
        usage_error(e.what());
      }
    }
    else if (flag == "--n_layer") a.n_layer = parse_int(flag, value, 1, kMaxLayers), a.n_layer_given = true;
    else if (flag == "--n_head") a.n_head = parse_int(flag, value, 1, kMaxWidth), a.n_head_given = true;
    else if (flag == "--n_embd") a.n_embd = parse_int(flag, value, 1, kMaxWidth), a.n_embd_given = true;
    else if (flag == "--device-memory" || flag == "--host-memory" || flag == "--nvme-bytes") {
      const auto n = zero::parse_byte_size(value);
      if (!n) usage_error(flag + ": expected a byte count such as 512MiB, 2GiB or 80e9; got \"" + value + "\"");
      (flag == "--device-memory" ? a.device_memory : flag == "--host-memory" ? a.host_memory : a.nvme_bytes) = *n;
    } else if (flag == "--nproc") a.nproc = parse_int(flag, value, 1, 1024);
    else if (flag == "--probe_steps") a.probe_steps = parse_int(flag, value, 1, 1000);
    else if (flag == "--probe_timeout") a.probe_timeout = static_cast<double>(parse_int(flag, value, 0, 10000000));
    else if (flag == "--head_dim") a.head_dim = parse_int(flag, value, 1, kMaxWidth);
    else if (flag == "--block_size") a.block_size = parse_int(flag, value, 1, kMaxBlock);
    else if (flag == "--batch_size") a.batch_size = parse_int(flag, value, 1, kMaxBatch), a.batch_size_given = true;
    else if (flag == "--limit_train_batches") a.limit_train_batches = parse_int(flag, value, 1, kMaxCount);
    else if (flag == "--max_epochs") a.max_epochs = parse_int(flag, value, 1, kMaxCount);
    else if (flag == "--precision") {
      if (value != "32" && value != "16" && value != "bf16")
        usage_error("--precision: expected one of 32, 16, bf16; got \"" + value + "\"");
      a.precision = value;
    } else if (flag == "--lr") a.lr = parse_double(flag, value, 0, 1e3);
    else if (flag == "--weight_decay") a.weight_decay = parse_double(flag, value, 0, 10);
    else if (flag == "--optimizer") {
      if (value != "adamw" && value != "adam" && value != "adagrad")
        usage_error("--optimizer: expected adamw, adam or adagrad; got \"" + value + "\"");
      a.optimizer = value;
    }
    else if (flag == "--data") a.data = value;
    else if (flag == "--vocab_size") a.vocab_size = parse_int(flag, value, 2, kMaxWidth);
    else if (flag == "--ndigit") a.ndigit = parse_int(flag, value, 1, kMaxDigits);
    else if (flag == "--seed") a.seed = static_cast<uint64_t>(parse_int(flag, value, 0, std::numeric_limits<int64_t>::max()));
    else if (flag == "--summary-json") a.summary_json = value;
    else if (flag == "--dropout") a.dropout = parse_double(flag, value, 0, 1, /*below_max=*/true);
    else if (flag == "--device") {
      try {
        (void)torch::Device(value);
      } catch (const std::exception&) {
        usage_error("--device: expected cpu, cuda or cuda:N; got \"" + value + "\"");
      }
      a.device = value;
    } else if (flag == "--cpu_copy_mode") {
      if (value != "immediate" && value != "deferred")
        usage_error("--cpu_copy_mode: expected immediate or deferred; got \"" + value + "\"");
      a.cpu_copy_mode = value == "deferred" ? zero::CopyMode::kDeferred : zero::CopyMode::kImmediate;
    } else if (flag == "--save_dir") a.save_dir = value;
    else if (flag == "--save_every") a.save_every = parse_int(flag, value, 0, kMaxCount);
    else if (flag == "--resume") a.resume = value;
    else if (flag == "--resume_tag") a.resume_tag = value;
    else if (flag == "--load_weights") a.load_weights = value;
    else if (flag == "--stop_after_steps") a.stop_after_steps = parse_int(flag, value, 0, kMaxCount);
    else if (flag == "--test_kill_save") a.test_kill_save = value;
    else {
      auto near = zero::nearest(flag, flags);
      usage_error(flag + ": unknown option" + (near.empty() ? "" : "; did you mean " + near + "?"));
    }
  }
  if (a.config.empty()) usage_error("--config FILE is required (e.g. configs/mingpt_zero0.json)");
  if (a.save_every > 0 && a.save_dir.empty()) usage_error("--save_every needs --save_dir DIR");
  if (seen.count("--resume_tag") && a.resume_tag.empty())
    usage_error("--resume_tag: expected a checkpoint's tag; got \"\" (leave --resume_tag out for the latest)");
  if (!a.resume_tag.empty() && a.resume.empty()) usage_error("--resume_tag needs --resume DIR");
  for (const char* f : {"--save_dir", "--resume", "--config", "--data", "--load_weights", "--summary-json"})
    if (seen.count(f) && seen[f].empty()) usage_error(std::string(f) + ": expected a path; got \"\"");
  if (!a.data.empty() && a.vocab_size)
    usage_error("--data and --vocab_size each choose the task (a text file, random tokens): give one");
  if (a.block_size && a.data.empty() && !a.vocab_size)
    usage_error("--block_size applies to --data and --vocab_size only: the addition task's context is set by --ndigit (3 x ndigit)");
  if (a.find_max) {
    for (const auto& [given, name] : std::vector<std::pair<bool, std::string>>{
             {a.n_embd_given, "--n_embd"}, {a.n_head_given, "--n_head"}, {a.limit_train_batches.has_value(), "--limit_train_batches"},
             {a.stop_after_steps.has_value(), "--stop_after_steps"}, {seen.count("--max_epochs") > 0, "--max_epochs"},
             {!a.save_dir.empty(), "--save_dir"}, {!a.resume.empty(), "--resume"}, {!a.load_weights.empty(), "--load_weights"}})
      if (given) usage_error(name + " does not go with --find-max-params: the search sets the width and the steps of each probe");
  } else {
    for (const char* f : {"--nproc", "--probe_steps", "--probe_timeout", "--head_dim", "--oversubscribe"})
      if (seen.count(f)) usage_error(std::string(f) + " goes with --find-max-params only");
  }
  if (const std::string problem = zero::runs::too_many_ranks("--nproc", a.nproc, a.oversubscribe); !problem.empty())
    usage_error(problem);
  if (a.n_head > a.n_embd || a.n_embd % a.n_head != 0)
    usage_error("--n_embd " + std::to_string(a.n_embd) + " must be a multiple of --n_head " + std::to_string(a.n_head));
  if (!a.resume.empty() && !a.load_weights.empty())
    usage_error("--resume and --load_weights both set the weights: give one");
  return a;
}

const char* precision_name(torch::ScalarType t) {
  return t == torch::kHalf ? "16" : t == torch::kBFloat16 ? "bf16" : "32";
}

// --find-max-params: the search runs this binary once per size (find_max.cpp).
int find_max(const Args& args, const mingpt::GPTConfig& gcfg, const zero::InitOptions& opts) {
  mingpt::FindMaxOptions f;
  char self[4096] = {0};
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) throw zero::IoError(std::string("readlink /proc/self/exe: ") + std::strerror(errno));
  f.self = std::string(self, static_cast<size_t>(n));
  f.launcher = f.self.substr(0, f.self.rfind('/') + 1) + "zero";
  if (args.nproc > 1 && ::access(f.launcher.c_str(), X_OK) != 0)
    usage_error("--nproc " + std::to_string(args.nproc) + " runs the probes with " + f.launcher + ", which is not there");
  f.nproc = args.nproc;
  f.config = args.config;
  zero::config::LoadOptions lo;
  lo.world_size = args.nproc;
  lo.auto_values = opts.auto_values;
  lo.auto_values.total_num_steps = 1;
  lo.auto_values.warmup_num_steps = 1;
  f.resolved = zero::config::load_file(args.config, lo);
  f.vocab_size = gcfg.vocab_size;
  f.block_size = gcfg.block_size;
  f.tie_weights = gcfg.tie_weights;
  f.checkpointing = args.checkpoint;
  f.device_memory = args.device_memory;
  f.host_memory = args.host_memory;
  f.nvme_bytes = args.nvme_bytes;
  f.on_cuda = args.device ? torch::Device(*args.device).is_cuda() : torch::cuda::is_available();
  if (f.on_cuda && !f.device_memory)
    f.device_total = zero::cuda_total_memory(args.device ? torch::Device(*args.device) : torch::Device(torch::kCUDA, 0));
  if (!f.on_cuda && !f.device_memory)
    usage_error("--find-max-params on the CPU needs --device-memory BYTES (the budget a GPU's memory would set)");
  if (args.n_layer_given) f.n_layer = args.n_layer;
  f.head_dim = args.head_dim;
  f.steps = args.probe_steps;
  f.probe_timeout_s = args.probe_timeout;
  f.forward = args.forward;
  f.json_path = args.summary_json;
  if (!f.json_path.empty()) check_writable("--summary-json", f.json_path);
  return mingpt::find_max_params(f);
}

// NOTE [outputs and inputs]: no output over what the run reads, before any work.
void check_outputs(const Args& a) {
  zero::CommandFiles files;
  files.reads("--config", a.config);
  if (!a.data.empty()) files.reads("--data", a.data);
  if (!a.load_weights.empty()) {
    try {
      const auto w = zero::ckpt::WeightFiles::resolve(a.load_weights);
      // Read whole before the first step: a save may replace them later.
      if (!w.index.empty()) files.reads_checkpoint("--load_weights' index", w.index, /*whole_folder=*/false);
      for (const auto& f : w.files) files.reads_checkpoint("--load_weights", f, /*whole_folder=*/false);
    } catch (const zero::IoError&) {  // the load names what is wrong
      files.reads("--load_weights", a.load_weights);
    }
  }
  if (!a.resume.empty()) {
    if (!a.resume_tag.empty())
      files.reads_checkpoint("--resume_tag", a.resume + "/" + a.resume_tag, /*whole_folder=*/true);
    else zero::ckpt::add_resume_inputs(files, "--resume", a.resume);
  }
  if (!a.summary_json.empty()) files.writes("--summary-json", a.summary_json);
  if (!a.save_dir.empty()) files.adds_to_folder("--save_dir", a.save_dir);
  if (const std::string problem = files.problem(); !problem.empty()) usage_error(problem);
}

}  // namespace

int main(int argc, char** argv) {
  zero::install_crash_reporter("mingpt");  // NOTE [crash report]
  const Args args = parse_args(argc, argv);
  check_outputs(args);
  try {
    std::unique_ptr<mingpt::Task> task =
        args.vocab_size ? mingpt::make_random_task(*args.vocab_size, args.block_size.value_or(128), 65536)
        : args.data.empty() ? mingpt::make_addition_task(args.ndigit)
                            : mingpt::make_text_task(args.data, args.block_size.value_or(128));
    mingpt::GPTConfig gcfg;
    gcfg.vocab_size = task->vocab_size();
    gcfg.block_size = task->block_size();
    gcfg.n_layer = args.n_layer;
    gcfg.n_head = args.n_head;
    gcfg.n_embd = args.n_embd;
    gcfg.embd_pdrop = gcfg.resid_pdrop = gcfg.attn_pdrop = args.dropout;
    gcfg.tie_weights = args.tie_weights;

    zero::InitOptions opts;
    opts.auto_values.train_micro_batch_size_per_gpu = args.batch_size;
    opts.auto_values.gradient_accumulation_steps = 1;
    opts.auto_values.lr = args.lr;
    opts.auto_values.weight_decay = args.weight_decay;
    opts.auto_values.hidden_size = args.n_embd;
    opts.auto_values.gradient_clipping = 1.0;
    const std::string precision = args.precision.value_or("32");
    opts.auto_values.precision = precision == "32" ? "fp32" : precision == "16" ? "fp16" : "bf16";
    opts.tokens_per_sample = task->block_size();
    if (args.device) opts.device = torch::Device(*args.device);
    opts.cpu_copy_mode = args.cpu_copy_mode;
    opts.program_ends_at_stop = true;  // the loop asks engine.stop_requested()
    opts.device_memory_limit_bytes = args.device_memory;
    opts.host_memory_limit_bytes = args.host_memory;
    opts.nvme_limit_bytes = args.nvme_bytes;
    if (args.find_max) return find_max(args, gcfg, opts);
    // A schedule's "auto" total_num_steps depends on the resolved batch: resolve
    // the config once to learn it, then build the engine with the real total.
    auto micro_batches_per_epoch = [&](const zero::config::BatchConfig& b) {
      // Micro-steps per epoch: samples / (samples of one micro-step over all ranks).
      int64_t n = task->train_size() / (b.train_batch_size / b.gradient_accumulation_steps);
      if (args.limit_train_batches) n = std::min(n, *args.limit_train_batches);
      return n / b.gradient_accumulation_steps * b.gradient_accumulation_steps;
    };
    int zero_stage = 0;
    bool config_has_optimizer = true;
    {
      zero::config::LoadOptions probe;
      opts.dist = zero::DistEnv::from_environment();
      // Only rank 0 writes the summary (other nodes need not have its folder):
      // checked now, not found unwritable after the run.
      if (!args.summary_json.empty() && opts.dist->rank == 0) check_writable("--summary-json", args.summary_json);
      // So is the checkpoint folder (the engine then takes its writer lock).
      if (!args.save_dir.empty() && opts.dist->rank == 0)
        if (const auto problem = zero::ckpt::checkpoint_folder_problem("--save_dir", args.save_dir); !problem.empty())
          usage_error(problem);
      probe.world_size = opts.dist->world_size;
      probe.auto_values = opts.auto_values;
      probe.auto_hint = zero::detail::program_auto_hint("mingpt");
      probe.auto_values.total_num_steps = 1;
      probe.auto_values.warmup_num_steps = 1;
      const auto probed = zero::config::load_file(args.config, probe);
      const auto& b = probed.batch;
      zero_stage = probed.zero.stage;
      config_has_optimizer = probed.optimizer.has_value();
      const int64_t steps = micro_batches_per_epoch(b) / b.gradient_accumulation_steps * args.max_epochs;
      opts.auto_values.total_num_steps = std::max<int64_t>(1, steps);
      opts.auto_values.warmup_num_steps = std::max<int64_t>(1, steps / 20);
    }
    // ZeRO stage 3 builds the model partitioned (zero::Init): each block is
    // cut into shards as it is made, so no rank ever holds the whole model.
    std::unique_ptr<zero::Init> init;
    if (zero_stage == 3) {
      init = std::make_unique<zero::Init>(args.config, opts);
      if (opts.dist->rank == 0) std::fprintf(stderr, "mingpt: building the model partitioned (zero::Init)\n");
    }
    torch::manual_seed(args.seed);
    mingpt::GPT model(gcfg, init.get());
    if (!init) opts.layers = model->stage3_layers();
    // The program's own optimizer where the config has none (or --optimizer
    // asks; the config's then wins, with a warning): NOTE [client optimizer].
    std::unique_ptr<torch::optim::Optimizer> client;
    if (!config_has_optimizer || args.optimizer)
      client = zero::detail::program_optimizer("--optimizer", args.optimizer.value_or("adamw"),
                                               {{model->parameters(), args.weight_decay}}, args.lr);
    opts.optimizer = client.get();
    auto engine = init ? zero::initialize(model.ptr(), *init, model->stage3_layers(), client.get())
                       : zero::initialize(model.ptr(), args.config, opts);

    if (args.checkpoint) model->set_checkpointer(&engine.checkpointer());
    // Before the first step: another job saving into the folder is found now.
    if (!args.save_dir.empty()) engine.open_checkpoint_dir(args.save_dir);
    const auto& batch = engine.config().batch;
    if (args.precision && *args.precision != precision_name(engine.compute_dtype())) {
      usage_error("--precision " + *args.precision + " conflicts with " + args.config +
                  " (fp16.enabled " + (engine.config().fp16.enabled ? "true" : "false") +
                  ", bf16.enabled " + (engine.config().bf16.enabled ? "true" : "false") + ")");
    }
    if (args.batch_size_given && batch.train_micro_batch_size_per_gpu != args.batch_size) {
      usage_error("--batch_size " + std::to_string(args.batch_size) + " conflicts with " + args.config +
                  " (train_micro_batch_size_per_gpu " + std::to_string(batch.train_micro_batch_size_per_gpu) + ")");
    }
    const int64_t ws = engine.world_size(), rank = engine.rank();
    const int64_t mbs = batch.train_micro_batch_size_per_gpu, gas = batch.gradient_accumulation_steps;
    const int64_t micro_per_epoch = micro_batches_per_epoch(batch);
    if (micro_per_epoch == 0)
      usage_error("an optimizer step takes " + std::to_string(batch.train_batch_size) + " samples (micro-batch " +
                  std::to_string(mbs) + " x gradient_accumulation_steps " + std::to_string(gas) + " x " +
                  std::to_string(ws) + " ranks) but the training set of " + task->name() + " has " +
                  std::to_string(task->train_size()) + ": lower --batch_size (or the config's batch keys)");

    if (rank == 0) std::fprintf(stderr,
                 "mingpt: %s | %lld parameters (L=%lld, H=%lld, C=%lld, T=%lld, V=%lld) | ZeRO stage %d | "
                 "precision %s | device %s | global batch %lld = %lld x %lld x %lld ranks\n",
                 task->name().c_str(), static_cast<long long>(engine.num_parameters()),
                 static_cast<long long>(gcfg.n_layer), static_cast<long long>(gcfg.n_head),
                 static_cast<long long>(gcfg.n_embd), static_cast<long long>(gcfg.block_size),
                 static_cast<long long>(gcfg.vocab_size), engine.config().zero.stage,
                 precision_name(engine.compute_dtype()), engine.device().str().c_str(),
                 static_cast<long long>(batch.train_batch_size), static_cast<long long>(mbs),
                 static_cast<long long>(gas), static_cast<long long>(ws));

    // Checkpoints (docs/checkpoints.md): the data position travels as client state.
    const int64_t steps_per_epoch = micro_per_epoch / gas;
    int64_t start_epoch = 0, start_step = 0;  // where this run begins: epoch, optimizer step in it
    int64_t saves = 0, save_bytes = 0, load_bytes = 0, last_saved_step = -1;
    double save_s = 0, load_s = 0;
    if (!args.test_kill_save.empty()) {
      // RANK:POINT:N[:TERM|:WAIT=FILE]: SIGKILL; or SIGTERM (a stop the save
      // catches); or stand still there, FILE made, until a stop signal comes
      // (one the test sends from outside, to the launcher say).
      std::string spec = args.test_kill_save, wait_file;
      int sig = SIGKILL;
      if (spec.size() > 5 && spec.compare(spec.size() - 5, 5, ":TERM") == 0) sig = SIGTERM, spec.resize(spec.size() - 5);
      if (const auto w = spec.find(":WAIT="); w != std::string::npos) {
        wait_file = spec.substr(w + 6);
        spec.resize(w);
        sig = 0;
      }
      const auto c1 = spec.find(':'), c2 = spec.rfind(':');
      if (c1 == std::string::npos || c2 == c1) usage_error("--test_kill_save: expected RANK:POINT:N[:TERM|:WAIT=FILE]");
      const int64_t kill_rank = parse_int("--test_kill_save", spec.substr(0, c1), 0, ws - 1);
      const std::string point = spec.substr(c1 + 1, c2 - c1 - 1);
      const int64_t nth = parse_int("--test_kill_save", spec.substr(c2 + 1), 1, kMaxCount);
      zero::detail::CheckpointHooks hooks;
      hooks.at = [&saves, rank, kill_rank, point, nth, sig, wait_file](const std::string& at) {
        if (rank == kill_rank && at == point && saves + 1 == nth && sig == 0) {
          std::ofstream(wait_file) << "waiting\n";
          for (int i = 0; i < 1200 && !zero::detail::save_stop_requested(); ++i)
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
          return;
        }
        if (rank == kill_rank && at == point && saves + 1 == nth) {
          std::fprintf(stderr, "mingpt: --test_kill_save: %s to rank %lld at \"%s\" of save %lld\n",
                       sig == SIGKILL ? "SIGKILL" : "SIGTERM", static_cast<long long>(rank), at.c_str(),
                       static_cast<long long>(nth));
          std::fflush(stderr);
          std::raise(sig);
        }
      };
      zero::detail::set_checkpoint_hooks(engine, std::move(hooks));
    }
    if (!args.resume.empty()) {
      const auto st = engine.load_checkpoint(args.resume, args.resume_tag);
      load_bytes = st.bytes;
      load_s = st.seconds;
      const auto client = nlohmann::json::parse(st.client_state);
      const std::string where = st.dir + "/" + st.tag;
      if (!client.contains("epoch") || !client.contains("step_in_epoch") || !client.contains("seed") ||
          !client.contains("train_batch_size"))
        usage_error("--resume " + args.resume + ": " + where + " holds no mingpt data position (not saved by mingpt)");
      for (const char* key : {"epoch", "step_in_epoch", "seed", "train_batch_size"})
        if (!client[key].is_number_unsigned() || client[key].get<uint64_t>() > uint64_t{std::numeric_limits<int64_t>::max()} ||
            client[key].get<uint64_t>() < (std::string(key) == "train_batch_size" ? 1u : 0u))
          usage_error("--resume " + args.resume + ": " + where + "/meta.json: client_state." + key +
                      ": expected a whole number, " + (std::string(key) == "train_batch_size" ? "1" : "0") +
                      " or more; got " + client[key].dump() + " (a damaged checkpoint)");
      if (client["seed"].get<uint64_t>() != args.seed)
        usage_error("--resume: " + where + " was trained with --seed " + client["seed"].dump() + " (its data order); got --seed " +
                    std::to_string(args.seed));
      if (client["train_batch_size"].get<int64_t>() != batch.train_batch_size)
        usage_error("--resume: " + where + " was trained with train_batch_size " + client["train_batch_size"].dump() +
                    "; this run has " + std::to_string(batch.train_batch_size) +
                    " (the data position counts global batches: keep the global batch, change the micro-batch or "
                    "gradient_accumulation_steps)");
      start_epoch = client["epoch"].get<int64_t>();
      start_step = client["step_in_epoch"].get<int64_t>();
      if (start_step >= steps_per_epoch) ++start_epoch, start_step = 0;
      // Saving to the folder resumed from: not the state just read again.
      if (args.save_dir == args.resume) last_saved_step = engine.global_steps();
      if (rank == 0)
        std::fprintf(stderr, "mingpt: resumed from %s at step %lld (epoch %lld, step %lld of it); this rank read %s in %.2f s\n",
                     where.c_str(), static_cast<long long>(engine.global_steps()),
                     static_cast<long long>(start_epoch + 1), static_cast<long long>(start_step),
                     zero::format_bytes(load_bytes).c_str(), load_s);
    } else if (!args.load_weights.empty()) {
      engine.load_weights(args.load_weights);
      if (rank == 0) std::fprintf(stderr, "mingpt: weights from %s\n", args.load_weights.c_str());
    }
    auto save = [&](int64_t epoch, int64_t step_in_epoch) {
      const nlohmann::json client = {{"epoch", epoch}, {"step_in_epoch", step_in_epoch}, {"seed", args.seed},
                                     {"train_batch_size", batch.train_batch_size}};
      const auto st = engine.save_checkpoint(args.save_dir, "", client.dump());
      ++saves;
      save_bytes += st.bytes;
      save_s += st.seconds;
      last_saved_step = engine.global_steps();
      if (rank == 0)
        std::fprintf(stderr, "\nmingpt: saved %s/%s (this rank: %s in %.2f s)\n", st.dir.c_str(), st.tag.c_str(),
                     zero::format_bytes(st.bytes).c_str(), st.seconds);
    };

    model->train();
    const auto V = gcfg.vocab_size;
    double epoch_time_sum = 0, peak_sum = 0, final_loss = NAN, eval_accuracy = NAN;
    int64_t epochs_run = 0;
    torch::Tensor step_loss;
    std::vector<double> loss_curve;  // this rank's mean loss per optimizer step
    std::vector<double> step_times;  // seconds per optimizer step (the loss read at each one waits for the device)
    auto step_start = std::chrono::steady_clock::now();
    // --stop_after_steps, or ZERO_STOP_AFTER_STEPS (a tool's run, NOTE [run
    // report]): the run ends there and then does its own end (summary, save).
    bool stopped = (args.stop_after_steps && engine.global_steps() >= *args.stop_after_steps) || engine.stop_requested();
    if (stopped && rank == 0)  // said, not silent: nothing trains
      std::fprintf(stderr, "mingpt: stopped after step %lld, before training (%s)\n",
                   static_cast<long long>(engine.global_steps()),
                   engine.stop_requested() ? "ZERO_STOP_AFTER_STEPS" : "--stop_after_steps");
    int64_t end_epoch = start_epoch, end_step = start_step;  // the data position after the last step run
    for (int64_t epoch = start_epoch; epoch < args.max_epochs && !stopped; ++epoch) {
      const auto order = mingpt::epoch_order(task->train_size(), args.seed, epoch);
      // After the data order (the host's, made once per epoch), as a GPU run counts.
      engine.reset_peak_bytes();
      const int64_t first_mb = epoch == start_epoch ? start_step * gas : 0;
      std::optional<zero::ProgressLine> progress;
      if (rank == 0) progress.emplace("epoch " + std::to_string(epoch + 1) + "/" + std::to_string(args.max_epochs),
                                  micro_per_epoch - first_mb, "batches");
      const auto t0 = std::chrono::steady_clock::now();
      double last_loss = NAN;
      for (int64_t mb = first_mb; mb < micro_per_epoch; ++mb) {
        auto b = task->train_batch(mingpt::micro_batch_indices(order, mb / gas, mb % gas, rank, mbs, gas, ws));
        if (mb == first_mb) engine.check_batch(b.x);
        auto logits = model->forward(b.x.to(engine.device()));
        auto loss = torch::nn::functional::cross_entropy(
            logits.to(torch::kFloat).view({-1, V}), b.y.to(engine.device()).view({-1}),
            torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1));
        step_loss = step_loss.defined() ? step_loss + loss.detach() : loss.detach();
        engine.backward(loss);
        engine.step();
        if ((mb + 1) % gas == 0) {
          last_loss = step_loss.item<double>() / static_cast<double>(gas);
          loss_curve.push_back(last_loss);
          step_loss = torch::Tensor();
          const auto now = std::chrono::steady_clock::now();
          step_times.push_back(std::chrono::duration<double>(now - step_start).count());
          end_epoch = epoch, end_step = (mb + 1) / gas;
          const int64_t done = engine.global_steps();
          stopped = (args.stop_after_steps && done >= *args.stop_after_steps) || engine.stop_requested();
          if (!args.save_dir.empty() && args.save_every > 0 && done % args.save_every == 0) save(epoch, end_step);
          step_start = std::chrono::steady_clock::now();  // a save is not a step
        }
        // No loss is shown until an optimizer step has one (not "loss nan").
        char note[64] = "";
        if (!std::isnan(last_loss)) std::snprintf(note, sizeof note, "loss %.4f", last_loss);
        if (progress) progress->update(mb + 1 - first_mb, note);
        if (stopped) break;
      }
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      step_start = std::chrono::steady_clock::now();  // evaluation is not a step
      epoch_time_sum += secs;
      ++epochs_run;
      peak_sum += static_cast<double>(engine.peak_bytes(zero::Tier::kDevice));
      final_loss = last_loss;
      if (stopped) {
        if (progress) progress->finish("stopped after step " + std::to_string(engine.global_steps()));
        break;
      }
      // At stage 3 every rank runs the evaluation: its layers gather across ranks.
      if (rank == 0 || engine.config().zero.stage == 3) eval_accuracy = task->evaluate(model, engine.device(), 256);
      if (rank == 0) {
        char note[96];
        std::snprintf(note, sizeof note, "loss %.4f | held-out accuracy %.1f%%", last_loss, 100 * eval_accuracy);
        progress->finish(note);
      }
    }
    if (!args.save_dir.empty() && last_saved_step != engine.global_steps()) save(end_epoch, end_step);
    const double avg_epoch = epoch_time_sum / static_cast<double>(std::max<int64_t>(1, epochs_run));
    const double avg_peak_mib = peak_sum / static_cast<double>(std::max<int64_t>(1, epochs_run)) / (1024.0 * 1024.0);

    // Every rank's figures, and the loss curve averaged over ranks (each rank's
    // loss is the mean over its equal share of the global batch).
    auto state = engine.model_state_bytes();
    auto on_device = engine.model_state_bytes(zero::Tier::kDevice);
    auto pinned = engine.model_state_bytes(zero::Tier::kPinnedHost), host = engine.model_state_bytes(zero::Tier::kHost);
    auto nvme = engine.model_state_bytes(zero::Tier::kNvme);
    const auto traffic = zero::detail::collective_traffic_of(engine);  // before this gather
    auto mine = torch::tensor({engine.peak_bytes(zero::Tier::kDevice), engine.peak_bytes(zero::Tier::kPinnedHost),
                               engine.peak_bytes(zero::Tier::kHost), engine.peak_bytes(zero::Tier::kNvme),
                               state.parameters, state.gradients, state.optimizer_states,
                               on_device.parameters, on_device.gradients, on_device.optimizer_states,
                               pinned.parameters + host.parameters, pinned.gradients + host.gradients,
                               pinned.optimizer_states + host.optimizer_states,
                               engine.stage3_stats() ? engine.stage3_stats()->peak_live_parameters : 0,
                               // gathered parameters at their peak: what the ledger's parameter peak has
                               // beyond the shards (nothing is gathered in layers after a step)
                               engine.ledger().get(zero::Tier::kDevice, zero::Kind::kParameters).peak_bytes -
                                   engine.ledger().get(zero::Tier::kDevice, zero::Kind::kParameters).current_bytes,
                               nvme.parameters, nvme.gradients, nvme.optimizer_states,
                               save_bytes, static_cast<int64_t>(save_s * 1e6), load_bytes,
                               static_cast<int64_t>(load_s * 1e6), traffic.bytes.within_node,
                               traffic.bytes.across_nodes, traffic.steps, static_cast<int64_t>(traffic.node)},
                              torch::kLong);
    auto all = mine.repeat({ws});
    auto curve = torch::tensor(loss_curve, torch::kDouble);
    if (auto* comm = zero::detail::comm_of(engine)) {
      // On the collectives' device (NCCL takes CUDA tensors only).
      auto all_d = all.to(comm->device()), mine_d = mine.to(comm->device()), curve_d = curve.to(comm->device());
      comm->all_gather(all_d, mine_d).wait();
      comm->all_reduce_sum(curve_d).wait();
      all = all_d.cpu();
      curve = curve_d.cpu().div_(static_cast<double>(ws));
    }
    if (!loss_curve.empty()) final_loss = curve[-1].item<double>();
    const double param_l2 = engine.parameter_l2();  // a collective at stage 3
    if (rank != 0) return 0;

    std::printf("Average Epoch time: %.2f seconds\n", avg_epoch);
    std::printf("Average Peak memory: %.2f MiB\n", avg_peak_mib);
    if (std::isnan(eval_accuracy))  // no epoch ran to its end (--stop_after_steps): nothing was evaluated
      std::printf("Held-out accuracy: not evaluated (no epoch finished)\n");
    else
      std::printf("Held-out accuracy: %.2f%%\n", 100 * eval_accuracy);
    std::fflush(stdout);
    std::cerr << engine.memory_summary();

    if (!args.summary_json.empty()) {
      auto figures = [](const torch::Tensor& row) {
        auto r = row.accessor<int64_t, 1>();
        return std::pair{nlohmann::json{{"device", r[0]}, {"pinned_host", r[1]}, {"host", r[2]}, {"nvme", r[3]}},
                         nlohmann::json{{"parameters", r[4]}, {"gradients", r[5]}, {"optimizer_states", r[6]}}};
      };
      auto by_tier = [](const torch::Tensor& row) {
        auto r = row.accessor<int64_t, 1>();
        return nlohmann::json{
            {"device", {{"parameters", r[7]}, {"gradients", r[8]}, {"optimizer_states", r[9]}}},
            {"host", {{"parameters", r[10]}, {"gradients", r[11]}, {"optimizer_states", r[12]}}},
            {"nvme", {{"parameters", r[15]}, {"gradients", r[16]}, {"optimizer_states", r[17]}}}};
      };
      auto ranks = nlohmann::json::array();
      for (int64_t r = 0; r < ws; ++r) {
        auto row = all.view({ws, -1})[r].contiguous();
        auto [peaks, states] = figures(row);
        ranks.push_back({{"rank", r}, {"peak_bytes", peaks}, {"model_state_bytes", states},
                         {"model_state_bytes_by_tier", by_tier(row)},
                         {"peak_live_parameters", row[13].item<int64_t>()},
                         {"peak_gathered_bytes", row[14].item<int64_t>()},
                         {"checkpoint", {{"save_bytes", row[18].item<int64_t>()},
                                         {"save_s", static_cast<double>(row[19].item<int64_t>()) * 1e-6},
                                         {"load_bytes", row[20].item<int64_t>()},
                                         {"load_s", static_cast<double>(row[21].item<int64_t>()) * 1e-6}}},
                         {"node", row[25].item<int64_t>()},
                         {"collective_bytes", {{"within_node", row[22].item<int64_t>()},
                                               {"across_nodes", row[23].item<int64_t>()},
                                               {"steps", row[24].item<int64_t>()}}}});
      }
      auto [peaks, states] = figures(mine);
      std::vector<double> curve_values(curve.data_ptr<double>(), curve.data_ptr<double>() + curve.numel());
      nlohmann::json summary = {
          {"world_size", ws},
          {"zero_stage", engine.config().zero.stage},
          {"precision", precision_name(engine.compute_dtype())},
          {"device", engine.device().str()},
          {"num_parameters", engine.num_parameters()},
          {"steps", engine.global_steps()},
          {"skipped_steps", engine.skipped_steps()},
          {"final_loss", final_loss},
          {"loss_curve", curve_values},
          {"param_l2", param_l2},
          {"avg_epoch_time_s", avg_epoch},
          {"step_time_s", step_times},
          {"tokens_per_step", batch.train_batch_size * task->block_size()},
          {"peak_bytes", peaks},
          {"model_state_bytes", states},
          {"ranks", ranks},
          {"collective_bytes_per_step", zero::detail::traffic_per_step(ranks)},
          {"eval_accuracy", eval_accuracy},
          {"task", task->name()},
          {"activation_checkpointing", args.checkpoint},
          {"tie_weights", args.tie_weights},
          {"checkpoints_saved", saves},
          {"resumed", !args.resume.empty()},
      };
      summary.update(zero::detail::engine_figures(engine));
      zero::ckpt::write_file_atomically(args.summary_json, summary.dump(2) + "\n");
      std::fprintf(stderr, "mingpt: summary written to %s\n", args.summary_json.c_str());
    }
    return 0;
  } catch (const zero::runs::Interrupted& e) {
    std::cerr << "mingpt: " << e.what() << "; the search's runs are ended and their files removed\n";
    return 128 + e.signal();
  } catch (const zero::OutOfMemoryError& e) {
    std::cerr << "mingpt: " << zero::error_text(e) << "\n";
    return kOutOfMemoryStatus;
  } catch (const c10::OutOfMemoryError& e) {
    std::cerr << "mingpt: out of memory on the device: " << zero::error_text(e) << "\n";
    return kOutOfMemoryStatus;
  } catch (const zero::Error& e) {
    std::cerr << "mingpt: " << zero::error_text(e) << "\n";
    return 1;
  } catch (const std::exception& e) {
    // LibTorch's CPU allocator refusing memory is out of memory on the host.
    const std::string text = zero::error_text(e);
    if (text.find("DefaultCPUAllocator: not enough memory") != std::string::npos) {
      std::cerr << "mingpt: out of memory on the host: " << text << "\n";
      return kOutOfMemoryStatus;
    }
    std::cerr << "mingpt: " << text << "\n";
    return 1;
  }
}
