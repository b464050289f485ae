// The training engine: what zero::initialize returns.
//
//   auto engine = zero::initialize(model, "ds_config.json");
//   for (...) {
//     auto loss = loss_fn(model->forward(x), y);
//     engine.backward(loss);  // scales (fp16, accumulation) and runs backward
//     engine.step();          // every micro-step; acts at the accumulation boundary
//   }
//
// The user keeps calling model->forward; the engine owns the parameters' memory
// (see NOTE [flat layout]) and the optimizer. At ZeRO stage 3 the parameters
// are gathered only while their layer runs (zero/partition/layer.h), and they stay
// empty once the engine is destroyed: save_16bit_model first. Move-only. Not thread-safe: one
// training thread drives it.
//
// Errors (zero/core/error.h): ConfigError (the config or InitOptions cannot
// work), UsageError (the program called the API in a way it cannot work),
// CommunicationError (a rank died or hung; every collective fails within
// ZERO_COMM_TIMEOUT_S), IoError (NVMe offload, saving), OutOfMemoryError (a
// tier's limit), DivergedError (fp16's loss scale at its minimum), and
// InternalError for a bug in zero.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include "zero/checkpointing/checkpoint.h"
#include "zero/config/config.h"
#include "zero/core/copy_mode.h"
#include "zero/core/dist_env.h"
#include "zero/core/memory_ledger.h"

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace zero {

class Init;
struct InitState;

/// A parameter group, as DeepSpeed takes the client's
/// `[{"params": ..., "weight_decay": ..., "lr": ...}, ...]`: the parameters
/// `match` takes (by the name the model gives them, and the tensor) train
/// with this group's weight decay and lr instead of the config's. lr scales
/// with the schedule: a group's lr is the schedule's lr times lr / the
/// config's lr (with no schedule, or a config lr of 0: lr
/// itself). A parameter is in the first
/// group that matches it, or in the default group (the config's values).
struct ParamGroup {
  /// The group's name, in logs, checkpoints and Engine::param_groups: not
  /// empty, unique, and not "default" (initialize throws ConfigError otherwise).
  std::string name;
  /// Whether a parameter (its name in the model, and the tensor) belongs to
  /// this group; called on the training thread at initialize. Required
  /// (initialize throws ConfigError without it).
  std::function<bool(const std::string& name, const torch::Tensor& param)> match;
  /// The group's weight decay; unset: the config's. At least 0 (else ConfigError).
  std::optional<double> weight_decay;
  /// The group's lr, scaled with the schedule as above; unset: the config's. At least 0 (else ConfigError).
  std::optional<double> lr;
  /// The group of the parameters whose names end with one of `suffixes`
  /// (".bias", "norm.weight") or equal one of `names`.
  static ParamGroup by_name(std::string group_name, std::vector<std::string> suffixes, std::vector<std::string> names,
                            std::optional<double> weight_decay, std::optional<double> lr = std::nullopt);
};

/// Which parameters train, by name, for InitOptions::trainable: a name
/// trains when one of `patterns` (ECMAScript regular expressions, searched
/// anywhere in the name, as PEFT's target_modules and DeepSpeed users'
/// name filters do) matches it. Throws ConfigError naming a pattern that is
/// not a valid regular expression.
std::function<bool(const std::string& name)> trainable_matching(const std::vector<std::string>& patterns);
/// The other way round: a name is frozen when one of `patterns` matches it.
/// Throws ConfigError as trainable_matching.
std::function<bool(const std::string& name)> frozen_matching(const std::vector<std::string>& patterns);

/// What initialize (and zero::Init) takes besides the model and the config:
/// the program's settings that are not DeepSpeed config keys. Read at
/// initialize; the engine keeps a copy. Unset members take the defaults
/// each one names.
struct InitOptions {
  /// Values that "auto" entries of the config resolve to (as Hugging Face fills them).
  config::AutoValues auto_values;
  /// The program's flag behind each member of auto_values that its user gave
  /// ("lr" -> "--lr"; members lr, weight_decay, eps, gradient_clipping,
  /// train_micro_batch_size_per_gpu, gradient_accumulation_steps): where the
  /// config gives that key a value of its own, not "auto", the flag is
  /// unused, and zero::Init or initialize says so, once.
  std::map<std::string, std::string> auto_value_flags;
  /// Tokens per sample, for tokens/s in progress lines (none: not printed).
  std::optional<int64_t> tokens_per_sample;
  /// The device to train on; default: cuda:LOCAL_RANK when CUDA is available, else CPU.
  std::optional<torch::Device> device;
  /// Print progress lines every steps_per_print steps (rank 0 only).
  bool print_progress = true;
  /// The program asks Engine::stop_requested() and ends itself when it is
  /// true (NOTE [run report]): then ZERO_STOP_AFTER_STEPS set by a person
  /// (without ZERO_RUN_REPORT) does not end the process, and the program's
  /// own end (a summary, checkpoint, export) runs. Without it, and always in
  /// a tool's run (ZERO_RUN_REPORT set: its report is what the tool reads,
  /// and a probe must not write the user's outputs), the engine ends the
  /// process at the stop, saying so.
  bool program_ends_at_stop = false;
  /// Where this process sits in the job; default: DistEnv::from_environment().
  std::optional<DistEnv> dist;
  /// Cap on page-locked host memory for offloaded states; past it, buffers
  /// fall back to pageable memory with a warning. Default: half of physical memory.
  std::optional<int64_t> pinned_memory_limit_bytes;
  /// Per-rank memory budgets, to find what fits a smaller machine (mingpt
  /// --find-max-params): past one, an allocation throws zero::OutOfMemoryError
  /// naming the tier, the bytes asked, the cap and the config keys that would
  /// help. Device: on CUDA the caching allocator's per-process memory fraction
  /// (c10's OutOfMemoryError then); on the CPU every CPU tensor byte not on a
  /// host tier (NOTE [emulated device memory]). Host: pinned and pageable
  /// host tiers together. NVMe: the swap files.
  /// The device budget, bytes (positive); unset: ZERO_DEVICE_MEMORY when
  /// the environment sets it, else none.
  std::optional<int64_t> device_memory_limit_bytes;
  /// The host budget, bytes (positive); unset: ZERO_HOST_MEMORY, else none.
  std::optional<int64_t> host_memory_limit_bytes;
  /// The NVMe budget, bytes (positive); unset: ZERO_NVME_BYTES, else none.
  std::optional<int64_t> nvme_limit_bytes;
  /// ZeRO stage 3: modules to gather layer by layer besides the children of
  /// ModuleList and Sequential containers; their forward must run through
  /// zero::forward / zero::layer_forward (zero/partition/layer.h).
  std::vector<std::shared_ptr<torch::nn::Module>> layers;
  /// ZeRO stage 3: leaf modules (DeepSpeed's set_z3_leaf_modules): each is
  /// one layer, all its parameters gathered together before it runs and
  /// released after, whatever subset of its children runs on this rank (a
  /// mixture of experts that skips an expert without tokens); no module
  /// inside it is a layer of its own, and its gradients are reduced whole
  /// on every rank (zeros for what did not run), so ranks never disagree on
  /// collectives. Its forward must run through zero::forward, as a layer's.
  /// zero::set_leaf marks a module the same way. Stages 0-2: no effect.
  std::vector<std::shared_ptr<torch::nn::Module>> leaf_modules;
  /// Which parameters train, by name (NOTE [frozen groups]): at initialize
  /// every parameter of the model is set trainable (requires_grad true) or
  /// frozen by it before anything is laid out; under zero::Init, each
  /// parameter as its layer is partitioned (Init::partition's `name`, then
  /// the parameter's name in the layer). Unset: each parameter's own
  /// requires_grad. See trainable_matching / frozen_matching.
  std::function<bool(const std::string& name)> trainable;
  /// Parameter groups (ParamGroup): each step updates a group's parameters
  /// with its weight decay and lr; checkpoints save each group's values and
  /// a load restores them. Empty: one group, the config's.
  std::vector<ParamGroup> param_groups;
  /// The program's own optimizer, as DeepSpeed takes a client optimizer
  /// (NOTE [client optimizer]): a torch::optim::Adam, AdamW or Adagrad built
  /// on the model's trainable parameters. Its type, options and parameter
  /// groups become zero's flat optimizer (the program then steps through
  /// the engine, never the optimizer itself; its state is not carried
  /// over). For a config with no `optimizer` section; when the config has
  /// one, the config's wins, with a warning. Not owned; read at initialize
  /// only. Other types, and options zero's optimizers lack (amsgrad,
  /// Adagrad's lr_decay, betas or eps that differ between groups), are
  /// refused, naming them.
  torch::optim::Optimizer* optimizer = nullptr;
  /// Test seam, for a machine without a GPU: CopyMode::kDeferred holds every
  /// device-host transfer (offload, stage-3 gathers, cpu_checkpointing)
  /// back until it is waited for, and throws zero::InternalError when a host
  /// buffer is written while a transfer may still read it, so a missing wait
  /// fails on the CPU instead of racing on a GPU (NOTE [device streams]). No
  /// effect on a CUDA device.
  CopyMode cpu_copy_mode = CopyMode::kImmediate;
};

/// Stage 3's parameter gathering, since initialize (or the last reset).
struct Stage3Stats {
  int64_t layers = 0;                ///< Stage-3 layers (leaf modules included).
  int64_t live_parameters = 0;       ///< elements gathered in layers now
  int64_t peak_live_parameters = 0;  ///< and at most
  int64_t gathers = 0;               ///< all-gathers issued
  int64_t prefetched_gathers = 0;    ///< of those, issued ahead of use
  double gather_wait_s = 0;          ///< time the training thread waited for them, seconds
  /// Whether a recorded order of the layers (NOTE [stage-3 trace]) is
  /// followed now, so gathers may be prefetched: false until the first
  /// micro-step ends, and from an event off the trace to the end of its micro-step.
  bool trace_valid = false;
};

/// The NVMe swapping of optimizer states (NOTE [optimizer swapping]) and of
/// stage 3's parameters (NOTE [parameter swapping]), this rank, since the
/// engine was made.
struct NvmeStats {
  int64_t file_bytes = 0;     ///< Optimizer states: bytes of the swap files.
  int64_t buffer_bytes = 0;   ///< bytes of the host buffers they are stepped through
  int64_t bytes_read = 0;     ///< bytes read from the swap files
  int64_t bytes_written = 0;  ///< bytes written to them, the initial write included
  double read_wait_s = 0;     ///< seconds the optimizer waited for reads...
  double write_wait_s = 0;    ///< ...and for writes: the part not hidden
  double step_s = 0;          ///< seconds in the swapped optimizer passes, all told
  /// Stage 3's parameter shards (offload_param nvme): zero when not swapped.
  /// Bytes of the parameter swap file.
  int64_t param_file_bytes = 0;
  int64_t param_bytes_read = 0;     ///< bytes read, the start-up's reads (for the fp32 master) included
  int64_t param_bytes_cached = 0;   ///< reads saved, bytes: the shard was still in a swap buffer
  int64_t param_bytes_written = 0;  ///< bytes written, the initial write included
  double param_read_wait_s = 0;     ///< seconds gathers waited for shards coming from disk
};

/// How Engine::load_weights maps the names of a weights file onto the
/// model's: strip_prefix off the front of a name that has it ("model."),
/// then add_prefix on, then `rename` (the name so far in, the model's name
/// out; "" leaves the tensor out). Applied to every tensor of the file.
struct LoadWeightsOptions {
  std::string strip_prefix;  ///< Taken off the front of a file's name that starts with it ("model."); "": none.
  std::string add_prefix;    ///< Put on the front of every name after strip_prefix; "": none.
  /// The name after the prefixes in, the model's name out ("" leaves the
  /// tensor out); empty function: names unchanged.
  std::function<std::string(const std::string&)> rename;
  /// Parameters the file may lack (the model's names): they keep the values
  /// they have, master included (a LoRA model's adapters over a base model's
  /// weights: zero::models::is_lora_parameter). Any other parameter the
  /// file lacks is an error.
  std::function<bool(const std::string&)> keep_missing;
};

/// What Engine::save_hf writes: the weights in `dtype` (default: the
/// compute dtype; a smaller float dtype rounds), in shards of at most
/// `max_shard_bytes` (Hugging Face's default, 5 GB), names with
/// strip_prefix taken off and add_prefix put on, and `config_json` as
/// config.json when not empty (the model's architecture: zero does not know
/// it, models/ does).
struct SaveHfOptions {
  std::optional<torch::ScalarType> dtype;   ///< The files' dtype; unset: the compute dtype.
  int64_t max_shard_bytes = 5'000'000'000;  ///< The most bytes of one weights file (shard).
  std::string strip_prefix;                 ///< Taken off the front of a model name that starts with it; "": none.
  std::string add_prefix;                   ///< Put on the front of every name after strip_prefix; "": none.
  std::string config_json;                  ///< Written as config.json when not empty (JSON text).
  /// Merges LoRA adapters (PEFT's merge_and_unload): each pair
  /// `X.lora_A.weight` (A [r, in]) and `X.lora_B.weight` (B [out, r]) is
  /// folded into `X.weight` as W + lora_scaling * B A (in fp32, then the
  /// export's dtype) and not written itself, so the output is the plain
  /// model. lora_scaling is alpha / r. Each such X.weight must be frozen.
  std::optional<double> lora_scaling;
};

/// How Engine::save_checkpoint saves.
struct SaveCheckpointOptions {
  /// Leave the frozen parameters out (DeepSpeed's exclude_frozen_parameters):
  /// a LoRA run's checkpoint holds the adapters and their states, not the
  /// base. load_checkpoint then keeps the frozen values the model has: load
  /// the base weights first (load_weights, or the program's own).
  bool exclude_frozen = false;
};

/// What one rank did in save_checkpoint or load_checkpoint.
struct CheckpointStats {
  std::string dir;       ///< The checkpoint folder given (load_weights: the weights' path).
  std::string tag;       ///< The tag saved (`global_step<N>` for "") or loaded; load_weights: "".
  int64_t bytes = 0;     ///< bytes this rank wrote (save) or read (load)
  double seconds = 0;    ///< this rank's time in the call, seconds
  /// load: the client state saved with it (a JSON object, as text).
  std::string client_state = "{}";
};

/// A parameter group as a fine-tuning loop sees it (Engine::param_groups).
struct ParamGroupState {
  std::string name;         ///< "default" (the config's values), then InitOptions::param_groups' names
  double lr = 0;            ///< the lr of the next optimizer step
  double weight_decay = 0;  ///< the weight decay of the next optimizer step
  int64_t numel = 0;        ///< elements of its parameters
};

/// Bytes of model states this rank holds, from the memory ledger.
struct ModelStateBytes {
  int64_t parameters = 0;        ///< Bytes of the trainable parameters in the compute dtype (not the frozen ones).
  int64_t gradients = 0;         ///< Bytes of the gradient buffers.
  int64_t optimizer_states = 0;  ///< Bytes of the optimizer states, the master included.
  /// The sum of the three, bytes.
  int64_t total() const { return parameters + gradients + optimizer_states; }
};

/// The training engine (DeepSpeed's DeepSpeedEngine), made by
/// zero::initialize. It owns the memory of the model's trainable parameters
/// (flat buffers, or stage 3's shards), their gradients, the optimizer and
/// its states, the lr schedule, the loss scaler, the memory ledger and the
/// activation checkpointer, and holds a shared_ptr to the model. Move-only;
/// a moved-from engine may only be destroyed or assigned to.
///
/// Threads: not thread-safe. One training thread drives it: the thread
/// that made it calls every method, const ones too (they read state that
/// other calls change, unguarded), one call at a time. The engine
/// registers its checkpointer for that thread, so
/// zero::checkpointing::checkpoint in the model's code uses it there only.
/// While the training thread waits in a backward, autograd may run the
/// engine's gradient hooks on its own threads. The destructor may run on
/// another thread.
///
/// Errors: each method names what it throws, as zero::Error kinds
/// (zero/core/error.h): ConfigError, UsageError, CommunicationError,
/// IoError, OutOfMemoryError, DivergedError; InternalError for a bug in
/// zero. A method called "a collective" must be called by every rank, in
/// the same order.
class Engine {
 public:
  /// Takes over `model`'s trainable parameters: moves them to the device and
  /// the compute dtype and rebinds them into the engine's flat buffers (at
  /// stage 3 this rank keeps its shards only, and the entries of every
  /// Sequential become stage-3 layers, NOTE [stage-3 layers]). Joins the job
  /// of `options.dist` when it has more than one rank, and checks that every
  /// rank has the same config. On a CPU device it installs the process-wide
  /// counting CPU allocator. Throws ConfigError (no optimizer section, a
  /// world size other than the config's, a bad InitOptions::layers entry, a
  /// bad nvme_path), UsageError (a layer another engine holds),
  /// CommunicationError, OutOfMemoryError, IoError.
  Engine(std::shared_ptr<torch::nn::Module> model, config::Config config, InitOptions options = {});
  /// Writes ZERO_TRACE's trace and ZERO_RUN_REPORT's report when set (a
  /// failure there is logged, not thrown), takes the checkpointer out of
  /// checkpointing::current() and frees the engine's memory. At stage 3 the
  /// model's partitioned parameters stay empty afterwards.
  ~Engine();
  /// Takes the other engine's state; that one may then only be destroyed
  /// or assigned to.
  Engine(Engine&&) noexcept;
  /// Ends this engine as its destructor would (trace, run report, the
  /// thread's checkpointer, its memory), then takes the other's state; the
  /// other may then only be destroyed or assigned to.
  Engine& operator=(Engine&&) noexcept;

  /// Backward of `loss` (a scalar), multiplied by the loss scale (fp16) and
  /// divided by gradient_accumulation_steps; gradients accumulate in the
  /// engine's buffers and are reduced across ranks as they are produced.
  /// The program may instead call backward itself, as in PyTorch:
  /// loss.backward(), out.backward(grad), one backward through several
  /// engines' models (NOTE [user backward]). Throws UsageError for a loss
  /// that is not a scalar, or after a plain backward in the same
  /// accumulation window; CommunicationError. Also UsageError inside a
  /// GatheredParameters scope, when a parameter's requires_grad changed
  /// since initialize, and when the last backward the program started
  /// ended in an error (that window's gradients are discarded); and what
  /// the model's own backward throws.
  void backward(const torch::Tensor& loss);
  /// Ends a micro-step. At the accumulation boundary: unscale, overflow check,
  /// clip, optimizer step, lr schedule, loss-scale update. Throws
  /// DivergedError (fp16 at fp16.min_loss_scale still overflowing),
  /// CommunicationError, IoError (NVMe offload); UsageError as backward
  /// (a GatheredParameters scope, a changed requires_grad, a failed
  /// backward of the program's). With ZERO_STOP_AFTER_STEPS set it may end
  /// the process at the stop (InitOptions::program_ends_at_stop).
  void step();
  /// The loss as Engine::backward would backpropagate it for the loss
  /// scale: multiplied by the fp16 loss scale (the loss itself otherwise),
  /// for a program that calls backward itself: engine.scale(loss).backward()
  /// gives Engine::backward's gradients (NOTE [user backward]); a plain
  /// loss.backward() works too, unscaled. Must come right before that
  /// backward.
  torch::Tensor scale(const torch::Tensor& loss);
  /// Checks a micro-batch against the config: `batch` ([samples, tokens,
  /// ...], the model's input) has train_micro_batch_size_per_gpu samples,
  /// and InitOptions::tokens_per_sample tokens each when that was given.
  /// The engine does not see the data otherwise: call it where the batch is
  /// made. Throws UsageError naming the shape, the key and the numbers.
  void check_batch(const torch::Tensor& batch) const;
  /// Discards gradients accumulated since the last boundary. Throws
  /// CommunicationError (it waits for reductions in flight).
  void zero_grad();

  /// The lr of the next optimizer step (the default group's).
  double get_lr() const;
  /// Sets the lr of the next optimizer steps: of every parameter group, or
  /// of group `group` (an index of param_groups()). With an lr scheduler
  /// the schedule's next step sets the lr again (as DeepSpeed's
  /// scheduler.step() overwrites optimizer.param_groups' lr); without one
  /// the value stays (checkpoints save it). Throws UsageError (no such
  /// group, an lr that is negative or not finite).
  void set_lr(double lr, std::optional<size_t> group = std::nullopt);
  /// Sets the weight decay of every group, or of one, for the steps to
  /// come (checkpoints save it). Throws UsageError as set_lr.
  void set_weight_decay(double weight_decay, std::optional<size_t> group = std::nullopt);
  /// The optimizer's parameter groups, "default" first, with the lr and
  /// weight decay of the next step.
  std::vector<ParamGroupState> param_groups() const;
  /// Optimizer steps taken (skipped fp16 steps included, as DeepSpeed counts).
  int64_t global_steps() const;
  /// Micro-steps taken (calls of step()), restored by load_checkpoint.
  int64_t micro_steps() const;
  /// Optimizer steps skipped because the gradients were not finite (fp16's
  /// overflow, or bf16.check_grad_overflow), restored by load_checkpoint.
  int64_t skipped_steps() const;
  /// True when the next step() is an optimizer step.
  bool is_gradient_accumulation_boundary() const;
  /// The fp16 loss scale the next backward multiplies by; 1 without fp16.
  double loss_scale() const;
  /// Global gradient norm of the last boundary step (unscaled, before clipping).
  double last_grad_norm() const;

  /// The config the engine runs with; valid while the engine lives.
  const config::Config& config() const;
  /// This process's rank in the job (InitOptions::dist).
  int rank() const;
  /// Ranks in the job.
  int world_size() const;
  /// Seconds this rank waited for gradient reductions after backward (what
  /// overlap did not hide), since initialize.
  double grad_comm_wait_seconds() const;
  /// Seconds this rank waited for parameter all-gathers (after the step, and
  /// at stage 3 before each layer). On a GPU these waits are measured on the
  /// stream (NOTE [device streams]), as are those of grad_comm_wait_seconds.
  double param_gather_wait_seconds() const;
  /// Seconds the host waited for device-host copies of the offloaded
  /// optimizer (NOTE [offload transfers]), since initialize; the NVMe waits
  /// are in nvme_stats().
  double transfer_wait_seconds() const;
  /// The device the engine trains on (InitOptions::device, resolved).
  torch::Device device() const;
  /// The dtype of the parameters the model computes with (fp16, bf16 or fp32, by the config).
  torch::ScalarType compute_dtype() const;
  /// Elements of the model's trainable parameters at full size (a tied
  /// parameter once, no padding, frozen ones left out), on every rank.
  int64_t num_parameters() const;
  /// L2 norm of all parameters (summed in double). At stage 3 every rank
  /// holds a shard: this is a collective, to call on every rank. Throws
  /// CommunicationError, IoError (shards on NVMe).
  double parameter_l2() const;

  /// The memory ledger: bytes per tier and kind, and per-tier limits.
  MemoryLedger& ledger();
  /// Activation checkpointing configured by the config's
  /// activation_checkpointing section, counted in this engine's ledger. The
  /// engine has no model-parallel group, so partition_activations has nothing
  /// to split across here (logged once).
  checkpointing::Checkpointer& checkpointer();
  /// This rank's model-state bytes now, on every tier together.
  ModelStateBytes model_state_bytes() const;
  /// The same, only what lives on `tier`.
  ModelStateBytes model_state_bytes(Tier tier) const;
  /// Peak bytes per tier: the device peak is measured (CUDA caching allocator,
  /// or the counting CPU allocator when the device is the CPU); the host tiers
  /// and NVMe are the ledger's peaks.
  int64_t peak_bytes(Tier tier) const;
  /// Starts new peaks (ledger, and the measured device peak) from current usage.
  void reset_peak_bytes();
  /// Writes the model's parameters and buffers, in the compute dtype, to
  /// `path` on rank 0, atomically (DeepSpeed's save_16bit_model): a path
  /// ending in .safetensors gets a safetensors file (what safetensors,
  /// transformers and load_weights read; a tied parameter once, under its
  /// first name), any other a state dict pickle as DeepSpeed writes it
  /// (Python: torch.load(path, weights_only=False), every name of a tied
  /// parameter). At stage 3 this needs
  /// zero_optimization.stage3_gather_16bit_weights_on_model_save: every
  /// rank takes part, the layers are gathered one at a time and rank 0
  /// writes each as it comes (the pickle: keeps them until the end). Throws
  /// ConfigError without it, IoError when the file cannot be written,
  /// CommunicationError.
  void save_16bit_model(const std::string& path);
  /// Writes the weights in Hugging Face's save_pretrained layout into `dir`
  /// (SaveHfOptions): model.safetensors, or model-0000k-of-0000n.safetensors
  /// with model.safetensors.index.json, and config.json when given, a layer
  /// at a time as the gathers bring them, so no rank holds the model whole.
  /// The files appear whole in `dir`, replacing an earlier export's weight
  /// files (other files, a tokenizer say, stay). A collective; at stage 3
  /// it needs stage3_gather_16bit_weights_on_model_save, as
  /// save_16bit_model. Throws ConfigError, UsageError (a dtype larger than
  /// the compute dtype: the master (fp32 unless 16-bit) is exported from a checkpoint by
  /// `zero checkpoint export --hf`), IoError, CommunicationError.
  void save_hf(const std::string& dir, const SaveHfOptions& options = {});
  /// Why save_hf(dir) would fail for this engine's config or for `dir`
  /// (named by option `flag` in the message), or "": at stage 3 without
  /// stage3_gather_16bit_weights_on_model_save; `dir` a file, not writable,
  /// or holding a file of a name an export writes that no earlier export
  /// recorded (NOTE [export folder]; config.json too when `with_config`).
  /// For a program to check before it trains, not after. Makes nothing.
  std::string save_hf_problem(const std::string& flag, const std::string& dir, bool with_config) const;

  /// Saves the training state as `dir`/`tag`/ (docs/checkpoints.md): every
  /// rank writes its partition of the master (fp32, or 16-bit: NOTE [16-bit
  /// master]) and optimizer states from
  /// where they live (device, host, NVMe), in parallel, with block checksums;
  /// rank 0 the buffers and frozen parameters (gathered at stage 3; none
  /// with options.exclude_frozen), the step counters, LR
  /// schedule, loss scaler and `client_state` (a JSON object) in meta.json;
  /// each rank its RNG states. Files go to a hidden folder first; the tag
  /// appears, and `dir`/latest names it, only once every rank's files are
  /// complete and flushed, so an interrupted save leaves the previous
  /// checkpoint as it was. `tag` "" means "global_step<N>". A collective:
  /// every rank calls it, at an accumulation boundary. Throws UsageError
  /// (between the micro-steps of an accumulation, a bad tag), IoError (naming
  /// the file, offset and errno; a disk without room names the path, the
  /// bytes needed and those available, before anything is written),
  /// ConfigError (client_state not a JSON object), CommunicationError.
  CheckpointStats save_checkpoint(const std::string& dir, const std::string& tag = "",
                                  const std::string& client_state = "{}", const SaveCheckpointOptions& options = {});
  /// Makes `dir` this job's checkpoint folder, as the first save_checkpoint
  /// into it does: checks that it is a folder rank 0 can write (making it if
  /// needed), takes its writer lock for the engine's lifetime (rank 0 holds
  /// DIR/.zero-lock: another job saving into DIR is refused, naming the
  /// process that holds it), and removes what interrupted saves left there
  /// (NOTE [checkpoint commit]). Call it before training to find a bad
  /// folder before the first step, not at the first save. A collective; a
  /// second call for the same folder does nothing. Throws IoError.
  void open_checkpoint_dir(const std::string& dir);
  /// Restores a checkpoint (`tag` "" means the one `dir`/latest names),
  /// saved at any world size and any stage: each rank reads only the parts of
  /// the saved partitions its own partition needs (NOTE [checkpoint mapping]),
  /// verified against their checksums. The RNG states are restored when the
  /// world size is the one saved. A collective. Throws IoError naming the
  /// file and what is wrong (missing, truncated, damaged, a checkpoint of a
  /// model with other parameters), ConfigError (another optimizer),
  /// CommunicationError.
  CheckpointStats load_checkpoint(const std::string& dir, const std::string& tag = "");
  /// Sets the parameters (and the master) from full weights by
  /// parameter name: one safetensors file (as `zero checkpoint consolidate`
  /// writes it), a sharded set's index (model.safetensors.index.json), or a
  /// folder holding either (Hugging Face's save_pretrained layout). Each
  /// rank reads only the byte ranges of its own partition, so a model built
  /// under zero::Init is filled without ever being whole anywhere. Names go
  /// through `options` (a prefix off or on, a rename); a tied parameter is
  /// found under any of its names. Buffers and frozen parameters found by
  /// name are loaded too. Rank 0 warns, naming them, of tensors in another
  /// dtype than the model computes in (converted: an fp32 master starts
  /// from the file's values, the compute copy is rounded from the master)
  /// and of tensors the model
  /// has no place for (not loaded). The optimizer states start anew: call it
  /// before training. A collective. Throws IoError naming the file: a
  /// parameter it lacks (listed, with a prefix that would match when there
  /// is one) or holds with another shape, a damaged file. Returns what this
  /// rank read (bytes, seconds).
  CheckpointStats load_weights(const std::string& path, const LoadWeightsOptions& options = {});

  /// The mean of `tensor` over the ranks (a loss to log, say), as a new
  /// tensor on `tensor`'s device in its dtype; `tensor` itself unchanged
  /// (detached: no gradient flows through it). One process: a copy. A
  /// collective: every rank calls it with a tensor of the same shape and
  /// dtype. Throws UsageError for a tensor that is not floating-point (an
  /// integer mean would truncate), CommunicationError.
  torch::Tensor all_reduce_mean(const torch::Tensor& tensor);

  /// Stage 3's figures; nullopt below stage 3.
  std::optional<Stage3Stats> stage3_stats() const;
  /// The NVMe swaps' figures; nullopt unless offload_optimizer or offload_param is on nvme.
  std::optional<NvmeStats> nvme_stats() const;
  /// Starts the live-parameter peak anew.
  void reset_stage3_peak();
  /// The end-of-run table of memory per tier and kind.
  std::string memory_summary() const;
  /// Whether ZERO_STOP_AFTER_STEPS=N asks this run to end now: N optimizer
  /// steps taken (at once for N = 0). For programs that set
  /// InitOptions::program_ends_at_stop; always false without the variable.
  bool stop_requested() const;

  /// The engine's state: an incomplete type outside zero's own code.
  struct Impl;
  /// The engine's state, for zero's own code; owned by the engine.
  Impl& impl() { return *impl_; }
  /// The same, read-only.
  const Impl& impl() const { return *impl_; }

 private:
  friend Engine initialize(std::shared_ptr<torch::nn::Module> model, Init& init,
                           const std::vector<std::shared_ptr<torch::nn::Module>>& layers,
                           torch::optim::Optimizer* optimizer);
  // A model built under zero::Init: its shards and ledger are taken over.
  Engine(std::shared_ptr<torch::nn::Module> model, config::Config config, InitOptions options,
         std::shared_ptr<InitState> init);
  std::unique_ptr<Impl> impl_;
};

/// DeepSpeed's GatheredParameters: while it lives, `params` (parameters of
/// the engine's model) hold their full values on every rank, at stage 3 too
/// (their layers gathered exactly, not through qwZ), to read or, with a
/// modifier rank, to change:
///
///   {
///     zero::GatheredParameters g(engine, {model->head->weight}, /*modifier_rank=*/0);
///     if (engine.rank() == 0) model->head->weight.normal_(0, 0.02);  // under NoGradGuard
///   }  // rank 0's values now on every rank, in the shards, the master and the model
///
/// With `modifier_rank`, done() (or the destructor) broadcasts that rank's
/// values of `params` to every rank and writes them where the engine keeps
/// them: stage 3's shards, the master (fp32 or 16-bit) of a trainable
/// parameter, the compute copy; the optimizer states stay. Only the
/// elements the modifier changed reach the master: the others keep its
/// bits (not the 16-bit compute copy's rounding of them). Without it, the
/// values are to read (a change is lost at the next gather, or at the next
/// step below stage 3). A collective: every rank makes it with the same
/// parameters, in the same order, and ends it at the same point; not during
/// backward. Throws UsageError (a tensor that is not a parameter of the
/// model, a modifier rank outside the job, during backward),
/// CommunicationError, IoError (shards on NVMe).
class GatheredParameters {
 public:
  /// Gathers `params` (at stage 3, the groups that hold them, each whole on
  /// every rank until the scope ends) and, with `modifier_rank`, keeps a
  /// copy of their values to tell the modifier's changes from. `engine` is
  /// not owned and must outlive the scope. Call on the training thread, not
  /// during backward. Throws UsageError, CommunicationError, IoError as above.
  GatheredParameters(Engine& engine, std::vector<torch::Tensor> params, std::optional<int> modifier_rank = std::nullopt);
  /// Ends the scope as done() does; an error there is logged, not thrown
  /// (call done() to have it thrown).
  ~GatheredParameters();
  GatheredParameters(const GatheredParameters&) = delete;
  GatheredParameters& operator=(const GatheredParameters&) = delete;
  /// Ends the scope: writes the modifier rank's values (with one) and
  /// releases what was gathered. Once; the destructor then does nothing.
  void done();

 private:
  Engine* engine_;
  std::vector<torch::Tensor> params_;
  std::optional<int> modifier_;
  std::vector<std::pair<size_t, bool>> held_;  // stage 3: groups held, and whether each was released before
  std::vector<torch::Tensor> originals_;       // with a modifier: the values at the start, to tell its changes
  bool done_ = false;
};

/// Reads a DeepSpeed config (a file path, or JSON text starting with '{'),
/// logs its warnings (rank 0), and builds the engine (see Engine's
/// constructor for what it does and throws). Throws ConfigError listing every
/// problem of the config, IoError when the file cannot be read.
Engine initialize(std::shared_ptr<torch::nn::Module> model, const std::string& config,
                  InitOptions options = {});
/// The same for a config already read: logs its warnings (rank 0) and
/// builds the engine. Throws as Engine's constructor.
Engine initialize(std::shared_ptr<torch::nn::Module> model, config::Config config,
                  InitOptions options = {});
/// A model built under zero::Init (zero/runtime/init.h): its layers' shards
/// are adopted as they are (no rank ever holds the whole model). `layers`:
/// stage-3 layers outside ModuleList and Sequential containers, as
/// InitOptions::layers. Throws as the constructor, and UsageError when the
/// Init was already given to an engine or a module it partitioned is not a
/// layer of `model`. `optimizer`: the program's own, built on the model's
/// parameters once it is built (InitOptions::optimizer; the Init's options
/// were set before the model existed).
Engine initialize(std::shared_ptr<torch::nn::Module> model, Init& init,
                  const std::vector<std::shared_ptr<torch::nn::Module>>& layers = {},
                  torch::optim::Optimizer* optimizer = nullptr);

/// For modules declared with TORCH_MODULE (a ModuleHolder).
template <typename M>
Engine initialize(torch::nn::ModuleHolder<M>& model, const std::string& config,
                  InitOptions options = {}) {
  return initialize(model.ptr(), config, std::move(options));
}

}  // namespace zero
