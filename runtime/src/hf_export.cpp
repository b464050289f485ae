#include "zero/runtime/hf_export.h"

#include <stdlib.h>

#include <cstdio>
#include <set>

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
#include <nlohmann/json.hpp>

#include "zero/core/error.h"

namespace zero::ckpt {
namespace {

bool is_weight_file(const std::string& name) {
  if (name == "model.safetensors" || name == "model.safetensors.index.json") return true;
  return name.rfind("model-", 0) == 0 && name.size() > 12 && name.compare(name.size() - 12, 12, ".safetensors") == 0 &&
         name.find("-of-") != std::string::npos;
}

}  // namespace

HfWriter::HfWriter(std::string dir, std::vector<Tensor> tensors, int64_t max_shard_bytes, offload::AioEngine& aio)
    : dir_(std::move(dir)), tensors_(std::move(tensors)), aio_(aio) {
  ZERO_CHECK(!tensors_.empty(), "an export of no tensors");
  int64_t shard = 0, in_shard = 0;
  for (const auto& t : tensors_) {
    const int64_t n = c10::multiply_integers(t.shape) * static_cast<int64_t>(c10::elementSize(t.dtype));
    if (in_shard > 0 && in_shard + n > max_shard_bytes) ++shard, in_shard = 0;
    in_shard += n;
    shard_of_.push_back(shard);
  }
  if (const std::string problem = save_folder_problem("export folder", dir_); !problem.empty()) throw IoError(problem);
  std::string pattern = dir_ + "/.zero-export-XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) throw IoError("make a temporary folder " + pattern + ": " + std::strerror(errno));
  tmp_ = pattern;
}

HfWriter::~HfWriter() {
  writer_.reset();
  if (finished_ || moving_) return;
  try {
    remove_tree(tmp_);
  } catch (const std::exception&) {  // the error that ended the export says more
  }
}

std::string HfWriter::file_name(int64_t shard) const {
  if (shards() == 1) return "model.safetensors";
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05lld-of-%05lld.safetensors", static_cast<long long>(shard + 1),
                static_cast<long long>(shards()));
  return buf;
}

void HfWriter::open_shard(int64_t shard) {
  Layout layout;
  for (size_t i = 0; i < tensors_.size(); ++i)
    if (shard_of_[i] == shard) layout.tensors.push_back({tensors_[i].name, tensors_[i].dtype, tensors_[i].shape});
  layout.metadata = {{"format", "pt"}};
  writer_ = std::make_unique<TensorFileWriter>(tmp_ + "/" + file_name(shard), std::move(layout), aio_);
  open_shard_ = shard;
}

void HfWriter::append(const at::Tensor& t) {
  ZERO_CHECK(next_ < tensors_.size(), "more tensors than the export planned");
  const Tensor& want = tensors_[next_];
  ZERO_CHECK(t.sizes().vec() == want.shape, "tensor " + want.name + " came with another shape than planned");
  if (open_shard_ != shard_of_[next_]) {
    if (writer_) {
      writer_->commit("");
      written_.push_back(file_name(open_shard_));
    }
    open_shard(shard_of_[next_]);
  }
  const at::Tensor v = t.scalar_type() == want.dtype ? t : t.to(want.dtype);
  writer_->append(writer_->tensor(want.name), v.contiguous());
  bytes_ += v.numel() * static_cast<int64_t>(v.element_size());
  ++next_;
}

void HfWriter::append_part(const at::Tensor& part) {
  ZERO_CHECK(next_ < tensors_.size(), "more tensors than the export planned");
  const Tensor& want = tensors_[next_];
  if (open_shard_ != shard_of_[next_]) {
    if (writer_) {
      writer_->commit("");
      written_.push_back(file_name(open_shard_));
    }
    open_shard(shard_of_[next_]);
  }
  const at::Tensor v = (part.scalar_type() == want.dtype ? part : part.to(want.dtype)).reshape({-1}).contiguous();
  const int64_t total = c10::multiply_integers(want.shape);
  ZERO_CHECK(part_done_ + v.numel() <= total, "tensor " + want.name + " given more elements than its shape");
  writer_->append(writer_->tensor(want.name), v);
  bytes_ += v.numel() * static_cast<int64_t>(v.element_size());
  part_done_ += v.numel();
  if (part_done_ == total) ++next_, part_done_ = 0;
}

void HfWriter::finish(const std::string& config_json) {
  ZERO_CHECK(next_ == tensors_.size(), "the export ended before its last tensor");
  writer_->commit("");
  written_.push_back(file_name(open_shard_));
  writer_.reset();
  if (shards() > 1) {
    nlohmann::json map = nlohmann::json::object();
    for (size_t i = 0; i < tensors_.size(); ++i) map[tensors_[i].name] = file_name(shard_of_[i]);
    const nlohmann::json index = {{"metadata", {{"total_size", bytes_}}}, {"weight_map", map}};
    write_file_atomically(tmp_ + "/model.safetensors.index.json", index.dump(2) + "\n");
  }
  if (!config_json.empty()) write_file_atomically(tmp_ + "/config.json", config_json);
  // The new files come in first (a rename replaces a file of the same name
  // whole), then the earlier export's other weight files go, the index
  // last: at every point the folder holds a whole set of weights, the old
  // one until the new index (or model.safetensors) is in place. From the
  // first move on, the temporary folder is kept if a move fails (what is
  // in it may be all there is), so nothing is lost.
  moving_ = true;
  const std::string final_file = shards() > 1 ? "model.safetensors.index.json" : "model.safetensors";
  for (const auto& name : written_)
    if (name != final_file) rename_path(tmp_ + "/" + name, dir_ + "/" + name);
  if (!config_json.empty()) rename_path(tmp_ + "/config.json", dir_ + "/config.json");
  rename_path(tmp_ + "/" + final_file, dir_ + "/" + final_file);
  std::set<std::string> kept(written_.begin(), written_.end());
  kept.insert(final_file);
  for (const auto& name : list_folder(dir_))
    if (is_weight_file(name) && kept.count(name) == 0) ::unlink((dir_ + "/" + name).c_str());
  sync_path(dir_);
  finished_ = true;
  remove_tree(tmp_);
}

}  // namespace zero::ckpt
