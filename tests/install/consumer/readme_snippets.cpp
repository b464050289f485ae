// The README's C++ snippets, as written, compiled against the installed
// package (tests/install/run.sh extracts them into README_SNIPPETS_DIR):
// their names, includes and targets are the package's.
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
