// Internal: readers for each part of a DeepSpeed config. Each reads from the
// top-level Section, fills its part of Config and reports problems to the
// Context (NOTE [config problems] in reader.h).
#pragma once

#include "reader.h"

namespace zero::config::detail {

/// zero_optimization (also the legacy boolean form), with offload blocks.
void read_zero(Section& top, Config& config);
/// fp16 and bf16 / bfloat16; needs config.zero.stage.
void read_precision(Section& top, Config& config);
void read_aio(Section& top, Config& config);
void read_activation_checkpointing(Section& top, Config& config);
void read_optimizer(Section& top, Config& config);
void read_scheduler(Section& top, Config& config);

/// Sections and keys zero does not implement: errors where they would change
/// training, warnings where they would not (the table in features.cpp).
void check_features(Context& ctx, const Json& root);
/// Warns about unknown top-level keys that look like typos of known ones.
void check_top_level_keys(Context& ctx, const Json& root);

}  // namespace zero::config::detail
