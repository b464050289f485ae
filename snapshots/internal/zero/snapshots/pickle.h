// torch.save files without Python: a restricted reader and a writer
// (docs/checkpoints.md, "DeepSpeed's checkpoints").
//
// NOTE [restricted unpickling]
// A torch.save file is a zip archive: data.pkl, a pickle of the saved
// object, and one record per tensor storage (data/<key>). A pickle is a
// program for Python's pickle machine; loading one in Python may call any
// function it names. This reader runs the machine's stack and memo
// operations itself and builds plain values (None, bool, int, float, str,
// bytes, tuple, list, dict), and knows a short list of globals: what torch
// writes for tensors, storages, torch.Size, dtypes and OrderedDict, and the
// few DeepSpeed classes its checkpoints hold (ZeroStageEnum, the loss
// scalers, fragment_address), whose state it keeps as a dict. Any other
// global is refused with its name, before anything is built from it:
// nothing named in a file is ever called. Tensors are not read when the
// pickle is: a value holds where a tensor's elements are (its record,
// dtype, offset, sizes and strides), and the caller reads what it needs,
// a piece at a time.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace zero::ckpt::pickle {

/// Where a saved tensor's elements are in its archive.
struct TensorRef {
  std::string record;  // the storage's record, "data/<key>"
  at::ScalarType dtype = at::kFloat;
  int64_t storage_numel = 0;
  int64_t offset = 0;  // in elements of the storage
  std::vector<int64_t> sizes, strides;
  int64_t numel() const;
  /// Whether its elements lie in order with no gaps (so a range of them is one read).
  bool contiguous() const;
};

struct Value;
using ValuePtr = std::shared_ptr<Value>;

/// A value of a pickle, as the restricted reader builds it, or as a writer
/// is given it.
struct Value {
  enum class Kind { kNone, kBool, kInt, kFloat, kStr, kBytes, kTuple, kList, kDict, kSize, kTensor, kObject, kGlobal, kStorage };
  Kind kind = Kind::kNone;
  bool b = false;
  int64_t i = 0;
  double f = 0.0;
  std::string s;                                         // str, bytes; kObject/kGlobal: "module.name"
  std::vector<ValuePtr> items;                           // tuple, list, torch.Size
  std::vector<std::pair<ValuePtr, ValuePtr>> entries;    // dict (in order), an object's state
  bool ordered = false;                                  // a dict: an OrderedDict
  TensorRef tensor;                                      // kTensor, kStorage (read)
  at::Tensor data;                                       // kTensor (written): a CPU tensor

  /// The kind's name, for messages ("a dict", "an int").
  std::string kind_name() const;
  /// A dict's (or an object's) entry under string key `key`, or null.
  const Value* find(const std::string& key) const;
  /// find(), throwing IoError "<where>: has no <key>" when missing.
  const Value& at(const std::string& key, const std::string& where) const;
  /// A dict's entry under int key `key`, or null.
  const Value* find(int64_t key) const;

  /// The value as its kind, throwing IoError "<where>: expected KIND, got KIND".
  int64_t as_int(const std::string& where) const;  // also a bool
  double as_double(const std::string& where) const;  // an int or a float
  bool as_bool(const std::string& where) const;
  const std::string& as_str(const std::string& where) const;
  const TensorRef& as_tensor(const std::string& where) const;
  /// A tuple's, list's or torch.Size's items.
  const std::vector<ValuePtr>& as_sequence(const std::string& where) const;
  /// A dict's (or object's) entries.
  const std::vector<std::pair<ValuePtr, ValuePtr>>& as_dict(const std::string& where) const;
  bool is_none() const { return kind == Kind::kNone; }

  // Building values to write.
  static ValuePtr none();
  static ValuePtr boolean(bool v);
  static ValuePtr integer(int64_t v);
  static ValuePtr real(double v);
  static ValuePtr str(std::string v);
  static ValuePtr list(std::vector<ValuePtr> items = {});
  static ValuePtr tuple(std::vector<ValuePtr> items);
  static ValuePtr size(const std::vector<int64_t>& dims);  // a torch.Size
  static ValuePtr dict(bool ordered = false);
  /// A CPU tensor (saved contiguous, in its own storage).
  static ValuePtr tensor_of(at::Tensor t);
  /// An instance of class `module.name` whose __dict__ is `state` (a dict).
  static ValuePtr object(std::string qualified_name, ValuePtr state);
  /// Sets a dict's entry `key` (appended when new), returning this dict.
  Value& set(const std::string& key, ValuePtr v);
  Value& set(int64_t key, ValuePtr v);
};

/// A torch.save file, opened: its pickle read (NOTE [restricted
/// unpickling]), its records found. Reads tensors with pread(2); no member
/// is changed after opening, so several threads may read at once.
class Archive {
 public:
  /// Opens `path`. Throws IoError naming the file: missing, not a zip
  /// archive (torch.save's legacy format included), no data.pkl, a pickle
  /// that is truncated, malformed, or names a global outside the list (its
  /// name said), a tensor whose storage record is missing or too short.
  static std::unique_ptr<Archive> open(const std::string& path);
  ~Archive();
  Archive(const Archive&) = delete;
  Archive& operator=(const Archive&) = delete;

  const std::string& path() const { return path_; }
  const Value& root() const { return *root_; }
  /// Reads a whole tensor, contiguous, in its saved dtype. Throws IoError
  /// naming the file, the offset and errno.
  at::Tensor read(const TensorRef& t) const;
  /// Reads elements [first, first + count) of a contiguous tensor (in
  /// order), converted to fp32, into `dst`. Throws IoError as read(), and
  /// for a range outside the tensor.
  void read_floats(const TensorRef& t, int64_t first, int64_t count, float* dst) const;
  /// Bytes of tensor data read so far.
  int64_t bytes_read() const { return bytes_read_; }

 private:
  Archive() = default;
  std::string path_;
  int fd_ = -1;
  ValuePtr root_;
  std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> records_;  // record -> (file offset, bytes)
  mutable std::atomic<int64_t> bytes_read_{0};
  std::pair<int64_t, int64_t> record(const std::string& name) const;
  void pread_all(void* dst, int64_t n, int64_t offset) const;
};

/// Parses pickle bytes (data.pkl) by NOTE [restricted unpickling]; `where`
/// names them in errors. Tensors become TensorRefs of records "data/<key>".
ValuePtr parse(const std::string& bytes, const std::string& where);

/// Serialises `root` as pickle protocol 2 (what torch.save writes), with
/// each tensor a persistent storage "<key>"; `tensors` gets, in key order,
/// the tensor each key stores (contiguous).
std::string serialize(const Value& root, std::vector<at::Tensor>* tensors);

/// Writes `root` to `path` as torch.save does (a zip archive torch.load and
/// DeepSpeed read), through a temporary file renamed over `path` after an
/// fsync. Throws IoError naming the file and errno.
void save(const std::string& path, const Value& root);

}  // namespace zero::ckpt::pickle
