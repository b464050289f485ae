// zero tune --help: the options' text (tune.cpp is the command).
#include "tune_plan.h"

namespace zero::tools {

const char* const kTuneUsage = R"(usage: zero tune --device-memory B --host-memory B [options] -- PROGRAM ARGS...
       zero tune --model mingpt:L,C[,V,T] --device-memory B --host-memory B [options]

Proposes the fastest ZeRO config that fits: lists candidates (stage, offload
of optimizer states and parameters, where the offloaded states and
gradients live, activation checkpointing, micro-batch, bucket sizes), drops those the estimator says do not fit the budgets, skips
those another candidate beats on every count, trains a few steps of the rest
on real ranks (most promising first, a line per run), and writes the fastest
as a DeepSpeed config with a table of what it tried and measured. Runs and
swap files are removed however it ends.

  -- PROGRAM ARGS...          your training program (it calls zero::initialize):
                             each run is PROGRAM ARGS with {config} replaced by
                             the candidate's config file, stopped after --steps
                             optimizer steps; the engine reports what it did
                             (ZERO_RUN_REPORT); the program needs no change
  --model mingpt:L,C[,V,T]   or minGPT with L blocks of width C, vocabulary V
                             (default 50257) and context T (default 1024);
                             the runs train on random tokens
  --n_head H                 attention heads (default C / 64, at least 1)
  --device-memory B          per-rank budgets (512MiB, 80GB, 1.5e9): the GPU's
  --host-memory B            memory (on the CPU, emulated) and host memory
  --nvme-path DIR            also try NVMe offload, swap files in a scratch
                             folder under DIR; the config written names DIR
  --nvme-bytes B             NVMe budget per rank (default: DIR's free space
                             shared by the ranks)
  --ranks N                  ranks on this machine, or a node with --nodes
                             (default 1; at most 4 per processor in all
                             unless --oversubscribe)
  --nodes M                  M nodes of --ranks ranks, emulated here (zero
                             launch --emulate_nodes, over loopback): the
                             per-rank budgets, the keys of more than one node
                             and their bytes across nodes as on M machines.
                             With --ranks 2 or more the winner is then tried
                             with each key that applies to its stage:
                             mics_shard_size (a node) at stages 2-3,
                             zero_hpz_partition_size (a node) at stage 3
                             (default 1; on the CPU: --device cpu on a GPU
                             machine, the nodes sharing its GPUs otherwise)
  --inter-node-bandwidth B   with --nodes: bytes a second each rank can send
                             to other nodes (25GB: a 200 Gb/s NIC a rank):
                             each run is ranked by its step here plus the
                             bytes its busiest node sends across a step at
                             --ranks x B, none of it overlapped (without it,
                             by its step here alone: loopback, no network)
  --allow-quantized-communication
                             with --nodes: also try ZeRO++'s quantized
                             collectives on the winner at stage 3 (qwZ with
                             MiCS or hpZ, and qwZ + hpZ + qgZ), which change
                             the numerics
  --exhaustive               run every candidate that fits (to check the tuner;
                             with --nodes the keys still on the winner only)
  --config FILE              base config: its optimizer, scheduler, clipping,
                             precision and other keys are kept, the tuned
                             keys replaced (default: AdamW, clipping 1.0);
                             with --nodes its MiCS and ZeRO++ keys are
                             replaced too (each candidate has its own)
  --precision fp32|fp16|bf16 (default: the base config's; else bf16 on a GPU,
                             fp32 on the CPU)
  --device cpu|cuda          where the ranks train (default: cuda when there is one)
  --micro-batches LIST       micro-batches per rank to try (default 1,2,4,8,16,32)
  --stages LIST              ZeRO stages to try (default 0,1,2,3)
  --offload LIST             offload devices to try: none,cpu,nvme (default none,cpu,
                             and nvme with --nvme-path)
  --checkpointing LIST       none,blocks,cpu: none, every block, every block with
                             cpu_checkpointing (default none,blocks; a program:
                             none, its base config's activation_checkpointing kept)
  --bucket-sizes LIST        elements (2e6,5e7): reduce/allgather buckets and stage 3's
                             prefetch bucket (default: 1/16 and 1/4 of the parameters)
  --steps N                  optimizer steps per run, the first untimed (default 4)
  --trials N                 runs of the frontier at most (default 8); the winner's
                             other bucket sizes, and with --nodes its keys of
                             several nodes (up to 5 runs), are run besides
  --run-timeout S            a run still going after S seconds is stopped, reported
                             and skipped (default 600; 0: no limit)
  --ratios LIST              offload_optimizer.ratio values to try at stage 3 +
                             optimizer cpu or nvme (the share offloaded, the
                             rest stepped on the device; default
                             0.25,0.5,0.75,1); the smallest that trains beats
                             the larger. With nvme, host memory keeps what
                             its budget holds (offload_optimizer.max_in_cpu),
                             the disk the rest
  --gradients LIST           where the gradient partition lives at stages 2-3
                             with the optimizer offloaded: host,device
                             (default both; device is zero's own
                             offload_optimizer.gradients_on_device, tried
                             where the host gradients do not fit)
  --allow-low-precision-states
                             also try Adam's moments in 8 bits
                             (optimizer.params.optim_bits 8: a model of about
                             1.5x the parameters fits with offload) and, in
                             bf16, a bf16 master and bf16 states
                             (bf16_master_weights_and_grads and
                             bf16_optimizer_states: about 1.75x), and 8-bit
                             moments under a bf16 or fp16 master (about 2x),
                             which change the numerics; proposed only where
                             fp32 states do not fit or run slower
  --out FILE                 the winning config (default ds_config.json)
  --json FILE                every candidate: its estimate, outcome and figures
  --force                    replace an --out or --json file that an earlier
                             tune did not write (it replaces its own always)
)";

}  // namespace zero::tools
