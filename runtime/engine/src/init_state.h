// zero::Init's state, shared with the engine that adopts it.
#pragma once

#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "zero/runtime/dist_env.h"
#include "zero/runtime/init.h"

namespace zero {

struct Init::State {
  config::Config config;
  InitOptions options;
  DistEnv dist;
  at::Device device{at::kCPU};
  at::ScalarType dtype = at::kFloat;
  std::shared_ptr<MemoryLedger> ledger = std::make_shared<MemoryLedger>();
  struct Layer {
    std::vector<at::Tensor> params;  // in the engine's order: named_parameters, partitioned ones only
    std::vector<std::vector<int64_t>> shapes;
    at::Tensor chunk;  // this rank's chunk, compute dtype
  };
  std::unordered_map<const void*, Layer> layers;    // by module
  std::unordered_set<const void*> partitioned;      // parameter TensorImpls
  bool adopted = false;
};

}  // namespace zero
