// zero_optimization, fp16, bf16, aio and activation_checkpointing: the
// pydantic-validated sections (strict) and the plain dicts next to them.
// Rules: ../shared/ds_config_rules.md sections 3, 4 and 6.1-6.2.
#include <cmath>

#include "sections.h"

namespace zero::config::detail {
namespace {

constexpr int64_t kDefaultSubGroupSize = 1000000000;
constexpr int64_t kMinNvmeSubGroup = 1024;   // 4 KiB of fp32: one aligned block per state
constexpr int64_t kSmallSubGroup = 1 << 16;  // below: warned
constexpr int64_t kAioBlockAlignment = 4096;
constexpr int64_t kSmallAioBlock = 1 << 16;  // below: warned

OffloadDevice device_from(const std::string& name) {
  if (name == "cpu") return OffloadDevice::kCpu;
  if (name == "nvme") return OffloadDevice::kNvme;
  return OffloadDevice::kNone;
}

// Optional[Path]: null and absent both mean none.
void read_nvme_path(Section& s, std::string& out, OffloadDevice device) {
  const Json* v = s.raw("nvme_path");
  if (v != nullptr && !v->is_null()) {
    if (s.read_string("nvme_path", out) == Got::kGiven && out.find('\0') != std::string::npos) {
      s.context().problem(s.path_of("nvme_path"), "expected a folder path; got " + show(*v) +
                                                      " (a NUL character cannot be in a path)");
      out.clear();
      return;
    }
  } else {
    s.context().record(s.record_path_of("nvme_path"), nullptr, Origin::kDefault);
  }
  if (device == OffloadDevice::kNvme && out.empty()) {
    s.context().problem(s.path_of("nvme_path"),
                        "expected a directory path when device is nvme; got " +
                            (v == nullptr ? std::string("nothing") : show(*v)));
  }
}

// sub_group_size: here sub-groups are element
// ranges of the owned partition, each one pass of the optimizer loop and,
// on NVMe, its own 4 KiB-aligned extent in each state's swap file.
void read_sub_group_size(Section& zs, ZeroConfig& z) {
  Context& ctx = zs.context();
  if (zs.read_int("sub_group_size", z.sub_group_size, Range::at_least(0)) != Got::kGiven) return;
  const std::string path = zs.path_of("sub_group_size");
  if (z.sub_group_size == 0) {
    // DeepSpeed's 0 puts each parameter in a sub-group of its own; ranges of
    // one element would be a pass per element.
    z.sub_group_size = kDefaultSubGroupSize;
    ctx.record(zs.record_path_of("sub_group_size"), z.sub_group_size, Origin::kDerived);
    ctx.warn(path, "0 (DeepSpeed: one sub-group per parameter) is read as the default 1e9: sub-groups here are "
                   "element ranges of the partition, and a range per parameter buys nothing");
    return;
  }
  if (z.offload_optimizer.device == OffloadDevice::kNvme && z.sub_group_size < kMinNvmeSubGroup) {
    ctx.problem(path, "expected at least " + std::to_string(kMinNvmeSubGroup) +
                          " with offload_optimizer nvme; got " + std::to_string(z.sub_group_size) +
                          " (each sub-group is a 4 KiB-aligned extent of every state's swap file: smaller "
                          "sub-groups make the files mostly padding, e.g. 1 makes 4 KiB per element per state)");
  } else if (z.sub_group_size < kSmallSubGroup) {
    ctx.warn(path, std::to_string(z.sub_group_size) +
                       " is far below the default 1e9: each sub-group is one pass of the optimizer loop (with "
                       "offload, one set of transfers), so a model of N elements per rank takes N / " +
                       std::to_string(z.sub_group_size) + " of them per step");
  }
}

void read_offload_param(Section& zs, OffloadParamConfig& o) {
  Section s = zs.child("offload_param", Kind::kStrict);
  std::string device = "none";
  s.read_enum("device", device, {"none", "cpu", "nvme"}, /*case_sensitive=*/true);
  o.device = device_from(device);
  read_nvme_path(s, o.nvme_path, o.device);
  // The swap buffers exist only with nvme: there, as the engine requires, at
  // least one buffer of at least one element (DeepSpeed's schema allows 0).
  const Range swap = o.device == OffloadDevice::kNvme ? Range::at_least(1) : Range::at_least(0);
  s.read_int("buffer_count", o.buffer_count, swap);
  s.read_int("buffer_size", o.buffer_size, swap);
  s.read_int("max_in_cpu", o.max_in_cpu, Range::at_least(0));
  s.read_bool("pin_memory", o.pin_memory);
  s.finish();
}

void read_offload_optimizer(Section& zs, OffloadOptimizerConfig& o) {
  Section s = zs.child("offload_optimizer", Kind::kStrict);
  std::string device = "none";
  s.read_enum("device", device, {"none", "cpu", "nvme"}, /*case_sensitive=*/true);
  o.device = device_from(device);
  read_nvme_path(s, o.nvme_path, o.device);
  s.read_int("buffer_count", o.buffer_count,
             o.device == OffloadDevice::kNvme ? Range::at_least(1) : Range::at_least(0));
  s.read_bool("pin_memory", o.pin_memory);
  s.read_bool("pipeline_read", o.pipeline_read);
  s.read_bool("pipeline_write", o.pipeline_write);
  s.read_bool("fast_init", o.fast_init);
  s.read_double("ratio", o.ratio, Range::between(0.0, 1.0));
  s.read_bool("super_offload", o.super_offload);
  s.read_bool("gradients_on_device", o.gradients_on_device);  // zero's own (NOTE [device gradients])
  s.read_int("max_in_cpu", o.max_in_cpu, Range::at_least(0));  // zero's own (NOTE [state placement])
  // Valid DeepSpeed keys that only tune DeepSpeed's own CPU Adam.
  bool unused_bool = true;
  s.read_bool("convert_grad_on_cpu", unused_bool, {}, /*record=*/false);
  double unused_double = 0.8;
  s.read_double("cpuadam_cores_perc", unused_double, Range::between(0.0, 1.0), {}, /*record=*/false);
  s.finish();
}

// A deprecated boolean that becomes an offload block (rules 3.4).
void read_deprecated_offload(Section& zs, const char* old_key, const char* new_key, OffloadDevice& device,
                             const std::string& device_record_path) {
  const Json* v = zs.raw(old_key);
  if (v == nullptr || v->is_null()) return;
  Context& ctx = zs.context();
  bool enabled = false;
  if (zs.read_bool(old_key, enabled, {}, /*record=*/false) != Got::kGiven) return;
  if (zs.raw(new_key) != nullptr) {
    ctx.problem(zs.path_of(old_key), std::string("expected either ") + old_key + " (deprecated) or " + new_key +
                                         "; got both (DeepSpeed: Cannot provide deprecated parameter '" + old_key +
                                         "' and replacing parameter '" + new_key + "' together)");
    return;
  }
  ctx.warn(zs.path_of(old_key), std::string("deprecated; use ") + new_key + (enabled ? ": {\"device\": \"cpu\"}" : "") +
                                    " (read as " + (enabled ? "device cpu" : "no offload") + ")");
  if (enabled) {
    device = OffloadDevice::kCpu;
    ctx.record(device_record_path, "cpu", Origin::kDerived);
  }
}

void read_zero_fields(Section& zs, Config& config) {
  Context& ctx = zs.context();
  ZeroConfig& z = config.zero;
  const AutoValues& av = ctx.auto_values();

  int64_t stage = 0;
  zs.read_int("stage", stage, Range::between(0, 3));
  z.stage = static_cast<int>(stage);
  const bool stage3 = z.stage == 3;

  // The Hugging Face integration fills these from the model's hidden size;
  // the two stage3_* ones only for ZeRO-3 (rules 8.2).
  const std::optional<int64_t> hidden = av.hidden_size;
  const AutoFill reduce_fill{hidden ? std::optional<Json>(*hidden * *hidden) : std::nullopt, "hidden_size"};
  AutoFill prefetch_fill;
  AutoFill persistence_fill;
  if (stage3) {
    prefetch_fill = AutoFill{hidden ? std::optional<Json>(static_cast<int64_t>(0.9 * static_cast<double>(*hidden * *hidden)))
                                    : std::nullopt,
                             "hidden_size"};
    persistence_fill = AutoFill{hidden ? std::optional<Json>(10 * *hidden) : std::nullopt, "hidden_size"};
  }

  zs.read_bool("contiguous_gradients", z.contiguous_gradients);
  zs.read_bool("reduce_scatter", z.reduce_scatter);
  zs.read_int("reduce_bucket_size", z.reduce_bucket_size, Range::at_least(0), reduce_fill);
  zs.read_bool("use_multi_rank_bucket_allreduce", z.use_multi_rank_bucket_allreduce);
  zs.read_bool("allgather_partitions", z.allgather_partitions);
  zs.read_int("allgather_bucket_size", z.allgather_bucket_size, Range::at_least(0));

  // Optional[bool]: unset (absent, null or a dropped "auto") means stage == 3.
  const Json* overlap = zs.raw("overlap_comm");
  const bool overlap_unset = overlap == nullptr || overlap->is_null() ||
                             (overlap->is_string() && overlap->get_ref<const std::string&>() == "auto");
  if (overlap_unset) {
    if (overlap != nullptr && overlap->is_string()) {
      ctx.warn(zs.path_of("overlap_comm"), "\"auto\" is dropped as DeepSpeed does; unset means true iff stage is 3");
    }
    z.overlap_comm = stage3;
    ctx.record(zs.record_path_of("overlap_comm"), z.overlap_comm, Origin::kDerived);
  } else {
    zs.read_bool("overlap_comm", z.overlap_comm);
  }

  zs.read_bool("load_from_fp32_weights", z.load_from_fp32_weights);
  zs.read_bool("elastic_checkpoint", z.elastic_checkpoint);
  read_offload_param(zs, z.offload_param);
  read_offload_optimizer(zs, z.offload_optimizer);
  read_sub_group_size(zs, z);
  zs.read_int({"stage3_prefetch_bucket_size", "prefetch_bucket_size"}, z.prefetch_bucket_size, Range::at_least(0),
              prefetch_fill);
  zs.read_int({"stage3_param_persistence_threshold", "param_persistence_threshold"}, z.param_persistence_threshold,
              Range::at_least(0), persistence_fill);
  zs.read_int({"stage3_model_persistence_threshold", "model_persistence_threshold"}, z.model_persistence_threshold,
              Range::at_least(0));
  zs.read_int({"stage3_max_live_parameters", "max_live_parameters"}, z.max_live_parameters, Range::at_least(0));
  zs.read_int({"stage3_max_reuse_distance", "max_reuse_distance"}, z.max_reuse_distance, Range::at_least(0));
  zs.read_bool({"stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"},
               z.gather_16bit_weights_on_model_save);
  zs.read_int({"stage3_module_granularity_threshold", "module_granularity_threshold"}, z.module_granularity_threshold);
  zs.read_bool({"stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params"},
               z.use_all_reduce_for_fetch_params);
  zs.read_bool({"stage3_allgather_sequential", "allgather_sequential"}, z.allgather_sequential);
  zs.read_bool("ignore_unused_parameters", z.ignore_unused_parameters);
  zs.read_bool("round_robin_gradients", z.round_robin_gradients);
  zs.read_int("zero_hpz_partition_size", z.zero_hpz_partition_size, Range::at_least(0));
  zs.read_bool("zero_quantized_weights", z.zero_quantized_weights);
  zs.read_bool("zero_quantized_gradients", z.zero_quantized_gradients);
  zs.read_int("zero_quantized_weights_block_size", z.zero_quantized_weights_block_size, Range::at_least(4));
  zs.read_int("mics_shard_size", z.mics_shard_size, Range::at_least(-1));
  zs.read_bool("mics_hierarchical_params_gather", z.mics_hierarchical_params_gather);

  // Deprecated keys (rules 3.4).
  read_deprecated_offload(zs, "cpu_offload", "offload_optimizer", z.offload_optimizer.device,
                          zs.record_path_of("offload_optimizer.device"));
  read_deprecated_offload(zs, "cpu_offload_param", "offload_param", z.offload_param.device,
                          zs.record_path_of("offload_param.device"));
  if (const Json* v = zs.raw("cpu_offload_use_pin_memory"); v != nullptr && !v->is_null()) {
    bool unused = false;
    if (zs.read_bool("cpu_offload_use_pin_memory", unused, {}, /*record=*/false) == Got::kGiven) {
      ctx.warn(zs.path_of("cpu_offload_use_pin_memory"),
               "deprecated and without effect; use offload_param/offload_optimizer pin_memory");
    }
  }
  if (const Json* v = zs.raw("stage3_gather_fp16_weights_on_model_save"); v != nullptr && !v->is_null()) {
    bool value = false;
    const Got got = zs.read_bool("stage3_gather_fp16_weights_on_model_save", value, {}, /*record=*/false);
    if (zs.raw("gather_16bit_weights_on_model_save") != nullptr ||
        zs.raw("stage3_gather_16bit_weights_on_model_save") != nullptr) {
      ctx.problem(zs.path_of("stage3_gather_fp16_weights_on_model_save"),
                  "expected either stage3_gather_fp16_weights_on_model_save (deprecated) or "
                  "gather_16bit_weights_on_model_save; got both");
    } else if (got == Got::kGiven) {
      ctx.warn(zs.path_of("stage3_gather_fp16_weights_on_model_save"),
               "deprecated; use stage3_gather_16bit_weights_on_model_save (read as that)");
      z.gather_16bit_weights_on_model_save = value;
      ctx.record(zs.record_path_of("stage3_gather_16bit_weights_on_model_save"), value, Origin::kGiven);
    }
  }

  // Valid keys that zero does not store. Booleans are type-checked; the ones
  // that would change training are refused by features.cpp.
  for (const char* key : {"legacy_stage1", "zero_quantized_nontrainable_weights", "memory_efficient_linear",
                          "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
                          "enable_sanity_checks", "save_muon_momentum_buffer_in_memory"}) {
    bool unused = false;
    zs.read_bool(key, unused, {}, /*record=*/false);
  }
  int64_t unused_int = 0;
  zs.read_int({"stage3_partition_stream_chunk_size", "partition_stream_chunk_size"}, unused_int, Range::at_least(0),
              {}, /*record=*/false);
  zs.known({"zeropp_loco_param", "leaf_module", "zenflow"});

  // Cross-field rules.
  if (z.offload_optimizer.ratio < 1.0 && !stage3) {
    ctx.problem(zs.path_of("offload_optimizer.ratio"),
                "expected 1.0 unless stage is 3 (DeepSpeed: Partial offloading only supported for ZeRO Stage 3.); got " +
                    Json(z.offload_optimizer.ratio).dump());
  } else if (z.offload_optimizer.ratio < 1.0) {
    // NOTE [partial offload]: the device keeps 1 - ratio of the optimizer
    // states, beside shards on the device, with the host's share in memory.
    const std::string path = zs.path_of("offload_optimizer.ratio");
    const std::string got = "; got " + Json(z.offload_optimizer.ratio).dump();
    if (z.offload_optimizer.device == OffloadDevice::kNone)
      ctx.warn(path, "has no effect without offload_optimizer.device \"cpu\" or \"nvme\": every optimizer state is "
                     "on the device");
    else if (z.offload_param.device != OffloadDevice::kNone)
      ctx.problem(path, "expected 1.0 with offload_param (zero keeps a device share of the optimizer states only "
                        "where the parameter shards stay on the device)" + got);
  }
  // ZeRO++ (NOTE [quantized gather], NOTE [hpZ]): stage 3's gathers.
  if (z.zero_quantized_weights_block_size % 4 != 0)
    ctx.problem(zs.path_of("zero_quantized_weights_block_size"),
                "expected a multiple of 4 (a block's codes are followed by its 4-byte scale); got " +
                    std::to_string(z.zero_quantized_weights_block_size));
  if (!stage3) {
    if (z.zero_quantized_weights)
      ctx.warn(zs.path_of("zero_quantized_weights"),
               "has no effect below stage 3 (stage is " + std::to_string(z.stage) + "): no parameters are gathered");
    if (z.zero_hpz_partition_size > 1)
      ctx.warn(zs.path_of("zero_hpz_partition_size"),
               "has no effect below stage 3 (stage is " + std::to_string(z.stage) + "): no parameters are gathered");
    if (z.zero_quantized_gradients)
      ctx.warn(zs.path_of("zero_quantized_gradients"),
               "has no effect below stage 3 (stage is " + std::to_string(z.stage) + "): ZeRO++ quantizes stage 3's "
               "gradient reduction");
  }
  if (stage3 && zs.has("zero_quantized_weights_block_size") && !z.zero_quantized_weights && !z.zero_quantized_gradients)
    ctx.warn(zs.path_of("zero_quantized_weights_block_size"),
             "has no effect without zero_quantized_weights or zero_quantized_gradients: nothing is quantized");
  if (stage3 && z.zero_hpz_partition_size > 1 && ctx.options().world_size > 1 &&
      z.zero_hpz_partition_size == ctx.options().world_size)
    ctx.warn(zs.path_of("zero_hpz_partition_size"),
             "equals the world size " + std::to_string(ctx.options().world_size) +
                 ": the secondary partition spans every rank, as the primary one does, so no gather changes; hpZ "
                 "helps where it is the ranks of one node, fewer than the world's");
  if (z.zero_hpz_partition_size > 1 && ctx.options().world_size > 1 &&
      ctx.options().world_size % z.zero_hpz_partition_size != 0)
    ctx.problem(zs.path_of("zero_hpz_partition_size"),
                "expected a divisor of the world size " + std::to_string(ctx.options().world_size) +
                    " (the ranks of a node); got " + std::to_string(z.zero_hpz_partition_size));
  // NOTE [MiCS]: shard groups of consecutive ranks, at stages 2 and 3.
  if (z.mics_shard_size > 0) {
    const std::string path = zs.path_of("mics_shard_size");
    const int64_t world = ctx.options().world_size;
    if (z.stage < 2) {
      ctx.warn(path, "has no effect below stage 2 (stage is " + std::to_string(z.stage) +
                         "): zero shards the gradients and optimizer states within MiCS groups at stages 2 and 3");
    } else if (world > 1 && (z.mics_shard_size > world || world % z.mics_shard_size != 0)) {
      ctx.problem(path, "expected a divisor of the world size " + std::to_string(world) +
                            " (the ranks each shard group partitions the model states across); got " +
                            std::to_string(z.mics_shard_size));
    }
    if (z.stage >= 2) {
      // Both define which ranks hold a partition's copy; ZeRO++'s gradient
      // hops are over the world's nodes, not a shard group's.
      if (z.zero_hpz_partition_size > 1 && stage3)
        ctx.problem(zs.path_of("zero_hpz_partition_size"),
                    "expected 1 with mics_shard_size (MiCS already keeps each layer's partition within a shard "
                    "group, whose gathers stay there); got " + std::to_string(z.zero_hpz_partition_size));
      if (z.zero_quantized_gradients && stage3)
        ctx.problem(zs.path_of("zero_quantized_gradients"),
                    "expected false with mics_shard_size (zero's quantized two-hop reduction is over the world's "
                    "nodes; MiCS reduces within the shard group, then across its replicas); got true");
    }
  }
  if (z.mics_hierarchical_params_gather && !(stage3 && z.mics_shard_size > 0))
    ctx.warn(zs.path_of("mics_hierarchical_params_gather"),
             "has no effect without mics_shard_size at stage 3 (stage is " + std::to_string(z.stage) +
                 "): it shapes the gathers of a MiCS shard group's layers");
  // NOTE [state placement]: zero's own key.
  if (z.offload_optimizer.max_in_cpu > 0 && z.offload_optimizer.device != OffloadDevice::kNvme)
    ctx.warn(zs.path_of("offload_optimizer.max_in_cpu"),
             "has no effect without offload_optimizer.device \"nvme\": the offloaded optimizer states are all in "
             "host memory (or on the device) already");
  // NOTE [device gradients]: zero's own key.
  if (z.offload_optimizer.gradients_on_device) {
    const std::string path = zs.path_of("offload_optimizer.gradients_on_device");
    if (z.stage < 2 || z.offload_optimizer.device == OffloadDevice::kNone)
      ctx.warn(path, "has no effect without a gradient partition offloaded (stages 2-3 with offload_optimizer): "
                     "the gradients are on the device already");
    else if (z.offload_optimizer.super_offload && stage3 && z.offload_optimizer.device == OffloadDevice::kCpu &&
             z.offload_param.device == OffloadDevice::kNone)
      ctx.problem(path, "expected false with offload_optimizer.super_offload (its CPU steps during backward read "
                        "the gradients in host memory); got true");
  }
  // SuperOffload is DeepSpeed's stage-3 optimizer; elsewhere DeepSpeed
  // ignores the key, and so does zero, saying so.
  if (z.offload_optimizer.super_offload) {
    const std::string path = zs.path_of("offload_optimizer.super_offload");
    if (!stage3)
      ctx.warn(path, "has no effect below stage 3 (stage is " + std::to_string(z.stage) +
                         "): the CPU step runs after backward");
    else if (z.offload_optimizer.device != OffloadDevice::kCpu)
      ctx.warn(path, std::string("has no effect without offload_optimizer.device \"cpu\" (it is \"") +
                         (z.offload_optimizer.device == OffloadDevice::kNvme ? "nvme" : "none") +
                         "\"): the CPU step runs after backward");
    else if (z.offload_param.device != OffloadDevice::kNone)
      ctx.warn(path, "has no effect with offload_param: zero speculates only while the parameter shards stay on "
                     "the device (NOTE [speculative step]); the CPU step runs after backward");
    else if (z.offload_optimizer.ratio == 0.0)
      ctx.warn(path, "has no effect with offload_optimizer.ratio 0: every optimizer state stays on the device "
                     "(NOTE [partial offload])");
  }
  if (z.offload_param.device != OffloadDevice::kNone && !stage3) {
    ctx.warn(zs.path_of("offload_param"), "has no effect below stage 3 (stage is " + std::to_string(z.stage) + ")");
  }
  if (z.offload_optimizer.device != OffloadDevice::kNone && z.stage == 0) {
    ctx.warn(zs.path_of("offload_optimizer"), "has no effect at stage 0");
  }
}

}  // namespace

void read_zero(Section& top, Config& config) {
  Context& ctx = top.context();
  const Json* raw = top.raw("zero_optimization");
  top.known({"allgather_size"});
  if (raw != nullptr && raw->is_boolean()) {
    // Legacy form (rules 3.1): true is stage 1 with the top-level allgather_size.
    Section defaults(ctx, "zero_optimization", nullptr, Kind::kStrict);
    read_zero_fields(defaults, config);
    const bool enabled = raw->get<bool>();
    config.zero.stage = enabled ? 1 : 0;
    ctx.record("zero_optimization.stage", config.zero.stage, Origin::kDerived);
    ctx.warn("zero_optimization", std::string("a boolean is deprecated; write {\"stage\": ") + (enabled ? "1" : "0") +
                                      "} (read as stage " + (enabled ? "1" : "0") + ")");
    if (enabled) {
      int64_t size = 500000000;
      if (top.read_int("allgather_size", size, Range::at_least(0), {}, /*record=*/false) == Got::kGiven) {
        config.zero.allgather_bucket_size = size;
        ctx.record("zero_optimization.allgather_bucket_size", size, Origin::kDerived);
      }
    }
    return;
  }
  Section zs = top.child("zero_optimization", Kind::kStrict);
  read_zero_fields(zs, config);
  zs.finish();
}

void read_precision(Section& top, Config& config) {
  Context& ctx = top.context();
  const std::optional<std::string>& precision = ctx.auto_values().precision;

  Fp16Config& f = config.fp16;
  Section fs = top.child("fp16", Kind::kStrict);
  fs.read_bool("enabled", f.enabled,
               AutoFill{precision ? std::optional<Json>(*precision == "fp16") : std::nullopt, "precision"});
  fs.read_bool("auto_cast", f.auto_cast);
  fs.read_double("loss_scale", f.loss_scale, Range::at_least(0));
  fs.read_int("initial_scale_power", f.initial_scale_power);
  const Got window = fs.read_int("loss_scale_window", f.loss_scale_window);
  int64_t min_loss_scale = 1;
  const Got min_scale = fs.read_int("min_loss_scale", min_loss_scale);
  f.min_loss_scale = static_cast<double>(min_loss_scale);
  fs.read_int("hysteresis", f.hysteresis);
  fs.read_bool("consecutive_hysteresis", f.consecutive_hysteresis);
  fs.read_bool("fp16_master_weights_and_grads", f.fp16_master_weights_and_grads);
  const Got fp16_rounding = fs.read_bool("stochastic_rounding", f.stochastic_rounding);
  fs.finish();
  // Rules 4.3: positive only matters for dynamic scaling.
  if (f.enabled && f.loss_scale == 0) {
    if (window != Got::kBad && f.loss_scale_window <= 0) {
      ctx.problem("fp16.loss_scale_window", "expected an integer > 0 with dynamic loss scaling (loss_scale 0); got " +
                                                std::to_string(f.loss_scale_window));
    }
    if (min_scale != Got::kBad && min_loss_scale <= 0) {
      ctx.problem("fp16.min_loss_scale", "expected an integer > 0 with dynamic loss scaling (loss_scale 0); got " +
                                             std::to_string(min_loss_scale));
    }
  }

  // Rules 4.2: "bfloat16" only when "bf16" is absent.
  const Json* bf16 = top.raw("bf16");
  const Json* legacy = top.raw("bfloat16");
  const bool bf16_absent = bf16 == nullptr || bf16->is_null();
  const bool use_legacy = bf16_absent && legacy != nullptr && !legacy->is_null();
  if (use_legacy) {
    ctx.warn("bfloat16", "legacy name of bf16, read because bf16 is absent");
  } else if (!bf16_absent && legacy != nullptr) {
    ctx.warn("bfloat16", "ignored because bf16 is present (as DeepSpeed does)");
  }
  Bf16Config& b = config.bf16;
  Section bs = top.child(use_legacy ? "bfloat16" : "bf16", Kind::kStrict, std::string("bf16"));
  // The Hugging Face integration fills only bf16.enabled, not bfloat16.enabled.
  const AutoFill bf16_fill = use_legacy ? AutoFill{}
                                        : AutoFill{precision ? std::optional<Json>(*precision == "bf16") : std::nullopt,
                                                   "precision"};
  bs.read_bool("enabled", b.enabled, bf16_fill);
  bs.read_bool("immediate_grad_update", b.immediate_grad_update);
  bs.read_bool("check_grad_overflow", b.check_grad_overflow);
  bs.read_bool("bf16_master_weights_and_grads", b.bf16_master_weights_and_grads);
  bs.read_bool("bf16_optimizer_states", b.bf16_optimizer_states);
  const Got bf16_rounding = bs.read_bool("stochastic_rounding", b.stochastic_rounding);
  bs.finish();
  // Rounding of a 16-bit master (NOTE [16-bit master]): nothing to round
  // without one, so a key given then would be ignored without a word.
  if (fp16_rounding == Got::kGiven && !(f.enabled && f.fp16_master_weights_and_grads))
    ctx.warn("fp16.stochastic_rounding", "ignored: it rounds a 16-bit master, and fp16.fp16_master_weights_and_grads "
                                         "is not on (with fp16.enabled)");
  if (bf16_rounding == Got::kGiven && !(b.enabled && b.bf16_master_weights_and_grads))
    ctx.warn(bs.path_of("stochastic_rounding"), "ignored: it rounds a 16-bit master, and " +
                                                    bs.path_of("bf16_master_weights_and_grads") +
                                                    " is not on (with " + bs.path_of("enabled") + ")");

  if (f.enabled && b.enabled) {
    ctx.problem(bs.path_of("enabled"),
                "expected at most one of fp16.enabled and " + bs.path_of("enabled") +
                    " true; got both (DeepSpeed: bfloat16 and fp16 modes cannot be simultaneously enabled)");
  }
  const int stage = config.zero.stage;
  if (f.fp16_master_weights_and_grads && stage == 0) {
    ctx.problem("fp16.fp16_master_weights_and_grads", "expected false unless ZeRO stage is 1-3; got true at stage 0");
  }
  if (b.bf16_master_weights_and_grads && stage == 0) {
    ctx.problem(bs.path_of("bf16_master_weights_and_grads"),
                "expected false unless ZeRO stage is 1-3; got true at stage 0");
  }
  if (b.bf16_optimizer_states && (stage == 0 || !b.bf16_master_weights_and_grads)) {
    ctx.problem(bs.path_of("bf16_optimizer_states"),
                "expected false unless ZeRO stage is 1-3 and bf16_master_weights_and_grads is true; got true");
  }
  // A master in a precision the run does not compute in: DeepSpeed builds
  // no such optimizer and the key has no effect; say so.
  if (f.fp16_master_weights_and_grads && !f.enabled && stage > 0)
    ctx.warn("fp16.fp16_master_weights_and_grads", "ignored: fp16.enabled is false (the master stays fp32)");
  if (b.bf16_master_weights_and_grads && !b.enabled && stage > 0)
    ctx.warn(bs.path_of("bf16_master_weights_and_grads"), "ignored: " + bs.path_of("enabled") +
                                                             " is false (the master and states stay fp32)");
}

void read_aio(Section& top, Config& config) {
  Context& ctx = top.context();
  AioConfig& a = config.aio;
  Section s = top.child("aio", Kind::kPlain);
  if (s.read_int("block_size", a.block_size, Range::above(0)) == Got::kGiven) {
    if (a.block_size % kAioBlockAlignment != 0) {
      ctx.problem(s.path_of("block_size"),
                  "expected a multiple of " + std::to_string(kAioBlockAlignment) + " bytes (O_DIRECT moves whole " +
                      "4 KiB blocks; DeepSpeed's default is 1048576); got " + std::to_string(a.block_size));
    } else if (a.block_size < kSmallAioBlock) {
      ctx.warn(s.path_of("block_size"),
               std::to_string(a.block_size) + " bytes is far below the default 1048576: every block is one "
               "request to the disk, so a 1 GiB swap file takes " + std::to_string((int64_t{1} << 30) / a.block_size) +
               " of them per pass (zero nvme-tune measures the best size)");
    }
  }
  s.read_int("queue_depth", a.queue_depth, Range::above(0));
  const Got intra = s.read_int("intra_op_parallelism", a.intra_op_parallelism, Range::at_least(1));
  s.read_bool("single_submit", a.single_submit);
  s.read_bool("overlap_events", a.overlap_events);
  s.read_bool("use_gds", a.use_gds);
  if (const Json* v = s.raw("thread_count"); v != nullptr && !v->is_null()) {
    if (intra == Got::kAbsent) {
      if (s.read_int("thread_count", a.intra_op_parallelism, Range::at_least(1), {}, /*record=*/false) == Got::kGiven) {
        ctx.record("aio.intra_op_parallelism", a.intra_op_parallelism, Origin::kGiven);
        ctx.warn("aio.thread_count", "legacy name of intra_op_parallelism, used as that (DeepSpeed ignores it)");
      }
    } else {
      ctx.warn("aio.thread_count", "legacy name of intra_op_parallelism; ignored because intra_op_parallelism is given");
    }
  }
  s.finish();
}

void read_activation_checkpointing(Section& top, Config& config) {
  Context& ctx = top.context();
  ActivationCheckpointingConfig& a = config.activation_checkpointing;
  Section s = top.child("activation_checkpointing", Kind::kPlain);
  s.read_bool("partition_activations", a.partition_activations);
  s.read_bool("contiguous_memory_optimization", a.contiguous_memory_optimization);
  s.read_bool("cpu_checkpointing", a.cpu_checkpointing);
  int64_t number = 0;
  const Got got = s.read_int("number_checkpoints", number, Range::at_least(0), {}, /*record=*/false);
  if (got == Got::kGiven) {
    a.number_checkpoints = number;
    ctx.record("activation_checkpointing.number_checkpoints", number, Origin::kGiven);
  } else {
    ctx.record("activation_checkpointing.number_checkpoints", nullptr, Origin::kDefault);
  }
  s.read_bool("synchronize_checkpoint_boundary", a.synchronize_checkpoint_boundary);
  s.read_bool("profile", a.profile);
  s.finish();
}

}  // namespace zero::config::detail
