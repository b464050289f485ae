// NOTE [device streams] (zero/core/streams.h).
#include "zero/core/streams.h"

#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "zero/core/error.h"
#include "zero/core/trace.h"

namespace zero {
namespace {

// kDeferred's copies: held until their event is waited for, in issue order.
struct DeferredQueue {
  struct Pending {
    at::Tensor dst, src;
    bool host_source = false;
    uint64_t seq = 0;
  };
  struct Unconfirmed {  // a host source copied, its event not yet synchronized
    at::Tensor src, snapshot;
    uint64_t seq = 0;
  };
  std::mutex mu;
  std::deque<Pending> pending;
  std::deque<Unconfirmed> unconfirmed;
  uint64_t issued = 0;     // seq of the last copy issued
  uint64_t performed = 0;  // copies up to this seq are done
  uint64_t confirmed = 0;  // ... and the host has waited for them

  uint64_t push(const at::Tensor& dst, const at::Tensor& src, bool host_source) {
    std::lock_guard<std::mutex> lock(mu);
    verify_locked();
    // Aliases: a caller that later points its tensor elsewhere (set_) does not
    // change what this copy reads or writes.
    pending.push_back({dst.detach(), src.detach(), host_source, ++issued});
    return issued;
  }
  void perform_locked(uint64_t upto) {
    at::NoGradGuard no_grad;
    while (!pending.empty() && pending.front().seq <= upto) {
      auto p = std::move(pending.front());
      pending.pop_front();
      p.dst.copy_(p.src);
      if (p.host_source) unconfirmed.push_back({p.src, p.src.clone(), p.seq});
      performed = p.seq;
    }
  }
  // Bit for bit: a source of NaNs (a speculative step's values from
  // gradients that overflowed, NOTE [speculative step]) is unchanged when its
  // bytes are, though NaN != NaN.
  static bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
    if (!a.is_contiguous() || !b.is_contiguous() || a.scalar_type() != b.scalar_type()) return at::equal(a, b);
    return a.numel() == b.numel() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
  }
  // A host source that changed before the host waited for its copy.
  void verify_locked() {
    for (const auto& u : unconfirmed) {
      if (!same_bytes(u.src, u.snapshot)) {
        const uint64_t seq = u.seq;
        unconfirmed.clear();
        throw InternalError("copy #" + std::to_string(seq) + " (CopyMode::kDeferred): its host source of " +
                            std::to_string(u.src.numel()) +
                            " elements was written before the host synchronize()d the copy's event; on a GPU "
                            "that overwrites a buffer an asynchronous copy may still be reading "
                            "(NOTE [device streams])");
      }
    }
  }
  void block(uint64_t seq) {
    std::lock_guard<std::mutex> lock(mu);
    verify_locked();
    perform_locked(seq);
  }
  void synchronize(uint64_t seq) {
    std::lock_guard<std::mutex> lock(mu);
    verify_locked();
    perform_locked(seq);
    while (!unconfirmed.empty() && unconfirmed.front().seq <= seq) unconfirmed.pop_front();
    confirmed = std::max(confirmed, seq);
  }
  bool done(uint64_t seq) {
    std::lock_guard<std::mutex> lock(mu);
    return confirmed >= seq;
  }
};

}  // namespace

struct StreamEvent::State {
  std::optional<at::cuda::CUDAEvent> cuda;  // recorded on a CopyStream
  c10::DeviceIndex device = 0;
  std::shared_ptr<DeferredQueue> queue;  // kDeferred
  uint64_t seq = 0;
  // CUDA: the copy's tensors, kept until its end is known (synchronize, or
  // a query that finds it done), then let go, so that a buffer the caller
  // frees after synchronize() is freed then, not at the stream's next copy.
  std::mutex mu;
  std::vector<at::Tensor> keep;
  void release() {
    std::lock_guard<std::mutex> lock(mu);
    keep.clear();
  }
};

void StreamEvent::synchronize() const {
  if (!state_) return;
  const trace::Span span("wait", "host waits for a copy");
  if (state_->cuda) {
    state_->cuda->synchronize();
    state_->release();
  } else if (state_->queue) {
    state_->queue->synchronize(state_->seq);
  }
}

void StreamEvent::block_current() const {
  if (!state_) return;
  if (state_->cuda) state_->cuda->block(c10::cuda::getCurrentCUDAStream(state_->device));
  else if (state_->queue) state_->queue->block(state_->seq);
}

bool StreamEvent::query() const {
  if (!state_) return true;
  if (state_->cuda) {
    if (!state_->cuda->query()) return false;
    state_->release();
    return true;
  }
  if (state_->queue) return state_->queue->done(state_->seq);
  return true;
}

struct CopyStream::Impl {
  std::optional<c10::cuda::CUDAStream> stream;  // CUDA
  std::shared_ptr<DeferredQueue> queue;          // CPU, kDeferred
  // CUDA: the copies in flight, each event keeping its tensors until its end
  // (StreamEvent::State::keep). recordStream alone would not do: it skips
  // memory the caching allocator did not hand out itself, such as the memory
  // ledger's tensors (which wrap it).
  std::deque<StreamEvent> in_flight;

  void prune() {
    while (!in_flight.empty() && in_flight.front().query()) in_flight.pop_front();
  }

  // The side stream waits for what the current stream has queued so far
  // (unless it is the current stream: inside run()).
  void follow_current(c10::DeviceIndex device) {
    auto current = c10::cuda::getCurrentCUDAStream(device);
    if (current == *stream) return;
    at::cuda::CUDAEvent ready;
    ready.record(current);
    ready.block(*stream);
  }
  StreamEvent record_end(c10::DeviceIndex device) {
    auto st = std::make_shared<StreamEvent::State>();
    st->cuda.emplace();
    st->cuda->record(*stream);
    st->device = device;
    return StreamEvent(std::move(st));
  }
};

CopyStream::CopyStream(at::Device device, CopyMode cpu_mode) : device_(device), impl_(std::make_unique<Impl>()) {
  if (device.is_cuda()) {
    const c10::DeviceIndex index = device.has_index() ? device.index() : c10::cuda::current_device();
    device_ = at::Device(at::kCUDA, index);
    impl_->stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index);
  } else if (cpu_mode == CopyMode::kDeferred) {
    impl_->queue = std::make_shared<DeferredQueue>();
  }
}

CopyStream::~CopyStream() {
  if (!impl_) return;
  if (impl_->stream) {
    try {
      impl_->stream->synchronize();  // the copies in flight end before their tensors go
    } catch (const std::exception&) {
    }
  }
  if (impl_->queue) {
    std::lock_guard<std::mutex> lock(impl_->queue->mu);
    impl_->queue->perform_locked(impl_->queue->issued);
  }
}
CopyStream::CopyStream(CopyStream&&) noexcept = default;
CopyStream& CopyStream::operator=(CopyStream&&) noexcept = default;

void CopyStream::record(const at::Tensor& t) const {
  if (!impl_->stream || !t.defined() || !t.is_cuda() || !t.has_storage()) return;
  c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), *impl_->stream);
}

void CopyStream::record_on_current(const at::Tensor& t) const {
  if (!impl_->stream || !t.defined() || !t.is_cuda() || !t.has_storage()) return;
  c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(),
                                                c10::cuda::getCurrentCUDAStream(device_.index()));
}

StreamEvent CopyStream::copy(const at::Tensor& dst, const at::Tensor& src, bool host_source) {
  const trace::Span span(
      "copy", [&] { return std::string(src.is_cuda() ? "device" : "host") + " to " + (dst.is_cuda() ? "device" : "host"); },
      src.numel() * static_cast<int64_t>(src.element_size()));
  bytes_ += src.numel() * static_cast<int64_t>(src.element_size());
  if (impl_->stream) {
    const c10::DeviceIndex index = device_.index();
    impl_->follow_current(index);
    {
      const c10::cuda::CUDAStreamGuard guard(*impl_->stream);
      at::NoGradGuard no_grad;
      dst.copy_(src, /*non_blocking=*/true);
    }
    record(dst);
    record(src);
    StreamEvent end = impl_->record_end(index);
    end.state_->keep = {dst.detach(), src.detach()};
    impl_->prune();
    impl_->in_flight.push_back(end);
    return end;
  }
  if (impl_->queue) {
    auto st = std::make_shared<StreamEvent::State>();
    st->queue = impl_->queue;
    st->seq = impl_->queue->push(dst, src, host_source);
    return StreamEvent(std::move(st));
  }
  at::NoGradGuard no_grad;
  dst.copy_(src);
  return {};
}

StreamEvent CopyStream::run(const std::function<void()>& fn) {
  if (impl_->stream) {
    const c10::DeviceIndex index = device_.index();
    impl_->follow_current(index);
    {
      const c10::cuda::CUDAStreamGuard guard(*impl_->stream);
      fn();
    }
    return impl_->record_end(index);
  }
  fn();
  if (impl_->queue) {  // the end of the copies fn issued here
    auto st = std::make_shared<StreamEvent::State>();
    st->queue = impl_->queue;
    std::lock_guard<std::mutex> lock(impl_->queue->mu);
    st->seq = impl_->queue->issued;
    return StreamEvent(std::move(st));
  }
  return {};
}

// Each wait counts once: on the CPU its host time; on CUDA the larger of its
// host time and the stream's stall between events recorded before and after
// it. A wait that blocks the host (Gloo, or a finish() that synchronizes)
// leaves an idle stream "stalled" for the same time, and one that blocks only
// the stream (NCCL) takes no host time: the sum of the two would count the
// first twice.
struct WaitClock::Impl {
  struct Pending {
    at::cuda::CUDAEvent before, after;
    double host_s = 0;
  };
  bool cuda = false;
  c10::DeviceIndex device = 0;
  mutable double total_s = 0;
  // Waits whose stream-side events are not read yet (done in order).
  mutable std::deque<Pending> pending;

  void settle(Pending& p) const {
    const double stall_s = static_cast<double>(p.before.elapsed_time(p.after)) / 1e3;
    total_s += std::max(p.host_s, stall_s);
  }

  void resolve(bool wait_all) const {
    while (!pending.empty()) {
      auto& p = pending.front();
      if (!p.after.query()) {
        if (!wait_all) return;
        p.after.synchronize();
      }
      settle(p);
      pending.pop_front();
    }
  }
};

WaitClock::WaitClock(at::Device device) : impl_(std::make_unique<Impl>()) {
  impl_->cuda = device.is_cuda();
  if (impl_->cuda) impl_->device = device.has_index() ? device.index() : c10::cuda::current_device();
}
WaitClock::~WaitClock() = default;
WaitClock::WaitClock(WaitClock&&) noexcept = default;
WaitClock& WaitClock::operator=(WaitClock&&) noexcept = default;

void WaitClock::time(const std::function<void()>& wait, const char* what) {
  const trace::Span span("wait", what);
  auto& s = *impl_;
  std::optional<at::cuda::CUDAEvent> before;
  if (s.cuda) {
    before.emplace(cudaEventDefault);  // timing on
    before->record(c10::cuda::getCurrentCUDAStream(s.device));
  }
  const auto t0 = std::chrono::steady_clock::now();
  wait();
  const double host_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!s.cuda) {
    s.total_s += host_s;
    return;
  }
  at::cuda::CUDAEvent after(cudaEventDefault);
  after.record(c10::cuda::getCurrentCUDAStream(s.device));
  s.pending.push_back(Impl::Pending{std::move(*before), std::move(after), host_s});
  // Bounded: past 256, wait for the oldest (long done, as a rule).
  while (s.pending.size() > 256) {
    auto& p = s.pending.front();
    p.after.synchronize();
    s.settle(p);
    s.pending.pop_front();
  }
  s.resolve(/*wait_all=*/false);
}

double WaitClock::seconds() const {
  impl_->resolve(/*wait_all=*/true);
  return impl_->total_s;
}

void WaitClock::reset() {
  impl_->resolve(/*wait_all=*/true);
  impl_->total_s = 0;
}

}  // namespace zero
