// Engine::load_checkpoint and Engine::load_weights (docs/checkpoints.md, NOTE
// [checkpoint mapping]).
#include <signal.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <array>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <unordered_set>
#include <map>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include "zero/snapshots/checkpoint_format.h"
#include "zero/snapshots/checkpoint_io.h"
#include "zero/snapshots/deepspeed_checkpoint.h"
#include "engine_impl.h"
#include "zero/core/error.h"
#include "zero/partition/stage3_plan.h"

#include "engine_checkpoint.h"

namespace zero {

// What the checkpoint files share (engine_checkpoint.h).
using detail::checkpoints::state_numel_of_group;
using detail::checkpoints::blockwise_state;
using detail::checkpoints::precision_of;
using detail::checkpoints::part_name;
using detail::checkpoints::set_generator_state;
using detail::checkpoints::extra_state;
using detail::checkpoints::load_frozen_groups;

namespace {

// Every name of each parameter (a tied one has several), by tensor.
std::unordered_map<const void*, std::vector<std::string>> names_by_tensor(torch::nn::Module& model) {
  std::unordered_map<const void*, std::vector<std::string>> out;
  for (const auto& item : model.named_parameters(true)) out[item.value().unsafeGetTensorImpl()].push_back(item.key());
  return out;
}

// Loads sub-groups window by window (bounded memory whatever a sub-group's
// size), reading the next window, which may be the next sub-group's, while
// this one is checked and copied: straight into the destination tensors when
// they are contiguous fp32 host memory, else through host staging and a copy
// (a device).
class WindowLoader {
 public:
  using Issue = std::function<std::unique_ptr<ckpt::PieceReader::Pending>(size_t k, int64_t first, int64_t count)>;
  WindowLoader(const std::vector<partition::SubGroup>& sub_groups, ckpt::PieceReader& reader, Issue issue)
      : reader_(reader), issue_(std::move(issue)) {
    constexpr int64_t kWindow = int64_t{4} << 20;  // elements (16 MiB a state)
    for (size_t k = 0; k < sub_groups.size(); ++k)
      for (int64_t w = 0; w < sub_groups[k].numel; w += kWindow)
        windows_.push_back({k, w, std::min(kWindow, sub_groups[k].numel - w)});
  }

  /// Sub-group k's turn (in order): fills `dsts` (one per state, k's length).
  void fill(size_t k, const std::vector<at::Tensor*>& dsts) {
    for (; done_ < windows_.size() && windows_[done_].k == k; ++done_) {
      while (issued_ < windows_.size() && issued_ <= done_ + 1) {  // this window and the next in flight
        const Window& w = windows_[issued_++];
        pending_.push_back(issue_(w.k, w.first, w.count));
      }
      const Window& w = windows_[done_];
      bool direct = true;
      for (const at::Tensor* t : dsts)
        direct = direct && t->is_cpu() && t->is_contiguous() && t->scalar_type() == at::kFloat;
      std::vector<float*> to;
      if (staging_.size() < dsts.size()) staging_.resize(dsts.size());
      for (size_t i = 0; i < dsts.size(); ++i) {
        if (direct) {
          to.push_back(dsts[i]->data_ptr<float>() + w.first);
        } else {
          staging_[i].resize(static_cast<size_t>(w.count));
          to.push_back(staging_[i].data());
        }
      }
      auto pending = std::move(pending_.front());
      pending_.pop_front();
      reader_.complete(*pending, to);
      if (!direct)
        for (size_t i = 0; i < dsts.size(); ++i)
          dsts[i]->narrow(0, w.first, w.count).copy_(at::from_blob(staging_[i].data(), {w.count}, at::kFloat));
    }
  }

 private:
  struct Window {
    size_t k;
    int64_t first, count;
  };
  ckpt::PieceReader& reader_;
  Issue issue_;
  std::vector<Window> windows_;
  size_t issued_ = 0, done_ = 0;
  std::deque<std::unique_ptr<ckpt::PieceReader::Pending>> pending_;
  std::vector<std::vector<float>> staging_;
};

}  // namespace

CheckpointStats Engine::load_checkpoint(const std::string& dir, const std::string& tag_in) {
  auto& s = *impl_;
  const Impl::UncountedTraffic uncounted(s);  // NOTE [bytes across nodes]: not a step's
  const auto t0 = Clock::now();
  at::NoGradGuard no_grad;
  // A DeepSpeed checkpoint reads as one of zero's (NOTE [deepspeed checkpoints]).
  const std::string ds_dir = ckpt::deepspeed::find(dir, tag_in);
  ckpt::deepspeed::Opened ds;
  if (!ds_dir.empty()) ds = ckpt::deepspeed::open(ds_dir);
  const std::string tag_dir = ds_dir.empty() ? ckpt::tag_folder(dir, tag_in) : ds_dir;
  const std::string meta_path = ds_dir.empty() ? tag_dir + "/meta.json" : tag_dir;
  const nlohmann::json meta = ds_dir.empty() ? ckpt::read_meta(tag_dir) : std::move(ds.meta);
  if (!ds_dir.empty() && s.dist.rank == 0)
    log::info("load_checkpoint: " + tag_dir + " is a DeepSpeed checkpoint (DeepSpeed " +
              meta.value("ds_version", std::string("?")) + ", stage " + std::to_string(meta.at("stage").get<int>()) +
              ", " + std::to_string(meta.at("world_size").get<int64_t>()) + " ranks" +
              (ckpt::is_folder(tag_dir + "/zero") ? ", universal" : "") +
              "): its master, Adam moments, steps, LR schedule and loss scale are read into this run's layout");
  auto& opt = *s.optimizer;
  const auto& flat = opt.parameters();
  const auto& store = opt.store();
  const auto saved_states = meta.at("states").get<std::vector<std::string>>();
  // Adam's moments in fp32 or bf16 and in 8 bits (NOTE [8-bit states]) are
  // converted into each other as they load: dequantized, or quantized into
  // this run's blocks.
  const std::vector<std::string> adam_names{"fp32_master", "exp_avg", "exp_avg_sq"};
  const std::vector<std::string> q8_names{"fp32_master",        "exp_avg.q8",          "exp_avg.absmax",
                                          "exp_avg_sq.sqrt_q8", "exp_avg_sq.sqrt_absmax", "exp_avg.fp32_blocks",
                                          "exp_avg_sq.fp32_blocks"};
  // (Saved before min_8bit_size: every block in 8 bits, no fp32 blocks.)
  const std::vector<std::string> q8_all_names(q8_names.begin(), q8_names.begin() + 5);
  const bool saved_q8_states = saved_states == q8_names || saved_states == q8_all_names;
  const bool from_8bit = saved_q8_states && store.names() == adam_names;
  const bool to_8bit = saved_states == adam_names && store.names() == q8_names;
  const bool from_all_8bit = saved_states == q8_all_names && store.names() == q8_names;
  if (saved_states != store.names() && !from_8bit && !to_8bit && !from_all_8bit) {
    std::string have, want;
    for (const auto& n : saved_states) have += (have.empty() ? "" : ", ") + n;
    for (const auto& n : store.names()) want += (want.empty() ? "" : ", ") + n;
    throw ConfigError({meta_path + ": the checkpoint holds the states " + have + " (optimizer " +
                       meta.value("optimizer", "?") + "); this engine's optimizer (" + s.config.optimizer->type_name +
                       ") has " + want + ": load the weights alone with engine.load_weights to start the states afresh"});
  }
  if ((from_8bit || to_8bit) && s.dist.rank == 0)
    log::warning(std::string("load_checkpoint: the checkpoint's Adam moments are ") +
                 (from_8bit ? "8-bit (optimizer.params.optim_bits 8) and this run keeps them element by element: they "
                              "are dequantized (each value as its code and block scale give it)"
                            : "element by element and this run keeps them in 8 bits (optimizer.params.optim_bits 8): "
                              "they are quantized into this run's blocks (each value moves by at most half an E4M3 "
                              "step of its block's scale)"));
  // A master or states saved in another precision are converted as they
  // are read (NOTE [16-bit master]): widening is exact, narrowing rounds to
  // nearest; say so.
  {
    // (Checkpoints from before the key: an fp32 master, fp32 or 8-bit states.)
    const bool saved_blocks = meta.contains("state_blocks") && !meta.at("state_blocks").is_null();
    const nlohmann::json saved_precision =
        meta.value("precision", nlohmann::json{{"master", "fp32"}, {"states", saved_blocks ? "8bit" : "fp32"}});
    const nlohmann::json precision = precision_of(store);
    // (8-bit against element-wise moments: said above.)
    const bool states_differ = saved_precision.value("states", "") != precision.value("states", "") &&
                               saved_precision.value("states", "") != "8bit" && precision.value("states", "") != "8bit";
    if ((saved_precision.value("master", "") != precision.value("master", "") || states_differ) && s.dist.rank == 0)
      log::warning("load_checkpoint: the master and optimizer states were saved in " + saved_precision.dump() +
                   "; this run keeps them in " + precision.dump() +
                   ": they are converted as they are read (widened exactly, or rounded to nearest into 16 bits)");
  }
  const ckpt::SavedLayout saved = ckpt::SavedLayout::from_json(meta.at("layout"), meta_path);
  const auto index = saved.index();
  {  // Every parameter of the model is in the checkpoint with its shape, and the other way round.
    std::unordered_set<std::string> model_names;
    for (const auto& slot : flat.slots()) {
      model_names.insert(slot.name);
      auto it = index.find(slot.name);
      if (it == index.end())
        throw IoError(meta_path + ": has no parameter " + slot.name + ": a checkpoint of another model");
      const auto& sp = saved.groups[it->second.first].params[it->second.second];
      if (sp.shape != slot.shape)
        throw IoError(meta_path + ": parameter " + slot.name + " has shape " + c10::str(c10::IntArrayRef(sp.shape)) +
                      " there and " + c10::str(c10::IntArrayRef(slot.shape)) + " in the model: a checkpoint of another model");
    }
    for (const auto& g : saved.groups)
      for (const auto& p : g.params)
        if (model_names.count(p.name) == 0)
          throw IoError(meta_path + ": has parameter " + p.name + ", which the model lacks: a checkpoint of another model");
  }
  auto reader = ds_dir.empty() ? ckpt::PieceReader::checkpoint(tag_dir, meta, partition::aio_options(s.config.aio))
                               : std::move(ds.reader);
  if (ds_dir.empty()) ckpt::check_saved_states(tag_dir, meta, *reader);
  const int64_t layout_rank = opt.partition_rank();
  const auto& groups = store.sub_groups();
  // fp32 states by element ranges, at any world size; block-wise ones
  // (8-bit Adam's) below.
  const auto& specs = store.state_specs();
  std::vector<std::string> by_range{store.names()[0]};
  std::vector<size_t> blockwise;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (blockwise_state(specs[i])) blockwise.push_back(i);
    else by_range.push_back(store.names()[i + 1]);
  }
  if (from_8bit) by_range = {adam_names[0]};  // the moments from the saved blocks below
  if (to_8bit) by_range = adam_names;         // the moments by element ranges, quantized below
  // 8-bit states laid out as this run lays them out (partitions, groups,
  // sub-groups) are read as they are; otherwise each moment is dequantized
  // from the saved blocks and quantized again in this run's (NOTE [8-bit
  // states]), with a warning: a value moves by at most half an E4M3 step of
  // its new block's scale.
  bool requantize = false;
  int64_t saved_sub_group = 0;
  if ((!blockwise.empty() && !to_8bit) || from_8bit) {
    const nlohmann::json want = {{"partitions", flat.world_size()},
                                 {"sub_group_size", s.config.zero.sub_group_size},
                                 {"min_8bit_size", s.config.optimizer->min_8bit_size}};
    nlohmann::json have = meta.value("state_blocks", nlohmann::json(nullptr));
    // (Saved before min_8bit_size: every block in 8 bits, as min_8bit_size 0.)
    if (have.is_object() && !have.contains("min_8bit_size")) have["min_8bit_size"] = 0;
    const bool same_groups = meta.at("layout") == ckpt::layout_of(flat, flat.world_size(), *s.model).to_json();
    if (!have.is_object() || !have.contains("sub_group_size") || !have.at("sub_group_size").is_number_integer() ||
        have.at("sub_group_size").get<int64_t>() < 1)
      throw IoError(meta_path + ": 8-bit optimizer states without their state_blocks layout: a damaged checkpoint");
    saved_sub_group = have.at("sub_group_size").get<int64_t>();
    requantize = !from_8bit && (have != want || !same_groups);
    if (requantize && store.names() != q8_names)
      throw ConfigError({meta_path + ": block-wise states other than 8-bit Adam's load only as they were laid out"});
    if (requantize && s.dist.rank == 0)
      log::warning("load_checkpoint: the 8-bit optimizer states were saved laid out by " + have.dump() + " at stage " +
                   std::to_string(meta.value("stage", -1)) + (same_groups ? "" : " with other groups") +
                   "; this run lays them out by " + want.dump() + " at stage " + std::to_string(s.config.zero.stage) +
                   ": they are dequantized and quantized again in this run's blocks (each value moves by at most "
                   "half an E4M3 step of its new block's scale)");
  }
  // A saved rank's 8-bit tensors of a group, read whole, the last few kept.
  struct SavedQ8 {
    at::Tensor m_codes, m_scale, v_codes, v_scale;
    at::Tensor m_fp32, v_fp32;     // the fp32 blocks' moments (min_8bit_size), or none
    std::vector<int64_t> fp32_at;  // per saved sub-group: where its fp32 blocks' moments start in them
  };
  std::map<std::pair<int64_t, size_t>, SavedQ8> saved_q8;
  std::deque<std::pair<int64_t, size_t>> saved_order;
  auto saved_q8_of = [&](int64_t part, size_t group) -> const SavedQ8& {
    const auto key = std::make_pair(part, group);
    if (auto it = saved_q8.find(key); it != saved_q8.end()) return it->second;
    const std::string file = part_name(part) + ".safetensors", gs = "." + std::to_string(group);
    auto read = [&](const std::string& name, at::ScalarType dtype) {
      at::Tensor t = reader->read_tensor(file, name + gs).reshape({-1}).contiguous();
      if (t.scalar_type() != dtype) throw IoError(tag_dir + "/" + file + ": " + name + gs + " is not " + c10::toString(dtype));
      return t;
    };
    SavedQ8 q{read("exp_avg.q8", at::kByte), read("exp_avg.absmax", at::kFloat), read("exp_avg_sq.sqrt_q8", at::kByte),
              read("exp_avg_sq.sqrt_absmax", at::kFloat)};
    if (saved_states == q8_names) {
      q.m_fp32 = read("exp_avg.fp32_blocks", at::kFloat);
      q.v_fp32 = read("exp_avg_sq.fp32_blocks", at::kFloat);
      // Each saved sub-group's fp32 blocks (its marked scales) take 256 of
      // them each, at least 256 (FlatOptimizer::StateSpec::side_numel).
      const int64_t per_sub = (saved_sub_group + 255) / 256, blocks = q.m_scale.numel();
      const float* ms = q.m_scale.data_ptr<float>();
      int64_t pos = 0;
      for (int64_t b0 = 0; b0 < blocks; b0 += per_sub) {
        q.fp32_at.push_back(pos);
        int64_t marked = 0;
        for (int64_t b = b0; b < std::min(blocks, b0 + per_sub); ++b) marked += ms[b] < 0 ? 1 : 0;
        pos += 256 * std::max<int64_t>(1, marked);
      }
      if (pos != q.m_fp32.numel() || pos != q.v_fp32.numel())
        throw IoError(tag_dir + "/" + file + ": the fp32 blocks of group " + std::to_string(group) +
                      " (exp_avg.fp32_blocks) do not match its marked block scales: a damaged checkpoint");
    }
    if (saved_order.size() >= 2) {
      saved_q8.erase(saved_order.front());
      saved_order.pop_front();
    }
    saved_order.push_back(key);
    return saved_q8.emplace(key, std::move(q)).first->second;
  };
  WindowLoader loader(groups, *reader, [&](size_t k, int64_t first, int64_t count) {
    const auto [g, start, len] = groups[k];
    return reader->issue(by_range,
                         ckpt::map_range(flat, layout_rank, g, start + first, count, saved, index, meta_path), count);
  });
  const std::string own_file = part_name(layout_rank) + ".safetensors";  // stage 0: rank 0's, which holds all
  std::vector<at::Tensor> group_state(specs.size());  // block-wise: group g's saved tensor
  std::vector<int64_t> group_at(specs.size());        // where the next sub-group's part starts in it
  // Sub-group k's moments by value from the saved 8-bit blocks (saved
  // sub-groups split each chunk from its start: element e of a saved chunk
  // is in block (e / S) * ceil(S / 256) + (e % S) / 256): exp_avg into mv,
  // exp_avg_sq into vv and its square root into sv (a saved fp32 block's
  // values as they are, with the square root correctly rounded).
  auto dequantize_saved = [&](size_t k, std::vector<float>& mv, std::vector<float>& sv, std::vector<float>& vv) {
    const auto [g, start, len] = groups[k];
    const int64_t S = saved_sub_group, per_sub = (S + 255) / 256;
    mv.assign(static_cast<size_t>(len), 0.0f);
    sv.assign(static_cast<size_t>(len), 0.0f);
    vv.assign(static_cast<size_t>(len), 0.0f);
    for (const auto& pc : ckpt::map_range(flat, layout_rank, g, start, len, saved, index, meta_path)) {
      const SavedQ8& q = saved_q8_of(pc.part, pc.group);
      const int64_t blocks = q.m_scale.numel(), last = pc.begin + pc.count - 1;
      if (pc.count <= 0) continue;
      if (last >= q.m_codes.numel() || q.v_codes.numel() != q.m_codes.numel() || q.v_scale.numel() != blocks ||
          (last / S) * per_sub + (last % S) / 256 >= blocks)
        throw IoError(tag_dir + "/" + part_name(pc.part) + ".safetensors: its 8-bit states of group " +
                      std::to_string(pc.group) + " do not hold the elements the checkpoint's layout says");
      const uint8_t* mc = q.m_codes.data_ptr<uint8_t>();
      const uint8_t* vc = q.v_codes.data_ptr<uint8_t>();
      const float* ms = q.m_scale.data_ptr<float>();
      const float* vs = q.v_scale.data_ptr<float>();
      for (int64_t e = pc.begin; e < pc.begin + pc.count; ++e) {
        const int64_t b = (e / S) * per_sub + (e % S) / 256;  // below `blocks`: checked for the last
        const size_t d = static_cast<size_t>(pc.dst + e - pc.begin);
        if (ms[b] < 0) {  // a block kept in fp32: its place in the saved sub-group's fp32 moments
          const int64_t pos = q.m_fp32.defined() ? q.fp32_at[static_cast<size_t>(e / S)] +
                                                       static_cast<int64_t>(-ms[b] - 1) * 256 + (e % S) % 256
                                                 : -1;
          if (pos < 0 || pos >= q.m_fp32.numel())
            throw IoError(tag_dir + "/" + part_name(pc.part) + ".safetensors: a block of group " +
                          std::to_string(pc.group) + " is marked fp32 and has no fp32 moments: a damaged checkpoint");
          mv[d] = q.m_fp32.data_ptr<float>()[pos];
          vv[d] = q.v_fp32.data_ptr<float>()[pos];
          sv[d] = static_cast<float>(std::sqrt(static_cast<double>(vv[d])));
          continue;
        }
        mv[d] = optim::dequantize_8bit(mc[e], ms[b]);
        sv[d] = optim::dequantize_8bit(vc[e], vs[b]);
        vv[d] = sv[d] * sv[d];  // as the step squares it
      }
    }
  };
  opt.load_states([&](size_t k, at::Tensor& m, std::vector<at::Tensor>& st, at::Tensor*) {
    const int64_t len = groups[k].numel;
    std::vector<float> mv, sv, vv;
    if (from_8bit) {  // the master by ranges; the moments dequantized, v = s * s as the step squares it
      std::vector<at::Tensor*> dsts{&m};
      loader.fill(k, dsts);
      dequantize_saved(k, mv, sv, vv);
      st[0].copy_(at::from_blob(mv.data(), {len}, at::kFloat));
      st[1].copy_(at::from_blob(vv.data(), {len}, at::kFloat));
      return;
    }
    if (to_8bit) {  // the moments by ranges into fp32, then quantized (the second as its square root)
      at::Tensor tm = at::empty({len}, at::kFloat), tv = at::empty({len}, at::kFloat);
      std::vector<at::Tensor*> dsts{&m, &tm, &tv};
      loader.fill(k, dsts);
      const at::Tensor ts = tv.to(at::kDouble).sqrt().to(at::kFloat);  // correctly rounded, as the kernel's sqrt
      optim::store_8bit(tm.data_ptr<float>(), ts.data_ptr<float>(), tv.data_ptr<float>(), len, store.fp32_blocks(k), st);
      return;
    }
    std::vector<at::Tensor*> dsts{&m};
    for (size_t i = 0; i < st.size(); ++i)
      if (std::find(blockwise.begin(), blockwise.end(), i) == blockwise.end()) dsts.push_back(&st[i]);
    loader.fill(k, dsts);
    const size_t g = groups[k].group;
    if (requantize) {
      dequantize_saved(k, mv, sv, vv);
      optim::store_8bit(mv.data(), sv.data(), vv.data(), len, store.fp32_blocks(k), st);
      return;
    }
    const bool first_of_group = k == 0 || groups[k - 1].group != g;
    for (size_t i : blockwise) {
      if (from_all_8bit && specs[i].side) {  // saved before them: no block in fp32
        st[i].zero_();
        continue;
      }
      if (first_of_group) {
        const std::string name = store.names()[i + 1] + "." + std::to_string(g);
        group_state[i] = reader->read_tensor(own_file, name);
        if (group_state[i].scalar_type() != specs[i].dtype || group_state[i].numel() != state_numel_of_group(store, i, g))
          throw IoError(tag_dir + "/" + own_file + ": " + name + " has another dtype or length than this run's");
        group_at[i] = 0;
      }
      st[i].copy_(group_state[i].reshape({-1}).narrow(0, group_at[i], st[i].numel()));
      group_at[i] += st[i].numel();
    }
  });
  // Buffers and frozen parameters, by name: whole, and stage 3's frozen
  // groups (NOTE [frozen groups]; each rank keeps its chunk). A checkpoint
  // saved with exclude_frozen has none: the model keeps its own.
  const bool with_frozen = meta.value("frozen_parameters", std::string("included")) != "excluded";
  if (!with_frozen && s.dist.rank == 0)
    log::info("load_checkpoint: " + tag_dir + " was saved without the frozen parameters (exclude_frozen): they keep "
              "the values the model has (its base weights, loaded before)");
  // A tied frozen parameter is saved under one of its names (stage 3: its
  // slot's; below it: each): any of them will do.
  auto names_of = names_by_tensor(*s.model);
  auto saved_value = [&](const std::string& name, const at::Tensor& t, at::IntArrayRef shape) {
    std::string found = name;
    if (!reader->has_tensor("model.safetensors", name))
      for (const auto& alias : names_of[t.unsafeGetTensorImpl()])
        if (reader->has_tensor("model.safetensors", alias)) found = alias;
    if (!reader->has_tensor("model.safetensors", found))
      throw IoError(tag_dir + "/model.safetensors: has no " + name + " (a buffer or frozen parameter of the model)");
    at::Tensor v = reader->read_tensor("model.safetensors", found);
    if (v.sizes() != shape)
      throw IoError(tag_dir + "/model.safetensors: " + name + " has shape " + c10::str(v.sizes()) + " there and " +
                    c10::str(shape) + " in the model");
    return v;
  };
  for (const auto& [name, t] : extra_state(*s.model, flat, with_frozen)) t.copy_(saved_value(name, t, t.sizes()));
  if (with_frozen)
    load_frozen_groups(opt, [&](const partition::ParamSlot& slot) { return saved_value(slot.name, slot.param, slot.shape); });
  // RNG states, at the world size they were saved with.
  if (!meta.value("rng_states", true)) {
    if (s.dist.rank == 0) log::info("load_checkpoint: the checkpoint holds no RNG states: they start anew");
  } else if (meta.at("world_size").get<int64_t>() == s.dist.world_size) {
    const std::string file = part_name(s.dist.rank) + ".safetensors";
    set_generator_state(at::kCPU, reader->read_tensor(file, "rng.cpu"));
    if (s.device.is_cuda() && reader->has_tensor(file, "rng.cuda"))
      set_generator_state(s.device, reader->read_tensor(file, "rng.cuda"));
  } else if (s.dist.rank == 0) {
    log::info("load_checkpoint: saved at " + std::to_string(meta.at("world_size").get<int64_t>()) +
              " ranks, loaded at " + std::to_string(s.dist.world_size) + ": the RNG states start anew");
  }
  // Parameter groups: each group's saved values come back (as a torch
  // optimizer's load_state_dict brings its param_groups' lr and decay).
  // A checkpoint whose one group is the default (set_weight_decay made it)
  // gives this run that group too.
  if (meta.contains("param_groups") && opt.param_groups().empty() && meta.at("param_groups").size() == 1 &&
      meta.at("param_groups")[0].value("name", "") == "default")
    opt.set_param_groups({{"default", std::nullopt, std::nullopt}}, std::vector<size_t>(flat.slots().size(), 0));
  s.lr_set = meta.contains("lr_set") ? std::optional<double>(meta.at("lr_set").get<double>()) : std::nullopt;
  if (s.dist.rank == 0 && meta.contains("param_groups") != !opt.param_groups().empty())
    log::warning(opt.param_groups().empty()
                     ? "load_checkpoint: the checkpoint was saved with parameter groups (meta.json param_groups) and "
                       "this run has none: every parameter steps with the config's lr and weight_decay"
                     : "load_checkpoint: this run has parameter groups and the checkpoint none: they step with this "
                       "run's values (InitOptions::param_groups)");
  if (meta.contains("param_groups") && !opt.param_groups().empty()) {
    const auto numels = opt.param_group_numels();
    auto optional_of = [](const nlohmann::json& v) { return v.is_null() ? std::nullopt : std::optional<double>(v.get<double>()); };
    std::vector<std::string> unmatched;
    for (const auto& g : meta.at("param_groups")) {
      const std::string name = g.at("name").get<std::string>();
      const auto& groups = opt.param_groups();
      size_t k = 0;
      while (k < groups.size() && groups[k].name != name) ++k;
      if (k == groups.size()) {
        unmatched.push_back(name);
        continue;
      }
      if (g.contains("numel") && g.at("numel").get<int64_t>() != numels[k] && s.dist.rank == 0)
        log::warning("load_checkpoint: parameter group " + name + " held " + std::to_string(g.at("numel").get<int64_t>()) +
                     " elements when saved and holds " + std::to_string(numels[k]) + " in this run: its match "
                     "takes other parameters now, and they step with the saved group's values");
      partition::ZeroOptimizer::GroupHyper h{name, optional_of(g.at("lr")), optional_of(g.at("weight_decay")),
                                             g.contains("lr_set") ? std::optional<double>(g.at("lr_set").get<double>())
                                                                  : std::nullopt};
      if ((h.lr != groups[k].lr || h.weight_decay != groups[k].weight_decay) && s.dist.rank == 0)
        log::warning("load_checkpoint: parameter group " + name + " has the checkpoint's lr and weight_decay (" +
                     g.at("lr").dump() + ", " + g.at("weight_decay").dump() + "), not this run's");
      opt.set_group_hyper(k, h);
    }
    if (!unmatched.empty() && s.dist.rank == 0)
      log::warning("load_checkpoint: the checkpoint's parameter groups " + [&] {
        std::string n;
        for (const auto& u : unmatched) n += (n.empty() ? "" : ", ") + u;
        return n;
      }() + " are not this run's: their values are not used");
  }
  s.global_steps = meta.at("global_steps").get<int64_t>();
  s.micro_steps = meta.at("micro_steps").get<int64_t>();
  s.skipped_steps = meta.at("skipped_steps").get<int64_t>();
  s.applied_steps = meta.at("applied_steps").get<int64_t>();
  s.last_grad_norm = meta.at("last_grad_norm").is_null() ? NAN : meta.at("last_grad_norm").get<double>();
  if (s.scheduler && meta.at("scheduler").is_object())
    s.scheduler->set_last_batch_iteration(meta.at("scheduler").at("last_batch_iteration").get<int64_t>());
  const auto& sc = meta.at("loss_scaler");
  s.scaler.load_state({sc.at("cur_scale").get<double>(), sc.at("cur_iter").get<int64_t>(),
                       sc.at("last_overflow_iter").get<int64_t>(), sc.at("cur_hysteresis").get<int64_t>()});
  s.loss_sum = torch::Tensor();
  s.loss_count = 0;
  CheckpointStats out;
  out.dir = dir;
  out.tag = meta.value("tag", "");
  out.bytes = reader->bytes_read();
  out.seconds = seconds_since(t0);
  out.client_state = meta.at("client_state").dump();
  return out;
}

namespace {

// "bf16" for the model's dtypes, safetensors' names ("BF16") for a file's.
std::string names_list(const std::vector<std::string>& names, size_t shown = 5) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < shown; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > shown) out += " and " + std::to_string(names.size() - shown) + " more";
  return out;
}

// A prefix that would make the file's names match `missing`, said as the
// option that applies it, or "".
std::string prefix_hint(const std::vector<std::string>& missing, const std::vector<ckpt::WeightTensor>& tensors) {
  for (const auto& want : missing) {
    for (const auto& t : tensors) {
      if (t.name.size() > want.size() && t.name.compare(t.name.size() - want.size(), want.size(), want) == 0)
        return "; the file names it " + t.name + ": LoadWeightsOptions::strip_prefix \"" +
               t.name.substr(0, t.name.size() - want.size()) + "\" would match";
      if (want.size() > t.name.size() && want.compare(want.size() - t.name.size(), t.name.size(), t.name) == 0)
        return "; the file has " + t.name + ": LoadWeightsOptions::add_prefix \"" +
               want.substr(0, want.size() - t.name.size()) + "\" would match";
    }
  }
  return "";
}

}  // namespace

CheckpointStats Engine::load_weights(const std::string& path, const LoadWeightsOptions& options) {
  auto& s = *impl_;
  const Impl::UncountedTraffic uncounted(s);  // NOTE [bytes across nodes]: not a step's
  const auto t0 = Clock::now();
  at::NoGradGuard no_grad;
  const ckpt::WeightFiles files = ckpt::WeightFiles::resolve(path);
  auto rename = [&options](const std::string& name) {
    std::string n = name;
    if (!options.strip_prefix.empty() && n.rfind(options.strip_prefix, 0) == 0) n = n.substr(options.strip_prefix.size());
    n = options.add_prefix + n;
    return options.rename ? options.rename(n) : n;
  };
  ckpt::SavedLayout saved;
  std::vector<ckpt::WeightTensor> tensors;
  auto reader = ckpt::PieceReader::weights(files, rename, &saved, &tensors, partition::aio_options(s.config.aio));
  auto& opt = *s.optimizer;
  const auto& flat = opt.parameters();
  const auto& store = opt.store();

  // Every name of each laid-out parameter (tied ones have several): the file
  // may hold it under any of them.
  auto names_of = names_by_tensor(*s.model);
  auto index = saved.index();
  std::unordered_set<std::string> used, kept;  // kept: LoadWeightsOptions::keep_missing's
  std::vector<std::string> missing, tied_unused;
  for (const auto& slot : flat.all_slots()) {  // stage 3's frozen groups too (NOTE [frozen groups])
    std::string found = index.count(slot.name) ? slot.name : "";
    for (const auto& alias : names_of[slot.param.unsafeGetTensorImpl()])
      if (found.empty() && index.count(alias)) found = alias;
    if (found.empty()) {
      // (A frozen one has no master to keep it: it must be in the file.)
      if (options.keep_missing && slot.param.requires_grad() && options.keep_missing(slot.name)) kept.insert(slot.name);
      else missing.push_back(slot.name);
      continue;
    }
    if (found != slot.name) saved.aliases[slot.name] = found;
    used.insert(found);
    // A tied parameter (tie_word_embeddings: lm_head.weight is
    // model.embed_tokens.weight) takes its first name's tensor, as
    // transformers' tie_weights does; a tensor of the file under another of
    // its names is not used, and is named.
    for (const auto& n : names_of[slot.param.unsafeGetTensorImpl()])
      if (n != found && index.count(n) && used.insert(n).second) tied_unused.push_back(n + " (tied to " + found + ")");
  }
  if (!missing.empty()) {
    // A tensor of the name that is not floating point (an int32 table where
    // the model has a weight) is there, but not weights.
    for (const auto& want : missing)
      for (const auto& t : tensors)
        if (t.name == want && !at::isFloatingType(t.dtype))
          throw IoError(files.source + ": " + (t.file_name == t.name ? t.name : t.file_name + " (the model's " + t.name + ")") +
                        " in " + t.file + " is " + ckpt::dtype_name(t.dtype) + "; expected a floating-point tensor " +
                        "(F32, F16, BF16 or F64) for the model's parameter");
    throw IoError(files.source + ": has no tensor for " + std::to_string(missing.size()) + " of the model's " +
                  std::to_string(flat.all_slots().size()) + " parameters: " + names_list(missing) +
                  prefix_hint(missing, tensors) + " (names after LoadWeightsOptions' mapping)");
  }
  index = saved.index();
  const auto extra = extra_state(*s.model, flat);
  for (const auto& [name, t] : extra) used.insert(name);
  {  // A frozen parameter kept whole must be in the file too, under one of
     // its names (nothing trains it: missing, it would keep its
     // initialisation), as one in stage 3's frozen groups must.
    std::vector<std::string> absent;
    std::unordered_set<const void*> seen;
    for (const auto& [name, p] : s.frozen_whole) {
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
      bool found = false;
      for (const auto& alias : names_of[p.unsafeGetTensorImpl()]) found = found || index.count(alias) > 0;
      if (!found) absent.push_back(name);
    }
    if (!absent.empty())
      throw IoError(files.source + ": has no tensor for " + std::to_string(absent.size()) + " frozen parameter(s): " +
                    names_list(absent) + prefix_hint(absent, tensors) +
                    " (a frozen parameter takes its values from the file: nothing trains it)");
  }
  if (!kept.empty() && s.dist.rank == 0)
    log::info("load_weights " + files.source + ": " + std::to_string(kept.size()) + " parameter(s) the file lacks keep "
              "their values (LoadWeightsOptions::keep_missing): " + names_list({kept.begin(), kept.end()}, 3));
  if (s.dist.rank == 0) {
    std::map<std::string, int64_t> other_dtype;  // file dtype -> tensors
    std::vector<std::string> unused;
    for (const auto& t : tensors) {
      if (used.count(t.name) == 0) unused.push_back(t.name);
      else if (at::isFloatingType(t.dtype) && t.dtype != s.dtype) ++other_dtype[ckpt::dtype_name(t.dtype)];
    }
    for (const auto& [dtype, n] : other_dtype) {
      // The master is fp32 unless it is 16-bit by the config: a 16-bit file gives it
      // 16-bit values; an fp32 file keeps them whole and only the compute
      // copy is rounded.
      const std::string compute = ckpt::dtype_name(s.dtype);
      // (A 16-bit master, NOTE [16-bit master], is the compute copy's dtype.)
      const std::string how = store.master_dtype() != at::kFloat ? "the " + compute + " master and compute copy are rounded from them"
                              : dtype == "F64"   ? "the fp32 master is rounded from them"
                              : dtype == "F32" ? "the fp32 master keeps them whole, the " + compute +
                                                     " compute copy is rounded from them"
                                               : "the fp32 master starts from the " + dtype + " values";
      log::warning("load_weights " + files.source + ": " + std::to_string(n) + " tensor(s) in " + dtype +
                   ", the model computes in " + compute + ": converted (" + how + ")");
    }
    if (!unused.empty())
      log::warning("load_weights " + files.source + ": " + std::to_string(unused.size()) +
                   " tensor(s) the model has no parameter or buffer for, not loaded: " + names_list(unused, 8));
    if (!tied_unused.empty())
      log::warning("load_weights " + files.source + ": " + std::to_string(tied_unused.size()) +
                   " tensor(s) of tied parameters not used: " + names_list(tied_unused, 8) +
                   ": the model shares one tensor between the names (tie_word_embeddings), loaded from the first; "
                   "the file's other copy is left out. Where the file's copies differ, transformers keeps the "
                   "distinct one it finds and its logits differ from this model's: set tie_word_embeddings false in "
                   "the config to train them apart");
  }

  const int64_t layout_rank = opt.partition_rank();
  const auto& groups = store.sub_groups();
  WindowLoader loader(groups, *reader, [&](size_t k, int64_t first, int64_t count) {
    const auto [g, start, len] = groups[k];
    return reader->issue({"fp32_master"},
                         ckpt::map_range(flat, layout_rank, g, start + first, count, saved, index, files.source, &kept),
                         count);
  });
  opt.load_states([&](size_t k, at::Tensor& m, std::vector<at::Tensor>& st, at::Tensor*) {
    // The kept parameters' elements of this sub-group, as the master has them.
    const auto [g, start, len] = groups[k];
    const auto& grp = flat.groups()[g];
    const int64_t lo = layout_rank * grp.chunk_numel + start, hi = lo + len;  // in group coordinates
    std::vector<std::pair<int64_t, at::Tensor>> keep;
    for (size_t i : kept.empty() ? std::vector<size_t>{} : grp.slots) {
      const auto& slot = flat.slots()[i];
      if (kept.count(slot.name) == 0) continue;
      const int64_t a = std::max(lo, slot.offset - grp.begin), b = std::min(hi, slot.offset - grp.begin + slot.numel);
      if (a < b) keep.emplace_back(a - lo, m.narrow(0, a - lo, b - a).clone());
    }
    loader.fill(k, {&m});
    for (const auto& [at, values] : keep) m.narrow(0, at, values.numel()).copy_(values);
    store.start_states(k, st);  // (8-bit Adam's fp32 blocks marked again)
  });
  // Stage 3's frozen groups: each rank reads its chunk's byte ranges.
  for (size_t g : detail::checkpoints::frozen_groups(flat)) {
    const int64_t n = flat.all_groups()[g].chunk_numel;
    at::Tensor chunk = at::empty({n}, at::kFloat);
    reader->fill({"fp32_master"}, ckpt::map_range(flat, layout_rank, g, 0, n, saved, index, files.source, &kept), n,
                 {chunk.data_ptr<float>()});
    opt.write_frozen_shard(g, chunk);
  }
  for (const auto& [name, t] : extra) {
    if (!reader->has_tensor("", name)) continue;
    at::Tensor v = reader->read_tensor("", name);
    if (v.sizes() != t.sizes())
      throw IoError(files.source + ": " + name + " has shape " + c10::str(v.sizes()) + " there and " +
                    c10::str(t.sizes()) + " in the model");
    t.copy_(v);
  }
  CheckpointStats out;
  out.dir = files.source;
  out.bytes = reader->bytes_read();
  out.seconds = seconds_since(t0);
  return out;
}

}  // namespace zero
