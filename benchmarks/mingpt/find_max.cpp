// NOTE [max-parameter search]
// The largest minGPT that trains is found by training it: each probe runs
// this binary (under `zero launch` for several ranks) for a few optimizer
// steps of one shape with the budgets applied (InitOptions'
// device/host/NVMe limits: on a GPU the caching allocator's memory fraction,
// on the CPU the ledger's tiers and NOTE [emulated device memory]), so every
// allocation is real and the first one past a budget ends the probe with
// exit status 3 (out of memory). Any other failure ends the search, and so
// does a probe still running after --probe_timeout (a hung run).
//
// Shapes: n_embd on a grid of head_dim (n_head = n_embd / head_dim) and,
// unless --n_layer fixes it, n_layer = n_embd / head_dim (64 wide per layer,
// about GPT-2's proportions). Parameters grow with the grid index k as k^3,
// so the search runs in two phases:
//   1. the largest k that fits: start where the estimator's model states
//      fit (runtime/include/zero/runtime/estimate.h), step up or down until
//      the answer changes, bisect;
//   2. at that width and the next one, the largest n_layer that fits
//      (bisected), which refines the answer to about one layer.
// Each shape is run once (results are cached). The report names the largest
// shape, its parameters, step time and peak memory per tier, and the
// estimator's capacity at that width: the largest model whose model states
// alone fit the budgets, so found / capacity says what activations, buffers
// and fragmentation cost.
#include "find_max.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "zero/core/error.h"
#include "zero/core/text.h"
#include "zero/runtime/estimate.h"

#include "zero/snapshots/checkpoint_format.h"
#include "zero/runs/runs.h"

namespace mingpt {

using zero::runs::CatchStopSignals;
using zero::runs::ProbeResult;
using zero::runs::ProbeRun;
using zero::runs::ScratchDir;
using zero::runs::temp_parent;

namespace {

struct Shape {
  int64_t n_layer = 0, n_embd = 0;
  bool operator<(const Shape& o) const { return std::tie(n_layer, n_embd) < std::tie(o.n_layer, o.n_embd); }
};

struct Probe {
  Shape shape;
  int64_t num_parameters = 0;
  bool fits = false;
  std::string oom;  // why it did not fit: the out-of-memory message, or the refusal
  ProbeResult run;  // its figures when it ran (step time, peaks, wall time)
};

class Search {
 public:
  Search(const FindMaxOptions& o, std::string scratch) : o_(o), scratch_(std::move(scratch)) {}

  Shape shape_at(int64_t k) const { return {o_.n_layer ? *o_.n_layer : k, k * o_.head_dim}; }

  int64_t parameters(const Shape& s) const {
    int64_t n = 0;
    for (const auto& p : zero::mingpt_parameters(s.n_layer, s.n_embd, o_.vocab_size, o_.block_size, o_.tie_weights))
      n += p.numel;
    return n;
  }

  // NVMe offload of parameters swaps each layer's shard through buffers of
  // offload_param.buffer_size elements: past that a shape cannot run at all
  // (the engine refuses it), whatever the budgets. The refusal, or "".
  std::string swap_buffer_refusal(const Shape& s) const {
    const auto& op = o_.resolved.zero.offload_param;
    if (o_.resolved.zero.stage != 3 || op.device != zero::config::OffloadDevice::kNvme) return "";
    std::map<int, int64_t> layers;
    for (const auto& p : zero::mingpt_parameters(s.n_layer, s.n_embd, o_.vocab_size, o_.block_size, o_.tie_weights))
      layers[p.layer] += p.numel;
    int64_t largest = 0;
    for (const auto& [layer, n] : layers) largest = std::max(largest, (n + o_.nproc - 1) / o_.nproc);
    if (largest <= op.buffer_size) return "";
    return "a layer's shard of " + std::to_string(largest) +
           " elements is over zero_optimization.offload_param.buffer_size " + std::to_string(op.buffer_size);
  }

  // Whether the estimator's model states alone fit the budgets.
  bool states_fit(const Shape& s) const {
    if (!swap_buffer_refusal(s).empty()) return false;
    const auto e = zero::estimate_model_states(
        o_.resolved, zero::mingpt_parameters(s.n_layer, s.n_embd, o_.vocab_size, o_.block_size, o_.tie_weights));
    const auto device_budget = o_.device_memory ? o_.device_memory : o_.device_total;
    return (!device_budget || e.device.total() <= *device_budget) &&
           (!o_.host_memory || e.host.total() <= *o_.host_memory) && (!o_.nvme_bytes || e.nvme.total() <= *o_.nvme_bytes);
  }

  const Probe& probe(const Shape& s) {
    if (auto it = cache_.find(s); it != cache_.end()) return it->second;
    Probe p;
    p.shape = s;
    p.num_parameters = parameters(s);
    if (const std::string refusal = swap_buffer_refusal(s); !refusal.empty()) {
      p.oom = refusal + " (not run)";
      return cache_.emplace(s, std::move(p)).first->second;
    }
    const int n = static_cast<int>(cache_.size()) + 1;
    std::fprintf(stderr, "find-max-params: probe %d: n_layer %lld, n_embd %lld (%s parameters) ...", n,
                 static_cast<long long>(s.n_layer), static_cast<long long>(s.n_embd), human(p.num_parameters).c_str());
    std::fflush(stderr);
    // The probe is this binary, told its budgets and its last step through
    // the environment; its figures come back in the engine's run report
    // (NOTE [run report]).
    ProbeRun run;
    run.launcher = o_.launcher;
    run.nproc = o_.nproc;
    run.report_path = scratch_ + "/probe" + std::to_string(n) + ".report";
    run.log_path = scratch_ + "/probe" + std::to_string(n) + ".log";
    run.timeout_s = o_.probe_timeout_s;
    run.stop_after_steps = o_.steps;
    run.device_budget = o_.device_memory;
    run.host_budget = o_.host_memory;
    run.nvme_budget = o_.nvme_bytes;
    const int64_t gas = o_.resolved.batch.gradient_accumulation_steps;
    run.argv = {o_.self};
    run.argv.insert(run.argv.end(), o_.forward.begin(), o_.forward.end());
    for (const auto& a : std::vector<std::string>{
             "--config", o_.config, "--n_layer", std::to_string(s.n_layer), "--n_embd", std::to_string(s.n_embd),
             "--n_head", std::to_string(s.n_embd / o_.head_dim), "--limit_train_batches", std::to_string(o_.steps * gas)})
      run.argv.push_back(a);
    p.run = zero::runs::run_probe(run);
    const ProbeResult& r = p.run;
    if (r.outcome == ProbeResult::Outcome::kTrained) {
      p.fits = true;
      std::fprintf(stderr, " fits | step %.3f s | peak device %s, host %s, nvme %s | %.1f s\n", r.step_s,
                   zero::format_bytes(r.peak_device).c_str(), zero::format_bytes(r.peak_host).c_str(),
                   zero::format_bytes(r.peak_nvme).c_str(), r.seconds);
    } else if (r.outcome == ProbeResult::Outcome::kOutOfMemory) {
      p.oom = r.message;
      std::fprintf(stderr, " does not fit | %s | %.1f s\n", p.oom.substr(0, 160).c_str(), r.seconds);
    } else if (r.outcome == ProbeResult::Outcome::kTimedOut) {
      std::fprintf(stderr, " timed out\n");
      const auto nl = r.message.find('\n');  // the limit's line, then the log's last lines
      throw zero::Error(zero::ErrorKind::kInternal, "the probe was " + r.message.substr(0, nl) +
                                                        " (--probe_timeout S sets the limit):\n  " + r.command + "\n" +
                                                        (nl == std::string::npos ? "" : r.message.substr(nl + 1)));
    } else {
      std::fprintf(stderr, " failed\n");
      throw zero::Error(zero::ErrorKind::kInternal, "the probe failed with exit status " + std::to_string(r.status) +
                                                        " for a reason other than memory:\n  " + r.command + "\n" +
                                                        r.message);
    }
    return cache_.emplace(s, std::move(p)).first->second;
  }

  bool fits(const Shape& s) { return probe(s).fits; }

  const std::map<Shape, Probe>& probes() const { return cache_; }

  static std::string human(int64_t n) {
    char buf[32];
    const double v = static_cast<double>(n);
    if (v >= 1e9) std::snprintf(buf, sizeof buf, "%.2fB", v / 1e9);
    else if (v >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", v / 1e6);
    else std::snprintf(buf, sizeof buf, "%.1fK", v / 1e3);
    return buf;
  }

 private:
  const FindMaxOptions& o_;
  std::string scratch_;
  std::map<Shape, Probe> cache_;
};

// The largest x in [lo, hi] with ok(x), given ok(lo) and !ok(hi + 1) unknown:
// bisects on a predicate that is true up to a point.
template <class F>
int64_t last_true(int64_t lo, int64_t hi, F ok) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (ok(mid)) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

}  // namespace

int find_max_params(const FindMaxOptions& o) {
  CatchStopSignals stop;  // the scratch folder goes however the search is stopped
  ScratchDir scratch(temp_parent(), "mingpt-find");
  Search search(o, scratch.path());
  const auto t0 = std::chrono::steady_clock::now();
  constexpr int64_t kMaxGrid = 2048;  // n_embd up to 2048 x head_dim

  // Phase 1: the grid index. The estimator's largest index is where the model
  // states alone fill a budget; the real limit is at or below it.
  int64_t k_est = 0;
  while (k_est < kMaxGrid && search.states_fit(search.shape_at(k_est + 1))) ++k_est;
  std::fprintf(stderr, "find-max-params: %s on %lld rank(s); the estimator's model states fit up to n_embd %lld\n",
               o.config.c_str(), static_cast<long long>(o.nproc), static_cast<long long>(k_est * o.head_dim));
  int64_t k = std::max<int64_t>(1, k_est);
  int64_t lo = 0, hi = kMaxGrid + 1;  // fits(lo) (0: nothing yet), !fits(hi)
  if (search.fits(search.shape_at(k))) {
    lo = k;
    for (int64_t step = 1; lo < kMaxGrid; step *= 2) {
      const int64_t next = std::min(kMaxGrid, lo + step);
      if (!search.fits(search.shape_at(next))) {
        hi = next;
        break;
      }
      lo = next;
    }
  } else {
    hi = k;
    for (int64_t step = 1; hi > 1; step *= 2) {
      const int64_t next = std::max<int64_t>(1, hi - step);
      if (search.fits(search.shape_at(next))) {
        lo = next;
        break;
      }
      hi = next;
    }
  }
  if (lo == 0) {
    const auto& smallest = search.probes().at(search.shape_at(1));
    std::fprintf(stderr, "find-max-params: not even n_embd %lld fits: %s\n", static_cast<long long>(o.head_dim),
                 smallest.oom.c_str());
    return 1;
  }
  if (hi > lo + 1) lo = last_true(lo, hi - 1, [&](int64_t x) { return search.fits(search.shape_at(x)); });

  // Phase 2: depth at this width and the next.
  Shape best = search.shape_at(lo);
  if (!o.n_layer) {
    for (int64_t kk : {lo, lo + 1}) {
      if (kk > kMaxGrid) continue;
      const int64_t width = kk * o.head_dim;
      auto ok = [&](int64_t L) { return L >= 1 && search.fits({L, width}); };
      int64_t l_lo = kk == lo ? lo : 0, l_hi = 0;  // ok(l_lo) (0: none yet), !ok(l_hi)
      if (kk == lo) {
        for (int64_t step = 1;; step *= 2) {
          if (!ok(l_lo + step)) {
            l_hi = l_lo + step;
            break;
          }
          l_lo += step;
        }
      } else {
        l_hi = kk;  // shape_at(lo + 1) did not fit
        // Below the previous width's depth a wider model has no more parameters.
        const int64_t floor_l = std::max<int64_t>(1, best.n_layer * best.n_embd * best.n_embd / (width * width));
        if (!ok(floor_l)) continue;
        l_lo = floor_l;
      }
      const int64_t L = last_true(l_lo, l_hi - 1, ok);
      if (search.parameters({L, width}) > search.parameters(best)) best = {L, width};
    }
  }

  // The estimator's capacity at the chosen width: the most layers whose model
  // states alone fit.
  int64_t cap_layers = 0;
  if (o.n_layer) {
    cap_layers = k_est;  // widths, for a fixed depth
  } else {
    int64_t hi_l = 1;
    while (hi_l < (int64_t{1} << 20) && search.states_fit({hi_l, best.n_embd})) hi_l *= 2;
    cap_layers = hi_l == 1 ? 0 : last_true(hi_l / 2, hi_l - 1, [&](int64_t L) { return search.states_fit({L, best.n_embd}); });
  }
  const int64_t capacity = o.n_layer ? (cap_layers ? search.parameters(search.shape_at(cap_layers)) : 0)
                                     : (cap_layers ? search.parameters({cap_layers, best.n_embd}) : 0);
  const bool capacity_bounded = o.n_layer ? k_est < kMaxGrid : cap_layers < (int64_t{1} << 20) - 1;

  // The estimator's prediction at that width: the most layers whose peak of
  // a step (states, activations, buffers; NOTE [peak estimate]) fits.
  auto peak_fits = [&](int64_t L) {
    zero::MinGPTWorkload w;
    w.n_layer = L;
    w.n_embd = best.n_embd;
    w.n_head = best.n_embd / o.head_dim;
    w.vocab_size = o.vocab_size;
    w.block_size = o.block_size;
    w.tie_weights = o.tie_weights;
    w.micro_batch = o.resolved.batch.train_micro_batch_size_per_gpu;
    w.checkpointing = o.checkpointing;
    if (!search.swap_buffer_refusal({L, best.n_embd}).empty()) return false;
    const auto e = zero::estimate_peak(o.resolved, w, /*nccl=*/o.on_cuda && o.nproc > 1);
    const auto device_budget = o.device_memory ? o.device_memory : o.device_total;
    return (!device_budget || e.device() <= *device_budget) && (!o.host_memory || e.host() <= *o.host_memory) &&
           (!o.nvme_bytes || e.nvme() <= *o.nvme_bytes);
  };
  int64_t predicted_layers = 0;
  if (!o.n_layer && peak_fits(1)) {
    int64_t hi_l = 1;
    while (hi_l < (int64_t{1} << 20) && peak_fits(hi_l)) hi_l *= 2;
    predicted_layers = peak_fits(hi_l) ? hi_l : last_true(hi_l / 2, hi_l - 1, peak_fits);
  }
  const int64_t predicted = predicted_layers ? search.parameters({predicted_layers, best.n_embd}) : 0;

  const auto& b = search.probes().at(best);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double tokens = static_cast<double>(o.resolved.batch.train_batch_size * o.block_size);
  std::printf("largest: n_layer %lld, n_embd %lld, n_head %lld: %lld parameters (%s)\n",
              static_cast<long long>(best.n_layer), static_cast<long long>(best.n_embd),
              static_cast<long long>(best.n_embd / o.head_dim), static_cast<long long>(b.num_parameters),
              Search::human(b.num_parameters).c_str());
  std::printf("step time %.3f s (%.0f tokens/s); peak per rank: device %s, host %s, nvme %s\n", b.run.step_s,
              b.run.step_s > 0 ? tokens / b.run.step_s : 0.0, zero::format_bytes(b.run.peak_device).c_str(),
              zero::format_bytes(b.run.peak_host).c_str(), zero::format_bytes(b.run.peak_nvme).c_str());
  if (capacity_bounded && capacity > 0)
    std::printf("estimator's capacity (model states alone fill a budget) at n_embd %lld: %s parameters; found %.1f%% of it\n",
                static_cast<long long>(best.n_embd), Search::human(capacity).c_str(),
                100.0 * static_cast<double>(b.num_parameters) / static_cast<double>(capacity));
  if (predicted > 0 && predicted_layers < (int64_t{1} << 20))
    std::printf("estimator's prediction (peak of a step) at n_embd %lld: n_layer %lld, %s parameters (%+.1f%% of found)\n",
                static_cast<long long>(best.n_embd), static_cast<long long>(predicted_layers),
                Search::human(predicted).c_str(),
                100.0 * static_cast<double>(predicted - b.num_parameters) / static_cast<double>(b.num_parameters));
  std::printf("%zu probes in %.1f s\n", search.probes().size(), secs);
  std::fflush(stdout);

  if (!o.json_path.empty()) {
    auto probes = nlohmann::json::array();
    for (const auto& [shape, p] : search.probes()) {
      nlohmann::json row = {{"n_layer", shape.n_layer}, {"n_embd", shape.n_embd}, {"num_parameters", p.num_parameters},
                            {"fits", p.fits}, {"seconds", p.run.seconds}};
      if (p.fits)
        row.update({{"step_time_s", p.run.step_s},
                    {"peak_bytes", {{"device", p.run.peak_device}, {"host", p.run.peak_host}, {"nvme", p.run.peak_nvme}}}});
      else row["out_of_memory"] = p.oom;
      probes.push_back(row);
    }
    auto opt = [](const std::optional<int64_t>& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); };
    nlohmann::json report = {
        {"config", o.config},
        {"ranks", o.nproc},
        {"budgets", {{"device", opt(o.device_memory)}, {"host", opt(o.host_memory)}, {"nvme", opt(o.nvme_bytes)}}},
        {"zero_stage", o.resolved.zero.stage},
        {"largest",
         {{"n_layer", best.n_layer}, {"n_embd", best.n_embd}, {"n_head", best.n_embd / o.head_dim},
          {"num_parameters", b.num_parameters}, {"step_time_s", b.run.step_s},
          {"tokens_per_step", o.resolved.batch.train_batch_size * o.block_size},
          {"peak_bytes", {{"device", b.run.peak_device}, {"host", b.run.peak_host}, {"nvme", b.run.peak_nvme}}}}},
        {"capacity", {{"num_parameters", capacity_bounded ? nlohmann::json(capacity) : nlohmann::json(nullptr)},
                      {"ratio", capacity_bounded && capacity > 0
                                    ? nlohmann::json(static_cast<double>(b.num_parameters) / static_cast<double>(capacity))
                                    : nlohmann::json(nullptr)}}},
        {"predicted", o.n_layer || predicted == 0 || predicted_layers >= (int64_t{1} << 20) ? nlohmann::json(nullptr)
                                                  : nlohmann::json{{"n_layer", predicted_layers},
                                                                   {"num_parameters", predicted}}},
        {"probes", probes},
        {"seconds", secs}};
    zero::ckpt::write_file_atomically(o.json_path, report.dump(2) + "\n");
  }
  return 0;
}

}  // namespace mingpt
