// NOTE [run context] in context.h.
#include "context.h"

#include "engine_util.h"
#include "zero/core/error.h"
#include "zero/core/ledger_alloc.h"
#include "zero/partition/zero_optimizer.h"

namespace zero::detail {

RunContext make_context(config::Config config, InitOptions options) {
  RunContext c;
  c.config = std::move(config);
  c.dist = options.dist ? *options.dist : DistEnv::from_environment();
  options.dist = c.dist;
  if (c.config.world_size != c.dist.world_size) {
    throw ConfigError({c.config.source + ": the batch sizes were resolved for world size " +
                       std::to_string(c.config.world_size) + " but this job has " +
                       std::to_string(c.dist.world_size) + " ranks"});
  }
  c.device = resolve_device(options.device, c.dist);
  c.dtype = partition::compute_dtype(c.config);
  c.grad_accum_dtype = partition::grad_accum_dtype(c.config);
  if (c.device.is_cpu()) install_counting_cpu_allocator();
  c.ledger->set_limit(Tier::kPinnedHost, options.pinned_memory_limit_bytes.value_or(default_pinned_limit()),
                      "InitOptions::pinned_memory_limit_bytes");
  c.options = std::move(options);
  return c;
}

}  // namespace zero::detail
