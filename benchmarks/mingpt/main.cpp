// mingpt: trains minGPT with a DeepSpeed config through zero, with the flags
// of the minGPT max-parameter benchmark. See docs/mingpt.md.
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
#include "args.h"
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

using namespace mingpt::cli;  // the command line (args.h)
// zero/runs/runs.h's kOutOfMemoryStatus: the searches tell "does not fit" from other failures by it.
using zero::runs::kOutOfMemoryStatus;

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
    if (args.lr_given) opts.auto_value_flags["lr"] = "--lr";
    if (args.weight_decay_given) opts.auto_value_flags["weight_decay"] = "--weight_decay";
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

    // Every rank's figures (rank_figures: peaks, model-state bytes, bytes
    // sent), this program's own (stage 3's live and gathered parameters,
    // checkpoint I/O), and the loss curve averaged over ranks (each rank's
    // loss is the mean over its equal share of the global batch).
    auto ranks = zero::detail::rank_figures(engine);
    const auto& params = engine.ledger().get(zero::Tier::kDevice, zero::Kind::kParameters);
    auto mine = torch::tensor({engine.stage3_stats() ? engine.stage3_stats()->peak_live_parameters : 0,
                               // gathered parameters at their peak: what the ledger's parameter peak has
                               // beyond the shards (nothing is gathered in layers after a step)
                               params.peak_bytes - params.current_bytes, save_bytes,
                               static_cast<int64_t>(save_s * 1e6), load_bytes, static_cast<int64_t>(load_s * 1e6)},
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
      const auto own = all.view({ws, -1}).contiguous();
      const auto v = own.accessor<int64_t, 2>();
      for (int64_t r = 0; r < ws; ++r) {
        auto& rank_r = ranks[static_cast<size_t>(r)];
        rank_r["peak_live_parameters"] = v[r][0];
        rank_r["peak_gathered_bytes"] = v[r][1];
        rank_r["checkpoint"] = nlohmann::json{{"save_bytes", v[r][2]},
                                              {"save_s", static_cast<double>(v[r][3]) * 1e-6},
                                              {"load_bytes", v[r][4]},
                                              {"load_s", static_cast<double>(v[r][5]) * 1e-6}};
      }
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
          {"peak_bytes", ranks.at(0).at("peak_bytes")},  // this rank's (0)
          {"model_state_bytes", ranks.at(0).at("model_state_bytes")},
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
