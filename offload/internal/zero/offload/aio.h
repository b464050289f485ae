// The asynchronous I/O engine for NVMe offload: io_uring through liburing.
//
// NOTE [aio engine]
// A request (read or write of `len` bytes at a file offset) is split into
// blocks of `block_size` bytes, dealt round-robin to `threads` workers, each
// with its own ring of `queue_depth` entries. A worker keeps its ring full
// (overlap_events: it reaps completions as they come and refills at once) or
// submits a batch and waits for all of it (overlap_events false);
// single_submit submits each entry by itself instead of a batch per call.
// These are DeepSpeed's aio knobs with DeepSpeed's meaning.
//
// Files are opened twice: with O_DIRECT (bypassing the page cache) and
// without. A block goes through the direct descriptor when its buffer, offset
// and length are multiples of kAioAlignment, otherwise (the unaligned tail of
// a request, say) through the buffered one, so any size round-trips exactly.
// Where O_DIRECT is refused (some filesystems), the file is buffered only and
// a warning names the path once. Short reads and writes are resubmitted for
// the rest; a read that meets the end of the file, or any error, fails the
// request: wait() throws zero::IoError naming the file, the offset and length
// of the block and the errno.
//
// Buffers and files are not registered with the rings (io_uring's fixed
// buffers and files): measured on this project's disk, neither made transfers
// faster (benchmarks/RESULTS.md), and registration pins memory against
// RLIMIT_MEMLOCK. A worker drops each finished block's reference to its file
// at once, so closing a file (and freeing an unlinked one) happens when its
// owner lets go, never in the middle of later I/O.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace zero::offload {

/// O_DIRECT's alignment for buffers, offsets and lengths.
inline constexpr int64_t kAioAlignment = 4096;

/// `bytes` rounded up to kAioAlignment.
inline int64_t aio_aligned(int64_t bytes) { return (bytes + kAioAlignment - 1) / kAioAlignment * kAioAlignment; }

struct AioOptions {
  int64_t block_size = 1 << 20;  // aio.block_size
  int64_t queue_depth = 8;       // aio.queue_depth
  int64_t threads = 1;           // aio.intra_op_parallelism (thread_count)
  bool single_submit = false;    // aio.single_submit
  bool overlap_events = true;    // aio.overlap_events
};

/// A file for the engine. Thread-safe to share between requests.
class AioFile {
 public:
  /// Opens (with `create`, creates or truncates) `path` for reading and
  /// writing. Throws zero::IoError naming the path and errno.
  /// Created files get `mode` (less the umask): 0600 for swap files (the
  /// default), 0644 for checkpoints.
  static std::shared_ptr<AioFile> open(const std::string& path, bool create, bool try_direct = true,
                                       unsigned mode = 0600);
  /// Opens an existing `path` for reading only (a checkpoint on a read-only
  /// mount). Throws zero::IoError naming the path and errno.
  static std::shared_ptr<AioFile> open_read_only(const std::string& path, bool try_direct = true);
  ~AioFile();
  AioFile(const AioFile&) = delete;
  AioFile& operator=(const AioFile&) = delete;

  const std::string& path() const { return path_; }
  /// Allocates the file's first `bytes` on disk now (fallocate), as swap
  /// files are sized up front: writes then fill allocated blocks instead of
  /// growing the file, and a full disk fails here, before training. Throws
  /// zero::IoError naming the path, size and errno (ENOSPC: the disk is full);
  /// filesystems without fallocate are left to grow as written.
  void reserve(int64_t bytes);
  /// False when the filesystem refused O_DIRECT (all I/O buffered).
  bool direct() const { return direct_fd_ >= 0; }
  int direct_fd() const { return direct_fd_; }
  int buffered_fd() const { return buffered_fd_; }

 private:
  AioFile() = default;
  std::string path_;
  int direct_fd_ = -1;
  int buffered_fd_ = -1;
};

/// Memory aligned for O_DIRECT, rounded up to kAioAlignment.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(int64_t bytes);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& o) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
  void* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  int64_t size_ = 0;
};

class AioEngine;

/// A request in flight. wait() blocks until every block is done and throws
/// zero::IoError if one failed. Copyable (all copies see the same request).
class AioHandle {
 public:
  AioHandle() = default;
  void wait();
  bool done() const;
  struct State;

 private:
  friend class AioEngine;
  explicit AioHandle(std::shared_ptr<State> s) : state_(std::move(s)) {}
  std::shared_ptr<State> state_;
};

/// Waits for every handle, adding the time waited to `seconds`; the first
/// error is rethrown after all have finished (no transfer outlives its
/// buffer). Clears `handles`.
void wait_all(std::vector<AioHandle>& handles, double& seconds);

class AioEngine {
 public:
  /// Starts the workers and their rings. Throws zero::IoError when io_uring
  /// cannot be set up (naming errno), zero::ConfigError on bad options.
  explicit AioEngine(AioOptions options);
  /// Waits for every request in flight, then stops the workers.
  ~AioEngine();
  AioEngine(const AioEngine&) = delete;
  AioEngine& operator=(const AioEngine&) = delete;

  AioHandle write(const std::shared_ptr<AioFile>& file, const void* buf, int64_t len, int64_t offset);
  AioHandle read(const std::shared_ptr<AioFile>& file, void* buf, int64_t len, int64_t offset);

  const AioOptions& options() const { return options_; }

  /// Test seam: the next block of a write (or read) fails with `err` instead
  /// of reaching the file.
  void inject_fault(bool on_write, int err);

  struct Impl;

 private:
  AioHandle submit(const std::shared_ptr<AioFile>& file, void* buf, int64_t len, int64_t offset, bool write);

  AioOptions options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zero::offload
