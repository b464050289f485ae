// zero tune's candidates and their configs (tune_plan.h).
#include "tune_plan.h"

#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "zero/core/error.h"
#include "zero/snapshots/checkpoint_format.h"

namespace zero::tools {

// 3.6M, 1.2B, 950K: a count for people.
std::string human_count(double n) {
  char buf[32];
  if (n >= 1e9) std::snprintf(buf, sizeof buf, "%.3gB", n / 1e9);
  else if (n >= 1e6) std::snprintf(buf, sizeof buf, "%.3gM", n / 1e6);
  else if (n >= 1e3) std::snprintf(buf, sizeof buf, "%.3gK", n / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", n);
  return buf;
}

const char* const kLevelName[3] = {"none", "cpu", "nvme"};
const char* const kCheckpointName[3] = {"none", "blocks", "cpu"};

const std::vector<Family> kFamilies = {{0, 0, 0}, {1, 0, 0}, {2, 0, 0}, {2, 1, 0}, {2, 2, 0},
                                       {3, 0, 0}, {3, 1, 0}, {3, 1, 1}, {3, 2, 0}, {3, 2, 2}};

std::string family_name(const Family& f) {
  std::string s = "stage " + std::to_string(f.stage);
  if (f.opt) s += std::string(" + optimizer ") + kLevelName[f.opt];
  if (f.param) s += std::string(" + params ") + kLevelName[f.param];
  return s;
}

std::string comm_keys_name(const CommKeys& k) {
  std::string s;
  auto add = [&](const std::string& part) { s += (s.empty() ? "" : " + ") + part; };
  if (k.mics) add("mics_shard_size " + std::to_string(k.mics));
  if (k.hpz) add("hpZ " + std::to_string(k.hpz));
  if (k.qwz) add("qwZ");
  if (k.qgz) add("qgZ");
  return s;
}

const char* status_name(Status s) {
  switch (s) {
    case Status::kNotRun: return "not run";
    case Status::kDoesNotFit: return "does not fit (estimate)";
    case Status::kDominated: return "dominated";
    case Status::kTrained: return "trained";
    case Status::kOutOfMemory: return "out of memory";
    case Status::kFailed: return "failed";
    case Status::kTimedOut: return "timed out";
  }
  return "?";
}

// a beats b on every count: no more work in any component, a micro-batch at
// least as large, and better in one of them (equal work and micro-batch at
// stages 0, 1 and 2 are measured, not guessed).
bool dominates(const Candidate& a, const Candidate& b) {
  const auto wa = a.work(), wb = b.work();
  bool less = false;
  for (size_t i = 0; i < wa.size(); ++i) {
    if (wa[i] > wb[i]) return false;
    less = less || wa[i] < wb[i];
  }
  if (a.micro_batch < b.micro_batch) return false;
  return less || a.micro_batch > b.micro_batch;
}

std::string ratio_text(double ratio) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", ratio);
  return buf;
}

std::string describe(const Candidate& c) {
  std::string s = family_name(kFamilies[c.family]);
  if (c.checkpointing) s += std::string(", checkpointing ") + kCheckpointName[c.checkpointing];
  if (c.optim_bits == 8) s += c.master16 ? ", 16-bit master and 8-bit Adam states" : ", 8-bit Adam states";
  if (c.optim_bits == 16) s += ", bf16 master and states";
  if (c.ratio < 1.0) s += ", offload ratio " + ratio_text(c.ratio);
  if (c.max_in_cpu > 0) s += ", " + human_count(static_cast<double>(c.max_in_cpu)) + " in host memory";
  if (c.grads_on_device) s += ", gradients on the device";
  if (c.keys.any()) s += ", " + comm_keys_name(c.keys);
  s += ", micro-batch " + std::to_string(c.micro_batch) + ", buckets " + human_count(static_cast<double>(c.bucket));
  return s;
}

std::optional<std::vector<std::string>> split_list(const std::string& v) {
  std::vector<std::string> out;
  std::stringstream ss(v);
  for (std::string item; std::getline(ss, item, ',');) {
    if (item.empty()) return std::nullopt;
    out.push_back(item);
  }
  if (out.empty()) return std::nullopt;
  return out;
}

std::optional<int64_t> parse_positive(const std::string& v, int64_t max_value) {
  try {
    size_t used = 0;
    const long long x = std::stoll(v, &used);
    if (used == v.size() && x >= 1 && x <= max_value) return x;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

// 2e6, 2000000, 1.5e7: a positive element count.
std::optional<std::vector<double>> parse_ratios(const std::string& v, std::string& problem) {
  auto items = split_list(v);
  if (!items) {
    problem = "expected a comma-separated list; got \"" + v + "\"";
    return std::nullopt;
  }
  std::vector<double> out;
  for (const auto& item : *items) {
    char* end = nullptr;
    const double x = std::strtod(item.c_str(), &end);
    if (end == item.c_str() || *end != '\0' || !(x > 0.0 && x <= 1.0)) {
      problem = "expected shares in (0, 1] (0.5: half the optimizer states offloaded); got \"" + item + "\"";
      return std::nullopt;
    }
    out.push_back(x);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::optional<int64_t> parse_elements(const std::string& v) {
  try {
    size_t used = 0;
    const double x = std::stod(v, &used);
    if (used == v.size() && std::isfinite(x) && x >= 1 && x <= 1e13 && x == std::floor(x)) return static_cast<int64_t>(x);
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

// Two significant digits: configs read 1200000, not 1193046.
int64_t round2(double x) {
  if (x < 100) return std::max<int64_t>(1, static_cast<int64_t>(std::llround(x)));
  const double scale = std::pow(10.0, std::floor(std::log10(x)) - 1);
  return static_cast<int64_t>(std::llround(x / scale) * scale);
}

bool written_by_tune(const std::string& path) {
  try {
    const auto j = nlohmann::json::parse(ckpt::read_small_file(path));
    return j.is_object() && j.value(kTuneMark, "") == kTuneMarkValue;
  } catch (const std::exception&) {
    return false;
  }
}

// The base config with the candidate's keys; `nvme_path` for its swap files.
// A candidate as a row of zero tune's --json report: its setup, estimate,
// outcome and, trained, its figures.
nlohmann::json report_row(const Plan& plan, const Candidate& c) {
  const Family& f = kFamilies[c.family];
  // The keys of several nodes in effect: the candidate's, or on one node the
  // base config's (which candidate_config keeps there); 0 for none.
  const nlohmann::json z = candidate_config(plan, c, "/nvme")["zero_optimization"];
  auto size_key = [&](const char* k) {
    const int64_t v = z.contains(k) && z[k].is_number_integer() ? z[k].get<int64_t>() : 0;
    return v > 1 || (v == 1 && std::string(k) == "mics_shard_size") ? v : int64_t{0};
  };
  auto flag_key = [&](const char* k) { return z.contains(k) && z[k].is_boolean() && z[k].get<bool>(); };
  nlohmann::json row = {{"stage", f.stage},
                        {"offload_optimizer", kLevelName[f.opt]},
                        {"offload_ratio", c.ratio},
                        {"max_in_cpu", c.max_in_cpu},
                        {"gradients_on_device", c.grads_on_device},
                        {"offload_param", kLevelName[f.param]},
                        {"checkpointing", kCheckpointName[c.checkpointing]},
                        {"optim_bits", c.optim_bits},
                        {"master", c.master16 ? plan.precision : std::string("fp32")},
                        {"micro_batch", c.micro_batch},
                        {"bucket_size", c.bucket},
                        {"mics_shard_size", size_key("mics_shard_size")},
                        {"zero_hpz_partition_size", size_key("zero_hpz_partition_size")},
                        {"zero_quantized_weights", flag_key("zero_quantized_weights")},
                        {"zero_quantized_gradients", flag_key("zero_quantized_gradients")},
                        {"estimate_bytes",
                         {{"device", c.estimate.device()}, {"host", c.estimate.host()}, {"nvme", c.estimate.nvme()}}},
                        {"fits_estimate", c.fits},
                        {"status", status_name(c.status)},
                        {"run_order", c.order}};
  if (c.status == Status::kTrained) {
    row["measured"] = {{"step_time_s", c.run.step_s},
                       {"step_times_s", c.run.step_times},
                       {"tokens_per_step", c.run.tokens_per_step},
                       {"tokens_per_s", c.tokens_per_s()},
                       {"samples_per_step", c.run.samples_per_step},
                       {"samples_per_s", c.samples_per_s()},
                       {"peak_bytes", {{"device", c.run.peak_device}, {"host", c.run.peak_host}, {"nvme", c.run.peak_nvme}}},
                       {"run_s", c.run.seconds}};
    if (plan.nodes > 1) {
      row["measured"]["bytes_per_step"] = {{"within_node", c.run.within_node_per_step},
                                           {"across_nodes", c.run.across_nodes_per_step},
                                           {"busiest_node_across_nodes", c.run.busiest_node_across_per_step}};
      row["measured"]["network_s"] = c.network_s;  // with --inter-node-bandwidth; tokens_per_s counts it
    }
  }
  else if (c.order)
    row["error"] = c.run.message;
  return row;
}

nlohmann::json candidate_config(const Plan& plan, const Candidate& c, const std::string& nvme_path) {
  const Family& f = kFamilies[c.family];
  nlohmann::json j = plan.base;
  j[kTuneMark] = kTuneMarkValue;
  j.erase("train_batch_size");
  j["train_micro_batch_size_per_gpu"] = c.micro_batch;
  j["gradient_accumulation_steps"] = plan.gas;
  if (plan.set_precision) {
    j["fp16"] = {{"enabled", plan.precision == "fp16"}};
    j["bf16"] = {{"enabled", plan.precision == "bf16"}};
  }
  nlohmann::json z = j.contains("zero_optimization") ? j["zero_optimization"] : nlohmann::json::object();
  for (const char* k : {"offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param", "cpu_offload_params",
                        "stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                        "prefetch_bucket_size", "max_live_parameters", "max_reuse_distance"})
    z.erase(k);
  // On more than one node the keys are the tuner's dimensions: each
  // candidate has its own, the base config's go.
  if (plan.nodes > 1) {
    for (const char* k : kCommKeyNames) z.erase(k);
    if (c.keys.mics) z["mics_shard_size"] = c.keys.mics;
    if (c.keys.hpz) z["zero_hpz_partition_size"] = c.keys.hpz;
    if (c.keys.qwz) z["zero_quantized_weights"] = true;
    if (c.keys.qgz) z["zero_quantized_gradients"] = true;
  }
  z["stage"] = f.stage;
  z["reduce_bucket_size"] = c.bucket;
  z["allgather_bucket_size"] = c.bucket;
  if (f.stage == 3) {
    z["stage3_prefetch_bucket_size"] = c.bucket;
    z["stage3_max_live_parameters"] = 2 * c.bucket;
    z["stage3_max_reuse_distance"] = 2 * c.bucket;
  }
  if (f.opt) {
    z["offload_optimizer"] = {{"device", kLevelName[f.opt]}, {"pin_memory", true}};
    if (f.opt == 2) z["offload_optimizer"]["nvme_path"] = nvme_path;
    if (c.ratio < 1.0) z["offload_optimizer"]["ratio"] = c.ratio;  // NOTE [partial offload]
    if (c.max_in_cpu > 0) z["offload_optimizer"]["max_in_cpu"] = c.max_in_cpu;  // NOTE [state placement]
    if (c.grads_on_device) z["offload_optimizer"]["gradients_on_device"] = true;  // NOTE [device gradients]
  }
  if (f.param) {
    z["offload_param"] = {{"device", kLevelName[f.param]}, {"pin_memory", true}};
    if (f.param == 2) {
      // The swap buffers hold this rank's shard of the largest layer: of
      // its MiCS shard group's ranks where it has one (config::partition_ranks).
      const int64_t mics = z.value("mics_shard_size", int64_t{0});
      const int64_t part = mics > 0 && f.stage >= 2 ? mics : plan.world();
      const int64_t shard = (plan.largest_layer + part - 1) / part;
      const int64_t buffer = round2(static_cast<double>(shard) * 1.05 + 4096);
      z["offload_param"].update({{"nvme_path", nvme_path}, {"buffer_count", 5}, {"buffer_size", buffer},
                                 {"max_in_cpu", buffer}});
    }
  }
  j["zero_optimization"] = z;
  if (c.optim_bits == 8) j["optimizer"]["params"]["optim_bits"] = 8;
  if (c.optim_bits == 16)  // NOTE [16-bit master]: DeepSpeed's keys, stages 1-3
    j["bf16"].update({{"enabled", true}, {"bf16_master_weights_and_grads", true}, {"bf16_optimizer_states", true}});
  else if (c.master16 && plan.precision == "fp16")
    j["fp16"].update({{"enabled", true}, {"fp16_master_weights_and_grads", true}});
  else if (c.master16)
    j["bf16"].update({{"enabled", true}, {"bf16_master_weights_and_grads", true}});
  if (f.opt == 2 || f.param == 2) {
    if (!j.contains("aio"))
      j["aio"] = {{"block_size", 1048576}, {"queue_depth", 8}, {"single_submit", false}, {"overlap_events", true}};
  } else {
    j.erase("aio");
  }
  if (c.checkpointing == 0 && !plan.program.empty()) {
    // A program checkpoints where its code says: its base section stays.
  } else if (c.checkpointing == 0) j.erase("activation_checkpointing");
  else
    j["activation_checkpointing"] = {{"partition_activations", c.checkpointing == 2},
                                     {"cpu_checkpointing", c.checkpointing == 2},
                                     {"contiguous_memory_optimization", false}};
  return j;
}

// "" when the run trained at `stage` with `micro_batch` as its config said;
// else what it did instead (a program that does not read {config} whole).
std::string config_mismatch(const RunReport& r, int stage, int64_t micro_batch) {
  const auto& c = r.json.at("config");
  const int got_stage = c.at("stage").get<int>();
  const int64_t got_mb = c.at("train_micro_batch_size_per_gpu").get<int64_t>();
  if (got_stage == stage && got_mb == micro_batch) return "";
  return "the program trained at stage " + std::to_string(got_stage) + " with micro-batch " + std::to_string(got_mb) +
         " where its config said stage " + std::to_string(stage) + ", micro-batch " + std::to_string(micro_batch) +
         " (" + c.value("source", std::string("?")) + "): does it take its DeepSpeed config from {config}, whole, "
         "without --batch_size or the like overriding it?";
}

int64_t free_bytes(const std::string& path) {
  struct statvfs st {};
  if (::statvfs(path.c_str(), &st) != 0) throw IoError("statvfs " + path + ": " + std::strerror(errno));
  return static_cast<int64_t>(st.f_bavail) * static_cast<int64_t>(st.f_frsize);
}


int64_t fill_host_budget(config::Config c, const std::vector<ParameterShape>& shapes, int64_t budget,
                         const std::function<int64_t(const config::Config&)>& host_of) {
  auto at = [&](int64_t m) -> const config::Config& {
    c.zero.offload_optimizer.max_in_cpu = m;
    return c;
  };
  int64_t a = 0, b = std::max<int64_t>(1, estimate_model_states(at(0), shapes).num_parameters);
  if (host_of(at(b)) <= budget) {
    a = b;
  } else {
    while (b - a > 1) {
      const int64_t mid = a + (b - a) / 2;
      (host_of(at(mid)) <= budget ? a : b) = mid;
    }
  }
  // (The swap files shrink as max_in_cpu grows.)
  auto disk = [&](int64_t m) { return estimate_model_states(at(m), shapes).nvme.optimizer_states; };
  const int64_t files = disk(a);
  if (disk(0) <= files) return 0;
  int64_t lo = 0, hi = a;  // disk(lo) > files >= disk(hi)
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (disk(mid) <= files ? hi : lo) = mid;
  }
  return hi;
}

void estimate_candidate(const Plan& plan, Candidate& c, const std::vector<ParameterShape>& shapes,
                        double activation_per_sample) {
  const Family& fam = kFamilies[c.family];
  c.max_in_cpu = 0;  // filled below
  config::LoadOptions lo;
  lo.world_size = plan.world();
  lo.auto_stand_ins = true;
  const auto cfg = config::load_string(candidate_config(plan, c, plan.nvme_path.empty() ? "/nvme" : plan.nvme_path).dump(),
                                       lo, "zero tune (" + describe(c) + ")");
  const bool nccl = plan.on_cuda && plan.world() > 1;
  auto estimate_of = [&](const config::Config& cf) {
    if (plan.program.empty()) {
      MinGPTWorkload w;
      w.n_layer = plan.n_layer;
      w.n_embd = plan.n_embd;
      w.n_head = plan.n_head;
      w.vocab_size = plan.vocab;
      w.block_size = plan.block;
      w.micro_batch = c.micro_batch;
      w.checkpointing = c.checkpointing > 0;
      return estimate_peak(cf, w, nccl);
    }
    // The activations measured in the first run, per sample.
    Activations a;
    a.device = static_cast<int64_t>(activation_per_sample * static_cast<double>(c.micro_batch));
    return estimate_peak(cf, shapes, a, nccl);
  };
  c.estimate = estimate_of(cfg);
  // NOTE [state placement]: with the optimizer on NVMe, host memory
  // keeps as many of the offloaded groups as its budget holds: the
  // same model with less to read and write each step.
  if (fam.opt == 2 && c.estimate.host() <= plan.host_budget) {
    config::Config filled = cfg;
    filled.zero.offload_optimizer.max_in_cpu = fill_host_budget(
        cfg, shapes, plan.host_budget, [&](const config::Config& f) { return estimate_of(f).host(); });
    if (filled.zero.offload_optimizer.max_in_cpu > 0) {
      c.max_in_cpu = filled.zero.offload_optimizer.max_in_cpu;
      c.estimate = estimate_of(filled);
    }
  }
  c.fits = c.estimate.device() <= plan.device_budget && c.estimate.host() <= plan.host_budget &&
           (fam.opt != 2 && fam.param != 2 ? c.estimate.nvme() == 0 : c.estimate.nvme() <= plan.nvme_budget);
  c.status = c.fits ? Status::kNotRun : Status::kDoesNotFit;
}

std::vector<Candidate> comm_variants(const Plan& plan, const Candidate& winner, const std::vector<ParameterShape>& shapes,
                                     double activation_per_sample) {
  std::vector<Candidate> out;
  const int stage = kFamilies[winner.family].stage;
  if (plan.nodes < 2 || plan.ranks < 2 || stage < 2) return out;
  const int64_t node = plan.ranks;
  std::vector<CommKeys> sets = {{node, 0, false, false}};  // MiCS: the states within a node, replicated across
  if (stage == 3) {
    sets.push_back({0, node, false, false});  // hpZ: backward's gathers within the node
    if (plan.quantized_communication) {
      sets.push_back({node, 0, true, false});
      sets.push_back({0, node, true, false});
      sets.push_back({0, node, true, true});
    }
  }
  for (const CommKeys& k : sets) {
    Candidate c = winner;
    c.keys = k;
    c.run = {};
    c.order = 0;
    c.network_s = 0;
    estimate_candidate(plan, c, shapes, activation_per_sample);
    out.push_back(std::move(c));
  }
  return out;
}

std::vector<Candidate> grid_candidates(const Plan& plan, const Grid& g, const std::vector<ParameterShape>& shapes,
                                       double activation_per_sample) {
  std::vector<Candidate> all;
  for (size_t f = 0; f < kFamilies.size(); ++f) {
    const Family& fam = kFamilies[f];
    if (!g.stages.count(fam.stage) || !g.offload.count(fam.opt) || !g.offload.count(fam.param)) continue;
    // Moments' bits and a 16-bit master: fp32 states; a bf16 master and
    // states; 8-bit moments under an fp32 master, and under a 16-bit one.
    const std::pair<int, bool> kinds[] = {{32, false}, {16, true}, {8, false}, {8, true}};
    // NOTE [partial offload]: stage 3 + optimizer offload (parameters on the device) at each ratio.
    const std::vector<double> ratios = fam.stage == 3 && fam.opt != 0 && fam.param == 0 ? plan.ratios
                                                                                       : std::vector<double>{1.0};
    // NOTE [device gradients]: stages 2-3 with the optimizer offloaded.
    const std::vector<bool> grad_places =
        fam.stage >= 2 && fam.opt != 0 ? plan.grad_places : std::vector<bool>{false};
    for (const double ratio : ratios)
    for (const bool grads_on_device : grad_places)
    for (const auto& [bits, master16] : kinds)
    for (int ck : g.checkpointing)
      for (int64_t mb : g.micro_batches)
        for (int64_t bucket : g.bucket_sizes) {
          if (bits != 32 && !plan.low_precision_states) continue;
          if (bits == 16 && plan.precision != "bf16") continue;
          if (master16 && (plan.precision == "fp32" || fam.stage == 0)) continue;  // DeepSpeed's rule: stages 1-3
          Candidate c;
          c.family = static_cast<int>(f);
          c.optim_bits = bits;
          c.master16 = master16;
          c.ratio = ratio;
          c.grads_on_device = grads_on_device;
          c.checkpointing = ck;
          c.micro_batch = mb;
          c.bucket = bucket;
          estimate_candidate(plan, c, shapes, activation_per_sample);
          all.push_back(std::move(c));
        }
  }
  return all;
}

}  // namespace zero::tools
