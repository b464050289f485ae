// The README's C++ snippets, as written, compiled against the installed
// package (tests/install/run.sh extracts them into README_SNIPPETS_DIR):
// their names, includes and targets are the package's.
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <zero/models/llama.h>
#include <zero/zero.h>

// docs/fine-tuning.md, "Fine-tuning: LoRA, frozen parts, mixtures of experts".
void readme_fine_tuning(const zero::models::LlamaConfig& cfg) {
#include "readme_fine_tuning.inc"
}

// "`init.partition(m)` returns `m` as it was given, a TORCH_MODULE holder too".
void readme_partition_holder(zero::Init& init) {
  torch::nn::Linear b(4, 4);
  b = init.partition(b);
}

// docs/getting-started.md, a model's forward through its stage-3 layers.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int /*cfg*/) {}
  torch::Tensor forward(torch::Tensor x) { return x; }
};
TORCH_MODULE(Block);
struct NetImpl : torch::nn::Module {
  torch::nn::ModuleList blocks_;
  torch::nn::Linear head_{4, 4};
  torch::Tensor forward(torch::Tensor x) {
#include "getting_started_forward.inc"
    return x;
  }
};

// docs/getting-started.md, a model built partitioned under zero::Init.
void getting_started_init(std::shared_ptr<torch::nn::Module> model, torch::nn::ModuleList blocks, int cfg, int n_layer) {
#include "getting_started_init.inc"
}

// docs/checkpoints.md, the engine's checkpoint calls.
void checkpoints_calls(zero::Engine& engine) {
#include "checkpoints_calls.inc"
}
