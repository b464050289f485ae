#include "zero/runtime/run_summary.h"
#include "zero/runtime/engine_internal.h"

#include <algorithm>
#include <fstream>
#include <string>

#include <ATen/ATen.h>

#include "engine_impl.h"

namespace zero::detail {
namespace {
// VmRSS of /proc/self/status in bytes; 0 where there is none.
int64_t resident_bytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return 0;
}
}  // namespace

nlohmann::json rank_figures(Engine& engine) {
  const auto tiers = {Tier::kDevice, Tier::kPinnedHost, Tier::kHost, Tier::kNvme};
  std::vector<int64_t> mine;
  for (Tier t : tiers) mine.push_back(engine.peak_bytes(t));
  const auto st = engine.model_state_bytes();
  mine.insert(mine.end(), {st.parameters, st.gradients, st.optimizer_states});
  for (Tier t : {Tier::kDevice, Tier::kHost, Tier::kPinnedHost, Tier::kNvme}) {
    const auto b = engine.model_state_bytes(t);
    mine.insert(mine.end(), {b.parameters, b.gradients, b.optimizer_states});
  }
  const auto traffic = collective_traffic_of(engine);  // 19-22
  mine.insert(mine.end(), {traffic.bytes.within_node, traffic.bytes.across_nodes, traffic.steps, traffic.node});
  // 23-25: frozen parameters now (NOTE [frozen groups]): device, host, NVMe;
  // 26: this process's resident memory now.
  auto& ledger = engine.ledger();
  mine.insert(mine.end(), {ledger.get(Tier::kDevice, Kind::kFrozenParameters).current_bytes,
                           ledger.get(Tier::kHost, Kind::kFrozenParameters).current_bytes +
                               ledger.get(Tier::kPinnedHost, Kind::kFrozenParameters).current_bytes,
                           ledger.get(Tier::kNvme, Kind::kFrozenParameters).current_bytes, resident_bytes()});
  const int64_t n = static_cast<int64_t>(mine.size());
  at::Tensor all = at::tensor(mine, at::kLong).repeat({engine.world_size()});
  if (auto* comm = comm_of(engine)) {
    at::Tensor mine_d = at::tensor(mine, at::kLong).to(comm->device()), all_d = all.to(comm->device());
    comm->all_gather(all_d, mine_d).wait();
    all = all_d.cpu();
  }
  auto a = all.accessor<int64_t, 1>();
  nlohmann::json ranks = nlohmann::json::array();
  for (int64_t r = 0; r < engine.world_size(); ++r) {
    const int64_t* v = &a[r * n];
    auto states = [&](int64_t at) {
      return nlohmann::json{{"parameters", v[at]}, {"gradients", v[at + 1]}, {"optimizer_states", v[at + 2]}};
    };
    nlohmann::json host = states(10);  // host: pageable and pinned together
    for (const char* k : {"parameters", "gradients", "optimizer_states"}) host[k] = host[k].get<int64_t>() + states(13)[k].get<int64_t>();
    ranks.push_back({{"rank", r},
                     {"peak_bytes", {{"device", v[0]}, {"pinned_host", v[1]}, {"host", v[2]}, {"nvme", v[3]}}},
                     {"model_state_bytes", states(4)},
                     {"model_state_bytes_by_tier", {{"device", states(7)}, {"host", host}, {"nvme", states(16)}}},
                     {"node", v[22]},
                     {"frozen_parameter_bytes", v[23] + v[24] + v[25]},
                     {"frozen_parameter_bytes_by_tier", {{"device", v[23]}, {"host", v[24]}, {"nvme", v[25]}}},
                     {"resident_bytes", v[26]},
                     {"collective_bytes", {{"within_node", v[19]}, {"across_nodes", v[20]}, {"steps", v[21]}}}});
  }
  return ranks;
}

nlohmann::json max_peaks(const nlohmann::json& ranks) {
  nlohmann::json peaks = {{"device", 0}, {"pinned_host", 0}, {"host", 0}, {"nvme", 0}};
  for (const auto& r : ranks)
    for (auto& [k, v] : peaks.items()) v = std::max(v.get<int64_t>(), r.at("peak_bytes").at(k).get<int64_t>());
  return peaks;
}

nlohmann::json traffic_per_step(const nlohmann::json& ranks) {
  double within = 0, across = 0;
  int64_t steps = 0;
  for (const auto& r : ranks) {
    const auto& c = r.at("collective_bytes");
    within += c.at("within_node").get<double>();
    across += c.at("across_nodes").get<double>();
    steps = std::max(steps, c.at("steps").get<int64_t>());
  }
  const double d = static_cast<double>(std::max<int64_t>(1, steps));
  return {{"within_node", within / d}, {"across_nodes", across / d}, {"steps", steps}};
}

nlohmann::json engine_figures(const Engine& engine) {
  nlohmann::json j = {{"grad_comm_wait_s", engine.grad_comm_wait_seconds()},
                      {"param_gather_wait_s", engine.param_gather_wait_seconds()},
                      {"transfer_wait_s", engine.transfer_wait_seconds()},
                      {"transfer_bytes", engine.impl().optimizer->transfer_bytes()}};
  if (auto st = engine.stage3_stats())
    j["stage3"] = {{"layers", st->layers},
                   {"peak_live_parameters", st->peak_live_parameters},
                   {"gathers", st->gathers},
                   {"prefetched_gathers", st->prefetched_gathers},
                   {"gather_wait_s", st->gather_wait_s},
                   {"trace_valid", st->trace_valid}};
  if (engine.impl().optimizer->speculates()) {  // NOTE [speculative step]
    const auto c = speculation_counts(engine);
    j["speculation"] = {{"planned", c.planned}, {"validated", c.validated}, {"redone", c.redone},
                        {"undone", c.undone},   {"sub_group_steps", c.sub_groups}};
  }
  if (auto nv = engine.nvme_stats())
    j["nvme"] = {{"file_bytes", nv->file_bytes},
                 {"buffer_bytes", nv->buffer_bytes},
                 {"bytes_read", nv->bytes_read},
                 {"bytes_written", nv->bytes_written},
                 {"read_wait_s", nv->read_wait_s},
                 {"write_wait_s", nv->write_wait_s},
                 {"optimizer_step_s", nv->step_s},
                 {"param_file_bytes", nv->param_file_bytes},
                 {"param_bytes_read", nv->param_bytes_read},
                 {"param_bytes_cached", nv->param_bytes_cached},
                 {"param_bytes_written", nv->param_bytes_written},
                 {"param_read_wait_s", nv->param_read_wait_s}};
  return j;
}

}  // namespace zero::detail
