// Full weights in Hugging Face's save_pretrained layout (Engine::save_hf,
// `zero checkpoint export --hf`): model.safetensors, or
// model-0000k-of-0000n.safetensors shards with model.safetensors.index.json,
// and config.json when given. Tensors arrive one at a time and go to disk as
// they come, so memory holds a tensor, not the model.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "zero/offload/aio.h"
#include "zero/snapshots/checkpoint_format.h"

namespace zero::ckpt {

// NOTE [export folder]
// An export replaces only the files of an earlier export. Each export
// records what it wrote in DIR/.zero-export.json, each file with its size
// and modification time; a file of a name the export writes that no record
// lists (the user's own model.safetensors, a config.json), or that another
// tool changed since (a config.json edited by hand), is refused before any
// work, and everything else in DIR (a
// tokenizer, the user's model-best-of-3.safetensors, folders) stays. The
// export is written into a fresh folder beside DIR (.NAME.zero-export-XXXXXX),
// which is then swapped in whole: DIR's other files are hard-linked into it,
// and one renameat2(RENAME_EXCHANGE) trades the two, so a reader of DIR sees
// the earlier export or the new one, never a mix; the earlier folder, now
// under the temporary name, goes last. Where the file system cannot
// (no exchange, no hard links, a parent folder not writable), the new files
// are moved in one by one, the index (or model.safetensors) last, and then
// the earlier export's other files go. The fresh folder is locked (flock)
// while its export runs; one left by a killed export is removed by the next
// export to the same folder.
class HfWriter {
 public:
  struct Tensor {
    std::string name;
    at::ScalarType dtype = at::kFloat;
    std::vector<int64_t> shape;
  };
  /// Plans shards of at most `max_shard_bytes` of tensor data each, in
  /// `tensors`' order (a larger tensor has a shard of its own; one shard is
  /// named model.safetensors, with no index), checks `dir` (folder_problem
  /// with the planned names), removes what killed exports left, and makes
  /// the fresh folder (NOTE [export folder]). Throws IoError naming the folder.
  HfWriter(std::string dir, std::vector<Tensor> tensors, int64_t max_shard_bytes, offload::AioEngine& aio);
  /// Unfinished, it removes its fresh folder: `dir` is as it was.
  ~HfWriter();

  /// Why an export cannot go to `dir` (named by option `flag`), or "": a
  /// file, not writable, or holding a file of a name an export writes
  /// (model.safetensors, model.safetensors.index.json,
  /// model-NNNNN-of-NNNNN.safetensors, and config.json when `with_config`)
  /// that no earlier export recorded. Makes nothing (a check before a run).
  static std::string folder_problem(const std::string& flag, const std::string& dir, bool with_config);
  HfWriter(const HfWriter&) = delete;
  HfWriter& operator=(const HfWriter&) = delete;

  /// The next tensor, whole, in the planned order (any device and dtype:
  /// converted to its planned dtype; a shape other than planned is an
  /// internal error).
  void append(const at::Tensor& t);
  /// The next elements of the tensor in progress (in order, any dtype and
  /// shape: flattened), so a large tensor comes in pieces; the next tensor
  /// starts once this one is whole.
  void append_part(const at::Tensor& part);
  /// After the last tensor: writes the index (when sharded), config.json
  /// (when `config_json` is not empty) and the record, then swaps the fresh
  /// folder in (NOTE [export folder]). Throws IoError naming what failed;
  /// `dir` then holds the earlier export or this one whole.
  void finish(const std::string& config_json);

  int64_t shards() const { return static_cast<int64_t>(shard_of_.empty() ? 0 : shard_of_.back() + 1); }
  int64_t bytes() const { return bytes_; }

 private:
  std::string file_name(int64_t shard) const;
  void open_shard(int64_t shard);
  void swap_in(const std::vector<std::string>& files);
  void move_in(const std::vector<std::string>& files, const std::string& final_file);

  std::string dir_, tmp_;
  int tmp_lock_ = -1;     // flock'ed descriptor of tmp_ while the export runs
  bool tmp_beside_ = true;  // tmp_ beside dir_ (else inside it: files move one by one)
  std::vector<Tensor> tensors_;
  std::vector<int64_t> shard_of_;  // by tensor
  offload::AioEngine& aio_;
  size_t next_ = 0;
  int64_t part_done_ = 0;  // elements of tensors_[next_] written by append_part
  int64_t open_shard_ = -1;
  std::unique_ptr<TensorFileWriter> writer_;
  std::vector<std::string> written_;  // file names in tmp_
  int64_t bytes_ = 0;
  bool finished_ = false;
  bool moving_ = false;  // finish() has begun changing dir_: tmp_ is kept if it fails
};

}  // namespace zero::ckpt
