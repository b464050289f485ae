// What the models tests share (llama_test.cpp, lora_test.cpp): the
// programs' folder, make_llama.py (transformers' side), a shell command,
// a safetensors tensor, a token file.
#pragma once

#include <sys/wait.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include <ATen/core/Tensor.h>

#include "zero/snapshots/checkpoint_io.h"

namespace zero::test {

inline const std::string kBin = std::string(ZERO_BINARY_DIR) + "/bin/";

// make_llama.py's command line; torch (under transformers) keeps a compile
// cache in TMPDIR unless told where: `dir`.
inline std::string py(const std::string& dir) {
  return "env TORCHINDUCTOR_CACHE_DIR=" + dir + "/inductor python3 " + std::string(ZERO_SOURCE_DIR) +
         "/tests/models/make_llama.py ";
}

// `cmd`'s exit status, its output in `log`.
inline int sh(const std::string& cmd, const std::string& log) {
  const int status = std::system((cmd + " > " + log + " 2>&1").c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

// Tensor `name` of a safetensors file (or a weights folder).
inline at::Tensor read(const std::string& file, const std::string& name) {
  zero::ckpt::SavedLayout layout;
  auto reader = zero::ckpt::PieceReader::weights(zero::ckpt::WeightFiles::resolve(file), {}, &layout, nullptr, {});
  return reader->read_tensor(file, name);
}

// A flat file of `count` uint16 token ids, (i * mul + i / div) % vocab.
inline void write_tokens(const std::string& path, int count, int mul, int div, int vocab) {
  std::ofstream out(path, std::ios::binary);
  for (int i = 0; i < count; ++i) {
    const uint16_t t = static_cast<uint16_t>((i * mul + i / div) % vocab);
    out.write(reinterpret_cast<const char*>(&t), 2);
  }
}

}  // namespace zero::test
