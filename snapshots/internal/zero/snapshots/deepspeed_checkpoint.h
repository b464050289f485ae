// DeepSpeed's checkpoints, read and written (docs/checkpoints.md,
// "DeepSpeed's checkpoints").
//
// NOTE [deepspeed checkpoints]
// DeepSpeed saves a ZeRO run as torch.save files in DIR/TAG (DIR/latest
// names TAG): the model's file (mp_rank_00_model_states.pt; at stage 3 one
// per rank, zero_pp_rank_R_mp_rank_00_model_states.pt) holds the module's
// state dict (buffers; parameters whole below stage 3, empty at it), each
// optimizer group's parameter names and shapes in order (param_shapes), the
// step counters, the LR scheduler's state and the client state; one
// optimizer file per rank (zero_pp_rank_R_mp_rank_00_optim_states.pt,
// bf16_... for the BF16 optimizer) holds that rank's fp32 master and Adam
// moments:
// - stages 1 and 2: each group flattened in param_shapes order, padded at
//   its end to a multiple of 2 x ranks, cut into equal partitions; rank R
//   saves partition R without the padding (single_partition_of_fp32_groups;
//   the moments in base_optimizer_state, with it or without it);
// - stage 3: every parameter padded to a multiple of the ranks and cut into
//   equal partitions; rank R's flat groups (fp32_flat_groups, one per
//   sub-group) are its partitions of the parameters one after another.
// ds_to_universal writes the universal form: DIR/TAG/zero/NAME/fp32.pt,
// exp_avg.pt, exp_avg_sq.pt (whole tensors), step.pt, and
// zero/optimizer_state.pt; DIR/latest_universal names TAG.
// Reading maps these onto zero's saved layout (NOTE [checkpoint mapping]):
// a saved group per stage-1/2 group (partitions of the ranks), per
// parameter at stage 3 (its partitions), per parameter whole for the
// universal form; so a rank of any world size and stage reads its own
// elements and no more, a piece at a time. Writing (export) lays a zero
// checkpoint out as DeepSpeed would have saved it at a given world size
// and stage, with the files zero_to_fp32.py and deepspeed's
// load_checkpoint read.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "zero/snapshots/checkpoint_io.h"

namespace zero::ckpt::deepspeed {

/// The folder of the DeepSpeed checkpoint `dir` holds, for `tag` ("" means
/// the tag DIR/latest names, or DIR/latest_universal's when only it is
/// there); "" when `dir` does not hold one (a zero checkpoint, nothing).
/// `dir` may also be the tag folder itself.
std::string find(const std::string& dir, const std::string& tag);

/// A DeepSpeed checkpoint opened as zero reads its own: `meta` says what
/// zero's meta.json would (the states, the layout, steps, scheduler, loss
/// scaler, client state; "format": "deepspeed"; "rng_states": false), and
/// `reader` reads pieces of it (PieceReader), the buffers and frozen
/// parameters by name from "model.safetensors".
struct Opened {
  std::string tag_dir;
  nlohmann::json meta;
  std::unique_ptr<PieceReader> reader;
};

/// Opens the checkpoint in `tag_dir` (find()'s answer). Throws IoError
/// naming the file and what was expected: a missing rank file, a truncated
/// or foreign file (NOTE [restricted unpickling]), tensor parallelism or
/// pipeline stages (not read), sizes that do not add up.
Opened open(const std::string& tag_dir);

/// The checkpoint in `tag_dir`, zero's or DeepSpeed's, opened for reading:
/// zero's meta.json and PieceReader::checkpoint, or open(). Throws as they do.
Opened open_any(const std::string& tag_dir, const offload::AioOptions& aio);

/// The folder of checkpoint `dir`'s tag `tag` ("" for the latest), zero's
/// (tag_folder) or DeepSpeed's (find).
std::string tag_folder_any(const std::string& dir, const std::string& tag);

/// Reads every torch.save file of the DeepSpeed checkpoint in `tag_dir`
/// whole (each pickle parsed, each tensor read), calling `on_file(path,
/// bytes)` for each; returns the bytes of tensor data read. Throws IoError
/// naming the first damaged file.
int64_t verify(const std::string& tag_dir, const std::function<void(const std::string&, int64_t)>& on_file);

struct ExportOptions {
  int64_t world_size = 0;  // ranks of the layout written; 0: the checkpoint's own
  int stage = 0;           // 1, 2 or 3; 0: the checkpoint's (stage 0 is written as 2)
  bool universal = false;  // ds_to_universal's form instead
  std::string tag;         // "" : the checkpoint's tag
  // From the run's config (the caller reads it, with its schedule): the
  // optimizer group DeepSpeed restores, its lr the one the next step uses.
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  bool adam_w_mode = true;
  double clip_grad = 0.0;
  int64_t sub_group_size = 1000000000;  // stage 3's sub-groups, as DeepSpeed splits them
  int64_t train_batch_size = 1;         // global_samples = global_steps x this
  std::string ds_version = "0.18.9";    // what the files say wrote them
};

struct ExportStats {
  int64_t files = 0;
  int64_t bytes_read = 0;
  int64_t bytes_written = 0;
  std::string tag_dir;
};

/// Writes zero checkpoint `zero_tag_dir` (its meta.json read) as DeepSpeed
/// lays it out into `out` (OUT/TAG and OUT/latest, or OUT/latest_universal),
/// parameter by parameter so memory holds a few parameters' states.
/// `progress(done, total)` counts parameters. `out` must not exist or be
/// an empty folder; what is written appears whole (a temporary folder
/// renamed) or not at all. Throws IoError, UsageError for options a
/// checkpoint cannot be written with (8-bit states, another optimizer than
/// Adam).
ExportStats export_checkpoint(const std::string& zero_tag_dir, const std::string& out, const ExportOptions& options,
                              const std::function<void(int64_t, int64_t)>& progress = {});

/// Converts the DeepSpeed checkpoint in `ds_tag_dir` (find()'s answer) into
/// a zero checkpoint in `out` (OUT/TAG and OUT/latest), laid out as it was
/// saved (the same ranks and partitions), with its states, steps, schedule,
/// buffers, frozen parameters and client state; it has no RNG states. Reads
/// and writes a window at a time, so memory stays a few buffers whatever the
/// model's size. `progress(done, total)` counts elements. `out` must not
/// exist or be empty; what is written appears whole or not at all. Throws
/// IoError as open() does, and naming what cannot be written.
ExportStats import_checkpoint(const std::string& ds_tag_dir, const std::string& out,
                              const std::function<void(int64_t, int64_t)>& progress = {});

}  // namespace zero::ckpt::deepspeed
