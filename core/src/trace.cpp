// NOTE [trace]: the recorder and the file.
#include "zero/core/trace.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <new>
#include <mutex>
#include <vector>

#include "zero/core/command_files.h"
#include "zero/core/log.h"

namespace zero::trace {

namespace detail {
std::atomic<bool> g_on{false};
}  // namespace detail

namespace {

struct Event {
  char phase;  // 'X' complete, 'b'/'e' async begin/end
  const char* cat;
  std::string name;
  int64_t ts_us;
  int64_t dur_us;
  int64_t arg;
  int tid;
  int64_t id = 0;  // async pairs
};

struct Recorder {
  std::mutex mutex;
  std::string path;
  int rank = 0;
  int world_size = 1;
  std::vector<Event> events;
  int64_t dropped = 0;
  int64_t max_events = kMaxEvents;
  std::map<int, std::string> thread_names;
  bool exit_hook = false;
  bool streamed = false;  // the trace went to a stream (/dev/stdout): once
};

Recorder& recorder() {
  static Recorder* r = new Recorder();  // outlives every static destructor and atexit flush
  return *r;
}

std::atomic<int> g_next_tid{1};
int this_tid() {
  thread_local const int tid = g_next_tid.fetch_add(1);
  return tid;
}

void add(Event e) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!detail::g_on.load(std::memory_order_relaxed)) return;
  if (static_cast<int64_t>(r.events.size()) >= r.max_events) {
    ++r.dropped;
    return;
  }
  try {
    r.events.push_back(std::move(e));
  } catch (const std::bad_alloc&) {  // from a Span's destructor: counted, never thrown
    ++r.dropped;
  }
}

void append_escaped(std::string& out, const std::string& s) {
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
}

std::string render(const Recorder& r) {
  std::string out;
  out.reserve(r.events.size() * 96 + 512);
  const std::string pid = std::to_string(r.rank);
  out += "{\"displayTimeUnit\": \"ms\", \"otherData\": {\"writer\": \"zero (ZERO_TRACE)\", \"rank\": " + pid +
         ", \"world_size\": " + std::to_string(r.world_size) + ", \"dropped_events\": " + std::to_string(r.dropped) +
         "},\n\"traceEvents\": [\n";
  out += "{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": " + pid + ", \"tid\": 0, \"args\": {\"name\": \"rank " +
         pid + "\"}},\n";
  out += "{\"ph\": \"M\", \"name\": \"process_sort_index\", \"pid\": " + pid + ", \"tid\": 0, \"args\": {\"sort_index\": " +
         pid + "}}";
  for (const auto& [tid, name] : r.thread_names) {
    out += ",\n{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": " + pid + ", \"tid\": " + std::to_string(tid) +
           ", \"args\": {\"name\": \"";
    append_escaped(out, name);
    out += "\"}}";
  }
  for (const Event& e : r.events) {
    out += ",\n{\"ph\": \"";
    out += e.phase;
    out += "\", \"cat\": \"";
    out += e.cat;
    out += "\", \"pid\": " + pid + ", \"tid\": " + std::to_string(e.tid) + ", \"ts\": " + std::to_string(e.ts_us);
    if (e.phase == 'X') out += ", \"dur\": " + std::to_string(e.dur_us);
    // Async ids scoped to the process: the ranks' requests stay apart once merged.
    if (e.phase == 'b' || e.phase == 'e') out += ", \"id2\": {\"local\": " + std::to_string(e.id) + "}";
    out += ", \"name\": \"";
    append_escaped(out, e.name);
    out += "\"";
    if (e.arg >= 0) out += ", \"args\": {\"n\": " + std::to_string(e.arg) + "}";
    out += "}";
  }
  out += "\n]}\n";
  return out;
}

// Writes the whole file beside itself, then renames it over `path`: a reader
// sees the last complete trace, never half of one.
// `final`: the last write of this path (the process ends, or the trace
// moves to another path); a stream is written then only, once.
bool write_locked(Recorder& r, bool final) {
  if (r.path.empty()) return true;
  // NOTE [outputs and inputs]: a stream (ZERO_TRACE=/dev/stdout) takes one
  // whole trace, at the final flush; a link is written through, not replaced.
  const int out = stream_output_fd(r.path);
  if (out >= 0 && (!final || r.streamed)) return true;
  std::string text;
  try {
    text = render(r);
  } catch (const std::bad_alloc&) {
    log::warning("ZERO_TRACE: no memory to render the " + std::to_string(r.events.size()) + " events of rank " +
                 std::to_string(r.rank) + "; " + r.path + " was not written");
    return false;
  }
  if (out >= 0) {
    r.streamed = true;
    if (const std::string problem = write_to_stream(r.path, out, text); !problem.empty()) {
      log::warning("ZERO_TRACE: could not " + problem);
      return false;
    }
    return true;
  }
  struct stat link {};
  const std::string path = ::lstat(r.path.c_str(), &link) == 0 && S_ISLNK(link.st_mode) ? resolved_path(r.path) : r.path;
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  auto fail = [&](const char* what, int64_t offset) {
    const int err = errno;
    log::warning("ZERO_TRACE: could not " + std::string(what) + " " + tmp + (offset >= 0 ? " at offset " + std::to_string(offset) : "") +
                 ": " + std::strerror(err) + " (errno " + std::to_string(err) + "); the trace of rank " +
                 std::to_string(r.rank) + " was not written to " + r.path);
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    return false;
  };
  if (fd < 0) return fail("create", -1);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return fail("write", static_cast<int64_t>(done));
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) return fail("fsync", -1);
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    log::warning("ZERO_TRACE: could not close " + tmp + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")");
    return false;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    log::warning("ZERO_TRACE: could not rename " + tmp + " to " + r.path + ": " + std::strerror(err) + " (errno " +
                 std::to_string(err) + ")");
    return false;
  }
  if (r.dropped > 0)
    log::warning_once("trace-dropped:" + r.path, "ZERO_TRACE: the trace holds its first " + std::to_string(r.max_events) +
                                                      " events; " + std::to_string(r.dropped) +
                                                      " more were dropped (otherData.dropped_events in " + r.path + ")");
  return true;
}

}  // namespace

// The steady clock, so a span's duration never goes negative when the system
// clock is set, shifted once to the system clock's epoch, so the ranks' files
// share a time axis.
int64_t detail::now_us() {
  using std::chrono::duration_cast;
  using std::chrono::microseconds;
  static const int64_t offset =
      duration_cast<microseconds>(std::chrono::system_clock::now().time_since_epoch()).count() -
      duration_cast<microseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  return offset + duration_cast<microseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void detail::record_complete(const char* cat, std::string name, int64_t begin_us, int64_t arg) {
  add({'X', cat, std::move(name), begin_us, now_us() - begin_us, arg, this_tid()});
}

void detail::record_async(const char* cat, const char* name, int64_t begin_us, int64_t arg) {
  static std::atomic<int64_t> next_id{1};
  const int64_t id = next_id.fetch_add(1);
  const int tid = this_tid();
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!detail::g_on.load(std::memory_order_relaxed)) return;
  if (static_cast<int64_t>(r.events.size()) + 2 > r.max_events) {
    r.dropped += 2;
    return;
  }
  try {
    if (r.events.capacity() < r.events.size() + 2)  // both or neither, growing as push_back would
      r.events.reserve(std::max(r.events.size() + 2, 2 * r.events.capacity()));
    r.events.push_back({'b', cat, name, begin_us, 0, arg, tid, id});
    r.events.push_back({'e', cat, name, now_us(), 0, -1, tid, id});
  } catch (const std::bad_alloc&) {
    r.dropped += 2;
  }
}

void detail::record_complete_on(int tid, const char* cat, std::string name, int64_t begin_us, int64_t arg) {
  add({'X', cat, std::move(name), begin_us, now_us() - begin_us, arg, tid});
}

int detail::this_thread() { return this_tid(); }

std::string trace_path_for_rank(const std::string& value, int rank, int world_size) {
  if (world_size <= 1) return value;
  std::string stem = value;
  if (stem.size() > 5 && stem.compare(stem.size() - 5, 5, ".json") == 0) stem.resize(stem.size() - 5);
  return stem + ".rank" + std::to_string(rank) + ".json";
}

void start(const std::string& path, int rank, int world_size, int64_t max_events) {
  Recorder& r = recorder();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (detail::g_on.load() && r.path == path) return;  // a later engine of the same run goes on
    if (detail::g_on.load()) write_locked(r, /*final=*/true);
    r.path = path;
    r.streamed = false;
    r.rank = rank;
    r.world_size = world_size;
    r.events.clear();
    r.dropped = 0;
    r.max_events = max_events;
    if (!r.exit_hook) {
      r.exit_hook = true;
      std::atexit([] { flush(/*final=*/true); });
    }
    r.thread_names.emplace(this_tid(), "training");
    detail::g_on.store(true);
  }
}

bool flush(bool final) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!detail::g_on.load()) return true;
  return write_locked(r, final);
}

void stop() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  detail::g_on.store(false);
  r.path.clear();
  r.events.clear();
  r.dropped = 0;
  r.thread_names.clear();
  r.streamed = false;
}

void name_thread(const std::string& name) {
  if (!on()) return;
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.thread_names[this_tid()] = name;
}

}  // namespace zero::trace
