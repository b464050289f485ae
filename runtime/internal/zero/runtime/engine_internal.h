// What zero's own programs (mingpt, the tests' workers) reach inside an
// Engine and users do not: internal, never installed.
#pragma once

#include "zero/core/comm.h"
#include "zero/runtime/engine.h"

namespace zero::detail {

/// The data-parallel group's collectives (null with one process), for a
/// program that gathers its own figures across ranks. Owned by the engine.
Comm* comm_of(Engine& engine);

}  // namespace zero::detail
