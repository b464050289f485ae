// The pieces of an engine checkpoint's files (checkpoint_format.h).
#include "zero/snapshots/checkpoint_format.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ctime>

#include <algorithm>
#include <array>
#include <deque>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include <c10/util/accumulate.h>
#include <nlohmann/json.hpp>

#include "zero/core/command_files.h"
#include "zero/core/error.h"

namespace zero::ckpt {
namespace {

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

uint32_t crc32c_soft(const uint8_t* p, size_t n, uint32_t crc) {
  static const std::array<uint32_t, 256> table = make_table();
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_hw(const uint8_t* p, size_t n, uint32_t crc) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n-- > 0) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}
#endif

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  static const bool hw = __builtin_cpu_supports("sse4.2");
  crc = hw ? crc32c_hw(p, n, crc) : crc32c_soft(p, n, crc);
#else
  crc = crc32c_soft(p, n, crc);
#endif
  return ~crc;
}

int64_t TensorEntry::numel() const { return c10::multiply_integers(shape); }

int64_t Layout::num_sums() const {
  int64_t n = 0;
  for (const auto& t : tensors) n += t.num_sums();
  return n;
}

const TensorEntry& Layout::at(const std::string& name, const std::string& file) const {
  for (const auto& t : tensors)
    if (t.name == name) return t;
  throw IoError(file + ": no tensor " + name + " in the file (a checkpoint of another model, or a damaged one)");
}

const char* dtype_name(at::ScalarType d) {
  switch (d) {
    case at::kFloat: return "F32";
    case at::kBFloat16: return "BF16";
    case at::kHalf: return "F16";
    case at::kDouble: return "F64";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    case at::kShort: return "I16";
    case at::kChar: return "I8";
    case at::kByte: return "U8";
    case at::kBool: return "BOOL";
    default: return "?";
  }
}

at::ScalarType dtype_from_name(const std::string& n, const std::string& where) {
  static const std::unordered_map<std::string, at::ScalarType> m = {
      {"F32", at::kFloat}, {"BF16", at::kBFloat16}, {"F16", at::kHalf}, {"F64", at::kDouble}, {"I64", at::kLong},
      {"I32", at::kInt},   {"I16", at::kShort},     {"I8", at::kChar},  {"U8", at::kByte},    {"BOOL", at::kBool}};
  auto it = m.find(n);
  if (it == m.end()) throw IoError(where + ": dtype \"" + n + "\" is not one zero reads");
  return it->second;
}

std::string make_header(Layout& layout) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!layout.metadata.empty()) {
    nlohmann::ordered_json md = nlohmann::ordered_json::object();
    for (const auto& [k, v] : layout.metadata) md[k] = v;
    h["__metadata__"] = md;
  }
  int64_t offset = 0, sums = 0;
  for (auto& t : layout.tensors) {
    t.begin = offset;
    t.end = offset + t.numel() * static_cast<int64_t>(c10::elementSize(t.dtype));
    t.first_sum = sums;
    sums += t.num_sums();
    offset = t.end;
    h[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
  }
  std::string json = h.dump();
  // Spaces after the JSON (the format allows them) put the data on a 4 KiB boundary.
  const int64_t start = (8 + static_cast<int64_t>(json.size()) + 4095) / 4096 * 4096;
  json.append(static_cast<size_t>(start - 8 - static_cast<int64_t>(json.size())), ' ');
  layout.data_start = start;
  std::string out(8, '\0');
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xFF);
  out += json;
  layout.header_crc = crc32c(out.data(), out.size());
  return out;
}

Layout read_header(offload::AioEngine& aio, const std::shared_ptr<offload::AioFile>& file, const std::string& path,
                   int64_t size) {
  if (size < 8) throw IoError(path + ": " + std::to_string(size) + " bytes, too short for a safetensors header (truncated?)");
  offload::AlignedBuffer first(4096);
  const int64_t head = std::min<int64_t>(size, 4096);
  aio.read(file, first.data(), head, 0).wait();
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<uint8_t*>(first.data())[i]) << (8 * i);
  if (n > static_cast<uint64_t>(size - 8) || n > (uint64_t{1} << 30))
    throw IoError(path + ": header of " + std::to_string(n) + " bytes does not fit the file's " + std::to_string(size) +
                  " bytes (truncated or not a safetensors file)");
  std::string json(static_cast<size_t>(n), '\0');
  uint32_t header_crc = 0;
  if (8 + static_cast<int64_t>(n) <= head) {
    std::memcpy(json.data(), static_cast<char*>(first.data()) + 8, n);
    header_crc = crc32c(first.data(), 8 + n);
  } else {
    offload::AlignedBuffer all(offload::aio_aligned(8 + static_cast<int64_t>(n)));
    aio.read(file, all.data(), 8 + static_cast<int64_t>(n), 0).wait();
    std::memcpy(json.data(), static_cast<char*>(all.data()) + 8, n);
    header_crc = crc32c(all.data(), 8 + n);
  }
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(json);
  } catch (const std::exception&) {
    throw IoError(path + ": the safetensors header is not valid JSON (damaged file)");
  }
  Layout layout;
  layout.data_start = 8 + static_cast<int64_t>(n);
  layout.header_crc = header_crc;
  try {
    for (const auto& [key, v] : h.items()) {
      if (key == "__metadata__") {
        for (const auto& [mk, mv] : v.items()) layout.metadata[mk] = mv.get<std::string>();
        continue;
      }
      TensorEntry t;
      t.name = key;
      t.dtype = dtype_from_name(v.at("dtype").get<std::string>(), path + ": tensor " + key);
      // Whole numbers only: the JSON reader would truncate 2.5 to 2.
      for (const char* field : {"shape", "data_offsets"}) {
        const auto& list = v.at(field);
        if (!list.is_array() || !std::all_of(list.begin(), list.end(), [](const nlohmann::json& x) {
              return x.is_number_integer();
            }))
          throw IoError(path + ": tensor " + key + "'s " + field + " " + list.dump() +
                        " is not a list of whole numbers (a damaged or hand-made header)");
      }
      if (v.at("data_offsets").size() != 2)
        throw IoError(path + ": tensor " + key + "'s data_offsets " + v.at("data_offsets").dump() +
                      " is not [begin, end] (a damaged or hand-made header)");
      t.shape = v.at("shape").get<std::vector<int64_t>>();
      // Each dimension at least 0, and their product (in bytes) no larger
      // than the file: a shape that is nonsense or overflows is refused
      // here, not counted as a negative or wrapped element count later.
      int64_t bytes = static_cast<int64_t>(c10::elementSize(t.dtype));
      for (const int64_t d : t.shape)
        if (d < 0 || __builtin_mul_overflow(bytes, d, &bytes) || bytes > size)
          throw IoError(path + ": tensor " + key + " has shape " + v.at("shape").dump() + ", which " +
                        (d < 0 ? "has a negative dimension" : "holds more bytes than the file's " + std::to_string(size)) +
                        " (a damaged or hand-made header)");
      t.begin = v.at("data_offsets").at(0).get<int64_t>();
      t.end = v.at("data_offsets").at(1).get<int64_t>();
      layout.tensors.push_back(std::move(t));
    }
  } catch (const IoError&) {
    throw;
  } catch (const std::exception& e) {
    throw IoError(path + ": malformed safetensors header (" + e.what() + ")");
  }
  std::sort(layout.tensors.begin(), layout.tensors.end(),
            [](const TensorEntry& a, const TensorEntry& b) { return a.begin < b.begin; });
  int64_t sums = 0, next = 0;
  for (auto& t : layout.tensors) {
    if (t.end - t.begin != t.numel() * static_cast<int64_t>(c10::elementSize(t.dtype)) || t.begin < 0 ||
        layout.data_start + t.end > size) {
      throw IoError(path + ": tensor " + t.name + " spans bytes [" + std::to_string(t.begin) + ", " +
                    std::to_string(t.end) + ") of data, which does not fit its shape or the file's " +
                    std::to_string(size) + " bytes (truncated?)");
    }
    // As the safetensors library reads a file: the tensors tile the data,
    // in order, with no gap, no overlap, nothing after them.
    if (t.begin != next)
      throw IoError(path + ": tensor " + t.name + " starts at data byte " + std::to_string(t.begin) + "; expected " +
                    std::to_string(next) + " (" + (t.begin < next ? "it overlaps the tensor before it" : "a gap before it") +
                    ": a damaged or hand-made header)");
    next = t.end;
    t.first_sum = sums;
    sums += t.num_sums();
  }
  if (layout.data_start + next != size)
    throw IoError(path + ": " + std::to_string(size - layout.data_start - next) + " bytes after its last tensor (the " +
                  "safetensors library refuses such a file; appended to, or a damaged header)");
  return layout;
}

void StreamSums::add(const void* data, int64_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const int64_t take = std::min(n, kSumBlock - in_block_);
    crc_ = crc32c(p, static_cast<size_t>(take), crc_);
    in_block_ += take;
    p += take;
    n -= take;
    if (in_block_ == kSumBlock) {
      out_->push_back(crc_);
      crc_ = 0;
      in_block_ = 0;
    }
  }
}

void StreamSums::finish() {
  if (in_block_ > 0) out_->push_back(crc_);
  crc_ = 0;
  in_block_ = 0;
}

void sync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw IoError("open " + path + " to flush it: " + errno_text(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw IoError("flush " + path + ": " + errno_text(err));
}

int64_t file_size(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return -1;
  return static_cast<int64_t>(st.st_size);
}

namespace {
// The file is assembled in aligned blocks of this size, each written (with
// O_DIRECT where the filesystem allows it) once all its bytes are in.
constexpr int64_t kBlockBytes = int64_t{4} << 20;
constexpr size_t kMaxInFlight = 8;  // blocks written at once
}  // namespace

TensorFileWriter::TensorFileWriter(std::string path, Layout layout, offload::AioEngine& aio)
    : path_(std::move(path)), layout_(std::move(layout)), aio_(aio) {
  const std::string header = make_header(layout_);
  sums_.resize(layout_.tensors.size());
  written_.assign(layout_.tensors.size(), 0);
  for (size_t i = 0; i < layout_.tensors.size(); ++i) streams_.emplace_back(&sums_[i]);
  // A file or link left at the temporary name goes first: opening it would
  // follow a link and truncate what it points at.
  ::unlink(tmp().c_str());
  file_ = offload::AioFile::open(tmp(), /*create=*/true, /*try_direct=*/true, /*mode=*/0644);
  try {
    file_->reserve(layout_.file_bytes());  // a full disk fails here, before the data
    put(0, header.data(), static_cast<int64_t>(header.size()));
  } catch (...) {  // no destructor runs for a constructor that throws: the temporary goes here
    file_.reset();
    ::unlink(tmp().c_str());
    throw;
  }
}

TensorFileWriter::~TensorFileWriter() {
  for (auto& b : in_flight_) {
    try {
      b.io.wait();
    } catch (...) {  // the error was, or will be, reported by the writer's user
    }
  }
  in_flight_.clear();
  file_.reset();
  if (!committed_) ::unlink(tmp().c_str());
}

size_t TensorFileWriter::tensor(const std::string& name) const {
  for (size_t i = 0; i < layout_.tensors.size(); ++i)
    if (layout_.tensors[i].name == name) return i;
  ZERO_CHECK(false, "no tensor " + name + " in " + path_);
  return 0;
}

offload::AlignedBuffer TensorFileWriter::take_buffer() {
  if (!free_.empty()) {
    offload::AlignedBuffer b = std::move(free_.back());
    free_.pop_back();
    return b;
  }
  return offload::AlignedBuffer(kBlockBytes);
}

void TensorFileWriter::put(int64_t offset, const void* data, int64_t n) {
  const auto* src = static_cast<const char*>(data);
  const int64_t file_bytes = layout_.file_bytes();
  while (n > 0) {
    const int64_t index = offset / kBlockBytes, within = offset % kBlockBytes;
    const int64_t block_len = std::min(kBlockBytes, file_bytes - index * kBlockBytes);
    auto it = open_.find(index);
    if (it == open_.end()) it = open_.emplace(index, Block{take_buffer(), 0, {}}).first;
    const int64_t c = std::min(n, block_len - within);
    std::memcpy(static_cast<char*>(it->second.buf.data()) + within, src, static_cast<size_t>(c));
    it->second.filled += c;
    ZERO_CHECK(it->second.filled <= block_len, "block " + std::to_string(index) + " of " + path_ + " written twice");
    if (it->second.filled == block_len) {  // whole: to disk
      while (in_flight_.size() >= kMaxInFlight) {
        in_flight_.front().io.wait();
        free_.push_back(std::move(in_flight_.front().buf));
        in_flight_.pop_front();
      }
      Block done = std::move(it->second);
      open_.erase(it);
      done.io = aio_.write(file_, done.buf.data(), block_len, index * kBlockBytes);
      in_flight_.push_back(std::move(done));
    }
    offset += c, src += c, n -= c;
  }
}

void TensorFileWriter::append(size_t i, const at::Tensor& src) {
  const auto& t = layout_.tensors.at(i);
  ZERO_CHECK(src.scalar_type() == t.dtype, "tensor " + t.name + " of " + path_ + " appended in another dtype");
  const int64_t es = static_cast<int64_t>(src.element_size());
  at::Tensor host = src.is_cpu() ? src.contiguous() : at::Tensor();
  const int64_t per = kBlockBytes / es;  // elements a device tensor comes over in at a time
  at::Tensor flat = src.reshape({-1});
  for (int64_t e = 0; e < flat.numel(); e += host.defined() ? flat.numel() : per) {
    const int64_t n = host.defined() ? flat.numel() : std::min(per, flat.numel() - e);
    const at::Tensor piece = host.defined() ? host : flat.narrow(0, e, n).cpu();
    ZERO_CHECK(written_[i] + n * es <= t.end - t.begin, "tensor " + t.name + " of " + path_ + " written past its end");
    streams_[i].add(piece.data_ptr(), n * es);
    put(layout_.data_start + t.begin + written_[i], piece.data_ptr(), n * es);
    written_[i] += n * es;
  }
}

TensorFileWriter::Committed TensorFileWriter::commit(const std::string& sums_path) {
  std::string sums;
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    const auto& t = layout_.tensors[i];
    ZERO_CHECK(written_[i] == t.end - t.begin, "tensor " + t.name + " of " + path_ + " not written whole");
    streams_[i].finish();
    sums.append(reinterpret_cast<const char*>(sums_[i].data()), sums_[i].size() * 4);
  }
  ZERO_CHECK(open_.empty(), path_ + ": blocks left partly written");
  for (auto& b : in_flight_) b.io.wait();
  in_flight_.clear();
  free_.clear();
  if (::fsync(file_->buffered_fd()) != 0) {
    const int err = errno;
    throw IoError("flush " + tmp() + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")");
  }
  file_.reset();
  if (std::rename(tmp().c_str(), path_.c_str()) != 0) {
    const int err = errno;
    throw IoError("rename " + tmp() + " -> " + path_ + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")");
  }
  committed_ = true;
  if (!sums_path.empty()) write_file_atomically(sums_path, sums);
  return {layout_.file_bytes(), layout_.header_crc, crc32c(sums.data(), sums.size())};
}

void write_file_atomically(const std::string& path_in, const std::string& data) {
  // NOTE [outputs and inputs]: a stream is written where it stands, never replaced.
  if (const int fd = stream_output_fd(path_in); fd >= 0) {
    if (std::string problem = write_to_stream(path_in, fd, data); !problem.empty()) throw IoError(problem);
    return;
  }
  if (std::string problem = output_place_problem("output", path_in); !problem.empty()) throw IoError(problem);
  // A link is written through: its target is replaced, the link stays.
  const std::string path = is_regular_file(path_in) || !path_exists(path_in) ? path_in : resolved_path(path_in);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw IoError("open " + tmp + " for writing: " + errno_text(errno));
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : ENOSPC;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw IoError("write " + tmp + " at offset " + std::to_string(done) + ": " + errno_text(err));
    }
    done += static_cast<size_t>(n);
  }
  const int synced = ::fsync(fd) == 0 ? 0 : errno;
  const int closed = ::close(fd) == 0 ? 0 : errno;
  if (synced != 0 || closed != 0) {
    ::unlink(tmp.c_str());
    throw IoError("flush " + tmp + ": " + errno_text(synced != 0 ? synced : closed));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw IoError("rename " + tmp + " -> " + path + ": " + errno_text(err));
  }
  const auto slash = path.rfind('/');
  sync_path(slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash));
}

std::string read_small_file(const std::string& path) {
  // A folder, a dangling link or a loop is named as such, not "cannot open".
  if (const std::string problem = input_file_problem(path, path); !problem.empty()) throw IoError(problem);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError("open " + path + " for reading: " + errno_text(errno));
  std::ostringstream s;
  s << in.rdbuf();
  if (in.bad()) throw IoError("read " + path + ": " + errno_text(errno));
  return s.str();
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

void make_folders(const std::string& path) {
  if (path.empty()) return;
  std::string at;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    at = path.substr(0, pos);
    if (at.empty() || ::mkdir(at.c_str(), 0755) == 0 || errno == EEXIST) continue;
    const int err = errno;
    throw IoError("create folder " + at + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")");
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw IoError("create folder " + path + ": a file of that name is in the way");
}

namespace {
int remove_entry(const char* path, const struct stat*, int type, struct FTW*) {
  const int rc = type == FTW_DP ? ::rmdir(path) : ::unlink(path);
  if (rc != 0 && errno != ENOENT) {
    const int err = errno;
    throw IoError(std::string("remove ") + path + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")");
  }
  return 0;
}
}  // namespace

void remove_tree(const std::string& path) {
  if (!path_exists(path)) return;
  if (::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS) != 0 && path_exists(path)) {
    const int err = errno;
    throw IoError("remove " + path + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")");
  }
}

void rename_path(const std::string& from, const std::string& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0) {
    const int err = errno;
    throw IoError("rename " + from + " -> " + to + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")");
  }
}

std::vector<std::string> list_folder(const std::string& path) {
  DIR* d = ::opendir(path.c_str());
  if (d == nullptr) {
    const int err = errno;
    throw IoError("list " + path + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")");
  }
  std::vector<std::string> out;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") out.push_back(name);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

bool is_regular_file(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool is_folder(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string output_file_problem(const std::string& flag, const std::string& path) {
  const std::string head = flag + " " + path + ": ";
  if (path.empty()) return flag + ": expected a file name; got \"\"";
  // A stream (/dev/stdout) is written where it stands; anything else under
  // /dev or /proc, a device or a pipe is refused, never replaced.
  if (stream_output_fd(path) >= 0) return "";
  if (std::string problem = output_place_problem(flag, path); !problem.empty()) return problem;
  // A link is written through: the folder that takes the file is its target's.
  struct stat link {};
  const std::string target = ::lstat(path.c_str(), &link) == 0 && S_ISLNK(link.st_mode) ? resolved_path(path) : path;
  const auto slash = target.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : target.substr(0, slash);
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0)
    return head + "the folder " + dir + " does not exist" + (errno == ENOENT ? "" : " (" + errno_text(errno) + ")");
  if (!S_ISDIR(st.st_mode)) return head + dir + " is not a folder";
  if (::access(dir.c_str(), W_OK) != 0) return head + "cannot write in " + dir + ": " + errno_text(errno);
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return head + "is a folder; expected a file name";
    if (!S_ISREG(st.st_mode)) return head + "is not a regular file (a device, pipe or socket); expected a file name";
  }
  return "";
}

std::string save_folder_problem(const std::string& flag, const std::string& dir) {
  const std::string head = flag + " " + dir + ": ";
  if (dir.empty()) return flag + ": expected a folder; got \"\"";
  struct stat st {};
  if (::stat(dir.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) return head + "is a file, not a folder";
  // Nothing is made here (a run that fails later leaves no empty folders):
  // the folder, or else its deepest existing ancestor, must take files.
  std::string at = dir;
  while (::stat(at.c_str(), &st) != 0) {
    // ENOTDIR: a part of the path is a file; the walk up finds which.
    if (errno != ENOENT && errno != ENOTDIR) return head + "cannot reach " + at + ": " + errno_text(errno);
    const auto slash = at.find_last_of('/');
    at = slash == std::string::npos ? "." : slash == 0 ? "/" : at.substr(0, slash);
  }
  if (!S_ISDIR(st.st_mode)) return head + "cannot make the folder: " + at + " is a file";
  // A file made and removed: access() passes root on a read-only mount's
  // folder modes, and says nothing of a full or read-only file system.
  std::string probe = at + "/.zero-write-test.XXXXXX";
  const int fd = ::mkstemp(probe.data());
  if (fd < 0)
    return head + (at == dir ? "cannot write in the folder: " : "cannot make the folder in " + at + ": ") +
           errno_text(errno);
  ::close(fd);
  ::unlink(probe.c_str());
  return "";
}

std::string checkpoint_folder_problem(const std::string& flag, const std::string& dir) {
  if (std::string p = save_folder_problem(flag, dir); !p.empty()) return p;
  if (!is_folder(dir)) return "";
  const std::string head = flag + " " + dir + ": ";
  for (const std::string& name : list_folder(dir)) {
    struct stat st {};
    const std::string path = dir + "/" + name;
    if (::lstat(path.c_str(), &st) != 0) continue;
    if (name == "latest" && !S_ISREG(st.st_mode))
      return head + "holds " + path + ", which is not a file; a save writes `latest` there (the tag a resume reads): "
                    "move it, or save to another folder";
    const bool numbered = name.size() > 11 && name.rfind("global_step", 0) == 0 &&
                          name.find_first_not_of("0123456789", 11) == std::string::npos;
    if (numbered && !holds_only_a_saves_files(path))
      return head + "holds " + path + ", which is not a checkpoint (it holds files no save writes); a save of that "
                    "step would replace it: move it, or save to another folder";
  }
  return "";
}

std::string make_folders_reporting(const std::string& dir_in) {
  std::string dir = dir_in;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  std::string at = dir;
  std::vector<std::string> missing;
  struct stat st {};
  while (!at.empty() && at != "/" && at != "." && ::stat(at.c_str(), &st) != 0 && errno == ENOENT) {
    missing.push_back(at);
    const auto slash = at.find_last_of('/');
    at = slash == std::string::npos ? "." : slash == 0 ? "/" : at.substr(0, slash);
  }
  make_folders(dir);
  return missing.empty() ? "" : missing.back();
}

void add_resume_inputs(CommandFiles& files, const std::string& flag, const std::string& dir) {
  const std::string latest = dir + "/latest";
  std::string tag;
  if (file_size(latest) >= 0 && !is_folder(latest)) {
    try {
      tag = read_small_file(latest);
    } catch (const IoError&) {
    }
    while (!tag.empty() && (tag.back() == '\n' || tag.back() == ' ' || tag.back() == '\r')) tag.pop_back();
  }
  if (tag.empty() || tag.find('/') != std::string::npos || tag[0] == '.') {
    // No usable latest (the resume will say why): what it would read first.
    files.reads_checkpoint(flag + "'s latest", latest, /*whole_folder=*/false);
    return;
  }
  files.reads_checkpoint(flag + "'s latest", latest, /*whole_folder=*/false);
  files.reads_checkpoint(flag + "'s checkpoint " + tag, dir + "/" + tag, /*whole_folder=*/true);
}

namespace {
constexpr const char* kLockName = ".zero-lock";
}  // namespace

namespace {
// "pid 123 on host h": who holds a lock, as its file starts.
std::string lock_owner_text() {
  char host[256] = "?";
  ::gethostname(host, sizeof host - 1);
  return "pid " + std::to_string(::getpid()) + " on host " + host;
}
}  // namespace

FolderLock::Attempt FolderLock::try_acquire(const std::string& dir) {
  const std::string path = dir + "/" + kLockName;
  Attempt out;
  for (;;) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) throw IoError("open " + path + " (the folder's writer lock): " + errno_text(errno));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      char buf[512];
      const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
      ::close(fd);
      if (err == ENOLCK || err == ENOSYS || err == EOPNOTSUPP || err == EINVAL) {  // no flock on this file system
        out.state = State::kUnsupported;
        out.holder = errno_text(err);
        return out;
      }
      if (err != EWOULDBLOCK) throw IoError("flock " + path + ": " + errno_text(err));
      std::string text = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
      while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
      const std::string me = lock_owner_text();
      out.state = text.rfind(me + ",", 0) == 0 ? State::kHeldHere : State::kHeld;
      out.holder = text.empty() ? "another process (it has not yet written its name)" : text;
      return out;
    }
    // Only a holder removes the file (as it lets go): a file locked after
    // its removal is not the lock. Then open the one there now.
    struct stat mine {}, named {};
    if (::fstat(fd, &mine) == 0 && ::stat(path.c_str(), &named) == 0 && mine.st_ino == named.st_ino &&
        mine.st_dev == named.st_dev) {
      const std::time_t now = ::time(nullptr);
      std::tm utc {};
      char when[32] = "?";
      if (::gmtime_r(&now, &utc) != nullptr) std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &utc);
      const std::string text = lock_owner_text() + ", since " + when + "\n";
      if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
        const int err = errno;
        ::close(fd);
        throw IoError("write " + path + " (the folder's writer lock): " + errno_text(err));
      }
      out.state = State::kAcquired;
      out.lock = std::unique_ptr<FolderLock>(new FolderLock(dir, fd));
      return out;
    }
    ::close(fd);
  }
}

FolderLock::~FolderLock() {
  if (fd_ < 0) return;
  ::unlink((dir_ + "/" + kLockName).c_str());  // while still held (only a holder removes it): see try_acquire
  ::close(fd_);
  // Folders the job made and left empty (a run that saved nothing) go too:
  // from dir() up to the outermost one it made, no further.
  if (made_.empty()) return;
  std::string at = dir_;
  while (at.size() > 1 && at.back() == '/') at.pop_back();
  if (at != made_ && at.compare(0, made_.size() + 1, made_ + "/") != 0) return;  // not under it: touch nothing
  while (::rmdir(at.c_str()) == 0 && at != made_) {
    const auto slash = at.find_last_of('/');
    if (slash == std::string::npos || slash == 0) break;
    at = at.substr(0, slash);
  }
}

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() > tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

// A folder of a save's name holding anything but a save's files is not a
// save's, whatever its name says, and is left alone.
bool holds_only_a_saves_files(const std::string& path) {
  struct stat st{};
  if (::lstat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return false;
  for (const std::string& name : list_folder(path)) {
    if (::lstat((path + "/" + name).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
    const std::string base = name.substr(0, name.find(".tmp."));
    if (base != "meta.json" && !ends_with(base, ".safetensors") && !ends_with(base, ".sums")) return false;
  }
  return true;
}

namespace {

// A temporary file a save writes, by its name, and a plain file.
bool a_saves_temporary_file(const std::string& dir, const std::string& name) {
  struct stat st{};
  if (name.rfind("latest.tmp.", 0) != 0 && name.rfind(".zero-write-test.", 0) != 0) return false;
  return ::lstat((dir + "/" + name).c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace

std::vector<std::string> remove_interrupted_saves(const std::string& dir) {
  std::vector<std::string> removed;
  for (const std::string& name : list_folder(dir)) {
    bool stale = false;
    if (name[0] == '.' && ends_with(name, ".incoming")) {
      stale = holds_only_a_saves_files(dir + "/" + name);
    } else if (name[0] == '.' && ends_with(name, ".old")) {
      // Moved aside by a save of the same tag: stale once DIR/TAG is whole.
      const std::string tag = name.substr(1, name.size() - 5);
      stale = holds_only_a_saves_files(dir + "/" + name) && file_size(dir + "/" + tag + "/meta.json") >= 0;
    } else {
      stale = a_saves_temporary_file(dir, name);
    }
    if (!stale) continue;
    remove_tree(dir + "/" + name);
    removed.push_back(name);
  }
  if (!removed.empty()) sync_path(dir);
  return removed;
}

}  // namespace zero::ckpt
