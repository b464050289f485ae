// zero/testing/memory.h: an engine's memory figures, against a baseline and against the formulas.
#include "zero/testing/memory.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "engine_impl.h"
#include "run_reporter.h"
#include "zero/core/error.h"
#include "zero/core/text.h"

namespace zero::testing {
namespace {

constexpr const char* kStateKinds[] = {"parameters", "gradients", "optimizer_states"};

}  // namespace

MemoryFigures figures_of(Engine& engine) {
  MemoryFigures f;
  f["peak/device"] = engine.peak_bytes(Tier::kDevice);
  for (const Tier t : {Tier::kPinnedHost, Tier::kHost, Tier::kNvme})
    f[std::string("peak/") + to_string(t)] = engine.peak_bytes(t);
  for (const Tier t : {Tier::kDevice, Tier::kPinnedHost, Tier::kHost, Tier::kNvme})
    for (int k = 0; k < kNumKinds; ++k)
      f[std::string("ledger/") + to_string(t) + "/" + to_string(static_cast<Kind>(k))] =
          engine.ledger().get(t, static_cast<Kind>(k)).peak_bytes;
  const auto st = engine.model_state_bytes();
  f["model_states/parameters"] = st.parameters;
  f["model_states/gradients"] = st.gradients;
  f["model_states/optimizer_states"] = st.optimizer_states;
  return f;
}

MemoryComparison compare_with_baseline(Engine& engine, const std::string& path, double tolerance, int64_t slack_bytes) {
  Baseline b = read_baseline(path);
  const int64_t rank = engine.rank();
  if (b.world_size != engine.world_size()) {
    MemoryComparison c;
    c.ok = false;
    c.message = path + " was recorded on " + std::to_string(b.world_size) + " rank(s), this engine has " +
                std::to_string(engine.world_size());
    return c;
  }
  Baseline mine;  // this rank alone
  mine.world_size = 1;
  mine.ranks = {b.ranks[static_cast<size_t>(rank)]};
  auto c = compare(mine, {figures_of(engine)}, tolerance, slack_bytes);
  for (auto& row : c.rows) row.rank = rank;
  return c;
}

std::vector<ParameterShape> parameter_shapes(Engine& engine) { return detail::parameter_shapes(engine.impl()); }

Check expect_model_states_near_formula(Engine& engine, double tolerance) {
  const auto params = parameter_shapes(engine);
  const auto e = estimate_model_states(engine.config(), params);
  Check c;
  const double psi = static_cast<double>(std::max<int64_t>(1, e.num_parameters));
  std::ostringstream out;
  out << "model states of rank " << engine.rank() << " against the ZeRO formulas (stage " << engine.config().zero.stage
      << ", " << e.num_parameters << " parameters, tolerance " << 100 * tolerance << "%):\n";
  const std::pair<const char*, std::vector<Tier>> tiers[] = {
      {"device", {Tier::kDevice}}, {"host", {Tier::kHost, Tier::kPinnedHost}}, {"nvme", {Tier::kNvme}}};
  for (const auto& [name, ts] : tiers) {
    const StateBytes& want = std::string(name) == "device" ? e.device : std::string(name) == "host" ? e.host : e.nvme;
    for (const char* kind : kStateKinds) {
      int64_t got = 0;
      for (const Tier t : ts) {
        const auto b = engine.model_state_bytes(t);
        got += std::string(kind) == "parameters" ? b.parameters : std::string(kind) == "gradients" ? b.gradients
                                                                                                   : b.optimizer_states;
      }
      const int64_t w = std::string(kind) == "parameters" ? want.parameters
                        : std::string(kind) == "gradients" ? want.gradients
                                                           : want.optimizer_states;
      const double big = static_cast<double>(std::max(w, got));
      const bool near = std::abs(static_cast<double>(w - got)) <= tolerance * big || big < 0.01 * psi;
      if (big == 0) continue;
      char line[200];
      std::snprintf(line, sizeof line, "  %-6s %-16s formula %12s (%.2f B/param), ledger %12s (%.2f B/param)%s\n", name,
                    kind, format_bytes(w).c_str(), static_cast<double>(w) / psi, format_bytes(got).c_str(),
                    static_cast<double>(got) / psi, near ? "" : "  OFF");
      out << line;
      c.ok = c.ok && near;
    }
  }
  c.message = out.str();
  return c;
}

}  // namespace zero::testing
