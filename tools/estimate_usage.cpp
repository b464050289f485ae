// zero estimate --help: the options' text (estimate.cpp is the command).
#include "tune_plan.h"

namespace zero::tools {

const char* const kEstimateUsage = R"(usage: zero estimate (--params P | --model mingpt:L,C[,V,T] | --hf-config FILE
                      | --weights FILE | --calibrate REPORT) [options]

Model-state memory per rank (parameters, gradients, optimizer states) on the
device, in host memory and on NVMe, as the engine lays them out, for each
ZeRO configuration (DeepSpeed's estimate_zero2/zero3_model_states_mem_needs
tables), or for one.

  --params P                 a model of P parameters (1.3e9, 1300M, 1.3B)
  --model mingpt:L,C[,V,T]   minGPT with L blocks of width C (vocabulary V,
                             default 50257; context T, default 1024), its
                             stage-3 layers and persistent parameters exact
  --hf-config FILE           a Hugging Face Llama-family config.json (or its
                             folder): LlamaForCausalLM as zero::models builds
                             it, its layers exact; budgets give the most layers
  --weights FILE             a model.safetensors, a sharded index, or a folder
                             holding either: every tensor by name and shape, a
                             layer per "<prefix>.<number>." block and per other
                             module (as a ModuleList of blocks is laid out)
  --calibrate REPORT         a run report of this model (ZERO_RUN_REPORT=FILE
                             writes FILE.rank0): its measured device peak,
                             less the estimated states and buffers of its
                             config, gives the activations per sample; each
                             configuration's peak of a step is then printed
                             (and bounded by the budgets); alone, the model is
                             the report's parameters
  --trainable-params P       with --params: P of the parameters train, the
                             rest are frozen (no gradient, master or optimizer
                             state; partitioned at stage 3, NOTE [frozen
                             groups]); budgets keep the fraction
  --lora R --lora-targets q_proj,v_proj,...
                             with --hf-config: LoRA adapters of rank R on the
                             named projections (default q_proj,v_proj;
                             all-linear for all seven), the base frozen, as
                             llama train --lora builds it
  --ranks-per-node G --nodes M   G x M ranks (default 1 x 1); on M > 1 nodes
                             of G > 1 ranks, each configuration at stages
                             2-3 also with its states sharded within a node
                             (mics_shard_size G), and at stage 3 with a
                             secondary partition in the node
                             (zero_hpz_partition_size G), alone and with
                             ZeRO++'s quantized collectives (qwZ, qgZ)
  --precision fp32|fp16|bf16 compute precision (default bf16)
  --stage S                  only stage S, with:
  --offload-optimizer none|cpu|nvme  --offload-param none|cpu|nvme
  --optim-bits 32|16|8|both|all
                             Adam's moments in fp32 (default); 16: a bf16
                             master and bf16 moments (bf16.bf16_master_
                             weights_and_grads and bf16_optimizer_states:
                             --precision bf16, stages 1-3); 8: 8-bit moments
                             (optimizer.params.optim_bits 8: 2 bytes a
                             parameter and a scale per 256); both: 32 and 8;
                             all: 32, 16, 8 and a 16-bit master with 8-bit
                             moments (the compute dtype's: bf16_master_
                             weights_and_grads or fp16_master_weights_and_
                             grads, stages 1-3), each configuration every
                             way (with --precision fp16: 32, 8 and the fp16
                             master with 8-bit moments)
  --config FILE              only the configuration a DeepSpeed config gives
                             ("auto" checked as zero config check does)
  --device-memory B --host-memory B --nvme-bytes B
                             budgets per rank (1.5GiB, 80GB, 2TB, 1e9): whether
                             each configuration fits, and the largest model
                             whose states do (minGPT: the most blocks at
                             width C; --params: the most parameters); where
                             the optimizer is offloaded at stages 2-3, also
                             the placement that fits a larger one: the
                             gradients on the device, at stage 3 the
                             share of the states offloaded
                             (offload_optimizer.ratio 1, 0.95, ..., 0.05, 0),
                             and with nvme the most the host budget holds
                             in host memory (offload_optimizer.max_in_cpu)
  --micro-batch B            with --model: the micro-batch per rank (default 1) for the
  --checkpointing            peak of a training step: the states plus activations (every
  --n_head H                 block checkpointed with --checkpointing; H heads, default
  --backend nccl|gloo        C / 64) and the engine's buffers (NOTE [peak estimate];
                             default nccl, as on GPUs); budgets then bound the peak
  --json FILE                the same as JSON

Sizes are printed in the unit that fits each (B, KiB to TiB). With --params,
--hf-config and --weights only the model states are counted unless
--calibrate gives the activations.
)";

}  // namespace zero::tools
