// `zero bench ...` subcommands. Each prints a readable table and, with
// --json FILE, writes the same figures as JSON (units in the key names).
#pragma once

#include <string>
#include <vector>

namespace zero::tools {

/// zero bench engine: minGPT training steps through zero's engine against a
/// plain LibTorch loop (torch::optim::AdamW, clip_grad_norm_), same model and
/// data, in one run. Returns the process exit code.
int bench_engine(const std::vector<std::string>& args);

}  // namespace zero::tools
