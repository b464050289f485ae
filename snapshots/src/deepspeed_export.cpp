// Writing a zero checkpoint as DeepSpeed lays one out: NOTE [deepspeed checkpoints].
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>

#include "zero/core/error.h"
#include "zero/snapshots/checkpoint_format.h"
#include "zero/snapshots/deepspeed_checkpoint.h"
#include "zero/snapshots/deepspeed_names.h"
#include "zero/snapshots/pickle.h"

namespace zero::ckpt::deepspeed {

using pickle::Value;
using pickle::ValuePtr;

namespace {

// A trainable parameter of the zero checkpoint, in its saved order.
struct Param {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  size_t group = 0, index = 0;  // in the saved layout
};

ValuePtr from_json(const nlohmann::json& j) {
  if (j.is_null()) return Value::none();
  if (j.is_boolean()) return Value::boolean(j.get<bool>());
  if (j.is_number_integer() || j.is_number_unsigned()) return Value::integer(j.get<int64_t>());
  if (j.is_number()) return Value::real(j.get<double>());
  if (j.is_string()) return Value::str(j.get<std::string>());
  if (j.is_array()) {
    auto l = Value::list();
    for (const auto& x : j) l->items.push_back(from_json(x));
    return l;
  }
  auto d = Value::dict();
  for (const auto& [k, v] : j.items()) d->set(k, from_json(v));
  return d;
}

// Reads states (fp32_master, exp_avg, exp_avg_sq) of elements [first,
// first + count) of parameter p into dsts[i] + at.
void read_param(PieceReader& reader, const SavedLayout& saved, const Param& p, int64_t first, int64_t count,
                const std::vector<float*>& dsts, int64_t at) {
  if (count <= 0) return;
  std::vector<Piece> pieces;
  append_pieces(saved, p.group, p.index, first, count, 0, pieces);
  std::vector<float*> d;
  for (float* x : dsts) d.push_back(x + at);
  reader.fill({"fp32_master", "exp_avg", "exp_avg_sq"}, std::move(pieces), count, d);
}

ValuePtr loss_scaler(const nlohmann::json& meta) {
  auto state = Value::dict();
  const auto sc = meta.value("loss_scaler", nlohmann::json::object());
  state->set("cur_scale", Value::real(sc.value("cur_scale", 1.0)));
  state->set("dynamic", Value::boolean(false));
  return Value::object("deepspeed.runtime.fp16.loss_scaler.LossScaler", state);
}

ValuePtr torch_param_group(const ExportOptions& o) {
  auto g = Value::dict();
  g->set("lr", Value::real(o.lr));
  g->set("betas", Value::tuple({Value::real(o.beta1), Value::real(o.beta2)}));
  g->set("eps", Value::real(o.eps));
  g->set("weight_decay", Value::real(o.weight_decay));
  g->set("amsgrad", Value::boolean(false));
  g->set("maximize", Value::boolean(false));
  g->set("foreach", Value::none());
  g->set("capturable", Value::boolean(false));
  g->set("differentiable", Value::boolean(false));
  g->set("fused", Value::none());
  g->set("decoupled_weight_decay", Value::boolean(o.adam_w_mode));
  g->set("params", Value::list({Value::integer(0)}));
  return g;
}

// torch.optim's state dict of one flat parameter per entry of `moments`.
ValuePtr torch_optimizer_state(const ExportOptions& o, int64_t step,
                               const std::vector<std::pair<at::Tensor, at::Tensor>>& moments) {
  auto state = Value::dict();
  for (size_t k = 0; k < moments.size(); ++k) {
    auto s = Value::dict();
    s->set("step", Value::tensor_of(at::scalar_tensor(static_cast<double>(step), at::kFloat)));
    s->set("exp_avg", Value::tensor_of(moments[k].first));
    s->set("exp_avg_sq", Value::tensor_of(moments[k].second));
    state->set(static_cast<int64_t>(k), s);
  }
  auto groups = Value::list();
  auto g = torch_param_group(o);
  auto params = Value::list();
  for (size_t k = 0; k < moments.size(); ++k) params->items.push_back(Value::integer(static_cast<int64_t>(k)));
  g->set("params", params);
  groups->items.push_back(g);
  auto out = Value::dict();
  out->set("state", state);
  out->set("param_groups", groups);
  return out;
}

}  // namespace

ExportStats export_checkpoint(const std::string& zero_tag_dir, const std::string& out, const ExportOptions& options,
                              const std::function<void(int64_t, int64_t)>& progress) {
  const nlohmann::json meta = read_meta(zero_tag_dir);
  const std::vector<std::string> adam{"fp32_master", "exp_avg", "exp_avg_sq"};
  if (meta.at("states").get<std::vector<std::string>>() != adam)
    throw UsageError(zero_tag_dir + "/meta.json: the checkpoint holds the states " + meta.at("states").dump() +
                     " (optimizer " + meta.value("optimizer", "?") + "); DeepSpeed's layout holds Adam's fp32 master, "
                     "exp_avg and exp_avg_sq: export a checkpoint of an Adam run with 32-bit states");
  if (meta.contains("param_groups") && meta.at("param_groups").size() > 1)
    throw UsageError(zero_tag_dir + "/meta.json: the run had " + std::to_string(meta.at("param_groups").size()) +
                     " parameter groups; the export writes DeepSpeed's layout of one optimizer group");
  const int64_t world = options.world_size > 0 ? options.world_size : meta.at("world_size").get<int64_t>();
  int stage = options.stage > 0 ? options.stage : meta.at("stage").get<int>();
  if (stage == 0) stage = 2;
  if (stage < 1 || stage > 3) throw UsageError("export-deepspeed: --stage " + std::to_string(stage) + ": expected 1, 2 or 3");
  if (world < 1) throw UsageError("export-deepspeed: --world-size " + std::to_string(world) + ": expected 1 or more");
  const std::string tag = options.tag.empty() ? meta.value("tag", std::string("global_step0")) : options.tag;
  check_tag(tag);
  if (path_exists(out) && !(is_folder(out) && list_folder(out).empty()))
    throw UsageError("export-deepspeed: " + out + " exists and is not an empty folder; the export writes a new folder");

  const SavedLayout saved = SavedLayout::from_json(meta.at("layout"), zero_tag_dir + "/meta.json");
  auto reader = PieceReader::checkpoint(zero_tag_dir, meta, offload::AioOptions{});
  check_saved_states(zero_tag_dir, meta, *reader);
  std::vector<Param> params;
  for (size_t g = 0; g < saved.groups.size(); ++g)
    for (size_t i = 0; i < saved.groups[g].params.size(); ++i) {
      const auto& sp = saved.groups[g].params[i];
      params.push_back({sp.name, sp.shape, sp.numel, g, i});
    }
  int64_t total = 0;
  for (const auto& p : params) total += p.numel;
  // Buffers and frozen parameters (model.safetensors); the model file's
  // metadata names the buffers (saves before it: every tensor a buffer).
  const Layout& model_layout = reader->file_layout("model.safetensors");
  std::set<std::string> buffer_set;
  bool buffers_known = false;
  if (auto it = model_layout.metadata.find("buffers"); it != model_layout.metadata.end()) {
    buffers_known = true;
    for (const auto& b : nlohmann::json::parse(it->second)) buffer_set.insert(b.get<std::string>());
  }
  std::vector<std::pair<std::string, at::Tensor>> buffers, frozen;
  for (const auto& t : model_layout.tensors) {
    at::Tensor v = reader->read_tensor("model.safetensors", t.name);
    (buffers_known && buffer_set.count(t.name) == 0 ? frozen : buffers).emplace_back(t.name, v);
  }

  const std::string tmp = out + ".zero-export-" + std::to_string(::getpid());
  remove_tree(tmp);
  const std::string tag_dir = tmp + "/" + tag;
  make_folders(tag_dir);
  ExportStats stats;
  stats.tag_dir = out + "/" + tag;
  const int64_t global_steps = meta.at("global_steps").get<int64_t>();
  const int64_t step = meta.at("applied_steps").get<int64_t>();
  auto put = [&](const std::string& name, const Value& v) {
    pickle::save(tag_dir + "/" + name, v);
    stats.files++;
    stats.bytes_written += file_size(tag_dir + "/" + name);
  };
  try {
    // The common entries of the model files.
    auto shapes = Value::dict(true);
    for (const auto& p : params) shapes->set(p.name, Value::size(p.shape));
    auto frozen_shapes = Value::dict(true);
    for (const auto& [name, t] : frozen) frozen_shapes->set(name, Value::size(t.sizes().vec()));
    auto buffer_names = Value::list();
    for (const auto& [name, t] : buffers) buffer_names->items.push_back(Value::str(name));
    auto shared = Value::dict();
    for (const auto& [alias, name] : saved.aliases) shared->set(alias, Value::str(name));
    auto model_file = [&](int64_t rank, bool whole_params) {
      auto m = Value::dict();
      auto module = Value::dict(true);
      std::vector<float> values;
      for (const auto& p : params) {
        at::Tensor t = at::zeros({whole_params ? p.numel : 0}, at::kFloat);
        if (whole_params) {
          at::Tensor m1 = at::empty({p.numel}, at::kFloat), m2 = at::empty({p.numel}, at::kFloat);
          read_param(*reader, saved, p, 0, p.numel, {t.data_ptr<float>(), m1.data_ptr<float>(), m2.data_ptr<float>()}, 0);
          t = t.reshape(p.shape);
        }
        module->set(p.name, Value::tensor_of(t));
      }
      auto fragments = Value::dict(true);
      for (const auto& [name, t] : frozen) {
        if (stage == 3) {  // each rank's partition, padded
          const int64_t n = t.numel(), part = (n + world - 1) / world;
          at::Tensor padded = at::zeros({part * world}, t.scalar_type());
          padded.narrow(0, 0, n).copy_(t.reshape({-1}));
          fragments->set(name, Value::tensor_of(padded.narrow(0, rank * part, part).clone()));
          module->set(name, Value::tensor_of(at::zeros({0}, t.scalar_type())));
        } else {
          fragments->set(name, Value::tensor_of(t));
          module->set(name, Value::tensor_of(t));
        }
      }
      for (const auto& [name, t] : buffers) module->set(name, Value::tensor_of(t));
      m->set("module", module);
      m->set("buffer_names", buffer_names);
      m->set("optimizer", Value::none());
      m->set("param_shapes", Value::list({shapes}));
      m->set("frozen_param_shapes", frozen_shapes);
      m->set("shared_params", shared);
      m->set("frozen_param_fragments", fragments);
      const auto& sched = meta.at("scheduler");
      if (sched.is_object()) {
        auto s = Value::dict();
        s->set("last_batch_iteration", Value::integer(sched.at("last_batch_iteration").get<int64_t>()));
        m->set("lr_scheduler", s);
      } else {
        m->set("lr_scheduler", Value::none());
      }
      m->set("data_sampler", Value::none());
      m->set("random_ltd", Value::none());
      m->set("sparse_tensor_module_names", Value::list());
      m->set("skipped_steps", Value::integer(meta.at("skipped_steps").get<int64_t>()));
      m->set("global_steps", Value::integer(global_steps));
      m->set("global_samples", Value::integer(global_steps * options.train_batch_size));
      m->set("dp_world_size", Value::integer(world));
      m->set("mp_world_size", Value::integer(1));
      m->set("ds_config", from_json(meta.value("config", nlohmann::json::object())));
      m->set("ds_version", Value::str(options.ds_version));
      const nlohmann::json client = meta.value("client_state", nlohmann::json::object());
      for (const auto& [k, v] : client.items())
        if (m->find(k) == nullptr) m->set(k, from_json(v));
      return m;
    };
    auto common_optimizer = [&](auto& osd) {
      osd->set("loss_scaler", loss_scaler(meta));
      osd->set("dynamic_loss_scale", Value::boolean(false));
      osd->set("overflow", Value::boolean(false));
    };
    auto wrap = [&](ValuePtr osd) {
      auto f = Value::dict();
      f->set("optimizer_state_dict", osd);
      f->set("ds_config", from_json(meta.value("config", nlohmann::json::object())));
      f->set("ds_version", Value::str(options.ds_version));
      return f;
    };
    int64_t done = 0;
    if (options.universal) {
      // ds_to_universal's form: every state of every parameter whole.
      make_folders(tag_dir + "/zero");
      for (const auto& p : params) {
        at::Tensor v[3];
        for (auto& t : v) t = at::empty({p.numel}, at::kFloat);
        read_param(*reader, saved, p, 0, p.numel, {v[0].data_ptr<float>(), v[1].data_ptr<float>(), v[2].data_ptr<float>()}, 0);
        make_folders(tag_dir + "/zero/" + p.name);
        const char* names[] = {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"};
        for (int k = 0; k < 3; ++k) {
          auto d = Value::dict();
          d->set("param", Value::tensor_of(v[k].reshape(p.shape)));
          d->set("cat_dim", Value::integer(0));
          put("zero/" + p.name + "/" + names[k], *d);
        }
        put("zero/" + p.name + "/step.pt", *Value::tensor_of(at::scalar_tensor(static_cast<double>(step), at::kFloat)));
        if (progress) progress(++done, static_cast<int64_t>(params.size()));
      }
      auto osd = Value::dict();
      common_optimizer(osd);
      osd->set("clip_grad", Value::real(options.clip_grad));
      osd->set("zero_stage", Value::integer(stage));
      osd->set("group_paddings", Value::list({Value::integer(0)}));
      osd->set("partition_count", Value::list({Value::integer(world)}));
      osd->set("ds_version", Value::str(options.ds_version));
      osd->set("param_groups", Value::list({torch_param_group(options)}));
      put("zero/optimizer_state.pt", *osd);
      put(kModelFile, *model_file(0, true));
    } else if (stage == 3) {
      // Each parameter cut into `world` partitions of ceil(numel / world);
      // sub-groups of DeepSpeed's greedy split by sub_group_size.
      std::vector<std::vector<size_t>> sub_groups(1);
      int64_t partitioned = 0, in_sub = 0;
      for (const auto& p : params) partitioned += (p.numel + world - 1) / world;
      for (size_t k = 0; k < params.size(); ++k) {
        sub_groups.back().push_back(k);
        in_sub += (params[k].numel + world - 1) / world;
        if (options.sub_group_size < partitioned && in_sub >= options.sub_group_size && k + 1 < params.size()) {
          sub_groups.emplace_back();
          in_sub = 0;
        }
      }
      for (int64_t r = 0; r < world; ++r) {
        auto flats = Value::list();
        std::vector<std::pair<at::Tensor, at::Tensor>> moments;
        for (const auto& sg : sub_groups) {
          int64_t n = 0;
          for (size_t k : sg) n += (params[k].numel + world - 1) / world;
          at::Tensor v[3];
          for (auto& t : v) t = at::zeros({n}, at::kFloat);
          int64_t at = 0;
          for (size_t k : sg) {
            const int64_t part = (params[k].numel + world - 1) / world;
            const int64_t first = std::min(params[k].numel, r * part), last = std::min(params[k].numel, (r + 1) * part);
            read_param(*reader, saved, params[k], first, last - first,
                       {v[0].data_ptr<float>(), v[1].data_ptr<float>(), v[2].data_ptr<float>()}, at);
            at += part;
          }
          flats->items.push_back(Value::tensor_of(v[0]));
          moments.emplace_back(v[1], v[2]);
        }
        auto osd = Value::dict();
        osd->set("zero_stage", Value::integer(3));
        common_optimizer(osd);
        osd->set("partition_count", Value::integer(world));
        osd->set("optimizer_state_dict", torch_optimizer_state(options, step, moments));
        osd->set("fp32_flat_groups", flats);
        put(optim_file("", r), *wrap(osd));
        put(zero3_model_file(r), *model_file(r, false));
        if (progress) progress(r + 1, world);
      }
    } else {
      // Stages 1 and 2: the group flattened, padded to 2 x world, cut in world partitions.
      const int64_t align = 2 * world, padded = (total + align - 1) / align * align, part = padded / world;
      for (int64_t r = 0; r < world; ++r) {
        const int64_t lo = r * part, lean = std::max<int64_t>(0, std::min(total, lo + part) - lo);
        at::Tensor v[3];
        for (auto& t : v) t = at::zeros({part}, at::kFloat);
        auto mapping = Value::dict(true);
        int64_t offset = 0;
        for (const auto& p : params) {
          const int64_t a = std::max(lo, offset), b = std::min(lo + lean, offset + p.numel);
          if (a < b) {
            read_param(*reader, saved, p, a - offset, b - a,
                       {v[0].data_ptr<float>(), v[1].data_ptr<float>(), v[2].data_ptr<float>()}, a - lo);
            auto fa = Value::dict();
            fa->set("numel", Value::integer(b - a));
            fa->set("start", Value::integer(a - lo));
            mapping->set(p.name, Value::object("deepspeed.utils.tensor_fragment.fragment_address", fa));
          }
          offset += p.numel;
        }
        auto osd = Value::dict();
        common_optimizer(osd);
        osd->set("clip_grad", Value::real(options.clip_grad));
        osd->set("base_optimizer_state", torch_optimizer_state(options, step, {{v[1], v[2]}}));
        osd->set("single_partition_of_fp32_groups", Value::list({Value::tensor_of(v[0].narrow(0, 0, lean).clone())}));
        osd->set("zero_stage", Value::integer(stage));
        osd->set("group_paddings", Value::list({Value::integer(part - lean)}));
        osd->set("partition_count", Value::list({Value::integer(world)}));
        osd->set("ds_version", Value::str(options.ds_version));
        osd->set("param_slice_mappings", Value::list({mapping}));
        put(optim_file("", r), *wrap(osd));
        if (progress) progress(r + 1, world);
      }
      put(kModelFile, *model_file(0, true));
    }
    write_file_atomically(tmp + "/" + (options.universal ? "latest_universal" : "latest"), tag);
    rename_path(tmp, out);  // (over an empty folder too)
    sync_path(out);
  } catch (...) {
    remove_tree(tmp);
    throw;
  }
  stats.bytes_read = reader->bytes_read();
  return stats;
}

ExportStats import_checkpoint(const std::string& ds_tag_dir, const std::string& out,
                              const std::function<void(int64_t, int64_t)>& progress) {
  Opened ds = open(ds_tag_dir);
  nlohmann::json meta = ds.meta;
  const SavedLayout saved = SavedLayout::from_json(meta.at("layout"), ds_tag_dir);
  const std::string tag = meta.at("tag").get<std::string>();
  check_tag(tag);
  if (path_exists(out) && !(is_folder(out) && list_folder(out).empty()))
    throw UsageError("import-deepspeed: " + out + " exists and is not an empty folder; the import writes a new folder");
  const std::string tmp = out + ".zero-import-" + std::to_string(::getpid());
  remove_tree(tmp);
  const std::string tag_dir = tmp + "/" + tag;
  make_folders(tag_dir);
  const std::vector<std::string> states{"fp32_master", "exp_avg", "exp_avg_sq"};
  int64_t total = 0;
  for (const auto& g : saved.groups) total += g.chunk_numel * saved.partitions;
  ExportStats stats;
  stats.tag_dir = out + "/" + tag;
  nlohmann::json files = nlohmann::json::object();
  try {
    offload::AioEngine aio(offload::AioOptions{});
    constexpr int64_t kWindow = int64_t{16} << 20;
    std::vector<float> buf[3];
    int64_t done = 0;
    auto part_name = [](int64_t r) {
      char name[32];
      std::snprintf(name, sizeof name, "rank%05lld", static_cast<long long>(r));
      return std::string(name);
    };
    for (int64_t r = 0; r < saved.partitions; ++r) {
      Layout layout;
      for (size_t g = 0; g < saved.groups.size(); ++g)
        for (const auto& st : states) layout.tensors.push_back({st + "." + std::to_string(g), at::kFloat, {saved.groups[g].chunk_numel}});
      layout.metadata = {{"format", kFormat}, {"rank", std::to_string(r)}};
      const std::string file = tag_dir + "/" + part_name(r) + ".safetensors";
      TensorFileWriter w(file, layout, aio);
      for (size_t g = 0; g < saved.groups.size(); ++g) {
        const int64_t chunk = saved.groups[g].chunk_numel;
        for (int64_t w0 = 0; w0 < chunk; w0 += kWindow) {
          const int64_t n = std::min(kWindow, chunk - w0);
          std::vector<float*> dsts;
          for (auto& b : buf) {
            b.resize(static_cast<size_t>(n));
            dsts.push_back(b.data());
          }
          ds.reader->fill(states, {{r, g, w0, n, 0}}, n, dsts);
          for (size_t k = 0; k < 3; ++k)
            w.append(g * 3 + k, at::from_blob(buf[k].data(), {n}, at::kFloat));
          done += n;
          if (progress) progress(done, total);
        }
      }
      const auto c = w.commit(tag_dir + "/" + part_name(r) + ".sums");
      files[part_name(r) + ".safetensors"] = {{"bytes", c.bytes}, {"header_crc", c.header_crc}, {"sums_crc", c.sums_crc}};
      stats.bytes_written += c.bytes;
      stats.files++;
    }
    // The buffers and frozen parameters; the model file names the buffers.
    const Layout& extras = ds.reader->file_layout("model.safetensors");
    Layout model_layout;
    nlohmann::json buffers = nlohmann::json::array();
    std::set<std::string> frozen_names;
    const nlohmann::json frozen_shapes = meta.value("frozen_shapes", nlohmann::json::object());
    for (const auto& [k, v] : frozen_shapes.items()) frozen_names.insert(k);
    std::vector<at::Tensor> values;
    for (const auto& t : extras.tensors) {
      values.push_back(ds.reader->read_tensor("model.safetensors", t.name).contiguous());
      model_layout.tensors.push_back({t.name, values.back().scalar_type(), values.back().sizes().vec()});
      if (frozen_names.count(t.name) == 0) buffers.push_back(t.name);
    }
    model_layout.metadata = {{"format", kFormat}, {"buffers", buffers.dump()}};
    TensorFileWriter mw(tag_dir + "/model.safetensors", model_layout, aio);
    for (size_t i = 0; i < values.size(); ++i) mw.append(i, values[i]);
    const auto c = mw.commit(tag_dir + "/model.sums");
    files["model.safetensors"] = {{"bytes", c.bytes}, {"header_crc", c.header_crc}, {"sums_crc", c.sums_crc}};
    stats.bytes_written += c.bytes;
    stats.files++;
    meta["format"] = kFormat;
    meta["version"] = kVersion;
    meta["files"] = files;
    meta["compute_dtype"] = "F32";
    meta["config"] = meta.value("ds_config", nlohmann::json::object());
    meta["imported_from"] = {{"deepspeed", meta.value("ds_version", std::string())}, {"path", ds_tag_dir}};
    meta.erase("ds_config");
    meta.erase("frozen_shapes");
    write_file_atomically(tag_dir + "/meta.json", meta.dump(2));
    write_file_atomically(tmp + "/latest", tag);
    rename_path(tmp, out);
    sync_path(out);
  } catch (...) {
    remove_tree(tmp);
    throw;
  }
  stats.bytes_read = ds.reader->bytes_read();
  return stats;
}

}  // namespace zero::ckpt::deepspeed
