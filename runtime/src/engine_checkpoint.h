// What engine_save.cpp and engine_load.cpp share (engine_checkpoint.cpp):
// the saved file names, the precision meta.json records, the ranks'
// agreement on a step, the RNG states and the model's other tensors.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include "zero/core/comm.h"
#include "zero/optim/flat_optimizer.h"
#include "zero/partition/state_store.h"
#include "zero/partition/zero_optimizer.h"

namespace zero::detail::checkpoints {

/// State i's length over group g's sub-groups (a block-wise state's blocks).
int64_t state_numel_of_group(const partition::StateStore& store, size_t i, size_t g);
/// A state read and written whole (8-bit Adam's codes and scales), not by
/// element ranges (fp32 and 16-bit states are: NOTE [16-bit master]).
bool blockwise_state(const optim::FlatOptimizer::StateSpec& spec);
/// "fp32", "bf16", "fp16": the precision of the master or of the element-wise states.
std::string precision_name(at::ScalarType t);
/// The master's and the element-wise states' precision, as meta.json records it.
nlohmann::json precision_of(const partition::StateStore& store);
bool has_block_states(const partition::StateStore& store);
/// rank00003: the stem of a rank's files.
std::string part_name(int64_t rank);
/// Bytes free for an unprivileged writer in `folder`; -1 when unknown.
int64_t statvfs_free(const std::string& folder);
/// Every rank's value of `v`, by rank (this rank's alone without a group).
std::vector<int64_t> everyone(Comm* comm, int64_t v, const std::string& what);
/// After a step every rank may have failed on its own: each says so, and all
/// throw together (the failing rank its own error).
void agree(Comm* comm, const std::exception_ptr& mine, const std::string& what);
at::Tensor generator_state(at::Device d);
void set_generator_state(at::Device d, const at::Tensor& state);
/// The model's buffers and whole frozen parameters (not in the engine's
/// partitions nor in stage 3's frozen groups, NOTE [frozen groups]), by
/// name; without the frozen parameters when not `with_frozen`.
std::vector<std::pair<std::string, at::Tensor>> extra_state(torch::nn::Module& model,
                                                            const partition::FlatParameters& flat,
                                                            bool with_frozen = true);
/// Stage 3's frozen groups: their indices in flat.all_groups().
std::vector<size_t> frozen_groups(const partition::FlatParameters& flat);
/// Sets each frozen group's shard (NOTE [frozen groups]) from its
/// parameters' whole values: `value_of(slot)` (a tensor of the slot's shape,
/// any float dtype). This rank reads what value_of gives, keeps its chunk.
void load_frozen_groups(partition::ZeroOptimizer& opt,
                        const std::function<at::Tensor(const partition::ParamSlot& slot)>& value_of);

}  // namespace zero::detail::checkpoints
