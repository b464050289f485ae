// A tiny Llama for the hardening rounds' process tests (round4_test.cpp,
// round5_test.cpp): its config.json, a DeepSpeed config, token data, the
// `llama train` command line over them, and one exported.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "tool_test_util.h"

namespace zero::test {

/// minGPT's smallest shape, as the hardening tests run it.
inline const std::string kTiny = " --n_layer 1 --n_embd 32 --n_head 2 --batch_size 16 ";
inline const std::string kLlamaConfig =
    R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": false})";
inline const std::string kDs =
    R"({"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}})";

/// DIR/tok.bin: 4096 uint16 token ids below 64.
inline std::string token_file(const TempDir& dir) {
  const std::string path = dir.file("tok.bin");
  std::ofstream out(path, std::ios::binary);
  for (int i = 0; i < 4096; ++i) {
    const uint16_t t = static_cast<uint16_t>((i * 7 + i / 5) % 64);
    out.write(reinterpret_cast<const char*>(&t), 2);
  }
  return path;
}

/// One step of `model` on DIR/tok.bin with DIR/ds.json, then `extra`.
inline std::string llama_train(const TempDir& dir, const std::string& model, const std::string& extra) {
  return kBin + "llama train --model " + model + " --config " + dir.file("ds.json") + " --data " + dir.file("tok.bin") +
         " --block_size 8 --steps 1 " + extra;
}

/// A tiny Llama in `dir`/model: its config.json and the weights of one
/// step from a fresh initialisation, as --save_hf writes them.
inline std::string make_llama(const TempDir& dir, int limit_s = 60) {
  ::mkdir(dir.file("cfg").c_str(), 0755);
  write(dir, "cfg/config.json", kLlamaConfig);
  write(dir, "ds.json", kDs);
  token_file(dir);
  const Outcome r = run(llama_train(dir, dir.file("cfg"), "--save_hf " + dir.file("model")), limit_s);
  EXPECT_EQ(r.code, 0) << r.out;
  return dir.file("model");
}

}  // namespace zero::test
