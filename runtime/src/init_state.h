// zero::Init's state, shared with the engine that adopts it.
#pragma once

#include <memory>

#include "context.h"
#include "zero/core/ledger_alloc.h"
#include "zero/offload/aio.h"
#include "zero/partition/stage3_plan.h"
#include "zero/runtime/init.h"

namespace zero {

struct InitState {
  detail::RunContext ctx;  // NOTE [run context]
  // The layers partitioned so far, and the rules' state (NOTE [stage-3 plan]).
  partition::Prebuilt built;
  bool adopted = false;
  // offload_param nvme: the last shard's write, in flight while the next
  // layer is built; its buffer outlives the engine below, which waits for it
  // when destroyed.
  struct PendingWrite {
    offload::AlignedBuffer buf;
    LedgerReservation held;
    offload::AioHandle io;
  } pending;
  std::unique_ptr<offload::AioEngine> aio;
  LedgerReservation swap_disk;

  /// Waits for the last shard's write (throws zero::IoError if it failed).
  void finish_swap_out() {
    auto done = std::move(pending);
    pending = {};
    done.io.wait();
  }
};

}  // namespace zero
