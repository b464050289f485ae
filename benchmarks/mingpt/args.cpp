// mingpt's command line (args.h).
#include "args.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <sstream>

#include "zero/core/command_files.h"
#include "zero/core/error.h"
#include "zero/core/text.h"
#include "zero/runs/runs.h"
#include "zero/snapshots/checkpoint_io.h"

namespace mingpt::cli {

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
                           writes the search's report (docs/mingpt.md, "The max-parameter benchmark")
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
                    bool below_max) {
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
    } else if (flag == "--lr") a.lr = parse_double(flag, value, 0, 1e3), a.lr_given = true;
    else if (flag == "--weight_decay") a.weight_decay = parse_double(flag, value, 0, 10), a.weight_decay_given = true;
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
  files.writes_environment_outputs();  // ZERO_TRACE, ZERO_RUN_REPORT: this rank's files
  if (const std::string problem = files.problem(); !problem.empty()) usage_error(problem);
  zero::CommandFiles::declare(files);  // the engine checks them again at initialize
}

}  // namespace mingpt::cli
