// Error types thrown by every part of zero.
//
// LibTorch reports failures by throwing, and so does zero. One base class,
// zero::Error, with a kind per failure domain so callers can catch broadly or
// narrowly. Every message a user can trigger names the thing (config key, file,
// collective) and what was expected; see STYLE.md "Errors".
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace zero {

/// The failure domain of a zero::Error, one per subclass: config, usage, I/O,
/// out of memory, communication, divergence, unsupported feature, internal bug.
enum class ErrorKind { kConfig, kUsage, kIo, kOutOfMemory, kCommunication, kDiverged, kUnsupported, kInternal };

/// Base of all zero exceptions. what() is the full, user-facing message.
class Error : public std::runtime_error {
 public:
  /// An error whose kind() is `kind` and whose what() is `message`. The
  /// subclasses set the kind; an Error made directly with kOutOfMemory is
  /// not counted by out_of_memory_count().
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  /// The failure domain, for callers that catch zero::Error broadly.
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

/// A DeepSpeed config (or another config file: `subject` names what it is,
/// "a Hugging Face config.json") that cannot be used. Holds every problem
/// found in the file (one line each, "file: json.path: expected ...; got
/// ..."), so a user fixes them all in one pass; what() joins them under
/// "N problems in SUBJECT:".
class ConfigError : public Error {
 public:
  /// Takes the problems found, one line each. what() is the one line when
  /// there is one, else "N problems in SUBJECT:" and the lines indented.
  explicit ConfigError(std::vector<std::string> problems, const std::string& subject = "the DeepSpeed config");
  /// Every problem found, one line each, in the order given.
  const std::vector<std::string>& problems() const noexcept { return problems_; }

 private:
  std::vector<std::string> problems_;
};

/// The program used the API in a way it cannot work: a loss that is not a
/// scalar, gradients made by a plain loss.backward(), a layer that another
/// engine holds. The message says what to call instead.
class UsageError : public Error {
 public:
  /// An error of kind kUsage whose what() is `message`.
  explicit UsageError(const std::string& message) : Error(ErrorKind::kUsage, message) {}
};

/// Training cannot go on: fp16's dynamic loss scale is at its minimum and the
/// gradients still overflow. The message names the scale and the keys that help.
class DivergedError : public Error {
 public:
  /// An error of kind kDiverged whose what() is `message`.
  explicit DivergedError(const std::string& message) : Error(ErrorKind::kDiverged, message) {}
};

/// A failed file or device operation: message names operation, path, offset,
/// byte count and strerror(errno).
class IoError : public Error {
 public:
  /// An error of kind kIo whose what() is `message`.
  explicit IoError(const std::string& message) : Error(ErrorKind::kIo, message) {}
};

/// An allocation that would exceed a tier's limit: message names what was
/// needed, what is in use, the limit, and the config key that would help.
/// Each one made is remembered (last_out_of_memory), so a run report can
/// say a run ran out of memory even when the program caught the error.
class OutOfMemoryError : public Error {
 public:
  /// An error of kind kOutOfMemory whose what() is `message`; records it as
  /// the process's last one (thread-safe).
  explicit OutOfMemoryError(const std::string& message);
};

/// The message of the last OutOfMemoryError this process made ("" if none).
/// Thread-safe.
std::string last_out_of_memory();
/// How many OutOfMemoryError objects this process has made, caught or not.
/// Thread-safe.
int64_t out_of_memory_count();

/// The tier an out-of-memory message is about: "device" (also CUDA's and
/// the emulated device's), "pinned_host", "host", "nvme", or "" when the
/// text says none.
std::string out_of_memory_tier(const std::string& message);

/// A collective or rendezvous that failed or timed out; names the operation
/// and the rank.
class CommunicationError : public Error {
 public:
  /// An error of kind kCommunication whose what() is `message`.
  explicit CommunicationError(const std::string& message)
      : Error(ErrorKind::kCommunication, message) {}
};

/// A DeepSpeed feature this runtime does not implement, used where ignoring it
/// would change training.
class UnsupportedError : public Error {
 public:
  /// An error of kind kUnsupported whose what() is `message`.
  explicit UnsupportedError(const std::string& message)
      : Error(ErrorKind::kUnsupported, message) {}
};

/// A broken invariant inside zero (a bug, not a user error). Thrown by
/// ZERO_CHECK with file and line.
class InternalError : public Error {
 public:
  /// An error of kind kInternal whose what() is `message`.
  explicit InternalError(const std::string& message) : Error(ErrorKind::kInternal, message) {}
};

/// The message of `e` for a person: what() without the C++ stack trace that
/// LibTorch appends to its errors ("Exception raised from ...", "frame #N:"
/// lines), also where such an error is quoted inside another message. The
/// trace is kept when the environment sets ZERO_DEBUG=1 (or LibTorch's
/// TORCH_SHOW_CPP_STACKTRACES=1).
std::string error_text(const std::exception& e);

/// The same for a message already taken from what().
std::string error_text(const std::string& what);

namespace detail {
/// ZERO_CHECK's failure path: throws InternalError naming `file`:`line`, the
/// `condition` that failed and `message`, and asking for a bug report.
[[noreturn]] void throw_internal(const char* file, int line, const char* condition,
                                 const std::string& message);
}  // namespace detail

}  // namespace zero

/// Always-on invariant check (also in release builds). Never use it on user
/// input or on a system call's result: those get their own error kinds.
#define ZERO_CHECK(cond, msg)                                                 \
  do {                                                                        \
    if (!(cond)) ::zero::detail::throw_internal(__FILE__, __LINE__, #cond, (msg)); \
  } while (0)
