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
#include "zero/runtime/checkpoint_format.h"

namespace zero::ckpt {

class HfWriter {
 public:
  struct Tensor {
    std::string name;
    at::ScalarType dtype = at::kFloat;
    std::vector<int64_t> shape;
  };
  /// Plans shards of at most `max_shard_bytes` of tensor data each, in
  /// `tensors`' order (a larger tensor has a shard of its own; one shard is
  /// named model.safetensors, with no index), and makes a hidden temporary
  /// folder in `dir` (made if missing). Throws IoError naming the folder.
  HfWriter(std::string dir, std::vector<Tensor> tensors, int64_t max_shard_bytes, offload::AioEngine& aio);
  /// Unfinished, it removes its temporary folder: `dir` is as it was.
  ~HfWriter();
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
  /// After the last tensor: writes the index (when sharded) and config.json
  /// (when `config_json` is not empty), moves the new files into `dir` (the
  /// index, or model.safetensors, last), then removes an earlier export's
  /// other weight files (model*.safetensors and its index; other files
  /// stay). Throws IoError; a move that fails keeps the temporary folder.
  void finish(const std::string& config_json);

  int64_t shards() const { return static_cast<int64_t>(shard_of_.empty() ? 0 : shard_of_.back() + 1); }
  int64_t bytes() const { return bytes_; }

 private:
  std::string file_name(int64_t shard) const;
  void open_shard(int64_t shard);

  std::string dir_, tmp_;
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
  bool moving_ = false;  // finish() has begun moving files into dir_
};

}  // namespace zero::ckpt
