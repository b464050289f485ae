// Training data as nanoGPT and Megatron write it: a flat file of token ids
// (uint16 or uint32, little-endian), read a window at a time, never whole.
// Not mapped: a file shortened under a mapping ends the process with SIGBUS
// and no word; read, a file that changes under the run ends it with an
// error naming the file.
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

namespace llama {

class TokenData {
 public:
  /// Opens `path`. `bytes_per_token` 2 (uint16) or 4 (uint32). Throws
  /// zero::IoError naming the file: missing, not a whole number of tokens,
  /// fewer than `block_size` + 1 tokens.
  TokenData(const std::string& path, int bytes_per_token, int64_t block_size);
  ~TokenData();
  TokenData(const TokenData&) = delete;
  TokenData& operator=(const TokenData&) = delete;

  int64_t tokens() const { return tokens_; }
  /// Samples [first, first + count) of the endless sequence of windows:
  /// sample j is tokens [o, o + block_size + 1) with o = j * block_size
  /// modulo the last start that fits. Returns int64 [count, block_size + 1].
  /// Throws zero::IoError naming the file and offset of a token id >= `vocab`,
  /// and naming the file and what changed when it is not the file it was
  /// when opened (shortened, grown, rewritten, replaced).
  at::Tensor samples(int64_t first, int64_t count, int64_t vocab) const;

 private:
  void check_unchanged() const;

  std::string path_;
  int bytes_;
  int64_t block_, tokens_ = 0, size_ = 0;
  int fd_ = -1;
  int64_t mtime_ns_ = 0;
  unsigned long long ino_ = 0;
};

}  // namespace llama
