// NOTE [swap files] in swap_folder.h.
#include "zero/offload/swap_folder.h"

#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "zero/core/error.h"
#include "zero/core/text.h"

namespace zero::offload {
namespace {

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

std::string host_name() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "host";
  return buf;
}

// Removes the folder's files by name (those not yet unlinked) and the folder.
class FolderGuard {
 public:
  explicit FolderGuard(std::string dir) : dir_(std::move(dir)) {}
  ~FolderGuard() {
    for (const auto& f : files_) ::unlink(f.c_str());
    ::rmdir(dir_.c_str());
  }
  void add(const std::string& f) { files_.push_back(f); }
  void forget(const std::string& f) { std::erase(files_, f); }

 private:
  std::string dir_;
  std::vector<std::string> files_;
};

// The name of a kernel file system that cannot hold swap files, or null.
const char* pseudo_filesystem(const std::string& path) {
  struct statfs fs {};
  if (::statfs(path.c_str(), &fs) != 0) return nullptr;
  switch (static_cast<unsigned long>(fs.f_type)) {
    case 0x9fa0: return "procfs (/proc)";
    case 0x62656572: return "sysfs (/sys)";
    case 0x1cd1: return "devpts";
    case 0x27e0eb: return "cgroup";
    case 0x63677270: return "cgroup2";
    case 0x64626720: return "debugfs";
    case 0x73636673: return "securityfs";
    default: return nullptr;
  }
}

}  // namespace

int64_t free_bytes(const std::string& path) {
  struct statvfs s {};
  if (::statvfs(path.c_str(), &s) != 0) return -1;
  return static_cast<int64_t>(s.f_bavail) * static_cast<int64_t>(s.f_frsize);
}

std::vector<std::shared_ptr<AioFile>> create_swap_files(const std::string& nvme_path, const std::string& config_key,
                                                        const std::string& tag, const std::string& what,
                                                        const std::vector<SwapFileSpec>& files) {
  if (nvme_path.empty()) {
    throw ConfigError({config_key + ": expected the path of a folder on a fast disk for the swap files; got none"});
  }
  struct stat st {};
  if (::stat(nvme_path.c_str(), &st) != 0) {
    throw ConfigError({config_key + ": " + nvme_path + " cannot be used: " + errno_text(errno) +
                       "; create the folder or point nvme_path at an existing one"});
  }
  if (!S_ISDIR(st.st_mode)) throw ConfigError({config_key + ": " + nvme_path + " is not a folder"});
  if (const char* pseudo = pseudo_filesystem(nvme_path)) {
    throw ConfigError({config_key + ": " + nvme_path + " is on " + pseudo +
                       ", a kernel interface that holds no files; point nvme_path at a folder on a disk"});
  }
  if (::access(nvme_path.c_str(), W_OK | X_OK) != 0) {
    throw ConfigError({config_key + ": " + nvme_path + " is not writable by this process: " + errno_text(errno)});
  }
  std::random_device rd;
  const std::string dir = nvme_path + "/zero-swap-" + host_name() + "-" + std::to_string(::getpid()) + "-" + tag +
                          "-" + std::to_string(rd() % 100000);
  if (::mkdir(dir.c_str(), 0700) != 0) {
    const int err = errno;
    if (err == EROFS || err == EACCES || err == EPERM || err == ENOENT) {
      throw ConfigError({config_key + ": cannot create a folder in " + nvme_path + ": " + errno_text(err) +
                         (err == EROFS ? " (a read-only file system)" : "")});
    }
    throw IoError("create the swap folder " + dir + ": " + errno_text(err));
  }
  FolderGuard guard(dir);
  int64_t needed = 0;
  for (const auto& f : files) needed += aio_aligned(f.bytes);
  const int64_t free = free_bytes(nvme_path);
  if (free >= 0 && needed > free) {
    throw IoError(config_key + ": " + nvme_path + " has " + format_bytes(free) + " free; the swap files of " + what +
                  " need " + format_bytes(needed) + ". Free space there, choose another nvme_path, or spread the "
                  "model over more ranks (each holds 1/N of the states)");
  }
  std::vector<std::shared_ptr<AioFile>> out;
  for (const auto& f : files) {
    const std::string path = dir + "/" + f.name;
    guard.add(path);
    auto file = AioFile::open(path, /*create=*/true);
    file->reserve(f.bytes);  // names the path, the size and ENOSPC
    if (::unlink(path.c_str()) != 0) throw IoError("unlink the swap file " + path + ": " + errno_text(errno));
    guard.forget(path);
    out.push_back(std::move(file));
  }
  return out;  // the guard removes the (now empty) folder
}

}  // namespace zero::offload
