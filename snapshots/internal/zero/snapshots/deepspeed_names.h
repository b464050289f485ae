// The file names of DeepSpeed's checkpoints (NOTE [deepspeed checkpoints]).
#pragma once

#include <cstdint>
#include <string>

namespace zero::ckpt::deepspeed {

/// The model's file below stage 3 (and the universal form's).
inline constexpr const char* kModelFile = "mp_rank_00_model_states.pt";
/// Rank r's model file at stage 3.
inline std::string zero3_model_file(int64_t r) {
  return "zero_pp_rank_" + std::to_string(r) + "_mp_rank_00_model_states.pt";
}
/// Rank r's optimizer file; `prefix` "bf16_" for DeepSpeed's BF16 optimizer.
inline std::string optim_file(const std::string& prefix, int64_t r) {
  return prefix + "zero_pp_rank_" + std::to_string(r) + "_mp_rank_00_optim_states.pt";
}

}  // namespace zero::ckpt::deepspeed
