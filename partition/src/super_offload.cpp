// The speculative CPU step (offload_optimizer.super_offload) of the ZeRO
// optimizer (zero_optimizer.h).
//
// NOTE [speculative step]
// With offload_optimizer.super_offload (DeepSpeed's SuperOffload:
// speculation, then validation), the boundary backward's CPU step does not
// wait for step():
//   - the engine gives begin_backward the step it will ask for (the step
//     number, lr and betas, the loss scale and the clip);
//   - the reducer says when a group's reduced gradient is complete in host
//     memory (its last piece added, which it does as soon as the piece's copy
//     has ended; the last layers' groups first). A worker thread then sums
//     the group's squares (its share of the global norm, the call step()
//     makes) and steps each of its sub-groups with the factor that holds
//     when nothing is clipped (loss scale x world size x pre-scale), writing
//     each window of 64K elements of master and states into the undo buffer
//     just before its update, while it is in cache, the gradient unscaled
//     inside the CPU pass (NOTE [16-bit gradients]), so it stays as it was
//     for a redo; their
//     new 16-bit values go up on the worker's own copy stream while backward
//     goes on;
//   - step() waits for the worker, adds the groups' squares in group order
//     (the additions the plain step makes), all-reduces and decides. The
//     factor equals the one assumed: done, once the compute stream waits for
//     the worker's last copy. Clipped (or a step other than planned): every
//     stepped sub-group's master and states are copied back from the undo
//     buffer and the whole step runs again as without speculation. Not
//     finite (the fp16 overflow check): copied back, the restored values
//     written to the device again, the step skipped.
// So every case equals the plain step bit for bit: the same kernel on the
// same inputs, the same sums in the same order.
//
// The undo buffer is a copy of the master and states (12 bytes a parameter
// with fp32 Adam; 8-bit states copy their bytes), in pageable host memory,
// counted in the ledger as optimizer states (and by zero estimate); writing
// it adds one write of those bytes to the CPU pass. It is kept even where nothing
// can be clipped or overflow: a backward abandoned after some groups stepped
// (an exception in a later hook), or gradients zeroed before step(), is
// undone with it.
//
// Where: stage 3 with offload_optimizer cpu and no offload_param. The new
// values go to the device's shards, which no later part of that backward
// reads (a group is final when all its parameters' gradients are in); the
// worker's copies wait for the work queued on the device's default stream,
// which is safe because nothing reads a final group's shard later in that
// backward. Shards in host memory are still being copied from, the
// parameter swapper is one thread's, and NVMe states stream in one pass.
// The worker issues no collective, and neither does an undo (the values are
// rewritten from the restored masters; group 0's gathered copy never held
// the speculative ones), so the ranks' collectives stay in one order
// whatever each rank's worker reached. During backward a final group's
// master, states and gradient are the worker's alone. Between that
// backward and step(), whatever reads the shards or states settles the
// speculation first, undoing it (a gather for a forward, read_states for a
// checkpoint, parameter_l2, gathers to export): step() then steps as
// without super_offload. A backward the program starts itself
// (loss.backward()) has no planned step: its step runs after backward, as
// without super_offload.
//
// With offload_optimizer.ratio < 1 (NOTE [partial offload]) only the host's
// groups are speculated, and only they have an undo copy: the device's
// share steps at step(), with the factor then known, after a validation
// (or with the rest in a redo), in a fraction of the CPU's time.
//
// A worker that fails leaves its sub-group restorable as far as its undo
// copy reached, which covers every window whose update began; step()
// undoes everything and rethrows, a cancel undoes it and warns.
#include "zero/partition/zero_optimizer.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include "zero/core/error.h"
#include "zero/core/ledger_alloc.h"
#include "zero/core/log.h"
#include "zero/core/trace.h"

namespace zero::partition {

void ZeroOptimizer::spec_init(const Stage3Layout* layout) {
  ZERO_CHECK(options_.stage == 3 && layout != nullptr, "super_offload runs at stage 3");
  ZERO_CHECK(store_->offloaded() && !options_.nvme && reducer_->owned_in_store(),
             "super_offload needs the optimizer offloaded to host memory");
  ZERO_CHECK(!layout->offload_param && !layout->nvme_param, "super_offload keeps the parameter shards on the device");
  ZERO_CHECK(!options_.grads_on_device, "super_offload steps gradients in host memory (not gradients_on_device)");
  spec_ = std::make_unique<Speculation>(options_.device, options_.copy_mode);
  Speculation& sp = *spec_;
  const auto& sub_groups = store_->sub_groups();
  sp.stepped.assign(sub_groups.size(), 0);
  sp.saved.assign(sub_groups.size(), -1);
  sp.sumsq.resize(flat_->groups().size());

  // The undo buffer: sub-group by sub-group, its master then its states,
  // each 64-byte aligned, in one allocation.
  const auto& specs = store_->state_specs();
  auto aligned = [](int64_t b) { return (b + 63) / 64 * 64; };
  // (Of the host's sub-groups: the device's share, NOTE [partial offload],
  // steps at step().)
  int64_t bytes = 0;
  for (size_t k = 0; k < sub_groups.size(); ++k) {
    if (!store_->on_host(sub_groups[k].group)) continue;
    bytes += aligned(sub_groups[k].numel * static_cast<int64_t>(c10::elementSize(store_->master_dtype())));
    for (size_t i = 0; i < specs.size(); ++i)
      bytes += aligned(store_->state_numel(i, k) * static_cast<int64_t>(c10::elementSize(specs[i].dtype)));
  }
  sp.undo = LedgerAlloc::host_empty(ledger_, std::max<int64_t>(bytes, 1), at::kByte, /*pin=*/false,
                                    Kind::kOptimizerStates, "undo copy of the speculative step (super_offload)");
  int64_t at = 0;
  auto view = [&](int64_t numel, at::ScalarType dtype) {
    const int64_t b = numel * static_cast<int64_t>(c10::elementSize(dtype));
    at::Tensor v = sp.undo.narrow(0, at, b).view(dtype);
    at += aligned(b);
    return v;
  };
  sp.undo_views.resize(sub_groups.size());
  for (size_t k = 0; k < sub_groups.size(); ++k) {
    if (!store_->on_host(sub_groups[k].group)) continue;
    sp.undo_views[k].push_back(view(sub_groups[k].numel, store_->master_dtype()));
    for (size_t i = 0; i < specs.size(); ++i) sp.undo_views[k].push_back(view(store_->state_numel(i, k), specs[i].dtype));
  }

  // The worker's pinned buffers for new values on their way to the device,
  // as write_pass's (NOTE [offload transfers]).
  sp.ring = make_value_ring("parameters for the device (super_offload)");
  reducer_->set_on_host_final([this](size_t g) { spec_group_final(g); });
  sp.worker = std::thread([this] { spec_worker(); });
}

int64_t ZeroOptimizer::speculation_undo_bytes() const {
  return spec_ ? static_cast<int64_t>(spec_->undo.nbytes()) : 0;
}

void ZeroOptimizer::spec_group_final(size_t g) {
  Speculation& sp = *spec_;
  {
    std::lock_guard<std::mutex> lock(sp.mu);
    if (!sp.armed) return;  // not a planned boundary: the step runs at step()
    sp.ready.push_back(g);
    ++sp.notified;
  }
  sp.cv.notify_all();
}

void ZeroOptimizer::spec_worker() {
  Speculation& sp = *spec_;
  trace::name_thread("super_offload CPU steps");
  at::NoGradGuard no_grad;
  const c10::DeviceGuard device(options_.device);  // the copies' device is current here too
  const auto& sub_groups = store_->sub_groups();
  const int64_t piece = value_piece();
  for (;;) {
    size_t g = 0;
    bool skip = false;
    {
      std::unique_lock<std::mutex> lock(sp.mu);
      sp.cv.wait(lock, [&] { return sp.stop || !sp.ready.empty(); });
      if (sp.stop) return;
      g = sp.ready.front();
      sp.ready.pop_front();
      skip = sp.skip;
    }
    try {
      if (!skip) {
        sp.sumsq[g] = group_sum_of_squares(g);
        StreamEvent group_last;
        for (size_t k = 0; k < sub_groups.size(); ++k) {
          if (sub_groups[k].group != g) continue;
          const auto [grp, start, len] = sub_groups[k];
          std::vector<at::Tensor> v = store_->views(k);
          sp.saved[k] = -1;   // its undo copy is written as it is stepped, this far
          sp.stepped[k] = 1;
          at::Tensor m = v[0];
          std::vector<at::Tensor> s(v.begin() + 1, v.end());
          LowOut low = to_device(flat_->part(grp).narrow(0, start, len), piece, sp.ring, sp.copies, sp.wait_s,
                                 sp.last, group_last);
          const trace::Span span("optimizer", "speculative CPU step of a sub-group", static_cast<int64_t>(k));
          step_sub_group(k, reducer_->owned(grp).narrow(0, start, len), m, s, low, sp.plan.params, sp.combined,
                         &sp.undo_views[k], &sp.saved[k]);
          ++spec_sub_groups_;
        }
      }
    } catch (...) {
      // A sub-group left half stepped is restored as far as its undo copy
      // reached, which covers every window its update began (spec_restore).
      std::lock_guard<std::mutex> lock(sp.mu);
      if (!sp.error) sp.error = std::current_exception();
      sp.skip = true;
    }
    {
      std::lock_guard<std::mutex> lock(sp.mu);
      ++sp.groups_done;
    }
    sp.cv.notify_all();
  }
}

void ZeroOptimizer::spec_wait() {
  Speculation& sp = *spec_;
  std::exception_ptr error;
  {
    const trace::Span span("wait", "wait for the speculative CPU steps");
    std::unique_lock<std::mutex> lock(sp.mu);
    sp.cv.wait(lock, [&] { return sp.groups_done == sp.notified; });
    error = sp.error;
    // Every host group went there before step() (reducer_->wait_all()).
    size_t host_groups = 0;
    for (size_t g = 0; g < flat_->groups().size(); ++g) host_groups += store_->on_host(g) ? 1 : 0;
    if (!error && sp.notified != host_groups) sp.skip = true;
  }
  if (!error && sp.skip) {
    spec_restore(/*rewrite_values=*/true);
    ZERO_CHECK(false, "super_offload: a group's gradient never became final before the step");
  }
  if (!error) return;
  try {
    spec_restore(/*rewrite_values=*/true);
  } catch (const std::exception&) {  // the worker's error says more
  }
  std::rethrow_exception(error);
}

void ZeroOptimizer::spec_restore(bool rewrite_values) {
  Speculation& sp = *spec_;
  // The worker's copies of new values end before anything else writes there.
  sp.last.block_current();
  sp.last = StreamEvent();
  const bool any = std::any_of(sp.stepped.begin(), sp.stepped.end(), [](char c) { return c != 0; });
  if (any) {
    const trace::Span span("optimizer", "undo the speculative step");
    const auto& specs = store_->state_specs();
    for (size_t k = 0; k < sp.stepped.size(); ++k) {
      if (!sp.stepped[k] || sp.saved[k] < 0) continue;
      // As far as the undo copy reached: the whole sub-group once stepped,
      // less after a failure (a window is copied before its update begins).
      const int64_t n = sp.saved[k];
      std::vector<at::Tensor> v = store_->views(k);
      v[0].narrow(0, 0, n).copy_(sp.undo_views[k][0].narrow(0, 0, n));
      for (size_t i = 0; i < specs.size(); ++i) {
        if (specs[i].side) v[i + 1].copy_(sp.undo_views[k][i + 1]);
        else if (n > 0) optim::state_window(specs[i], v[i + 1], 0, n).copy_(optim::state_window(specs[i], sp.undo_views[k][i + 1], 0, n));
      }
    }
    if (rewrite_values) spec_rewrite_values();
  }
  {
    std::lock_guard<std::mutex> lock(sp.mu);
    sp.armed = false;
  }
  std::fill(sp.stepped.begin(), sp.stepped.end(), 0);
  std::fill(sp.saved.begin(), sp.saved.end(), -1);
}

// The values as they were, written from the restored masters into the
// stepped sub-groups' shards as a load does (a shard is its master in the
// compute dtype: NOTE [16-bit master]), through the training thread's
// pinned buffers and stream. No collective: group 0's gathered copy never
// held the speculative values, so nothing is gathered again.
void ZeroOptimizer::spec_rewrite_values() {
  Speculation& sp = *spec_;
  const auto& sub_groups = store_->sub_groups();
  if (!param_ring_.defined()) param_ring_ = make_value_ring("parameters for the device");
  StreamEvent last, group_last;
  for (size_t k = 0; k < sp.stepped.size(); ++k) {
    if (!sp.stepped[k]) continue;
    const auto [g, start, len] = sub_groups[k];
    LowOut low = to_device(flat_->part(g).narrow(0, start, len), value_piece(), param_ring_, copies_, copy_wait_s_,
                           last, group_last);
    write_values_of(store_->views(k)[0], low);
  }
  last.block_current();  // the next forward's gathers read them after the copies
}

void ZeroOptimizer::spec_cancel() {
  Speculation& sp = *spec_;
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(sp.mu);
    sp.skip = true;  // what is still queued is not stepped
    sp.cv.wait(lock, [&] { return sp.groups_done == sp.notified; });
    sp.ready.clear();
    error = sp.error;
    sp.error = nullptr;
  }
  spec_restore(/*rewrite_values=*/true);
  ++spec_counts_.undone;
  if (error) {  // undone whole: nothing is lost, but the failure is said
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      log::warning(std::string("offload_optimizer.super_offload: a speculative CPU step failed (") + e.what() +
                   "); it was undone with the rest of the speculation, and the step will run after backward");
    } catch (...) {
      log::warning("offload_optimizer.super_offload: a speculative CPU step failed; it was undone");
    }
  }
}

void ZeroOptimizer::spec_settle() {
  if (spec_ && spec_->armed && !in_backward_) spec_cancel();
}

}  // namespace zero::partition
