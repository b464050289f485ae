// The typed, validated form of a DeepSpeed JSON config.
//
// Only config/ sees JSON: everything else reads these structs. Defaults are
// DeepSpeed's (v0.19.6, see ../shared/ds_config_rules.md); sizes that
// DeepSpeed writes as floats (5e8) are integers here. Structs are plain
// values: copyable, no hidden state, safe to read from any thread.
#pragma once

#include <array>
#include <functional>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace zero::config {

/// Where a resolved value came from, for `zero config check`.
/// kAuto: "auto" in the file, left to the program (AutoValues) and checked
/// with a stand-in value (LoadOptions::auto_stand_ins, `zero config check`).
enum class Origin { kGiven, kDefault, kDerived, kAuto };

/// One resolved value: its JSON path ("zero_optimization.stage"), the value as
/// JSON text, and its origin.
struct ResolvedValue {
  std::string path;
  std::string value;
  Origin origin = Origin::kDefault;
};

/// The batch triangle, resolved against the data-parallel world size as
/// DeepSpeed does (floor division, then train_batch_size == mbs * gas * ws).
struct BatchConfig {
  int64_t train_batch_size = 0;
  int64_t train_micro_batch_size_per_gpu = 0;
  int64_t gradient_accumulation_steps = 1;
};

enum class OptimizerType { kAdam, kAdamW, kAdagrad, kLion };

/// `optimizer` section. DeepSpeed's type names are case-insensitive.
/// "Adam" with adam_w_mode (default true) is decoupled weight decay, as in
/// DeepSpeed's FusedAdam/CPUAdam; "AdamW" always is.
struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdamW;
  std::string type_name = "AdamW";  // as written in the file
  double lr = 1e-3;
  std::array<double, 2> betas{0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adam_w_mode = true;
  bool bias_correction = true;
  bool amsgrad = false;       // accepted; true is refused (no fused kernel does it)
  double initial_accumulator_value = 0.0;  // Adagrad
  /// Adam/AdamW: bits a moment is kept in, bitsandbytes' name: 32 (fp32) or
  /// 8 (block-wise quantized, NOTE [8-bit states] in optim/).
  int optim_bits = 32;
  /// With optim_bits 8: a parameter of fewer elements keeps fp32 moments
  /// (bitsandbytes' min_8bit_size, its default), and so does every 8-bit
  /// block that holds an element of one (NOTE [8-bit states] in optim/).
  int64_t min_8bit_size = 4096;
  /// bf16.bf16_optimizer_states (with bf16.enabled and its master): the
  /// states are bf16, one element per parameter (set by the config reader).
  bool bf16_states = false;
};

enum class SchedulerType { kWarmupLR, kWarmupDecayLR, kWarmupCosineLR, kOneCycle, kLRRangeTest };
enum class WarmupType { kLog, kLinear };

/// `scheduler` section; only the fields of `type` are meaningful.
/// Field names and defaults are those of deepspeed/runtime/lr_schedules.py.
struct SchedulerConfig {
  SchedulerType type = SchedulerType::kWarmupLR;
  std::string type_name = "WarmupLR";
  // WarmupLR / WarmupDecayLR
  double warmup_min_lr = 0.0;
  // none: the optimizer's lr for WarmupLR; 0.001 for WarmupDecayLR, as in
  // DeepSpeed, whose WarmupDecayLR signature has that default.
  std::optional<double> warmup_max_lr;
  int64_t warmup_num_steps = 1000;
  WarmupType warmup_type = WarmupType::kLog;
  // WarmupDecayLR / WarmupCosineLR
  int64_t total_num_steps = 0;
  // WarmupCosineLR
  double warmup_min_ratio = 0.0;
  double cos_min_ratio = 1e-4;
  // OneCycle
  double cycle_min_lr = 0.0;
  double cycle_max_lr = 0.0;
  double decay_lr_rate = 0.0;
  int64_t cycle_first_step_size = 2000;
  std::optional<int64_t> cycle_second_step_size;  // none: equal to the first
  int64_t cycle_first_stair_count = 0;
  std::optional<int64_t> cycle_second_stair_count;  // none: equal to the first
  int64_t decay_step_size = 0;
  bool cycle_momentum = true;
  double cycle_min_mom = 0.8;
  double cycle_max_mom = 0.9;
  double decay_mom_rate = 0.0;
  // LRRangeTest
  double lr_range_test_min_lr = 1e-3;
  int64_t lr_range_test_step_size = 2000;
  double lr_range_test_step_rate = 1.0;
  bool lr_range_test_staircase = false;
};

/// `fp16` section. loss_scale 0 means dynamic scaling.
struct Fp16Config {
  bool enabled = false;
  bool auto_cast = false;
  double loss_scale = 0.0;
  int64_t initial_scale_power = 16;
  int64_t loss_scale_window = 1000;
  int64_t hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1.0;
  bool fp16_master_weights_and_grads = false;
  /// zero's extension: a 16-bit master is written back with stochastic
  /// rounding (NOTE [16-bit master] in optim/); false rounds to nearest, as
  /// DeepSpeed does.
  bool stochastic_rounding = true;
};

/// `bf16` section (or the legacy `bfloat16` when `bf16` is absent).
struct Bf16Config {
  bool enabled = false;
  bool immediate_grad_update = false;
  bool check_grad_overflow = true;
  bool bf16_master_weights_and_grads = false;
  bool bf16_optimizer_states = false;
  /// As Fp16Config::stochastic_rounding, for the bf16 master and states.
  bool stochastic_rounding = true;
};

enum class OffloadDevice { kNone, kCpu, kNvme };

/// `zero_optimization.offload_param`.
struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;
  int64_t buffer_count = 5;
  int64_t buffer_size = 100000000;
  int64_t max_in_cpu = 1000000000;
  bool pin_memory = true;
};

/// `zero_optimization.offload_optimizer`.
struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;
  int64_t buffer_count = 4;
  bool pin_memory = true;
  bool pipeline_read = false;
  bool pipeline_write = false;
  bool fast_init = false;
  double ratio = 1.0;
  /// SuperOffload: the CPU step of each sub-group starts during the boundary
  /// backward, validated afterwards (stage 3 with device cpu and no
  /// offload_param; NOTE [speculative step]).
  bool super_offload = false;
  /// zero's own: the gradient partition stays on the device (stages 2-3;
  /// NOTE [device gradients]).
  bool gradients_on_device = false;
  /// zero's own, named after offload_param's: with nvme, elements of the
  /// offloaded partition whose master and states stay in host memory, the
  /// first groups (NOTE [state placement]); 0: all on NVMe.
  int64_t max_in_cpu = 0;
};

/// `zero_optimization`; the stage3_* keys under their unprefixed field names.
struct ZeroConfig {
  int stage = 0;
  bool contiguous_gradients = true;
  bool reduce_scatter = true;
  int64_t reduce_bucket_size = 500000000;
  bool use_multi_rank_bucket_allreduce = true;
  bool allgather_partitions = true;
  int64_t allgather_bucket_size = 500000000;
  bool overlap_comm = false;  // DeepSpeed: unset means true iff stage == 3
  bool load_from_fp32_weights = true;
  bool elastic_checkpoint = false;
  OffloadParamConfig offload_param;          // device kNone when absent
  OffloadOptimizerConfig offload_optimizer;  // device kNone when absent
  int64_t sub_group_size = 1000000000;
  int64_t prefetch_bucket_size = 50000000;
  int64_t param_persistence_threshold = 100000;
  int64_t model_persistence_threshold = std::numeric_limits<int64_t>::max();
  int64_t max_live_parameters = 1000000000;
  int64_t max_reuse_distance = 1000000000;
  bool gather_16bit_weights_on_model_save = false;
  int64_t module_granularity_threshold = 0;
  bool use_all_reduce_for_fetch_params = false;
  bool allgather_sequential = false;
  bool ignore_unused_parameters = true;
  bool round_robin_gradients = false;
  /// ZeRO++ (stage 3). hpZ: groups of this many consecutive ranks keep a
  /// secondary partition, so later gathers stay in the group (NOTE [hpZ]).
  int64_t zero_hpz_partition_size = 1;
  /// qwZ: layers' gathers send block-quantized int8 weights (NOTE
  /// [quantized gather]), in blocks of zero_quantized_weights_block_size
  /// elements (zero's own key; DeepSpeed's 8000 by default).
  bool zero_quantized_weights = false;
  int64_t zero_quantized_weights_block_size = 8000;
  /// qgZ: gradients reduced in two quantized hops, within the node then
  /// across (NOTE [quantized gradients]), in blocks of the same size.
  bool zero_quantized_gradients = false;
  /// MiCS (stages 2-3, NOTE [MiCS]): the model states are partitioned
  /// within groups of this many consecutive ranks and replicated across the
  /// groups; -1 (or 0): every rank's partition is the world's.
  int64_t mics_shard_size = -1;
  /// MiCS at stage 3: a layer's gather over a shard group that spans nodes
  /// goes in two hops, across the nodes (one shard a rank), then within each
  /// node.
  bool mics_hierarchical_params_gather = false;
};

/// `aio` section (NVMe swapping). intra_op_parallelism also read from the
/// legacy `thread_count`.
struct AioConfig {
  int64_t block_size = 1048576;
  int64_t queue_depth = 8;
  int64_t intra_op_parallelism = 1;
  bool single_submit = false;
  bool overlap_events = true;
  bool use_gds = false;
};

/// `activation_checkpointing` section.
struct ActivationCheckpointingConfig {
  bool partition_activations = false;
  bool contiguous_memory_optimization = false;
  bool cpu_checkpointing = false;
  std::optional<int64_t> number_checkpoints;
  bool synchronize_checkpoint_boundary = false;
  bool profile = false;
};

/// A fully resolved and validated DeepSpeed config.
struct Config {
  std::string source;  // the file path, or "<string>"
  BatchConfig batch;
  int64_t world_size = 1;  // the data-parallel world size the triangle was resolved for
  std::optional<OptimizerConfig> optimizer;  // none: no optimizer section
  std::optional<SchedulerConfig> scheduler;  // none: constant lr
  Fp16Config fp16;
  Bf16Config bf16;
  double gradient_clipping = 1.0;  // 0 disables
  bool prescale_gradients = false;
  double gradient_predivide_factor = 1.0;
  std::string gradient_allreduce_op = "mean";
  ZeroConfig zero;
  AioConfig aio;
  ActivationCheckpointingConfig activation_checkpointing;
  std::optional<int64_t> steps_per_print;  // none: DeepSpeed prints nothing periodic
  bool wall_clock_breakdown = false;
  bool memory_breakdown = false;
  bool zero_allow_untested_optimizer = false;
  bool zero_force_ds_cpu_optimizer = true;
  std::optional<std::string> communication_data_type;  // "fp16" | "bf16" | "fp32"
  std::optional<std::string> grad_accum_dtype;         // data_types.grad_accum_dtype

  std::vector<std::string> warnings;  // deprecations and ignored sections, one line each
  std::vector<ResolvedValue> resolved;  // every value the runtime uses, for `config check`
  std::string canonical_json;  // the resolved config as sorted, compact JSON (for hashing)

  bool mixed_precision() const { return fp16.enabled || bf16.enabled; }
};

/// Values the program knows and a DeepSpeed config may leave as "auto" (the
/// Hugging Face placeholder). Unset members leave "auto" unresolved, which is
/// an error naming the key.
struct AutoValues {
  std::optional<int64_t> train_micro_batch_size_per_gpu;
  std::optional<int64_t> gradient_accumulation_steps;
  std::optional<double> gradient_clipping;
  std::optional<double> lr;
  std::optional<std::array<double, 2>> betas;
  std::optional<double> eps;
  std::optional<double> weight_decay;
  std::optional<int64_t> total_num_steps;
  std::optional<int64_t> warmup_num_steps;
  std::optional<std::string> precision;  // "fp32" | "fp16" | "bf16": fills fp16/bf16.enabled
  std::optional<int64_t> hidden_size;    // fills bucket sizes and stage3 thresholds
};

struct LoadOptions {
  int64_t world_size = 1;
  AutoValues auto_values;
  /// For checking a config on its own (`zero config check`): each AutoValues
  /// member left unset gets a stand-in (micro-batch 1, lr 1e-3, 1000 steps,
  /// ...), so a file with "auto" is checked in full; values filled from a
  /// stand-in are recorded with Origin::kAuto. A micro-batch or accumulation
  /// stand-in gives way to a train_batch_size the file gives.
  bool auto_stand_ins = false;
  /// Checked as training reads it (zero::initialize, `zero config check`):
  /// a config with no optimizer section gets a warning that the program
  /// must pass its own (InitOptions::optimizer, NOTE [client optimizer]).
  /// Off for tools that read a config for other keys (the estimator's layouts).
  bool for_training = false;
  /// How the caller fills AutoValues member `name` ("lr"), for the message
  /// of an "auto" left unfilled: a program's flag ("--lr"), `zero config
  /// check`'s "--auto lr=VALUE". Null: "AutoValues::lr" (C++ callers).
  std::function<std::string(const std::string& name)> auto_hint;
};

/// Parses, validates and resolves a DeepSpeed config file. Throws
/// zero::ConfigError listing every problem found (file, JSON path, expected,
/// found); I/O failures are zero::IoError naming the path. Warnings are in
/// Config::warnings (the caller decides where to log them).
Config load_file(const std::string& path, const LoadOptions& options = {});

/// Same, from JSON text; `name` stands in for the file name in messages.
Config load_string(const std::string& json_text, const LoadOptions& options = {},
                   const std::string& name = "<string>");

/// The ranks a partition of the model states spans (NOTE [MiCS]): the
/// world, or a MiCS shard group (mics_shard_size at stages 2-3).
int64_t partition_ranks(const Config& config);

/// Human-readable listing of the resolved config: one line per value with its
/// origin (given, default, derived), then the warnings.
std::string describe(const Config& config);

const char* to_string(OffloadDevice device);
const char* to_string(Origin origin);

}  // namespace zero::config
