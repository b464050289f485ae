#include "token_data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>

#include "zero/core/command_files.h"
#include "zero/core/error.h"

namespace llama {

namespace {
std::string err_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }
int64_t mtime_ns(const struct stat& st) { return int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec; }
}  // namespace

TokenData::TokenData(const std::string& path, int bytes_per_token, int64_t block_size)
    : path_(path), bytes_(bytes_per_token), block_(block_size) {
  if (const std::string problem = zero::input_file_problem("--data", path); !problem.empty())
    throw zero::IoError(problem + " (the token data)");
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) {
    const int err = errno;
    throw zero::IoError("open " + path + " (the token data): " + err_text(err));
  }
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    throw zero::IoError(path + ": not a regular file (the token data)");
  }
  size_ = st.st_size;
  mtime_ns_ = mtime_ns(st);
  ino_ = st.st_ino;
  if (size_ % bytes_ != 0) {
    ::close(fd_);
    throw zero::IoError(path + ": " + std::to_string(size_) + " bytes, not a whole number of " +
                        (bytes_ == 2 ? "uint16" : "uint32") + " tokens (--dtype?)");
  }
  tokens_ = size_ / bytes_;
  if (tokens_ < block_ + 2) {
    ::close(fd_);
    throw zero::IoError(path + ": " + std::to_string(tokens_) + " tokens; --block_size " + std::to_string(block_) +
                        " needs at least " + std::to_string(block_ + 2));
  }
}

TokenData::~TokenData() {
  if (fd_ >= 0) ::close(fd_);
}

void TokenData::check_unchanged() const {
  struct stat now {}, named {};
  if (::fstat(fd_, &now) != 0) {
    const int err = errno;
    throw zero::IoError("fstat " + path_ + " (the token data): " + err_text(err));
  }
  std::string what;
  if (now.st_size != size_)
    what = (now.st_size < size_ ? "shortened from " : "grown from ") + std::to_string(size_) + " to " +
           std::to_string(now.st_size) + " bytes";
  else if (mtime_ns(now) != mtime_ns_)
    what = "rewritten (its modification time changed)";
  else if (::stat(path_.c_str(), &named) != 0 || named.st_ino != ino_)
    what = "replaced or removed (the name no longer leads to the file the run opened)";
  if (!what.empty())
    throw zero::IoError(path_ + " (the token data, --data): the file changed under the run: " + what +
                        "; the run cannot go on with the data it started with, so it ends here. Give a run its own "
                        "copy of the data, or let the writer finish before the run starts");
}

at::Tensor TokenData::samples(int64_t first, int64_t count, int64_t vocab) const {
  check_unchanged();
  at::Tensor out = at::empty({count, block_ + 1}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t starts = tokens_ - block_ - 1;  // window starts 0 .. starts
  std::vector<unsigned char> window(static_cast<size_t>((block_ + 1) * bytes_));
  for (int64_t i = 0; i < count; ++i) {
    const int64_t start = ((first + i) % (starts / block_ + 1)) * block_;
    const int64_t offset = start * bytes_;
    size_t done = 0;
    while (done < window.size()) {
      const ssize_t n = ::pread(fd_, window.data() + done, window.size() - done, static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const int err = errno;
        throw zero::IoError("read " + path_ + " (the token data) at offset " + std::to_string(offset + done) + ", " +
                            std::to_string(window.size() - done) + " bytes: " + err_text(err));
      }
      if (n == 0) {
        check_unchanged();  // names what changed
        throw zero::IoError("read " + path_ + " (the token data) at offset " + std::to_string(offset + done) +
                            ": the file ends there, before the " + std::to_string(size_) + " bytes it had");
      }
      done += static_cast<size_t>(n);
    }
    for (int64_t t = 0; t <= block_; ++t) {
      int64_t id = 0;
      if (bytes_ == 2) {
        uint16_t v;
        std::memcpy(&v, window.data() + t * 2, 2);
        id = v;
      } else {
        uint32_t v;
        std::memcpy(&v, window.data() + t * 4, 4);
        id = v;
      }
      if (id >= vocab)
        throw zero::IoError(path_ + ": token id " + std::to_string(id) + " at byte offset " +
                            std::to_string(offset + t * bytes_) + " is not below the model's vocab_size " +
                            std::to_string(vocab) + " (--dtype?)");
      *o++ = id;
    }
  }
  return out;
}

}  // namespace llama
