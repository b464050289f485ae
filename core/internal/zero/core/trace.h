// A timeline of what each rank did, as a Chrome trace (NOTE [trace]).
//
// NOTE [trace]
// ZERO_TRACE=FILE makes the engine record, on each rank, when the host ran
// each part of a step: the forward, backward and step phases; at stage 3 the
// forward and backward of each layer; gathers, gradient reductions,
// device-host copies, the optimizer step of each sub-group, NVMe requests,
// and the waits for them and for the gradient norm, each on the track of the
// thread that ran it. Rank R of a
// run with more than one rank writes FILE.rankR.json (FILE less a ".json"
// end), one rank FILE itself. The file is the JSON that chrome://tracing and
// https://ui.perfetto.dev open: complete ("X") events, and async ("b"/"e")
// pairs for NVMe requests, which overlap (ids local to the process), timed by
// the steady clock from an origin on the system clock's epoch, so the files
// of several ranks line up on one axis (`zero trace merge` joins them). It is
// written, whole and atomically, when an engine ends and at exit. The events
// are held in host memory until then, outside the ledger: about 100 bytes
// each, some 230 a step for a small stage-3 model, at most kMaxEvents (about
// 100 MB); the rest, and any the host had no memory for, are counted in the
// file (otherData.dropped_events) and said in a warning.
//
// On a GPU the spans are host time: when the host issued work or waited for
// it; a wait shows where the host or the compute stream stood still.
//
// Off (no ZERO_TRACE), each site costs one relaxed atomic load: a Span
// builds no name and reads no clock.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

namespace zero::trace {

inline constexpr int64_t kMaxEvents = 1'000'000;

namespace detail {
extern std::atomic<bool> g_on;
void record_complete(const char* cat, std::string name, int64_t begin_us, int64_t arg);
/// The same on the track of thread `tid` (this_thread() where it began).
void record_complete_on(int tid, const char* cat, std::string name, int64_t begin_us, int64_t arg);
int this_thread();
void record_async(const char* cat, const char* name, int64_t begin_us, int64_t arg);
int64_t now_us();
}  // namespace detail

/// Whether a trace is being recorded.
inline bool on() noexcept { return detail::g_on.load(std::memory_order_relaxed); }

/// Starts recording into `path` (the file this rank writes; see
/// trace_path_for_rank) for rank `rank`. A second start with another path
/// writes what was recorded so far to the first and starts afresh.
void start(const std::string& path, int rank, int world_size, int64_t max_events = kMaxEvents);
/// Writes what was recorded so far (the whole trace, atomically). Returns
/// false, after a warning naming the file and errno, when it could not.
/// A stream (ZERO_TRACE=/dev/stdout) takes one whole trace: it is written
/// only by the `final` flush (the process's end: its exit hook, or a run
/// the engine ends at ZERO_STOP_AFTER_STEPS).
bool flush(bool final = false);
/// Stops recording and forgets the events (tests).
void stop();
/// The file rank `rank` writes for ZERO_TRACE=`value`.
std::string trace_path_for_rank(const std::string& value, int rank, int world_size);
/// Names the calling thread in the trace (the engine's is "training").
void name_thread(const std::string& name);

/// A span from its construction to its destruction on the calling thread.
/// `name` is a string literal or a callable returning the name, called only
/// when the trace is on. `arg` (bytes, a sub-group, a layer) goes into the
/// event's args when not negative.
class Span {
 public:
  Span(const char* cat, const char* name, int64_t arg = -1) {
    if (on()) open(cat, name, arg);
  }
  template <class NameFn, class = std::enable_if_t<std::is_invocable_r_v<std::string, NameFn>>>
  Span(const char* cat, NameFn&& name, int64_t arg = -1) {
    if (on()) open(cat, std::forward<NameFn>(name)(), arg);
  }
  ~Span() {
    if (cat_ != nullptr) detail::record_complete(cat_, std::move(name_), begin_us_, arg_);
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  void open(const char* cat, std::string name, int64_t arg) {
    cat_ = cat;
    name_ = std::move(name);
    arg_ = arg;
    begin_us_ = detail::now_us();
  }
  const char* cat_ = nullptr;
  std::string name_;
  int64_t begin_us_ = 0;
  int64_t arg_ = -1;
};

/// A span that does not fit a scope (a layer's forward between two hooks,
/// whose end may come on another thread): open() where it begins, close()
/// where it ends; it is drawn on the thread that opened it. A span opened
/// again before its close restarts; one never closed is not recorded.
class OpenSpan {
 public:
  void open() {
    if (on()) {
      begin_us_ = detail::now_us();
      tid_ = detail::this_thread();
    }
  }
  template <class NameFn>
  void close(const char* cat, NameFn&& name, int64_t arg = -1) {
    if (begin_us_ >= 0 && on()) detail::record_complete_on(tid_, cat, std::forward<NameFn>(name)(), begin_us_, arg);
    begin_us_ = -1;
  }
  bool is_open() const { return begin_us_ >= 0; }

 private:
  int64_t begin_us_ = -1;
  int tid_ = 0;
};

/// Work that began at `begin_us` (detail::now_us(), taken while on()) and
/// ends now, possibly on another thread and overlapping others of its kind
/// (an NVMe request): an async ("b"/"e") pair, a track of its own.
inline void async_done(const char* cat, const char* name, int64_t begin_us, int64_t arg = -1) {
  if (on() && begin_us >= 0) detail::record_async(cat, name, begin_us, arg);
}

}  // namespace zero::trace
