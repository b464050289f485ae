// The addition task's GPT that the runtime tests train: 10 tokens, 6
// positions, no dropout (so that runs compare exactly). Width and heads
// are the test's; the defaults are the smallest the tests use.
#pragma once

#include <cstdint>

#include "model.h"

namespace zero::test {

inline mingpt::GPTConfig tiny_gpt_config(int64_t n_embd = 32, int64_t n_head = 2, int64_t n_layer = 2) {
  mingpt::GPTConfig c;
  c.vocab_size = 10;
  c.block_size = 6;
  c.n_layer = n_layer;
  c.n_head = n_head;
  c.n_embd = n_embd;
  c.embd_pdrop = c.resid_pdrop = c.attn_pdrop = 0.0;
  return c;
}

}  // namespace zero::test
