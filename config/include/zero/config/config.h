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
  std::string path;   ///< The dotted JSON path, e.g. "zero_optimization.stage".
  std::string value;  ///< The value as compact JSON text ("null" for a value left unset).
  Origin origin = Origin::kDefault;  ///< Given in the file, a default, derived from other keys, or "auto".
};

/// The batch triangle, resolved against the data-parallel world size as
/// DeepSpeed does (floor division, then train_batch_size == mbs * gas * ws).
struct BatchConfig {
  /// train_batch_size: samples per optimizer step over all ranks (micro-batch
  /// x accumulation steps x data-parallel ranks).
  int64_t train_batch_size = 0;
  /// train_micro_batch_size_per_gpu: samples a rank runs in one forward and backward.
  int64_t train_micro_batch_size_per_gpu = 0;
  /// gradient_accumulation_steps: micro-steps whose gradients are summed before one optimizer step.
  int64_t gradient_accumulation_steps = 1;
};

/// optimizer.type: the optimizers zero implements.
enum class OptimizerType { kAdam, kAdamW, kAdagrad, kLion };

/// `optimizer` section. DeepSpeed's type names are case-insensitive.
/// "Adam" with adam_w_mode (default true) is decoupled weight decay, as in
/// DeepSpeed's FusedAdam/CPUAdam; "AdamW" always is.
struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdamW;  ///< optimizer.type.
  std::string type_name = "AdamW";  ///< optimizer.type as written in the file
  double lr = 1e-3;  ///< optimizer.params.lr: learning rate (default 1e-3; 1e-2 for Adagrad).
  /// optimizer.params.betas: Adam's and Lion's moment decay rates, each at
  /// least 0 and below 1 (default 0.9, 0.999; 0.9, 0.99 for Lion). Not read
  /// for Adagrad.
  std::array<double, 2> betas{0.9, 0.999};
  /// optimizer.params.eps: added to the denominator for numerical stability
  /// (default 1e-8; 1e-10 for Adagrad). Not read for Lion.
  double eps = 1e-8;
  double weight_decay = 0.0;  ///< optimizer.params.weight_decay: weight decay (decoupled for AdamW and adam_w_mode).
  /// optimizer.params.adam_w_mode (Adam, AdamW): Adam with decoupled weight
  /// decay; always true for AdamW (false there is warned and ignored).
  bool adam_w_mode = true;
  bool bias_correction = true;  ///< optimizer.params.bias_correction (Adam, AdamW): bias correction of the moments.
  bool amsgrad = false;       ///< optimizer.params.amsgrad: accepted; true is refused (no fused kernel does it)
  /// optimizer.params.initial_accumulator_value: Adagrad's sum of squares starts here.
  double initial_accumulator_value = 0.0;
  /// optimizer.params.optim_bits. Adam/AdamW: bits a moment is kept in,
  /// bitsandbytes' name: 32 (fp32) or 8 (block-wise quantized, NOTE [8-bit
  /// states] in optim/).
  int optim_bits = 32;
  /// optimizer.params.min_8bit_size, in elements. With optim_bits 8: a
  /// parameter of fewer elements keeps fp32 moments (bitsandbytes'
  /// min_8bit_size, its default), and so does every 8-bit block that holds
  /// an element of one (NOTE [8-bit states] in optim/).
  int64_t min_8bit_size = 4096;
  /// bf16.bf16_optimizer_states (with bf16.enabled and its master): the
  /// states are bf16, one element per parameter (set by the config reader).
  bool bf16_states = false;
};

/// scheduler.type: the learning-rate schedules zero implements (DeepSpeed's
/// names, case-sensitive).
enum class SchedulerType { kWarmupLR, kWarmupDecayLR, kWarmupCosineLR, kOneCycle, kLRRangeTest };
/// scheduler.params.warmup_type: the shape of the warm-up, log or linear.
enum class WarmupType { kLog, kLinear };

/// `scheduler` section; only the fields of `type` are meaningful.
/// Field names and defaults are those of deepspeed/runtime/lr_schedules.py.
struct SchedulerConfig {
  SchedulerType type = SchedulerType::kWarmupLR;  ///< scheduler.type.
  std::string type_name = "WarmupLR";  ///< scheduler.type as written (it must match DeepSpeed's spelling).
  // WarmupLR / WarmupDecayLR
  double warmup_min_lr = 0.0;  ///< scheduler.params.warmup_min_lr: the learning rate warm-up starts from.
  /// scheduler.params.warmup_max_lr: the learning rate warm-up reaches.
  /// none: the optimizer's lr for WarmupLR; 0.001 for WarmupDecayLR, as in
  /// DeepSpeed, whose WarmupDecayLR signature has that default.
  std::optional<double> warmup_max_lr;
  /// scheduler.params.warmup_num_steps: steps of warm-up (WarmupLR,
  /// WarmupDecayLR, WarmupCosineLR).
  int64_t warmup_num_steps = 1000;
  /// scheduler.params.warmup_type: the warm-up's shape (WarmupLR,
  /// WarmupDecayLR, WarmupCosineLR).
  WarmupType warmup_type = WarmupType::kLog;
  // WarmupDecayLR / WarmupCosineLR
  /// scheduler.params.total_num_steps: the schedule's length in steps, for
  /// its decay (required by both).
  int64_t total_num_steps = 0;
  // WarmupCosineLR
  double warmup_min_ratio = 0.0;  ///< scheduler.params.warmup_min_ratio: warm-up starts at this fraction of lr.
  double cos_min_ratio = 1e-4;    ///< scheduler.params.cos_min_ratio: the cosine ends at this fraction of lr.
  // OneCycle
  double cycle_min_lr = 0.0;   ///< scheduler.params.cycle_min_lr (required): the cycle's lowest learning rate.
  double cycle_max_lr = 0.0;   ///< scheduler.params.cycle_max_lr (required): the cycle's highest learning rate.
  double decay_lr_rate = 0.0;  ///< scheduler.params.decay_lr_rate: learning-rate decay after the cycle.
  int64_t cycle_first_step_size = 2000;  ///< scheduler.params.cycle_first_step_size: steps of the rising half.
  /// scheduler.params.cycle_second_step_size: steps of the falling half;
  /// none: equal to the first.
  std::optional<int64_t> cycle_second_step_size;
  /// scheduler.params.cycle_first_stair_count: stairs in the rising half (0: smooth).
  int64_t cycle_first_stair_count = 0;
  /// scheduler.params.cycle_second_stair_count: stairs in the falling half;
  /// none: equal to the first.
  std::optional<int64_t> cycle_second_stair_count;
  int64_t decay_step_size = 0;  ///< scheduler.params.decay_step_size: steps between decays after the cycle.
  /// scheduler.params.cycle_momentum: cycle the momentum (beta1) against the learning rate.
  bool cycle_momentum = true;
  double cycle_min_mom = 0.8;   ///< scheduler.params.cycle_min_mom: the lowest momentum.
  double cycle_max_mom = 0.9;   ///< scheduler.params.cycle_max_mom: the highest momentum.
  double decay_mom_rate = 0.0;  ///< scheduler.params.decay_mom_rate: momentum decay after the cycle.
  // LRRangeTest
  /// scheduler.params.lr_range_test_min_lr: the learning rate the test starts
  /// from; lr = min_lr * (1 + step_rate * interval), interval = steps / step_size.
  double lr_range_test_min_lr = 1e-3;
  int64_t lr_range_test_step_size = 2000;  ///< scheduler.params.lr_range_test_step_size: steps per interval.
  double lr_range_test_step_rate = 1.0;    ///< scheduler.params.lr_range_test_step_rate: lr growth per interval.
  /// scheduler.params.lr_range_test_staircase: the interval is rounded down
  /// to a whole number, so lr rises in steps.
  bool lr_range_test_staircase = false;
};

/// `fp16` section. loss_scale 0 means dynamic scaling.
struct Fp16Config {
  bool enabled = false;    ///< fp16.enabled: train in fp16 with loss scaling.
  /// fp16.auto_cast: cast the model's inputs to fp16; zero does not (true is
  /// warned and ignored: the program casts its inputs).
  bool auto_cast = false;
  double loss_scale = 0.0;  ///< fp16.loss_scale: a fixed loss scale; 0: dynamic.
  int64_t initial_scale_power = 16;  ///< fp16.initial_scale_power: the dynamic loss scale starts at 2 to this power.
  int64_t loss_scale_window = 1000;  ///< fp16.loss_scale_window: steps without overflow before the scale grows.
  int64_t hysteresis = 2;  ///< fp16.hysteresis: overflows tolerated before the scale shrinks.
  /// fp16.consecutive_hysteresis: the hysteresis counter refills after a step without overflow.
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1.0;  ///< fp16.min_loss_scale: the dynamic scale's floor (an integer in the file).
  /// fp16.fp16_master_weights_and_grads: keep the master weights and
  /// gradients in fp16 (stages 1-3 only).
  bool fp16_master_weights_and_grads = false;
  /// fp16.stochastic_rounding, zero's extension: a 16-bit master is written
  /// back with stochastic rounding (NOTE [16-bit master] in optim/); false
  /// rounds to nearest, as DeepSpeed does.
  bool stochastic_rounding = true;
};

/// `bf16` section (or the legacy `bfloat16` when `bf16` is absent).
struct Bf16Config {
  bool enabled = false;  ///< bf16.enabled: train in bf16 (no loss scaling).
  /// bf16.immediate_grad_update: apply gradients to the master as they are
  /// reduced; no effect in zero (true is warned).
  bool immediate_grad_update = false;
  /// bf16.check_grad_overflow: check bf16 gradients for inf and NaN before the step.
  bool check_grad_overflow = true;
  /// bf16.bf16_master_weights_and_grads: keep the master weights and
  /// gradients in bf16 (stages 1-3 only).
  bool bf16_master_weights_and_grads = false;
  /// bf16.bf16_optimizer_states: keep the optimizer states (moments) in bf16;
  /// needs bf16_master_weights_and_grads and stage 1-3.
  bool bf16_optimizer_states = false;
  /// bf16.stochastic_rounding: as Fp16Config::stochastic_rounding, for the
  /// bf16 master and states.
  bool stochastic_rounding = true;
};

/// The `device` of offload_param and offload_optimizer: "none" (kept on the
/// accelerator), "cpu" or "nvme".
enum class OffloadDevice { kNone, kCpu, kNvme };

/// `zero_optimization.offload_param`.
struct OffloadParamConfig {
  /// zero_optimization.offload_param.device: where the stage-3 parameter
  /// shards live.
  OffloadDevice device = OffloadDevice::kNone;
  /// zero_optimization.offload_param.nvme_path: folder of the parameter swap
  /// files; required with nvme, empty when unset.
  std::string nvme_path;
  /// zero_optimization.offload_param.buffer_count: pinned buffers for
  /// parameter swap-ins (at least 1 with nvme).
  int64_t buffer_count = 5;
  /// zero_optimization.offload_param.buffer_size: elements per parameter
  /// swap buffer (at least 1 with nvme).
  int64_t buffer_size = 100000000;
  /// zero_optimization.offload_param.max_in_cpu: with nvme, parameter
  /// elements kept in host memory.
  int64_t max_in_cpu = 1000000000;
  /// zero_optimization.offload_param.pin_memory: page-locked host memory for
  /// the offloaded parameters.
  bool pin_memory = true;
};

/// `zero_optimization.offload_optimizer`.
struct OffloadOptimizerConfig {
  /// zero_optimization.offload_optimizer.device: where the fp32 master and
  /// the optimizer states live and step.
  OffloadDevice device = OffloadDevice::kNone;
  /// zero_optimization.offload_optimizer.nvme_path: folder of the
  /// optimizer-state swap files; required with nvme, empty when unset.
  std::string nvme_path;
  /// zero_optimization.offload_optimizer.buffer_count: pinned buffers for
  /// optimizer-state swaps (at least 1 with nvme).
  int64_t buffer_count = 4;
  /// zero_optimization.offload_optimizer.pin_memory: page-locked host memory
  /// for the offloaded states.
  bool pin_memory = true;
  /// zero_optimization.offload_optimizer.pipeline_read: with nvme, read the
  /// next sub-group's states while one steps.
  bool pipeline_read = false;
  /// zero_optimization.offload_optimizer.pipeline_write: with nvme, write a
  /// sub-group's states back while the next steps.
  bool pipeline_write = false;
  /// zero_optimization.offload_optimizer.fast_init: with nvme, skip writing
  /// the initial states through the swap pipeline; no effect in zero (true
  /// is warned).
  bool fast_init = false;
  /// zero_optimization.offload_optimizer.ratio: stage 3 only, the share (0 to
  /// 1) of the optimizer states offloaded; the rest step on the device.
  double ratio = 1.0;
  /// zero_optimization.offload_optimizer.super_offload. SuperOffload: the
  /// CPU step of each sub-group starts during the boundary backward,
  /// validated afterwards (stage 3 with device cpu and no offload_param;
  /// NOTE [speculative step]).
  bool super_offload = false;
  /// zero_optimization.offload_optimizer.gradients_on_device, zero's own:
  /// the gradient partition stays on the device (stages 2-3; NOTE [device
  /// gradients]).
  bool gradients_on_device = false;
  /// zero_optimization.offload_optimizer.max_in_cpu, zero's own, named after
  /// offload_param's: with nvme, elements of the offloaded partition whose
  /// master and states stay in host memory, the first groups (NOTE [state
  /// placement]); 0: all on NVMe.
  int64_t max_in_cpu = 0;
};

/// `zero_optimization`; the stage3_* keys under their unprefixed field names.
struct ZeroConfig {
  /// zero_optimization.stage: 0: data parallel; 1: optimizer states
  /// partitioned; 2: and gradients; 3: and parameters.
  int stage = 0;
  /// zero_optimization.contiguous_gradients: copy gradients into one
  /// contiguous buffer as they are produced.
  bool contiguous_gradients = true;
  /// zero_optimization.reduce_scatter: reduce gradients with reduce-scatter
  /// (each rank gets its partition) rather than all-reduce.
  bool reduce_scatter = true;
  /// zero_optimization.reduce_bucket_size: elements reduced in one collective.
  int64_t reduce_bucket_size = 500000000;
  /// zero_optimization.use_multi_rank_bucket_allreduce: stages 1-2, all-reduce
  /// a bucket across ranks in one call; zero always does (false is warned).
  bool use_multi_rank_bucket_allreduce = true;
  /// zero_optimization.allgather_partitions: stages 1-2, gather the updated
  /// partitions with all-gather; zero always does (false is warned).
  bool allgather_partitions = true;
  /// zero_optimization.allgather_bucket_size: elements gathered at once after
  /// the step (the legacy top-level allgather_size with a boolean
  /// zero_optimization).
  int64_t allgather_bucket_size = 500000000;
  /// zero_optimization.overlap_comm: overlap gradient reduction with the
  /// backward pass. DeepSpeed: unset means true iff stage == 3
  bool overlap_comm = false;
  /// zero_optimization.load_from_fp32_weights: initialise the fp32 master
  /// from the checkpoint's fp32 weights; zero always does (false is warned).
  bool load_from_fp32_weights = true;
  /// zero_optimization.elastic_checkpoint: checkpoints that load at another
  /// world size; zero's always do (true is warned as without effect).
  bool elastic_checkpoint = false;
  OffloadParamConfig offload_param;          ///< zero_optimization.offload_param; device kNone when absent
  OffloadOptimizerConfig offload_optimizer;  ///< zero_optimization.offload_optimizer; device kNone when absent
  /// zero_optimization.sub_group_size: elements of a sub-group, the unit the
  /// offloaded optimizer steps and swaps; 0 in the file is read as 1e9.
  int64_t sub_group_size = 1000000000;
  /// zero_optimization.stage3_prefetch_bucket_size: stage 3, parameter
  /// elements gathered ahead of use.
  int64_t prefetch_bucket_size = 50000000;
  /// zero_optimization.stage3_param_persistence_threshold: stage 3,
  /// parameters of at most this many elements stay whole on every rank.
  int64_t param_persistence_threshold = 100000;
  /// zero_optimization.stage3_model_persistence_threshold: stage 3, a cap on
  /// the elements kept whole by the persistence threshold.
  int64_t model_persistence_threshold = std::numeric_limits<int64_t>::max();
  /// zero_optimization.stage3_max_live_parameters: stage 3, gathered
  /// parameter elements a rank may hold at once.
  int64_t max_live_parameters = 1000000000;
  /// zero_optimization.stage3_max_reuse_distance: stage 3, a parameter used
  /// again within this many elements is not released.
  int64_t max_reuse_distance = 1000000000;
  /// zero_optimization.stage3_gather_16bit_weights_on_model_save (or the
  /// deprecated stage3_gather_fp16_weights_on_model_save): stage 3, gather
  /// the full 16-bit weights when the model is saved.
  bool gather_16bit_weights_on_model_save = false;
  /// zero_optimization.stage3_module_granularity_threshold: no effect in zero,
  /// whose stage-3 layers are the modules it is given (above 0 is warned).
  int64_t module_granularity_threshold = 0;
  /// zero_optimization.stage3_use_all_reduce_for_fetch_params: no effect in
  /// zero, which gathers with all-gathers (true is warned).
  bool use_all_reduce_for_fetch_params = false;
  /// zero_optimization.stage3_allgather_sequential: no effect in zero, which
  /// gathers a layer in one collective (true is warned).
  bool allgather_sequential = false;
  /// zero_optimization.ignore_unused_parameters: parameters without a
  /// gradient in a step are allowed; zero always reduces them as zeros
  /// (false is warned).
  bool ignore_unused_parameters = true;
  /// zero_optimization.round_robin_gradients: stages 1-2 with offload,
  /// gradients copied to the host by ranks in turn; no effect in zero (true
  /// is warned).
  bool round_robin_gradients = false;
  /// zero_optimization.zero_hpz_partition_size, ZeRO++ (stage 3). hpZ: groups
  /// of this many consecutive ranks keep a secondary partition, so later
  /// gathers stay in the group (NOTE [hpZ]).
  int64_t zero_hpz_partition_size = 1;
  /// zero_optimization.zero_quantized_weights. qwZ: layers' gathers send
  /// block-quantized int8 weights (NOTE [quantized gather]), in blocks of
  /// zero_quantized_weights_block_size elements (zero's own key; DeepSpeed's
  /// 8000 by default).
  bool zero_quantized_weights = false;
  /// zero_optimization.zero_quantized_weights_block_size, zero's own:
  /// elements per quantization block of qwZ and qgZ (a multiple of 4).
  int64_t zero_quantized_weights_block_size = 8000;
  /// zero_optimization.zero_quantized_gradients. qgZ: gradients reduced in
  /// two quantized hops, within the node then across (NOTE [quantized
  /// gradients]), in blocks of the same size.
  bool zero_quantized_gradients = false;
  /// zero_optimization.mics_shard_size. MiCS (stages 2-3, NOTE [MiCS]): the
  /// model states are partitioned within groups of this many consecutive
  /// ranks and replicated across the groups; -1 (or 0): every rank's
  /// partition is the world's.
  int64_t mics_shard_size = -1;
  /// zero_optimization.mics_hierarchical_params_gather. MiCS at stage 3: a
  /// layer's gather over a shard group that spans nodes goes in two hops,
  /// across the nodes (one shard a rank), then within each node.
  bool mics_hierarchical_params_gather = false;
};

/// `aio` section (NVMe swapping). intra_op_parallelism also read from the
/// legacy `thread_count`.
struct AioConfig {
  int64_t block_size = 1048576;  ///< aio.block_size: bytes of one NVMe request (a multiple of 4096).
  int64_t queue_depth = 8;       ///< aio.queue_depth: NVMe requests in flight.
  int64_t intra_op_parallelism = 1;  ///< aio.intra_op_parallelism: threads that submit a transfer's requests.
  bool single_submit = false;  ///< aio.single_submit: submit requests one at a time rather than in batches.
  bool overlap_events = true;  ///< aio.overlap_events: overlap submitting requests with waiting for completions.
  bool use_gds = false;        ///< aio.use_gds: GPUDirect Storage; true is refused (not implemented by zero).
};

/// `activation_checkpointing` section.
struct ActivationCheckpointingConfig {
  /// activation_checkpointing.partition_activations: split each checkpointed
  /// activation across the model-parallel ranks.
  bool partition_activations = false;
  /// activation_checkpointing.contiguous_memory_optimization: copy
  /// checkpoints into one contiguous buffer (sized by number_checkpoints).
  bool contiguous_memory_optimization = false;
  /// activation_checkpointing.cpu_checkpointing: keep the checkpointed
  /// activations in host memory.
  bool cpu_checkpointing = false;
  /// activation_checkpointing.number_checkpoints: checkpoints the contiguous
  /// buffer holds; none when absent.
  std::optional<int64_t> number_checkpoints;
  /// activation_checkpointing.synchronize_checkpoint_boundary: synchronize
  /// the device at each checkpoint.
  bool synchronize_checkpoint_boundary = false;
  /// activation_checkpointing.profile: time the checkpointed forward and recompute.
  bool profile = false;
};

/// A fully resolved and validated DeepSpeed config.
struct Config {
  std::string source;  ///< the file path, or `"<string>"` (load_string's `name`)
  BatchConfig batch;   ///< train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps.
  int64_t world_size = 1;  ///< the data-parallel world size the triangle was resolved for
  std::optional<OptimizerConfig> optimizer;  ///< `optimizer`; none: no optimizer section
  std::optional<SchedulerConfig> scheduler;  ///< `scheduler`; none: constant lr
  Fp16Config fp16;  ///< `fp16` section.
  Bf16Config bf16;  ///< `bf16` section (or the legacy `bfloat16`).
  /// gradient_clipping: the global gradient norm is clipped to this before
  /// the step; 0 disables
  double gradient_clipping = 1.0;
  /// prescale_gradients: divide gradients by the world size before the reduction, not after.
  bool prescale_gradients = false;
  /// gradient_predivide_factor: divide gradients by this before the reduction
  /// and by world size / factor after.
  double gradient_predivide_factor = 1.0;
  /// gradient_allreduce_op: how gradients are combined across ranks, "mean"
  /// or "sum" (sum is refused at stage 3).
  std::string gradient_allreduce_op = "mean";
  ZeroConfig zero;  ///< `zero_optimization` section.
  AioConfig aio;    ///< `aio` section.
  ActivationCheckpointingConfig activation_checkpointing;  ///< `activation_checkpointing` section.
  /// steps_per_print: steps between progress lines; none: DeepSpeed prints nothing periodic
  std::optional<int64_t> steps_per_print;
  /// wall_clock_breakdown: time forward, backward and step and print them.
  bool wall_clock_breakdown = false;
  bool memory_breakdown = false;  ///< memory_breakdown: print memory use as training goes.
  /// zero_allow_untested_optimizer: no effect in zero, which builds its own
  /// optimizers (true is warned).
  bool zero_allow_untested_optimizer = false;
  /// zero_force_ds_cpu_optimizer: no effect in zero, which always runs its
  /// own CPU optimizer with offload (giving it is warned).
  bool zero_force_ds_cpu_optimizer = true;
  /// communication_data_type: the dtype gradients are reduced in, "fp16" |
  /// "bf16" | "fp32"; none: unset.
  std::optional<std::string> communication_data_type;
  /// data_types.grad_accum_dtype: the dtype gradients are accumulated in over
  /// micro-steps, "fp16" | "bf16" | "fp32"; none: unset.
  std::optional<std::string> grad_accum_dtype;

  std::vector<std::string> warnings;  ///< deprecations and ignored sections, one line each
  std::vector<ResolvedValue> resolved;  ///< every value the runtime uses, for `config check`
  std::string canonical_json;  ///< the resolved config as sorted, compact JSON (for hashing)

  /// True when fp16.enabled or bf16.enabled: training computes in 16 bits.
  bool mixed_precision() const { return fp16.enabled || bf16.enabled; }
};

/// Values the program knows and a DeepSpeed config may leave as "auto" (the
/// Hugging Face placeholder). Unset members leave "auto" unresolved, which is
/// an error naming the key.
struct AutoValues {
  /// Fills train_micro_batch_size_per_gpu, and with gradient_accumulation_steps
  /// and the world size, train_batch_size.
  std::optional<int64_t> train_micro_batch_size_per_gpu;
  std::optional<int64_t> gradient_accumulation_steps;  ///< Fills gradient_accumulation_steps.
  std::optional<double> gradient_clipping;  ///< Fills gradient_clipping.
  /// Fills optimizer.params.lr and scheduler.params.warmup_max_lr (and lets
  /// warmup_min_lr "auto" become 0).
  std::optional<double> lr;
  std::optional<std::array<double, 2>> betas;  ///< Fills optimizer.params.betas.
  std::optional<double> eps;  ///< Fills optimizer.params.eps.
  std::optional<double> weight_decay;  ///< Fills optimizer.params.weight_decay.
  std::optional<int64_t> total_num_steps;  ///< Fills scheduler.params.total_num_steps.
  std::optional<int64_t> warmup_num_steps;  ///< Fills scheduler.params.warmup_num_steps.
  std::optional<std::string> precision;  ///< "fp32" | "fp16" | "bf16": fills fp16/bf16.enabled
  /// The model's hidden size `h` (above 0); fills bucket sizes and stage3
  /// thresholds: reduce_bucket_size `h * h`; at stage 3 also
  /// stage3_prefetch_bucket_size `0.9 * h * h` and
  /// stage3_param_persistence_threshold `10 * h`.
  std::optional<int64_t> hidden_size;
};

/// How load_file and load_string read a config: the world size, the values
/// for "auto" entries, and how a check is run.
struct LoadOptions {
  /// The data-parallel world size the batch triangle is resolved for, and
  /// the hpZ and MiCS sizes are checked against; must be above 0.
  int64_t world_size = 1;
  AutoValues auto_values;  ///< What fills the file's "auto" entries.
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
/// Reads no shared state: any thread may call it.
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

/// "none", "cpu" or "nvme": the config's spelling. A static string.
const char* to_string(OffloadDevice device);
/// "given", "default", "derived", or for kAuto a phrase saying the program
/// fills it and a stand-in was checked. A static string.
const char* to_string(Origin origin);

}  // namespace zero::config
