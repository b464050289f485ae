#include "token_data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <ATen/ATen.h>

#include "zero/core/error.h"

namespace llama {

TokenData::TokenData(const std::string& path, int bytes_per_token, int64_t block_size)
    : path_(path), bytes_(bytes_per_token), block_(block_size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw zero::IoError("open " + path + " (the token data): " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw zero::IoError(path + ": not a regular file (the token data)");
  }
  size_ = st.st_size;
  if (size_ % bytes_ != 0) {
    ::close(fd);
    throw zero::IoError(path + ": " + std::to_string(size_) + " bytes, not a whole number of " +
                        (bytes_ == 2 ? "uint16" : "uint32") + " tokens (--dtype?)");
  }
  tokens_ = size_ / bytes_;
  if (tokens_ < block_ + 2) {
    ::close(fd);
    throw zero::IoError(path + ": " + std::to_string(tokens_) + " tokens; --block_size " + std::to_string(block_) +
                        " needs at least " + std::to_string(block_ + 2));
  }
  map_ = ::mmap(nullptr, static_cast<size_t>(size_), PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw zero::IoError("mmap " + path + " (" + std::to_string(size_) + " bytes): " + std::strerror(err));
  }
}

TokenData::~TokenData() {
  if (map_ != nullptr) ::munmap(map_, static_cast<size_t>(size_));
}

at::Tensor TokenData::samples(int64_t first, int64_t count, int64_t vocab) const {
  at::Tensor out = at::empty({count, block_ + 1}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t starts = tokens_ - block_ - 1;  // window starts 0 .. starts
  for (int64_t i = 0; i < count; ++i) {
    const int64_t start = ((first + i) % (starts / block_ + 1)) * block_;
    for (int64_t t = 0; t <= block_; ++t) {
      const int64_t at = start + t;
      const int64_t id = bytes_ == 2 ? static_cast<const uint16_t*>(map_)[at] : static_cast<const uint32_t*>(map_)[at];
      if (id >= vocab)
        throw zero::IoError(path_ + ": token id " + std::to_string(id) + " at byte offset " + std::to_string(at * bytes_) +
                            " is not below the model's vocab_size " + std::to_string(vocab) + " (--dtype?)");
      *o++ = id;
    }
  }
  return out;
}

}  // namespace llama
