// Flat parameter buffers: the trainable parameters of a model laid out in one
// contiguous buffer, grouped into buckets, each parameter rebound to a view.
//
// NOTE [flat layout]
// Parameters are packed in module order (a parameter shared by two modules,
// a tied weight, appears once, at its first use), back to back, into groups of
// about `group_numel` elements (a parameter larger than that is a group of its
// own). Each group is padded with zeros to a multiple of
// world_size * kPartitionAlignNumel elements and split into world_size equal
// chunks: rank r owns chunk r of every group, so one bucket is reduce-scattered
// or all-gathered by a single collective on contiguous memory. A rank's owned
// chunks, concatenated in group order, form its owned partition (fp32 master,
// optimizer states and, at stage 2, gradients live only for it). Padding is
// never read as a parameter; its gradient is zero and it stays zero.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include "zero/core/memory_ledger.h"

namespace zero::partition {

inline constexpr int64_t kPartitionAlignNumel = 256;

/// One parameter's place in the flat buffer (a frozen one's too, at stage 3:
/// NOTE [frozen groups]).
struct ParamSlot {
  std::string name;    // first name it was found under ("blocks.0.attn.query.weight")
  at::Tensor param;    // the module's parameter (now a view into the flat buffer)
  int64_t offset = 0;  // in elements, into the flat buffer
  int64_t numel = 0;
  std::vector<int64_t> shape;
  size_t group = 0;
};

/// A bucket of consecutive parameters, partitioned across ranks.
struct FlatGroup {
  std::string name;            // stage 3: the layer it holds ("blocks.3"); else empty
  int64_t begin = 0;           // offset into the flat buffer
  int64_t padded_numel = 0;    // world_size * chunk_numel
  int64_t chunk_numel = 0;     // one rank's share
  int64_t owned_offset = 0;    // offset of this group's chunk in the owned partition (-1: frozen)
  std::vector<size_t> slots;   // indices into all_slots()
  bool frozen = false;         // NOTE [frozen groups]
};

/// Stage 3: the parameters of one group (a layer), and optionally this rank's
/// chunk of it already made (partitioned construction, zero::Init), in which
/// case the parameters' values are not read.
struct GroupSpec {
  std::string name;
  /// The parameters are frozen (requires_grad false): NOTE [frozen groups].
  bool frozen = false;
  std::vector<std::pair<std::string, at::Tensor>> params;
  at::Tensor chunk;  // this rank's chunk in the compute dtype, or undefined
  /// Instead of `chunk`: zero::Init wrote this rank's chunk to the parameter
  /// swap file (ParamSwapOptions::adopted_offsets); part() starts empty.
  bool chunk_on_disk = false;
  std::vector<std::vector<int64_t>> shapes;  // with `chunk` or `chunk_on_disk`: the parameters' shapes
};

/// Fills `chunk` with elements [begin, begin + chunk.numel()) of the
/// parameters laid end to end (flattened, in order), zeros past their end: a
/// rank's chunk of a group, without laying out the whole group.
void copy_chunk_of(const std::vector<at::Tensor>& params, int64_t begin, at::Tensor& chunk);

/// Gives a tensor's storage `nbytes` of fresh memory from its allocator, or
/// (0) frees it; the tensor's metadata is untouched.
void set_storage_bytes(const at::Tensor& t, size_t nbytes);

// NOTE [stage-3 storage]
// At stage 3 there is no flat buffer of the whole model. Each rank keeps its
// chunk of every group (its shards, in the compute dtype) and each
// group has a full-size tensor whose storage is empty until the group is
// gathered (all-gathered into it) and emptied again when it is released. The
// storage object itself lives on, so views of it that autograd saved during
// forward (weight.t() inside linear, say) see the values again once the group
// is gathered for backward, and hold no memory meanwhile. A released
// parameter is rebound to an empty tensor, so code that reads it by mistake
// gets a shape error instead of reading freed memory; during backward its
// shape is kept (autograd checks gradients against it) and only the storage
// is emptied.

// NOTE [frozen groups]
// At stage 3 frozen parameters (requires_grad false: a LoRA base, a frozen
// tower) are partitioned like trainable ones: each layer's frozen parameters
// form a group of their own, split across the ranks, gathered with the
// layer's trainable group for its forward and for the backward that passes
// through it, and released after. A frozen group has no gradient, master or
// optimizer state: it is not in the owned partition (owned_offset -1), the
// optimizer and the gradient reducer never see it. Its shard lives where the
// trainable shards live (the device, host memory with offload_param, or the
// parameter swap file), counted in the ledger as Kind::kFrozenParameters.
// Frozen groups come after every trainable group, and their slots after
// every trainable slot, so groups() and slots() (the trainable ones, what the
// optimizer steps) keep the indices they have in all_groups() and
// all_slots() (what the gathers, the swapper, loads and exports walk). Frozen
// parameters outside every layer, or under
// stage3_param_persistence_threshold, stay whole on every rank, as the
// always-gathered group does for trainable ones.

class FlatParameters {
 public:
  /// Copies the values of `named_params` (deduplicated by identity) into one
  /// flat buffer of `dtype` on `device`, allocated through `ledger` as
  /// (device tier, parameters), and rebinds every parameter to its view.
  /// Throws zero::OutOfMemoryError from the ledger.
  FlatParameters(const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                 at::ScalarType dtype, at::Device device, int64_t world_size, int64_t group_numel,
                 MemoryLedger& ledger);
  /// Stage 3 (NOTE [stage-3 storage]): one group per spec, in order; keeps
  /// only `rank`'s chunk of each, in `partition_tier` (device, or a host tier
  /// for offload_param). Parameters are left released. Frozen specs (NOTE
  /// [frozen groups]) must come after every trainable one.
  FlatParameters(std::vector<GroupSpec> groups, at::ScalarType dtype, at::Device device, int64_t world_size,
                 int64_t rank, Tier partition_tier, MemoryLedger& ledger);
  FlatParameters(const FlatParameters&) = delete;
  FlatParameters& operator=(const FlatParameters&) = delete;

  /// The whole-model buffer (stages 0-2; undefined at stage 3).
  const at::Tensor& flat() const { return flat_; }
  /// Stage 3: this rank's chunk of group g (its shard of the layer), in the
  /// compute dtype; one tensor per group, so shards made by zero::Init are
  /// adopted without a copy.
  const at::Tensor& part(size_t g) const { return parts_[g]; }
  /// Stage 3: group g's full-size tensor (empty storage while released).
  const at::Tensor& full(size_t g) const { return full_[g]; }
  bool stage3() const { return !flat_.defined(); }
  /// The trainable parameters' slots and groups: what the optimizer steps.
  c10::ArrayRef<ParamSlot> slots() const { return c10::ArrayRef<ParamSlot>(slots_).slice(0, trainable_slots_); }
  c10::ArrayRef<FlatGroup> groups() const { return c10::ArrayRef<FlatGroup>(groups_).slice(0, trainable_groups_); }
  /// Every slot and group, the frozen ones after (NOTE [frozen groups]):
  /// what stage 3 gathers, swaps, loads and exports.
  const std::vector<ParamSlot>& all_slots() const { return slots_; }
  const std::vector<FlatGroup>& all_groups() const { return groups_; }
  /// Elements that are trainable parameters (no padding): what the optimizer steps.
  int64_t numel() const { return numel_; }
  /// Elements including padding.
  int64_t padded_numel() const { return flat_.numel(); }
  /// Elements of one rank's owned partition (sum of its chunks).
  int64_t owned_numel() const { return owned_numel_; }
  int64_t world_size() const { return world_size_; }

  /// Layout of one group of `numel` elements: padded size for the world.
  static int64_t padded_size(int64_t numel, int64_t world_size);

  /// Group g's range of a buffer laid out like flat().
  at::Tensor group_of(const at::Tensor& like_flat, size_t g) const;
  /// Rank r's chunk of group g in a buffer laid out like flat().
  at::Tensor chunk_of(const at::Tensor& like_flat, size_t g, int64_t rank) const;
  /// Group g's chunk in a buffer laid out like the owned partition.
  at::Tensor owned_chunk_of(const at::Tensor& like_owned, size_t g) const;

 private:
  std::vector<ParamSlot> slots_;
  std::vector<FlatGroup> groups_;
  at::Tensor flat_;
  std::vector<at::Tensor> parts_;
  std::vector<at::Tensor> full_;
  size_t trainable_slots_ = 0, trainable_groups_ = 0;
  int64_t numel_ = 0;
  int64_t owned_numel_ = 0;
  int64_t world_size_ = 1;
};

}  // namespace zero::partition
