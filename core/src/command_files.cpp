#include "zero/core/command_files.h"

#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>

#include "zero/core/error.h"
#include "zero/core/process.h"

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

}  // namespace

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
  add(whole_folder ? Role::kReadFolder : Role::kReadFile, std::move(what), path);
  if (!entries_.empty() && entries_.back().path == path) entries_.back().from_checkpoint = true;
}
void CommandFiles::writes(std::string what, const std::string& path) { add(Role::kWriteFile, std::move(what), path); }
void CommandFiles::writes_folder(std::string what, const std::string& dir) {
  add(Role::kWriteFolder, std::move(what), dir);
}
void CommandFiles::adds_to_folder(std::string what, const std::string& dir) {
  add(Role::kAddToFolder, std::move(what), dir);
}

void CommandFiles::reads_program_arguments(const std::vector<std::string>& argv) {
  auto regular = [](const std::string& p) {
    struct stat st {};
    return !p.empty() && ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
  };
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (i == 0) {
      if (const std::string program = find_program(a); regular(program)) reads("the program", program);
      continue;
    }
    if (regular(a)) {
      reads("the program's argument", a);
    } else if (const auto eq = a.find('='); eq != std::string::npos && regular(a.substr(eq + 1))) {
      reads("the program's argument " + a.substr(0, eq), a.substr(eq + 1));
    }
  }
}

std::string CommandFiles::clash(const Entry& out, const Entry& in) {
  const bool same = out.where == in.where || (out.exists && in.exists && out.dev == in.dev && out.ino == in.ino);
  const std::string head = out.what + " " + out.path + ": ";
  const std::string input = in.what + " " + in.path;
  if (in.role == Role::kReadFile) {
    if (same)
      return head + "this command reads that file (" + input + "); writing " + out.what +
             " there would destroy it. Choose another path for " + out.what;
    if (out.role == Role::kWriteFolder && within(in.where, out.where))
      return head + "holds " + input + ", which this command reads, and writing the folder would replace what is in it. "
                    "Choose another folder for " + out.what;
    return "";
  }
  // A folder read whole.
  if (within(out.where, in.where))
    return head + (same ? "is " : "lies inside ") + input + ", which this command reads whole. Choose a path outside it for " +
           out.what;
  if (out.role == Role::kWriteFolder && within(in.where, out.where))
    return head + "holds " + input + ", which this command reads, and writing the folder would replace what is in it. "
                  "Choose another folder for " + out.what;
  return "";
}

// What `other` is, lying where a save into checkpoint folder `folder`
// adds its entries, or "".
std::string CommandFiles::in_save_names(const Entry& folder, const Entry& other) {
  if (other.from_checkpoint || other.where == folder.where || !within(other.where, folder.where)) return "";
  const std::string rest = other.where.substr(folder.where == "/" ? 1 : folder.where.size() + 1);
  const std::string first = rest.substr(0, rest.find('/'));
  if (first != "latest" && first.rfind("global_step", 0) != 0 && first[0] != '.') return "";
  return other.what + " " + other.path + ": lies in " + folder.what + " " + folder.path + " under the name " + first +
         ", which a save there replaces (its `latest`, its global_stepN checkpoints and hidden working folders). "
         "Choose a path outside those names";
}

std::string CommandFiles::problem() const {
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
      const bool same = out.where == other.where || (out.exists && other.exists && out.dev == other.dev &&
                                                     out.ino == other.ino);
      if (same && out.role == Role::kWriteFile && other.role == Role::kWriteFile)
        return out.what + " " + out.path + ": is also " + other.what + " (" + other.path +
               "); give each output a path of its own";
      if (same && (out.role == Role::kWriteFolder || other.role == Role::kWriteFolder))
        return out.what + " " + out.path + ": is also " + other.what + " (" + other.path +
               "); give each output a path of its own";
      // A file written into a folder that is exported: the export would replace it.
      if (out.role == Role::kWriteFile && other.role == Role::kWriteFolder && within(out.where, other.where))
        return out.what + " " + out.path + ": lies inside " + other.what + " " + other.path +
               ", which this command writes as a whole; choose a path outside it";
      if (other.role == Role::kWriteFile && out.role == Role::kWriteFolder && within(other.where, out.where))
        return other.what + " " + other.path + ": lies inside " + out.what + " " + out.path +
               ", which this command writes as a whole; choose a path outside it";
    }
  }
  return "";
}

}  // namespace zero
