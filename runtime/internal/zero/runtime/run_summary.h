// The figures of a run that every program reports the same way (mingpt's
// and llama's --summary-json): each rank's memory peaks per tier and its
// model-state bytes, gathered.
#pragma once

#include <nlohmann/json.hpp>

#include "zero/runtime/engine.h"

namespace zero::detail {

/// Every rank's figures, by rank: peak_bytes (device, pinned_host, host,
/// nvme), model_state_bytes (parameters, gradients, optimizer_states) and
/// model_state_bytes_by_tier (device, host, nvme), node and
/// collective_bytes (within_node, across_nodes, steps: since initialize;
/// NOTE [bytes across nodes]), on every rank. A collective. Throws
/// CommunicationError.
nlohmann::json rank_figures(Engine& engine);

/// The bytes every rank's collectives sent, summed over ranks, per step:
/// within_node, across_nodes and the steps they are over, from
/// rank_figures' array (a summary's collective_bytes_per_step).
nlohmann::json traffic_per_step(const nlohmann::json& ranks);

/// The largest of each rank's peaks per tier, and rank 0's model-state
/// bytes, from rank_figures' array: a summary's top-level peak_bytes and
/// model_state_bytes.
nlohmann::json max_peaks(const nlohmann::json& ranks);

/// This rank's waits and its stage-3 and NVMe figures, to merge into a
/// summary: grad_comm_wait_s, param_gather_wait_s, transfer_wait_s,
/// transfer_bytes (the offloaded optimizer's device-host copies), and
/// "stage3" (at stage 3) and "nvme" (with NVMe offload) objects. Local.
nlohmann::json engine_figures(const Engine& engine);

}  // namespace zero::detail
