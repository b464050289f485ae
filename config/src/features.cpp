// DeepSpeed features zero does not implement, in one table, and the list of
// DeepSpeed's top-level keys (for typo warnings).
#include "sections.h"

#include <unordered_set>
#include "zero/core/text.h"

namespace zero::config::detail {
namespace {

enum class When {
  kPresent,  // the key is there and not null
  kTrue,     // the value is the boolean true
  kAbove,    // a number greater than `bound`
  kBelow,    // a number less than `bound`
  kFalse,    // the value is the boolean false
};

enum class Severity {
  kError,    // ignoring it would change training
  kWarning,  // it would not change the math: accepted and ignored, with a warning
};

struct FeatureRule {
  const char* path;  // dotted JSON path
  When when;
  double bound;
  Severity severity;
  const char* feature;   // errors: what the user asked for; warnings: the whole message
  const char* expected;  // for errors: what zero accepts instead
};

// NOTE [unsupported features]
// Every DeepSpeed feature zero does not implement is listed here, so none is
// ignored silently. Add a row to extend; sections that are read elsewhere
// (optimizer types, scheduler types) report their own.
constexpr FeatureRule kFeatures[] = {
    // Errors: these would change training.
    {"sparse_attention", When::kPresent, 0, Severity::kError, "sparse attention", "no sparse_attention section"},
    {"elasticity.enabled", When::kTrue, 0, Severity::kError, "elastic training", "false"},
    {"compile.deepcompile", When::kTrue, 0, Severity::kError, "DeepCompile", "false"},
    {"tensor_parallel.autotp_size", When::kAbove, 1, Severity::kError, "automatic tensor parallelism (AutoTP)",
     "1"},
    {"pipeline.stages", When::kAbove, 1, Severity::kError, "pipeline parallelism", "1"},
    {"zero_optimization.zenflow", When::kPresent, 0, Severity::kError, "ZenFlow", "no zenflow section"},
    {"amp.enabled", When::kTrue, 0, Severity::kError, "Apex AMP", "false (use fp16 or bf16)"},
    {"torch_autocast.enabled", When::kTrue, 0, Severity::kError, "torch autocast", "false (use fp16 or bf16)"},
    {"curriculum_learning.enabled", When::kTrue, 0, Severity::kError, "curriculum learning", "false"},
    {"data_efficiency.enabled", When::kTrue, 0, Severity::kError, "data efficiency", "false"},
    {"progressive_layer_drop.enabled", When::kTrue, 0, Severity::kError, "progressive layer drop", "false"},
    {"eigenvalue.enabled", When::kTrue, 0, Severity::kError, "eigenvalue computation", "false"},
    {"quantize_training.enabled", When::kTrue, 0, Severity::kError, "quantized training (MoQ)", "false"},
    {"compression_training", When::kPresent, 0, Severity::kError, "compression training",
     "no compression_training section"},
    {"hybrid_engine.enabled", When::kTrue, 0, Severity::kError, "the hybrid engine", "false"},
    {"sequence_parallel_size", When::kAbove, 1, Severity::kError, "sequence parallelism", "1"},
    {"aio.use_gds", When::kTrue, 0, Severity::kError, "GPUDirect Storage", "false"},
    // Warnings: accepted and ignored, the math is unchanged.
    {"flops_profiler.enabled", When::kTrue, 0, Severity::kWarning, "the flops profiler is not implemented by zero", nullptr},
    {"tensorboard.enabled", When::kTrue, 0, Severity::kWarning, "TensorBoard monitoring is not implemented by zero", nullptr},
    {"wandb.enabled", When::kTrue, 0, Severity::kWarning, "Weights & Biases monitoring is not implemented by zero", nullptr},
    {"csv_monitor.enabled", When::kTrue, 0, Severity::kWarning, "CSV monitoring is not implemented by zero", nullptr},
    {"comet.enabled", When::kTrue, 0, Severity::kWarning, "Comet monitoring is not implemented by zero", nullptr},
    {"comms_logger.enabled", When::kTrue, 0, Severity::kWarning, "the communication logger is not implemented by zero", nullptr},
    {"checkpoint", When::kPresent, 0, Severity::kWarning, "DeepSpeed's checkpoint options do not apply to zero, which has its own checkpoint format",
     nullptr},
    {"autotuning.enabled", When::kTrue, 0, Severity::kWarning, "autotuning is not implemented by zero", nullptr},
    {"dataloader_drop_last", When::kTrue, 0, Severity::kWarning, "zero has no data loader (DeepSpeed's option for its own)", nullptr},
    {"dump_state", When::kTrue, 0, Severity::kWarning, "dumping the engine state is not implemented by zero", nullptr},
    {"zero_optimization.zero_quantized_nontrainable_weights", When::kTrue, 0, Severity::kWarning,
     "has no effect: zero keeps frozen parameters in the compute dtype (at stage 3 partitioned and gathered as the "
     "trainable ones are); DeepSpeed's int8 copy of them is not implemented",
     nullptr},
    {"zero_force_ds_cpu_optimizer", When::kPresent, 0, Severity::kWarning,
     "has no effect: zero always runs its own CPU optimizer with offload", nullptr},
    {"fp16.auto_cast", When::kTrue, 0, Severity::kWarning, "casting forward inputs to fp16 is not implemented by zero (the program casts its inputs)", nullptr},
    {"sparse_gradients", When::kTrue, 0, Severity::kWarning, "sparse gradient all-reduce is not implemented by zero", nullptr},
    {"disable_allgather", When::kTrue, 0, Severity::kWarning, "disable_allgather is not implemented by zero", nullptr},
    {"graph_harvesting", When::kTrue, 0, Severity::kWarning, "graph harvesting is not implemented by zero", nullptr},
    {"data_types.param_dtype", When::kPresent, 0, Severity::kWarning, "a separate parameter dtype is not implemented by zero (fp16/bf16 decide it)", nullptr},
    {"data_types.buffer_dtype", When::kPresent, 0, Severity::kWarning, "a separate buffer dtype is not implemented by zero", nullptr},
    {"zero_optimization.legacy_stage1", When::kTrue, 0, Severity::kWarning, "the legacy stage 1 implementation is not in zero (its stage 1 computes the same)",
     nullptr},
    {"zero_optimization.leaf_module", When::kPresent, 0, Severity::kWarning, "ZeRO-3 leaf modules are not implemented by zero", nullptr},
    {"zero_optimization.zeropp_loco_param", When::kPresent, 0, Severity::kWarning, "LoCo-ZeRO++ is not implemented by zero", nullptr},
    {"zero_optimization.stage3_partition_stream_chunk_size", When::kAbove, 0, Severity::kWarning,
     "streamed partitioning at zero.Init is not implemented by zero", nullptr},
    {"zero_optimization.partition_stream_chunk_size", When::kAbove, 0, Severity::kWarning,
     "streamed partitioning at zero.Init is not implemented by zero", nullptr},
    // Keys DeepSpeed reads to tune how it runs; zero computes the same
    // without them (docs/architecture.md, "Config keys").
    {"zero_optimization.allgather_partitions", When::kFalse, 0, Severity::kWarning,
     "has no effect: zero always all-gathers the updated partitions (false asks DeepSpeed for broadcasts)", nullptr},
    {"zero_optimization.use_multi_rank_bucket_allreduce", When::kFalse, 0, Severity::kWarning,
     "has no effect: zero reduces each bucket with one collective", nullptr},
    {"zero_optimization.round_robin_gradients", When::kTrue, 0, Severity::kWarning,
     "has no effect: with offload each rank already copies only its own reduced chunks to the host, bucket by "
     "bucket as their reductions end",
     nullptr},
    {"zero_optimization.ignore_unused_parameters", When::kFalse, 0, Severity::kWarning,
     "has no effect: zero always reduces parameters without gradients as zeros", nullptr},
    {"zero_optimization.load_from_fp32_weights", When::kFalse, 0, Severity::kWarning,
     "has no effect: load_checkpoint always sets the fp32 master from the checkpoint's own fp32 (or 16-bit "
     "master) states, as true does; false, rebuilding it from the 16-bit weights, is not done", nullptr},
    {"zero_optimization.elastic_checkpoint", When::kTrue, 0, Severity::kWarning,
     "has no effect: zero's checkpoints always load at another world size or stage (each rank reads its share, "
     "docs/checkpoints.md), which is what it asks for", nullptr},
    {"zero_optimization.stage3_module_granularity_threshold", When::kAbove, 0, Severity::kWarning,
     "has no effect: zero's stage-3 layers are the modules it is given (NOTE [stage-3 layers])", nullptr},
    {"zero_optimization.module_granularity_threshold", When::kAbove, 0, Severity::kWarning,
     "has no effect: zero's stage-3 layers are the modules it is given (NOTE [stage-3 layers])", nullptr},
    {"zero_optimization.stage3_use_all_reduce_for_fetch_params", When::kTrue, 0, Severity::kWarning,
     "has no effect: zero gathers stage-3 parameters with all-gathers", nullptr},
    {"zero_optimization.use_all_reduce_for_fetch_params", When::kTrue, 0, Severity::kWarning,
     "has no effect: zero gathers stage-3 parameters with all-gathers", nullptr},
    {"zero_optimization.stage3_allgather_sequential", When::kTrue, 0, Severity::kWarning,
     "has no effect: zero issues each layer's all-gather as one collective", nullptr},
    {"zero_optimization.allgather_sequential", When::kTrue, 0, Severity::kWarning,
     "has no effect: zero issues each layer's all-gather as one collective", nullptr},
    {"zero_optimization.offload_optimizer.fast_init", When::kTrue, 0, Severity::kWarning,
     "has no effect: zero writes the initial states through its swap buffers", nullptr},
    {"zero_optimization.offload_optimizer.convert_grad_on_cpu", When::kPresent, 0, Severity::kWarning,
     "has no effect: zero's CPU Adam widens 16-bit gradients inside its pass (stage 3, or a 16-bit master) and reads fp32 ones as they are", nullptr},
    {"zero_optimization.offload_optimizer.cpuadam_cores_perc", When::kPresent, 0, Severity::kWarning,
     "has no effect: zero's CPU Adam runs on every core oneTBB gives it", nullptr},
    {"bf16.immediate_grad_update", When::kTrue, 0, Severity::kWarning,
     "has no effect: zero adds each gradient into its buffers as backward produces it", nullptr},
    {"zero_allow_untested_optimizer", When::kTrue, 0, Severity::kWarning,
     "has no effect: zero builds its own optimizers from the optimizer section", nullptr},
    {"seq_parallel_communication_data_type", When::kPresent, 0, Severity::kWarning,
     "has no effect: zero has no sequence parallelism", nullptr},
};

// Every top-level key DeepSpeed reads (runtime/constants.py and the section
// getters of runtime/config.py).
const std::vector<std::string>& top_level_keys() {
  static const std::vector<std::string> keys = {
      "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer", "scheduler",
      "fp16", "bf16", "bfloat16", "amp", "torch_autocast", "gradient_clipping", "zero_optimization",
      "prescale_gradients", "gradient_predivide_factor", "gradient_allreduce_op", "sparse_gradients",
      "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "disable_allgather",
      "communication_data_type", "seq_parallel_communication_data_type", "data_types",
      "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "activation_checkpointing", "aio",
      "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "sparse_attention",
      "pipeline", "elasticity", "progressive_layer_drop", "curriculum_learning", "data_efficiency",
      "compression_training", "eigenvalue", "quantize_training", "checkpoint", "autotuning",
      "dataloader_drop_last", "hybrid_engine", "compile", "tensor_parallel", "sequence_parallel_size", "nebula",
      "weight_quantization", "graph_harvesting", "use_data_before_expert_parallelism", "vocabulary_size",
      "log_level", "allgather_size", "managed_gradient_accumulation", "timers", "monitor_config"};
  return keys;
}

const Json* lookup(const Json& root, const std::string& path) {
  const Json* node = &root;
  size_t start = 0;
  for (;;) {
    if (!node->is_object()) return nullptr;
    const size_t dot = path.find('.', start);
    const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    auto it = node->find(part);
    if (it == node->end()) return nullptr;
    node = &*it;
    if (dot == std::string::npos) return node;
    start = dot + 1;
  }
}

bool triggered(const FeatureRule& rule, const Json& v) {
  switch (rule.when) {
    case When::kPresent:
      return !v.is_null();
    case When::kTrue:
      return v.is_boolean() && v.get<bool>();
    case When::kFalse:
      return v.is_boolean() && !v.get<bool>();
    case When::kAbove:
      return v.is_number() && v.get<double>() > rule.bound;
    case When::kBelow:
      return v.is_number() && v.get<double>() < rule.bound;
  }
  return false;
}

}  // namespace

void check_features(Context& ctx, const Json& root) {
  for (const FeatureRule& rule : kFeatures) {
    const Json* v = lookup(root, rule.path);
    if (v == nullptr || !triggered(rule, *v)) continue;
    const std::string got = rule.when == When::kPresent && v->is_object() ? "a " + std::string(rule.path) + " section"
                                                                          : show(*v);
    if (rule.severity == Severity::kError) {
      ctx.problem(rule.path, std::string(rule.feature) + " is not implemented by zero; expected " + rule.expected +
                                 "; got " + got);
    } else if (std::string(rule.feature).rfind("has no effect", 0) == 0) {
      ctx.warn(rule.path, got + " " + rule.feature + " (training is unchanged)");
    } else {
      ctx.warn(rule.path, std::string(rule.feature) + "; ignored (training is unchanged)");
    }
  }
}

// Every unknown top-level key is named, with the nearest known one when it
// is close; keys starting with '_' are comments by convention ("_comment")
// and pass silently. Not errors: DeepSpeed ignores them.
void check_top_level_keys(Context& ctx, const Json& root) {
  const std::vector<std::string>& keys = top_level_keys();
  const std::unordered_set<std::string> known(keys.begin(), keys.end());
  size_t unknown = 0;
  for (const auto& [key, value] : root.items()) {
    if (known.count(key) != 0) continue;
    if (!key.empty() && key[0] == '_') continue;
    if (++unknown > kMaxUnknownKeysShown) continue;  // counted below, without a suggestion's cost
    const std::string suggestion = key.size() >= 4 ? zero::nearest(key, keys, 2) : std::string();
    ctx.warn(key, "unknown top-level key, ignored as DeepSpeed does" +
                      (suggestion.empty() ? std::string() : "; did you mean " + suggestion + "?"));
  }
  if (unknown > kMaxUnknownKeysShown)
    ctx.warn("", "... and " + with_commas(unknown - kMaxUnknownKeysShown) +
                     " more unknown top-level keys, ignored as DeepSpeed does");
}

}  // namespace zero::config::detail
