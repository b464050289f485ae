#include "data.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <sstream>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>

namespace mingpt {
namespace {

class AdditionTask final : public Task {
 public:
  explicit AdditionTask(int64_t ndigit) : ndigit_(ndigit) {
    int64_t limit = 1;
    for (int64_t i = 0; i < ndigit; ++i) limit *= 10;
    const int64_t n = limit * limit;
    // A fixed split, independent of the training seed, so accuracy figures compare.
    auto perm = epoch_order(n, /*seed=*/1337, /*epoch=*/0);
    const int64_t n_test = std::min<int64_t>(n / 5, 500);
    test_.assign(perm.begin(), perm.begin() + n_test);
    train_.assign(perm.begin() + n_test, perm.end());
    limit_ = limit;
  }
  std::string name() const override { return std::to_string(ndigit_) + "-digit addition"; }
  int64_t vocab_size() const override { return 10; }
  int64_t block_size() const override { return 3 * ndigit_; }  // a, b, c(ndigit+1) minus 1
  int64_t train_size() const override { return static_cast<int64_t>(train_.size()); }

  Batch train_batch(const std::vector<int64_t>& indices) const override {
    const int64_t B = static_cast<int64_t>(indices.size()), T = block_size();
    auto x = torch::empty({B, T}, torch::kLong);
    auto y = torch::empty({B, T}, torch::kLong);
    auto xa = x.accessor<int64_t, 2>();
    auto ya = y.accessor<int64_t, 2>();
    for (int64_t i = 0; i < B; ++i) {
      auto seq = encode(train_[indices[i]]);
      for (int64_t t = 0; t < T; ++t) {
        xa[i][t] = seq[t];
        ya[i][t] = t < 2 * ndigit_ - 1 ? -1 : seq[t + 1];  // train on the answer only
      }
    }
    return {x, y};
  }

  double evaluate(GPT& model, torch::Device device, int64_t batch_size) const override {
    torch::NoGradGuard no_grad;
    const bool was_training = model->is_training();
    model->eval();
    int64_t correct = 0;
    const int64_t n = static_cast<int64_t>(test_.size());
    for (int64_t start = 0; start < n; start += batch_size) {
      const int64_t B = std::min(batch_size, n - start);
      auto ctx = torch::empty({B, 2 * ndigit_}, torch::kLong);
      auto ca = ctx.accessor<int64_t, 2>();
      for (int64_t i = 0; i < B; ++i) {
        auto seq = encode(test_[start + i]);
        for (int64_t t = 0; t < 2 * ndigit_; ++t) ca[i][t] = seq[t];
      }
      auto idx = ctx.to(device);
      for (int64_t k = 0; k < ndigit_ + 1; ++k) {  // greedy decoding of the answer
        auto logits = model->forward(idx).select(1, idx.size(1) - 1);
        idx = torch::cat({idx, logits.argmax(-1, /*keepdim=*/true)}, 1);
      }
      auto out = idx.to(torch::kCPU);
      auto oa = out.accessor<int64_t, 2>();
      for (int64_t i = 0; i < B; ++i) {
        const int64_t pair = test_[start + i];
        const int64_t expected = pair / limit_ + pair % limit_;
        int64_t got = 0, place = 1;
        for (int64_t k = 0; k < ndigit_ + 1; ++k, place *= 10) got += oa[i][2 * ndigit_ + k] * place;
        correct += got == expected;
      }
    }
    if (was_training) model->train();
    return static_cast<double>(correct) / static_cast<double>(n);
  }

 private:
  // Digits of a, of b, then of c = a + b reversed (ndigit + 1 of them).
  std::vector<int64_t> encode(int64_t pair) const {
    const int64_t a = pair / limit_, b = pair % limit_, c = a + b;
    std::vector<int64_t> seq;
    auto digits = [&](int64_t v, int64_t width, bool reversed) {
      std::vector<int64_t> d(width);
      for (int64_t i = width - 1; i >= 0; --i, v /= 10) d[i] = v % 10;
      if (reversed) std::reverse(d.begin(), d.end());
      seq.insert(seq.end(), d.begin(), d.end());
    };
    digits(a, ndigit_, false);
    digits(b, ndigit_, false);
    digits(c, ndigit_ + 1, true);
    return seq;
  }

  int64_t ndigit_;
  int64_t limit_ = 1;
  std::vector<int64_t> train_, test_;
};

// A next-token batch of `rows` sequences: x[i][t] = token(i, t) and
// y[i][t] = token(i, t + 1) for t < T.
template <class Token>
Batch next_token_batch(int64_t rows, int64_t T, Token token) {
  auto x = torch::empty({rows, T}, torch::kLong);
  auto y = torch::empty({rows, T}, torch::kLong);
  auto xa = x.accessor<int64_t, 2>();
  auto ya = y.accessor<int64_t, 2>();
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t t = 0; t < T; ++t) {
      xa[i][t] = token(i, t);
      ya[i][t] = token(i, t + 1);
    }
  }
  return {x, y};
}

// Greedy next-token accuracy of the model over `items`, batch_size at a
// time, `make` turning a chunk of them into a batch; in eval mode, no grad.
double next_token_accuracy(GPT& model, torch::Device device, int64_t batch_size, const std::vector<int64_t>& items,
                           const std::function<Batch(const std::vector<int64_t>&)>& make) {
  torch::NoGradGuard no_grad;
  const bool was_training = model->is_training();
  model->eval();
  int64_t correct = 0, total = 0;
  for (size_t s = 0; s < items.size(); s += static_cast<size_t>(batch_size)) {
    const std::vector<int64_t> chunk(items.begin() + static_cast<std::ptrdiff_t>(s),
                                     items.begin() + static_cast<std::ptrdiff_t>(std::min(items.size(), s + batch_size)));
    auto b = make(chunk);
    auto pred = model->forward(b.x.to(device)).argmax(-1).to(torch::kCPU);
    correct += pred.eq(b.y).sum().item<int64_t>();
    total += b.y.numel();
  }
  if (was_training) model->train();
  return total ? static_cast<double>(correct) / static_cast<double>(total) : 0.0;
}

class TextTask final : public Task {
 public:
  TextTask(const std::string& path, int64_t block_size) : path_(path), block_size_(block_size) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0)
      throw std::runtime_error("--data " + path + ": cannot open the file: " + std::strerror(errno));
    if (!S_ISREG(st.st_mode))
      throw std::runtime_error("--data " + path + ": expected a regular text file; got " +
                               (S_ISDIR(st.st_mode) ? "a directory" : "a device, pipe or socket"));
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("--data " + path + ": cannot open the file for reading: " + std::strerror(errno));
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    std::map<unsigned char, int64_t> vocab;
    for (unsigned char ch : text) vocab.emplace(ch, 0);
    int64_t id = 0;
    for (auto& [ch, v] : vocab) v = id++;
    vocab_size_ = static_cast<int64_t>(vocab.size());
    ids_.reserve(text.size());
    for (unsigned char ch : text) ids_.push_back(vocab[ch]);
    n_train_ = static_cast<int64_t>(ids_.size() * 9 / 10);
    if (n_train_ - block_size_ - 1 < 1 || static_cast<int64_t>(ids_.size()) - n_train_ < block_size_ + 1) {
      throw std::runtime_error("--data " + path + ": " + std::to_string(ids_.size()) +
                               " characters is too short for block_size " +
                               std::to_string(block_size_) + " (need at least " +
                               std::to_string(10 * (block_size_ + 2)) + ")");
    }
  }
  std::string name() const override { return "character-level text from " + path_; }
  int64_t vocab_size() const override { return vocab_size_; }
  int64_t block_size() const override { return block_size_; }
  int64_t train_size() const override { return n_train_ - block_size_ - 1; }

  Batch train_batch(const std::vector<int64_t>& indices) const override {
    return windows(indices, 0);
  }

  double evaluate(GPT& model, torch::Device device, int64_t batch_size) const override {
    const int64_t n_eval = static_cast<int64_t>(ids_.size()) - n_train_ - block_size_ - 1;
    // At most 64 windows spread over the held-out text.
    const int64_t count = std::min<int64_t>(64, n_eval + 1);
    std::vector<int64_t> starts;
    for (int64_t i = 0; i < count; ++i) starts.push_back(i * std::max<int64_t>(1, n_eval / count));
    return next_token_accuracy(model, device, batch_size, starts,
                               [&](const std::vector<int64_t>& chunk) { return windows(chunk, n_train_); });
  }

 private:
  Batch windows(const std::vector<int64_t>& starts, int64_t base) const {
    return next_token_batch(static_cast<int64_t>(starts.size()), block_size_,
                            [&](int64_t i, int64_t t) { return ids_[base + starts[i] + t]; });
  }

  std::string path_;
  int64_t block_size_;
  int64_t vocab_size_ = 0;
  int64_t n_train_ = 0;
  std::vector<int64_t> ids_;
};

// Uniformly random tokens, the same for every rank and run (a counter-based
// hash of sample and position): a workload of any vocabulary and context for
// throughput and memory (zero tune, the max-parameter search), with nothing
// to learn, so its held-out accuracy stays near 1 / vocab_size.
class RandomTask final : public Task {
 public:
  RandomTask(int64_t vocab_size, int64_t block_size, int64_t train_size)
      : vocab_size_(vocab_size), block_size_(block_size), train_size_(train_size) {}
  std::string name() const override {
    return "random tokens (vocabulary " + std::to_string(vocab_size_) + ", context " + std::to_string(block_size_) + ")";
  }
  int64_t vocab_size() const override { return vocab_size_; }
  int64_t block_size() const override { return block_size_; }
  int64_t train_size() const override { return train_size_; }
  Batch train_batch(const std::vector<int64_t>& indices) const override { return sequences(indices, 0); }

  double evaluate(GPT& model, torch::Device device, int64_t batch_size) const override {
    std::vector<int64_t> held_out(64);  // the 64 samples past the training set
    std::iota(held_out.begin(), held_out.end(), 0);
    return next_token_accuracy(model, device, batch_size, held_out,
                               [&](const std::vector<int64_t>& chunk) { return sequences(chunk, train_size_); });
  }

 private:
  static uint64_t mix(uint64_t z) {  // splitmix64's finaliser
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  Batch sequences(const std::vector<int64_t>& indices, int64_t base) const {
    const uint64_t T = static_cast<uint64_t>(block_size_);
    return next_token_batch(static_cast<int64_t>(indices.size()), block_size_, [&](int64_t i, int64_t t) {
      const uint64_t sample = static_cast<uint64_t>(base + indices[i]) * (T + 1);
      return static_cast<int64_t>(mix(sample + static_cast<uint64_t>(t) + 0x9e3779b97f4a7c15ULL) %
                                  static_cast<uint64_t>(vocab_size_));
    });
  }

  int64_t vocab_size_, block_size_, train_size_;
};

}  // namespace

std::unique_ptr<Task> make_addition_task(int64_t ndigit) {
  return std::make_unique<AdditionTask>(ndigit);
}

std::unique_ptr<Task> make_text_task(const std::string& path, int64_t block_size) {
  return std::make_unique<TextTask>(path, block_size);
}

std::unique_ptr<Task> make_random_task(int64_t vocab_size, int64_t block_size, int64_t train_size) {
  if (vocab_size < 2 || block_size < 1 || train_size < 1)
    throw std::runtime_error("random tokens: expected vocab_size >= 2, block_size >= 1, train_size >= 1");
  return std::make_unique<RandomTask>(vocab_size, block_size, train_size);
}

std::vector<int64_t> epoch_order(int64_t n, uint64_t seed, int64_t epoch) {
  auto gen = at::detail::createCPUGenerator(seed * 1000003ULL + static_cast<uint64_t>(epoch));
  auto perm = torch::randperm(n, gen, torch::kLong);
  auto* p = perm.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + n);
}

std::vector<int64_t> micro_batch_indices(const std::vector<int64_t>& order, int64_t step,
                                         int64_t micro, int64_t rank, int64_t micro_batch,
                                         int64_t grad_accum, int64_t world_size) {
  const int64_t global = micro_batch * grad_accum * world_size;
  const int64_t begin = step * global + micro * micro_batch * world_size + rank * micro_batch;
  std::vector<int64_t> out;
  out.reserve(micro_batch);
  for (int64_t i = 0; i < micro_batch; ++i) out.push_back(order[(begin + i) % order.size()]);
  return out;
}

}  // namespace mingpt
