// zero tune's candidates (tune_plan.cpp): the families of ZeRO stage and
// offload it searches (DeepSpeed's estimator tables), a candidate and its
// outcome, the plan of a search, and the config each candidate is run with.
// tune.cpp is the command: its options, the search and its report.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "zero/runs/runs.h"
#include "zero/runtime/estimate.h"

namespace zero::tools {

/// 3.6M, 1.2B, 950K: a count for people.
std::string human_count(double n);

/// Offload levels (0 none, 1 cpu, 2 nvme) and activation checkpointing (0 none, 1 blocks, 2 cpu), by name.
extern const char* const kLevelName[3];
extern const char* const kCheckpointName[3];

struct Family {
  int stage = 0, opt = 0, param = 0;  // offload levels: 0 none, 1 cpu, 2 nvme
};
/// DeepSpeed's estimator tables (zero estimate's list).
extern const std::vector<Family> kFamilies;

std::string family_name(const Family& f);

/// The keys of more than one node (NOTE [config tuner], on nodes): MiCS
/// (mics_shard_size: the model states partitioned within a node), hpZ
/// (zero_hpz_partition_size: stage 3's secondary partition in the node), and
/// ZeRO++'s quantized collectives (zero_quantized_weights,
/// zero_quantized_gradients). None set: the plain collectives.
struct CommKeys {
  int64_t mics = 0, hpz = 0;
  bool qwz = false, qgz = false;
  bool any() const { return mics > 0 || hpz > 0 || qwz || qgz; }
  bool operator==(const CommKeys& o) const { return mics == o.mics && hpz == o.hpz && qwz == o.qwz && qgz == o.qgz; }
};
/// The zero_optimization keys of several nodes: on --nodes M > 1 the
/// tuner's to choose (a base config's are replaced by each candidate's).
inline constexpr const char* kCommKeyNames[] = {"mics_shard_size",         "mics_hierarchical_params_gather",
                                                "zero_hpz_partition_size", "zero_quantized_weights",
                                                "zero_quantized_nontrainable_weights", "zero_quantized_gradients"};
/// "mics_shard_size 2", "hpZ 2 + qwZ + qgZ", "" for none.
std::string comm_keys_name(const CommKeys& k);

enum class Status { kNotRun, kDoesNotFit, kDominated, kTrained, kOutOfMemory, kFailed, kTimedOut };
const char* status_name(Status s);

struct Candidate {
  int family = 0;  // index into kFamilies
  int checkpointing = 0;
  int optim_bits = 32;  // 8: Adam's moments in 8 bits; 16: a bf16 master and states (--allow-low-precision-states)
  bool master16 = false;  // a master in the 16-bit compute dtype (with 16; with 8: bf16/fp16 master, 8-bit moments)
  /// The optimizer states' kind as one number (optim_bits and master16).
  int states_kind() const { return optim_bits * 2 + (master16 ? 1 : 0); }
  /// offload_optimizer.ratio (stage 3 + optimizer offload: NOTE [partial
  /// offload]); 1 elsewhere.
  double ratio = 1.0;
  /// The offloaded share in thousandths (0 without optimizer offload, 1000 all of it).
  int offloaded_share() const { return kFamilies[family].opt ? static_cast<int>(ratio * 1000 + 0.5) : 0; }
  /// With the optimizer on NVMe: offload_optimizer.max_in_cpu, the
  /// elements whose states the host budget holds (NOTE [state placement]).
  int64_t max_in_cpu = 0;
  /// offload_optimizer.gradients_on_device (stages 2-3 with the optimizer
  /// offloaded: NOTE [device gradients]).
  bool grads_on_device = false;
  int64_t micro_batch = 1, bucket = 0;
  /// On more than one node: the keys tried on the winner (none in the grid).
  CommKeys keys;
  /// --inter-node-bandwidth: the seconds a step's bytes across nodes take
  /// (the busiest node's, measured, at its ranks' bandwidth), added to the
  /// measured step (0 without).
  double network_s = 0;
  PeakEstimate estimate;
  bool fits = false;
  Status status = Status::kNotRun;
  zero::runs::ProbeResult run;
  int order = 0;  // 1-based position among the runs (0: not run)
  /// The step the runs are ranked by: measured, plus network_s.
  double step_s() const { return run.step_s + network_s; }
  double tokens_per_s() const { return step_s() > 0 ? static_cast<double>(run.tokens_per_step) / step_s() : 0; }
  double samples_per_s() const { return step_s() > 0 ? static_cast<double>(run.samples_per_step) / step_s() : 0; }
  // What the runs are ranked by: tokens per second where the program says
  // its tokens per sample (InitOptions::tokens_per_sample), else samples.
  double rate() const { return run.tokens_per_step > 0 ? tokens_per_s() : samples_per_s(); }
  // The work that costs time besides the model's own, per component; 8-bit
  // or bf16 states count as one (their numerics differ from the base config's), so
  // they are proposed only where they fit what fp32 states do not, or take a
  // larger micro-batch. The offloaded share is a component of its own: a
  // partial offload moves and steps less on the CPU than the whole. The
  // gradients on the device are one too: their copies to the host wait for
  // the step rather than run behind backward, so they are proposed where
  // they fit what host gradients do not.
  std::array<int, 7> work() const {
    const Family& f = kFamilies[family];
    return {f.stage == 3 ? 1 : 0, f.opt, f.param, checkpointing, optim_bits != 32 ? 1 : 0, grads_on_device ? 1 : 0,
            offloaded_share()};
  }
  /// The components but the share, which orders candidates of one sum.
  int work_sum() const {
    const auto w = work();
    return w[0] + w[1] + w[2] + w[3] + w[4] + w[5];
  }
};

/// a beats b on every count: no more work in any component, a micro-batch at
/// least as large, and better in one of them.
bool dominates(const Candidate& a, const Candidate& b);
std::string describe(const Candidate& c);
/// 0.5, 0.25: an offload_optimizer.ratio for people.
std::string ratio_text(double ratio);

/// "1,2,4" -> its items (nullopt for an empty item or list).
std::optional<std::vector<std::string>> split_list(const std::string& v);
/// A whole number from 1 to max_value.
std::optional<int64_t> parse_positive(const std::string& v, int64_t max_value);
/// 2e6, 2000000, 1.5e7: a positive element count.
std::optional<int64_t> parse_elements(const std::string& v);
/// "0.25,0.5,1": offload_optimizer.ratio values, each in (0, 1], sorted and
/// without repeats; nullopt with `problem` (what was expected) otherwise.
std::optional<std::vector<double>> parse_ratios(const std::string& v, std::string& problem);

/// Two significant digits: configs read 1200000, not 1193046.
int64_t round2(double x);

struct Plan {
  int64_t n_layer = 0, n_embd = 0, vocab = 0, block = 0, n_head = 1;
  int64_t ranks = 1;  // per node
  /// --nodes: nodes of `ranks` ranks, emulated on this machine (zero launch
  /// --emulate_nodes); more than one makes the keys of CommKeys dimensions.
  int64_t nodes = 1;
  int64_t world() const { return ranks * nodes; }
  /// --inter-node-bandwidth, bytes a second each rank sends to other nodes
  /// (0: runs are ranked by their step here alone).
  double inter_node_bandwidth = 0;
  bool quantized_communication = false;  // --allow-quantized-communication: qwZ and qgZ too
  int64_t device_budget = 0, host_budget = 0, nvme_budget = 0;
  std::string nvme_path;  // the user's (written into the winner); empty: no NVMe
  std::string precision;  // fp32 | fp16 | bf16
  std::optional<std::string> device;
  bool on_cuda = false;
  int64_t steps = 4, gas = 1;
  nlohmann::json base;
  int64_t largest_layer = 0;  // elements of the largest stage-3 layer
  std::vector<std::string> program;  // -- PROGRAM ARGS (empty: minGPT)
  bool set_precision = true;         // a program keeps its base config's precision unless --precision says
  bool low_precision_states = false;  // --allow-low-precision-states
  std::vector<double> ratios{0.25, 0.5, 0.75, 1.0};  // --ratios: stage 3 + optimizer offload's offload_optimizer.ratio
  std::vector<bool> grad_places{false, true};  // --gradients: host (false), device (true)
};

/// zero tune --help's text (tune_usage.cpp).
extern const char* const kTuneUsage;
/// zero estimate --help's text (estimate_usage.cpp).
extern const char* const kEstimateUsage;

/// The key a tune's files carry (a '_' key: a comment to DeepSpeed and
/// zero), so that a later tune replaces them and nothing else without --force.
inline constexpr const char* kTuneMark = "_written_by";
inline constexpr const char* kTuneMarkValue = "zero tune";
bool written_by_tune(const std::string& path);

/// The candidate's row of the --json report.
nlohmann::json report_row(const Plan& plan, const Candidate& c);
/// The base config with the candidate's keys; `nvme_path` for its swap files.
nlohmann::json candidate_config(const Plan& plan, const Candidate& c, const std::string& nvme_path);
/// "" when the run trained at `stage` with `micro_batch` as its config said;
/// else what it did instead (a program that does not read {config} whole).
std::string config_mismatch(const RunReport& r, int stage, int64_t micro_batch);
/// Bytes free in `path`'s file system. Throws IoError.
int64_t free_bytes(const std::string& path);

/// What zero tune's grid spans besides the plan's own lists (its options).
struct Grid {
  std::set<int> stages, offload, checkpointing;  // offload: kLevelName's indices
  std::vector<int64_t> micro_batches, bucket_sizes;
};

/// Step 1 of zero tune: every candidate of the grid (the families in
/// `stages` x `offload`, the ratios, the gradients' places, the states'
/// kinds, checkpointing, micro-batches, buckets), each with its estimated
/// peak (minGPT's, or `shapes` with the activations measured per sample)
/// and whether it fits the budgets; with the optimizer on NVMe, max_in_cpu
/// filled to the host budget.
std::vector<Candidate> grid_candidates(const Plan& plan, const Grid& grid, const std::vector<ParameterShape>& shapes,
                                       double activation_per_sample);

/// The candidate's estimated peak under the plan's budgets (`c.estimate`,
/// `c.fits`, `c.status` kDoesNotFit when over one); with the optimizer on
/// NVMe, `c.max_in_cpu` filled to the host budget first.
void estimate_candidate(const Plan& plan, Candidate& c, const std::vector<ParameterShape>& shapes,
                        double activation_per_sample);

/// On more than one node, the winner with each set of keys that applies
/// to its stage (MiCS within a node at stages 2-3; at stage 3 hpZ, and with
/// --allow-quantized-communication qwZ + MiCS, qwZ + hpZ and qwZ + hpZ +
/// qgZ), each estimated; none on one node or one rank a node.
std::vector<Candidate> comm_variants(const Plan& plan, const Candidate& winner, const std::vector<ParameterShape>& shapes,
                                     double activation_per_sample);

/// NOTE [state placement]: with the optimizer on NVMe, the largest
/// offload_optimizer.max_in_cpu under which `host_of(config)` (host bytes,
/// as the caller estimates them) stays within `budget`, bisected over
/// elements, then lowered to the elements of the groups it keeps (the
/// smallest value with the same swap files for `shapes`: a smaller model's
/// groups then take no more host memory). 0 where nothing more fits.
int64_t fill_host_budget(config::Config config, const std::vector<ParameterShape>& shapes, int64_t budget,
                         const std::function<int64_t(const config::Config&)>& host_of);

}  // namespace zero::tools
