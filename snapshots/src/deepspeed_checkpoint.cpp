// Reading DeepSpeed's checkpoints: NOTE [deepspeed checkpoints].
#include "zero/snapshots/deepspeed_checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <unordered_set>

#include "zero/core/error.h"
#include "zero/snapshots/checkpoint_format.h"
#include "zero/snapshots/deepspeed_names.h"
#include "zero/snapshots/pickle.h"

namespace zero::ckpt::deepspeed {

using pickle::Archive;
using pickle::TensorRef;
using pickle::Value;

std::string find(const std::string& dir, const std::string& tag) {
  auto holds_model_file = [](const std::string& d) {
    return path_exists(d + "/" + kModelFile) || path_exists(d + "/" + zero3_model_file(0));
  };
  auto tag_of = [&](const std::string& latest) -> std::string {
    std::string t = read_small_file(latest);
    while (!t.empty() && (t.back() == '\n' || t.back() == '\r' || t.back() == ' ')) t.pop_back();
    return t;
  };
  if (!is_folder(dir)) return "";
  if (path_exists(dir + "/meta.json")) return "";
  if (!tag.empty()) {
    const std::string d = dir + "/" + tag;
    return is_folder(d) && !path_exists(d + "/meta.json") && holds_model_file(d) ? d : "";
  }
  if (holds_model_file(dir)) return dir;
  for (const char* latest : {"latest", "latest_universal"}) {
    const std::string path = dir + "/" + latest;
    if (!is_regular_file(path)) continue;
    const std::string t = tag_of(path);
    if (t.empty() || t.find('/') != std::string::npos) continue;
    const std::string d = dir + "/" + t;
    if (is_folder(d) && !path_exists(d + "/meta.json") && holds_model_file(d)) return d;
  }
  return "";
}

namespace {

// Where elements of one saved chunk are: [at, at + count) of the chunk are
// elements [first, first + count) of tensor `t` of archive `a`.
struct Span {
  const Archive* a = nullptr;
  const TensorRef* t = nullptr;
  int64_t first = 0, count = 0, at = 0;
};

// The layout and sources of one checkpoint.
struct Source {
  std::string tag_dir;
  int stage = 0;
  bool universal = false;
  int64_t ranks = 1;
  std::vector<std::unique_ptr<Archive>> archives;  // every file read
  const Archive* model = nullptr;                   // the model's file (rank 0's at stage 3)
  std::vector<const Archive*> rank_models;          // stage 3: each rank's model file
  SavedLayout layout;
  // spans[state][group][part]
  std::map<std::string, std::vector<std::vector<std::vector<Span>>>> spans;
  std::map<std::string, std::vector<int64_t>> frozen;  // name -> shape (stage 3's fragments)
  std::set<std::string> trainable;                     // in param_shapes
  Layout extras;  // the buffers and frozen parameters, as "model.safetensors" would list them
};

const char* kStates[] = {"fp32_master", "exp_avg", "exp_avg_sq"};

std::vector<int64_t> shape_of(const Value& v, const std::string& where) {
  std::vector<int64_t> out;
  for (const auto& d : v.as_sequence(where)) out.push_back(d->as_int(where));
  return out;
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// The optimizer's parameter groups: names and shapes in order.
std::vector<std::vector<std::pair<std::string, std::vector<int64_t>>>> param_shapes(const Archive& m) {
  const std::string where = m.path() + ": param_shapes";
  std::vector<std::vector<std::pair<std::string, std::vector<int64_t>>>> groups;
  const Value& ps = m.root().at("param_shapes", m.path());
  if (ps.kind == Value::Kind::kDict) {  // (a single group saved as one dict)
    groups.emplace_back();
    for (const auto& [k, v] : ps.as_dict(where)) groups.back().emplace_back(k->as_str(where), shape_of(*v, where));
    return groups;
  }
  for (const auto& g : ps.as_sequence(where)) {
    groups.emplace_back();
    for (const auto& [k, v] : g->as_dict(where)) groups.back().emplace_back(k->as_str(where), shape_of(*v, where));
  }
  return groups;
}

// The moments of a stage-1/2 rank file's group g: base_optimizer_state is
// the torch optimizer's state dict (state keyed by group), or a list of
// states per group (elastic checkpoints).
const Value& moments_of(const Value& osd, size_t g, const std::string& where) {
  const Value& base = osd.at("base_optimizer_state", where);
  if (base.kind == Value::Kind::kList) {
    const auto& items = base.as_sequence(where + ": base_optimizer_state");
    if (g >= items.size()) throw IoError(where + ": base_optimizer_state has no group " + std::to_string(g));
    return *items[g];
  }
  const Value& state = base.at("state", where + ": base_optimizer_state");
  const Value* s = state.find(static_cast<int64_t>(g));
  if (s == nullptr) throw IoError(where + ": base_optimizer_state.state has no entry " + std::to_string(g) +
                                  " (an optimizer group without Adam's states: not trained yet, or not Adam)");
  return *s;
}

// Reads every tensor `root` holds (each value once), whole; returns the bytes.
int64_t read_every_tensor(const Archive& a, const Value& root) {
  std::unordered_set<const Value*> seen;
  std::vector<const Value*> work{&root};
  int64_t n = 0;
  while (!work.empty()) {
    const Value* v = work.back();
    work.pop_back();
    if (!seen.insert(v).second) continue;
    if (v->kind == Value::Kind::kTensor) n += a.read(v->tensor).nbytes();
    for (const auto& x : v->items) work.push_back(x.get());
    for (const auto& [k, x] : v->entries) work.push_back(x.get());
  }
  return n;
}

class DsReader final : public PieceReader {
 public:
  explicit DsReader(std::shared_ptr<Source> src) : src_(std::move(src)) {}

  struct Reads final : Pending {
    std::vector<std::vector<float>> data;
  };

  std::unique_ptr<Pending> issue(const std::vector<std::string>& states, std::vector<Piece> pieces,
                                 int64_t len) override {
    auto out = std::make_unique<Reads>();
    out->data.assign(states.size(), std::vector<float>(static_cast<size_t>(len), 0.0f));
    for (size_t i = 0; i < states.size(); ++i) {
      auto it = src_->spans.find(states[i]);
      if (it == src_->spans.end())
        throw IoError(src_->tag_dir + ": a DeepSpeed checkpoint holds fp32_master, exp_avg and exp_avg_sq; asked for " +
                      states[i]);
      for (const Piece& p : pieces) {
        const auto& spans = it->second.at(p.group).at(static_cast<size_t>(p.part));
        for (const Span& s : spans) {
          const int64_t lo = std::max(p.begin, s.at), hi = std::min(p.begin + p.count, s.at + s.count);
          if (lo >= hi) continue;
          s.a->read_floats(*s.t, s.first + (lo - s.at), hi - lo, out->data[i].data() + p.dst + (lo - p.begin));
        }
      }
    }
    return out;
  }

  void complete(Pending& pending, const std::vector<float*>& dsts) override {
    auto& r = static_cast<Reads&>(pending);
    for (size_t i = 0; i < dsts.size() && i < r.data.size(); ++i)
      std::memcpy(dsts[i], r.data[i].data(), r.data[i].size() * sizeof(float));
    bytes_read_ = total_read();
  }

  at::Tensor read_tensor(const std::string& file, const std::string& name) override {
    const Value* v = model_entry(file, name);
    at::Tensor t;
    if (v != nullptr) {
      t = src_->model->read(v->as_tensor(src_->model->path() + ": module." + name));
    } else if (auto it = src_->frozen.find(name); it != src_->frozen.end()) {
      // Stage 3's frozen parameters: each rank's fragment, in rank order.
      std::vector<at::Tensor> parts;
      for (const Archive* m : src_->rank_models) {
        const std::string where = m->path() + ": frozen_param_fragments";
        parts.push_back(m->read(m->root().at("frozen_param_fragments", m->path()).at(name, where).as_tensor(where)).reshape({-1}));
      }
      const int64_t n = numel_of(it->second);
      at::Tensor all = at::cat(parts);
      if (all.numel() < n)
        throw IoError(src_->tag_dir + ": the fragments of frozen parameter " + name + " hold " +
                      std::to_string(all.numel()) + " elements; its shape needs " + std::to_string(n));
      t = all.narrow(0, 0, n).reshape(it->second).contiguous();
    } else {
      throw IoError(src_->tag_dir + ": the DeepSpeed checkpoint has no " + name + " in its model file");
    }
    bytes_read_ = total_read();
    return t;
  }

  bool has_tensor(const std::string& file, const std::string& name) override {
    return model_entry(file, name) != nullptr || src_->frozen.count(name) != 0;
  }

  const Layout& file_layout(const std::string& file) override {
    if (file == "model.safetensors") return src_->extras;
    throw IoError(src_->tag_dir + ": " + file + " is not a file of a DeepSpeed checkpoint");
  }

  int64_t verify_file(const std::string& file) override {
    for (const auto& a : src_->archives)
      if (a->path() == file || a->path() == src_->tag_dir + "/" + file) return verify(*a, a->root());
    throw IoError(src_->tag_dir + ": has no file " + file);
  }

 private:
  // A buffer or (below stage 3) parameter of the model's state dict, not
  // an empty placeholder of a partitioned one.
  const Value* model_entry(const std::string& file, const std::string& name) const {
    if (file != "model.safetensors" && !file.empty()) return nullptr;
    const Value* module = src_->model->root().find("module");
    if (module == nullptr) return nullptr;
    const Value* v = module->find(name);
    if (v == nullptr || v->kind != Value::Kind::kTensor || src_->trainable.count(name) != 0) return nullptr;
    if (v->tensor.numel() == 0 && !v->tensor.sizes.empty() && src_->stage == 3) return nullptr;
    return v;
  }
  int64_t verify(const Archive& a, const Value& root) { return read_every_tensor(a, root); }
  int64_t total_read() const {
    int64_t n = 0;
    for (const auto& a : src_->archives) n += a->bytes_read();
    return n;
  }
  std::shared_ptr<Source> src_;
};

// Builds the layout and spans of stages 1 and 2: a saved group per
// DeepSpeed group, a part per rank.
void lay_out_zero12(Source& s, const std::vector<const Archive*>& optim,
                    const std::vector<std::vector<std::pair<std::string, std::vector<int64_t>>>>& groups) {
  s.layout.partitions = s.ranks;
  for (const auto& st : kStates) s.spans[st].assign(groups.size(), std::vector<std::vector<Span>>(static_cast<size_t>(s.ranks)));
  for (size_t g = 0; g < groups.size(); ++g) {
    SavedGroup sg;
    sg.name = std::to_string(g);
    int64_t offset = 0;
    for (const auto& [name, shape] : groups[g]) {
      SavedParam p{name, shape, offset, numel_of(shape)};
      offset += p.numel;
      sg.params.push_back(std::move(p));
    }
    // Each rank's fp32 partition, saved without its padding (the ZeRO
    // optimizer) or with it (DeepSpeed's BF16 optimizer: every partition
    // the same length, the padding in the last).
    std::vector<const TensorRef*> masters;
    std::vector<const Value*> osds;
    std::vector<int64_t> pads;
    bool all_padded = true;
    for (int64_t r = 0; r < s.ranks; ++r) {
      const Archive& a = *optim[static_cast<size_t>(r)];
      const std::string where = a.path() + ": optimizer_state_dict";
      const Value& osd = a.root().at("optimizer_state_dict", a.path());
      const auto& fp32 = osd.at("single_partition_of_fp32_groups", where).as_sequence(where);
      if (fp32.size() != groups.size())
        throw IoError(where + ": single_partition_of_fp32_groups has " + std::to_string(fp32.size()) +
                      " groups; the model file's param_shapes " + std::to_string(groups.size()));
      masters.push_back(&fp32[g]->as_tensor(where + ": single_partition_of_fp32_groups"));
      osds.push_back(&osd);
      const auto& p = osd.at("group_paddings", where).as_sequence(where + ": group_paddings");
      pads.push_back(g < p.size() ? p[g]->as_int(where + ": group_paddings") : 0);
      all_padded = all_padded && masters.back()->numel() == masters[0]->numel();
    }
    int64_t saved_total = 0, pad_total = 0;
    for (size_t r = 0; r < masters.size(); ++r) saved_total += masters[r]->numel(), pad_total += pads[r];
    all_padded = all_padded && pad_total > 0 && saved_total != offset && saved_total == offset + pad_total;
    const int64_t chunk = all_padded ? masters[0]->numel() : masters[0]->numel() + pads[0];
    int64_t lean_total = 0;
    for (int64_t r = 0; r < s.ranks; ++r) {
      const Archive& a = *optim[static_cast<size_t>(r)];
      const std::string where = a.path() + ": optimizer_state_dict";
      const TensorRef& master = *masters[static_cast<size_t>(r)];
      const int64_t lean = all_padded ? std::clamp<int64_t>(offset - r * chunk, 0, chunk) : master.numel();
      if (!all_padded && master.numel() + pads[static_cast<size_t>(r)] != chunk)
        throw IoError(where + ": group " + std::to_string(g) + "'s partition holds " + std::to_string(master.numel()) +
                      " + " + std::to_string(pads[static_cast<size_t>(r)]) + " padding elements; rank 0's " +
                      std::to_string(chunk) + ": files of different checkpoints");
      lean_total += lean;
      s.spans["fp32_master"][g][static_cast<size_t>(r)].push_back({&a, &master, 0, lean, 0});
      const Value& moments = moments_of(*osds[static_cast<size_t>(r)], g, where);
      for (const char* m : {"exp_avg", "exp_avg_sq"}) {
        const TensorRef& t = moments.at(m, where + ": base_optimizer_state").as_tensor(where + ": " + m);
        if (t.numel() < lean)
          throw IoError(where + ": group " + std::to_string(g) + "'s " + m + " holds " + std::to_string(t.numel()) +
                        " elements, its fp32 partition " + std::to_string(lean));
        s.spans[m][g][static_cast<size_t>(r)].push_back({&a, &t, 0, lean, 0});
      }
    }
    if (lean_total != offset)
      throw IoError(s.tag_dir + ": optimizer group " + std::to_string(g) + " holds " + std::to_string(lean_total) +
                    " elements in its rank files and " + std::to_string(offset) +
                    " in the model file's param_shapes: files of different checkpoints or models");
    sg.chunk_numel = chunk;
    sg.padded_numel = chunk * s.ranks;
    s.layout.groups.push_back(std::move(sg));
  }
}

// Stage 3: a saved group per parameter, a part per rank.
void lay_out_zero3(Source& s, const std::vector<const Archive*>& optim,
                   const std::vector<std::vector<std::pair<std::string, std::vector<int64_t>>>>& groups) {
  s.layout.partitions = s.ranks;
  std::vector<std::pair<std::string, std::vector<int64_t>>> params;
  for (const auto& g : groups) params.insert(params.end(), g.begin(), g.end());
  for (const auto& st : kStates) s.spans[st].assign(params.size(), std::vector<std::vector<Span>>(static_cast<size_t>(s.ranks)));
  std::vector<int64_t> parts;
  for (const auto& [name, shape] : params) {
    SavedGroup sg;
    sg.name = name;
    const int64_t n = numel_of(shape);
    parts.push_back((n + s.ranks - 1) / s.ranks);  // DeepSpeed's partition (0 for an empty parameter)
    sg.chunk_numel = std::max<int64_t>(1, parts.back());  // (a saved group holds at least one element)
    sg.padded_numel = sg.chunk_numel * s.ranks;
    sg.params.push_back({name, shape, 0, n});
    s.layout.groups.push_back(std::move(sg));
  }
  for (int64_t r = 0; r < s.ranks; ++r) {
    const Archive& a = *optim[static_cast<size_t>(r)];
    const std::string where = a.path() + ": optimizer_state_dict";
    const Value& osd = a.root().at("optimizer_state_dict", a.path());
    const auto& flats = osd.at("fp32_flat_groups", where).as_sequence(where + ": fp32_flat_groups");
    const Value& state = osd.at("optimizer_state_dict", where).at("state", where + ".optimizer_state_dict");
    // Rank r's flat groups one after another: parameter p's partition at its offset.
    struct Flat {
      const TensorRef* master;
      const TensorRef* m;
      const TensorRef* v;
      int64_t begin;
    };
    std::vector<Flat> flat;
    int64_t total = 0;
    for (size_t j = 0; j < flats.size(); ++j) {
      const TensorRef& t = flats[j]->as_tensor(where + ": fp32_flat_groups");
      const Value* sj = state.find(static_cast<int64_t>(j));
      if (sj == nullptr)
        throw IoError(where + ".optimizer_state_dict.state has no entry " + std::to_string(j) +
                      " (a sub-group without Adam's states: not trained yet, or not Adam)");
      const TensorRef& m = sj->at("exp_avg", where + ".optimizer_state_dict.state").as_tensor(where + ": exp_avg");
      const TensorRef& v = sj->at("exp_avg_sq", where + ".optimizer_state_dict.state").as_tensor(where + ": exp_avg_sq");
      if (m.numel() != t.numel() || v.numel() != t.numel())
        throw IoError(where + ": sub-group " + std::to_string(j) + "'s moments and fp32 partition differ in length");
      flat.push_back({&t, &m, &v, total});
      total += t.numel();
    }
    int64_t offset = 0;
    for (size_t p = 0; p < params.size(); ++p) {
      const int64_t chunk = parts[p];
      for (const Flat& f : flat) {
        const int64_t lo = std::max(offset, f.begin), hi = std::min(offset + chunk, f.begin + f.master->numel());
        if (lo >= hi) continue;
        const Span base{&a, nullptr, lo - f.begin, hi - lo, lo - offset};
        Span sm = base, se = base, sv = base;
        sm.t = f.master;
        se.t = f.m;
        sv.t = f.v;
        s.spans["fp32_master"][p][static_cast<size_t>(r)].push_back(sm);
        s.spans["exp_avg"][p][static_cast<size_t>(r)].push_back(se);
        s.spans["exp_avg_sq"][p][static_cast<size_t>(r)].push_back(sv);
      }
      offset += chunk;
    }
    if (offset != total)
      throw IoError(where + ": fp32_flat_groups hold " + std::to_string(total) + " elements; the partitions of the " +
                    std::to_string(params.size()) + " parameters in param_shapes at " + std::to_string(s.ranks) +
                    " ranks take " + std::to_string(offset) + ": files of different checkpoints or models");
  }
}

// The universal form: a saved group per parameter, whole.
void lay_out_universal(Source& s, const std::vector<std::vector<std::pair<std::string, std::vector<int64_t>>>>& groups) {
  s.layout.partitions = 1;
  std::vector<std::pair<std::string, std::vector<int64_t>>> params;
  for (const auto& g : groups) params.insert(params.end(), g.begin(), g.end());
  for (const auto& st : kStates) s.spans[st].assign(params.size(), std::vector<std::vector<Span>>(1));
  for (size_t p = 0; p < params.size(); ++p) {
    const auto& [name, shape] = params[p];
    const int64_t n = numel_of(shape);
    const int64_t chunk = std::max<int64_t>(1, n);  // (a saved group holds at least one element)
    s.layout.groups.push_back({name, chunk, chunk, {{name, shape, 0, n}}});
    const std::string folder = s.tag_dir + "/zero/" + name;
    const std::pair<const char*, const char*> files[] = {
        {"fp32_master", "fp32.pt"}, {"exp_avg", "exp_avg.pt"}, {"exp_avg_sq", "exp_avg_sq.pt"}};
    for (const auto& [state, file] : files) {
      const std::string path = folder + "/" + file;
      if (!is_regular_file(path))
        throw IoError(path + ": missing: the universal checkpoint lacks parameter " + name + "'s " + state);
      s.archives.push_back(Archive::open(path));
      const Archive& a = *s.archives.back();
      const Value& root = a.root();
      const TensorRef& t = (root.kind == Value::Kind::kTensor ? root : root.at("param", path)).as_tensor(path + ": param");
      if (t.numel() != n)
        throw IoError(path + ": holds " + std::to_string(t.numel()) + " elements; parameter " + name + " has " +
                      std::to_string(n) + " in param_shapes: files of different checkpoints or models");
      s.spans[state][p][0].push_back({&a, &t, 0, n, 0});
    }
  }
}

// Adam's step count from a saved step tensor (`fallback` when it holds none).
int64_t step_of(const at::Tensor& t, int64_t fallback) {
  if (t.numel() < 1) return fallback;
  return static_cast<int64_t>(std::llround(t.to(at::kDouble).reshape({-1})[0].item<double>()));
}

// Plain values of a pickle as JSON (the client state); tensors and objects
// are left out (returns false), and so is a value of more than `budget`
// values in all (a pickle can hold one list in many places).
bool to_json(const Value& v, nlohmann::json& out, int64_t& budget) {
  if (--budget < 0) return false;
  switch (v.kind) {
    case Value::Kind::kNone: out = nullptr; return true;
    case Value::Kind::kBool: out = v.b; return true;
    case Value::Kind::kInt: out = v.i; return true;
    case Value::Kind::kFloat:
      if (!std::isfinite(v.f)) return false;
      out = v.f;
      return true;
    case Value::Kind::kStr: out = v.s; return true;
    case Value::Kind::kTuple:
    case Value::Kind::kList:
    case Value::Kind::kSize:
      out = nlohmann::json::array();
      for (const auto& x : v.items) {
        nlohmann::json j;
        if (!to_json(*x, j, budget)) return false;
        out.push_back(j);
      }
      return true;
    case Value::Kind::kDict:
      out = nlohmann::json::object();
      for (const auto& [k, x] : v.entries) {
        nlohmann::json j;
        if (k->kind != Value::Kind::kStr || !to_json(*x, j, budget)) return false;
        out[k->s] = j;
      }
      return true;
    default: return false;
  }
}

}  // namespace

Opened open(const std::string& tag_dir) {
  auto src = std::make_shared<Source>();
  src->tag_dir = tag_dir;
  src->universal = is_folder(tag_dir + "/zero");
  // (Stage 3 has a model file per rank; ds_to_universal copies the ones it was given.)
  const std::string model_path =
      tag_dir + "/" + (is_regular_file(tag_dir + "/" + kModelFile) ? std::string(kModelFile) : zero3_model_file(0));
  if (!is_regular_file(model_path)) throw IoError(model_path + ": missing: not a DeepSpeed checkpoint's folder");
  src->archives.push_back(Archive::open(model_path));
  src->model = src->archives.back().get();
  const Value& mroot = src->model->root();
  const std::string mwhere = model_path;
  if (const Value* mp = mroot.find("mp_world_size"); mp != nullptr && mp->as_int(mwhere + ": mp_world_size") != 1)
    throw IoError(mwhere + ": saved with tensor parallelism (mp_world_size " +
                  std::to_string(mp->as_int(mwhere)) + "); zero reads data-parallel DeepSpeed checkpoints only");
  for (const auto& name : list_folder(tag_dir))
    if (name.find("mp_rank_01") != std::string::npos || name.find("layer_") == 0)
      throw IoError(tag_dir + "/" + name + ": a tensor-parallel or pipeline-stage file; zero reads data-parallel "
                    "DeepSpeed checkpoints only");
  const auto groups = param_shapes(*src->model);
  src->ranks = mroot.at("dp_world_size", mwhere).as_int(mwhere + ": dp_world_size");
  if (src->ranks < 1 || src->ranks > (1 << 20))
    throw IoError(mwhere + ": dp_world_size " + std::to_string(src->ranks) + " is not a number of ranks");
  const Value* stage_v = nullptr;
  const Archive* first_optim = nullptr;
  if (src->universal) {
    const std::string path = tag_dir + "/zero/optimizer_state.pt";
    if (!is_regular_file(path)) throw IoError(path + ": missing: a universal checkpoint's optimizer state");
    src->archives.push_back(Archive::open(path));
    first_optim = src->archives.back().get();
    stage_v = first_optim->root().find("zero_stage");
    src->stage = stage_v != nullptr ? static_cast<int>(stage_v->as_int(path + ": zero_stage")) : 2;
    lay_out_universal(*src, groups);
  } else {
    std::vector<const Archive*> optim;
    std::string prefix;
    for (const char* p : {"", "bf16_"})
      if (is_regular_file(tag_dir + "/" + optim_file(p, 0))) prefix = p;
    for (int64_t r = 0; r < src->ranks; ++r) {
      const std::string path = tag_dir + "/" + optim_file(prefix, r);
      if (!is_regular_file(path))
        throw IoError(path + ": missing: the checkpoint was saved by " + std::to_string(src->ranks) +
                      " ranks (dp_world_size in " + kModelFile + "), each with its optimizer file; stage 0 "
                      "checkpoints, which have none, are not read");
      src->archives.push_back(Archive::open(path));
      optim.push_back(src->archives.back().get());
    }
    if (is_regular_file(tag_dir + "/" + optim_file(prefix, src->ranks)))
      throw IoError(tag_dir + "/" + optim_file(prefix, src->ranks) + ": a rank file beyond dp_world_size " +
                    std::to_string(src->ranks) + ": files of different checkpoints");
    first_optim = optim[0];
    const std::string owhere = first_optim->path() + ": optimizer_state_dict";
    const Value& osd = first_optim->root().at("optimizer_state_dict", first_optim->path());
    // (DeepSpeed's BF16 optimizer, the bf16_ files, is stage 1 and says no stage.)
    auto stage_of = [&](const Value& o, const std::string& w) {
      const Value* z = o.find("zero_stage");
      return z == nullptr && !prefix.empty() ? 1 : static_cast<int>(o.at("zero_stage", w).as_int(w + ".zero_stage"));
    };
    src->stage = stage_of(osd, owhere);
    for (const Archive* a : optim) {
      const std::string w = a->path() + ": optimizer_state_dict";
      if (stage_of(a->root().at("optimizer_state_dict", a->path()), w) != src->stage)
        throw IoError(w + ".zero_stage differs from rank 0's (" + std::to_string(src->stage) + ")");
      const Value& pc = a->root().at("optimizer_state_dict", a->path()).at("partition_count", w);
      if (pc.kind != Value::Kind::kInt && pc.as_sequence(w).empty()) throw IoError(w + ".partition_count is empty");
      const int64_t count = pc.kind == Value::Kind::kInt ? pc.i : pc.as_sequence(w)[0]->as_int(w);
      if (count != src->ranks)
        throw IoError(w + ".partition_count is " + std::to_string(count) + "; dp_world_size " + std::to_string(src->ranks));
    }
    if (src->stage == 3) {
      for (int64_t r = 0; r < src->ranks; ++r) {
        const std::string path = tag_dir + "/" + zero3_model_file(r);
        if (r == 0) {
          src->rank_models.push_back(src->model);
          continue;
        }
        if (!is_regular_file(path)) throw IoError(path + ": missing: a stage-3 checkpoint has a model file per rank");
        src->archives.push_back(Archive::open(path));
        src->rank_models.push_back(src->archives.back().get());
      }
      if (const Value* fz = mroot.find("frozen_param_shapes"); fz != nullptr && fz->kind == Value::Kind::kDict)
        for (const auto& [k, v] : fz->entries) src->frozen[k->as_str(mwhere)] = shape_of(*v, mwhere + ": frozen_param_shapes");
      lay_out_zero3(*src, optim, groups);
    } else if (src->stage == 1 || src->stage == 2) {
      lay_out_zero12(*src, optim, groups);
    } else {
      throw IoError(owhere + ".zero_stage is " + std::to_string(src->stage) + ": expected 1, 2 or 3");
    }
  }
  for (const auto& g : groups)
    for (const auto& [name, shape] : g) src->trainable.insert(name);
  // The buffers and frozen parameters (what zero keeps in model.safetensors).
  if (const Value* module = mroot.find("module"); module != nullptr && module->kind == Value::Kind::kDict)
    for (const auto& [k, v] : module->entries) {
      if (k->kind != Value::Kind::kStr || v->kind != Value::Kind::kTensor || src->trainable.count(k->s) != 0) continue;
      if (src->frozen.count(k->s) != 0) continue;
      if (src->stage == 3 && v->tensor.numel() == 0 && !v->tensor.sizes.empty()) continue;  // a partitioned one
      src->extras.tensors.push_back({k->s, v->tensor.dtype, v->tensor.sizes});
    }
  for (const auto& [name, shape] : src->frozen) {
    const Value* fr = mroot.find("frozen_param_fragments");
    const Value* t = fr != nullptr ? fr->find(name) : nullptr;
    src->extras.tensors.push_back({name, t != nullptr && t->kind == Value::Kind::kTensor ? t->tensor.dtype : at::kFloat, shape});
  }
  // Tied parameters (shared_params: name -> the name laid out).
  if (const Value* sp = mroot.find("shared_params"); sp != nullptr && sp->kind == Value::Kind::kDict)
    for (const auto& [k, v] : sp->entries)
      if (k->kind == Value::Kind::kStr && v->kind == Value::Kind::kStr) src->layout.aliases[k->s] = v->s;

  // What zero's meta.json would say.
  const std::string owhere = first_optim->path();
  const Value& oroot = first_optim->root();
  const Value* osd = src->universal ? &oroot : oroot.find("optimizer_state_dict");
  nlohmann::json meta;
  meta["format"] = "deepspeed";
  meta["tag"] = tag_dir.substr(tag_dir.rfind('/') + 1);
  meta["world_size"] = src->ranks;
  meta["stage"] = src->stage;
  meta["states"] = {"fp32_master", "exp_avg", "exp_avg_sq"};
  meta["precision"] = {{"master", "fp32"}, {"states", "fp32"}};
  meta["state_blocks"] = nullptr;
  meta["layout"] = src->layout.to_json();
  meta["files"] = nlohmann::json::object();
  meta["rng_states"] = false;
  meta["frozen_parameters"] = "included";
  const Value* ds_config = mroot.find("ds_config");
  nlohmann::json config;
  int64_t budget = 100000;
  if (ds_config != nullptr) to_json(*ds_config, config, budget);
  std::string opt_type = "adam";
  if (config.is_object() && config.contains("optimizer") && config["optimizer"].is_object())
    opt_type = config["optimizer"].value("type", std::string("Adam"));
  meta["optimizer"] = opt_type;
  meta["ds_config"] = config;
  meta["ds_version"] = mroot.find("ds_version") != nullptr ? mroot.find("ds_version")->as_str(mwhere) : "";
  const int64_t global_steps = mroot.at("global_steps", mwhere).as_int(mwhere + ": global_steps");
  const int64_t skipped = mroot.find("skipped_steps") != nullptr ? mroot.find("skipped_steps")->as_int(mwhere) : 0;
  int64_t gas = 1;
  if (config.is_object() && config.contains("gradient_accumulation_steps") &&
      config["gradient_accumulation_steps"].is_number_integer())
    gas = config["gradient_accumulation_steps"].get<int64_t>();
  meta["global_steps"] = global_steps;
  meta["micro_steps"] = global_steps * gas;
  meta["skipped_steps"] = skipped;
  // Adam's step count: what its bias correction used last.
  int64_t applied = global_steps - skipped;
  {
    const Value* step = nullptr;
    if (src->universal && !src->layout.groups.empty()) {
      const std::string path = tag_dir + "/zero/" + src->layout.groups[0].name + "/step.pt";
      if (is_regular_file(path)) {
        src->archives.push_back(Archive::open(path));
        const Archive& a = *src->archives.back();
        step = a.root().kind == Value::Kind::kTensor ? &a.root() : a.root().find("param");
        if (step != nullptr) {
          const at::Tensor t = a.read(step->as_tensor(path));
          applied = step_of(t, global_steps - skipped);
        }
      }
    }
    if (src->universal && step == nullptr) {  // stage 3's universal form: no step.pt, the step in optimizer_state.pt
      const Value* inner = oroot.find("optimizer_state_dict");
      const Value* state = inner != nullptr ? inner->find("state") : nullptr;
      const Value* s0 = state != nullptr ? state->find(int64_t{0}) : nullptr;
      if (s0 != nullptr && (step = s0->find("step")) != nullptr) {
        if (step->kind == Value::Kind::kTensor) {
          const at::Tensor t = first_optim->read(step->tensor);
          applied = step_of(t, global_steps - skipped);
        } else {
          applied = step->as_int(owhere + ": step");
        }
      }
    } else if (!src->universal && osd != nullptr) {
      const Value* base = osd->find(src->stage == 3 ? "optimizer_state_dict" : "base_optimizer_state");
      const Value* st = nullptr;
      if (base != nullptr && base->kind == Value::Kind::kList && !base->items.empty()) st = base->items[0].get();
      else if (base != nullptr && base->find("state") != nullptr) st = base->find("state")->find(int64_t{0});
      if (st != nullptr && (step = st->find("step")) != nullptr) {
        if (step->kind == Value::Kind::kTensor) {
          const at::Tensor t = first_optim->read(step->tensor);
          applied = step_of(t, global_steps - skipped);
        } else {
          applied = step->as_int(owhere + ": step");
        }
      } else if (const Value* bs = osd->find("base_optimizer_state_step"); bs != nullptr) {
        applied = bs->as_int(owhere + ": base_optimizer_state_step");
      }
    }
  }
  meta["applied_steps"] = applied;
  meta["last_grad_norm"] = nullptr;
  const Value* sched = mroot.find("lr_scheduler");
  if (sched != nullptr && sched->kind == Value::Kind::kDict && sched->find("last_batch_iteration") != nullptr)
    meta["scheduler"] = {{"last_batch_iteration", sched->find("last_batch_iteration")->as_int(mwhere + ": lr_scheduler")}};
  else
    meta["scheduler"] = nullptr;
  nlohmann::json scaler = {{"cur_scale", 1.0}, {"cur_iter", global_steps}, {"last_overflow_iter", -1}, {"cur_hysteresis", 1}};
  if (osd != nullptr)
    if (const Value* ls = osd->find("loss_scaler"); ls != nullptr && ls->kind == Value::Kind::kObject) {
      const std::string w = owhere + ": loss_scaler";
      if (const Value* x = ls->find("cur_scale")) scaler["cur_scale"] = x->as_double(w);
      if (const Value* x = ls->find("cur_iter")) scaler["cur_iter"] = x->as_int(w);
      if (const Value* x = ls->find("last_overflow_iter")) scaler["last_overflow_iter"] = x->as_int(w);
      if (const Value* x = ls->find("cur_hysteresis")) scaler["cur_hysteresis"] = x->as_int(w);
    }
  meta["loss_scaler"] = scaler;
  // The client state: the model file's keys that are not DeepSpeed's own, as
  // JSON where they are plain values.
  static const std::set<std::string> ds_keys{
      "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
      "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
      "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
      "universal_checkpoint_info", "iteration", "zero_stage"};
  nlohmann::json client = nlohmann::json::object();
  for (const auto& [k, v] : mroot.as_dict(mwhere)) {
    if (k->kind != Value::Kind::kStr || ds_keys.count(k->s) != 0) continue;
    nlohmann::json j;
    int64_t each = 100000;
    if (to_json(*v, j, each)) client[k->s] = j;
  }
  meta["client_state"] = client;
  if (const Value* gs = mroot.find("global_samples")) meta["global_samples"] = gs->as_int(mwhere + ": global_samples");
  // Frozen parameters (the model file's other tensors are buffers).
  nlohmann::json frozen_shapes = nlohmann::json::object();
  if (const Value* fz = mroot.find("frozen_param_shapes"); fz != nullptr && fz->kind == Value::Kind::kDict)
    for (const auto& [k, v] : fz->entries)
      if (k->kind == Value::Kind::kStr) frozen_shapes[k->s] = shape_of(*v, mwhere + ": frozen_param_shapes");
  meta["frozen_shapes"] = frozen_shapes;
  Opened out;
  out.tag_dir = tag_dir;
  out.meta = std::move(meta);
  out.reader = std::make_unique<DsReader>(src);
  return out;
}

Opened open_any(const std::string& tag_dir, const offload::AioOptions& aio) {
  if (!find(tag_dir, "").empty()) return open(tag_dir);
  Opened out;
  out.tag_dir = tag_dir;
  out.meta = read_meta(tag_dir);
  out.reader = PieceReader::checkpoint(tag_dir, out.meta, aio);
  return out;
}

std::string tag_folder_any(const std::string& dir, const std::string& tag) {
  if (const std::string ds = find(dir, tag); !ds.empty()) return ds;
  return tag_folder(dir, tag);
}

int64_t verify(const std::string& tag_dir, const std::function<void(const std::string&, int64_t)>& on_file) {
  int64_t total = 0;
  std::function<void(const std::string&)> walk = [&](const std::string& dir) {
    for (const auto& name : list_folder(dir)) {
      const std::string path = dir + "/" + name;
      if (is_folder(path)) {
        walk(path);
        continue;
      }
      if (name.size() < 3 || name.substr(name.size() - 3) != ".pt") continue;
      auto a = Archive::open(path);
      const int64_t n = read_every_tensor(*a, a->root());
      total += n;
      if (on_file) on_file(path, n);
    }
  };
  walk(tag_dir);
  return total;
}

}  // namespace zero::ckpt::deepspeed
