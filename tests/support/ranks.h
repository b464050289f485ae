// Several ranks as threads of one test process, over Gloo on one in-memory
// c10d::HashStore: collectives for unit tests without spawning processes.
#pragma once

#include <cstdlib>
#include <exception>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "zero/core/comm.h"
#include "zero/core/dist_env.h"

namespace zero::testing {

/// Runs fn(rank, comm) on `world` ranks, one thread each; rethrows the first
/// exception a rank threw once every thread has ended. With per_node > 0
/// the ranks sit on nodes of per_node ranks each, in order (DistEnv::node).
/// On a CUDA `device` the ranks share it through Gloo (NCCL takes one rank
/// a device).
template <typename F>
void on_ranks(int world, F fn, int per_node = 0, at::Device device = at::kCPU) {
  if (per_node <= 0) per_node = world;
  // c10d's flight recorder is one per process, and its record of a
  // collective is not safe from several process groups' threads at once (a
  // crash inside it, now and then, under load): it is off for these
  // in-process ranks (it reads the variable when it is first used). Real
  // ranks are processes, one group each.
  ::setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        DistEnv env;
        env.rank = r;
        env.world_size = world;
        env.local_rank = r % per_node;
        env.local_world_size = per_node;
        env.node = r / per_node;
        env.timeout = std::chrono::milliseconds(60000);
        if (device.is_cuda()) env.backend = "gloo";
        auto comm = Comm::join(store, env, device);
        fn(r, *comm);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace zero::testing
