#include "zero/core/command_files.h"

#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fcntl.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <mutex>
#include <sstream>

#include "zero/core/dist_env.h"
#include "zero/core/error.h"
#include "zero/core/process.h"
#include "zero/core/trace.h"

namespace zero {
namespace {

std::vector<std::string> components(const std::string& path) {
  std::vector<std::string> out;
  std::stringstream s(path);
  for (std::string part; std::getline(s, part, '/');)
    if (!part.empty()) out.push_back(part);
  return out;
}

std::string real(const std::string& path) {
  char buf[PATH_MAX];
  return ::realpath(path.c_str(), buf) != nullptr ? std::string(buf) : std::string();
}

// `child` is `folder` or lies inside it.
bool within(const std::string& child, const std::string& folder) {
  if (child == folder) return true;
  if (folder == "/") return !child.empty();
  return child.size() > folder.size() && child.compare(0, folder.size(), folder) == 0 && child[folder.size()] == '/';
}

// The kernel's folder a resolved path lies in (/dev, /proc, /sys), or null.
const char* kernel_root(const std::string& where) {
  if (within(where, "/dev/shm")) return nullptr;  // a tmpfs for files
  for (const char* root : {"/dev", "/proc", "/sys"})
    if (within(where, root)) return root;
  return nullptr;
}

std::mutex g_declared_mutex;
CommandFiles& declared_files() {
  static CommandFiles files;
  return files;
}

}  // namespace

std::string write_to_stream(const std::string& path, int fd, const std::string& data) {
  std::cout.flush();
  std::fflush(nullptr);  // what the program printed before comes first
  for (size_t done = 0; done < data.size();) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : ENOSPC;
      return "write " + path + " (descriptor " + std::to_string(fd) + ") at offset " + std::to_string(done) + ": " +
             std::strerror(err) + " (errno " + std::to_string(err) + ")";
    }
    done += static_cast<size_t>(n);
  }
  return "";
}

int stream_output_fd(const std::string& path_in) {
  std::string path = path_in;
  for (int hop = 0; hop < 8; ++hop) {
    int fd = -1;
    if (path == "/dev/stdout") fd = 1;
    if (path == "/dev/stderr") fd = 2;
    for (const std::string prefix : {"/dev/fd/", "/proc/self/fd/"})
      if (path.size() > prefix.size() && path.size() < prefix.size() + 7 && path.compare(0, prefix.size(), prefix) == 0 &&
          path.find_first_not_of("0123456789", prefix.size()) == std::string::npos)
        fd = std::stoi(path.substr(prefix.size()));
    if (fd >= 0) {
      // Open for writing: stdin, or a closed descriptor, is no stream to write.
      const int flags = ::fcntl(fd, F_GETFL);
      return fd >= 1 && flags >= 0 && (flags & O_ACCMODE) != O_RDONLY ? fd : -1;
    }
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return -1;
    char target[PATH_MAX];
    const ssize_t n = ::readlink(path.c_str(), target, sizeof target - 1);
    if (n <= 0) return -1;
    std::string next(target, static_cast<size_t>(n));
    if (next[0] != '/') {
      const auto slash = path.rfind('/');
      next = (slash == std::string::npos ? std::string(".") : path.substr(0, slash)) + "/" + next;
    }
    path = next;
  }
  return -1;
}

std::string output_place_problem(const std::string& what, const std::string& path) {
  if (path.empty() || stream_output_fd(path) >= 0) return "";
  const std::string where = resolved_path(path);
  const std::string head = what == path ? path + ": " : what + " " + path + ": ";
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode))
    return head + "is not a regular file (a device, pipe or socket), which an output would replace; expected a file "
                  "name (or /dev/stdout)";
  if (const char* root = kernel_root(where))
    return head + "is under " + root + (where == path ? std::string() : " (it is " + where + ")") +
           ", which holds devices and the kernel's files, not files to write; an output goes there only as a stream "
           "(/dev/stdout, /dev/stderr, /dev/fd/N). Choose a file elsewhere";
  return "";
}

std::string run_report_file(const std::string& prefix, long long rank) { return prefix + ".rank" + std::to_string(rank); }

std::string input_file_problem(const std::string& what, const std::string& path) {
  const std::string head = what == path ? path + ": " : what + " " + path + ": ";
  if (path.empty()) return what + ": expected a file name; got \"\"";
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    struct stat lst {};
    if (err == ENOENT && ::lstat(path.c_str(), &lst) == 0 && S_ISLNK(lst.st_mode)) {
      char target[PATH_MAX];
      const ssize_t n = ::readlink(path.c_str(), target, sizeof target - 1);
      return head + "a dangling link (to " + (n > 0 ? std::string(target, static_cast<size_t>(n)) : "?") +
             ", which does not exist); expected a file";
    }
    if (err == ELOOP) return head + "a loop of symbolic links; expected a file";
    if (err == ENOENT) return head + std::strerror(err) + " (errno " + std::to_string(err) + ")";
    if (err == ENOTDIR) return head + "a part of the path is a file, not a folder";
    return head + "cannot reach it: " + std::strerror(err) + " (errno " + std::to_string(err) + ")";
  }
  if (S_ISDIR(st.st_mode)) return head + "is a folder; expected a file";
  if (!S_ISREG(st.st_mode)) return head + "is not a regular file (a device, pipe or socket); expected a file";
  if (::access(path.c_str(), R_OK) != 0) {
    const int err = errno;
    return head + "cannot read it: " + std::strerror(err) + " (errno " + std::to_string(err) + ")";
  }
  return "";
}

std::string config_file_argument(const std::string& flag, const std::string& value) {
  const auto first = value.find_first_not_of(" \t\r\n");
  if (first == std::string::npos || value[first] != '{') return value;
  struct stat st {};
  if (::stat(value.c_str(), &st) == 0) return "./" + value;
  std::string shown = value;
  if (shown.size() > 40) shown = shown.substr(0, 37).append("...");
  throw UsageError(flag + " " + shown + ": no such file; " + flag + " takes the path of a DeepSpeed config file (JSON "
                   "text in place of a file is for C++ callers of zero::initialize)");
}

std::string resolved_path(const std::string& path_in) {
  if (path_in.empty()) return "";
  std::string path = path_in;
  if (path[0] != '/') {
    char cwd[PATH_MAX];
    if (::getcwd(cwd, sizeof cwd) == nullptr) return path_in;
    path = std::string(cwd) + "/" + path;
  }
  if (std::string r = real(path); !r.empty()) return r;
  // A dangling link is where its target would be (a write through it makes
  // the target), followed link by link.
  for (int hop = 0; hop < 40; ++hop) {
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) break;
    char target[PATH_MAX];
    const ssize_t n = ::readlink(path.c_str(), target, sizeof target - 1);
    if (n <= 0) break;
    std::string next(target, static_cast<size_t>(n));
    if (next[0] != '/') next = path.substr(0, path.rfind('/')) + "/" + next;
    path = next;
    if (std::string r = real(path); !r.empty()) return r;
  }
  // The deepest ancestor that exists, then the rest by name.
  const auto parts = components(path);
  size_t have = parts.size();
  std::string base;
  while (have > 0) {
    std::string prefix;
    for (size_t i = 0; i + 1 < have; ++i) prefix += "/" + parts[i];
    base = real(prefix.empty() ? "/" : prefix);
    --have;
    if (!base.empty()) break;
  }
  if (base.empty()) base = "/";
  std::vector<std::string> out = components(base);
  for (size_t i = have; i < parts.size(); ++i) {
    if (parts[i] == ".") continue;
    if (parts[i] == "..") {
      if (!out.empty()) out.pop_back();
      continue;
    }
    out.push_back(parts[i]);
  }
  std::string joined;
  for (const auto& p : out) joined += "/" + p;
  return joined.empty() ? "/" : joined;
}

void CommandFiles::add(Role role, std::string what, const std::string& path) {
  if (path.empty()) return;
  // A stream is written where it stands; nothing is replaced.
  if (role == Role::kWriteFile && stream_output_fd(path) >= 0) return;
  // The same entry again (the engine adds the environment's outputs to what
  // a program declared with them) is one entry.
  for (const Entry& e : entries_)
    if (e.role == role && e.what == what && e.path == path) return;
  Entry e;
  e.role = role;
  e.what = std::move(what);
  e.path = path;
  e.where = resolved_path(path);
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    e.exists = true;
    e.dev = st.st_dev;
    e.ino = st.st_ino;
  }
  entries_.push_back(std::move(e));
}

void CommandFiles::reads(std::string what, const std::string& path) { add(Role::kReadFile, std::move(what), path); }
void CommandFiles::reads_folder(std::string what, const std::string& dir) {
  add(Role::kReadFolder, std::move(what), dir);
}
void CommandFiles::reads_checkpoint(std::string what, const std::string& path, bool whole_folder) {
  const Role role = whole_folder ? Role::kReadFolder : Role::kReadFile;
  add(role, what, path);
  for (Entry& e : entries_)
    if (e.role == role && e.what == what && e.path == path) e.from_checkpoint = true;
}
void CommandFiles::writes(std::string what, const std::string& path) { add(Role::kWriteFile, std::move(what), path); }
void CommandFiles::writes_folder(std::string what, const std::string& dir) {
  add(Role::kWriteFolder, std::move(what), dir);
}
void CommandFiles::adds_to_folder(std::string what, const std::string& dir) {
  add(Role::kAddToFolder, std::move(what), dir);
}

void CommandFiles::writes_environment_outputs(int rank, int world_size) {
  if (rank < 0 || world_size < 0) {
    DistEnv env;
    try {
      env = DistEnv::from_environment();
    } catch (const std::exception&) {  // the engine names the variable
    }
    if (rank < 0) rank = env.rank;
    if (world_size < 0) world_size = env.world_size;
  }
  const std::string r = std::to_string(rank);
  if (const char* v = std::getenv("ZERO_TRACE"); v != nullptr && *v != '\0') {
    if (world_size > 1 && stream_output_fd(v) >= 0 && refused_.empty())
      refused_ = std::string("ZERO_TRACE=") + v + ": a stream, and each of the " + std::to_string(world_size) +
                 " ranks writes a trace of its own (FILE.rankR.json): give a file name, and join the ranks' files "
                 "with `zero trace merge`";
    writes("ZERO_TRACE's file for rank " + r, trace::trace_path_for_rank(v, rank, world_size));
  }
  if (const char* v = std::getenv("ZERO_RUN_REPORT"); v != nullptr && *v != '\0') {
    if (stream_output_fd(v) >= 0 && refused_.empty())
      refused_ = std::string("ZERO_RUN_REPORT=") + v + ": a stream; the variable names a file name prefix, and rank "
                 "R writes PREFIX.rankR (such as /tmp/report)";
    writes("ZERO_RUN_REPORT's file for rank " + r, run_report_file(v, rank));
  }
}

void CommandFiles::declare(const CommandFiles& files) {
  std::lock_guard<std::mutex> lock(g_declared_mutex);
  declared_files() = files;
}

CommandFiles CommandFiles::declared() {
  std::lock_guard<std::mutex> lock(g_declared_mutex);
  return declared_files();
}

void CommandFiles::reads_program_arguments(const std::vector<std::string>& argv) {
  auto kind = [](const std::string& p) -> int {  // 1: a regular file, 2: a folder, 0: neither
    struct stat st {};
    if (p.empty() || ::stat(p.c_str(), &st) != 0) return 0;
    return S_ISREG(st.st_mode) ? 1 : S_ISDIR(st.st_mode) ? 2 : 0;
  };
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (i == 0) {
      if (const std::string program = find_program(a); kind(program) == 1) reads("the program", program);
      continue;
    }
    std::string what = "the program's argument", path = a;
    if (kind(a) == 0)
      if (const auto eq = a.find('='); eq != std::string::npos) {
        what += " " + a.substr(0, eq);
        path = a.substr(eq + 1);
      }
    if (const int k = kind(path); k == 1) {
      reads(what, path);
    } else if (k == 2) {
      // The working folder, or one that holds it (`--data .`), is where the
      // command's own outputs lie: not counted, or no rerun could write them.
      const std::string here = resolved_path("."), folder = resolved_path(path);
      if (!within(here, folder)) add(Role::kReadFolderFiles, what + " (a folder)", path);
    }
  }
}

bool CommandFiles::same(const Entry& a, const Entry& b) {
  return a.where == b.where || (a.exists && b.exists && a.dev == b.dev && a.ino == b.ino);
}

// `child` is `folder` or lies inside it: by path, or by device and inode
// of the child's existing ancestors (a bind mount of the folder, a link).
bool CommandFiles::inside(const Entry& child, const Entry& folder) {
  if (within(child.where, folder.where)) return true;
  if (!folder.exists) return false;
  std::string at = child.where;
  while (!at.empty()) {
    struct stat st {};
    if (::stat(at.c_str(), &st) == 0 && st.st_dev == folder.dev && st.st_ino == folder.ino) return true;
    const auto slash = at.rfind('/');
    if (at == "/" || slash == std::string::npos) return false;  // (a relative path: no working folder)
    at = slash == 0 ? "/" : at.substr(0, slash);
  }
  return false;
}

std::string CommandFiles::clash(const Entry& out, const Entry& in) {
  const bool is_same = same(out, in);
  const std::string head = out.what + " " + out.path + ": ";
  const std::string input = in.what + " " + in.path;
  const std::string holds = head + "holds " + input + ", which this command reads, and writing the folder would "
                                   "replace what is in it. Choose another folder for " + out.what;
  if (in.role == Role::kReadFile) {
    if (is_same)
      return head + "this command reads that file (" + input + "); writing " + out.what +
             " there would destroy it. Choose another path for " + out.what;
    if (out.role == Role::kWriteFolder && inside(in, out)) return holds;
    return "";
  }
  if (in.role == Role::kReadFolderFiles) {
    // What the folder holds now may be read; a new name in it is not.
    if (out.role == Role::kWriteFile && out.exists && !is_same && inside(out, in))
      return head + "lies in " + input + ", and the program may read it; writing " + out.what +
             " there would replace it. Choose a path outside that folder for " + out.what;
    if (out.role == Role::kWriteFolder && inside(in, out)) return holds;
    return "";
  }
  // A folder read whole.
  if (inside(out, in))
    return head + (is_same ? "is " : "lies inside ") + input + ", which this command reads whole. Choose a path outside it for " +
           out.what;
  if (out.role == Role::kWriteFolder && inside(in, out)) return holds;
  return "";
}

// The name under which `child` lies in `folder` (its first component
// there), "" when it does not lie inside it or is the folder; by path, or
// by device and inode of the child's ancestors.
static std::string name_inside(const std::string& child_where, const std::string& folder_where, bool folder_exists,
                               unsigned long long dev, unsigned long long ino) {
  std::string at = child_where, first;
  while (!at.empty() && at != "/") {
    if (at == folder_where) return first;
    struct stat st {};
    if (folder_exists && ::stat(at.c_str(), &st) == 0 && st.st_dev == dev && st.st_ino == ino) return first;
    const auto slash = at.rfind('/');
    if (slash == std::string::npos) return "";  // (a relative path: no working folder)
    first = at.substr(slash + 1);
    at = slash == 0 ? "/" : at.substr(0, slash);
  }
  return folder_where == "/" ? first : "";
}

// What `other` is, lying where a save into checkpoint folder `folder`
// adds its entries, or "".
std::string CommandFiles::in_save_names(const Entry& folder, const Entry& other) {
  if (other.from_checkpoint || same(other, folder)) return "";
  const std::string first = name_inside(other.where, folder.where, folder.exists, folder.dev, folder.ino);
  if (first.empty()) return "";
  if (first != "latest" && first.rfind("global_step", 0) != 0 && first[0] != '.') return "";
  return other.what + " " + other.path + ": lies in " + folder.what + " " + folder.path + " under the name " + first +
         ", which a save there replaces (its `latest`, its global_stepN checkpoints and hidden working folders). "
         "Choose a path outside those names";
}

std::string CommandFiles::problem() const {
  if (!refused_.empty()) return refused_;
  auto is_output = [](Role r) { return r == Role::kWriteFile || r == Role::kWriteFolder || r == Role::kAddToFolder; };
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& out = entries_[i];
    if (!is_output(out.role)) continue;
    if (out.role == Role::kAddToFolder)
      for (const Entry& other : entries_)
        if (std::string c = in_save_names(out, other); !c.empty()) return c;
    for (const Entry& in : entries_) {
      if (is_output(in.role)) continue;
      if (std::string c = clash(out, in); !c.empty()) return c;
    }
    for (size_t j = i + 1; j < entries_.size(); ++j) {
      const Entry& other = entries_[j];
      if (!is_output(other.role)) continue;
      if (same(out, other))
        return out.what + " " + out.path + ": is also " + other.what + " (" + other.path +
               "); give each output a path of its own";
      // An output inside a folder written as a whole: the export would replace it.
      for (const auto& [a, b] : {std::pair<const Entry*, const Entry*>{&out, &other}, {&other, &out}})
        if (b->role == Role::kWriteFolder && inside(*a, *b))
          return a->what + " " + a->path + ": lies inside " + b->what + " " + b->path +
                 ", which this command writes as a whole; choose a path outside it";
    }
  }
  return "";
}

}  // namespace zero
