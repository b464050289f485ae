// The model and data of the DeepSpeed interoperability tests, written the
// same way in ds_train.py: two Linear layers around a LayerNorm, a buffer,
// and batches made by formula (the same float kernels in both), so that
// LibTorch and PyTorch compute the same numbers.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

namespace zero::testing {

struct TinyNetImpl : torch::nn::Module {
  static constexpr int64_t kIn = 5, kHidden = 9, kOut = 3;
  TinyNetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(kIn, kHidden))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})))),
        fc2(register_module("fc2", torch::nn::Linear(kHidden, kOut))) {
    register_buffer("scale", torch::tensor({0.5f, 1.0f, 2.0f}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc2->forward(torch::tanh(norm->forward(fc1->forward(x)))) * named_buffers()["scale"];
  }
  torch::nn::Linear fc1;
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc2;
};
TORCH_MODULE(TinyNet);

/// Global batch `step` (8 samples): inputs and targets, by formula.
inline std::pair<torch::Tensor, torch::Tensor> tiny_batch(int64_t step) {
  constexpr int64_t kBatch = 8;
  auto x = ((torch::arange(kBatch * TinyNetImpl::kIn, torch::kFloat) + static_cast<double>(step * 1000)) * 0.37).sin();
  auto y = ((torch::arange(kBatch * TinyNetImpl::kOut, torch::kFloat) + static_cast<double>(step * 1000)) * 0.91).cos();
  return {x.view({kBatch, TinyNetImpl::kIn}), y.view({kBatch, TinyNetImpl::kOut})};
}

}  // namespace zero::testing
