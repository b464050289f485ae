// NOTE [checkpoint mapping] in checkpoint_io.h.
#include "zero/snapshots/checkpoint_io.h"
#include "zero/snapshots/deepspeed_checkpoint.h"

#include <algorithm>
#include <cstdlib>
#include <set>
#include <cstdio>
#include <cstring>
#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>

#include "zero/core/command_files.h"
#include "zero/core/error.h"
#include "zero/snapshots/hf_export.h"

namespace zero::ckpt {
namespace {

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

std::string rank_file(int64_t part) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank%05lld", static_cast<long long>(part));
  return buf;
}

// One file of a checkpoint (or a weights file), opened on first use.
struct OpenFile {
  std::string path;
  int64_t size = 0;
  std::shared_ptr<offload::AioFile> file;
  Layout layout;
  std::vector<uint32_t> sums;  // empty: not verified (a weights file)
};

// A read of part of a file into `buf` (from the reader's pool).
struct PendingRead {
  offload::AlignedBuffer buf;
  int64_t size = 0;
  offload::AioHandle io;
  int64_t file_begin = 0;  // where buf starts in the file
};

// Reads of at least this many bytes are aligned for O_DIRECT.
constexpr int64_t kDirectRead = int64_t{1} << 20;

// Zeroes dst's elements [0, len) that no piece covers.
void zero_gaps(const std::vector<Piece>& pieces, int64_t len, float* dst) {
  std::vector<std::pair<int64_t, int64_t>> covered;
  for (const auto& p : pieces) covered.emplace_back(p.dst, p.dst + p.count);
  std::sort(covered.begin(), covered.end());
  int64_t at = 0;
  for (const auto& [b, e] : covered) {
    if (b > at) std::memset(dst + at, 0, static_cast<size_t>(b - at) * sizeof(float));
    at = std::max(at, e);
  }
  if (len > at) std::memset(dst + at, 0, static_cast<size_t>(len - at) * sizeof(float));
}

class ReaderBase : public PieceReader {
 public:
  explicit ReaderBase(const offload::AioOptions& aio) : aio_(aio) {}

  at::Tensor read_tensor(const std::string& file, const std::string& name) override {
    OpenFile& f = open(file);
    const TensorEntry& t = f.layout.at(name, f.path);
    at::Tensor out = at::empty(t.shape, at::TensorOptions().dtype(t.dtype));
    if (t.end > t.begin) {
      PendingRead r = start(f, t, 0, t.end - t.begin);
      finish(f, t, r, 0, t.end - t.begin, static_cast<char*>(out.data_ptr()));
    }
    return out;
  }

  bool has_tensor(const std::string& file, const std::string& name) override {
    OpenFile& f = open(file);
    for (const auto& t : f.layout.tensors)
      if (t.name == name) return true;
    return false;
  }

  const Layout& file_layout(const std::string& file) override { return open(file).layout; }

  int64_t verify_file(const std::string& file) override {
    OpenFile& f = open(file);
    constexpr int64_t kWindow = int64_t{8} << 20;
    std::vector<char> scratch(static_cast<size_t>(kWindow));
    int64_t total = 0;
    for (const auto& t : f.layout.tensors) {
      for (int64_t b = 0; b < t.end - t.begin; b += kWindow) {
        const int64_t e = std::min(t.end - t.begin, b + kWindow);
        PendingRead r = start(f, t, b, e);
        finish(f, t, r, b, e, scratch.data());
        total += e - b;
      }
    }
    return total;
  }

 protected:
  virtual OpenFile& open(const std::string& file) = 0;

  // Starts reading bytes [b0, b1) of tensor t's data, widened to its checksum
  // blocks, into the reader's buffer `slot` (reused: no fresh pages per read).
  // A large read is widened further, to file offsets that are multiples of
  // 4 KiB, so it goes past the page cache at the disk's speed (O_DIRECT); a
  // small one stays within its checksum blocks.
  PendingRead start(OpenFile& f, const TensorEntry& t, int64_t b0, int64_t b1) {
    const bool verify = !f.sums.empty();
    const int64_t lo = verify ? b0 / kSumBlock * kSumBlock : b0;
    const int64_t hi = verify ? std::min(t.end - t.begin, (b1 + kSumBlock - 1) / kSumBlock * kSumBlock) : b1;
    int64_t from = f.layout.data_start + t.begin + lo, to = f.layout.data_start + t.begin + hi;
    if (to - from >= kDirectRead) {
      from = from / offload::kAioAlignment * offload::kAioAlignment;
      to = std::min(f.size, offload::aio_aligned(to));
    }
    PendingRead r;
    r.file_begin = from;
    r.buf = take_buffer(to - from);
    r.size = to - from;
    r.io = engine().read(f.file, r.buf.data(), to - from, from);
    bytes_read_ += to - from;
    return r;
  }

  // Waits for r, checks its blocks, copies bytes [b0, b1) of the tensor to dst.
  void finish(OpenFile& f, const TensorEntry& t, PendingRead& r, int64_t b0, int64_t b1, char* dst) {
    try {
      r.io.wait();
    } catch (const IoError& e) {
      throw IoError(std::string(e.what()) + " (reading tensor " + t.name + " of the checkpoint)");
    }
    // Where byte x of the tensor's data is in the buffer (the read may start before or after the tensor).
    const int64_t skip = f.layout.data_start + t.begin - r.file_begin;
    auto byte = [&](int64_t x) { return static_cast<const char*>(r.buf.data()) + (skip + x); };
    if (!f.sums.empty()) {
      const int64_t first = b0 / kSumBlock * kSumBlock;
      for (int64_t b = first; b < b1; b += kSumBlock) {
        const int64_t n = std::min(kSumBlock, t.end - t.begin - b);
        const uint32_t want = f.sums.at(static_cast<size_t>(t.first_sum + b / kSumBlock));
        if (crc32c(byte(b), static_cast<size_t>(n)) != want) {
          throw IoError(f.path + ": checksum mismatch in tensor " + t.name + " at bytes [" + std::to_string(b) + ", " +
                        std::to_string(b + n) + ") of its data (file offset " +
                        std::to_string(f.layout.data_start + t.begin + b) + "): the file is damaged");
        }
      }
    }
    std::memcpy(dst, byte(b0), static_cast<size_t>(b1 - b0));
    free_.push_back(std::move(r.buf));
  }

  // finish() for elements [first, first + count) of the tensor into fp32
  // `dst`: fp32 as they are, 16-bit ones (a 16-bit master's and states',
  // NOTE [16-bit master]) widened.
  void finish_fp32(OpenFile& f, const TensorEntry& t, PendingRead& r, int64_t first, int64_t count, float* dst) {
    const int64_t es = static_cast<int64_t>(c10::elementSize(t.dtype));
    if (t.dtype == at::kFloat) {
      finish(f, t, r, first * es, (first + count) * es, reinterpret_cast<char*>(dst));
      return;
    }
    at::Tensor raw = at::empty({count}, at::TensorOptions().dtype(t.dtype));
    finish(f, t, r, first * es, (first + count) * es, static_cast<char*>(raw.data_ptr()));
    at::from_blob(dst, {count}, at::kFloat).copy_(raw);
  }

  // A buffer of at least n bytes: a free one when one is large enough (reads
  // reuse their pages instead of faulting in new ones), else a new one.
  offload::AlignedBuffer take_buffer(int64_t n) {
    size_t best = free_.size();
    for (size_t i = 0; i < free_.size(); ++i)
      if (free_[i].size() >= n && (best == free_.size() || free_[i].size() < free_[best].size())) best = i;
    if (best == free_.size()) return offload::AlignedBuffer(n);
    offload::AlignedBuffer b = std::move(free_[best]);
    free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
    return b;
  }

  offload::AioEngine& engine() {
    if (!aio_engine_) aio_engine_ = std::make_unique<offload::AioEngine>(aio_);
    return *aio_engine_;
  }

  offload::AioOptions aio_;
  std::unique_ptr<offload::AioEngine> aio_engine_;
  std::vector<offload::AlignedBuffer> free_;  // read buffers, reused
  std::unordered_map<std::string, std::unique_ptr<OpenFile>> files_;
};

// One issue()'s reads.
struct Reads : PieceReader::Pending {
  struct Read {
    OpenFile* file;
    const TensorEntry* tensor;
    size_t state;
    const Piece* piece;
    PendingRead pending;
  };
  std::vector<Piece> pieces;  // (their addresses are in reads: never resized after issue)
  int64_t len = 0;
  size_t states = 0;
  std::vector<Read> reads;
  ~Reads() override {
    for (auto& r : reads) {
      try {
        r.pending.io.wait();  // nothing may still write into a buffer being freed
      } catch (...) {
      }
    }
  }
};

class CheckpointReader final : public ReaderBase {
 public:
  // One rule for whether a checkpoint is there, for verify, info and load
  // alike: every file meta.json lists, and its checksums, exist at the size
  // recorded, whether or not this reader will read it.
  CheckpointReader(std::string dir, nlohmann::json files, const offload::AioOptions& aio)
      : ReaderBase(aio), dir_(std::move(dir)), files_meta_(std::move(files)) {
    if (!files_meta_.is_object() || files_meta_.empty())
      throw IoError(dir_ + "/meta.json: lists no files: a damaged checkpoint");
    for (const auto& [name, f] : files_meta_.items()) {
      const std::string path = dir_ + "/" + name;
      const int64_t want = f.value("bytes", int64_t{-1});
      const int64_t have = file_size(path);
      if (have < 0) throw IoError(path + ": missing (the checkpoint's meta.json lists it, " + std::to_string(want) + " bytes)");
      if (have != want)
        throw IoError(path + ": " + std::to_string(have) + " bytes, but the checkpoint's meta.json says " +
                      std::to_string(want) + (have < want ? " (truncated)" : " (changed)"));
      const std::string sums_path = dir_ + "/" + name.substr(0, name.rfind('.')) + ".sums";
      if (file_size(sums_path) < 0) throw IoError(sums_path + ": missing (the block checksums of " + name + ")");
    }
  }

  std::unique_ptr<Pending> issue(const std::vector<std::string>& states, std::vector<Piece> pieces,
                                 int64_t len) override {
    auto batch = std::make_unique<Reads>();
    batch->pieces = std::move(pieces);
    batch->len = len;
    batch->states = states.size();
    for (size_t s = 0; s < states.size(); ++s) {
      for (const auto& p : batch->pieces) {
        OpenFile& f = open(rank_file(p.part) + ".safetensors");
        const TensorEntry& t = f.layout.at(states[s] + "." + std::to_string(p.group), f.path);
        // fp32 states, or a 16-bit master's and states' (NOTE [16-bit
        // master]), widened to fp32 as they arrive.
        if (t.dtype != at::kFloat && t.dtype != at::kBFloat16 && t.dtype != at::kHalf)
          throw IoError(f.path + ": tensor " + t.name + " is " + std::string(c10::toString(t.dtype)) +
                        ", not an fp32 or 16-bit state: 8-bit Adam's codes and block scales (NOTE [8-bit states]) are "
                        "read whole by the engine that saved them, not element by element");
        const int64_t es = static_cast<int64_t>(c10::elementSize(t.dtype));
        if ((p.begin + p.count) * es > t.end - t.begin)
          throw IoError(f.path + ": tensor " + t.name + " does not hold the elements the checkpoint's layout says");
        batch->reads.push_back({&f, &t, s, &p, start(f, t, p.begin * es, (p.begin + p.count) * es)});
      }
    }
    return batch;
  }

  void complete(Pending& pending, const std::vector<float*>& dsts) override {
    auto& batch = static_cast<Reads&>(pending);
    ZERO_CHECK(dsts.size() == batch.states, "a destination per state");
    for (float* d : dsts) zero_gaps(batch.pieces, batch.len, d);
    for (auto& r : batch.reads)
      finish_fp32(*r.file, *r.tensor, r.pending, r.piece->begin, r.piece->count, dsts[r.state] + r.piece->dst);
    batch.reads.clear();
  }

 protected:
  OpenFile& open(const std::string& name) override {
    auto it = files_.find(name);
    if (it != files_.end()) return *it->second;
    const std::string path = dir_ + "/" + name;
    const auto meta = files_meta_.find(name);
    if (meta == files_meta_.end()) throw IoError(path + ": the checkpoint's meta.json lists no such file");
    const int64_t want = meta->at("bytes").get<int64_t>();
    const int64_t have = file_size(path);
    if (have < 0) throw IoError(path + ": missing (the checkpoint's meta.json lists it, " + std::to_string(want) + " bytes)");
    if (have != want)
      throw IoError(path + ": " + std::to_string(have) + " bytes, but the checkpoint's meta.json says " +
                    std::to_string(want) + (have < want ? " (truncated)" : " (changed)"));
    auto f = std::make_unique<OpenFile>();
    f->path = path;
    f->size = have;
    f->file = offload::AioFile::open_read_only(path, /*try_direct=*/true);
    f->layout = read_header(engine(), f->file, path, have);
    if (f->layout.header_crc != meta->at("header_crc").get<uint32_t>())
      throw IoError(path + ": the header's checksum differs from the one meta.json recorded (a damaged or changed file)");
    // The block checksums, checked as a whole against meta.json.
    const std::string sums_path = dir_ + "/" + name.substr(0, name.rfind('.')) + ".sums";
    const std::string sums = read_small_file(sums_path);
    if (static_cast<int64_t>(sums.size()) != f->layout.num_sums() * 4 ||
        crc32c(sums.data(), sums.size()) != meta->at("sums_crc").get<uint32_t>())
      throw IoError(sums_path + ": " + std::to_string(sums.size()) +
                    " bytes whose checksum differs from meta.json's (a damaged or changed file)");
    f->sums.resize(sums.size() / 4);
    std::memcpy(f->sums.data(), sums.data(), sums.size());
    bytes_read_ += f->layout.data_start + static_cast<int64_t>(sums.size());
    auto& ref = *f;
    files_.emplace(name, std::move(f));
    return ref;
  }

 private:
  std::string dir_;
  nlohmann::json files_meta_;
};

// Full weights in one or several safetensors files (NOTE [checkpoint
// mapping]): group i of the layout it makes is tensors_[i].
class WeightsReader final : public ReaderBase {
 public:
  WeightsReader(const WeightFiles& files, const std::function<std::string(const std::string&)>& rename,
                const offload::AioOptions& aio)
      : ReaderBase(aio), source_(files.source) {
    for (const auto& path : files.files) {
      OpenFile& f = open(path);
      for (size_t i = 0; i < f.layout.tensors.size(); ++i) {
        const TensorEntry& t = f.layout.tensors[i];
        const std::string name = rename ? rename(t.name) : t.name;
        if (name.empty()) continue;
        auto [it, fresh] = by_name_.emplace(name, tensors_.size());
        if (!fresh) {
          const auto& other = tensors_[it->second];
          throw IoError(source_ + ": tensors " + other.file_name + " (" + other.file + ") and " + t.name + " (" + path +
                        ") both map to the model's name " + name);
        }
        tensors_.push_back({name, t.name, path, t.dtype, t.shape});
        entries_.push_back({&f, &t});
      }
    }
  }

  const std::vector<WeightTensor>& tensors() const { return tensors_; }

  std::unique_ptr<Pending> issue(const std::vector<std::string>& states, std::vector<Piece> pieces,
                                 int64_t len) override {
    ZERO_CHECK(states.size() == 1 && states[0] == "fp32_master", "a weights file holds parameters only");
    auto batch = std::make_unique<Reads>();
    batch->pieces = std::move(pieces);
    batch->len = len;
    batch->states = 1;
    for (const auto& p : batch->pieces) {
      const auto [f, t] = entries_.at(p.group);
      const int64_t es = static_cast<int64_t>(c10::elementSize(t->dtype));
      batch->reads.push_back({f, t, 0, &p, start(*f, *t, p.begin * es, (p.begin + p.count) * es)});
    }
    return batch;
  }

  void complete(Pending& pending, const std::vector<float*>& dsts) override {
    auto& batch = static_cast<Reads&>(pending);
    zero_gaps(batch.pieces, batch.len, dsts[0]);
    for (auto& r : batch.reads)
      finish_fp32(*r.file, *r.tensor, r.pending, r.piece->begin, r.piece->count, dsts[0] + r.piece->dst);
    batch.reads.clear();
  }

  at::Tensor read_tensor(const std::string&, const std::string& name) override {
    const auto it = by_name_.find(name);
    if (it == by_name_.end()) throw IoError(source_ + ": has no tensor " + name);
    const auto [f, t] = entries_[it->second];
    at::Tensor out = at::empty(t->shape, at::TensorOptions().dtype(t->dtype));
    if (t->end > t->begin) {
      PendingRead r = start(*f, *t, 0, t->end - t->begin);
      finish(*f, *t, r, 0, t->end - t->begin, static_cast<char*>(out.data_ptr()));
    }
    return out;
  }

  bool has_tensor(const std::string&, const std::string& name) override { return by_name_.count(name) != 0; }

  OpenFile& open(const std::string& path) override {
    auto it = files_.find(path);
    if (it != files_.end()) return *it->second;
    const int64_t size = file_size(path);
    if (size < 0) throw IoError(path + ": no such file (the weights to load)");
    auto f = std::make_unique<OpenFile>();
    f->path = path;
    f->size = size;
    f->file = offload::AioFile::open_read_only(path, /*try_direct=*/true);
    f->layout = read_header(engine(), f->file, path, size);
    auto& ref = *f;
    files_.emplace(path, std::move(f));
    return ref;
  }

 private:
  std::string source_;
  std::vector<WeightTensor> tensors_;
  std::vector<std::pair<OpenFile*, const TensorEntry*>> entries_;  // by tensor index (OpenFiles are never moved)
  std::unordered_map<std::string, size_t> by_name_;
};

}  // namespace

nlohmann::json SavedLayout::to_json() const {
  nlohmann::json gs = nlohmann::json::array();
  for (const auto& g : groups) {
    nlohmann::json ps = nlohmann::json::array();
    for (const auto& p : g.params) ps.push_back({{"name", p.name}, {"shape", p.shape}, {"offset", p.offset}});
    gs.push_back({{"name", g.name}, {"padded_numel", g.padded_numel}, {"chunk_numel", g.chunk_numel}, {"params", ps}});
  }
  return {{"partitions", partitions}, {"groups", gs}, {"aliases", aliases}};
}

SavedLayout SavedLayout::from_json(const nlohmann::json& j, const std::string& where) {
  SavedLayout l;
  try {
    l.partitions = j.at("partitions").get<int64_t>();
    for (const auto& g : j.at("groups")) {
      SavedGroup sg;
      sg.name = g.at("name").get<std::string>();
      sg.padded_numel = g.at("padded_numel").get<int64_t>();
      sg.chunk_numel = g.at("chunk_numel").get<int64_t>();
      for (const auto& p : g.at("params")) {
        SavedParam sp;
        sp.name = p.at("name").get<std::string>();
        sp.shape = p.at("shape").get<std::vector<int64_t>>();
        sp.offset = p.at("offset").get<int64_t>();
        sg.params.push_back(std::move(sp));
      }
      l.groups.push_back(std::move(sg));
    }
    l.aliases = j.at("aliases").get<std::map<std::string, std::string>>();
  } catch (const std::exception& e) {
    throw IoError(where + ": malformed layout in meta.json (" + e.what() + ")");
  }
  // A damaged meta.json must not divide by zero or loop (a chunk of 0 or
  // fewer elements), nor send a read past its group.
  const auto bad = [&](const std::string& what) {
    throw IoError(where + ": meta.json's layout is damaged: " + what);
  };
  constexpr int64_t kMaxPartitions = int64_t{1} << 24, kMaxNumel = int64_t{1} << 50;
  if (l.partitions < 1 || l.partitions > kMaxPartitions)
    bad("partitions " + std::to_string(l.partitions) + "; expected 1 to " + std::to_string(kMaxPartitions));
  std::set<std::string> names;
  for (auto& g : l.groups) {
    const std::string group = "group " + g.name;
    if (g.chunk_numel < 1 || g.chunk_numel > kMaxNumel)
      bad(group + " has chunk_numel " + std::to_string(g.chunk_numel) + "; expected 1 or more");
    if (g.padded_numel < g.chunk_numel || g.padded_numel > kMaxNumel)
      bad(group + " has padded_numel " + std::to_string(g.padded_numel) + "; expected at least its chunk_numel " +
          std::to_string(g.chunk_numel));
    for (auto& p : g.params) {
      int64_t numel = 1;
      for (const int64_t d : p.shape) {
        if (d < 0 || d > kMaxNumel || (d > 0 && numel > kMaxNumel / d))
          bad("parameter " + p.name + " has shape " + nlohmann::json(p.shape).dump() + ", which is not a tensor's shape");
        numel *= d;
      }
      if (p.offset < 0 || p.offset > g.padded_numel - numel)
        bad("parameter " + p.name + " at offset " + std::to_string(p.offset) + " with " + std::to_string(numel) +
            " elements lies outside its group's " + std::to_string(g.padded_numel));
      if (!names.insert(p.name).second) bad("parameter " + p.name + " is laid out twice");
      p.numel = numel;
    }
  }
  for (const auto& [alias, name] : l.aliases)
    if (names.count(name) == 0) bad("alias " + alias + " names " + name + ", which is not laid out");
  return l;
}

std::unordered_map<std::string, std::pair<size_t, size_t>> SavedLayout::index() const {
  std::unordered_map<std::string, std::pair<size_t, size_t>> out;
  for (size_t g = 0; g < groups.size(); ++g)
    for (size_t i = 0; i < groups[g].params.size(); ++i) out[groups[g].params[i].name] = {g, i};
  for (const auto& [alias, name] : aliases)
    if (auto it = out.find(name); it != out.end()) out.emplace(alias, it->second);
  return out;
}

SavedLayout layout_of(const partition::FlatParameters& flat, int64_t partitions, const torch::nn::Module& model) {
  SavedLayout l;
  l.partitions = partitions;
  std::unordered_map<const void*, std::string> laid_out;
  for (const auto& grp : flat.groups()) {
    SavedGroup g;
    g.name = grp.name;
    g.padded_numel = grp.padded_numel;
    g.chunk_numel = grp.chunk_numel;
    for (size_t s : grp.slots) {
      const auto& slot = flat.slots()[s];
      g.params.push_back({slot.name, slot.shape, slot.offset - grp.begin, slot.numel});
      laid_out[slot.param.unsafeGetTensorImpl()] = slot.name;
    }
    l.groups.push_back(std::move(g));
  }
  for (const auto& item : model.named_parameters(true)) {
    auto it = laid_out.find(item.value().unsafeGetTensorImpl());
    if (it != laid_out.end() && it->second != item.key()) l.aliases[item.key()] = it->second;
  }
  return l;
}

void append_pieces(const SavedLayout& saved, size_t group, size_t param, int64_t first, int64_t count, int64_t dst,
                   std::vector<Piece>& out) {
  const SavedGroup& sg = saved.groups.at(group);
  const SavedParam& sp = sg.params.at(param);
  ZERO_CHECK(first >= 0 && first + count <= sp.numel, "elements past the end of parameter " + sp.name);
  // Element `first` of the parameter is element sp.offset + first of its saved group, split at the saved chunks.
  int64_t from = sp.offset + first;
  while (count > 0) {
    const int64_t part = from / sg.chunk_numel, begin = from % sg.chunk_numel;
    const int64_t n = std::min(count, sg.chunk_numel - begin);
    if (!out.empty()) {
      Piece& last = out.back();
      if (last.part == part && last.group == group && last.begin + last.count == begin && last.dst + last.count == dst) {
        last.count += n;
        from += n, dst += n, count -= n;
        continue;
      }
    }
    out.push_back({part, group, begin, n, dst});
    from += n, dst += n, count -= n;
  }
}

std::vector<Piece> map_range(const partition::FlatParameters& flat, int64_t rank, size_t g, int64_t start,
                             int64_t len, const SavedLayout& saved,
                             const std::unordered_map<std::string, std::pair<size_t, size_t>>& index,
                             const std::string& source, const std::unordered_set<std::string>* skip) {
  const auto& group = flat.all_groups()[g];  // a frozen group's too (NOTE [frozen groups])
  const int64_t lo = rank * group.chunk_numel + start, hi = lo + len;  // in group coordinates
  std::vector<Piece> out;
  for (size_t s : group.slots) {
    const auto& slot = flat.all_slots()[s];
    const int64_t p0 = slot.offset - group.begin, p1 = p0 + slot.numel;
    const int64_t a = std::max(lo, p0), b = std::min(hi, p1);
    if (a >= b) continue;
    if (skip != nullptr && skip->count(slot.name) > 0) continue;  // left to the caller
    auto it = index.find(slot.name);
    if (it == index.end())
      throw IoError(source + ": has no parameter " + slot.name + " (the model has it, shape " + shape_text(slot.shape) +
                    "): a checkpoint of another model");
    const SavedGroup& sg = saved.groups[it->second.first];
    const SavedParam& sp = sg.params[it->second.second];
    if (sp.shape != slot.shape)
      throw IoError(source + ": parameter " + slot.name + " has shape " + shape_text(sp.shape) + " there and " +
                    shape_text(slot.shape) + " in the model: a checkpoint of another model");
    append_pieces(saved, it->second.first, it->second.second, a - p0, b - a, a - lo, out);
  }
  return out;
}

std::unique_ptr<PieceReader> PieceReader::checkpoint(const std::string& tag_dir, const nlohmann::json& meta,
                                                     const offload::AioOptions& aio) {
  return std::make_unique<CheckpointReader>(tag_dir, meta.at("files"), aio);
}

WeightFiles WeightFiles::resolve(const std::string& path) {
  WeightFiles w;
  w.source = path;
  std::string index;
  auto regular = [](const std::string& p) { return input_file_problem(p, p).empty(); };
  if (is_folder(path)) {
    // transformers' order (from_pretrained of a folder, os.path.isfile):
    // model.safetensors when it is a file there, its sharded index only
    // when it is not.
    if (regular(path + "/model.safetensors")) w.files = {path + "/model.safetensors"};
    else if (regular(path + "/model.safetensors.index.json")) index = path + "/model.safetensors.index.json";
    else if (path_exists(path + "/model.safetensors"))
      throw IoError(input_file_problem(path + "/model.safetensors", path + "/model.safetensors") + " (the weights to load)");
    else
      throw IoError(path + ": a folder with neither model.safetensors nor model.safetensors.index.json (the weights "
                           "to load, as save_pretrained writes them)");
  } else if (!regular(path)) {
    throw IoError(input_file_problem(path, path) + " (the weights to load: a safetensors file, its index, or their folder)");
  } else if (path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0) {
    index = path;
  } else {
    w.files = {path};
  }
  w.index = index;
  if (!index.empty()) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(read_small_file(index));
    } catch (const IoError&) {
      throw;
    } catch (const std::exception& e) {
      throw IoError(index + ": not valid JSON (" + e.what() + "): expected a safetensors index with a weight_map");
    }
    if (!j.is_object() || !j.contains("weight_map") || !j.at("weight_map").is_object())
      throw IoError(index + ": has no \"weight_map\" object: not a safetensors index");
    const auto slash = index.rfind('/');
    const std::string folder = slash == std::string::npos ? "." : index.substr(0, slash);
    std::set<std::string> seen;
    for (const auto& [name, file] : j.at("weight_map").items()) {
      if (!file.is_string()) throw IoError(index + ": weight_map." + name + ": expected a file name");
      const std::string shard = file.get<std::string>();
      if (shard.empty() || shard.find('/') != std::string::npos || shard[0] == '.')
        throw IoError(index + ": weight_map." + name + ": \"" + shard + "\" is not a file of the index's folder");
      if (!seen.insert(shard).second) continue;
      if (!regular(folder + "/" + shard))
        throw IoError(input_file_problem(folder + "/" + shard, folder + "/" + shard) + " (" + index + " names it for " +
                      name + ")");
      w.files.push_back(folder + "/" + shard);
    }
    std::sort(w.files.begin(), w.files.end());
    if (w.files.empty()) throw IoError(index + ": its weight_map names no file");
  }
  return w;
}

std::unique_ptr<PieceReader> PieceReader::weights(const WeightFiles& files,
                                                  const std::function<std::string(const std::string&)>& rename,
                                                  SavedLayout* layout, std::vector<WeightTensor>* tensors,
                                                  const offload::AioOptions& aio) {
  auto r = std::make_unique<WeightsReader>(files, rename, aio);
  layout->partitions = 1;
  layout->groups.clear();
  layout->aliases.clear();
  for (const auto& t : r->tensors()) {  // one group per tensor, in order (Piece::group indexes them)
    SavedGroup g;
    g.name = t.name;
    const int64_t numel = c10::multiply_integers(t.shape);
    g.padded_numel = g.chunk_numel = std::max<int64_t>(1, numel);
    if (at::isFloatingType(t.dtype)) g.params.push_back({t.name, t.shape, 0, numel});
    layout->groups.push_back(std::move(g));
  }
  if (tensors != nullptr) *tensors = r->tensors();
  return r;
}

void check_saved_states(const std::string& tag_dir, const nlohmann::json& meta, PieceReader& reader) {
  std::set<std::string> listed;
  for (const auto& st : meta.at("states")) listed.insert(st.get<std::string>());
  const int64_t partitions = meta.at("layout").value("partitions", int64_t{1});
  for (const auto& [file, info] : meta.at("files").items()) {
    if (file.rfind("rank", 0) != 0) continue;
    std::set<std::string> held;
    for (const auto& t : reader.file_layout(file).tensors) {
      if (t.name.rfind("rng.", 0) == 0) continue;
      const auto dot = t.name.rfind('.');
      held.insert(dot == std::string::npos ? t.name : t.name.substr(0, dot));
    }
    const int64_t rank = std::atoll(file.substr(4).c_str());
    if (held.empty() && rank >= partitions) continue;  // a rank that held no partition: its RNG states only
    for (const auto& h : held)
      if (listed.count(h) == 0)
        throw IoError(tag_dir + "/" + file + ": holds the state " + h + ", which meta.json's \"states\" does not list: "
                      "meta.json does not describe the files it came with (edited or damaged)");
    for (const auto& l : listed)
      if (held.count(l) == 0)
        throw IoError(tag_dir + "/" + file + ": holds no state " + l + ", which meta.json's \"states\" lists: "
                      "meta.json does not describe the files it came with (edited or damaged)");
  }
}

void check_tag(const std::string& tag) {
  if (tag.empty() || tag.size() > 200 || tag[0] == '.' || tag.find('/') != std::string::npos ||
      tag.find('\0') != std::string::npos || tag == "latest") {
    throw UsageError("checkpoint tag \"" + tag.substr(0, 200) +
                     "\": expected a name of 1-200 characters without '/', not starting with '.', not \"latest\"");
  }
}

std::string tag_folder(const std::string& dir, const std::string& tag_in) {
  std::string tag = tag_in;
  if (!path_exists(dir)) throw IoError(dir + ": no such file or folder");
  if (!is_folder(dir)) throw IoError(dir + ": not a folder (a checkpoint is the folder save_checkpoint wrote)");
  if (tag.empty()) {
    if (file_size(dir + "/latest") < 0)
      throw IoError(dir + "/latest: missing: no complete checkpoint in " + dir + " (or give the tag)");
    tag = read_small_file(dir + "/latest");
    tag.erase(tag.find_last_not_of(" \n\r\t") + 1);
  }
  check_tag(tag);
  // NOTE [checkpoint commit]: a save replacing this tag that stopped between
  // moving the old folder aside and renaming the new one in leaves only the old.
  const std::string aside = dir + "/." + tag + ".old";
  if (file_size(dir + "/" + tag + "/meta.json") < 0 && file_size(aside + "/meta.json") >= 0) return aside;
  return dir + "/" + tag;
}

nlohmann::json read_meta(const std::string& tag_dir) {
  const std::string path = tag_dir + "/meta.json";
  if (file_size(path) < 0) throw IoError(path + ": missing: " + tag_dir + " is not a complete checkpoint");
  nlohmann::json meta;
  try {
    meta = nlohmann::json::parse(read_small_file(path));
  } catch (const IoError&) {
    throw;
  } catch (const std::exception& e) {
    throw IoError(path + ": not valid JSON (" + e.what() + "): a damaged checkpoint");
  }
  if (!meta.is_object() || meta.value("format", "") != kFormat)
    throw IoError(path + ": not a zero checkpoint (format \"" + std::string(kFormat) + "\")");
  if (meta.value("version", 0) != kVersion)
    throw IoError(path + ": format version " + meta.value("version", nlohmann::json(nullptr)).dump() +
                  "; this build reads version " + std::to_string(kVersion));
  for (const char* key : {"world_size", "states", "layout", "files", "global_steps", "client_state"})
    if (!meta.contains(key)) throw IoError(path + ": has no \"" + key + "\": a damaged checkpoint");
  // Every value a load trusts, checked here once, so that a damaged or
  // hand-edited meta.json is refused by name instead of read as a count.
  const auto bad = [&](const std::string& key, const std::string& expected) {
    throw IoError(path + ": " + key + ": expected " + expected + "; got " + meta.at(key).dump(-1).substr(0, 80) +
                  ": a damaged checkpoint");
  };
  const auto count = [&](const char* key, int64_t lo, int64_t hi) {
    if (!meta.contains(key)) return;
    const auto& v = meta.at(key);
    if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi)
      bad(key, "an integer from " + std::to_string(lo) + " to " + std::to_string(hi));
  };
  constexpr int64_t kMany = int64_t{1} << 62;
  count("world_size", 1, int64_t{1} << 24);
  count("stage", 0, 3);
  for (const char* key : {"global_steps", "micro_steps", "skipped_steps", "applied_steps"}) count(key, 0, kMany);
  const auto& states = meta.at("states");
  if (!states.is_array() || states.empty() ||
      !std::all_of(states.begin(), states.end(), [](const nlohmann::json& v) { return v.is_string(); }))
    bad("states", "a list of state names");
  if (!meta.at("files").is_object()) bad("files", "an object of file -> its size and checksums");
  if (!meta.at("client_state").is_object()) bad("client_state", "an object");
  if (!meta.at("layout").is_object()) bad("layout", "an object");
  SavedLayout::from_json(meta.at("layout"), path);  // throws naming what is damaged
  return meta;
}

namespace {

// State `state` of every parameter of a checkpoint, in its layout's order, a
// window of at most 4 Mi elements at a time (fp32; `window` valid during the
// call), `last` on a parameter's last window (an empty one for a parameter
// of no elements).
void for_each_window(PieceReader& reader, const SavedLayout& saved, const std::string& state, int64_t total,
                     const std::function<void(int64_t, int64_t)>& progress,
                     const std::function<void(size_t param, const at::Tensor& window, bool last)>& fn) {
  constexpr int64_t kWindow = int64_t{4} << 20;
  std::vector<float> buf;
  int64_t done = 0;
  size_t i = 0;
  for (size_t g = 0; g < saved.groups.size(); ++g) {
    for (size_t p = 0; p < saved.groups[g].params.size(); ++p, ++i) {
      const SavedParam& sp = saved.groups[g].params[p];
      if (sp.numel == 0) fn(i, at::empty({0}, at::kFloat), true);
      for (int64_t e = 0; e < sp.numel; e += kWindow) {
        const int64_t n = std::min(kWindow, sp.numel - e);
        std::vector<Piece> pieces;
        append_pieces(saved, g, p, e, n, 0, pieces);
        buf.resize(static_cast<size_t>(n));
        reader.fill({state}, pieces, n, {buf.data()});
        fn(i, at::from_blob(buf.data(), {n}, at::kFloat), e + n == sp.numel);
        done += n;
        if (progress) progress(done, total);
      }
    }
  }
}

}  // namespace

ConsolidateStats consolidate(const std::string& tag_dir, const std::string& out, at::ScalarType dtype,
                             const std::string& state, const offload::AioOptions& aio,
                             const std::function<void(int64_t, int64_t)>& progress) {
  auto opened = deepspeed::open_any(tag_dir, aio);  // zero's or DeepSpeed's
  const nlohmann::json& meta = opened.meta;
  const auto states = meta.at("states").get<std::vector<std::string>>();
  const bool weights = state == "fp32_master";
  // 8-bit states first: their names (codes, scales) are not what a user asks for.
  if (!weights && !meta.value("state_blocks", nlohmann::json(nullptr)).is_null())
    throw UsageError("state \"" + state + "\": the checkpoint " + tag_dir + " holds 8-bit Adam states "
                     "(optimizer.params.optim_bits 8: codes and block scales, NOTE [8-bit states]), which are not "
                     "laid out per parameter; only fp32_master can be written out");
  if (std::find(states.begin(), states.end(), state) == states.end()) {
    std::string have;
    for (const auto& n : states) have += (have.empty() ? "" : ", ") + n;
    throw UsageError("state \"" + state + "\": the checkpoint " + tag_dir + " holds " + have);
  }
  const SavedLayout saved = SavedLayout::from_json(meta.at("layout"), tag_dir + "/meta.json");
  auto reader = std::move(opened.reader);
  const Layout no_extra;
  const Layout& extra = weights ? reader->file_layout("model.safetensors") : no_extra;
  Layout layout;
  int64_t total = 0;
  for (const auto& g : saved.groups)
    for (const auto& p : g.params) {
      layout.tensors.push_back({p.name, dtype, p.shape});
      total += p.numel;
    }
  for (const auto& t : extra.tensors) layout.tensors.push_back({t.name, t.dtype, t.shape});
  layout.metadata = {{"format", "pt"},
                     {"source", tag_dir},
                     {"state", state},
                     {"global_steps", std::to_string(meta.at("global_steps").get<int64_t>())}};
  if (!saved.aliases.empty()) layout.metadata["tied"] = nlohmann::json(saved.aliases).dump();
  offload::AioEngine engine(aio);
  TensorFileWriter w(out, layout, engine);
  ConsolidateStats st;
  size_t i = 0;
  for_each_window(*reader, saved, state, total, progress, [&](size_t, const at::Tensor& window, bool last) {
    w.append(i, window.to(dtype));
    if (last) ++i, ++st.tensors;
  });
  for (const auto& t : extra.tensors) {
    w.append(i++, reader->read_tensor("model.safetensors", t.name));
    ++st.tensors;
  }
  st.bytes_written = w.commit("").bytes;
  st.bytes_read = reader->bytes_read();
  return st;
}

ConsolidateStats export_hf(const std::string& tag_dir, const std::string& out_dir, at::ScalarType dtype,
                           int64_t max_shard_bytes, const std::string& config_json, const offload::AioOptions& aio,
                           const std::function<void(int64_t, int64_t)>& progress) {
  const nlohmann::json meta = read_meta(tag_dir);
  const SavedLayout saved = SavedLayout::from_json(meta.at("layout"), tag_dir + "/meta.json");
  auto reader = PieceReader::checkpoint(tag_dir, meta, aio);
  const Layout& extra = reader->file_layout("model.safetensors");
  std::vector<HfWriter::Tensor> plan;
  int64_t total = 0;
  for (const auto& g : saved.groups)
    for (const auto& p : g.params) {
      plan.push_back({p.name, dtype, p.shape});
      total += p.numel;
    }
  for (const auto& t : extra.tensors) plan.push_back({t.name, t.dtype, t.shape});
  if (plan.empty()) throw IoError(tag_dir + ": holds no tensors to export");
  offload::AioEngine engine(aio);
  HfWriter writer(out_dir, plan, max_shard_bytes, engine);
  ConsolidateStats st;
  for_each_window(*reader, saved, "fp32_master", total, progress, [&](size_t, const at::Tensor& window, bool last) {
    writer.append_part(window);
    if (last) ++st.tensors;
  });
  for (const auto& t : extra.tensors) {
    writer.append(reader->read_tensor("model.safetensors", t.name));
    ++st.tensors;
  }
  writer.finish(config_json);
  st.bytes_written = writer.bytes();
  st.bytes_read = reader->bytes_read();
  return st;
}

}  // namespace zero::ckpt
