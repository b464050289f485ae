// NOTE [memory estimate]
// The engine's model states per rank, written down from where the engine
// allocates them (N ranks; p the compute dtype's bytes, g the gradient
// accumulation dtype's: fp16 2, bf16 with a bf16 master or at stage 3 2,
// else 4, or data_types.grad_accum_dtype):
//
// - Flat layout (NOTE [flat layout]): below stage 3 the parameters are packed
//   in model order into groups of at most min(reduce_bucket_size,
//   allgather_bucket_size) elements (a larger parameter alone), each padded
//   to N x 256 elements (stage 0: to 256, one partition); at stage 3 one
//   group per layer (NOTE [stage-3 plan]) of its parameters that are not kept
//   whole, and group 0 of the whole ones (under
//   stage3_param_persistence_threshold, within
//   stage3_model_persistence_threshold) and those outside every layer. P is
//   the sum of the padded groups over N: this rank's partition.
// - Parameters: stages 0-2 the whole flat buffer, p x padded, on the device.
//   Stage 3: this rank's shards, p x P, on the device (offload_param cpu: on
//   the host; nvme: group 0's and, in group order while max_in_cpu lasts,
//   the layers' on the host, the rest in the swap file, read through
//   min(buffer_count, shards on disk) host buffers of the largest of them),
//   plus group 0 whole (padded) on the device.
// - Gradients: stages 0-1 a flat buffer of g x padded on the device; stages
//   2-3 the partition, g x P on the device, or on the host when the
//   optimizer is offloaded: 4 x P at stage 2 (accumulated in fp32 there),
//   g x P at stage 3 (NOTE [16-bit gradients]); with gradients_on_device,
//   the same bytes on the device instead (NOTE [device gradients]). With bf16/fp16 master
//   weights and grads (NOTE [16-bit master]) g is 2 unless grad_accum_dtype
//   says otherwise, and the host's partition g x P.
// - Optimizer states: Adam's two fp32 moments, 8 x P, or with optim_bits 8
//   two 1-byte codes and a 4-byte scale per 256 elements of each sub-group,
//   about 2.03 x P (NOTE [8-bit states]), and two fp32 moments for the
//   blocks that min_8bit_size keeps in fp32 (Adagrad's and Lion's one, 4 x P;
//   stage 0: of the padded whole),
//   (bf16_optimizer_states: 2 bytes a moment), and an fp32 master, 4 x P
//   (2 x P with a 16-bit master), except where the parameters are the master:
//   fp32 on the device in one partition (stage 0, or one rank), and stage
//   3's fp32 shards on the device.
//   Offloaded to the CPU: all on the host, twice with super_offload at stage
//   3 without offload_param (the speculative step's undo copy, NOTE
//   [speculative step]); with offload_optimizer.ratio < 1 (stage 3, NOTE
//   [partial offload]) the groups host_groups() keeps on the device have
//   their master, states and gradient partition (g x their elements) there,
//   the undo copy only the host's. To NVMe: the swap files (each
//   sub-group of sub_group_size elements a 4 KiB-aligned extent per state),
//   and min(buffer_count, sub-groups) host buffers of the largest sub-group
//   of every state; with offload_optimizer.max_in_cpu, the first offloaded
//   groups within it in host memory instead, and with a ratio < 1 the
//   device's groups on the device, as with cpu (NOTE [state placement]).
//
// The planner (zero estimate with budgets): for each configuration whose
// optimizer is offloaded at stages 2-3 the largest model is also searched
// with the gradient partition on the device (gradients_on_device) and, at
// stage 3 with the shards on the device, at offload_optimizer.ratio 1, 0.95,
// ..., 0.05 and 0, and with nvme and a host budget with the host holding as
// many of the offloaded groups as it can beside the engine's pinned staging
// (offload_optimizer.max_in_cpu, bisected at each size, then lowered to the
// elements of the groups it keeps, so that the same groups, not one more,
// stay in memory for a model a layer smaller); the placement that fits the
// largest (by at least 1%, or with nvme one that keeps more in host memory)
// is printed with it.
// Each is the same formulas above, so the planner is as close to the ledger
// as they are (tools_tests EstimateMatchesLedger holds each placement's
// formula within 5%).
#include "zero/runs/estimate.h"

#include <algorithm>
#include <map>

#include "zero/partition/gradient_reducer.h"
#include "zero/partition/quantized_gather.h"
#include "zero/partition/stage3_rules.h"

namespace zero {
namespace {

constexpr int64_t kAlign = 256;        // kPartitionAlignNumel
constexpr int64_t kDiskBlock = 4096;   // the swap files' extents (kAioAlignment)

int64_t padded(int64_t numel, int64_t ranks) {
  const int64_t unit = ranks * kAlign;
  return std::max<int64_t>(unit, (numel + unit - 1) / unit * unit);
}

int64_t aligned(int64_t bytes) { return (bytes + kDiskBlock - 1) / kDiskBlock * kDiskBlock; }

int64_t bytes_of(const std::string& dtype) { return dtype == "fp16" || dtype == "bf16" ? 2 : 4; }

// A 16-bit master (bf16/fp16 master weights and grads, stages 1-3: NOTE
// [16-bit master]) is in the compute dtype, as are the gradients with it.
bool sixteen_bit_master(const config::Config& c) {
  return c.zero.stage > 0 && ((c.bf16.enabled && c.bf16.bf16_master_weights_and_grads) ||
                              (c.fp16.enabled && c.fp16.fp16_master_weights_and_grads));
}

// The gradient accumulation dtype's bytes (partition::grad_accum_dtype).
int64_t grad_bytes(const config::Config& c) {
  if (c.grad_accum_dtype) return bytes_of(*c.grad_accum_dtype);
  return c.fp16.enabled || (c.bf16.enabled && (sixteen_bit_master(c) || c.zero.stage == 3)) ? 2 : 4;
}

// The flat layout's groups (padded numel) and stage 3's whole group 0.
struct Layout {
  std::vector<int64_t> groups;
  std::vector<std::vector<int64_t>> members;  // per group: its parameters' numels, in order
  int64_t group0_whole = 0;
  int64_t largest_parameter = 0;
};

Layout layout_of(const config::Config& c, const std::vector<ParameterShape>& params) {
  const auto& z = c.zero;
  const int64_t N = config::partition_ranks(c);  // NOTE [MiCS]: a shard group's ranks
  const int64_t layout_ranks = z.stage == 0 ? 1 : N;
  Layout out;
  auto& groups = out.groups;
  for (const auto& q : params) out.largest_parameter = std::max(out.largest_parameter, q.numel);
  if (z.stage < 3) {
    const int64_t cap = std::max<int64_t>(
        1, z.stage == 0 ? z.reduce_bucket_size : std::min(z.reduce_bucket_size, z.allgather_bucket_size));
    int64_t used = 0;
    std::vector<int64_t> members;
    for (const auto& q : params) {
      if (used > 0 && used + q.numel > cap) {
        groups.push_back(padded(used, layout_ranks)), used = 0;
        out.members.push_back(std::move(members));
        members.clear();
      }
      used += q.numel;
      members.push_back(q.numel);
    }
    if (used > 0) groups.push_back(padded(used, layout_ranks)), out.members.push_back(std::move(members));
  } else {
    partition::PersistenceRule keep(z.param_persistence_threshold, z.model_persistence_threshold);
    std::vector<int64_t> layer_numel;
    std::vector<std::vector<int64_t>> layer_members;
    out.members.emplace_back();
    for (const auto& q : params) {
      const bool whole = keep.keep_whole(q.numel);  // spends the model's budget outside layers too
      if (q.layer < 0 || whole) {
        out.group0_whole += q.numel;
        out.members[0].push_back(q.numel);
        continue;
      }
      if (static_cast<size_t>(q.layer) >= layer_numel.size()) {
        layer_numel.resize(static_cast<size_t>(q.layer) + 1, 0);
        layer_members.resize(layer_numel.size());
      }
      layer_numel[static_cast<size_t>(q.layer)] += q.numel;
      layer_members[static_cast<size_t>(q.layer)].push_back(q.numel);
    }
    groups.push_back(padded(out.group0_whole, N));  // group 0 exists even when empty
    for (size_t i = 0; i < layer_numel.size(); ++i)
      if (layer_numel[i] > 0) groups.push_back(padded(layer_numel[i], N)), out.members.push_back(layer_members[i]);
  }
  return out;
}

std::vector<ParameterShape> trainable_only(const std::vector<ParameterShape>& params) {
  std::vector<ParameterShape> out;
  for (const auto& q : params)
    if (!q.frozen) out.push_back(q);
  return out;
}

// NOTE [frozen groups]: the frozen parameters kept whole (every one below
// stage 3; outside every layer or persistent at stage 3) and, at stage 3,
// each layer's frozen group, padded. The persistence rule walks every
// parameter in order, as the plan does.
struct FrozenLayout {
  int64_t whole = 0;
  std::vector<int64_t> groups;
};
FrozenLayout frozen_layers(const config::Config& c, const std::vector<ParameterShape>& params) {
  const auto& z = c.zero;
  FrozenLayout out;
  if (z.stage < 3) {
    for (const auto& q : params)
      if (q.frozen) out.whole += q.numel;
    return out;
  }
  partition::PersistenceRule keep(z.param_persistence_threshold, z.model_persistence_threshold);
  std::vector<int64_t> layer_numel;
  for (const auto& q : params) {
    const bool whole = keep.keep_whole(q.numel);
    if (!q.frozen) continue;
    if (q.layer < 0 || whole) {
      out.whole += q.numel;
      continue;
    }
    if (static_cast<size_t>(q.layer) >= layer_numel.size()) layer_numel.resize(static_cast<size_t>(q.layer) + 1, 0);
    layer_numel[static_cast<size_t>(q.layer)] += q.numel;
  }
  for (int64_t n : layer_numel)
    if (n > 0) out.groups.push_back(padded(n, config::partition_ranks(c)));
  return out;
}

}  // namespace

std::vector<ParameterShape> mingpt_parameters(int64_t L, int64_t C, int64_t V, int64_t T, bool tie) {
  std::vector<ParameterShape> out;
  int layer = 0;
  out.push_back({"pos_emb", T * C, -1});  // the model's own parameter comes before its children's
  out.push_back({"tok_emb.weight", V * C, layer++});
  for (int64_t i = 0; i < L; ++i, ++layer) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    for (const auto& [name, numel] : std::vector<std::pair<std::string, int64_t>>{
             {"ln1.weight", C}, {"ln1.bias", C}, {"ln2.weight", C}, {"ln2.bias", C},
             {"attn.key.weight", C * C}, {"attn.key.bias", C}, {"attn.query.weight", C * C}, {"attn.query.bias", C},
             {"attn.value.weight", C * C}, {"attn.value.bias", C}, {"attn.proj.weight", C * C},
             {"attn.proj.bias", C}, {"fc.weight", 4 * C * C}, {"fc.bias", 4 * C}, {"fc_proj.weight", 4 * C * C},
             {"fc_proj.bias", C}})
      out.push_back({b + name, numel, layer});
  }
  out.push_back({"ln_f.weight", C, layer});
  out.push_back({"ln_f.bias", C, layer++});
  if (!tie) out.push_back({"head.weight", V * C, layer});
  return out;
}

std::vector<ParameterShape> parameters_of_size(int64_t num_parameters) { return {{"weights", num_parameters, 0}}; }

MemoryEstimate estimate_model_states(const config::Config& c, const std::vector<ParameterShape>& params) {
  const auto& z = c.zero;
  const int64_t N = config::partition_ranks(c);  // NOTE [MiCS]: a shard group's ranks
  const int64_t p = c.fp16.enabled || c.bf16.enabled ? 2 : 4;
  const bool master16 = sixteen_bit_master(c);
  const int64_t master_bytes = master16 ? 2 : 4;
  const int64_t g = grad_bytes(c);
  // offload_optimizer has no effect at stage 0 (the config warns so).
  const bool off_opt = z.stage >= 1 && z.offload_optimizer.device != config::OffloadDevice::kNone;
  const bool nvme_opt = z.stage >= 1 && z.offload_optimizer.device == config::OffloadDevice::kNvme;
  const bool off_param = z.stage == 3 && z.offload_param.device != config::OffloadDevice::kNone;
  const bool nvme_param = z.stage == 3 && z.offload_param.device == config::OffloadDevice::kNvme;
  MemoryEstimate e;
  for (const auto& q : params) e.num_parameters += q.numel;

  // Groups of the flat layout (the trainable parameters'), and this rank's
  // chunk of each; the frozen ones apart (NOTE [frozen groups]).
  const Layout lay = layout_of(c, trainable_only(params));
  const auto& groups = lay.groups;
  const int64_t group0_whole = lay.group0_whole;
  const int64_t layout_ranks = z.stage == 0 ? 1 : N;
  int64_t flat = 0, part = 0;  // padded elements; this rank's
  for (int64_t n : groups) flat += n, part += n / layout_ranks;

  // Parameters.
  if (z.stage < 3) {
    e.device.parameters = p * flat;
  } else {
    // Group 0 gathered for good, as a padded buffer.
    e.device.parameters = p * padded(group0_whole, N);
    if (!off_param) {
      e.device.parameters += p * part;
    } else if (!nvme_param) {
      e.host.parameters += p * part;
    } else {
      // Group 0's shard stays in memory; the layers' shards while max_in_cpu
      // lasts, in order; the rest go to the swap file, read through
      // min(buffer_count, shards on disk) buffers of the largest of them.
      partition::InCpuBudget in_cpu(z.offload_param.max_in_cpu);
      int64_t disk_groups = 0, largest = 0;
      for (size_t i = 0; i < groups.size(); ++i) {
        const int64_t chunk = groups[i] / N;
        if (i == 0 || in_cpu.keep(chunk)) {
          e.host.parameters += p * chunk;
        } else {
          e.nvme.parameters += aligned(p * chunk);
          largest = std::max(largest, chunk);
          ++disk_groups;
        }
      }
      // NOTE [frozen groups]: the frozen shards come after every trainable
      // group, in the same budget and through the same buffers.
      for (int64_t n : frozen_layers(c, params).groups) {
        const int64_t chunk = n / N;
        if (in_cpu.keep(chunk)) {
          e.host.frozen_parameters += p * chunk;
        } else {
          e.nvme.frozen_parameters += aligned(p * chunk);
          largest = std::max(largest, chunk);
          ++disk_groups;
        }
      }
      if (disk_groups > 0)
        e.host.parameters += std::min<int64_t>(z.offload_param.buffer_count, disk_groups) * aligned(p * largest);
    }
  }
  {  // Frozen parameters (NOTE [frozen groups]): whole below stage 3, and
     // outside the layers or persistent at stage 3; else a shard a layer.
    const FrozenLayout fl = frozen_layers(c, params);
    e.device.frozen_parameters += p * fl.whole;
    int64_t shards = 0;
    for (int64_t n : fl.groups) shards += n / N;
    if (z.stage == 3 && !off_param) e.device.frozen_parameters += p * shards;
    else if (z.stage == 3 && !nvme_param) e.host.frozen_parameters += p * shards;
  }

  // Where each group's states are (and, stages 2-3, whether its gradient
  // partition is off the device): all offloaded with offload_optimizer, but
  // with a ratio < 1 at stage 3 (NOTE [partial offload]) the host_groups()
  // of this rank's chunks (the same on every rank) and, with nvme, those
  // within max_in_cpu in host memory (NOTE [state placement]): state_tiers().
  std::vector<int64_t> chunks;
  for (int64_t n : groups) chunks.push_back(n / layout_ranks);
  const std::vector<char> tier_of =
      off_opt ? partition::state_tiers(chunks, z.stage == 3 ? z.offload_optimizer.ratio : 1.0, nvme_opt,
                                       z.offload_optimizer.max_in_cpu)
              : std::vector<char>(groups.size(), partition::kStatesOnDevice);
  std::vector<char> host_of(groups.size());  // off the device
  for (size_t i = 0; i < groups.size(); ++i) host_of[i] = tier_of[i] != partition::kStatesOnDevice;
  int64_t part_on[2] = {0, 0};  // this rank's elements on the device, off it
  for (size_t i = 0; i < groups.size(); ++i) part_on[host_of[i] ? 1 : 0] += groups[i] / layout_ranks;

  // Gradients (gradients_on_device: the whole partition on the device, NOTE [device gradients]).
  if (z.stage < 2) {
    e.device.gradients = g * flat;
  } else if (off_opt && z.offload_optimizer.gradients_on_device) {  // in the host's dtype
    e.device.gradients = (master16 || z.stage == 3 ? g : 4) * part;
  } else {
    e.host.gradients = (master16 || z.stage == 3 ? g : 4) * part_on[1];
    e.device.gradients = g * part_on[0];
  }

  // Optimizer states: two moments and, unless the parameters are it, a master.
  // (Stage 3 with offload_param: on a GPU the shards are not on the device,
  // so the master is separate; a CPU-only run, where host and device are one,
  // keeps 4 x P less.)
  const bool params_are_master = p == 4 && !master16 && !off_opt && (z.stage == 3 ? !off_param : layout_ranks == 1);
  const int64_t state_bytes = c.optimizer && c.optimizer->bf16_states ? 2 : 4;
  const bool one_moment = c.optimizer && (c.optimizer->type == config::OptimizerType::kAdagrad ||
                                          c.optimizer->type == config::OptimizerType::kLion);
  // The state tensors, each as bytes per element and elements per block (0:
  // one per parameter): 8-bit Adam keeps each moment as 1-byte codes and a
  // 4-byte scale per 256 elements of a sub-group (NOTE [8-bit states]).
  struct StateTensor {
    int64_t bytes, per_block;
  };
  std::vector<StateTensor> tensors;
  if (!params_are_master) tensors.push_back({master_bytes, 0});
  if (one_moment) tensors.push_back({state_bytes, 0});
  else if (c.optimizer && c.optimizer->optim_bits == 8) tensors.insert(tensors.end(), {{1, 0}, {4, 256}, {1, 0}, {4, 256}});
  else tensors.insert(tensors.end(), {{state_bytes, 0}, {state_bytes, 0}});
  const int64_t sub = std::max<int64_t>(1, z.sub_group_size);
  auto numel_for = [](const StateTensor& t, int64_t n) { return t.per_block > 0 ? (n + t.per_block - 1) / t.per_block : n; };
  // Over this rank's sub-groups (counted, not walked: they may be many):
  // bytes in memory, bytes of the swap files, the largest sub-group on disk.
  // (Memory and sub-groups per tier: [0] the device's, [1] host memory's,
  // [2] NVMe's.)
  int64_t in_memory[3] = {0, 0, 0}, file = 0, sub_groups_on[3] = {0, 0, 0}, largest = 1;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const int64_t chunk = groups[gi] / layout_ranks, full = chunk / sub, rest = chunk % sub;
    const int tier = tier_of[gi];
    for (const auto& t : tensors) {
      if (tier == partition::kStatesOnNvme)
        file += full * aligned(t.bytes * numel_for(t, sub)) + (rest > 0 ? aligned(t.bytes * numel_for(t, rest)) : 0);
      else in_memory[tier] += t.bytes * (full * numel_for(t, sub) + (rest > 0 ? numel_for(t, rest) : 0));
    }
    sub_groups_on[tier] += full + (rest > 0 ? 1 : 0);
    if (tier == partition::kStatesOnNvme) largest = std::max(largest, full > 0 ? sub : rest);
  }
  // 8-bit Adam's blocks kept in fp32 (min_8bit_size): two fp32 moments for
  // each 256-element block of a sub-group that holds an element of a
  // smaller parameter, at least one block's per sub-group, found as the
  // store finds them (walking the small parameters, not the sub-groups);
  // the rank with the most.
  int64_t side_slot = 0;
  if (!one_moment && c.optimizer && c.optimizer->optim_bits == 8) {
    const int64_t min_8bit = c.optimizer->min_8bit_size, block_bytes = 4 * kAlign;
    // Per rank: (group, sub-group) -> (its fp32 blocks, the last one counted).
    std::vector<std::map<std::pair<size_t, int64_t>, std::pair<int64_t, int64_t>>> marked(
        static_cast<size_t>(layout_ranks));
    for (size_t gi = 0; gi < groups.size() && min_8bit > 0; ++gi) {
      const int64_t chunk = groups[gi] / layout_ranks;
      int64_t o = 0;
      for (int64_t q : lay.members[gi]) {
        if (q > 0 && q < min_8bit && chunk > 0) {
          for (int64_t r = o / chunk; r <= std::min(layout_ranks - 1, (o + q - 1) / chunk); ++r) {
            const int64_t e0 = std::max(o, r * chunk) - r * chunk, e1 = std::min(o + q, (r + 1) * chunk) - r * chunk;
            for (int64_t sg = e0 / sub; sg <= (e1 - 1) / sub; ++sg) {
              const int64_t b0 = (std::max(e0, sg * sub) - sg * sub) / kAlign;
              const int64_t b1 = (std::min(e1, (sg + 1) * sub) - 1 - sg * sub) / kAlign;
              auto& [count, last] = marked[static_cast<size_t>(r)].try_emplace({gi, sg}, 0, -1).first->second;
              for (int64_t b = std::max(b0, last + 1); b <= b1; ++b) ++count, last = b;
            }
          }
        }
        o += q;
      }
    }
    // (Per tier, the rank with the most in total; on NVMe each sub-group's
    // an aligned extent, and a buffer holds the most of one.)
    int64_t side_memory[2] = {0, 0}, side_file = 0;
    for (const auto& m : marked) {
      int64_t blocks[2] = {sub_groups_on[0], sub_groups_on[1]}, extents = sub_groups_on[2] * aligned(block_bytes),
              most = 1;
      for (const auto& [key, v] : m) {
        const int tier = tier_of[key.first];
        if (tier == partition::kStatesOnNvme) {
          extents += aligned(block_bytes * std::max<int64_t>(1, v.first)) - aligned(block_bytes);
          most = std::max(most, v.first);
        } else {
          blocks[tier] += std::max<int64_t>(1, v.first) - 1;
        }
      }
      if (2 * block_bytes * (blocks[0] + blocks[1]) > side_memory[0] + side_memory[1])
        side_memory[0] = 2 * block_bytes * blocks[0], side_memory[1] = 2 * block_bytes * blocks[1];
      side_file = std::max(side_file, 2 * extents);
      side_slot = std::max(side_slot, 2 * aligned(block_bytes * most));
    }
    in_memory[0] += side_memory[0];
    in_memory[1] += side_memory[1];
    file += side_file;
  }
  // (Without offload tier_of is all the device's.)
  e.device.optimizer_states = in_memory[0];
  if (!nvme_opt) {
    const bool speculates = off_opt && z.offload_optimizer.super_offload && z.stage == 3 && !off_param &&
                            !z.offload_optimizer.gradients_on_device;
    e.host.optimizer_states = (speculates ? 2 : 1) * in_memory[1];
  } else {
    // The groups within max_in_cpu in host memory; the disk's through
    // min(buffer_count, its sub-groups) buffers of its largest.
    e.host.optimizer_states = in_memory[1];
    if (sub_groups_on[2] > 0) {
      e.nvme.optimizer_states = file;
      const int64_t buffers = std::min<int64_t>(z.offload_optimizer.buffer_count, sub_groups_on[2]);
      int64_t slot = 0;
      for (const auto& t : tensors) slot += std::max<int64_t>(aligned(t.bytes * numel_for(t, largest)), 4096);
      slot += side_slot;
      e.host.optimizer_states += buffers * slot;
    }
  }
  return e;
}

// NOTE [peak estimate]
// A training step's peak per rank is the model states (NOTE [memory
// estimate]) plus what exists only while it runs, written down from the
// engine and minGPT (p the compute dtype's bytes, g the gradients'; B x T
// tokens a micro-batch, C wide, H heads, L blocks, V the vocabulary):
// - Activations autograd keeps for backward, per block: the block's input,
//   both LayerNorms' outputs, q, k, v, attention's output and its contiguous
//   copy, the residual sum, the MLP's two 4C-wide tensors: 17 x B T C x p;
//   two dropout masks, 2 x B T C bytes; attention's B H T^2 probabilities
//   and mask, (p + 1) x B H T^2. Outside the blocks: the embedding's sum and
//   mask, ln_f, and the logits with their fp32 copy and log-softmax,
//   B T (3C p + 9V). Checkpointing every block keeps each block's input
//   (B T C x p, on the host with cpu_checkpointing) and one block's
//   activations while it is recomputed.
// - A parameter's gradient between autograd's accumulation and the hook
//   that moves it into the flat buffers: the largest parameter, p bytes each.
// - Gradient buckets (stages 2-3): the one being filled, two being reduced,
//   and one spare (fewer when there are fewer groups), each the largest
//   group (stage 3: the largest layer) in g bytes; under NCCL each of the two
//   reductions also writes into a chunk (group / N), unless reduce_scatter is
//   false (an all-reduce in place, as under Gloo); with
//   zero_quantized_gradients at stage 3, each of the two also holds its
//   first hop's int8 payloads, sent and received. Stages 0 and 1 all-reduce
//   the flat gradients in place. With mics_shard_size (NOTE [MiCS]) N is
//   the shard group's ranks throughout, and under NCCL with the optimizer
//   offloaded two more chunks may wait in the replicas' sum; with
//   mics_hierarchical_params_gather a gather in flight stages M of its N
//   shards (NOTE [hierarchical gather]).
// - Stage 3's gathered layers, in p bytes, with offload_param a device copy
//   of the shard being sent. When stage3_max_reuse_distance spans the
//   layers, forward's layers stay gathered for backward, as many as
//   stage3_max_live_parameters holds (at least one): the peak is at the
//   start of backward, with them and the two buckets being reduced.
//   Otherwise each layer goes after its use and the largest is followed by
//   what min(stage3_prefetch_bucket_size, stage3_max_live_parameters - it)
//   prefetches; the layers peak in forward, the buckets in backward: the
//   larger of the two counts. Under Gloo (world size above 1), an
//   all-gather in flight also holds a flat copy of its output that c10d's
//   worker makes (ProcessGroupGloo's allgather), as large as the layer: it
//   lives while the worker runs the collective, beside whatever the
//   training thread holds then (so when depends on the machine's load), and
//   is counted at the peak. With zero_hpz_partition_size k > 1 (NOTE
//   [hpZ]), a k-th of every layer, p x layer / k each, on the device from
//   the first forward after a step to the step (not at rest: the step drops
//   them). With zero_quantized_weights (NOTE [quantized
//   gather]) a gather in flight also holds its payloads, this rank's and
//   the N gathered (N + 1 of the largest layer's shard's), and Gloo's copy
//   is of the N payloads rather than of the layer.
// - Offloaded optimizer: two pinned pieces of at most host_staging_numel
//   elements (the largest chunk when smaller) for the reduced gradients (g),
//   and two for the new values going to the device (p) unless stage 3's
//   shards live on the host.
PeakEstimate estimate_peak(const config::Config& c, const MinGPTWorkload& w, bool nccl) {
  const auto params = mingpt_parameters(w.n_layer, w.n_embd, w.vocab_size, w.block_size, w.tie_weights);
  const int64_t p = c.fp16.enabled || c.bf16.enabled ? 2 : 4;
  // Activations.
  Activations a;
  const int64_t B = w.micro_batch, T = w.block_size, C = w.n_embd, H = std::max<int64_t>(1, w.n_head), L = w.n_layer;
  const int64_t block = B * T * C * (17 * p + 2) + B * H * T * T * (p + 1);
  const int64_t outside = B * T * (3 * C * p + 9 * w.vocab_size);
  if (!w.checkpointing) {
    a.device = L * block + outside;
  } else {
    const int64_t inputs = L * B * T * C * p;
    a.device = block + outside + (c.activation_checkpointing.cpu_checkpointing ? 0 : inputs);
    if (c.activation_checkpointing.cpu_checkpointing) a.host = inputs;
  }
  return estimate_peak(c, params, a, nccl);
}

PeakEstimate estimate_peak(const config::Config& c, const std::vector<ParameterShape>& params,
                           const Activations& activations, bool nccl) {
  const auto& z = c.zero;
  PeakEstimate e;
  e.states = estimate_model_states(c, params);
  e.activations = activations.device;
  e.host_activations = activations.host;
  const int64_t N = config::partition_ranks(c);  // NOTE [MiCS]: a shard group's ranks
  const int64_t p = c.fp16.enabled || c.bf16.enabled ? 2 : 4;
  const int64_t g = grad_bytes(c);
  const bool off_opt = z.stage >= 1 && z.offload_optimizer.device != config::OffloadDevice::kNone;
  const bool off_param = z.stage == 3 && z.offload_param.device != config::OffloadDevice::kNone;

  // Buffers: the gradients' from the trainable parameters' layout; the
  // gathers' from every parameter's (a layer is gathered whole, its frozen
  // group with it: NOTE [frozen groups]).
  const Layout lay = layout_of(c, trainable_only(params));
  std::vector<ParameterShape> all = params;
  for (auto& q : all) q.frozen = false;
  const Layout lay_all = layout_of(c, all);
  const int64_t layout_ranks = z.stage == 0 ? 1 : N;
  int64_t largest_group = 0;  // stage 3: the largest layer's trainable group
  for (size_t i = z.stage == 3 ? 1 : 0; i < lay.groups.size(); ++i)
    largest_group = std::max(largest_group, lay.groups[i]);
  // Gradient buckets and gathered layers.
  int64_t buckets = 0, in_flight = 0, gathered = 0, layer_total = 0, largest_layer = 0;
  const int64_t n_groups = static_cast<int64_t>(lay.groups.size()) - (z.stage == 3 ? 1 : 0);
  for (size_t i = z.stage == 3 ? 1 : 0; i < lay_all.groups.size(); ++i) {
    layer_total += lay_all.groups[i];
    largest_layer = std::max(largest_layer, lay_all.groups[i]);
  }
  if (z.stage >= 2) {
    // reduce_scatter false all-reduces the bucket in place, as Gloo always does.
    const int64_t chunks = nccl && N > 1 && z.reduce_scatter ? g * (largest_group / N) : 0;
    // qgZ (stage 3, NOTE [quantized gradients]): a reduction in flight also
    // holds its first hop's payloads, sent and received (int8 and a scale a
    // block: about the bucket's elements in bytes, each).
    const int64_t qg = z.stage == 3 && z.zero_quantized_gradients && N > 1
                           ? 2 * partition::quantized_payload_bytes(largest_group, z.zero_quantized_weights_block_size)
                           : 0;
    // NOTE [MiCS]: under NCCL, chunks bound for host memory wait in the
    // replicas' sum once their buckets are free, two at most.
    const bool replicas = N < std::max<int64_t>(1, c.world_size);
    const int64_t summing = replicas && off_opt && nccl && z.reduce_scatter && N > 1
                                ? std::min<int64_t>(2, n_groups) * g * (largest_group / N)
                                : 0;
    buckets = std::min<int64_t>(4, n_groups) * g * largest_group + std::min<int64_t>(2, n_groups) * (chunks + qg) +
              summing;
    in_flight = std::min<int64_t>(2, n_groups) * (g * largest_group + chunks + qg) + summing;
  }
  bool kept = false;  // gathered layers stay for backward
  if (z.stage == 3 && largest_layer > 0) {
    kept = z.max_reuse_distance >= layer_total;
    const int64_t live = kept ? std::max<int64_t>(1, z.max_live_parameters / largest_layer)
                              : 1 + std::max<int64_t>(0, std::min(z.prefetch_bucket_size,
                                                                  z.max_live_parameters - largest_layer)) / largest_layer;
    gathered = p * std::min(layer_total, live * largest_layer);
    if (off_param) gathered += p * (largest_layer / N);  // the shard's device copy being sent
    const bool quantized = z.zero_quantized_weights && N > 1;
    const int64_t payload =
        quantized ? partition::quantized_payload_bytes(largest_layer / N, z.zero_quantized_weights_block_size) : 0;
    if (quantized) gathered += (N + 1) * payload;  // NOTE [quantized gather]
    // NOTE [hierarchical gather]: a gather in flight stages M of the N
    // shards (or payloads), M the nodes; the config does not say how many
    // ranks a node has, and the estimate takes two or more (M at most N / 2;
    // one rank a node gathers flat).
    if (z.mics_hierarchical_params_gather && z.mics_shard_size > 0 && N > 2) {
      const int64_t shard = quantized ? payload : p * (largest_layer / N);
      gathered += std::max<int64_t>(1, std::min(layer_total, live * largest_layer) / largest_layer) * (N / 2) * shard;
    }
    if (!nccl && N > 1) gathered += quantized ? N * payload : p * largest_layer;  // Gloo's flat copy of the output
  }
  // The largest parameter's gradient before its hook: a trainable one's.
  e.device_buffers = p * lay.largest_parameter + (kept ? gathered + in_flight : std::max(buckets, gathered));
  if (z.stage == 3 && z.zero_hpz_partition_size > 1 && N > 1)
    for (size_t i = 1; i < lay_all.groups.size(); ++i)
      e.device_buffers += p * (lay_all.groups[i] / z.zero_hpz_partition_size);
  // (None with ratio 0, when every group stays on the device: NOTE [partial offload].)
  if (off_opt && (z.stage != 3 || z.offload_optimizer.ratio > 0)) {
    int64_t chunk = 0;
    for (int64_t n : lay.groups) chunk = std::max(chunk, n / layout_ranks);
    chunk = std::min(chunk, std::max<int64_t>(1, z.sub_group_size));
    // The staging rings, gradients to the host and new values to the device,
    // hold two pieces each (ReductionOptions::host_staging_numel).
    const int64_t piece = std::min<int64_t>(chunk, partition::ReductionOptions{}.host_staging_numel);
    e.host_buffers += 2 * g * piece;
    if (!off_param) e.host_buffers += 2 * p * piece;
  }
  return e;
}

}  // namespace zero
