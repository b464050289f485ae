// zero::Init's state, shared with the engine that adopts it.
#pragma once

#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "zero/offload/aio.h"
#include "zero/core/dist_env.h"
#include "zero/runtime/init.h"

namespace zero {

struct InitState {
  config::Config config;
  InitOptions options;
  DistEnv dist;
  at::Device device{at::kCPU};
  at::ScalarType dtype = at::kFloat;
  std::shared_ptr<MemoryLedger> ledger = std::make_shared<MemoryLedger>();
  struct Layer {
    // Layers are known by address: holding the module keeps a later one from
    // reusing it (a temporary passed to partition(), say).
    std::shared_ptr<torch::nn::Module> module;
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
  // The last shard's write, in flight while the next layer is built; its
  // buffer outlives the engine below, which waits for it when destroyed.
  struct PendingWrite {
    offload::AlignedBuffer buf;
    LedgerReservation held;
    offload::AioHandle io;
  } pending;
  std::unique_ptr<offload::AioEngine> aio;
  std::shared_ptr<offload::AioFile> swap_file;
  int64_t swap_bytes = 0;
  LedgerReservation swap_disk;

  /// Waits for the last shard's write (throws zero::IoError if it failed).
  void finish_swap_out() {
    auto done = std::move(pending);
    pending = {};
    done.io.wait();
  }
};

}  // namespace zero
