// Engine::save_checkpoint and Engine::open_checkpoint_dir (NOTE [checkpoint
// commit] in engine_checkpoint.cpp).
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
#include "engine_impl.h"
#include "zero/core/error.h"
#include "zero/partition/stage3_plan.h"

#include "engine_checkpoint.h"

namespace zero {
namespace {

// NOTE [checkpoint commit]: stop signals during a save. The first is held
// for the save to stop at its next check; a second one (the save is stuck,
// say in an exchange with a peer) ends the process at once, as it would
// have without the save.
std::atomic<int> g_save_signal{0};
void note_save_signal(int sig) {
  int none = 0;
  if (g_save_signal.compare_exchange_strong(none, sig)) return;
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ::sigaction(sig, &dfl, nullptr);
  ::raise(sig);
}

// While one lives, SIGINT/SIGTERM/SIGHUP left at their default action are
// held instead of ending the process; check() throws once one came; the
// destructor restores the actions, lets go of `lock` (the folder's writer
// lock, so the next writer finds no stale file) and raises the signal again.
// One save at a time per process (the signal state is the process's).
class SaveSignals {
 public:
  SaveSignals(std::string what, std::unique_ptr<ckpt::FolderLock>* lock) : what_(std::move(what)), lock_(lock) {
    g_save_signal = 0;
    for (size_t i = 0; i < kSignals.size(); ++i) {
      struct sigaction now {};
      if (::sigaction(kSignals[i], nullptr, &now) != 0 || (now.sa_flags & SA_SIGINFO) || now.sa_handler != SIG_DFL)
        continue;
      struct sigaction sa {};
      sa.sa_handler = note_save_signal;
      sa.sa_flags = SA_RESTART;  // other threads' blocking calls go on (io_uring waits, sockets)
      sigemptyset(&sa.sa_mask);
      if (::sigaction(kSignals[i], &sa, &old_[i]) == 0) installed_[i] = true;
    }
  }
  ~SaveSignals() {
    for (size_t i = 0; i < kSignals.size(); ++i)
      if (installed_[i]) ::sigaction(kSignals[i], &old_[i], nullptr);
    const int sig = g_save_signal.exchange(0);
    if (sig == 0) return;
    if (lock_ != nullptr) lock_->reset();
    log::warning(what_ + ": " + name(sig) + " came during the save; the save was stopped and its files removed (the " +
                 "previous checkpoints are as they were), and the signal now ends the process");
    ::raise(sig);  // its default action, now that the save's files are gone
  }
  SaveSignals(const SaveSignals&) = delete;
  SaveSignals& operator=(const SaveSignals&) = delete;

  /// Throws IoError when a held signal came.
  static void check(const std::string& what) {
    const int sig = g_save_signal.load();
    if (sig == 0) return;
    throw IoError(what + ": stopped by " + name(sig) + "; the save's files are removed and the previous checkpoints "
                         "are as they were");
  }

 private:
  static std::string name(int sig) { return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "SIGHUP"; }
  std::string what_;
  static constexpr std::array<int, 3> kSignals = {SIGINT, SIGTERM, SIGHUP};
  std::unique_ptr<ckpt::FolderLock>* lock_;
  std::array<struct sigaction, 3> old_{};
  std::array<bool, 3> installed_{};
};

}  // namespace

// What the checkpoint files share (engine_checkpoint.h).
using detail::checkpoints::state_numel_of_group;
using detail::checkpoints::precision_of;
using detail::checkpoints::has_block_states;
using detail::checkpoints::part_name;
using detail::checkpoints::statvfs_free;
using detail::checkpoints::everyone;
using detail::checkpoints::agree;
using detail::checkpoints::generator_state;
using detail::checkpoints::extra_state;
using detail::checkpoints::frozen_groups;

void detail::set_checkpoint_hooks(Engine& engine, CheckpointHooks hooks) {
  engine.impl().checkpoint_hooks = std::move(hooks);
}

bool detail::save_stop_requested() { return g_save_signal.load() != 0; }

void Engine::open_checkpoint_dir(const std::string& dir) {
  auto& s = *impl_;
  if (s.save_folders.count(dir) != 0) return;
  const std::string what = "checkpoint folder " + dir;
  std::exception_ptr failed;
  std::unique_ptr<ckpt::FolderLock> lock;
  if (s.dist.rank == 0) {
    try {
      if (const std::string problem = ckpt::checkpoint_folder_problem("checkpoint folder", dir); !problem.empty())
        throw IoError(problem);
      const std::string made = ckpt::make_folders_reporting(dir);
      auto attempt = ckpt::FolderLock::try_acquire(dir);
      if (attempt.lock) attempt.lock->remove_when_empty(made);
      using State = ckpt::FolderLock::State;
      if (attempt.state == State::kHeld)
        throw IoError(what + ": another job is saving checkpoints there (" + attempt.holder + ", holding " + dir +
                      "/.zero-lock); two jobs saving into one folder would overwrite each other's files: give this "
                      "one another folder, or stop the other");
      if (attempt.state == State::kUnsupported)
        log::warning(what + ": its file system has no flock (" + attempt.holder + "): saving without a writer lock, "
                     "so nothing stops another job from saving there too");
      lock = std::move(attempt.lock);  // null when held here (the folder under another spelling) or unsupported
      const auto removed =
          attempt.state == State::kAcquired ? ckpt::remove_interrupted_saves(dir) : std::vector<std::string>{};
      if (!removed.empty()) {
        std::string names;
        for (const auto& n : removed) names += (names.empty() ? "" : ", ") + n;
        log::info(what + ": removed what interrupted saves left: " + names);
      }
    } catch (...) {
      failed = std::current_exception();
    }
  }
  agree(s.comm.get(), failed, what);
  // Every rank writes its own files there: the first rank of each other node
  // checks the folder too (another node may not see it, or not write in it),
  // once rank 0's tidying is over.
  if (s.dist.rank != 0 && s.dist.local_rank == 0) {
    try {
      if (std::string problem = ckpt::save_folder_problem("checkpoint folder", dir); !problem.empty())
        throw IoError(problem);
      ckpt::make_folders(dir);
    } catch (const std::exception& e) {
      failed = std::make_exception_ptr(IoError("rank " + std::to_string(s.dist.rank) + ": " + e.what()));
    }
  }
  agree(s.comm.get(), failed, what);  // the lock, if any, goes with it
  s.save_folders.emplace(dir, std::move(lock));
}

CheckpointStats Engine::save_checkpoint(const std::string& dir, const std::string& tag_in,
                                        const std::string& client_state, const SaveCheckpointOptions& options) {
  auto& s = *impl_;
  const auto t0 = Clock::now();
  at::NoGradGuard no_grad;
  if (s.micro_steps % s.gas() != 0) {
    throw UsageError("save_checkpoint between the micro-steps of an accumulation (micro-step " +
                     std::to_string(s.micro_steps) + ", gradient_accumulation_steps " + std::to_string(s.gas()) +
                     "): save after the step() that ends it");
  }
  const std::string tag = tag_in.empty() ? "global_step" + std::to_string(s.global_steps) : tag_in;
  ckpt::check_tag(tag);
  nlohmann::json client;
  try {
    client = nlohmann::json::parse(client_state);
  } catch (const std::exception&) {
  }
  if (!client.is_object()) throw ConfigError({"save_checkpoint: client_state: expected a JSON object; got " +
                                              client_state.substr(0, 200)});
  const std::string what = "save_checkpoint " + dir + "/" + tag;
  open_checkpoint_dir(dir);
  SaveSignals signals(what, &s.save_folders[dir]);  // NOTE [checkpoint commit]: a stop signal ends the save cleanly
  Comm* comm = s.comm.get();
  const int rank = s.dist.rank;
  const std::string incoming = dir + "/." + tag + ".incoming";
  const std::string final_dir = dir + "/" + tag;
  const std::string aside = dir + "/." + tag + ".old";  // a checkpoint of the same tag, while it is replaced
  auto& opt = *s.optimizer;
  const auto& flat = opt.parameters();
  const auto& store = opt.store();
  const int64_t partitions = flat.world_size();
  // The ranks of the first shard group write the partitions (NOTE [MiCS]:
  // the other replicas hold the same values); the others their RNG states.
  const bool holds_partition = rank < partitions;
  ZERO_CHECK(!holds_partition || opt.partition_rank() == (partitions == 1 ? 0 : rank),
             "the first ranks hold the partitions of their number");

  // This rank's file: its partition of every state, its RNG states.
  ckpt::Layout layout;
  if (holds_partition) {
    const auto& specs = store.state_specs();
    for (size_t g = 0; g < flat.groups().size(); ++g) {
      layout.tensors.push_back({store.names()[0] + "." + std::to_string(g), store.master_dtype(),
                                {flat.groups()[g].chunk_numel}});
      // Each state in its own dtype and length (8-bit Adam: codes and block scales).
      for (size_t i = 0; i < specs.size(); ++i)
        layout.tensors.push_back({store.names()[i + 1] + "." + std::to_string(g), specs[i].dtype,
                                  {state_numel_of_group(store, i, g)}});
    }
  }
  const at::Tensor rng_cpu = generator_state(at::kCPU);
  layout.tensors.push_back({"rng.cpu", at::kByte, {rng_cpu.numel()}});
  at::Tensor rng_dev;
  if (s.device.is_cuda()) {
    rng_dev = generator_state(s.device);
    layout.tensors.push_back({"rng.cuda", at::kByte, {rng_dev.numel()}});
  }
  layout.metadata = {{"format", ckpt::kFormat}, {"rank", std::to_string(rank)}};
  // The model file (rank 0's): stage 3's frozen groups, gathered (NOTE
  // [frozen groups]), then the whole frozen parameters and the buffers;
  // no frozen parameter with exclude_frozen.
  const bool with_frozen = !options.exclude_frozen;
  const auto frozen = with_frozen ? frozen_groups(flat) : std::vector<size_t>{};
  ckpt::Layout model_layout;
  const auto extra =
      rank == 0 ? extra_state(*s.model, flat, with_frozen) : std::vector<std::pair<std::string, at::Tensor>>{};
  if (rank == 0)
    for (size_t g : frozen)
      for (size_t i : flat.all_groups()[g].slots)
        model_layout.tensors.push_back({flat.all_slots()[i].name, s.dtype, flat.all_slots()[i].shape});
  for (const auto& [name, t] : extra) model_layout.tensors.push_back({name, t.scalar_type(), t.sizes().vec()});
  // Which of its tensors are buffers (the rest frozen parameters), for an
  // export to DeepSpeed's layout (NOTE [deepspeed checkpoints]).
  nlohmann::json buffer_names = nlohmann::json::array();
  for (const auto& item : s.model->named_buffers(true))
    if (item.value().defined()) buffer_names.push_back(item.key());
  model_layout.metadata = {{"format", ckpt::kFormat}, {"buffers", buffer_names.dump()}};

  // Rank 0 prepares the folder; every rank checks its disk has room for what it writes.
  std::exception_ptr failed;
  try {
    if (rank == 0) {
      ckpt::make_folders(dir);
      // A save replaces or removes only what saves wrote under its names.
      for (const std::string& path : {final_dir, incoming, aside})
        if (ckpt::path_exists(path) && !ckpt::holds_only_a_saves_files(path))
          throw IoError(path + " exists and is not a checkpoint's folder (it holds files no save writes); a save "
                        "replaces only an earlier checkpoint of its tag: move it, or save with another tag or folder");
      if (const std::string latest = dir + "/latest"; ckpt::path_exists(latest) && !ckpt::is_regular_file(latest))
        throw IoError(latest + " is not a file; a save writes the tag a resume reads there: move it, or save to "
                      "another folder");
      ckpt::remove_tree(incoming);
      ckpt::make_folders(incoming);
    }
  } catch (const std::exception& e) {
    failed = std::make_exception_ptr(IoError(what + ": cannot prepare " + incoming + ": " + e.what()));
  }
  agree(comm, failed, what);
  // From here a failed save removes its folder (every rank has stopped
  // writing once they agree that one failed).
  auto agree_or_clean = [&](std::exception_ptr mine, bool committed = false) {
    if (!mine && !committed) {  // a signal after the commit stops nothing: the checkpoint is whole
      try {
        SaveSignals::check(what);
      } catch (...) {
        mine = std::current_exception();
      }
    }
    try {
      agree(comm, mine, what);
    } catch (...) {
      // Rank 0 committed: the checkpoint is whole whatever another rank
      // did after (a rank stopped before the last word is no failed save).
      if (committed && rank == 0 && !mine) {
        std::string why = "another rank ended";
        try {
          throw;
        } catch (const std::exception& e) {
          why = e.what();
        } catch (...) {
        }
        throw IoError(what + ": the checkpoint is whole and " + dir + "/latest names it (" + tag +
                      "); after the commit the ranks could not agree: " + why);
      }
      if (rank == 0) {
        try {
          ckpt::remove_tree(incoming);
        } catch (const std::exception&) {  // the save's own error says more
        }
      }
      throw;
    }
  };
  {
    ckpt::make_header(layout);  // lays the file out: its size
    int64_t needed = layout.file_bytes() + layout.num_sums() * 4;
    if (rank == 0) {
      ckpt::Layout ml = model_layout;
      ckpt::make_header(ml);
      needed += ml.file_bytes() + ml.num_sums() * 4 + (int64_t{1} << 20);  // and meta.json
    }
    const int64_t free = s.checkpoint_hooks.free_bytes ? s.checkpoint_hooks.free_bytes(incoming) : statvfs_free(incoming);
    if (free >= 0 && free < needed) {
      failed = std::make_exception_ptr(IoError(
          what + ": " + incoming + " has " + format_bytes(free) + " free; this rank's files need " +
          format_bytes(needed) + " (" + std::to_string(needed) + " bytes); nothing was written and the previous "
          "checkpoints are as they were"));
    }
  }
  agree_or_clean(failed);

  // Each rank writes its files (NOTE [checkpoint commit]).
  ckpt::TensorFileWriter::Committed mine, model_file;
  int64_t bytes = 0;
  {
    // Rank 0's model file first: every rank gathers the frozen groups, a
    // group at a time, while rank 0 writes them; a failure to write stops
    // the writing, not the gathers (the other ranks are in them).
    std::unique_ptr<offload::AioEngine> aio;
    std::unique_ptr<ckpt::TensorFileWriter> mw;
    try {
      if (rank == 0) {
        aio = std::make_unique<offload::AioEngine>(partition::aio_options(s.config.aio));
        mw = std::make_unique<ckpt::TensorFileWriter>(incoming + "/model.safetensors", model_layout, *aio);
      }
    } catch (...) {
      failed = std::current_exception();
    }
    size_t next = 0;
    for (size_t g : frozen) {
      opt.stage3()->with_gathered(g, [&] {
        if (mw == nullptr || failed) return;
        try {
          SaveSignals::check(what);
          for (size_t i : flat.all_groups()[g].slots) mw->append(next++, flat.all_slots()[i].param.detach().contiguous());
        } catch (...) {
          failed = std::current_exception();
        }
      });
    }
    if (mw != nullptr && !failed) {
      try {
        for (size_t i = 0; i < extra.size(); ++i) mw->append(next++, extra[i].second.contiguous());
        model_file = mw->commit(incoming + "/model.sums");
        bytes += model_file.bytes;
      } catch (...) {
        failed = std::current_exception();
      }
    }
  }
  if (!failed) try {
    offload::AioEngine aio(partition::aio_options(s.config.aio));
    ckpt::TensorFileWriter w(incoming + "/" + part_name(rank) + ".safetensors", layout, aio);
    if (holds_partition) {
      const auto& groups = store.sub_groups();
      opt.read_states([&](size_t k, at::Tensor m, std::vector<at::Tensor> st) {
        SaveSignals::check(what);
        const size_t g = groups[k].group;
        w.append(w.tensor(store.names()[0] + "." + std::to_string(g)), m);
        for (size_t i = 0; i < st.size(); ++i) w.append(w.tensor(store.names()[i + 1] + "." + std::to_string(g)), st[i]);
      });
    }
    w.append(w.tensor("rng.cpu"), rng_cpu);
    if (rng_dev.defined()) w.append(w.tensor("rng.cuda"), rng_dev);
    mine = w.commit(incoming + "/" + part_name(rank) + ".sums");
    bytes += mine.bytes;
    if (s.checkpoint_hooks.at) s.checkpoint_hooks.at("rank_files");
  } catch (...) {
    failed = std::current_exception();
  }
  agree_or_clean(failed);
  const auto sizes = everyone(comm, mine.bytes, what + " (file sizes)");
  const auto header_crcs = everyone(comm, mine.header_crc, what + " (header checksums)");
  const auto sums_crcs = everyone(comm, mine.sums_crc, what + " (block checksums)");

  // Rank 0 commits: meta.json, the folder in place, then latest.
  try {
    if (rank == 0) {
      nlohmann::json files = nlohmann::json::object();
      for (size_t r = 0; r < sizes.size(); ++r)
        files[part_name(static_cast<int64_t>(r)) + ".safetensors"] = {
            {"bytes", sizes[r]}, {"header_crc", static_cast<uint32_t>(header_crcs[r])},
            {"sums_crc", static_cast<uint32_t>(sums_crcs[r])}};
      files["model.safetensors"] = {{"bytes", model_file.bytes}, {"header_crc", model_file.header_crc},
                                    {"sums_crc", model_file.sums_crc}};
      nlohmann::json meta = {
          {"format", ckpt::kFormat},
          {"version", ckpt::kVersion},
          {"tag", tag},
          {"world_size", s.dist.world_size},
          {"stage", s.config.zero.stage},
          {"compute_dtype", ckpt::dtype_name(s.dtype)},
          {"optimizer", s.config.optimizer->type_name},
          {"states", store.names()},
          {"precision", precision_of(store)},
          // Block-wise states (NOTE [8-bit states]) are laid out by the
          // partitions and sub-groups they were saved with.
          {"state_blocks", has_block_states(store)
                               ? nlohmann::json{{"partitions", partitions},
                                                {"sub_group_size", s.config.zero.sub_group_size},
                                                {"min_8bit_size", s.config.optimizer->min_8bit_size}}
                               : nlohmann::json(nullptr)},
          {"global_steps", s.global_steps},
          {"micro_steps", s.micro_steps},
          {"skipped_steps", s.skipped_steps},
          {"applied_steps", s.applied_steps},
          // JSON has no inf or NaN (an fp16 overflow's norm): null stands for them.
          {"last_grad_norm", std::isfinite(s.last_grad_norm) ? nlohmann::json(s.last_grad_norm) : nlohmann::json(nullptr)},
          {"scheduler", s.scheduler ? nlohmann::json{{"last_batch_iteration", s.scheduler->last_batch_iteration()}}
                                    : nlohmann::json(nullptr)},
          {"config", nlohmann::json::parse(s.config.canonical_json)},
          {"layout", ckpt::layout_of(flat, partitions, *s.model).to_json()},
          {"files", files},
          {"client_state", client},
          // NOTE [frozen groups]: exclude_frozen leaves them out; a resume
          // then keeps the values the model has (the base weights loaded).
          {"frozen_parameters", with_frozen ? "included" : "excluded"},
      };
      if (!opt.param_groups().empty()) {
        const auto numels = opt.param_group_numels();
        nlohmann::json pg = nlohmann::json::array();
        for (size_t k = 0; k < opt.param_groups().size(); ++k) {
          const auto& h = opt.param_groups()[k];
          pg.push_back({{"name", h.name},
                        {"lr", h.lr ? nlohmann::json(*h.lr) : nlohmann::json(nullptr)},
                        {"weight_decay", h.weight_decay ? nlohmann::json(*h.weight_decay) : nlohmann::json(nullptr)},
                        {"numel", numels[k]}});
          if (h.lr_set) pg.back()["lr_set"] = *h.lr_set;  // Engine::set_lr's, until the schedule's next step
        }
        meta["param_groups"] = pg;
      }
      if (s.lr_set) meta["lr_set"] = *s.lr_set;
      const auto sc = s.scaler.state();
      meta["loss_scaler"] = {{"cur_scale", sc.cur_scale}, {"cur_iter", sc.cur_iter},
                             {"last_overflow_iter", sc.last_overflow_iter}, {"cur_hysteresis", sc.cur_hysteresis}};
      ckpt::write_file_atomically(incoming + "/meta.json", meta.dump(1));
      if (s.checkpoint_hooks.at) s.checkpoint_hooks.at("meta");
      ckpt::remove_tree(aside);
      if (ckpt::path_exists(final_dir)) ckpt::rename_path(final_dir, aside);
      if (s.checkpoint_hooks.at) s.checkpoint_hooks.at("aside");
      ckpt::rename_path(incoming, final_dir);
      ckpt::sync_path(dir);
      ckpt::write_file_atomically(dir + "/latest", tag + "\n");
      ckpt::remove_tree(aside);
    }
  } catch (const std::exception& e) {
    failed = std::make_exception_ptr(IoError(what + ": committing: " + e.what()));
    // The replaced checkpoint back in its place.
    if (rank == 0 && !ckpt::path_exists(final_dir) && ckpt::path_exists(aside)) std::rename(aside.c_str(), final_dir.c_str());
  }
  agree_or_clean(failed, /*committed=*/true);
  CheckpointStats out;
  out.dir = dir;
  out.tag = tag;
  out.bytes = bytes;
  out.seconds = seconds_since(t0);
  return out;
}

}  // namespace zero
