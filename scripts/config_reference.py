#!/usr/bin/env python3
"""Writes the key table of docs/configuration.md from the code: every key
`zero config check` resolves for the configs in tests/docs/config_reference/
(between each section's stage, offload tiers, precisions, optimizers and
schedules), with its default. tests/docs/config_reference_test.sh fails when
a key the code reads has no row.

usage: scripts/config_reference.py BUILD_DIR [--check]
  rewrites docs/configuration.md's table; with --check, exits 1 naming the
  keys whose rows are missing or differ, and writes nothing.
"""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# zero's own keys (DeepSpeed refuses or ignores them).
OWN = {
    "zero_optimization.offload_optimizer.gradients_on_device",
    "zero_optimization.offload_optimizer.max_in_cpu",
    "zero_optimization.zero_quantized_weights_block_size",
}
# What each key means, in DeepSpeed's terms (zero's own keys: zero's).
MEANING = {
    "train_batch_size": "samples per optimizer step over all ranks: micro-batch x accumulation steps x data-parallel ranks",
    "train_micro_batch_size_per_gpu": "samples a rank runs in one forward and backward",
    "gradient_accumulation_steps": "micro-steps whose gradients are summed before one optimizer step",
    "gradient_clipping": "the global gradient norm is clipped to this before the step (0: no clipping)",
    "zero_optimization.stage": "0: data parallel; 1: optimizer states partitioned; 2: and gradients; 3: and parameters",
    "zero_optimization.contiguous_gradients": "copy gradients into one contiguous buffer as they are produced",
    "zero_optimization.reduce_scatter": "reduce gradients with reduce-scatter (each rank gets its partition) rather than all-reduce",
    "zero_optimization.reduce_bucket_size": "elements reduced at once: larger buckets, fewer collectives, more memory",
    "zero_optimization.use_multi_rank_bucket_allreduce": "stage 1-2: all-reduce a bucket's gradients across ranks in one call",
    "zero_optimization.allgather_partitions": "stage 1-2: gather the updated partitions with all-gather after the step",
    "zero_optimization.allgather_bucket_size": "elements gathered at once after the step",
    "zero_optimization.overlap_comm": "overlap gradient reduction with the backward pass",
    "zero_optimization.load_from_fp32_weights": "initialise the fp32 master from the checkpoint's fp32 weights on load",
    "zero_optimization.elastic_checkpoint": "checkpoints that load at another world size (zero's always do)",
    "zero_optimization.offload_param.device": "stage 3: where parameter shards live: none (the device), cpu or nvme",
    "zero_optimization.offload_param.nvme_path": "folder of the parameter swap files",
    "zero_optimization.offload_param.buffer_count": "pinned buffers for parameter swap-ins",
    "zero_optimization.offload_param.buffer_size": "elements per parameter swap buffer",
    "zero_optimization.offload_param.max_in_cpu": "with nvme: parameter elements kept in host memory",
    "zero_optimization.offload_param.pin_memory": "page-locked host memory for the offloaded parameters",
    "zero_optimization.offload_optimizer.device": "where the fp32 master and optimizer states live and step: none, cpu or nvme",
    "zero_optimization.offload_optimizer.nvme_path": "folder of the optimizer-state swap files",
    "zero_optimization.offload_optimizer.buffer_count": "pinned buffers for optimizer-state swaps",
    "zero_optimization.offload_optimizer.pin_memory": "page-locked host memory for the offloaded states",
    "zero_optimization.offload_optimizer.pipeline_read": "with nvme: read the next sub-group's states while one steps",
    "zero_optimization.offload_optimizer.pipeline_write": "with nvme: write a sub-group's states back while the next steps",
    "zero_optimization.offload_optimizer.fast_init": "with nvme: skip writing the initial states through the swap pipeline",
    "zero_optimization.offload_optimizer.ratio": "stage 3: the share of the optimizer states offloaded (the rest step on the device)",
    "zero_optimization.offload_optimizer.super_offload": "SuperOffload: the CPU optimizer steps during backward, overlapped",
    "zero_optimization.offload_optimizer.gradients_on_device": "keep the reduced gradients on the device while the states are offloaded",
    "zero_optimization.offload_optimizer.max_in_cpu": "with nvme: optimizer-state elements kept in host memory instead of on disk",
    "zero_optimization.sub_group_size": "elements of a sub-group: the unit the offloaded optimizer steps and swaps",
    "zero_optimization.stage3_prefetch_bucket_size": "stage 3: parameter elements gathered ahead of use",
    "zero_optimization.stage3_param_persistence_threshold": "stage 3: parameters of at most this many elements stay whole on every rank",
    "zero_optimization.stage3_model_persistence_threshold": "stage 3: a cap on the elements kept whole by the persistence threshold",
    "zero_optimization.stage3_max_live_parameters": "stage 3: gathered parameter elements a rank may hold at once",
    "zero_optimization.stage3_max_reuse_distance": "stage 3: a parameter used again within this many elements is not released",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "stage 3: gather the full 16-bit weights when the model is saved",
    "zero_optimization.stage3_module_granularity_threshold": "stage 3: modules with fewer parameters are fetched as one unit with their parent",
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": "stage 3: fetch parameters with all-reduce instead of all-gather",
    "zero_optimization.stage3_allgather_sequential": "stage 3: gather a layer's parameters one after another",
    "zero_optimization.ignore_unused_parameters": "parameters without a gradient in a step are allowed",
    "zero_optimization.round_robin_gradients": "stage 1-2 with offload: gradients copied to the host by ranks in turn",
    "zero_optimization.zero_hpz_partition_size": "ZeRO++ hpZ: ranks of the secondary parameter partition (a node's), for backward's gathers",
    "zero_optimization.zero_quantized_weights": "ZeRO++ qwZ: stage 3's parameter gathers send int8 blocks",
    "zero_optimization.zero_quantized_gradients": "ZeRO++ qgZ: stage 3's gradient reduction sends quantized blocks",
    "zero_optimization.zero_quantized_weights_block_size": "elements per quantization block of qwZ and qgZ",
    "zero_optimization.mics_shard_size": "MiCS: ranks of a shard group; states partitioned within it, replicated across groups",
    "zero_optimization.mics_hierarchical_params_gather": "MiCS: gather parameters within the node first, then across nodes",
    "fp16.enabled": "train in fp16 with dynamic loss scaling",
    "fp16.auto_cast": "cast the model's inputs to fp16",
    "fp16.loss_scale": "a fixed loss scale (0: dynamic)",
    "fp16.initial_scale_power": "the dynamic loss scale starts at 2 to this power",
    "fp16.loss_scale_window": "steps without overflow before the scale grows",
    "fp16.min_loss_scale": "the dynamic scale's floor",
    "fp16.hysteresis": "overflows tolerated before the scale shrinks",
    "fp16.consecutive_hysteresis": "the hysteresis counter refills after a step without overflow",
    "fp16.fp16_master_weights_and_grads": "keep the master weights and gradients in fp16",
    "fp16.stochastic_rounding": "round the fp16 update stochastically",
    "bf16.enabled": "train in bf16 (no loss scaling)",
    "bf16.immediate_grad_update": "apply gradients to the master as they are reduced",
    "bf16.check_grad_overflow": "check bf16 gradients for inf and NaN before the step",
    "bf16.bf16_master_weights_and_grads": "keep the master weights and gradients in bf16",
    "bf16.bf16_optimizer_states": "keep the optimizer states (moments) in bf16",
    "bf16.stochastic_rounding": "round the bf16 update stochastically",
    "prescale_gradients": "divide gradients by the world size before the reduction, not after",
    "gradient_predivide_factor": "divide gradients by this before the reduction and by world/factor after",
    "gradient_allreduce_op": "how gradients are combined across ranks (mean or sum)",
    "steps_per_print": "steps between progress lines",
    "wall_clock_breakdown": "time forward, backward and step and print them",
    "memory_breakdown": "print memory use as training goes",
    "zero_allow_untested_optimizer": "allow a client optimizer ZeRO has not been tested with",
    "zero_force_ds_cpu_optimizer": "with offload: require DeepSpeed's CPU optimizer",
    "communication_data_type": "the dtype gradients are reduced in (fp16, bf16 or fp32)",
    "data_types.grad_accum_dtype": "the dtype gradients are accumulated in over micro-steps",
    "optimizer.type": "Adam, AdamW, Adagrad or Lion (zero's flat optimizers)",
    "optimizer.params.lr": "learning rate",
    "optimizer.params.eps": "added to the denominator for numerical stability",
    "optimizer.params.weight_decay": "weight decay (decoupled for AdamW and adam_w_mode)",
    "optimizer.params.initial_accumulator_value": "Adagrad: the sum of squares starts here",
    "optimizer.params.betas": "Adam's and Lion's moment decay rates",
    "optimizer.params.adam_w_mode": "Adam with decoupled weight decay (AdamW)",
    "optimizer.params.bias_correction": "Adam's bias correction of the moments",
    "optimizer.params.amsgrad": "AMSGrad's running maximum of the second moment",
    "optimizer.params.optim_bits": "8: both moments block-wise in 8 bits (bitsandbytes' name)",
    "optimizer.params.min_8bit_size": "with 8-bit states: tensors smaller than this keep fp32 states",
    "scheduler.type": "the learning-rate schedule: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest",
    "scheduler.params.warmup_min_lr": "the learning rate warm-up starts from",
    "scheduler.params.warmup_max_lr": "the learning rate warm-up reaches",
    "scheduler.params.warmup_num_steps": "steps of warm-up",
    "scheduler.params.warmup_type": "the warm-up's shape: log or linear",
    "scheduler.params.total_num_steps": "the schedule's length, for its decay",
    "scheduler.params.warmup_min_ratio": "WarmupCosineLR: warm-up starts at this fraction of lr",
    "scheduler.params.cos_min_ratio": "WarmupCosineLR: the cosine ends at this fraction of lr",
    "scheduler.params.cycle_min_lr": "OneCycle: the cycle's lowest learning rate",
    "scheduler.params.cycle_max_lr": "OneCycle: the cycle's highest learning rate",
    "scheduler.params.decay_lr_rate": "OneCycle: learning-rate decay after the cycle",
    "scheduler.params.cycle_first_step_size": "OneCycle: steps of the rising half",
    "scheduler.params.cycle_second_step_size": "OneCycle: steps of the falling half",
    "scheduler.params.cycle_first_stair_count": "OneCycle: stairs in the rising half (0: smooth)",
    "scheduler.params.cycle_second_stair_count": "OneCycle: stairs in the falling half",
    "scheduler.params.decay_step_size": "OneCycle: steps between decays after the cycle",
    "scheduler.params.cycle_momentum": "OneCycle: cycle the momentum (beta1) against the learning rate",
    "scheduler.params.cycle_min_mom": "OneCycle: the lowest momentum",
    "scheduler.params.cycle_max_mom": "OneCycle: the highest momentum",
    "scheduler.params.decay_mom_rate": "OneCycle: momentum decay after the cycle",
    "aio.block_size": "bytes of one NVMe request",
    "aio.queue_depth": "NVMe requests in flight",
    "aio.intra_op_parallelism": "threads that submit a transfer's requests",
    "aio.single_submit": "submit requests one at a time rather than in batches",
    "aio.overlap_events": "overlap submitting requests with waiting for completions",
    "aio.use_gds": "GPUDirect Storage between NVMe and the device",
    "activation_checkpointing.partition_activations": "split each checkpointed activation across the model-parallel ranks",
    "activation_checkpointing.contiguous_memory_optimization": "copy checkpoints into one contiguous buffer",
    "activation_checkpointing.cpu_checkpointing": "keep the checkpointed activations in host memory",
    "activation_checkpointing.number_checkpoints": "checkpoints the contiguous buffer holds",
    "activation_checkpointing.synchronize_checkpoint_boundary": "synchronize the device at each checkpoint",
    "activation_checkpointing.profile": "time the checkpointed forward and recompute",
}

BEGIN, END = "<!-- keys: generated by scripts/config_reference.py -->", "<!-- end of keys -->"


def resolved(build: pathlib.Path):
    """(key, value, origin) in the order config check prints them, first seen wins."""
    seen = {}
    for cfg in sorted((ROOT / "tests/docs/config_reference").glob("*.json")):
        out = subprocess.run([str(build / "bin/zero"), "config", "check", str(cfg)], capture_output=True, text=True,
                             check=True).stdout
        for line in out.splitlines():
            m = re.match(r"^([a-z_][a-z0-9_.\[\]]*)\s+(.+?)\s+\((given|default|derived|auto)\)$", line)
            if not m:
                continue
            key, value, origin = m.groups()
            if key not in seen or (seen[key][1] != "default" and origin == "default"):
                seen[key] = (value, origin)
    return seen


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--check"]
    check = "--check" in sys.argv[1:]
    build = pathlib.Path(args[0] if args else ROOT / "build")
    rows = ["| key | default | meaning | |", "|---|---|---|---|"]
    for key, (value, origin) in resolved(build).items():
        default = f"`{value}`" if origin == "default" else "(from the config, or derived)"
        meaning = MEANING.get(key, "")
        if not meaning:
            print(f"scripts/config_reference.py: no meaning for {key}: add it to MEANING")
            sys.exit(1)
        rows.append(f"| `{key}` | {default} | {meaning} | {'zero' if key in OWN else ''} |")
    page = ROOT / "docs/configuration.md"
    text = page.read_text()
    head, rest = text.split(BEGIN)
    have, tail = rest.split(END)
    if check:
        listed = set(have.strip().splitlines())
        stale = [r for r in rows if r not in listed]
        gone = [r for r in listed if r not in rows]
        for r in stale:
            print(f"docs/configuration.md: no row {r} (the code reads this key, or its default changed)")
        for r in gone:
            print(f"docs/configuration.md: row {r} is not what the code reads now")
        if stale or gone:
            print("run scripts/config_reference.py BUILD_DIR to rewrite the table")
            sys.exit(1)
        print(f"docs/configuration.md: {len(rows) - 2} keys, each as the code reads it")
        return
    page.write_text(head + BEGIN + "\n" + "\n".join(rows) + "\n" + END + tail)


if __name__ == "__main__":
    main()
