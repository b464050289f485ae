// Side streams and events for the transfers between the device and host
// memory, and the clock of the time training waits for them.
//
// NOTE [device streams]
// On a CUDA device these transfers run off the compute stream (the current
// stream of the training thread):
//   - optimizer offload: each reduced gradient chunk goes device-to-host as
//     its bucket's reduction ends; the updated 16-bit parameters go
//     host-to-device from pinned buffers while CPU Adam works on the next
//     sub-group (NOTE [offload transfers]);
//   - stage 3: a layer's shard goes host-to-device (offload_param), and its
//     all-gather is launched on the same side stream, ahead of use;
//   - cpu_checkpointing: kept activations go device-to-host.
// Each runs on a CopyStream. A transfer first waits, on the GPU, for the work
// the compute stream has queued so far: what it reads is complete, and memory
// the caching allocator handed out again is no longer used by that work. It
// returns a StreamEvent, its end. Whoever needs its result waits for that
// event: the compute stream (StreamEvent::block_current: the GPU waits, the
// host goes on) or the host (StreamEvent::synchronize) before it reads a host
// destination, or writes into a host source again. Device memory a transfer
// touches is recorded on its stream, so the caching allocator does not reuse
// it before the transfer ends; LibTorch's pinned-memory allocator does the
// same for pinned host memory.
//
// On the CPU there is no stream: by default a transfer is a copy done at
// once, and its event is complete. For tests, CopyMode::kDeferred holds each
// copy back until its event is waited for (block_current or synchronize),
// and keeps a snapshot of the source of a copy from host memory: if that
// source changes before the host synchronize()d the copy's event (a buffer
// reused while a GPU could still be reading it), the next operation on the
// stream throws zero::InternalError. Code that misses a wait then computes
// wrong values or fails on the CPU, where on a GPU it would race.
// (Not modelled: the host reading a device-to-host destination after only a
// block_current; the host must synchronize() first.)
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>

#include "zero/core/copy_mode.h"

namespace zero {

/// The end of some work queued on a CopyStream. Default-constructed: complete.
/// Copyable (copies refer to the same point); any thread may wait on it.
class StreamEvent {
 public:
  StreamEvent() = default;
  /// The host blocks until the work is done (on the CPU in kDeferred mode:
  /// performs the copies up to this one and checks their host sources).
  void synchronize() const;
  /// The calling thread's current stream waits for the work before it runs
  /// anything queued later; the host does not wait. (kDeferred: performs
  /// the copies up to this one, the CPU being its own "current stream".)
  void block_current() const;
  /// Whether the work is done, without waiting (kDeferred: once the host
  /// has synchronize()d it or a later event of its stream).
  bool query() const;

  struct State;

 private:
  friend class CopyStream;
  explicit StreamEvent(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

/// A side stream for transfers on `device` (see NOTE [device streams]).
/// Not thread-safe: one thread issues its transfers. Move-only. Destroying it
/// does not wait for the transfers in flight (their memory is kept by the
/// allocators as said above); kDeferred performs the held copies.
class CopyStream {
 public:
  explicit CopyStream(at::Device device, CopyMode cpu_mode = CopyMode::kImmediate);
  ~CopyStream();
  CopyStream(CopyStream&&) noexcept;
  CopyStream& operator=(CopyStream&&) noexcept;

  /// dst.copy_(src) on this stream, after the current stream's work so far.
  /// `host_source`: src is host memory the host may write again later (a
  /// pinned buffer): kDeferred checks that it waits for the event first.
  /// Throws zero::InternalError (kDeferred) when an earlier copy's host source
  /// changed before its event was synchronized.
  StreamEvent copy(const at::Tensor& dst, const at::Tensor& src, bool host_source = false);
  /// Runs `fn` with this stream current (CUDA; on the CPU it just runs), after
  /// the current stream's work so far, so the collectives and copies `fn`
  /// launches follow both; returns the end of what `fn` queued on this stream.
  StreamEvent run(const std::function<void()>& fn);
  /// Makes a tensor's device memory unavailable to the caching allocator
  /// until this stream's work queued so far is done (c10's recordStream);
  /// nothing on the CPU.
  void record(const at::Tensor& t) const;
  /// The same for the calling thread's current stream: for memory this stream
  /// allocated that the current stream (or a collective it waits for) used.
  void record_on_current(const at::Tensor& t) const;

  at::Device device() const { return device_; }
  bool is_cuda() const { return device_.is_cuda(); }
  /// Bytes copy() has moved since construction (the issuing thread's count).
  int64_t bytes_copied() const { return bytes_; }

  struct Impl;

 private:
  at::Device device_;
  int64_t bytes_ = 0;
  std::unique_ptr<Impl> impl_;
};

/// Time the training thread waits. Each wait counts once: on the CPU the
/// host time it blocks; on a CUDA device the larger of that and the time the
/// current stream stands still at the wait (CUDA events before and after it,
/// read once they are done), so a wait that blocks only the stream (NCCL)
/// counts, and one that blocks the host while the stream idles (Gloo) is not
/// counted twice. Not thread-safe.
class WaitClock {
 public:
  explicit WaitClock(at::Device device);
  ~WaitClock();
  WaitClock(WaitClock&&) noexcept;
  WaitClock& operator=(WaitClock&&) noexcept;

  /// Runs `wait` and adds its time; `what` names it in the trace (NOTE [trace]).
  void time(const std::function<void()>& wait, const char* what = "wait");
  /// Seconds so far; waits for the events still pending (they mark points
  /// already queued on the stream).
  double seconds() const;
  void reset();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace zero
