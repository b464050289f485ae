// mingpt --find-max-params: the largest minGPT that trains under a config and
// per-rank memory budgets, found by running real training steps (docs/mingpt.md,
// "The max-parameter benchmark"; NOTE [max-parameter search] in find_max.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "zero/config/config.h"

namespace mingpt {

struct FindMaxOptions {
  std::string self;       // this binary, run once per probe
  std::string launcher;   // `zero`, for probes on more than one rank
  int64_t nproc = 1;      // ranks per probe (zero launch --nproc_per_node)
  std::string config;     // the DeepSpeed config file
  zero::config::Config resolved;  // it, resolved for nproc ranks (the estimator reads it)
  int64_t vocab_size = 0, block_size = 0;
  bool tie_weights = false;
  bool checkpointing = false;  // --checkpoint: every block (for the estimator's prediction)
  // Per-rank budgets; on the CPU the device budget is required.
  std::optional<int64_t> device_memory, host_memory, nvme_bytes;
  bool on_cuda = false;
  // On a GPU without a device budget: its memory, for the estimator alone
  // (the probes use the whole device).
  std::optional<int64_t> device_total;
  std::optional<int64_t> n_layer;  // a fixed depth: only the width is searched
  int64_t head_dim = 64;           // n_embd moves in steps of head_dim, n_head = n_embd / head_dim
  int64_t steps = 3;               // optimizer steps each probe trains
  double probe_timeout_s = 1800;   // a probe running longer is stopped and ends the search; 0: no limit
  std::vector<std::string> forward;  // flags every probe gets (precision, batch size, ...)
  std::string json_path;             // the search's report (empty: none)
};

/// Searches, printing a line per probe; prints the largest size found, its
/// parameters, step time and peak memory per tier. Returns the exit status.
int find_max_params(const FindMaxOptions& options);

}  // namespace mingpt
