// zero::Init's state, shared with the engine that adopts it.
#pragma once

#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "zero/offload/aio.h"
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
    at::Tensor chunk;  // this rank's chunk, compute dtype; undefined when on disk
    int64_t disk_offset = -1;  // where the chunk is in `swap_file` (offload_param nvme)
  };
  std::unordered_map<const void*, Layer> layers;    // by module
  std::unordered_set<const void*> partitioned;      // parameter TensorImpls
  bool adopted = false;
  // offload_param nvme: layers whose shards pass offload_param.max_in_cpu are
  // written to this file as they are built; the engine's parameter swapper
  // takes it over (NOTE [parameter swapping]).
  int64_t in_cpu_left = 0;  // elements of max_in_cpu not yet used
  std::unique_ptr<offload::AioEngine> aio;
  std::shared_ptr<offload::AioFile> swap_file;
  int64_t swap_bytes = 0;
  MemoryLedger::Reservation swap_disk;
};

}  // namespace zero
