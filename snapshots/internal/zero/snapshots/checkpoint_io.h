// Reading engine checkpoints at any world size and layout (docs/checkpoints.md).
//
// NOTE [checkpoint mapping]
// A checkpoint holds, for each rank that had a partition, its chunk of every
// group of the flat layout it was saved with (NOTE [flat layout]), per
// optimizer state; meta.json records that layout: each group's padded size
// and chunk size, and each parameter's name, shape and offset in its group.
// A rank loading it, under any layout (another world size, other bucket
// sizes, another stage), needs the elements of its own chunks: for each
// range of a chunk, map_range() finds, parameter by parameter, where those
// elements were (saved group, saved rank, element in that rank's chunk), and
// merges neighbours into as few pieces as the layouts allow. Padding is in
// no parameter and is left zero. Each piece is read alone, with the 1 KiB
// blocks around it whose checksums verify it, so a rank reads its share and
// little more. The same mapping fills a model from a full-weight safetensors
// file (each tensor a group of one parameter, saved by one rank).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>

#include "zero/snapshots/checkpoint_format.h"
#include "zero/offload/aio.h"
#include "zero/partition/flat_parameters.h"

namespace zero::ckpt {

struct SavedParam {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // in its group
  int64_t numel = 0;
};

struct SavedGroup {
  std::string name;
  int64_t padded_numel = 0;
  int64_t chunk_numel = 0;
  std::vector<SavedParam> params;
};

/// The flat layout a checkpoint was saved with.
struct SavedLayout {
  int64_t partitions = 1;  // ranks holding a partition (1 at stage 0: every rank holds all)
  std::vector<SavedGroup> groups;
  std::map<std::string, std::string> aliases;  // a tied parameter's other names -> the name laid out

  nlohmann::json to_json() const;
  /// Throws IoError naming `where` for a malformed layout.
  static SavedLayout from_json(const nlohmann::json& j, const std::string& where);
  /// name -> (group, index in its params)
  std::unordered_map<std::string, std::pair<size_t, size_t>> index() const;
};

/// The layout of `flat` as saved by a job of `partitions` partitions, with
/// the tied names `model` has beside the ones laid out.
SavedLayout layout_of(const partition::FlatParameters& flat, int64_t partitions, const torch::nn::Module& model);

/// Elements [dst, dst + count) of a destination range are elements
/// [begin, begin + count) of saved rank `part`'s chunk of saved group `group`.
struct Piece {
  int64_t part = 0;
  size_t group = 0;
  int64_t begin = 0;
  int64_t count = 0;
  int64_t dst = 0;
};

/// Appends to `out` where elements [first, first + count) of parameter
/// `param` of saved group `group` are, the first going to `dst` (merged
/// with the last piece when they follow it).
void append_pieces(const SavedLayout& saved, size_t group, size_t param, int64_t first, int64_t count, int64_t dst,
                   std::vector<Piece>& out);

/// NOTE [checkpoint mapping]: where elements [start, start + len) of this
/// rank's chunk of group g of `flat` (this rank: `rank`; a layout of one
/// partition: 0) are in `saved`; g indexes flat.all_groups() (a frozen
/// group's too). Parameters named in `skip` are left out (no piece: their
/// elements read as zeros). Throws IoError naming a parameter the
/// checkpoint lacks or holds with another shape.
std::vector<Piece> map_range(const partition::FlatParameters& flat, int64_t rank, size_t g, int64_t start,
                             int64_t len, const SavedLayout& saved,
                             const std::unordered_map<std::string, std::pair<size_t, size_t>>& index,
                             const std::string& source, const std::unordered_set<std::string>* skip = nullptr);

/// Where full weights are: one safetensors file, the index of a sharded set
/// (model.safetensors.index.json, as Hugging Face's save_pretrained writes
/// it), or a folder holding either.
struct WeightFiles {
  std::string source;              // as given, for messages
  std::string index;               // the sharded index read, or ""
  std::vector<std::string> files;  // the safetensors files, in the index's order
  /// Throws IoError naming the path: missing, a folder with neither file, an
  /// index that is not JSON or names a shard that is not there.
  static WeightFiles resolve(const std::string& path);
};

/// A weights file's tensor, by the name the model knows it under.
struct WeightTensor {
  std::string name;       // mapped (NameMap)
  std::string file_name;  // as the file has it
  std::string file;       // which of WeightFiles::files
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
};

/// Every rank file of the checkpoint in `tag_dir` holds exactly the states
/// meta.json lists ("states"), each tensor named STATE.GROUP (besides its
/// RNG states): a meta.json that lost or gained a state (an 8-bit
/// checkpoint's fp32_blocks, say) would otherwise load into the wrong
/// arithmetic. Throws IoError naming the file and the state.
void check_saved_states(const std::string& tag_dir, const nlohmann::json& meta, class PieceReader& reader);

/// Reads pieces into fp32 host memory: from a checkpoint's rank files (the
/// tensor "<state>.<group>" of rank<part>.safetensors, verified against its
/// .sums), or from a full-weight safetensors file (tensor = the group's one
/// parameter, any float dtype, state "fp32_master" only). Counts bytes read.
class PieceReader {
 public:
  /// A checkpoint folder (DIR/TAG) whose meta.json is `meta`.
  static std::unique_ptr<PieceReader> checkpoint(const std::string& tag_dir, const nlohmann::json& meta,
                                                 const offload::AioOptions& aio);
  /// Full weights by parameter name, in one file or several (`files`), each
  /// tensor renamed by `rename` (the file's name in, the model's out; "" leaves
  /// the tensor out; null keeps names). `layout` gets one group per tensor
  /// of a floating dtype, `tensors` (may be null) every tensor kept. Reads
  /// each file's header now; throws IoError naming the file, and one naming
  /// both files when two tensors map to one name.
  static std::unique_ptr<PieceReader> weights(const WeightFiles& files,
                                              const std::function<std::string(const std::string&)>& rename,
                                              SavedLayout* layout, std::vector<WeightTensor>* tensors,
                                              const offload::AioOptions& aio);
  virtual ~PieceReader() = default;

  /// Reads in flight (issue), finished into their destinations (complete).
  struct Pending {
    virtual ~Pending() = default;
  };
  /// Starts reading state states[i] at `pieces` (a range of `len` elements)
  /// into the reader's buffers. Throws IoError naming the file: missing,
  /// truncated, a tensor the layout does not match.
  virtual std::unique_ptr<Pending> issue(const std::vector<std::string>& states, std::vector<Piece> pieces,
                                         int64_t len) = 0;
  /// Waits for `pending`, checks every block, and fills dsts[i][0, len)
  /// with state i; elements no piece covers (padding) are set to zero.
  /// Throws IoError naming the file and offset of a checksum mismatch.
  virtual void complete(Pending& pending, const std::vector<float*>& dsts) = 0;
  /// issue() then complete().
  void fill(const std::vector<std::string>& states, std::vector<Piece> pieces, int64_t len,
            const std::vector<float*>& dsts) {
    complete(*issue(states, std::move(pieces), len), dsts);
  }
  /// Reads a whole tensor of a file of the folder (model.safetensors, the
  /// RNG state of a rank file) verified; throws IoError. A weights reader
  /// finds `name` (the model's) in whichever file has it; `file` is unused.
  virtual at::Tensor read_tensor(const std::string& file, const std::string& name) = 0;
  /// Whether `file` has tensor `name` (a weights reader: any of its files).
  virtual bool has_tensor(const std::string& file, const std::string& name) = 0;
  /// The layout of `file` (opened and, in a checkpoint, checked against meta.json).
  virtual const Layout& file_layout(const std::string& file) = 0;
  /// Reads all of `file` in bounded pieces, verifying every block; returns
  /// the bytes of tensor data read. Throws IoError naming the damage.
  virtual int64_t verify_file(const std::string& file) = 0;
  int64_t bytes_read() const { return bytes_read_; }

 protected:
  int64_t bytes_read_ = 0;
};

/// Throws UsageError unless `tag` can name a checkpoint folder: 1-200
/// characters, no '/', not starting with '.', not "latest".
void check_tag(const std::string& tag);
/// Reads and checks DIR/TAG/meta.json (format, version). Throws IoError
/// naming the file: missing, not JSON, another format.
nlohmann::json read_meta(const std::string& tag_dir);
/// The folder of `tag` in `dir` ("" means the tag `dir`/latest names).
/// Throws IoError when latest is missing, UsageError for a bad tag.
std::string tag_folder(const std::string& dir, const std::string& tag);

struct ConsolidateStats {
  int64_t tensors = 0;
  int64_t bytes_read = 0;
  int64_t bytes_written = 0;
};
/// Writes the full weights a checkpoint holds (state "fp32_master" of every
/// parameter, by name, in `dtype`, and the buffers and frozen parameters as
/// saved; or another state, "exp_avg" say, of every parameter) to the
/// safetensors file `out`, reading the rank files piece by piece (NOTE
/// [checkpoint mapping]) so memory stays bounded whatever the model's size.
/// `progress(done, total)` counts parameter elements. The file appears whole
/// or not at all. Throws IoError naming the damaged file, UsageError for a
/// state the checkpoint lacks.
ConsolidateStats consolidate(const std::string& tag_dir, const std::string& out, at::ScalarType dtype,
                             const std::string& state, const offload::AioOptions& aio,
                             const std::function<void(int64_t done, int64_t total)>& progress = {});

/// The full weights a checkpoint holds in Hugging Face's layout in `out_dir`
/// (HfWriter: shards of at most `max_shard_bytes`, their index, and
/// `config_json` as config.json when not empty), state "fp32_master" in
/// `dtype`, read piece by piece as consolidate() does. Throws as consolidate.
ConsolidateStats export_hf(const std::string& tag_dir, const std::string& out_dir, at::ScalarType dtype,
                           int64_t max_shard_bytes, const std::string& config_json, const offload::AioOptions& aio,
                           const std::function<void(int64_t done, int64_t total)>& progress = {});

}  // namespace zero::ckpt
