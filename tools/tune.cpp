// zero tune: the fastest ZeRO config that fits a model and per-rank memory
// budgets, chosen by the estimator and short training runs on real ranks:
// the user's own program (`-- PROGRAM ARGS`, `{config}` in ARGS replaced by
// each candidate's config) or minGPT (`--model mingpt:L,C`).
//
// NOTE [config tuner]
// The grid: each ZeRO setup of DeepSpeed's estimator tables (stage 0-3, the
// optimizer states and at stage 3 the parameters offloaded to the CPU or to
// NVMe), activation checkpointing (none, every block, every block with
// cpu_checkpointing), micro-batches and bucket sizes (reduce/allgather
// buckets; at stage 3 the prefetch bucket, twice that live). Three steps:
//   1. fit: estimate_peak (NOTE [peak estimate]) of each candidate against
//      the budgets; those over one are dropped, never run.
//   2. prune: a candidate is dominated when another one that fits does no
//      more of the work that costs time (stage 3's gathers, offload to the
//      CPU, to NVMe, checkpointing's recomputation and copies) at a
//      micro-batch at least as large: the other is at least as fast per
//      token, so it is not run. Bucket sizes are left out of this (each
//      point takes the largest that fits) and tried on the winner.
//   3. measure: the frontier that is left, least work and largest
//      micro-batch first, each trained for a few optimizer steps (the
//      program, or mingpt on random tokens of the model's vocabulary and
//      context, through zero launch, with the budgets and the stop step in
//      its environment and its figures from the engine's run report: NOTE
//      [run report], zero/runs/runs.h); up to --trials runs. A run
//      out of memory (the estimate was short) is reported and skipped, and
//      the candidates it dominated come back into the frontier; one that
//      failed, or ran past --run-timeout (stopped: a hung run), ends its
//      point. Then the winner's other bucket sizes.
// A program's model is known from a first run of two steps at stage 3 with
// everything offloaded (ZERO_STOP_AFTER_STEPS=2, no budgets): its run report
// lists the parameters and layers, and its device peak less the estimated
// states and buffers of that config gives the activations per sample, which
// the candidates' estimates then take (as zero estimate --calibrate).
// The fastest measured (tokens per second, or samples per second when the
// program does not say its tokens per sample) is written as ds_config.json;
// --exhaustive measures every candidate that fits instead (the benchmark of
// the tuner: its choice against the fastest of the whole grid).
// On nodes (--nodes M): every run is M nodes of --ranks ranks, emulated on
// this machine (zero launch --emulate_nodes: each rank's node as its own
// launcher would give it), the budgets per rank. After the buckets, the
// winner is run with each key of more than one node that applies to its
// stage (comm_variants, tune_plan.h): mics_shard_size of a node at stages
// 2-3 (the model states partitioned within the node, replicated across),
// zero_hpz_partition_size of a node at stage 3, and with
// --allow-quantized-communication qwZ with each, and qwZ + hpZ + qgZ; each
// estimated first (MiCS holds a node's share of the states, hpZ a
// secondary partition). Loopback has no network: a run's step here prices
// no bytes across nodes, so with --inter-node-bandwidth B (each rank's: a
// NIC a GPU) the bytes that the busiest node's ranks send across nodes a
// step (the runs' own counters, NOTE [bytes across nodes]) at --ranks x B
// are added to its step, as if nothing overlapped them (a node's bytes, not
// a rank's: Gloo's ring puts them on one rank, NCCL spreads them over the
// node's NICs);
// without it the ranking is of this machine alone, and says so.
// Runs, configs, logs and swap files live in scratch folders (under $TMPDIR
// and under --nvme-path) that go when the tuner ends, Ctrl-C included.
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#include "bench.h"
#include "tune_plan.h"
#include "zero/runs/runs.h"
#include "zero/config/config.h"
#include "zero/core/command_files.h"
#include "zero/core/error.h"
#include "zero/core/process.h"
#include "zero/core/text.h"
#include "zero/snapshots/checkpoint_format.h"
#include "zero/runtime/estimate.h"

namespace zero::tools {
namespace {

std::string mib(int64_t b) { return format_bytes(b); }

std::string fixed(double x, int digits) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", digits, x);
  return buf;
}

}  // namespace

int tune(const std::vector<std::string>& args) {
  auto fail = [](const std::string& m) {
    std::cerr << "zero tune: " << m << "\n(zero tune --help for the options)\n";
    return 2;
  };
  Plan plan;
  std::optional<std::array<int64_t, 4>> model;
  std::optional<int64_t> device_budget, host_budget, nvme_budget, n_head;
  std::string config_path, out_path = "ds_config.json", json_path, trainer;
  std::optional<std::string> precision, device;
  std::vector<int64_t> micro_batches = {1, 2, 4, 8, 16, 32}, bucket_sizes;
  std::set<int> stages = {0, 1, 2, 3}, checkpointing = {0, 1};
  std::optional<std::set<int>> offload;
  int64_t trials = 8;
  double run_timeout = 600;
  std::optional<int64_t> bandwidth;
  bool exhaustive = false, oversubscribe = false, force = false;
  const std::vector<std::string> known = {
      "--model", "--n_head", "--device-memory", "--host-memory", "--nvme-path", "--nvme-bytes", "--ranks",
      "--config", "--precision", "--device", "--micro-batches", "--stages", "--offload", "--checkpointing",
      "--bucket-sizes", "--steps", "--trials", "--run-timeout", "--exhaustive", "--out", "--json", "--trainer",
      "--oversubscribe", "--allow-low-precision-states", "--force", "--ratios", "--gradients", "--nodes",
      "--inter-node-bandwidth", "--allow-quantized-communication"};
  std::set<std::string> seen;
  std::vector<std::string> program;
  bool checkpointing_given = false;
  size_t n_options = args.size();
  for (size_t i = 0; i < args.size(); ++i)
    if (args[i] == "--") {
      program.assign(args.begin() + static_cast<std::ptrdiff_t>(i) + 1, args.end());
      n_options = i;
      if (program.empty()) return fail("--: expected a program and its arguments after it");
      break;
    }
  for (size_t i = 0; i < n_options; ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      std::cout << kTuneUsage;
      return 0;
    }
    if (const std::string problem = option_problem(a, known, seen); !problem.empty()) return fail(problem);
    if (a == "--exhaustive" || a == "--oversubscribe" || a == "--force") {
      (a == "--exhaustive" ? exhaustive : a == "--force" ? force : oversubscribe) = true;
      continue;
    }
    if (a == "--allow-low-precision-states" || a == "--allow-quantized-communication") {
      (a == "--allow-low-precision-states" ? plan.low_precision_states : plan.quantized_communication) = true;
      continue;
    }
    if (i + 1 >= n_options) return fail(a + ": expected a value");
    const std::string& v = args[++i];
    if (a == "--model") {
      std::string error;
      model = parse_mingpt_model(v, error);
      if (!model) return fail(error);
    } else if (a == "--n_head") {
      n_head = parse_positive(v, 1 << 20);
      if (!n_head) return fail("--n_head: expected a positive integer; got \"" + v + "\"");
    } else if (a == "--device-memory" || a == "--host-memory" || a == "--nvme-bytes") {
      auto b = parse_byte_size(v);
      if (!b) return fail(a + ": expected a size such as 80GiB, 1.5e9 or 512MiB; got \"" + v + "\"");
      (a == "--device-memory" ? device_budget : a == "--host-memory" ? host_budget : nvme_budget) = *b;
    } else if (a == "--nvme-path") {
      plan.nvme_path = v;
    } else if (a == "--ranks" || a == "--steps" || a == "--trials" || a == "--nodes") {
      auto x = parse_positive(v, a == "--ranks" || a == "--nodes" ? 1024 : 1000);
      if (!x) return fail(a + ": expected a positive integer; got \"" + v + "\"");
      (a == "--ranks" ? plan.ranks : a == "--steps" ? plan.steps : a == "--nodes" ? plan.nodes : trials) = *x;
    } else if (a == "--inter-node-bandwidth") {
      bandwidth = parse_byte_size(v);
      if (!bandwidth || *bandwidth <= 0)
        return fail("--inter-node-bandwidth: expected bytes a second such as 25GB or 1.2e10; got \"" + v + "\"");
    } else if (a == "--run-timeout") {
      const auto x = parse_run_timeout(v);
      if (!x) return fail("--run-timeout: expected seconds, 0 to 1e7 (0: no limit); got \"" + v + "\"");
      run_timeout = *x;
    } else if (a == "--config") {
      try {
        config_path = config_file_argument("--config", v);
      } catch (const UsageError& e) {
        return fail(e.what());
      }
    } else if (a == "--precision") {
      if (v != "fp32" && v != "fp16" && v != "bf16") return fail("--precision: expected fp32, fp16 or bf16; got \"" + v + "\"");
      precision = v;
    } else if (a == "--device") {
      if (v != "cpu" && v != "cuda") return fail("--device: expected cpu or cuda; got \"" + v + "\"");
      device = v;
    } else if (a == "--micro-batches" || a == "--bucket-sizes") {
      auto items = split_list(v);
      if (!items) return fail(a + ": expected a comma-separated list; got \"" + v + "\"");
      auto& list = a == "--micro-batches" ? micro_batches : bucket_sizes;
      list.clear();
      for (const auto& item : *items) {
        auto x = a == "--micro-batches" ? parse_positive(item, 1 << 20) : parse_elements(item);
        if (!x) return fail(a + ": expected positive integers (" + (a == "--micro-batches" ? "4" : "2e6") + "); got \"" + item + "\"");
        list.push_back(*x);
      }
    } else if (a == "--stages" || a == "--offload" || a == "--checkpointing") {
      auto items = split_list(v);
      if (!items) return fail(a + ": expected a comma-separated list; got \"" + v + "\"");
      std::set<int> set;
      for (const auto& item : *items) {
        int x = -1;
        if (a == "--stages") {
          if (item.size() == 1 && item[0] >= '0' && item[0] <= '3') x = item[0] - '0';
        } else {
          const auto* names = a == "--offload" ? kLevelName : kCheckpointName;
          for (int k = 0; k < 3; ++k)
            if (item == names[k]) x = k;
        }
        if (x < 0)
          return fail(a + ": expected " +
                      (a == "--stages" ? "stages 0 to 3" : a == "--offload" ? "none, cpu or nvme" : "none, blocks or cpu") +
                      "; got \"" + item + "\"");
        set.insert(x);
      }
      (a == "--stages" ? stages : a == "--offload" ? offload.emplace() : checkpointing) = set;
      checkpointing_given = checkpointing_given || a == "--checkpointing";
    } else if (a == "--gradients") {
      auto items = split_list(v);
      if (!items) return fail(a + ": expected a comma-separated list; got \"" + v + "\"");
      plan.grad_places.clear();
      for (const auto& item : *items) {
        if (item != "host" && item != "device") return fail(a + ": expected host, device or both; got \"" + item + "\"");
        plan.grad_places.push_back(item == "device");
      }
      std::sort(plan.grad_places.begin(), plan.grad_places.end());
      plan.grad_places.erase(std::unique(plan.grad_places.begin(), plan.grad_places.end()), plan.grad_places.end());
    } else if (a == "--ratios") {
      std::string problem;
      auto ratios = parse_ratios(v, problem);
      if (!ratios) return fail("--ratios: " + problem);
      plan.ratios = *ratios;
    } else if (a == "--out") {
      out_path = v;
    } else if (a == "--json") {
      json_path = v;
    } else {  // --trainer: the mingpt binary (default: beside this one)
      trainer = v;
    }
  }
  if (model && !program.empty()) return fail("--model and -- PROGRAM: give one (the model to tune for)");
  if (!model && program.empty()) return fail("-- PROGRAM ARGS (your training program) or --model mingpt:L,C[,V,T] is required");
  if (!program.empty()) {
    if (n_head) return fail("--n_head goes with --model mingpt:...");
    if (!trainer.empty()) return fail("--trainer goes with --model mingpt:...");
    if (device) return fail("--device goes with --model mingpt:... (a program picks its own device)");
    bool has_config = false;
    for (const auto& a : program) has_config = has_config || a.find("{config}") != std::string::npos;
    if (!has_config)
      return fail("the program's arguments have no {config}: write it where the program takes its DeepSpeed config "
                  "(e.g. --config {config}), so each run gets its candidate's");
    if (const std::string problem = program_problem(program[0]); !problem.empty()) return fail(problem);
    const std::string found = find_program(program[0]);
    program[0] = found;
    if (!checkpointing_given) checkpointing = {0};
  }
  if (plan.nodes == 1 && bandwidth) return fail("--inter-node-bandwidth goes with --nodes M (M > 1)");
  if (plan.nodes == 1 && plan.quantized_communication)
    return fail("--allow-quantized-communication goes with --nodes M (M > 1): ZeRO++'s quantized collectives are "
                "for the traffic between nodes");
  // MiCS, hpZ and ZeRO++ group the ranks of a node: with one, no key applies.
  if (plan.nodes > 1 && plan.ranks < 2 && plan.quantized_communication)
    return fail("--allow-quantized-communication with --ranks 1: each node has one rank, and MiCS, hpZ and ZeRO++'s "
                "keys group the ranks within a node, so none would be tried; give --ranks 2 or more");
  if (bandwidth) plan.inter_node_bandwidth = static_cast<double>(*bandwidth);
  if (const std::string problem = zero::runs::too_many_ranks(plan.nodes > 1 ? "--ranks x --nodes" : "--ranks",
                                                             plan.world(), oversubscribe);
      !problem.empty())
    return fail(problem);
  // The outputs come at the end of a long search: checked now. None may be
  // what the search reads (NOTE [outputs and inputs]); the default --out
  // never replaces the base --config.
  if (!seen.count("--out") && !config_path.empty() && resolved_path(config_path) == resolved_path(out_path))
    return fail("--config " + config_path + ": the tuned config goes to " + out_path + " when --out is not given, and " +
                "that is this base config; a tune never writes over its own --config: give --out FILE");
  {
    CommandFiles files;
    if (!config_path.empty()) files.reads("--config", config_path);
    if (!program.empty()) files.reads_program_arguments(program);
    if (!trainer.empty()) files.reads("--trainer", trainer);
    files.writes(seen.count("--out") ? "--out" : "--out (default)", out_path);
    if (!json_path.empty()) files.writes("--json", json_path);
    if (const std::string problem = files.problem(); !problem.empty()) return fail(problem);
  }
  for (const auto& [flag, path] : {std::pair<std::string, std::string>{"--out", out_path}, {"--json", json_path}}) {
    if (path.empty()) continue;
    if (const std::string problem = zero::runs::output_path_problem(flag, path); !problem.empty()) return fail(problem);
    // A tune replaces what a tune wrote (it marks its files); any other
    // file of that name only with --force.
    if (!force && ckpt::is_regular_file(path) && !written_by_tune(path))
      return fail(flag + (seen.count(flag) ? " " : " (default) ") + path +
                  ": exists and was not written by zero tune; give --force to replace it, or " +
                  (seen.count(flag) ? "another path" : flag + " FILE"));
  }
  if (!device_budget || !host_budget) return fail("--device-memory and --host-memory are required (per rank)");
  if (nvme_budget && plan.nvme_path.empty()) return fail("--nvme-bytes goes with --nvme-path DIR");
  if (offload && offload->count(2) && plan.nvme_path.empty()) return fail("--offload nvme needs --nvme-path DIR");
  if (!offload) offload = plan.nvme_path.empty() ? std::set<int>{0, 1} : std::set<int>{0, 1, 2};
  plan.program = program;
  plan.set_precision = program.empty() || precision.has_value();
  if (model) {
    plan.n_layer = (*model)[0], plan.n_embd = (*model)[1], plan.vocab = (*model)[2], plan.block = (*model)[3];
    plan.n_head = n_head.value_or(std::max<int64_t>(1, plan.n_embd / 64));
    if (plan.n_embd % plan.n_head != 0)
      return fail("--n_head " + std::to_string(plan.n_head) + " must divide the width " + std::to_string(plan.n_embd));
  }
  plan.device_budget = *device_budget;
  plan.host_budget = *host_budget;
  plan.device = device;
  plan.on_cuda = device ? *device == "cuda" : torch::cuda::is_available();
  // Emulated nodes share this machine's GPUs: rank R takes cuda:(R mod
  // --ranks), the device of another node's rank too, which NCCL refuses.
  if (plan.nodes > 1 && plan.on_cuda)
    return fail(std::string("--nodes ") + std::to_string(plan.nodes) +
                ": the nodes are emulated on this machine, where rank R would take cuda:(R mod --ranks), another "
                "node's rank's GPU too (NCCL refuses two ranks on one GPU); tune them on the CPU: " +
                (program.empty() ? "--device cpu" : "CUDA_VISIBLE_DEVICES= zero tune ... (the program then trains on the CPU)"));
  if (model && trainer.empty()) trainer = self_dir() + "/mingpt";
  if (model && ::access(trainer.c_str(), X_OK) != 0)
    return fail("the runs train with " + trainer + ", which is not there (build mingpt)");
  const std::string launcher = self_dir() + "/zero";

  try {
    if (!plan.nvme_path.empty()) {
      if (!ckpt::path_exists(plan.nvme_path)) return fail("--nvme-path " + plan.nvme_path + ": no such folder");
      if (!ckpt::is_folder(plan.nvme_path))
        return fail("--nvme-path " + plan.nvme_path + ": is a file; expected a folder on the NVMe drive (the runs' swap "
                    "files go in a scratch folder made there)");
      plan.nvme_budget = nvme_budget.value_or(free_bytes(plan.nvme_path) / plan.world());
    }
    // The base config, checked as `zero config check` does.
    if (!config_path.empty()) {
      const std::string text = ckpt::read_small_file(config_path);
      config::LoadOptions lo;
      lo.world_size = plan.world();
      lo.auto_stand_ins = true;
      // The batch is the tuner's to set (each candidate's micro-batch): a
      // base config without one is checked with the first it tries.
      std::string checked_text = text;
      {
        nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/true);
        if (j.is_object() && !j.contains("train_batch_size") && !j.contains("train_micro_batch_size_per_gpu")) {
          j["train_micro_batch_size_per_gpu"] = micro_batches.front();
          checked_text = j.dump();
        }
      }
      const auto checked = config::load_string(checked_text, lo, config_path);
      plan.base = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/true, /*ignore_comments=*/true);
      if (plan.nodes > 1 && plan.base.contains("zero_optimization") && plan.base["zero_optimization"].is_object()) {
        std::string dropped;
        for (const char* k : kCommKeyNames)
          if (plan.base["zero_optimization"].contains(k)) dropped += (dropped.empty() ? "" : ", ") + std::string(k);
        if (!dropped.empty())
          std::fprintf(stderr, "zero tune: --nodes: the base config's %s are the tuner's to choose: each candidate "
                               "has its own (none, or the winner's key sets)\n", dropped.c_str());
      }
      if (!precision) precision = checked.bf16.enabled ? "bf16" : checked.fp16.enabled ? "fp16" : std::optional<std::string>();
      plan.gas = checked.batch.gradient_accumulation_steps;
    } else {
      plan.base = {{"gradient_clipping", 1.0},
                   {"optimizer",
                    {{"type", "AdamW"},
                     {"params", {{"lr", 3e-4}, {"betas", {0.9, 0.95}}, {"eps", 1e-8}, {"weight_decay", 0.1}}}}},
                   {"zero_optimization", {{"overlap_comm", true}, {"contiguous_gradients", true}}}};
    }
    plan.precision = precision.value_or(plan.on_cuda ? "bf16" : "fp32");
    if (plan.low_precision_states) {
      const auto& opt = plan.base.value("optimizer", nlohmann::json::object());
      std::string type = opt.is_object() ? opt.value("type", std::string("AdamW")) : std::string("AdamW");
      std::transform(type.begin(), type.end(), type.begin(), [](unsigned char ch) { return std::tolower(ch); });
      if (type != "adam" && type != "adamw") {
        std::cerr << "zero tune: --allow-low-precision-states: the base config's optimizer " << opt.value("type", "")
                  << " has no 8-bit states (optimizer.params.optim_bits is Adam's and AdamW's)\n";
        return 2;
      }
    }

    // Scratch: configs, logs and reports under $TMPDIR; swap files under
    // --nvme-path; removed however the tuner ends, a stop signal included.
    zero::runs::CatchStopSignals stop;
    zero::runs::ScratchDir scratch(zero::runs::temp_parent(), "zero-tune");
    std::optional<zero::runs::ScratchDir> nvme_scratch;
    if (!plan.nvme_path.empty()) nvme_scratch.emplace(plan.nvme_path, "zero-tune-swap");
    // run: the program (or mingpt) on the ranks with `cfg_path`, budgets and
    // the stop step in its environment.
    auto probe_run = [&](const std::string& tag, const std::string& cfg_path, int64_t micro_batch, int checkpointing_level,
                         int64_t stop_after, bool budgets) {
      zero::runs::ProbeRun run;
      run.launcher = launcher;
      run.nproc = plan.ranks;
      run.nnodes = plan.nodes;
      run.report_path = scratch.path() + "/" + tag + ".report";
      run.log_path = scratch.path() + "/" + tag + ".log";
      run.timeout_s = run_timeout;
      run.stop_after_steps = stop_after;
      if (budgets) {
        run.device_budget = plan.device_budget;
        run.host_budget = plan.host_budget;
        if (!plan.nvme_path.empty()) run.nvme_budget = plan.nvme_budget;
      }
      if (!plan.program.empty()) {
        for (std::string a : plan.program) {
          for (size_t at = a.find("{config}"); at != std::string::npos; at = a.find("{config}", at + cfg_path.size()))
            a.replace(at, 8, cfg_path);
          run.argv.push_back(a);
        }
        return run;
      }
      run.argv = {trainer, "--config", cfg_path, "--vocab_size", std::to_string(plan.vocab), "--block_size",
                  std::to_string(plan.block), "--n_layer", std::to_string(plan.n_layer), "--n_embd",
                  std::to_string(plan.n_embd), "--n_head", std::to_string(plan.n_head), "--batch_size",
                  std::to_string(micro_batch), "--precision",
                  plan.precision == "fp32" ? "32" : plan.precision == "fp16" ? "16" : "bf16", "--limit_train_batches",
                  std::to_string(std::max<int64_t>(1, stop_after) * plan.gas)};
      if (checkpointing_level) run.argv.push_back("--checkpoint");
      if (plan.device) run.argv.insert(run.argv.end(), {"--device", *plan.device});
      return run;
    };

    std::vector<ParameterShape> shapes;
    double activation_per_sample = 0;  // a program's, measured
    if (plan.program.empty()) {
      shapes = mingpt_parameters(plan.n_layer, plan.n_embd, plan.vocab, plan.block);
    } else {
      // The program's model and its activations, from a run that builds it
      // and trains two steps at stage 3 with everything offloaded (the least
      // device memory), no budgets: its report lists the parameters, and
      // its device peak less what the estimator gives this config's states
      // and buffers is the activations of `micro_batch` samples (as zero
      // estimate --calibrate).
      Candidate d;
      d.family = 7;  // stage 3 + optimizer cpu + params cpu
      d.micro_batch = micro_batches.front();
      d.bucket = 50'000'000;
      nlohmann::json cfg = candidate_config(plan, d, "/nvme");
      cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0;  // every layer's parameters in its layer
      const std::string cfg_path = scratch.path() + "/describe.json";
      ckpt::write_file_atomically(cfg_path, cfg.dump(2) + "\n");
      std::fprintf(stderr, "zero tune: training the program 2 steps at stage 3 with offload to read its model ...");
      std::fflush(stderr);
      auto describe_run = probe_run("describe", cfg_path, d.micro_batch, 0, 2, false);
      describe_run.need_applied_step = false;  // fp16 may skip both: the peak of forward and backward is there
      const auto r = zero::runs::run_probe(describe_run);
      if (r.outcome != zero::runs::ProbeResult::Outcome::kTrained || r.reports.empty()) {
        std::fprintf(stderr, " failed\n");
        std::cerr << "zero tune: the program did not train at stage 3 with offload (" << r.command << "):\n"
                  << r.message << "\n";
        return 1;
      }
      if (const std::string off = config_mismatch(r.reports.front(), 3, d.micro_batch); !off.empty()) {
        std::fprintf(stderr, " failed\n");
        std::cerr << "zero tune: " << off << "\n";
        return 1;
      }
      shapes = r.reports.front().parameters();
      if (shapes.empty()) {
        std::fprintf(stderr, " failed\n");
        std::cerr << "zero tune: the program's model has no trainable parameters\n";
        return 1;
      }
      config::LoadOptions lo;
      lo.world_size = plan.world();
      lo.auto_stand_ins = true;
      const auto dcfg = config::load_string(cfg.dump(), lo, "zero tune (its first run)");
      const int64_t base = estimate_peak(dcfg, shapes, Activations{}, plan.on_cuda && plan.world() > 1).device();
      activation_per_sample = static_cast<double>(std::max<int64_t>(0, r.peak_device - base)) /
                              static_cast<double>(d.micro_batch);
      std::fprintf(stderr, " %zu parameter tensors; %s of activations a sample (device peak %s); %.1f s\n",
                   shapes.size(), format_bytes(static_cast<int64_t>(activation_per_sample)).c_str(),
                   format_bytes(r.peak_device).c_str(), r.seconds);
    }
    // Buckets hold gradients: the trainable parameters' (NOTE [frozen
    // groups]); a layer is gathered whole, frozen parameters too.
    int64_t num_parameters = 0, trainable = 0;
    std::map<int, int64_t> layer_sizes;
    for (const auto& p : shapes) num_parameters += p.numel, trainable += p.frozen ? 0 : p.numel, layer_sizes[p.layer] += p.numel;
    for (const auto& [layer, n] : layer_sizes) plan.largest_layer = std::max(plan.largest_layer, n);
    if (bucket_sizes.empty())
      bucket_sizes = {round2(static_cast<double>(std::max<int64_t>(trainable, 16)) / 16),
                      round2(static_cast<double>(std::max<int64_t>(trainable, 4)) / 4)};
    std::sort(bucket_sizes.begin(), bucket_sizes.end());
    bucket_sizes.erase(std::unique(bucket_sizes.begin(), bucket_sizes.end()), bucket_sizes.end());
    std::sort(micro_batches.begin(), micro_batches.end());
    micro_batches.erase(std::unique(micro_batches.begin(), micro_batches.end()), micro_batches.end());

    // 1. The grid, and what fits by the estimate.
    std::vector<Candidate> all = grid_candidates(plan, {stages, *offload, checkpointing, micro_batches, bucket_sizes},
                                                 shapes, activation_per_sample);
    int64_t fitting = std::count_if(all.begin(), all.end(), [](const Candidate& c) { return c.fits; });
    char what[160];
    if (plan.program.empty())
      std::snprintf(what, sizeof what, "mingpt:%lld,%lld,%lld,%lld (%s parameters, n_head %lld)",
                    static_cast<long long>(plan.n_layer), static_cast<long long>(plan.n_embd),
                    static_cast<long long>(plan.vocab), static_cast<long long>(plan.block),
                    human_count(static_cast<double>(num_parameters)).c_str(), static_cast<long long>(plan.n_head));
    else
      std::snprintf(what, sizeof what, "%s (%s parameters)", plan.program[0].c_str(),
                    human_count(static_cast<double>(num_parameters)).c_str());
    const std::string where =
        plan.nodes > 1 ? std::to_string(plan.nodes) + " nodes x " + std::to_string(plan.ranks) +
                             " ranks (emulated here: zero launch --emulate_nodes)"
                       : std::to_string(plan.ranks) + " rank(s)";
    std::fprintf(stderr, "zero tune: %s on %s, %s, %s; per rank: device %s, host %s%s\n", what, where.c_str(),
                 plan.on_cuda ? "cuda" : "cpu", plan.precision.c_str(),
                 mib(plan.device_budget).c_str(), mib(plan.host_budget).c_str(),
                 plan.nvme_path.empty() ? "" : (", nvme " + mib(plan.nvme_budget) + " under " + plan.nvme_path).c_str());
    if (plan.nodes > 1 && plan.inter_node_bandwidth <= 0)
      std::fprintf(stderr, "zero tune: the nodes share this machine's loopback, which prices no bytes across nodes: the "
                           "runs are ranked by their step here alone (--inter-node-bandwidth B adds the bytes at B)\n");
    std::fprintf(stderr, "zero tune: %zu candidates; %lld fit the estimate\n", all.size(), static_cast<long long>(fitting));
    if (fitting == 0) {
      std::fprintf(stderr,
                   "zero tune: nothing fits: raise a budget, allow more offload (--offload, --nvme-path), checkpointing "
                   "(--checkpointing) or smaller micro-batches (--micro-batches)\n");
      return 1;
    }

    const auto t0 = std::chrono::steady_clock::now();
    int runs = 0;
    double run_seconds = 0;

    auto measure = [&](Candidate& c, int64_t left) {
      zero::runs::check_stop();
      c.order = ++runs;
      const std::string tag = "run" + std::to_string(runs);
      const std::string cfg_path = scratch.path() + "/" + tag + ".json";
      const std::string swap = nvme_scratch ? nvme_scratch->path() : "/nvme";
      ckpt::write_file_atomically(cfg_path, candidate_config(plan, c, swap).dump(2) + "\n");
      std::fprintf(stderr, "zero tune: run %d (%lld more at most): %s ...", runs, static_cast<long long>(left),
                   describe(c).c_str());
      std::fflush(stderr);
      c.run = zero::runs::run_probe(probe_run(tag, cfg_path, c.micro_batch, c.checkpointing, plan.steps, true));
      if (plan.inter_node_bandwidth > 0 && c.run.outcome == zero::runs::ProbeResult::Outcome::kTrained &&
          !c.run.bytes_counted) {  // measured, but its bytes across nodes cannot be priced
        c.run.outcome = zero::runs::ProbeResult::Outcome::kFailed;
        c.run.message = "a rank's run report has no collective_bytes (a program built with an older zero?), so "
                        "--inter-node-bandwidth cannot price its bytes across nodes\n";
      }
      if (!plan.program.empty() && c.run.outcome == zero::runs::ProbeResult::Outcome::kTrained) {
        const std::string off = config_mismatch(c.run.reports.front(), kFamilies[c.family].stage, c.micro_batch);
        if (!off.empty()) {  // measured, but not this candidate
          c.run.outcome = zero::runs::ProbeResult::Outcome::kFailed;
          c.run.message = off + "\n";
        }
      }
      // --inter-node-bandwidth: the busiest node's bytes across, at its
      // ranks' bandwidth, while nothing else runs (loopback's own time stays
      // in the step).
      if (plan.inter_node_bandwidth > 0)
        c.network_s = c.run.busiest_node_across_per_step / (plan.inter_node_bandwidth * static_cast<double>(plan.ranks));
      run_seconds += c.run.seconds;
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      char eta[96];
      std::snprintf(eta, sizeof eta, "%.0f s so far, at most about %.0f s to go", elapsed,
                    run_seconds / runs * static_cast<double>(left));
      switch (c.run.outcome) {
        case zero::runs::ProbeResult::Outcome::kTrained:
          c.status = Status::kTrained;
          std::fprintf(stderr, " %.0f %s (step %.3f s%s) | peak device %s (estimate %s), host %s (%s)%s | %.1f s | %s\n",
                       c.rate(), c.run.tokens_per_step > 0 ? "tokens/s" : "samples/s", c.run.step_s,
                       c.network_s > 0 ? (" + " + fixed(c.network_s, 3) + " s across nodes").c_str() : "",
                       mib(c.run.peak_device).c_str(), mib(c.estimate.device()).c_str(), mib(c.run.peak_host).c_str(),
                       mib(c.estimate.host()).c_str(),
                       plan.nodes > 1 ? (" | across nodes " + mib(static_cast<int64_t>(c.run.across_nodes_per_step)) +
                                         " a step (busiest node " +
                                         mib(static_cast<int64_t>(c.run.busiest_node_across_per_step)) + ")")
                                            .c_str()
                                      : "",
                       c.run.seconds, eta);
          break;
        case zero::runs::ProbeResult::Outcome::kOutOfMemory:
          c.status = Status::kOutOfMemory;
          std::fprintf(stderr, " out of memory (skipped): %s | %.1f s | %s\n", c.run.message.c_str(),
                       c.run.seconds, eta);
          break;
        case zero::runs::ProbeResult::Outcome::kFailed:
          c.status = Status::kFailed;
          std::fprintf(stderr, " failed (skipped), exit status %d:\n%s  %s\n", c.run.status, c.run.message.c_str(), eta);
          break;
        case zero::runs::ProbeResult::Outcome::kTimedOut:
          c.status = Status::kTimedOut;
          std::fprintf(stderr, " timed out (skipped; --run-timeout): %s  %s\n", c.run.message.c_str(), eta);
          break;
      }
    };
    auto best_trained = [&]() -> Candidate* {
      Candidate* best = nullptr;
      for (auto& c : all)
        if (c.status == Status::kTrained && (!best || c.rate() > best->rate())) best = &c;
      return best;
    };
    // Least work first, then the largest micro-batch, then the stage, then
    // the smaller offloaded share (a family's ratios).
    auto promising = [](const Candidate* a, const Candidate* b) {
      return std::make_tuple(a->work_sum(), -a->micro_batch, kFamilies[a->family].stage, a->offloaded_share(), -a->bucket) <
             std::make_tuple(b->work_sum(), -b->micro_batch, kFamilies[b->family].stage, b->offloaded_share(), -b->bucket);
    };

    int64_t frontier_runs = 0, dominated = 0;
    if (exhaustive) {
      std::vector<Candidate*> order;
      for (auto& c : all)
        if (c.fits) order.push_back(&c);
      std::sort(order.begin(), order.end(), promising);
      for (size_t i = 0; i < order.size(); ++i) measure(*order[i], static_cast<int64_t>(order.size() - i - 1));
    } else {
      // 2-3. One point per (setup, states, gradients' place, checkpointing,
      // micro-batch): its buckets that fit, largest first. A point stands for
      // its largest bucket not out of memory (a smaller one needs less); a
      // run that failed otherwise ends the point.
      std::map<std::tuple<int, int, int, bool, int, int64_t>, std::vector<Candidate*>> points;
      for (auto& c : all)
        if (c.fits)
          points[{c.family, c.offloaded_share(), c.states_kind(), c.grads_on_device, c.checkpointing, c.micro_batch}]
              .push_back(&c);
      for (auto& [key, v] : points)
        std::sort(v.begin(), v.end(), [](const Candidate* a, const Candidate* b) { return a->bucket > b->bucket; });
      auto representative = [](const std::vector<Candidate*>& v) -> Candidate* {
        for (Candidate* c : v) {
          if (c->status == Status::kFailed || c->status == Status::kTimedOut) return nullptr;
          if (c->status != Status::kOutOfMemory) return c;
        }
        return nullptr;
      };
      auto reps = [&]() {
        std::vector<Candidate*> out;
        for (auto& [key, v] : points)
          if (Candidate* r = representative(v)) out.push_back(r);
        return out;
      };
      while (frontier_runs < trials) {
        const auto live = reps();
        std::vector<Candidate*> frontier;
        for (Candidate* p : live) {
          if (p->status != Status::kNotRun) continue;
          const bool beaten = std::any_of(live.begin(), live.end(), [&](const Candidate* q) { return q != p && dominates(*q, *p); });
          if (!beaten) frontier.push_back(p);
        }
        if (frontier.empty()) break;
        std::sort(frontier.begin(), frontier.end(), promising);
        measure(*frontier.front(),
                std::min<int64_t>(static_cast<int64_t>(frontier.size()) - 1, trials - frontier_runs - 1) +
                    static_cast<int64_t>(bucket_sizes.size()) - 1);
        ++frontier_runs;
      }
      const auto live = reps();
      for (Candidate* p : live)
        if (p->status == Status::kNotRun &&
            std::any_of(live.begin(), live.end(),
                        [&](const Candidate* q) { return q->status == Status::kTrained && dominates(*q, *p); })) {
          p->status = Status::kDominated;
          ++dominated;
        }
      // The winner's other bucket sizes.
      if (Candidate* best = best_trained()) {
        const Candidate winner = *best;
        std::vector<Candidate*> others;
        for (auto& c : all)
          if (c.fits && c.status == Status::kNotRun && c.family == winner.family && c.states_kind() == winner.states_kind() &&
              c.offloaded_share() == winner.offloaded_share() && c.grads_on_device == winner.grads_on_device &&
              c.checkpointing == winner.checkpointing && c.micro_batch == winner.micro_batch && c.bucket != winner.bucket)
            others.push_back(&c);
        for (size_t i = 0; i < others.size(); ++i) measure(*others[i], static_cast<int64_t>(others.size() - i - 1));
      }
    }
    // NOTE [config tuner], on nodes: the winner (its buckets chosen) with
    // each key of more than one node that applies to its stage. The keys
    // change what crosses the nodes, a little memory and, quantized, the
    // numerics: refinements of the chosen setup, as the buckets are.
    if (plan.nodes > 1)
      if (const Candidate* best = best_trained()) {
        auto variants = comm_variants(plan, *best, shapes, activation_per_sample);
        if (variants.empty())
          std::fprintf(stderr, "zero tune: no key of more than one node is tried: %s\n",
                       plan.ranks < 2 ? "a node has one rank (--ranks 1), and MiCS and hpZ group a node's ranks"
                                      : "the winner is below stage 2, where MiCS, hpZ and ZeRO++ do nothing");
        const int64_t fit = std::count_if(variants.begin(), variants.end(), [](const Candidate& c) { return c.fits; });
        fitting += fit;
        for (auto& v : variants) all.push_back(std::move(v));
        int64_t left = fit;
        for (size_t i = all.size() - variants.size(); i < all.size(); ++i)
          if (all[i].fits) measure(all[i], --left);
      }

    // The table, the winner, the files.
    std::vector<const Candidate*> ran;
    for (const auto& c : all)
      if (c.order) ran.push_back(&c);
    std::sort(ran.begin(), ran.end(), [](const Candidate* a, const Candidate* b) {
      if ((a->status == Status::kTrained) != (b->status == Status::kTrained)) return a->status == Status::kTrained;
      return a->status == Status::kTrained ? a->rate() > b->rate() : a->order < b->order;
    });
    const Candidate* best = best_trained();
    const char* unit = best != nullptr && best->run.tokens_per_step == 0 ? "samples/s" : "tokens/s";
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%-54s %5s %11s %11s %11s %11s %8s %10s %7s%s\n", "candidate (run order)", "run", "est device",
                "peak device", "est host", "peak host", plan.inter_node_bandwidth > 0 ? "step+net" : "step s", unit,
                "vs best",
                plan.nodes > 1 ? "  across nodes a step" : "");
    for (const Candidate* c : ran) {
      std::string name = family_name(kFamilies[c->family]);
      if (c->ratio < 1.0) name += ", ratio " + ratio_text(c->ratio);
      if (c->checkpointing) name += std::string(", ckpt ") + kCheckpointName[c->checkpointing];
      if (c->keys.any()) name += ", " + comm_keys_name(c->keys);
      name += ", mb " + std::to_string(c->micro_batch) + ", b " + human_count(static_cast<double>(c->bucket));
      if (c->status == Status::kTrained)
        std::printf("%-54s %5d %11s %11s %11s %11s %8.3f %10.0f %6.1f%%%s\n", name.c_str(), c->order,
                    mib(c->estimate.device()).c_str(), mib(c->run.peak_device).c_str(), mib(c->estimate.host()).c_str(),
                    mib(c->run.peak_host).c_str(), c->step_s(), c->rate(), 100.0 * c->rate() / best->rate(),
                    plan.nodes > 1 ? ("  " + mib(static_cast<int64_t>(c->run.across_nodes_per_step))).c_str() : "");
      else
        std::printf("%-54s %5d %11s %11s %11s %11s  %s\n", name.c_str(), c->order, mib(c->estimate.device()).c_str(), "-",
                    mib(c->estimate.host()).c_str(), "-", status_name(c->status));
    }
    std::printf("%zu candidates: %lld fit the estimate, %lld dominated by a faster-by-construction one, %d run in %.0f s\n",
                all.size(), static_cast<long long>(fitting), static_cast<long long>(dominated), runs, secs);
    if (!best) {
      std::fprintf(stderr, "zero tune: no candidate trained (see the lines above); no config written\n");
      return 1;
    }
    ckpt::write_file_atomically(out_path, candidate_config(plan, *best, plan.nvme_path).dump(2) + "\n");
    std::printf("best: %s: %.0f %s (step %.3f s, %lld %s); written to %s%s\n", describe(*best).c_str(), best->rate(),
                unit, best->step_s(),
                static_cast<long long>(best->run.tokens_per_step > 0 ? best->run.tokens_per_step : best->run.samples_per_step),
                best->run.tokens_per_step > 0 ? "tokens" : "samples",
                out_path.c_str(),
                best->checkpointing ? " (its activation_checkpointing takes effect where the model checkpoints its blocks)"
                                    : "");
    std::fflush(stdout);

    if (!json_path.empty()) {
      auto rows = nlohmann::json::array();
      for (const auto& c : all) rows.push_back(report_row(plan, c));
      nlohmann::json report = {
          {kTuneMark, kTuneMarkValue},
          {"model", plan.program.empty()
                        ? nlohmann::json{{"n_layer", plan.n_layer}, {"n_embd", plan.n_embd}, {"n_head", plan.n_head},
                                         {"vocab_size", plan.vocab}, {"block_size", plan.block},
                                         {"num_parameters", num_parameters}}
                        : nlohmann::json{{"program", plan.program}, {"num_parameters", num_parameters}}},
          {"ranks", plan.world()},
          {"nodes", plan.nodes},
          {"ranks_per_node", plan.ranks},
          {"inter_node_bandwidth", plan.inter_node_bandwidth > 0 ? nlohmann::json(plan.inter_node_bandwidth)
                                                                 : nlohmann::json(nullptr)},
          {"device", plan.on_cuda ? "cuda" : "cpu"},
          {"precision", plan.precision},
          {"budgets_bytes", {{"device", plan.device_budget}, {"host", plan.host_budget},
                             {"nvme", plan.nvme_path.empty() ? nlohmann::json(nullptr) : nlohmann::json(plan.nvme_budget)}}},
          {"mode", exhaustive ? "exhaustive" : "tuned"},
          {"steps_per_run", plan.steps},
          {"candidates", rows},
          {"fit_estimate", fitting},
          {"runs", runs},
          {"seconds", secs},
          {"best", {{"run_order", best->order}, {"tokens_per_s", best->tokens_per_s()},
                    {"samples_per_s", best->samples_per_s()}, {"config", out_path}}}};
      ckpt::write_file_atomically(json_path, report.dump(2) + "\n");
    }
    return 0;
  } catch (const zero::runs::Interrupted& e) {
    std::cerr << "zero tune: " << e.what() << "; its runs are ended and their files removed, no config written\n";
    return 128 + e.signal();
  } catch (const ConfigError& e) {
    std::cerr << "zero tune: " << error_text(e) << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "zero tune: " << error_text(e) << "\n";
    return 1;
  }
}

}  // namespace zero::tools
