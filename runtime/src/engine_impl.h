// The Engine's state, for the files that implement it (engine.cpp,
// engine_save.cpp, engine_load.cpp, engine_export.cpp, run_reporter.cpp).
#pragma once

#include <torch/cuda.h>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <sstream>

#include <torch/nn/module.h>

#include "context.h"
#include "zero/checkpointing/checkpoint.h"
#include "zero/core/comm.h"
#include "zero/core/log.h"
#include "zero/core/text.h"
#include "zero/optim/loss_scaler.h"
#include "zero/optim/lr_scheduler.h"
#include "zero/partition/zero_optimizer.h"
#include "zero/runtime/engine.h"
#include "zero/snapshots/checkpoint_format.h"
#include "zero/runtime/engine_internal.h"
#include "run_reporter.h"

namespace zero {

namespace detail {
/// A model tensor as saved: its name, its values (a parameter gathered at
/// stage 3, valid during the call), its identity (the parameter's TensorImpl).
using ModelTensorVisit = std::function<void(const std::string& name, const at::Tensor& values, const void* identity)>;
/// The parameters as the engine lays them out (a tied one under its first
/// name), gathered a group at a time at stage 3, then frozen parameters and
/// buffers, to `visit` on rank 0, in that order. Every rank calls it.
void for_each_model_tensor(Engine& engine, const ModelTensorVisit& visit);
}  // namespace detail

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The engine's state: its context (NOTE [run context]: config, options, job,
// device, dtypes, ledger) and the parts it drives.
struct Engine::Impl : detail::RunContext {
  std::unique_ptr<Comm> comm;  // first of the parts: destroyed after everything that uses it
  partition::MicsGroups mics;  // NOTE [MiCS]: over `comm`; the optimizer uses them
  std::shared_ptr<torch::nn::Module> model;
  MemoryLedger& ledger() const { return *RunContext::ledger; }
  std::unique_ptr<partition::ZeroOptimizer> optimizer;
  std::unique_ptr<optim::LrScheduler> scheduler;
  optim::LossScaler scaler;
  std::unique_ptr<checkpointing::Checkpointer> checkpointer;
  std::unique_ptr<detail::RunReporter> reporter;  // ZERO_RUN_REPORT (NOTE [run report])
  detail::CheckpointHooks checkpoint_hooks;  // test seams (engine_internal.h)
  // Checkpoint folders opened for saving (Engine::open_checkpoint_dir); rank
  // 0 holds each one's writer lock, the other ranks a null.
  std::map<std::string, std::unique_ptr<ckpt::FolderLock>> save_folders;

  // NOTE [user backward]: how this accumulation window's gradients were
  // made: by Engine::backward, or by backwards the program started whose
  // losses were multiplied by `window_factor` (1, engine.scale's loss
  // scale, another engine's scale / gas).
  enum class Backward { kNone, kEngine, kUser };
  Backward window_backward = Backward::kNone;
  double window_factor = 1.0;
  int64_t backward_micro_step = -1;  // the micro-step of the last backward the program started
  bool user_backward_open = false;   // begun from a hook, its end not yet run

  // NOTE [frozen groups]: the frozen parameters kept whole (every one below
  // stage 3), by name, and their bytes in the ledger.
  std::vector<std::pair<std::string, at::Tensor>> frozen_whole;
  LedgerReservation frozen_whole_bytes;

  int64_t micro_steps = 0;
  int64_t global_steps = 0;
  int64_t steps_this_run = 0;  // since initialize (global_steps also counts a resumed checkpoint's)
  CommBytes comm_bytes_uncounted;  // what initialize and loads sent (NOTE [bytes across nodes])
  /// Leaves what a load sends out of the steps' bytes, for its scope.
  struct UncountedTraffic {
    Impl& s;
    CommBytes start;
    explicit UncountedTraffic(Impl& impl) : s(impl), start(impl.comm ? impl.comm->bytes_sent() : CommBytes{}) {}
    ~UncountedTraffic() {
      if (s.comm) s.comm_bytes_uncounted = s.comm_bytes_uncounted + (s.comm->bytes_sent() - start);
    }
    UncountedTraffic(const UncountedTraffic&) = delete;
    UncountedTraffic& operator=(const UncountedTraffic&) = delete;
  };
  /// What this rank's collectives sent for its steps (and evaluation between them).
  CommBytes step_traffic() const {
    return comm ? comm->bytes_sent() - comm_bytes_uncounted : CommBytes{};
  }
  int64_t skipped_steps = 0;
  int64_t applied_steps = 0;
  double last_grad_norm = 0;

  // Progress: losses and time since the last printed line.
  torch::Tensor loss_sum;
  int64_t loss_count = 0;
  Clock::time_point window_start = Clock::now();
  int64_t window_steps = 0;
  // wall_clock_breakdown: time before backward (forward and data), in backward, in step.
  Clock::time_point phase_start = Clock::now();
  double t_forward = 0, t_backward = 0, t_step = 0;

  int64_t gas() const { return config.batch.gradient_accumulation_steps; }

  // wall_clock_breakdown on a GPU: the phases are timed by the host, so the
  // device's queued work is waited for at each boundary (as DeepSpeed's
  // timers do), or forward and backward would time only their launches.
  // Off, nothing waits.
  void sync_for_breakdown() const {
    if (config.wall_clock_breakdown && device.is_cuda()) torch::cuda::synchronize(device.index());
  }

  void print_progress() {
    const double elapsed = seconds_since(window_start);
    const double samples = static_cast<double>(window_steps * config.batch.train_batch_size);
    std::ostringstream line;
    char buf[256];
    std::snprintf(buf, sizeof buf, "step %lld", static_cast<long long>(global_steps));
    line << buf;
    // The loss is known when engine.backward saw it; a program's own
    // loss.backward() gives the engine none, and the line leaves it out.
    if (loss_count > 0) {
      std::snprintf(buf, sizeof buf, " | loss %.4f", loss_sum.item<double>() / loss_count);
      line << buf;
    }
    std::snprintf(buf, sizeof buf, " | lr %.3e | loss scale %g | %.1f samples/s", current_lr(), scaler.scale(),
                  elapsed > 0 ? samples / elapsed : 0.0);
    line << buf;
    if (options.tokens_per_sample) {
      std::snprintf(buf, sizeof buf, " | %.0f tokens/s",
                    elapsed > 0 ? samples * *options.tokens_per_sample / elapsed : 0.0);
      line << buf;
    }
    if (config.wall_clock_breakdown) {
      const double n = std::max<int64_t>(1, window_steps);
      std::snprintf(buf, sizeof buf, " | per step: forward %.1f ms, backward %.1f ms, step %.1f ms",
                    1e3 * t_forward / n, 1e3 * t_backward / n, 1e3 * t_step / n);
      line << buf;
    }
    log::info(line.str());
    if (config.memory_breakdown) {  // DeepSpeed's memory_breakdown: where the bytes are, now and at most
      std::ostringstream mem;
      mem << "memory (current / peak):";
      for (const Tier t : {Tier::kDevice, Tier::kPinnedHost, Tier::kHost, Tier::kNvme}) {
        const auto c = ledger().get(t);
        mem << " " << to_string(t) << " " << format_bytes(c.current_bytes) << " / " << format_bytes(c.peak_bytes);
      }
      log::info(mem.str());
    }
    loss_sum = torch::Tensor();
    loss_count = 0;
    window_steps = 0;
    t_forward = t_backward = t_step = 0;
    window_start = Clock::now();
  }

  // Engine::set_lr on every group: the next steps' lr until the schedule's next step.
  std::optional<double> lr_set;
  // zero::GatheredParameters scopes open now: backward and step wait for them to end.
  int gathered_scopes = 0;
  double current_lr() const {
    if (lr_set) return *lr_set;
    return scheduler ? scheduler->lr() : config.optimizer->lr;
  }

  // The next optimizer step's values (also what a speculative step assumes:
  // NOTE [speculative step]).
  optim::StepParams next_step_params() const {
    optim::StepParams p;
    p.step = applied_steps + 1;
    p.lr = current_lr();
    p.beta1 = config.optimizer->betas[0];
    p.beta2 = config.optimizer->betas[1];
    // OneCycle's momentum cycle, as DeepSpeed applies it: only to optimizers
    // with betas, and it pins beta2 to 0.99 for the whole run.
    const bool has_betas = config.optimizer->type != config::OptimizerType::kAdagrad;
    if (scheduler && scheduler->beta1() && has_betas) {
      p.beta1 = *scheduler->beta1();
      p.beta2 = 0.99;
    }
    return p;
  }

  void take_model_step() {
    const optim::StepParams p = next_step_params();
    // The factor the accumulated gradients carry (NOTE [user backward]):
    // engine.backward scaled the loss by the loss scale / gas; a backward
    // the program started carries the loss scale only if engine.scale did,
    // and never 1/gas, which the step applies.
    double carried = scaler.scale();
    if (window_backward == Backward::kUser) carried = window_factor * static_cast<double>(gas());
    window_backward = Backward::kNone;
    auto outcome = optimizer->step(p, carried, config.gradient_clipping);
    last_grad_norm = outcome.grad_norm;
    const double old_scale = scaler.scale();
    if (config.fp16.enabled) scaler.update(!outcome.applied);
    if (outcome.applied) {
      ++applied_steps;
      if (scheduler) {
        scheduler->step();
        // The schedule wins at its step (DeepSpeed's rule): set_lr's values go.
        lr_set.reset();
        for (size_t g = 0; g < optimizer->param_groups().size(); ++g) {
          auto h = optimizer->param_groups()[g];
          if (!h.lr_set) continue;
          h.lr_set.reset();
          optimizer->set_group_hyper(g, h);
        }
      }
    } else {
      ++skipped_steps;
      char buf[160];
      std::snprintf(buf, sizeof buf,
                    "step %lld: gradients not finite, step skipped; loss scale %g -> %g",
                    static_cast<long long>(global_steps + 1), old_scale, scaler.scale());
      log::info(buf);
    }
    ++global_steps;
    ++steps_this_run;
    ++window_steps;
    if (reporter) reporter->after_step();  // may end the process (ZERO_STOP_AFTER_STEPS)
    if (options.print_progress && dist.rank == 0 && config.steps_per_print && *config.steps_per_print > 0 &&
        global_steps % *config.steps_per_print == 0) {
      print_progress();
    }
  }
};


}  // namespace zero
