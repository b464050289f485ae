// The engine's side of the run report (NOTE [run report] in
// zero/runs/run_report.h): the reporter that writes it, stops the run
// after ZERO_STOP_AFTER_STEPS and reports an uncaught exception.
#include "run_reporter.h"

#include <unordered_map>
#include <unordered_set>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <mutex>

#include <c10/util/Exception.h>

#include "engine_impl.h"
#include "zero/core/command_files.h"
#include "zero/core/error.h"
#include "zero/core/log.h"
#include "zero/core/text.h"
#include "zero/core/trace.h"
#include "zero/snapshots/checkpoint_format.h"

namespace zero {

namespace detail {
namespace {

std::mutex g_reporter_mutex;
RunReporter* g_reporter = nullptr;  // the process's reporting engine's
bool g_reported = false;            // an engine of this process has reported: later ones do not
std::terminate_handler g_previous_terminate = nullptr;

// An exception nobody caught: the report says so before the process goes.
[[noreturn]] void report_then_terminate() {
  {
    std::lock_guard<std::mutex> lock(g_reporter_mutex);
    if (g_reporter != nullptr) {
      std::string message = "terminate called without an exception";
      bool oom = false;
      if (auto e = std::current_exception()) {
        try {
          std::rethrow_exception(e);
        } catch (const OutOfMemoryError& x) {
          message = error_text(x), oom = true;
        } catch (const c10::OutOfMemoryError& x) {
          message = error_text(x), oom = true;
        } catch (const std::exception& x) {
          message = error_text(x);
          oom = !out_of_memory_tier(message).empty();
        } catch (...) {
          message = "an exception that is not a std::exception";
        }
      }
      try {
        g_reporter->write(oom ? "out_of_memory" : "failed", message);
      } catch (...) {  // the process is going anyway
      }
    }
  }
  if (g_previous_terminate != nullptr) g_previous_terminate();
  std::abort();
}

int64_t vm_hwm() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return 0;
}

// NOTE [bytes across nodes]: this rank's, since initialize, and per step.
nlohmann::json collective_report(const Engine::Impl& s) {
  const CommBytes b = s.step_traffic();
  const double steps = static_cast<double>(std::max<int64_t>(1, s.steps_this_run));
  return {{"node", s.comm ? s.comm->node() : 0},
          {"within_node", b.within_node},
          {"across_nodes", b.across_nodes},
          {"steps", s.steps_this_run},
          {"within_node_per_step", static_cast<double>(b.within_node) / steps},
          {"across_nodes_per_step", static_cast<double>(b.across_nodes) / steps}};
}

const char* precision_of(const config::Config& c) { return c.bf16.enabled ? "bf16" : c.fp16.enabled ? "fp16" : "fp32"; }

}  // namespace

std::vector<ParameterShape> parameter_shapes(const Engine::Impl& s) {
  // Stage 3: a group's layer is the first unit that gathers it (group 0,
  // the always-gathered one, is in none); the frozen groups' too (NOTE
  // [frozen groups]), and the frozen parameters kept whole after them.
  const auto& flat = s.optimizer->parameters();
  std::unordered_map<size_t, int> layer_of;
  if (const auto* c = s.optimizer->stage3())
    for (size_t u = 0; u < c->units().size(); ++u)
      for (size_t g : c->units()[u].groups) layer_of.emplace(g, static_cast<int>(u));
  std::vector<ParameterShape> out;
  for (const auto& slot : flat.all_slots()) {
    const auto it = layer_of.find(slot.group);
    out.push_back({slot.name, slot.numel, it == layer_of.end() ? -1 : it->second, flat.all_groups()[slot.group].frozen});
  }
  std::unordered_set<const void*> seen;
  for (const auto& [name, p] : s.frozen_whole)
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back({name, p.numel(), -1, true});
  return out;
}

std::unique_ptr<RunReporter> RunReporter::start(Engine::Impl& engine) {
  const auto settings = RunReportSettings::from_environment();
  if (settings.path.empty() && !settings.stop_after_steps) return nullptr;
  if (!settings.path.empty()) {
    // The variable names a prefix: rank R writes PREFIX.rankR beside it. A
    // folder or a device there is a mistake, not a place beside which to write.
    struct stat st {};
    if (::stat(settings.path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
      throw UsageError("ZERO_RUN_REPORT=" + settings.path + ": " +
                       (S_ISDIR(st.st_mode) ? "is a folder" : "is not a regular file (a device, pipe or socket)") +
                       "; expected a file name prefix: rank R writes PREFIX.rankR (such as " +
                       (S_ISDIR(st.st_mode) ? settings.path + "/report" : std::string("/tmp/report")) + ")");
    // NOTE [outputs and inputs]: against the program's files and the
    // config in check_environment_outputs (engine.cpp), before this.
    const std::string mine = run_report_path(settings.path, engine.dist.rank);
    if (const std::string problem = ckpt::output_file_problem("ZERO_RUN_REPORT", mine); !problem.empty())
      throw UsageError(problem);
  }
  std::lock_guard<std::mutex> lock(g_reporter_mutex);
  if (g_reported) return nullptr;  // the process's first engine reports
  g_reported = true;
  std::unique_ptr<RunReporter> r(new RunReporter(engine, settings));
  g_reporter = r.get();
  g_previous_terminate = std::set_terminate(report_then_terminate);
  return r;
}

RunReporter::RunReporter(Engine::Impl& engine, RunReportSettings settings)
    : engine_(engine), settings_(std::move(settings)), last_boundary_(Clock::now()), ooms_at_start_(out_of_memory_count()) {}

RunReporter::~RunReporter() {
  std::lock_guard<std::mutex> lock(g_reporter_mutex);
  if (g_reporter == this) {
    g_reporter = nullptr;
    std::set_terminate(g_previous_terminate);
  }
}

void RunReporter::after_step() {
  if (engine_.device.is_cuda()) torch::cuda::synchronize(engine_.device.index());
  const auto now = Clock::now();
  step_times_.push_back(std::chrono::duration<double>(now - last_boundary_).count());
  last_boundary_ = now;
  if (!stop_due()) return;
  if (program_ends()) stopped_ = true;
  else stop();
}

bool RunReporter::stop_due() const {
  return settings_.stop_after_steps && static_cast<int64_t>(step_times_.size()) >= *settings_.stop_after_steps;
}

// A tool's run (ZERO_RUN_REPORT set: zero tune, memcheck, --find-max-params)
// ends at the stop whatever the program: its report is all the tool reads,
// and the program's own end would write the user's outputs (a checkpoint
// into the real --save_dir, an export, a summary) from a probe of another
// config. ZERO_STOP_AFTER_STEPS alone is a person's: a program that ends
// itself then does its whole end.
bool RunReporter::program_ends() const { return settings_.path.empty() && engine_.options.program_ends_at_stop; }

void RunReporter::after_initialize() {
  if (!stop_due()) return;
  if (program_ends()) stopped_ = true;
  else stop();
}

void RunReporter::stop() {
  if (engine_.dist.rank == 0)
    log::info("ZERO_STOP_AFTER_STEPS=" + std::to_string(*settings_.stop_after_steps) + ": the run stops after " +
              std::to_string(step_times_.size()) + " optimizer step(s) (a variable of zero's tools, NOTE [run "
              "report]); the process ends now, without the program's own end (no summary, final checkpoint or "
              "export it would write)" +
              (settings_.path.empty() ? "" : "; the run report goes to " + settings_.path + ".rank<R>"));
  write("stopped", "");
  // Every rank stops at the same step: the others are done with the last
  // collective before this process goes.
  if (engine_.comm) engine_.comm->barrier();
  // The checkpoint folders' writer locks go (and folders the run made and
  // left empty): nothing of this run's stays behind.
  engine_.save_folders.clear();
  if (trace::on()) trace::flush(/*final=*/true);  // _exit runs no exit hook (NOTE [trace])
  std::fflush(nullptr);
  // Destructors of the program's objects are not run: threads of the
  // optimizer or of I/O may still be parked, and the run is over.
  ::_exit(0);
}

void RunReporter::at_engine_end() {
  if (written_) return;
  // An out-of-memory error made while this engine lived, caught or not.
  if (out_of_memory_count() > ooms_at_start_) write("out_of_memory", last_out_of_memory());
  else if (std::uncaught_exceptions() > 0) write("failed", "the engine was destroyed while an exception was in flight");
  else write(stopped_ ? "stopped" : "completed", "");
}

void RunReporter::write(const std::string& outcome, const std::string& error) {
  if (settings_.path.empty()) return;  // ZERO_STOP_AFTER_STEPS alone: a stop, no report
  auto& s = engine_;
  nlohmann::json ledger = nlohmann::json::object();
  for (const Tier t : {Tier::kDevice, Tier::kPinnedHost, Tier::kHost, Tier::kNvme}) {
    nlohmann::json kinds = nlohmann::json::object();
    for (int k = 0; k < kNumKinds; ++k) {
      const auto c = s.ledger().get(t, static_cast<Kind>(k));
      kinds[to_string(static_cast<Kind>(k))] = {{"current", c.current_bytes}, {"peak", c.peak_bytes}};
    }
    ledger[to_string(t)] = kinds;
  }
  auto states = [&](std::optional<Tier> tier) {
    auto get = [&](Kind k) {
      return tier ? s.ledger().get(*tier, k).current_bytes : s.ledger().current_bytes(k);
    };
    return nlohmann::json{{"parameters", get(Kind::kParameters)},
                          {"gradients", get(Kind::kGradients)},
                          {"optimizer_states", get(Kind::kOptimizerStates)}};
  };
  nlohmann::json host = states(Tier::kHost);
  for (const char* k : {"parameters", "gradients", "optimizer_states"})
    host[k] = host[k].get<int64_t>() + states(Tier::kPinnedHost)[k].get<int64_t>();

  const int64_t samples = s.config.batch.train_batch_size;
  const int64_t tokens = s.options.tokens_per_sample ? samples * *s.options.tokens_per_sample : 0;
  double timed = 0;
  for (size_t i = step_times_.size() > 1 ? 1 : 0; i < step_times_.size(); ++i) timed += step_times_[i];
  const double timed_steps = static_cast<double>(step_times_.size() > 1 ? step_times_.size() - 1 : step_times_.size());
  const double per_step = timed_steps > 0 ? timed / timed_steps : 0;

  // Every trainable parameter at its full size, with its stage-3 layer.
  nlohmann::json params = nlohmann::json::array();
  for (const auto& p : parameter_shapes(s))
    params.push_back({{"name", p.name}, {"numel", p.numel}, {"layer", p.layer}, {"frozen", p.frozen}});

  const auto& z = s.config.zero;
  nlohmann::json j = {
      {"format", "zero-run-report"},
      {"version", 1},
      {"rank", s.dist.rank},
      {"world_size", s.dist.world_size},
      {"outcome", outcome},
      {"steps", static_cast<int64_t>(step_times_.size())},
      {"global_steps", s.global_steps},
      {"skipped_steps", s.skipped_steps},
      {"step_time_s", step_times_},
      {"samples_per_step", samples},
      {"tokens_per_step", tokens},
      {"samples_per_s", per_step > 0 ? static_cast<double>(samples) / per_step : 0.0},
      {"tokens_per_s", per_step > 0 ? static_cast<double>(tokens) / per_step : 0.0},
      {"peak_bytes",
       {{"device", device_peak_bytes(s)},
        {"pinned_host", s.ledger().get(Tier::kPinnedHost).peak_bytes},
        {"host", s.ledger().get(Tier::kHost).peak_bytes},
        {"nvme", s.ledger().get(Tier::kNvme).peak_bytes},
        {"host_total", s.ledger().host_total().peak_bytes}}},
      {"ledger", ledger},
      {"model_state_bytes", states(std::nullopt)},
      {"model_state_bytes_by_tier", {{"device", states(Tier::kDevice)}, {"host", host}, {"nvme", states(Tier::kNvme)}}},
      {"process_peak_rss_bytes", vm_hwm()},
      {"collective_bytes", collective_report(s)},
      {"num_parameters", s.optimizer->num_parameters()},
      {"device", s.device.str()},
      {"config",
       {{"source", s.config.source},
        {"stage", z.stage},
        {"precision", precision_of(s.config)},
        {"train_micro_batch_size_per_gpu", s.config.batch.train_micro_batch_size_per_gpu},
        {"gradient_accumulation_steps", s.config.batch.gradient_accumulation_steps},
        {"train_batch_size", samples},
        {"offload_optimizer", config::to_string(z.offload_optimizer.device)},
        {"offload_param", config::to_string(z.offload_param.device)},
        {"resolved", nlohmann::json::parse(s.config.canonical_json)}}},
      {"parameters", params},
  };
  if (s.optimizer->speculates()) {  // NOTE [speculative step]: how often the step taken ahead stood
    const auto c = s.optimizer->speculation_counts();
    j["speculation"] = {{"planned", c.planned},     {"validated", c.validated}, {"redone", c.redone},
                        {"undone", c.undone},       {"sub_group_steps", c.sub_groups}};
  }
  if (!error.empty()) j["error"] = {{"tier", out_of_memory_tier(error)}, {"message", error}};
  const std::string path = run_report_path(settings_.path, s.dist.rank);
  ckpt::write_file_atomically(path, j.dump(1) + "\n");
  written_ = true;
}

}  // namespace detail
}  // namespace zero
