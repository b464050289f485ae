// The pieces of an engine checkpoint's files (docs/checkpoints.md):
// safetensors headers, CRC32C block checksums, the atomic small-file writer.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>

#include "zero/offload/aio.h"

namespace zero {
class CommandFiles;
}  // namespace zero

namespace zero::ckpt {

inline constexpr const char* kFormat = "zero-checkpoint";
inline constexpr int kVersion = 1;
/// Checksums cover each tensor's data in blocks of this many bytes, counted
/// from the tensor's first byte (the last block may be shorter).
inline constexpr int64_t kSumBlock = 1024;

/// CRC-32C (Castagnoli) of `n` bytes, continuing from `crc` (0 to start);
/// SSE 4.2 where the CPU has it.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

/// One tensor of a safetensors file. Offsets are relative to the start of
/// the data (the byte after the header), as the format has them.
struct TensorEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;
  int64_t numel() const;
  /// Its checksums' index in the file's .sums (blocks of every earlier tensor first).
  int64_t first_sum = 0;
  int64_t num_sums() const { return (end - begin + kSumBlock - 1) / kSumBlock; }
};

/// A safetensors file's layout: tensors packed back to back in the given
/// order, the header padded with spaces so the data starts at a multiple of
/// 4096 bytes (O_DIRECT-friendly reads).
struct Layout {
  std::vector<TensorEntry> tensors;
  std::map<std::string, std::string> metadata;  // "__metadata__"
  int64_t data_start = 0;
  uint32_t header_crc = 0;  // crc32c of the file's first data_start bytes
  int64_t file_bytes() const { return data_start + (tensors.empty() ? 0 : tensors.back().end); }
  int64_t num_sums() const;
  const TensorEntry& at(const std::string& name, const std::string& file) const;
};

/// Lays out `tensors` (name, dtype, shape) and serialises the header: the
/// 8-byte little-endian length, then the JSON.
std::string make_header(Layout& layout);
/// Parses the header of the safetensors file `path` (already open as
/// `file`, `size` bytes). Throws IoError naming the file for a truncated or
/// malformed header.
Layout read_header(offload::AioEngine& aio, const std::shared_ptr<offload::AioFile>& file, const std::string& path,
                   int64_t size);

/// Safetensors' dtype names ("F32", "BF16", ...).
const char* dtype_name(at::ScalarType dtype);
at::ScalarType dtype_from_name(const std::string& name, const std::string& where);

/// Computes the block checksums of one tensor whose bytes arrive in order, in
/// pieces of any size.
class StreamSums {
 public:
  explicit StreamSums(std::vector<uint32_t>* out) : out_(out) {}
  void add(const void* data, int64_t n);
  void finish();

 private:
  std::vector<uint32_t>* out_;
  uint32_t crc_ = 0;
  int64_t in_block_ = 0;
};

/// Writes one safetensors file: the tensors of `layout`, each appended in
/// order in pieces of any size (tensors may interleave), its block checksums
/// computed on the way. The bytes are assembled in aligned 4 MiB blocks of
/// the file, each written through the AIO engine (O_DIRECT where the
/// filesystem allows it: no page cache, the disk's speed) as soon as it is
/// whole. The file is `path`.tmp until commit() flushes it and gives it its
/// name; destroyed before that, it removes the temporary file.
class TensorFileWriter {
 public:
  /// Throws IoError naming the file (cannot create it, no room for all of it).
  TensorFileWriter(std::string path, Layout layout, offload::AioEngine& aio);
  ~TensorFileWriter();
  TensorFileWriter(const TensorFileWriter&) = delete;
  TensorFileWriter& operator=(const TensorFileWriter&) = delete;

  /// The index of tensor `name` in the layout.
  size_t tensor(const std::string& name) const;
  /// The next elements of tensor i, in order (any device; the tensor's
  /// dtype). `src` may be reused once this returns.
  void append(size_t i, const at::Tensor& src);
  struct Committed {
    int64_t bytes = 0;
    uint32_t header_crc = 0;
    uint32_t sums_crc = 0;  // of the .sums file's bytes
  };
  /// Checks every tensor was written whole, flushes the file, renames it to
  /// its path and, unless `sums_path` is empty, writes the block checksums
  /// there (atomically). Throws IoError naming the file and errno.
  Committed commit(const std::string& sums_path);

 private:
  struct Block {
    offload::AlignedBuffer buf;
    int64_t filled = 0;
    offload::AioHandle io;
  };
  std::string tmp() const { return path_ + ".tmp"; }
  /// Copies n bytes for file offset `offset` into their blocks; writes the blocks it completes.
  void put(int64_t offset, const void* data, int64_t n);
  offload::AlignedBuffer take_buffer();

  std::string path_;
  Layout layout_;
  offload::AioEngine& aio_;
  std::shared_ptr<offload::AioFile> file_;
  std::vector<std::vector<uint32_t>> sums_;
  std::vector<StreamSums> streams_;
  std::vector<int64_t> written_;
  std::map<int64_t, Block> open_;  // block index -> partly filled block
  std::deque<Block> in_flight_;
  std::vector<offload::AlignedBuffer> free_;
  bool committed_ = false;
};

/// Writes `data` to `path` through a temporary file in the same folder,
/// flushed, then renamed over it, and flushes the folder: a reader sees the
/// old file or the new one. Throws IoError naming the file and errno.
void write_file_atomically(const std::string& path, const std::string& data);
/// Reads a small file whole. Throws IoError naming it.
std::string read_small_file(const std::string& path);
/// fsync() of a file or folder by path. Throws IoError naming it.
void sync_path(const std::string& path);
/// The size of `path`, or -1 when it does not exist.
int64_t file_size(const std::string& path);

// Folders, with POSIX calls: LibTorch exports its own build of some
// std::filesystem functions (remove_all among them), which the dynamic linker
// may bind our calls to, and which crash when it does.
/// Whether `path` exists (a file or a folder).
bool path_exists(const std::string& path);
/// Whether `path` itself (not a link's target) is a regular file.
bool is_regular_file(const std::string& path);
/// mkdir -p. Throws IoError naming the folder and errno.
void make_folders(const std::string& path);
/// rm -rf (nothing when it does not exist). Throws IoError naming what could
/// not be removed and errno.
void remove_tree(const std::string& path);
/// rename(2). Throws IoError naming both paths and errno.
void rename_path(const std::string& from, const std::string& to);
/// The names in a folder (without "." and ".."), sorted. Throws IoError.
std::vector<std::string> list_folder(const std::string& path);
/// Whether `path` is a folder (following links).
bool is_folder(const std::string& path);

/// Why `path`, an output file named by option `flag`, cannot be written
/// ("--json x/y.json: the folder x does not exist"), or "" when it can: its
/// folder exists and takes files, and the name is not a folder nor anything
/// but a regular file (a device such as /dev/full, a pipe). Checked before a
/// long run, not found out after it.
std::string output_file_problem(const std::string& flag, const std::string& path);
/// Why files cannot be saved in `dir` (option `flag`): a file, a folder
/// that cannot be made or written; "" when they can. Makes nothing: a run
/// that fails after the check leaves no empty folder behind.
std::string save_folder_problem(const std::string& flag, const std::string& dir);
/// save_folder_problem, and what a save into checkpoint folder `dir` would
/// replace that is not a save's: a `latest` that is not a plain file, a
/// global_stepN that is not a checkpoint's folder (holding other files).
std::string checkpoint_folder_problem(const std::string& flag, const std::string& dir);
/// Whether `path` is a real folder holding only what a save writes (rank
/// files, model.safetensors, their .sums, meta.json and temporary files): what a
/// save may replace or remove under a tag's names.
bool holds_only_a_saves_files(const std::string& path);
/// make_folders(dir), returning the outermost folder it made ("" when `dir`
/// was there), so that a job can remove what it made and left empty.
std::string make_folders_reporting(const std::string& dir);

/// What a resume from checkpoint folder `dir` (option `flag`) reads, for
/// NOTE [outputs and inputs]: its `latest` and the tag folder it names, or
/// the whole folder when that cannot be told yet (the resume then says why).
void add_resume_inputs(CommandFiles& files, const std::string& flag, const std::string& dir);

/// The writer lock of a checkpoint folder (NOTE [checkpoint commit]): an
/// exclusive flock(2) on DIR/.zero-lock, whose text names the holder (pid,
/// host, start time) for the message a second writer gets. The lock goes
/// with the process however it ends (the kernel drops it with the last
/// descriptor; the descriptor is closed across exec, though a child forked
/// without exec keeps it). A killed holder leaves the file, unlocked: the
/// next taker locks it. Not copyable.
class FolderLock {
 public:
  enum class State {
    kAcquired,     // `lock` holds it
    kHeld,         // another process holds it (`holder` names it)
    kHeldHere,     // this process holds it already, through another FolderLock
    kUnsupported,  // the file system has no flock (`holder`: its errno)
  };
  struct Attempt {
    State state = State::kHeld;
    std::unique_ptr<FolderLock> lock;
    std::string holder;
  };
  /// Takes `dir`'s lock without waiting. The file is removed by its holder
  /// as it lets go, while still holding it, so a file locked after its
  /// removal is never taken for the lock. Throws IoError when the lock file
  /// cannot be made or locked for a reason other than those of State.
  static Attempt try_acquire(const std::string& dir);
  ~FolderLock();
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;
  const std::string& dir() const { return dir_; }
  /// `made` (from make_folders_reporting) is removed with the folders under
  /// it down to dir() when the lock goes and they are empty.
  void remove_when_empty(std::string made) { made_ = std::move(made); }

 private:
  FolderLock(std::string dir, int fd) : dir_(std::move(dir)), fd_(fd) {}
  std::string dir_;
  int fd_ = -1;
  std::string made_;
};

/// Removes what interrupted saves left in `dir` (NOTE [checkpoint commit]):
/// hidden .TAG.incoming folders, a .TAG.old whose DIR/TAG is whole again,
/// temporary files of `latest`. Only under `dir`'s FolderLock (their writer
/// is then gone). Returns the names removed. Throws IoError.
std::vector<std::string> remove_interrupted_saves(const std::string& dir);

}  // namespace zero::ckpt
