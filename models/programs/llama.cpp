// llama: a Llama-family model (models/, zero/models/llama.h) through zero.
//   llama logits --model HF_DIR --tokens 1,2,3 --out FILE.safetensors   one sequence's logits
//   llama train --model HF_DIR --config ds.json --data TOKENS.bin ...    training on any number of ranks
#include <sys/stat.h>

#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/nn/functional/loss.h>

#include "token_data.h"
#include "zero/core/command_files.h"
#include "zero/core/crash_report.h"
#include "zero/core/progress.h"
#include "zero/core/text.h"
#include "zero/models/llama.h"
#include "zero/snapshots/checkpoint_format.h"
#include "zero/snapshots/checkpoint_io.h"
#include "zero/snapshots/hf_export.h"
#include "zero/runtime/engine_internal.h"
#include "zero/runtime/run_summary.h"
#include "zero/zero.h"

namespace {

using Json = nlohmann::json;

const char* kUsage = R"(usage: llama COMMAND [options]

  logits --model HF_DIR --tokens 1,2,3,... --out FILE.safetensors [--precision 32|bf16] [--config ds.json]
         [--device-memory B --host-memory B --nvme-bytes B] [--lora R --lora_alpha A --lora_targets LIST]
      The logits of one sequence (tensor "logits", [T, vocab_size], fp32) of
      the model in HF_DIR (its config.json and weights: model.safetensors or
      shards with model.safetensors.index.json). --config: a DeepSpeed config
      to run it with (default: stage 0, one process). --lora: the model has
      LoRA adapters (an export of llama train --lora without --merge_lora),
      run unmerged.
  train --model HF_DIR --config ds_config.json --data TOKENS.bin --steps N [options]
      Trains the model of HF_DIR (its weights if the folder has them, else a
      fresh initialisation from --seed) on a flat file of token ids, on any
      number of ranks (zero launch, torchrun): each optimizer step takes the
      next global batch of windows of the file, each rank its slice.
        --dtype uint16|uint32   the token ids' width (default uint16)
        --block_size T          tokens per sample (default 256)
        --batch_size B          micro-batch per rank; fills "auto" (default 8)
        --lr X                  fills "auto" lr, and is --optimizer's (default 3e-4)
        --weight_decay X        fills "auto" weight_decay, and is --optimizer's (default 0.1)
        --optimizer NAME        adamw, adam or adagrad: the program's own torch::optim optimizer,
                                passed as a DeepSpeed client optimizer; used when the config has no
                                optimizer section (default adamw then; a config's section wins,
                                with a warning)
        --precision 32|16|bf16  fills "auto" fp16/bf16 (default: as the config says)
        --seed N                initialisation without weights (default 42)
        --checkpoint            activation checkpointing of every decoder layer
        --decay_all             weight decay on every parameter (default: none on the norms and
                                the embedding, a parameter group of their own)
        --save_dir DIR --save_every N   engine checkpoints (every N steps and at the end)
        --resume DIR            continue from DIR's latest checkpoint (any world size, the same global batch)
        --save_hf OUT_DIR       at the end, the weights as transformers loads them, and config.json
        --lora R                LoRA adapters of rank R (PEFT's init); the rest of the model is frozen
                                (partitioned at stage 3, no gradient or optimizer state)
        --lora_alpha A          LoRA's alpha: the adapters' output times A / R (default 8)
        --lora_dropout P        dropout on the adapters' input (default 0)
        --lora_targets LIST     the projections with adapters: q_proj,k_proj,v_proj,o_proj,gate_proj,
                                up_proj,down_proj, or all-linear (default q_proj,v_proj)
        --merge_lora            with --save_hf: the adapters folded into the weights (W + B A alpha / R),
                                a plain Llama transformers loads
        --trainable REGEX       only parameters whose names match train (with --lora: and the adapters)
        --freeze REGEX          parameters whose names match are frozen
        --save_frozen           checkpoints (--save_dir) keep the frozen parameters too; by default a
                                run with frozen parameters saves without them (exclude_frozen) and a
                                resume takes them from --model
        --summary-json FILE     the run's summary (rank 0)
        --device-memory B --host-memory B --nvme-bytes B   per-rank budgets (512MiB, 2GiB, 80e9), as mingpt's

Integers are decimal digits; each option is given once.
)";

[[noreturn]] void usage_error(const std::string& message) {
  std::cerr << "llama: " << message << "\n(run llama --help for the options)\n";
  std::exit(2);
}

// --flag value pairs (and bare flags in `bare`), each once, known ones only.
std::map<std::string, std::string> parse_flags(int argc, char** argv, int first, const std::vector<std::string>& known,
                                               const std::set<std::string>& bare) {
  std::map<std::string, std::string> out;
  for (int i = first; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (std::find(known.begin(), known.end(), flag) == known.end()) {
      const auto near = zero::nearest(flag, known);
      usage_error(flag + ": unknown option" + (near.empty() ? "" : "; did you mean " + near + "?"));
    }
    std::string value = "1";
    if (!bare.count(flag)) {
      if (i + 1 >= argc) usage_error(flag + ": expected a value");
      value = argv[++i];
    }
    if (!out.emplace(flag, value).second) usage_error(flag + " given twice: give it once");
  }
  return out;
}

int64_t to_int(const std::string& flag, const std::string& v, int64_t lo, int64_t hi) {
  int64_t x = 0;
  const auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (v.empty() || ec != std::errc() || p != v.data() + v.size() || x < lo || x > hi)
    usage_error(flag + ": expected an integer in " + std::to_string(lo) + ".." + std::to_string(hi) + "; got \"" + v + "\"");
  return x;
}

double to_double(const std::string& flag, const std::string& v, double lo, double hi) {
  try {
    size_t used = 0;
    const double d = std::stod(v, &used);
    if (used == v.size() && std::isfinite(d) && d >= lo && d <= hi) return d;
  } catch (const std::exception&) {
  }
  usage_error(flag + ": expected a number in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]; got \"" + v + "\"");
}

// --lora R [--lora_alpha A] [--lora_dropout P] [--lora_targets LIST]
// [--merge_lora]: the adapters, checked against `model` when given.
zero::models::LoraConfig lora_flags(std::map<std::string, std::string>& f,
                                    const std::optional<zero::models::LlamaConfig>& model) {
  zero::models::LoraConfig lora;
  if (f.count("--lora")) lora.r = to_int("--lora", f["--lora"], 1, 1 << 20);
  if (f.count("--lora_alpha")) lora.alpha = to_double("--lora_alpha", f["--lora_alpha"], 1e-9, 1e9);
  if (f.count("--lora_dropout")) lora.dropout = to_double("--lora_dropout", f["--lora_dropout"], 0, 0.999);
  if (f.count("--lora_targets")) {
    lora.target_modules.clear();
    std::stringstream ss(f["--lora_targets"]);
    for (std::string item; std::getline(ss, item, ',');) lora.target_modules.push_back(item);
  }
  for (const char* needs : {"--lora_alpha", "--lora_dropout", "--lora_targets", "--merge_lora"})
    if (f.count(needs) && !lora.enabled()) usage_error(std::string(needs) + " goes with --lora R");
  if (model && lora.enabled()) lora.check(*model, "--lora", '_');
  return lora;
}

// VmHWM or VmRSS of this process, bytes.
int64_t proc_bytes(const char* key) {
  std::ifstream in("/proc/self/status");
  const std::string k = std::string(key) + ":";
  for (std::string line; std::getline(in, line);)
    if (line.rfind(k, 0) == 0) return std::stoll(line.substr(k.size())) * 1024;
  return -1;
}

// --device-memory / --host-memory / --nvme-bytes: per-rank budgets, as mingpt's.
void apply_budgets(std::map<std::string, std::string>& f, zero::InitOptions& opts) {
  for (const char* flag : {"--device-memory", "--host-memory", "--nvme-bytes"}) {
    if (!f.count(flag)) continue;
    const auto n = zero::parse_byte_size(f[flag]);
    if (!n) usage_error(std::string(flag) + ": expected a byte count such as 512MiB, 2GiB or 80e9; got \"" + f[flag] + "\"");
    (std::string(flag) == "--device-memory" ? opts.device_memory_limit_bytes
     : std::string(flag) == "--host-memory" ? opts.host_memory_limit_bytes
                                            : opts.nvme_limit_bytes) = *n;
  }
}

// load_weights with what it cost this rank: bytes read, and how far the
// process's peak resident memory rose (a rank reads its own shards' bytes).
// The peak is reset first ("5" to /proc/self/clear_refs, Linux 4.0+), so an
// earlier peak (building the model) cannot hide the load's; where the
// kernel refuses, the rise is measured above the earlier peak and says so.
void load_reporting(zero::Engine& engine, const std::string& model, bool lora = false) {
  bool reset = false;
  if (std::FILE* f = std::fopen("/proc/self/clear_refs", "w")) {
    reset = std::fputs("5", f) >= 0;
    reset = std::fclose(f) == 0 && reset;
  }
  const int64_t rss = proc_bytes("VmRSS"), hwm = proc_bytes("VmHWM");
  zero::LoadWeightsOptions o;
  if (lora) o.keep_missing = [](const std::string& name) { return zero::models::is_lora_parameter(name); };  // fresh adapters
  const auto st = engine.load_weights(model, o);
  const int64_t rise = std::max<int64_t>(0, proc_bytes("VmHWM") - (reset ? rss : std::max(rss, hwm)));
  std::fprintf(stderr, "llama: load_weights %s: this rank read %lld bytes in %.2f s; its peak resident memory rose %lld bytes%s\n",
               model.c_str(), static_cast<long long>(st.bytes), st.seconds, static_cast<long long>(rise),
               reset ? "" : " above the process's earlier peak (the kernel did not reset the peak)");
}

// --model names a Hugging Face folder, or a config.json in one: the folder
// holds the weights either way.
std::string model_folder(const std::string& model) {
  if (zero::ckpt::is_folder(model)) return model;
  const auto slash = model.find_last_of('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : model.substr(0, slash);
}

std::string model_config_path(const std::string& model) {
  return zero::ckpt::is_folder(model) ? model + "/config.json" : model;
}

// config.json for --save_hf: the input's (read when the run starts), every
// key kept (bos/eos/pad token ids, generation settings, keys this program
// does not read), with its dtype key ("dtype" in transformers 5,
// "torch_dtype" before) set to what the weights were saved in.
std::string saved_config(const std::string& input_text, at::ScalarType saved) {
  Json j = Json::parse(input_text, nullptr, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  const char* name = saved == at::kBFloat16 ? "bfloat16" : saved == at::kHalf ? "float16" : "float32";
  bool set = false;
  for (const char* key : {"dtype", "torch_dtype"})
    if (j.contains(key)) j[key] = name, set = true;
  if (!set) j["dtype"] = name;
  return j.dump(2) + "\n";
}

// Whether DIR has safetensors weights; weights only in torch's pickle
// format (pytorch_model.bin, its shards, *.pt) are refused rather than
// passed over for a fresh initialisation.
bool has_weights(const std::string& model) {
  const std::string dir = model_folder(model);
  // A weights file that is there but cannot be read as one (a dangling link,
  // a link loop, a folder) is named, not taken for no weights.
  for (const char* name : {"/model.safetensors", "/model.safetensors.index.json"})
    if (zero::ckpt::path_exists(dir + name)) {
      if (const std::string problem = zero::input_file_problem("--model's weights", dir + name); !problem.empty())
        usage_error(problem);
      return true;
    }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return false;
  for (const auto& name : zero::ckpt::list_folder(dir)) {
    const auto dot = name.rfind('.');
    const std::string ext = dot == std::string::npos ? "" : name.substr(dot);
    if ((ext == ".bin" && name.rfind("pytorch_model", 0) == 0) || ext == ".pt" || ext == ".pth")
      usage_error("--model " + dir + ": its weights are in torch's pickle format (" + name + "), which this program does "
                  "not read; save them as safetensors first (in Python: AutoModelForCausalLM.from_pretrained(DIR)"
                  ".save_pretrained(OUT, safe_serialization=True))");
  }
  return false;
}

// What --model reads (NOTE [outputs and inputs]): its config.json and the
// weights load_weights takes (the index and the shards it names).
void add_model_inputs(zero::CommandFiles& files, const std::string& model) {
  files.reads("--model's config.json", model_config_path(model));
  if (!has_weights(model)) return;
  try {
    const auto w = zero::ckpt::WeightFiles::resolve(model_folder(model));
    if (!w.index.empty()) files.reads("--model's weight index", w.index);
    for (const auto& file : w.files) files.reads("--model's weights", file);
  } catch (const zero::IoError&) {  // the load says what is wrong with them
    files.reads_folder("--model", model_folder(model));
  }
}

std::string precision_config(const std::string& precision) {
  if (precision == "bf16") return R"(, "bf16": {"enabled": true})";
  if (precision == "16") return R"(, "fp16": {"enabled": true})";
  return "";
}

int logits_command(int argc, char** argv) {
  auto f = parse_flags(argc, argv, 2,
                       {"--model", "--tokens", "--out", "--precision", "--config", "--device-memory", "--host-memory",
                        "--nvme-bytes", "--lora", "--lora_alpha", "--lora_targets"},
                       {});
  for (const char* need : {"--model", "--tokens", "--out"})
    if (!f.count(need)) usage_error(std::string("logits: ") + need + " is required");
  const std::string precision = f.count("--precision") ? f["--precision"] : "32";
  if (precision != "32" && precision != "bf16") usage_error("--precision: expected 32 or bf16; got \"" + precision + "\"");
  std::vector<int64_t> ids;
  std::stringstream ss(f["--tokens"]);
  for (std::string item; std::getline(ss, item, ',');) ids.push_back(to_int("--tokens", item, 0, int64_t{1} << 40));
  if (ids.empty()) usage_error("--tokens: expected token ids such as 1,2,3");
  if (const auto problem = zero::ckpt::output_file_problem("--out", f["--out"]); !problem.empty()) usage_error(problem);
  std::string config_path;
  if (f.count("--config")) config_path = zero::config_file_argument("--config", f["--config"]);
  {
    zero::CommandFiles files;  // NOTE [outputs and inputs]
    if (!config_path.empty()) files.reads("--config", config_path);
    add_model_inputs(files, f["--model"]);
    files.writes("--out", f["--out"]);
    files.writes_environment_outputs();
    if (const auto problem = files.problem(); !problem.empty()) usage_error(problem);
    zero::CommandFiles::declare(files);
  }

  const auto cfg = zero::models::LlamaConfig::from_file(f["--model"]);
  const auto lora = lora_flags(f, cfg);  // an unmerged LoRA export's adapters
  for (int64_t id : ids)
    if (id >= cfg.vocab_size)
      usage_error("--tokens: " + std::to_string(id) + " is not below the model's vocab_size " + std::to_string(cfg.vocab_size));
  if (static_cast<int64_t>(ids.size()) > cfg.max_position_embeddings)
    usage_error("--tokens: " + std::to_string(ids.size()) + " tokens, more than max_position_embeddings " +
                std::to_string(cfg.max_position_embeddings));
  const std::string ds = !config_path.empty() ? config_path
                                              : R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW",
                                                  "params": {"lr": 0.0}})" + precision_config(precision) + "}";
  zero::InitOptions opts;
  opts.print_progress = false;
  apply_budgets(f, opts);
  opts.auto_values.train_micro_batch_size_per_gpu = 1;
  opts.auto_values.precision = precision == "bf16" ? "bf16" : "fp32";
  // A training config's other "auto" values: logits take no step, so any
  // value is right; these are the ones that change nothing.
  opts.auto_values.gradient_accumulation_steps = 1;
  opts.auto_values.lr = 0.0;
  opts.auto_values.weight_decay = 0.0;
  opts.auto_values.gradient_clipping = 1.0;
  opts.auto_values.total_num_steps = 1;
  opts.auto_values.warmup_num_steps = 1;
  opts.auto_values.hidden_size = cfg.hidden_size;
  std::unique_ptr<zero::Init> init;
  zero::config::LoadOptions lo;
  lo.world_size = zero::DistEnv::from_environment().world_size;
  lo.auto_values = opts.auto_values;
  const auto resolved =
      config_path.empty() ? zero::config::load_string(ds, lo, "the default config") : zero::config::load_file(ds, lo);
  if (resolved.zero.stage == 3) init = std::make_unique<zero::Init>(ds, opts);
  zero::models::LlamaForCausalLM model(cfg, init.get(), lora);
  opts.layers = model->stage3_layers();
  // A config without an optimizer section (a trainer's): an optimizer that
  // never steps, so that the engine can be built (NOTE [client optimizer]).
  std::unique_ptr<torch::optim::Optimizer> client;
  if (!resolved.optimizer) client = zero::detail::program_optimizer("--config", "adamw", {{model->parameters(), 0.0}}, 0.0);
  opts.optimizer = client.get();
  auto engine = init ? zero::initialize(model.ptr(), *init, model->stage3_layers(), client.get())
                     : zero::initialize(model.ptr(), ds, opts);
  if (!has_weights(f["--model"]))
    usage_error("--model " + f["--model"] + ": no weights in " + model_folder(f["--model"]) +
                " (model.safetensors or its index)");
  load_reporting(engine, model_folder(f["--model"]));
  model->eval();
  torch::NoGradGuard no_grad;
  const auto x = torch::tensor(ids, torch::kLong).unsqueeze(0).to(engine.device());
  const auto logits = model->forward(x).squeeze(0).to(torch::kFloat).cpu().contiguous();
  if (engine.rank() == 0) {
    zero::ckpt::Layout layout;
    layout.tensors.push_back({"logits", at::kFloat, logits.sizes().vec()});
    layout.metadata = {{"format", "pt"}};
    zero::offload::AioEngine aio(zero::offload::AioOptions{});
    zero::ckpt::TensorFileWriter w(f["--out"], layout, aio);
    w.append(0, logits);
    w.commit("");
    std::fprintf(stderr, "llama: logits [%lld, %lld] of %s written to %s\n", static_cast<long long>(logits.size(0)),
                 static_cast<long long>(logits.size(1)), f["--model"].c_str(), f["--out"].c_str());
  }
  return 0;
}

int train_command(int argc, char** argv) {
  auto f = parse_flags(argc, argv, 2,
                       {"--model", "--config", "--data", "--dtype", "--block_size", "--batch_size", "--steps", "--lr",
                        "--weight_decay", "--precision", "--seed", "--checkpoint", "--save_dir", "--save_every",
                        "--resume", "--save_hf", "--summary-json", "--decay_all", "--device-memory", "--host-memory",
                        "--nvme-bytes", "--optimizer", "--lora", "--lora_alpha", "--lora_dropout", "--lora_targets",
                        "--merge_lora", "--trainable", "--freeze", "--save_frozen"},
                       {"--checkpoint", "--decay_all", "--merge_lora", "--save_frozen"});
  for (const char* need : {"--model", "--config", "--data", "--steps"})
    if (!f.count(need)) usage_error(std::string("train: ") + need + " is required");
  if (f.count("--optimizer") && f["--optimizer"] != "adamw" && f["--optimizer"] != "adam" && f["--optimizer"] != "adagrad")
    usage_error("--optimizer: expected adamw, adam or adagrad; got \"" + f["--optimizer"] + "\"");
  const std::string dtype = f.count("--dtype") ? f["--dtype"] : "uint16";
  if (dtype != "uint16" && dtype != "uint32") usage_error("--dtype: expected uint16 or uint32; got \"" + dtype + "\"");
  const int64_t T = f.count("--block_size") ? to_int("--block_size", f["--block_size"], 1, 1 << 20) : 256;
  const int64_t B = f.count("--batch_size") ? to_int("--batch_size", f["--batch_size"], 1, 1 << 20) : 8;
  const int64_t steps = to_int("--steps", f["--steps"], 1, int64_t{1} << 40);
  const double lr = f.count("--lr") ? to_double("--lr", f["--lr"], 0, 10) : 3e-4;
  const double wd = f.count("--weight_decay") ? to_double("--weight_decay", f["--weight_decay"], 0, 10) : 0.1;
  const uint64_t seed = f.count("--seed") ? static_cast<uint64_t>(to_int("--seed", f["--seed"], 0, int64_t{1} << 62)) : 42;
  const int64_t save_every = f.count("--save_every") ? to_int("--save_every", f["--save_every"], 1, int64_t{1} << 40) : 0;
  if (save_every > 0 && !f.count("--save_dir")) usage_error("--save_every needs --save_dir DIR");
  std::optional<std::string> precision;
  if (f.count("--precision")) {
    precision = f["--precision"];
    if (*precision != "32" && *precision != "16" && *precision != "bf16")
      usage_error("--precision: expected 32, 16 or bf16; got \"" + *precision + "\"");
  }

  // NOTE [frozen groups]: LoRA freezes everything but the adapters; --trainable
  // and --freeze choose by name (decided as each layer is built).
  const auto lora = lora_flags(f, std::nullopt);
  if (f.count("--merge_lora") && !f.count("--save_hf")) usage_error("--merge_lora goes with --save_hf OUT_DIR");
  zero::InitOptions opts;
  std::function<bool(const std::string&)> trainable_re, frozen_re;
  for (const char* flag : {"--trainable", "--freeze"}) {
    if (!f.count(flag)) continue;
    try {
      (std::string(flag) == "--trainable" ? trainable_re : frozen_re) =
          std::string(flag) == "--trainable" ? zero::trainable_matching({f[flag]}) : zero::frozen_matching({f[flag]});
    } catch (const zero::ConfigError& e) {
      usage_error(std::string(flag) + " " + f[flag] + ": not a regular expression (" + e.what() + ")");
    }
  }
  if (trainable_re || frozen_re) {
    opts.trainable = [trainable_re, frozen_re, with_lora = lora.enabled()](const std::string& name) {
      if (with_lora && zero::models::is_lora_parameter(name)) return !frozen_re || frozen_re(name);
      bool t = trainable_re ? trainable_re(name) : !with_lora;
      if (frozen_re && !frozen_re(name)) t = false;
      return t;
    };
  }
  apply_budgets(f, opts);
  opts.dist = zero::DistEnv::from_environment();
  opts.program_ends_at_stop = true;  // the loop asks engine.stop_requested()
  const int rank0 = opts.dist->rank == 0;
  const std::string config_path = zero::config_file_argument("--config", f["--config"]);
  // Outputs are checked before any step: none over an input (NOTE [outputs
  // and inputs]), each writable. Rank 0 writes the summary and --save_hf;
  // every rank writes its part of a checkpoint, so each node's first rank
  // checks --save_dir.
  {
    zero::CommandFiles files;
    files.reads("--config", config_path);
    files.reads("--data", f["--data"]);
    add_model_inputs(files, f["--model"]);
    if (f.count("--resume")) zero::ckpt::add_resume_inputs(files, "--resume", f["--resume"]);
    if (f.count("--summary-json")) files.writes("--summary-json", f["--summary-json"]);
    if (f.count("--save_hf")) files.writes_folder("--save_hf", f["--save_hf"]);
    if (f.count("--save_dir")) files.adds_to_folder("--save_dir", f["--save_dir"]);
    files.writes_environment_outputs(opts.dist->rank, opts.dist->world_size);
    if (const auto p = files.problem(); !p.empty()) usage_error(p);
    zero::CommandFiles::declare(files);  // the engine checks them again at initialize
  }
  if (rank0) {
    if (f.count("--summary-json"))
      if (const auto p = zero::ckpt::output_file_problem("--summary-json", f["--summary-json"]); !p.empty()) usage_error(p);
    if (f.count("--save_hf"))
      if (const auto p = zero::ckpt::HfWriter::folder_problem("--save_hf", f["--save_hf"], /*with_config=*/true);
          !p.empty())
        usage_error(p);
  }
  if (f.count("--save_dir") && opts.dist->local_rank == 0)
    if (const auto p = zero::ckpt::checkpoint_folder_problem("--save_dir", f["--save_dir"]); !p.empty())
      usage_error(rank0 ? p : "rank " + std::to_string(opts.dist->rank) + ": " + p);
  const auto cfg = zero::models::LlamaConfig::from_file(f["--model"]);
  if (lora.enabled()) lora.check(cfg, "--lora", '_');
  // Read now, not after training: the export's config.json is the input's.
  const std::string input_config_text =
      f.count("--save_hf") ? zero::ckpt::read_small_file(model_config_path(f["--model"])) : std::string();
  if (T > cfg.max_position_embeddings)
    usage_error("--block_size " + std::to_string(T) + ": more than the model's max_position_embeddings " +
                std::to_string(cfg.max_position_embeddings) + " (" + model_config_path(f["--model"]) +
                "): its positions past that were never trained; give --block_size " +
                std::to_string(cfg.max_position_embeddings) + " or less");
  const llama::TokenData data(f["--data"], dtype == "uint16" ? 2 : 4, T);
  opts.auto_values.train_micro_batch_size_per_gpu = B;
  opts.auto_values.gradient_accumulation_steps = 1;
  opts.auto_values.lr = lr;
  opts.auto_values.weight_decay = wd;
  for (const char* flag : {"--lr", "--weight_decay"})  // NOTE [config warnings]: unused where the config fixes them
    if (f.count(flag)) opts.auto_value_flags[std::string(flag).substr(2)] = flag;
  opts.auto_values.gradient_clipping = 1.0;
  opts.auto_values.total_num_steps = steps;
  opts.auto_values.warmup_num_steps = std::max<int64_t>(1, steps / 20);
  opts.auto_values.hidden_size = cfg.hidden_size;
  opts.auto_values.precision = !precision || *precision == "32" ? "fp32" : *precision == "16" ? "fp16" : "bf16";
  opts.tokens_per_sample = T;
  zero::config::LoadOptions lo;
  lo.world_size = opts.dist->world_size;
  lo.auto_values = opts.auto_values;
  lo.auto_hint = zero::detail::program_auto_hint("llama");
  const auto resolved = zero::config::load_file(config_path, lo);
  // The program's own optimizer where the config has none (NOTE [client
  // optimizer]); with --optimizer and a config section, the config's wins.
  const bool client_only = !resolved.optimizer.has_value();
  // The usual recipe: no weight decay on the norms and the embedding (the
  // client optimizer's groups when it is the one used).
  std::shared_ptr<zero::models::LlamaForCausalLMImpl> groups_of;  // the model, once built
  if (!f.count("--decay_all") && !client_only) {
    zero::ParamGroup no_decay;
    no_decay.name = "no_decay";
    no_decay.weight_decay = 0.0;
    no_decay.match = [&groups_of](const std::string& name, const torch::Tensor&) { return groups_of->no_decay(name); };
    opts.param_groups.push_back(no_decay);
  }
  // What trains, from the architecture (a model built under Init holds shards only).
  int64_t trainable_numel = 0, frozen_numel = 0;
  for (const auto& q : zero::models::llama_parameters(cfg, lora))
    ((opts.trainable ? opts.trainable(q.name) : !q.frozen) ? trainable_numel : frozen_numel) += q.numel;
  if (trainable_numel == 0)
    usage_error(std::string("no parameter trains:") +
                (f.count("--trainable") ? " --trainable " + f["--trainable"] + " matches none" : "") +
                (f.count("--freeze") ? " --freeze " + f["--freeze"] + " matches them all" : ""));
  std::unique_ptr<zero::Init> init;
  if (resolved.zero.stage == 3) init = std::make_unique<zero::Init>(config_path, opts);
  torch::manual_seed(seed);
  zero::models::LlamaForCausalLM model(cfg, init.get(), lora);
  groups_of = model.ptr();
  if (opts.trainable && !init)  // (under Init each layer was decided as it was built)
    for (const auto& item : model->named_parameters(true)) item.value().requires_grad_(opts.trainable(item.key()));
  opts.layers = model->stage3_layers();
  std::unique_ptr<torch::optim::Optimizer> client;
  if (client_only || f.count("--optimizer")) {
    std::vector<torch::Tensor> decay, no_decay;
    for (const auto& item : model->named_parameters(true))
      if (item.value().requires_grad())
        (!f.count("--decay_all") && model->no_decay(item.key()) ? no_decay : decay).push_back(item.value());
    client = zero::detail::program_optimizer("--optimizer", f.count("--optimizer") ? f["--optimizer"] : "adamw",
                                             {{decay, wd}, {no_decay, 0.0}}, lr);
  }
  opts.optimizer = client.get();
  auto engine = init ? zero::initialize(model.ptr(), *init, model->stage3_layers(), client.get())
                     : zero::initialize(model.ptr(), config_path, opts);
  if (f.count("--save_hf"))  // the config's part (stage 3's gather key): before training, not after
    if (const auto p = engine.save_hf_problem("--save_hf", f["--save_hf"], /*with_config=*/true); !p.empty())
      usage_error(p);
  const auto& batch = engine.config().batch;
  if (batch.train_micro_batch_size_per_gpu != B && f.count("--batch_size"))
    usage_error("--batch_size " + std::to_string(B) + " conflicts with " + f["--config"] + " (train_micro_batch_size_per_gpu " +
                std::to_string(batch.train_micro_batch_size_per_gpu) + ")");
  const int64_t mbs = batch.train_micro_batch_size_per_gpu, gas = batch.gradient_accumulation_steps;
  const int64_t ws = engine.world_size(), rank = engine.rank(), G = batch.train_batch_size;
  if (f.count("--checkpoint")) model->set_checkpointer(&engine.checkpointer());
  if (f.count("--save_dir")) engine.open_checkpoint_dir(f["--save_dir"]);
  if (has_weights(f["--model"])) {
    load_reporting(engine, model_folder(f["--model"]), lora.enabled());
  } else if (rank0) {
    std::fprintf(stderr, "llama: %s has no weights: the model starts from a fresh initialisation (--seed %llu)\n",
                 model_folder(f["--model"]).c_str(), static_cast<unsigned long long>(seed));
  }
  int64_t start = 0;
  if (f.count("--resume")) {
    const auto st = engine.load_checkpoint(f["--resume"]);
    const auto client = Json::parse(st.client_state);
    if (!client.contains("step") || client.value("train_batch_size", int64_t{0}) != G ||
        client.value("block_size", int64_t{0}) != T)
      usage_error("--resume " + f["--resume"] + ": " + st.dir + "/" + st.tag + " was saved by another run (its data position " +
                  "counts global batches of " + client.value("train_batch_size", Json(nullptr)).dump() + " samples of " +
                  client.value("block_size", Json(nullptr)).dump() + " tokens; this run has " + std::to_string(G) + " of " +
                  std::to_string(T) + ")");
    start = client.at("step").get<int64_t>();
    if (start > steps)
      usage_error("--steps " + std::to_string(steps) + ": " + st.dir + "/" + st.tag + " is at step " + std::to_string(start) +
                  " already (--steps counts from the start of the run, not from the resume)");
    if (rank0) std::fprintf(stderr, "llama: resumed from %s/%s at step %lld\n", st.dir.c_str(), st.tag.c_str(),
                            static_cast<long long>(start));
  }
  if (rank0 && frozen_numel > 0)
    std::fprintf(stderr, "llama: %lld parameters train, %lld are frozen%s\n", static_cast<long long>(trainable_numel),
                 static_cast<long long>(frozen_numel),
                 lora.enabled() ? (" (LoRA r=" + std::to_string(lora.r) + ")").c_str() : "");
  if (rank0)
    std::fprintf(stderr,
                 "llama: %lld parameters (%lld layers, hidden %lld, %lld heads / %lld kv) | ZeRO stage %d | %s | "
                 "global batch %lld = %lld x %lld x %lld ranks of %lld tokens | %lld tokens of data\n",
                 static_cast<long long>(engine.num_parameters()), static_cast<long long>(cfg.num_hidden_layers),
                 static_cast<long long>(cfg.hidden_size), static_cast<long long>(cfg.num_attention_heads),
                 static_cast<long long>(cfg.num_key_value_heads), engine.config().zero.stage,
                 engine.device().str().c_str(), static_cast<long long>(G), static_cast<long long>(mbs),
                 static_cast<long long>(gas), static_cast<long long>(ws), static_cast<long long>(T),
                 static_cast<long long>(data.tokens()));

  auto save = [&](int64_t step) {
    const Json client = {{"step", step}, {"train_batch_size", G}, {"block_size", T}, {"data", f["--data"]}};
    zero::SaveCheckpointOptions so;
    so.exclude_frozen = frozen_numel > 0 && !f.count("--save_frozen");
    const auto st = engine.save_checkpoint(f["--save_dir"], "", client.dump(), so);
    if (rank0) std::fprintf(stderr, "\nllama: saved %s/%s\n", st.dir.c_str(), st.tag.c_str());
  };
  std::vector<double> loss_curve, step_times;
  std::optional<zero::ProgressLine> progress;
  if (rank0) progress.emplace("train", steps - start, "steps");
  model->train();
  int64_t last_saved = f.count("--resume") ? start : -1;
  int64_t last_step = steps;  // where the run ends (ZERO_STOP_AFTER_STEPS may end it sooner)
  for (int64_t step = start; step < steps; ++step) {
    if (engine.stop_requested()) {  // a tool's run (NOTE [run report]): the end below still runs
      last_step = step;
      if (rank0) std::fprintf(stderr, "\nllama: stopped after step %lld (ZERO_STOP_AFTER_STEPS)\n", static_cast<long long>(step));
      break;
    }
    const auto t0 = std::chrono::steady_clock::now();
    torch::Tensor step_loss = torch::zeros({}, torch::kFloat);
    for (int64_t a = 0; a < gas; ++a) {
      const auto s = data.samples(step * G + (a * ws + rank) * mbs, mbs, cfg.vocab_size).to(engine.device());
      const auto x = s.narrow(1, 0, T), y = s.narrow(1, 1, T);
      if (step == start && a == 0) engine.check_batch(x);
      const auto logits = model->forward(x);
      const auto loss = torch::nn::functional::cross_entropy(logits.to(torch::kFloat).reshape({-1, cfg.vocab_size}),
                                                             y.reshape({-1}));
      step_loss += loss.detach().cpu() / static_cast<double>(gas);
      engine.backward(loss);
      engine.step();
    }
    const double l = engine.all_reduce_mean(step_loss).item<double>();
    loss_curve.push_back(l);
    step_times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    if (progress) {
      char note[64];
      std::snprintf(note, sizeof note, "loss %.4f", l);
      progress->update(step + 1 - start, note);
    }
    if (save_every > 0 && (step + 1) % save_every == 0) save(step + 1), last_saved = step + 1;
  }
  if (progress) progress->finish();
  if (f.count("--save_dir") && last_saved != last_step) save(last_step);
  if (f.count("--save_hf")) {
    zero::SaveHfOptions o;
    o.config_json = saved_config(input_config_text, engine.compute_dtype());
    if (f.count("--merge_lora")) o.lora_scaling = lora.scaling();
    engine.save_hf(f["--save_hf"], o);
    if (rank0) std::fprintf(stderr, "llama: weights and config.json written to %s\n", f["--save_hf"].c_str());
  }
  const auto ranks = zero::detail::rank_figures(engine);
  const double param_l2 = engine.parameter_l2();
  if (!rank0) return 0;
  std::cerr << engine.memory_summary();
  if (f.count("--summary-json")) {
    Json summary = {{"model", f["--model"]},
                          {"world_size", ws},
                          {"zero_stage", engine.config().zero.stage},
                          {"precision", zero::ckpt::dtype_name(engine.compute_dtype())},
                          {"device", engine.device().str()},
                          {"num_parameters", engine.num_parameters()},
                          {"trainable_parameters", trainable_numel},
                          {"frozen_parameters", frozen_numel},
                          {"steps", engine.global_steps()},
                          {"skipped_steps", engine.skipped_steps()},
                          {"final_loss", loss_curve.empty() ? NAN : loss_curve.back()},
                          {"loss_curve", loss_curve},
                          {"param_l2", param_l2},
                          {"step_time_s", step_times},
                          {"tokens_per_step", G * T},
                          {"peak_bytes", zero::detail::max_peaks(ranks)},
                          {"collective_bytes_per_step", zero::detail::traffic_per_step(ranks)},
                          {"model_state_bytes", ranks.at(0).at("model_state_bytes")},
                          {"ranks", ranks},
                          {"resumed", f.count("--resume") > 0}};
    summary.update(zero::detail::engine_figures(engine));
    zero::ckpt::write_file_atomically(f["--summary-json"], summary.dump(2) + "\n");
    std::fprintf(stderr, "llama: summary written to %s\n", f["--summary-json"].c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  zero::install_crash_reporter("llama");  // NOTE [crash report]
  if (argc < 2 || std::string(argv[1]) == "-h" || std::string(argv[1]) == "--help") {
    std::cout << kUsage;
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  try {
    if (command == "logits") return logits_command(argc, argv);
    if (command == "train") return train_command(argc, argv);
  } catch (const zero::OutOfMemoryError& e) {
    std::cerr << "llama: " << zero::error_text(e) << "\n";
    return 3;
  } catch (const c10::OutOfMemoryError& e) {  // the CUDA caching allocator's: out of memory too
    std::cerr << "llama: out of memory on the device: " << zero::error_text(e) << "\n";
    return 3;
  } catch (const std::exception& e) {
    std::cerr << "llama: " << zero::error_text(e) << "\n";
    return 1;
  }
  const auto near = zero::nearest(command, {"logits", "train"});
  usage_error("unknown command \"" + command + "\"" + (near.empty() ? "" : "; did you mean " + near + "?"));
}
