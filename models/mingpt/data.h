// Training tasks for minGPT that need no download.
//  - addition (default): a + b = c over ndigit-digit numbers, as in minGPT's
//    adder demo; tokens are digits, the answer is written reversed, and only
//    the answer's digits are trained on. Held-out metric: exact-match accuracy
//    of greedy decoding on a fixed test split.
//  - text (--data FILE): character-level language modelling on any text file;
//    the last 10% is held out. Held-out metric: next-character accuracy.
//  - random (--vocab_size V): uniformly random tokens of a vocabulary of V,
//    for throughput and memory at any model shape (nothing to learn).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include "model.h"

namespace mingpt {

struct Batch {
  torch::Tensor x;  // [B, T] int64
  torch::Tensor y;  // [B, T] int64, -1 where there is no target
};

class Task {
 public:
  virtual ~Task() = default;
  virtual std::string name() const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t block_size() const = 0;
  virtual int64_t train_size() const = 0;
  /// Samples `indices` of the training set.
  virtual Batch train_batch(const std::vector<int64_t>& indices) const = 0;
  /// Held-out accuracy in [0, 1]; runs the model in eval mode without grad.
  virtual double evaluate(GPT& model, torch::Device device, int64_t batch_size) const = 0;
};

std::unique_ptr<Task> make_addition_task(int64_t ndigit);
/// Throws std::runtime_error naming the path when it cannot be read or is too short.
std::unique_ptr<Task> make_text_task(const std::string& path, int64_t block_size);

/// `train_size` samples of `block_size` random tokens in [0, vocab_size).
std::unique_ptr<Task> make_random_task(int64_t vocab_size, int64_t block_size, int64_t train_size);

/// The order of the training set in `epoch`: a permutation drawn from `seed`
/// and the epoch alone, so every rank and every world size agrees.
std::vector<int64_t> epoch_order(int64_t n, uint64_t seed, int64_t epoch);

/// The samples of one micro-batch: global batch `step` of size
/// micro_batch * grad_accum * world_size, micro-step `micro`, rank `rank`.
/// A run on N ranks sees exactly the samples of a run on one rank with the
/// same global batch.
std::vector<int64_t> micro_batch_indices(const std::vector<int64_t>& order, int64_t step,
                                         int64_t micro, int64_t rank, int64_t micro_batch,
                                         int64_t grad_accum, int64_t world_size);

}  // namespace mingpt
