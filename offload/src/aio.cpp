// No LibTorch here: the engine works on raw memory (NOTE [aio engine]).
#include "zero/offload/aio.h"

#include <fcntl.h>
#include <liburing.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "zero/core/error.h"
#include "zero/core/log.h"
#include "zero/core/trace.h"

namespace zero::offload {
namespace {

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

bool aligned(int64_t x) { return x % kAioAlignment == 0; }

}  // namespace

// ---- files and buffers ------------------------------------------------------

namespace {
std::shared_ptr<AioFile> open_with(std::shared_ptr<AioFile> f, const std::string& path, int flags, unsigned mode,
                                   bool try_direct, int* buffered_fd, int* direct_fd) {
  *buffered_fd = ::open(path.c_str(), flags, static_cast<mode_t>(mode));
  if (*buffered_fd < 0) throw IoError("open " + path + ": " + errno_text(errno));
  if (try_direct) {
    *direct_fd = ::open(path.c_str(), (flags & ~(O_CREAT | O_TRUNC)) | O_DIRECT);
    if (*direct_fd < 0) {
      log::warning_once("aio.direct:" + path, "O_DIRECT is not supported for " + path + " (" + errno_text(errno) +
                                                  "); using buffered I/O for it, through the page cache");
    }
  }
  return f;
}
}  // namespace

std::shared_ptr<AioFile> AioFile::open(const std::string& path, bool create, bool try_direct, unsigned mode) {
  std::shared_ptr<AioFile> f(new AioFile());
  f->path_ = path;
  const int flags = O_RDWR | O_CLOEXEC | (create ? O_CREAT | O_TRUNC : 0);
  return open_with(f, path, flags, mode, try_direct, &f->buffered_fd_, &f->direct_fd_);
}

std::shared_ptr<AioFile> AioFile::open_read_only(const std::string& path, bool try_direct) {
  std::shared_ptr<AioFile> f(new AioFile());
  f->path_ = path;
  return open_with(f, path, O_RDONLY | O_CLOEXEC, 0, try_direct, &f->buffered_fd_, &f->direct_fd_);
}

void AioFile::reserve(int64_t bytes) {
  if (bytes <= 0) return;
  if (::fallocate(buffered_fd_, 0, 0, bytes) == 0) return;
  const int err = errno;
  if (err == EOPNOTSUPP || err == ENOSYS) return;
  throw IoError("reserve " + std::to_string(bytes) + " bytes for " + path_ + ": " + errno_text(err));
}

AioFile::~AioFile() {
  if (direct_fd_ >= 0) ::close(direct_fd_);
  if (buffered_fd_ >= 0) ::close(buffered_fd_);
}

AlignedBuffer::AlignedBuffer(int64_t bytes) {
  size_ = (std::max<int64_t>(bytes, 1) + kAioAlignment - 1) / kAioAlignment * kAioAlignment;
  data_ = std::aligned_alloc(kAioAlignment, static_cast<size_t>(size_));
  if (data_ == nullptr) throw OutOfMemoryError("aligned buffer of " + std::to_string(size_) + " bytes: allocation failed");
}
AlignedBuffer::~AlignedBuffer() { std::free(data_); }
AlignedBuffer::AlignedBuffer(AlignedBuffer&& o) noexcept : data_(o.data_), size_(o.size_) {
  o.data_ = nullptr;
  o.size_ = 0;
}
AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  std::swap(data_, o.data_);
  std::swap(size_, o.size_);
  return *this;
}

// ---- requests -----------------------------------------------------------------

struct AioHandle::State {
  std::mutex mu;
  int64_t trace_begin_us = -1;  // NOTE [trace]: set when the trace is on
  int64_t bytes = 0;
  bool write = false;
  std::condition_variable cv;
  int64_t remaining = 0;  // blocks not finished
  std::string error;      // the first failure
};

void AioHandle::wait() {
  if (!state_) return;
  const trace::Span span("wait", "wait for NVMe");
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->remaining == 0; });
  if (!state_->error.empty()) throw IoError(state_->error);
}

void wait_all(std::vector<AioHandle>& handles, double& seconds) {
  const auto t0 = std::chrono::steady_clock::now();
  std::exception_ptr first;
  for (auto& h : handles) {
    try {
      h.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  handles.clear();
  seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (first) std::rethrow_exception(first);
}

bool AioHandle::done() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->remaining == 0;
}

namespace {

struct Block {
  std::shared_ptr<AioFile> file;
  bool write = false;
  char* buf = nullptr;
  int64_t len = 0;
  int64_t offset = 0;
  std::shared_ptr<AioHandle::State> state;
  int fault = 0;  // injected errno

  int fd() const {
    const bool direct = file->direct() && aligned(reinterpret_cast<int64_t>(buf)) && aligned(offset) && aligned(len);
    return direct ? file->direct_fd() : file->buffered_fd();
  }
};

// Ends a block: its request learns the outcome. The block lets go of its
// file first, so a request whose wait() returns holds the file no more.
void finish(Block& b, const std::string& error) {
  b.file.reset();
  const std::shared_ptr<AioHandle::State> state = std::move(b.state);
  std::lock_guard<std::mutex> lock(state->mu);
  if (!error.empty() && state->error.empty()) state->error = error;
  if (--state->remaining == 0) {
    trace::async_done("nvme", state->write ? "NVMe write" : "NVMe read", state->trace_begin_us, state->bytes);
    state->cv.notify_all();
  }
}

std::string describe(const Block& b, const std::string& what) {
  return std::string(b.write ? "write" : "read") + " of " + std::to_string(b.len) + " bytes at offset " +
         std::to_string(b.offset) + " of " + b.file->path() + ": " + what;
}

// One worker: a ring and the blocks dealt to it.
class Worker {
 public:
  Worker(const AioOptions& o) : options_(o) {
    // The ring is made on the worker's own thread (see setup_ring).
    std::promise<int> ready;
    auto setup = ready.get_future();
    thread_ = std::thread([this, &ready] {
      const int rc = setup_ring();
      ready.set_value(rc);
      if (rc != 0) return;
      run();
      io_uring_queue_exit(&ring_);
    });
    const int rc = setup.get();
    if (rc < 0) {
      thread_.join();
      throw IoError("io_uring setup with queue depth " + std::to_string(o.queue_depth) + ": " + errno_text(-rc));
    }
  }
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void push(Block b) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back(std::move(b));
    }
    cv_.notify_all();
  }

 private:
  // Only this thread submits to and reaps from the ring, so the kernel may
  // defer completion work until the thread asks for completions, instead of
  // interrupting it for each one (SINGLE_ISSUER | DEFER_TASKRUN, as fio does;
  // on this project's virtual disk, writes went from 0.65-0.72 of fio's
  // throughput to 0.81).
  // Older kernels refuse the flags: then COOP_TASKRUN alone, then none.
  int setup_ring() {
    const unsigned depth = static_cast<unsigned>(options_.queue_depth);
    const unsigned tries[] = {IORING_SETUP_COOP_TASKRUN | IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
                              IORING_SETUP_COOP_TASKRUN, 0};
    int rc = -EINVAL;
    for (unsigned flags : tries) {
      rc = io_uring_queue_init(depth, &ring_, flags);
      if (rc != -EINVAL) break;
    }
    return rc;
  }

  void run() {
    std::vector<Block*> slots(static_cast<size_t>(options_.queue_depth), nullptr);
    std::vector<Block> flight(static_cast<size_t>(options_.queue_depth));
    int64_t in_flight = 0;
    for (;;) {
      // Fill the ring from the queue.
      int64_t queued = 0;
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (in_flight == 0) cv_.wait(lock, [&] { return stop_ || !pending_.empty(); });
        if (stop_ && pending_.empty() && in_flight == 0) return;
        while (in_flight < options_.queue_depth && !pending_.empty()) {
          size_t slot = 0;
          while (slots[slot] != nullptr) ++slot;
          flight[slot] = std::move(pending_.front());
          pending_.pop_front();
          Block& b = flight[slot];
          slots[slot] = &b;
          ++in_flight;
          if (b.fault != 0) {  // injected: completes at once with the error
            const int err = b.fault;
            lock.unlock();
            finish(b, describe(b, errno_text(err) + " [injected]"));
            b = Block{};
            lock.lock();
            slots[slot] = nullptr;
            --in_flight;
            continue;
          }
          io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
          if (b.write) io_uring_prep_write(sqe, b.fd(), b.buf, static_cast<unsigned>(b.len), static_cast<uint64_t>(b.offset));
          else io_uring_prep_read(sqe, b.fd(), b.buf, static_cast<unsigned>(b.len), static_cast<uint64_t>(b.offset));
          io_uring_sqe_set_data(sqe, reinterpret_cast<void*>(slot + 1));
          ++queued;
          if (options_.single_submit) io_uring_submit(&ring_);
        }
      }
      if (in_flight == 0) continue;
      // Reap: one at least (overlap_events), or all in flight. The batch is
      // submitted in the same system call that waits for the first.
      const int64_t want = options_.overlap_events ? 1 : in_flight;
      if (queued > 0 && !options_.single_submit) io_uring_submit_and_wait(&ring_, 1);
      for (int64_t got = 0; got < want;) {
        io_uring_cqe* cqe = nullptr;
        const int rc = io_uring_wait_cqe(&ring_, &cqe);
        if (rc == -EINTR) continue;
        if (rc < 0) {  // the ring itself failed: every block in it fails
          for (size_t s = 0; s < slots.size(); ++s) {
            if (slots[s] == nullptr) continue;
            finish(flight[s], describe(flight[s], "waiting for io_uring: " + errno_text(-rc)));
            flight[s] = Block{};
            slots[s] = nullptr;
          }
          in_flight = 0;
          break;
        }
        do {
          const size_t slot = reinterpret_cast<size_t>(io_uring_cqe_get_data(cqe)) - 1;
          const int res = cqe->res;
          io_uring_cqe_seen(&ring_, cqe);
          ++got;
          Block& b = flight[slot];
          slots[slot] = nullptr;
          --in_flight;
          complete(b, res);
          // Drop the block's hold on its file and request at once: a file
          // kept open by a finished block is closed later, in the middle of
          // other I/O, and closing an unlinked file frees its extents then
          // (this cost later writes 25% of their throughput).
          b = Block{};
        } while (io_uring_peek_cqe(&ring_, &cqe) == 0);
      }
    }
  }

  void complete(Block& b, int res) {
    if (res == -EINTR || res == -EAGAIN) return push(std::move(b));  // again, as it was
    if (res < 0) return finish(b, describe(b, errno_text(-res)));
    if (res == 0) {
      return finish(b, describe(b, b.write ? "the device accepted no bytes" : "unexpected end of file"));
    }
    if (res < b.len) {  // short: the rest goes again (buffered if no longer aligned)
      Block rest = std::move(b);
      rest.buf += res;
      rest.offset += res;
      rest.len -= res;
      return push(std::move(rest));
    }
    finish(b, "");
  }

  AioOptions options_;
  io_uring ring_{};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Block> pending_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

struct AioEngine::Impl {
  std::vector<std::unique_ptr<Worker>> workers;
  std::atomic<size_t> next{0};
  std::mutex fault_mu;
  int write_fault = 0, read_fault = 0;
  std::vector<AioHandle> issued;  // waited for on destruction
  std::mutex issued_mu;
};

AioEngine::AioEngine(AioOptions options) : options_(options), impl_(std::make_unique<Impl>()) {
  auto bad = [](const std::string& key, int64_t v, const std::string& expected) {
    throw ConfigError({"aio." + key + ": expected " + expected + "; got " + std::to_string(v)});
  };
  if (options_.block_size < 1 || options_.block_size % kAioAlignment != 0)
    bad("block_size", options_.block_size, "a positive multiple of " + std::to_string(kAioAlignment) + " bytes");
  if (options_.queue_depth < 1 || options_.queue_depth > 4096) bad("queue_depth", options_.queue_depth, "1 to 4096");
  if (options_.threads < 1 || options_.threads > 256) bad("intra_op_parallelism", options_.threads, "1 to 256");
  for (int64_t i = 0; i < options_.threads; ++i) impl_->workers.push_back(std::make_unique<Worker>(options_));
}

AioEngine::~AioEngine() {
  std::vector<AioHandle> issued;
  {
    std::lock_guard<std::mutex> lock(impl_->issued_mu);
    issued.swap(impl_->issued);
  }
  for (auto& h : issued) {
    try {
      h.wait();
    } catch (const std::exception&) {
      // the request's owner sees the error through its own handle
    }
  }
}

void AioEngine::inject_fault(bool on_write, int err) {
  std::lock_guard<std::mutex> lock(impl_->fault_mu);
  (on_write ? impl_->write_fault : impl_->read_fault) = err;
}

AioHandle AioEngine::submit(const std::shared_ptr<AioFile>& file, void* buf, int64_t len, int64_t offset,
                            bool write) {
  ZERO_CHECK(file != nullptr, "aio: no file");
  ZERO_CHECK(len >= 0 && offset >= 0, "aio: negative length or offset");
  ZERO_CHECK(buf != nullptr || len == 0, "aio: no buffer");
  auto state = std::make_shared<AioHandle::State>();
  if (trace::on()) state->trace_begin_us = trace::detail::now_us();
  state->bytes = len;
  state->write = write;
  std::vector<Block> blocks;
  char* base = static_cast<char*>(buf);
  for (int64_t pos = 0; pos < len;) {
    int64_t n = std::min(options_.block_size, len - pos);
    // The last block's unaligned tail goes by itself, so the rest can go direct.
    if (pos + n == len && n > kAioAlignment && !aligned(n)) n = n / kAioAlignment * kAioAlignment;
    blocks.push_back(Block{file, write, base + pos, n, offset + pos, state, 0});
    pos += n;
  }
  state->remaining = static_cast<int64_t>(blocks.size());
  AioHandle handle(state);
  if (blocks.empty()) return handle;
  {
    std::lock_guard<std::mutex> lock(impl_->fault_mu);
    int& fault = write ? impl_->write_fault : impl_->read_fault;
    blocks.front().fault = fault;
    fault = 0;
  }
  {
    std::lock_guard<std::mutex> lock(impl_->issued_mu);
    std::erase_if(impl_->issued, [](const AioHandle& h) { return h.done(); });
    impl_->issued.push_back(handle);
  }
  for (auto& b : blocks) impl_->workers[impl_->next++ % impl_->workers.size()]->push(std::move(b));
  return handle;
}

AioHandle AioEngine::write(const std::shared_ptr<AioFile>& file, const void* buf, int64_t len, int64_t offset) {
  return submit(file, const_cast<void*>(buf), len, offset, true);
}

AioHandle AioEngine::read(const std::shared_ptr<AioFile>& file, void* buf, int64_t len, int64_t offset) {
  return submit(file, buf, len, offset, false);
}

}  // namespace zero::offload
