#include "zero/snapshots/hf_export.h"

#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
#include <nlohmann/json.hpp>

#include "zero/core/error.h"
#include "zero/core/log.h"

namespace zero::ckpt {
namespace {

constexpr const char* kRecord = ".zero-export.json";

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

// A name an export writes: model.safetensors, its index, a shard
// model-NNNNN-of-NNNNN.safetensors, and config.json when one is written.
bool export_name(const std::string& name, bool with_config) {
  if (name == "model.safetensors" || name == "model.safetensors.index.json") return true;
  if (with_config && name == "config.json") return true;
  if (name.size() != 32 || name.compare(0, 6, "model-") != 0 || name.compare(11, 4, "-of-") != 0 ||
      name.compare(20, 12, ".safetensors") != 0)
    return false;
  for (size_t i : {6, 7, 8, 9, 10, 15, 16, 17, 18, 19})
    if (name[i] < '0' || name[i] > '9') return false;
  return true;
}

// A file's size and modification time, as the record keeps them: a file an
// export wrote that another tool has changed since is not the export's.
nlohmann::json stamp_of(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return nullptr;
  return {{"bytes", static_cast<int64_t>(st.st_size)},
          {"mtime_ns", static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec}};
}

struct Recorded {
  std::set<std::string> files;    // the earlier export's, as it wrote them
  std::set<std::string> changed;  // recorded, but changed since (or no longer a file)
};

// The files the earlier export to `dir` recorded (none without a record).
Recorded recorded(const std::string& dir) {
  const std::string path = dir + "/" + kRecord;
  if (file_size(path) < 0) return {};
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_small_file(path));
  } catch (const IoError&) {
    throw;
  } catch (const std::exception& e) {
    throw IoError(path + ": not valid JSON (" + e.what() + "): the record of an earlier export is damaged; remove it "
                  "and that export's files, or export to another folder");
  }
  Recorded out;
  if (!j.is_object() || !j.contains("files") || !j.at("files").is_array())
    throw IoError(path + ": has no \"files\" list: the record of an earlier export is damaged; remove it and that "
                  "export's files, or export to another folder");
  // Only names an export writes: a damaged or edited record cannot make an
  // export remove the user's tokenizer.json.
  // A record without stamps (an export before they were kept) is trusted.
  const nlohmann::json stamps = j.contains("stamps") && j.at("stamps").is_object() ? j.at("stamps") : nlohmann::json();
  for (const auto& f : j.at("files")) {
    if (!f.is_string() || !export_name(f.get<std::string>(), /*with_config=*/true)) continue;
    const std::string name = f.get<std::string>();
    const bool same = !stamps.is_object() || !stamps.contains(name) || stamps.at(name) == stamp_of(dir + "/" + name) ||
                      !path_exists(dir + "/" + name);
    (same ? out.files : out.changed).insert(name);
  }
  return out;
}

std::string parent_of(const std::string& dir) {
  std::string d = dir;
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  const auto slash = d.find_last_of('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : d.substr(0, slash);
}

std::string base_of(const std::string& dir) {
  std::string d = dir;
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  const auto slash = d.find_last_of('/');
  return slash == std::string::npos ? d : d.substr(slash + 1);
}

// A descriptor of `dir` holding its exclusive flock, or -1 when another
// process holds it (or the folder is gone).
int lock_folder(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return -1;
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Fresh folders of exports that were killed (nobody holds their lock):
// .NAME.zero-export-* beside `dir`, and .zero-export-* inside it, where
// exports before the record made them.
void remove_stale(const std::string& dir) {
  auto sweep = [](const std::string& folder, const std::string& prefix) {
    if (!is_folder(folder)) return;
    std::vector<std::string> names;
    try {
      names = list_folder(folder);
    } catch (const IoError&) {
      return;  // a parent we cannot list: nothing of ours to find there
    }
    for (const auto& name : names) {
      if (name.rfind(prefix, 0) != 0) continue;
      const std::string path = folder + "/" + name;
      const int fd = lock_folder(path);
      if (fd < 0) continue;  // a live export's
      try {
        remove_tree(path);
        log::info("export folder " + folder + ": removed " + name + ", left by an export that did not finish");
      } catch (const IoError& e) {
        log::warning(std::string("export folder: ") + e.what());
      }
      ::close(fd);
    }
  };
  sweep(parent_of(dir), "." + base_of(dir) + ".zero-export-");
  sweep(dir, ".zero-export-");
}

// Hard links of everything in `from` except `skip` into `to` (folders
// made again, links copied): `to` then holds the user's files too, with no
// byte copied. False when the file system cannot (no hard links, another
// kind of file).
bool mirror(const std::string& from, const std::string& to, const std::set<std::string>& skip) {
  for (const auto& name : list_folder(from)) {
    if (skip.count(name) != 0) continue;
    const std::string a = from + "/" + name, b = to + "/" + name;
    struct stat st {};
    if (::lstat(a.c_str(), &st) != 0) return false;
    if (S_ISDIR(st.st_mode)) {
      if (::mkdir(b.c_str(), st.st_mode & 07777) != 0 || !mirror(a, b, {})) return false;
    } else if (S_ISLNK(st.st_mode)) {
      std::vector<char> target(static_cast<size_t>(st.st_size) + 1);
      const ssize_t n = ::readlink(a.c_str(), target.data(), target.size());
      if (n < 0 || ::symlink(std::string(target.data(), static_cast<size_t>(n)).c_str(), b.c_str()) != 0) return false;
    } else if (S_ISREG(st.st_mode)) {
      if (::link(a.c_str(), b.c_str()) != 0) return false;
    } else {
      return false;  // a pipe, socket or device: left where it is, by the file-by-file way
    }
  }
  return true;
}

// After the swap: the earlier folder `old` against DIR `now`. Entries in
// `drop` (the earlier export's files) go; an entry that DIR holds too (the
// same file by inode, the same link, a folder settled the same way) goes;
// anything else (it came into DIR while the export was swapped in) moves
// back into DIR when the name is free there. True when `old` is then empty.
bool settle(const std::string& old, const std::string& now, const std::set<std::string>& drop) {
  bool all = true;
  for (const auto& name : list_folder(old)) {
    const std::string a = old + "/" + name, b = now + "/" + name;
    if (drop.count(name) != 0) {
      remove_tree(a);
      continue;
    }
    struct stat sa {}, sb {};
    if (::lstat(a.c_str(), &sa) != 0) continue;
    const bool in_now = ::lstat(b.c_str(), &sb) == 0;
    if (in_now && S_ISDIR(sa.st_mode) && S_ISDIR(sb.st_mode)) {
      if (settle(a, b, {})) ::rmdir(a.c_str());
      else all = false;
      continue;
    }
    if (in_now && !S_ISDIR(sa.st_mode) && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino) {
      ::unlink(a.c_str());
      continue;
    }
    if (in_now && S_ISLNK(sa.st_mode) && S_ISLNK(sb.st_mode)) {
      char ta[PATH_MAX], tb[PATH_MAX];
      const ssize_t na = ::readlink(a.c_str(), ta, sizeof ta), nb = ::readlink(b.c_str(), tb, sizeof tb);
      if (na >= 0 && na == nb && std::memcmp(ta, tb, static_cast<size_t>(na)) == 0) {
        ::unlink(a.c_str());
        continue;
      }
    }
    if (!in_now && ::rename(a.c_str(), b.c_str()) == 0) {
      log::warning("export folder " + now + ": " + name + " came in while the export was swapped in; moved back");
      continue;
    }
    all = false;
  }
  return all;
}

// Whether a file made in folder `from` can be renamed into folder `to`: not
// where `to` is a mount point, of another file system or a bind mount of
// the same one (rename(2) says EXDEV to both). A file made and moved back.
bool renames_into(const std::string& from, const std::string& to) {
  std::string probe = from + "/.zero-rename-test-XXXXXX";
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) return true;  // nothing to learn here: the export says what fails
  ::close(fd);
  const std::string there = to + "/" + base_of(probe);
  const bool moved = ::rename(probe.c_str(), there.c_str()) == 0;
  const int err = errno;
  ::unlink((moved ? there : probe).c_str());
  return moved || err != EXDEV;  // EXDEV: another mount (a read-only DIR is no mount point)
}

}  // namespace

std::string HfWriter::folder_problem(const std::string& flag, const std::string& dir, bool with_config) {
  if (const std::string problem = save_folder_problem(flag, dir); !problem.empty()) return problem;
  if (!is_folder(dir)) return "";
  try {
    const auto earlier = recorded(dir);
    for (const auto& name : list_folder(dir))
      if (export_name(name, with_config) && earlier.files.count(name) == 0)
        return flag + " " + dir + ": holds " + name + ", which " +
               (earlier.changed.count(name) ? "an earlier export wrote but something has changed since (its size or "
                                              "time is not what " + dir + "/" + kRecord + " recorded)"
                                            : "no earlier export of zero's wrote (" + dir + "/" + kRecord +
                                                  " does not list it)") +
               ", and an export there would replace it: move it away, or choose another folder (an export replaces "
               "only the files of an earlier export, as it wrote them)";
  } catch (const IoError& e) {
    return flag + " " + dir + ": " + e.what();
  }
  return "";
}

HfWriter::HfWriter(std::string dir, std::vector<Tensor> tensors, int64_t max_shard_bytes, offload::AioEngine& aio)
    : dir_(std::move(dir)), tensors_(std::move(tensors)), aio_(aio) {
  ZERO_CHECK(!tensors_.empty(), "an export of no tensors");
  int64_t shard = 0, in_shard = 0;
  for (const auto& t : tensors_) {
    const int64_t n = c10::multiply_integers(t.shape) * static_cast<int64_t>(c10::elementSize(t.dtype));
    if (in_shard > 0 && in_shard + n > max_shard_bytes) ++shard, in_shard = 0;
    in_shard += n;
    shard_of_.push_back(shard);
  }
  if (const std::string problem = folder_problem("export folder", dir_, /*with_config=*/false); !problem.empty())
    throw IoError(problem);
  // DIR as it really is: a link's target, "." or "x/.." by name, so that the
  // folder beside it is beside it.
  char real[PATH_MAX];
  if (::realpath(dir_.c_str(), real) != nullptr) dir_ = real;
  remove_stale(dir_);
  // The fresh folder beside DIR (a swap needs both on one file system);
  // inside DIR where DIR is a mount point (another file system than its
  // parent's) or its parent takes no new folder. Made under a name the
  // sweep of stale folders does not match, locked, then named as one.
  const bool mount_point = is_folder(dir_) && !renames_into(parent_of(dir_), dir_);
  auto make = [&](const std::string& where, const std::string& prefix) {
    std::string pattern = where + "/" + prefix + ".zero-new-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) return false;
    const int lock = lock_folder(pattern);  // -1 without flock: a later export cannot tell it from a stale one
    const std::string named = where + "/" + prefix + ".zero-export-" + pattern.substr(pattern.size() - 6);
    if (::rename(pattern.c_str(), named.c_str()) != 0) {
      if (lock >= 0) ::close(lock);
      ::rmdir(pattern.c_str());
      return false;
    }
    tmp_ = named;
    tmp_lock_ = lock;
    return true;
  };
  if (mount_point || !make(parent_of(dir_), "." + base_of(dir_))) {
    make_folders(dir_);
    tmp_beside_ = false;
    if (!make(dir_, "")) {
      const int err = errno;
      throw IoError("make a temporary folder in " + dir_ + ": " + errno_text(err));
    }
  }
}

HfWriter::~HfWriter() {
  writer_.reset();
  if (!finished_ && !moving_) {
    try {
      remove_tree(tmp_);
    } catch (const std::exception&) {  // the error that ended the export says more
    }
  }
  if (tmp_lock_ >= 0) ::close(tmp_lock_);
}

std::string HfWriter::file_name(int64_t shard) const {
  if (shards() == 1) return "model.safetensors";
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05lld-of-%05lld.safetensors", static_cast<long long>(shard + 1),
                static_cast<long long>(shards()));
  return buf;
}

void HfWriter::open_shard(int64_t shard) {
  Layout layout;
  for (size_t i = 0; i < tensors_.size(); ++i)
    if (shard_of_[i] == shard) layout.tensors.push_back({tensors_[i].name, tensors_[i].dtype, tensors_[i].shape});
  layout.metadata = {{"format", "pt"}};
  writer_ = std::make_unique<TensorFileWriter>(tmp_ + "/" + file_name(shard), std::move(layout), aio_);
  open_shard_ = shard;
}

void HfWriter::append(const at::Tensor& t) {
  ZERO_CHECK(next_ < tensors_.size(), "more tensors than the export planned");
  const Tensor& want = tensors_[next_];
  ZERO_CHECK(t.sizes().vec() == want.shape, "tensor " + want.name + " came with another shape than planned");
  if (open_shard_ != shard_of_[next_]) {
    if (writer_) {
      writer_->commit("");
      written_.push_back(file_name(open_shard_));
    }
    open_shard(shard_of_[next_]);
  }
  const at::Tensor v = t.scalar_type() == want.dtype ? t : t.to(want.dtype);
  writer_->append(writer_->tensor(want.name), v.contiguous());
  bytes_ += v.numel() * static_cast<int64_t>(v.element_size());
  ++next_;
}

void HfWriter::append_part(const at::Tensor& part) {
  ZERO_CHECK(next_ < tensors_.size(), "more tensors than the export planned");
  const Tensor& want = tensors_[next_];
  if (open_shard_ != shard_of_[next_]) {
    if (writer_) {
      writer_->commit("");
      written_.push_back(file_name(open_shard_));
    }
    open_shard(shard_of_[next_]);
  }
  const at::Tensor v = (part.scalar_type() == want.dtype ? part : part.to(want.dtype)).reshape({-1}).contiguous();
  const int64_t total = c10::multiply_integers(want.shape);
  ZERO_CHECK(part_done_ + v.numel() <= total, "tensor " + want.name + " given more elements than its shape");
  writer_->append(writer_->tensor(want.name), v);
  bytes_ += v.numel() * static_cast<int64_t>(v.element_size());
  part_done_ += v.numel();
  if (part_done_ == total) ++next_, part_done_ = 0;
}

void HfWriter::finish(const std::string& config_json) {
  ZERO_CHECK(next_ == tensors_.size(), "the export ended before its last tensor");
  writer_->commit("");
  written_.push_back(file_name(open_shard_));
  writer_.reset();
  if (shards() > 1) {
    nlohmann::json map = nlohmann::json::object();
    for (size_t i = 0; i < tensors_.size(); ++i) map[tensors_[i].name] = file_name(shard_of_[i]);
    const nlohmann::json index = {{"metadata", {{"total_size", bytes_}}}, {"weight_map", map}};
    write_file_atomically(tmp_ + "/model.safetensors.index.json", index.dump(2) + "\n");
    written_.push_back("model.safetensors.index.json");
  }
  if (!config_json.empty()) {
    write_file_atomically(tmp_ + "/config.json", config_json);
    written_.push_back("config.json");
  }
  // The names this export writes, checked again (a file may have come
  // since the constructor looked), config.json now that it is known.
  const Recorded found = is_folder(dir_) ? recorded(dir_) : Recorded{};
  const std::set<std::string>& earlier = found.files;
  if (is_folder(dir_))
    for (const auto& name : written_)
      if (earlier.count(name) == 0 && path_exists(dir_ + "/" + name))
        throw IoError("export folder " + dir_ + ": holds " + name + ", which " +
                      (found.changed.count(name) ? "an earlier export wrote but something has changed since"
                                                 : "no earlier export of zero's wrote (" + dir_ + "/" + kRecord +
                                                       " does not list it)") +
                      ", and the export would replace it: move it away, or choose another folder; nothing was changed");
  nlohmann::json stamps = nlohmann::json::object();
  for (const auto& name : written_) stamps[name] = stamp_of(tmp_ + "/" + name);
  const nlohmann::json record = {
      {"files", written_}, {"stamps", stamps}, {"by", "zero (Engine::save_hf, zero checkpoint export --hf)"}};
  write_file_atomically(tmp_ + "/" + kRecord, record.dump(1) + "\n");
  moving_ = true;
  if (tmp_beside_) {
    swap_in(std::vector<std::string>(earlier.begin(), earlier.end()));
  } else {
    move_in(std::vector<std::string>(earlier.begin(), earlier.end()),
            shards() > 1 ? "model.safetensors.index.json" : "model.safetensors");
  }
  finished_ = true;
}

// NOTE [export folder]: the fresh folder takes DIR's place whole.
void HfWriter::swap_in(const std::vector<std::string>& earlier) {
  const std::string parent = parent_of(dir_);
  struct stat st {};
  if (::stat(dir_.c_str(), &st) != 0) {  // a new folder: a rename puts it in place
    const mode_t mask = ::umask(0);
    ::umask(mask);
    ::chmod(tmp_.c_str(), 0777 & ~mask);
    if (::rename(tmp_.c_str(), dir_.c_str()) == 0) {
      sync_path(parent);
      return;
    }
    const int err = errno;
    if (err != EEXIST && err != ENOTEMPTY) throw IoError("rename " + tmp_ + " -> " + dir_ + ": " + errno_text(err));
    if (::stat(dir_.c_str(), &st) != 0) {
      const int gone = errno;
      throw IoError("stat " + dir_ + ": " + errno_text(gone));
    }
  }
  std::set<std::string> skip(earlier.begin(), earlier.end());
  skip.insert(kRecord);
  for (const auto& name : written_) skip.insert(name);
  if (!mirror(dir_, tmp_, skip)) {
    // Undo the links (the user's files are in DIR still), then file by file.
    for (const auto& name : list_folder(tmp_))
      if (std::find(written_.begin(), written_.end(), name) == written_.end() && name != kRecord)
        remove_tree(tmp_ + "/" + name);
    return move_in(earlier, shards() > 1 ? "model.safetensors.index.json" : "model.safetensors");
  }
  ::chmod(tmp_.c_str(), st.st_mode & 07777);
  if (::geteuid() == 0) (void)::chown(tmp_.c_str(), st.st_uid, st.st_gid);
  if (::renameat2(AT_FDCWD, tmp_.c_str(), AT_FDCWD, dir_.c_str(), RENAME_EXCHANGE) != 0) {
    const int err = errno;
    if (err != EINVAL && err != ENOSYS && err != EOPNOTSUPP && err != EXDEV && err != EBUSY && err != EPERM &&
        err != EACCES)
      throw IoError("renameat2(RENAME_EXCHANGE) " + tmp_ + " <-> " + dir_ + ": " + errno_text(err));
    for (const auto& name : list_folder(tmp_))
      if (std::find(written_.begin(), written_.end(), name) == written_.end() && name != kRecord)
        remove_tree(tmp_ + "/" + name);
    return move_in(earlier, shards() > 1 ? "model.safetensors.index.json" : "model.safetensors");
  }
  sync_path(parent);
  // tmp_ now names the earlier folder: the earlier export, links to what
  // DIR still holds, and whatever came into DIR after the links were made.
  std::set<std::string> drop(earlier.begin(), earlier.end());
  drop.insert(kRecord);
  bool settled = false;
  try {
    settled = settle(tmp_, dir_, drop);
  } catch (const IoError& e) {
    log::warning("export folder " + dir_ + ": " + e.what());
  }
  if (settled) {
    ::rmdir(tmp_.c_str());
    return;
  }
  // Something could not go back (a name taken in both): kept, under a name
  // no later export removes.
  std::string kept = parent + "/." + base_of(dir_) + ".zero-leftover-XXXXXX";
  if (::mkdtemp(kept.data()) != nullptr && ::rmdir(kept.c_str()) == 0 && ::rename(tmp_.c_str(), kept.c_str()) == 0)
    log::warning("export folder " + dir_ + ": the export is in place; files that came into the folder while it was "
                 "swapped in, and whose names were taken, are kept in " + kept);
  else
    log::warning("export folder " + dir_ + ": the export is in place; its earlier folder " + tmp_ +
                 " holds files that could not go back, and stays");
}

// NOTE [export folder]: where no swap can be made, file by file.
void HfWriter::move_in(const std::vector<std::string>& earlier, const std::string& final_file) {
  make_folders(dir_);
  for (const auto& name : written_)
    if (name != final_file) rename_path(tmp_ + "/" + name, dir_ + "/" + name);
  rename_path(tmp_ + "/" + final_file, dir_ + "/" + final_file);
  for (const auto& name : earlier)
    if (std::find(written_.begin(), written_.end(), name) == written_.end()) ::unlink((dir_ + "/" + name).c_str());
  rename_path(tmp_ + "/" + kRecord, dir_ + "/" + kRecord);
  sync_path(dir_);
  remove_tree(tmp_);
}

}  // namespace zero::ckpt
