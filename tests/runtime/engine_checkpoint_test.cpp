// Engine checkpoints in one process (docs/checkpoints.md): exact resume for
// every stage, precision and offload tier; a checkpoint of one stage loaded
// at another; the damage a load must name; interrupted and refused saves
// leaving the previous checkpoint as it was; host memory over many saves;
// consolidation read back by Python's safetensors; load_weights into a model
// built under zero::Init. The multi-rank cases (exact resume on two ranks,
// other world sizes, killed processes) are in tests/partition/resume_test.cpp.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/utils.h>

#include "data.h"
#include "model.h"
#include "zero/snapshots/checkpoint_format.h"
#include "zero/snapshots/checkpoint_io.h"
#include "zero/runtime/engine_internal.h"
#include "zero/zero.h"

namespace {

namespace ck = zero::ckpt;  // its folder helpers: see checkpoint_format.h on std::filesystem

const std::string kWork = std::string(ZERO_BINARY_DIR) + "/tests/engine_ckpt_" + std::to_string(getpid()) + "/";

mingpt::GPTConfig gpt(int64_t n_embd = 32, int64_t n_layer = 2) {
  mingpt::GPTConfig c;
  c.vocab_size = 10;
  c.block_size = 6;
  c.n_layer = n_layer;
  c.n_head = 2;
  c.n_embd = n_embd;
  c.embd_pdrop = c.resid_pdrop = c.attn_pdrop = 0.1;  // dropout: the RNG state must come back too
  return c;
}

zero::InitOptions quiet() {
  zero::InitOptions o;
  o.print_progress = false;
  o.device = torch::Device(torch::kCPU);
  return o;
}

std::string config(const std::string& extra, int64_t gas = 1, const std::string& optimizer = "AdamW") {
  const std::string opt_params = optimizer == "AdamW"
                                     ? R"({"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01})"
                                     : R"({"lr": 0.01, "initial_accumulator_value": 0.1})";
  return R"({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": )" + std::to_string(gas) +
         R"(, "gradient_clipping": 0.5, "optimizer": {"type": ")" + optimizer + R"(", "params": )" + opt_params + "}" +
         extra + "}";
}

// A model and its engine; stage 3 gathers mingpt's blocks layer by layer.
struct Trainer {
  mingpt::GPT model{nullptr};
  std::optional<zero::Engine> engine;
  std::vector<double> losses;

  Trainer(uint64_t seed, const std::string& cfg, mingpt::GPTConfig g = gpt(), std::vector<zero::ParamGroup> groups = {}) {
    torch::manual_seed(seed);
    model = mingpt::GPT(g);
    auto o = quiet();
    o.layers = model->stage3_layers();
    o.param_groups = std::move(groups);
    engine.emplace(zero::initialize(model.ptr(), cfg, o));
  }
  // Optimizer steps [from, to) of a fixed data order.
  void train(int64_t from, int64_t to) {
    static const auto task = mingpt::make_addition_task(2);
    static const auto order = mingpt::epoch_order(task->train_size(), 3, 0);
    const int64_t gas = engine->config().batch.gradient_accumulation_steps;
    model->train();
    for (int64_t s = from; s < to; ++s) {
      double sum = 0;
      for (int64_t k = 0; k < gas; ++k) {
        auto b = task->train_batch(mingpt::micro_batch_indices(order, s, k, 0, 8, gas, 1));
        auto logits = model->forward(b.x);
        auto loss = torch::nn::functional::cross_entropy(logits.to(torch::kFloat).view({-1, logits.size(-1)}),
                                                         b.y.view({-1}),
                                                         torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1));
        sum += loss.item<double>();
        engine->backward(loss);
        engine->step();
      }
      losses.push_back(sum);
    }
  }
};

// The tensors of a safetensors file, by name.
std::map<std::string, torch::Tensor> read_weights(const std::string& path) {
  zero::ckpt::SavedLayout layout;
  std::vector<zero::ckpt::WeightTensor> tensors;
  auto reader = zero::ckpt::PieceReader::weights(zero::ckpt::WeightFiles::resolve(path), {}, &layout, &tensors, {});
  std::map<std::string, torch::Tensor> out;
  for (const auto& t : tensors) out[t.name] = reader->read_tensor(path, t.name);
  return out;
}

// Every state of a checkpoint, consolidated: state -> name -> tensor.
std::map<std::string, std::map<std::string, torch::Tensor>> all_states(const std::string& dir) {
  const std::string tag_dir = zero::ckpt::tag_folder(dir, "");
  const auto meta = zero::ckpt::read_meta(tag_dir);
  std::map<std::string, std::map<std::string, torch::Tensor>> out;
  for (const auto& s : meta.at("states")) {
    const std::string file = dir + "/consolidated." + s.get<std::string>() + ".safetensors";
    zero::ckpt::consolidate(tag_dir, file, torch::kFloat, s.get<std::string>(), {});
    out[s.get<std::string>()] = read_weights(file);
  }
  return out;
}

void expect_same_states(const std::map<std::string, std::map<std::string, torch::Tensor>>& a,
                        const std::map<std::string, std::map<std::string, torch::Tensor>>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [state, tensors] : a) {
    ASSERT_EQ(tensors.size(), b.at(state).size()) << state;
    for (const auto& [name, t] : tensors)
      EXPECT_TRUE(torch::equal(t, b.at(state).at(name))) << state << " of " << name;
  }
}

struct ResumeCase {
  const char* name;
  std::string extra;
  int64_t gas = 1;
  std::string optimizer = "AdamW";
};

void PrintTo(const ResumeCase& c, std::ostream* os) { *os << c.name; }

class ExactResume : public ::testing::TestWithParam<ResumeCase> {
 protected:
  void SetUp() override { ck::make_folders(kWork + "nvme"); }
};

// Six steps in one go, and three, a save, a new model (other initial values,
// another RNG state) and engine, a load and three more: the same losses and
// the same fp32 master, moments and counters, bit for bit.
TEST_P(ExactResume, EqualsTheUninterruptedRun) {
  const auto& c = GetParam();
  std::string extra = c.extra;
  for (size_t at; (at = extra.find("NVME")) != std::string::npos;) extra.replace(at, 4, kWork + "nvme");
  const std::string cfg = config(extra, c.gas, c.optimizer);
  const std::string dir = kWork + c.name;
  Trainer whole(7, cfg);
  whole.train(0, 6);
  whole.engine->save_checkpoint(dir + "_whole");
  {
    Trainer first(7, cfg);
    first.train(0, 3);
    const auto st = first.engine->save_checkpoint(dir, "", R"({"epoch": 0, "next": 3})");
    EXPECT_EQ(st.tag, "global_step3");
    EXPECT_GT(st.bytes, 0);
  }
  torch::manual_seed(999);
  Trainer second(123, cfg);
  const auto st = second.engine->load_checkpoint(dir);
  EXPECT_EQ(st.tag, "global_step3");
  EXPECT_EQ(nlohmann::json::parse(st.client_state), nlohmann::json::parse(R"({"epoch": 0, "next": 3})"));
  EXPECT_EQ(second.engine->global_steps(), 3);
  second.train(3, 6);
  second.engine->save_checkpoint(dir);
  ASSERT_EQ(second.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(second.losses[i], whole.losses[3 + i]) << "step " << 4 + i;
  EXPECT_EQ(second.engine->global_steps(), whole.engine->global_steps());
  EXPECT_EQ(second.engine->skipped_steps(), whole.engine->skipped_steps());
  EXPECT_EQ(second.engine->get_lr(), whole.engine->get_lr());
  EXPECT_EQ(second.engine->loss_scale(), whole.engine->loss_scale());
  EXPECT_EQ(second.engine->parameter_l2(), whole.engine->parameter_l2());
  expect_same_states(all_states(dir), all_states(dir + "_whole"));
}

INSTANTIATE_TEST_SUITE_P(
    Stages, ExactResume,
    ::testing::Values(
        ResumeCase{"stage0_fp32", ""},
        ResumeCase{"stage1_bf16", R"(, "bf16": {"enabled": true}, "zero_optimization": {"stage": 1})"},
        ResumeCase{"stage2_fp16_warmup_gas2",
                   R"(, "fp16": {"enabled": true, "initial_scale_power": 24, "hysteresis": 1}, )"
                   R"("scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.003, "warmup_num_steps": 4}}, )"
                   R"("zero_optimization": {"stage": 2, "reduce_bucket_size": 3000})",
                   2},
        ResumeCase{"stage2_cpu_offload",
                   R"(, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "sub_group_size": 5000})"},
        ResumeCase{"stage1_nvme_bf16",
                   R"(, "bf16": {"enabled": true}, "zero_optimization": {"stage": 1, "sub_group_size": 5000, )"
                   R"("offload_optimizer": {"device": "nvme", "nvme_path": "NVME", "pipeline_read": true}})"},
        ResumeCase{"stage3_fp32", R"(, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100})"},
        ResumeCase{"stage3_bf16_cpu_offload",
                   R"(, "bf16": {"enabled": true}, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100, )"
                   R"("offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}})"},
        ResumeCase{"stage3_bf16_partial_offload",
                   R"(, "bf16": {"enabled": true}, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100, )"
                   R"("sub_group_size": 3000, "offload_optimizer": {"device": "cpu", "ratio": 0.5, "super_offload": true}})"},
        ResumeCase{"stage3_nvme",
                   R"(, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100, "sub_group_size": 5000, )"
                   R"("offload_optimizer": {"device": "nvme", "nvme_path": "NVME"}, )"
                   R"("offload_param": {"device": "nvme", "nvme_path": "NVME", "max_in_cpu": 0, "buffer_size": 40000}})"},
        ResumeCase{"stage1_adagrad", R"(, "zero_optimization": {"stage": 1})", 1, "Adagrad"}),
    [](const auto& info) { return std::string(info.param.name); });

class Checkpoints : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = kWork + ::testing::UnitTest::GetInstance()->current_test_info()->name();
    ck::remove_tree(dir_);
    trainer_.emplace(5, config(R"(, "zero_optimization": {"stage": 1})"));
    trainer_->train(0, 2);
    trainer_->engine->save_checkpoint(dir_, "first");
    trainer_->train(2, 3);
  }
  // Loads dir_ into a fresh engine; returns the error's text ("" when it loaded).
  template <typename E>
  std::string load_error(const std::string& cfg = config(R"(, "zero_optimization": {"stage": 1})"),
                         mingpt::GPTConfig g = gpt()) {
    Trainer fresh(6, cfg, g);
    try {
      fresh.engine->load_checkpoint(dir_);
    } catch (const E& e) {
      return e.what();
    }
    return "";
  }
  std::string file(const std::string& name) const { return dir_ + "/first/" + name; }

  std::string dir_;
  std::optional<Trainer> trainer_;
};

TEST_F(Checkpoints, LayoutIsAsDocumented) {
  EXPECT_EQ(zero::ckpt::read_small_file(dir_ + "/latest"), "first\n");
  EXPECT_EQ(ck::list_folder(dir_ + "/first"), (std::vector<std::string>{"meta.json", "model.safetensors", "model.sums", "rank00000.safetensors",
                                          "rank00000.sums"}));
  const auto meta = zero::ckpt::read_meta(dir_ + "/first");
  EXPECT_EQ(meta["global_steps"], 2);
  EXPECT_EQ(meta["states"], nlohmann::json({"fp32_master", "exp_avg", "exp_avg_sq"}));
  EXPECT_EQ(meta["config"]["zero_optimization"]["stage"], 1);
  EXPECT_EQ(meta["files"]["rank00000.safetensors"]["bytes"].get<int64_t>(),
            ck::file_size(file("rank00000.safetensors")));
  // Everyone may read what a save wrote (the umask aside), unlike swap files.
  struct stat st {};
  ASSERT_EQ(::stat(file("rank00000.safetensors").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0044, 0044 & ~[] { mode_t m = ::umask(0); ::umask(m); return m; }());
}

TEST_F(Checkpoints, ACheckpointOfOneStageLoadsAtAnother) {
  const auto want = all_states(dir_);
  for (const char* zero : {R"(, "zero_optimization": {"stage": 0})",
                           R"(, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 777})",
                           R"(, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "sub_group_size": 999})"}) {
    Trainer other(8, config(zero));
    other.engine->load_checkpoint(dir_);
    const std::string again = dir_ + "_again";
    ck::remove_tree(again);
    other.engine->save_checkpoint(again);
    expect_same_states(all_states(again), want);
  }
}

// NOTE [partial offload], NOTE [state placement]: a checkpoint saved at one
// placement of the optimizer states (device, host memory, NVMe) resumes at
// another (the states are saved by element range, wherever they lived) and
// trains on as the uninterrupted run, bit for bit on CPU ranks.
TEST(PartialOffload, ACheckpointResumesAtAnotherRatio) {
  ck::make_folders(kWork);
  const std::string nvme = kWork + "placement_nvme";
  ck::make_folders(nvme);
  auto cfg = [&](const std::string& offload) {
    return config(R"(, "bf16": {"enabled": true}, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100, )"
                  R"("sub_group_size": 3000, "offload_optimizer": {)" +
                  offload + "}}");
  };
  auto cpu = [](double ratio) { return R"("device": "cpu", "ratio": )" + std::to_string(ratio); };
  auto on_nvme = [&](double ratio, int64_t max_in_cpu) {
    return R"("device": "nvme", "nvme_path": ")" + nvme + R"(", "ratio": )" + std::to_string(ratio) +
           R"(, "max_in_cpu": )" + std::to_string(max_in_cpu);
  };
  struct Case {
    std::string saved;
    std::vector<std::string> resumed;
  };
  const std::vector<Case> cases = {
      {cpu(0.5), {cpu(0.0), cpu(0.3), cpu(1.0), on_nvme(1.0, 0), on_nvme(1.0, 4000), on_nvme(0.5, 0)}},
      {on_nvme(0.5, 0), {cpu(1.0), on_nvme(1.0, 1000000)}},
  };
  std::map<std::string, int64_t> disk;  // per placement resumed at: the swap files' bytes
  for (const auto& c : cases) {
    const std::string dir = kWork + "partial_offload_ratio";
    ck::remove_tree(dir);
    Trainer whole(7, cfg(c.saved));
    whole.train(0, 6);
    {
      Trainer first(7, cfg(c.saved));
      first.train(0, 3);
      first.engine->save_checkpoint(dir);
    }
    for (const auto& placement : c.resumed) {
      SCOPED_TRACE("saved at {" + c.saved + "}, resumed at {" + placement + "}");
      Trainer second(123, cfg(placement));
      second.engine->load_checkpoint(dir);
      second.train(3, 6);
      ASSERT_EQ(second.losses.size(), 3u);
      for (size_t i = 0; i < 3; ++i) EXPECT_EQ(second.losses[i], whole.losses[3 + i]) << "step " << 4 + i;
      EXPECT_EQ(second.engine->parameter_l2(), whole.engine->parameter_l2());
      disk[placement] = second.engine->ledger().get(zero::Tier::kNvme, zero::Kind::kOptimizerStates).current_bytes;
    }
  }
  // The NVMe placements mix the tiers: the swap files shrink as host memory
  // (max_in_cpu) or the device (ratio) holds some layers, and hold nothing
  // where every group is within max_in_cpu.
  EXPECT_GT(disk.at(on_nvme(1.0, 0)), disk.at(on_nvme(1.0, 4000)));
  EXPECT_GT(disk.at(on_nvme(1.0, 4000)), 0);
  EXPECT_GT(disk.at(on_nvme(1.0, 0)), disk.at(on_nvme(0.5, 0)));
  EXPECT_GT(disk.at(on_nvme(0.5, 0)), 0);
  EXPECT_EQ(disk.at(on_nvme(1.0, 1000000)), 0);
}

TEST_F(Checkpoints, ADamagedBlockIsNamedWithItsFileAndOffset) {
  const std::string f = file("rank00000.safetensors");
  const int64_t size = ck::file_size(f);
  {
    std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(size / 2);
    char c = 0;
    io.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    io.seekp(size / 2);
    io.write(&c, 1);
  }
  const std::string e = load_error<zero::IoError>();
  EXPECT_NE(e.find(f + ": checksum mismatch in tensor"), std::string::npos) << e;
  EXPECT_NE(e.find("file offset"), std::string::npos) << e;
  // zero checkpoint verify finds it too.
  auto reader = zero::ckpt::PieceReader::checkpoint(dir_ + "/first", zero::ckpt::read_meta(dir_ + "/first"), {});
  EXPECT_THROW(reader->verify_file("rank00000.safetensors"), zero::IoError);
}

TEST_F(Checkpoints, ATruncatedFileIsNamed) {
  const std::string f = file("rank00000.safetensors");
  ASSERT_EQ(::truncate(f.c_str(), ck::file_size(f) - 100), 0);
  const std::string e = load_error<zero::IoError>();
  EXPECT_NE(e.find(f + ": "), std::string::npos) << e;
  EXPECT_NE(e.find("(truncated)"), std::string::npos) << e;
}

TEST_F(Checkpoints, MissingFilesAreNamed) {
  ck::remove_tree(file("rank00000.sums"));
  std::string e = load_error<zero::IoError>();
  EXPECT_NE(e.find(file("rank00000.sums")), std::string::npos) << e;
  ck::remove_tree(file("rank00000.safetensors"));
  e = load_error<zero::IoError>();
  EXPECT_NE(e.find(file("rank00000.safetensors") + ": missing"), std::string::npos) << e;
  ck::remove_tree(file("meta.json"));
  e = load_error<zero::IoError>();
  EXPECT_NE(e.find(file("meta.json") + ": missing"), std::string::npos) << e;
  ck::remove_tree(dir_ + "/latest");
  e = load_error<zero::IoError>();
  EXPECT_NE(e.find(dir_ + "/latest: missing: no complete checkpoint in " + dir_), std::string::npos) << e;
}

TEST_F(Checkpoints, DamagedMetadataIsNamed) {
  std::ofstream(file("meta.json")) << "{\"format\": \"zero-checkpoint\", ";
  const std::string e = load_error<zero::IoError>();
  EXPECT_NE(e.find(file("meta.json") + ": not valid JSON"), std::string::npos) << e;
}

// A consolidate or export stopped part-way (Ctrl-C: `zero checkpoint`
// checks for a stop signal in its progress callback and throws) leaves
// neither its output nor a temporary file.
TEST_F(Checkpoints, AStoppedConsolidateOrExportLeavesNothing) {
  const std::string out = dir_ + "/out";
  ck::make_folders(out);
  const auto stop = [](int64_t, int64_t) { throw std::runtime_error("stopped"); };
  EXPECT_THROW(zero::ckpt::consolidate(dir_ + "/first", out + "/w.safetensors", torch::kFloat, "fp32_master", {}, stop),
               std::runtime_error);
  EXPECT_TRUE(ck::list_folder(out).empty());
  EXPECT_THROW(zero::ckpt::export_hf(dir_ + "/first", out + "/hf", torch::kFloat, int64_t{1} << 30, "", {}, stop),
               std::runtime_error);
  EXPECT_TRUE(ck::list_folder(out).empty());
  EXPECT_TRUE(ck::list_folder(dir_).size() > 0);
  for (const auto& name : ck::list_folder(dir_)) EXPECT_EQ(name.find("zero-export"), std::string::npos) << name;
}

TEST_F(Checkpoints, AnotherModelIsRefusedNamingTheParameter) {
  std::string e = load_error<zero::IoError>(config(R"(, "zero_optimization": {"stage": 1})"), gpt(48));
  EXPECT_NE(e.find("parameter pos_emb has shape [1, 6, 32] there and [1, 6, 48] in the model: a checkpoint of another model"),
            std::string::npos) << e;
  e = load_error<zero::IoError>(config(R"(, "zero_optimization": {"stage": 1})"), gpt(32, 3));
  EXPECT_NE(e.find("has no parameter blocks.2."), std::string::npos) << e;
}

TEST_F(Checkpoints, AnotherOptimizerIsRefusedNamingTheStates) {
  const std::string e = load_error<zero::ConfigError>(config(R"(, "zero_optimization": {"stage": 1})", 1, "Adagrad"));
  EXPECT_NE(e.find("holds the states fp32_master, exp_avg, exp_avg_sq (optimizer AdamW)"), std::string::npos) << e;
}

// A save that fails before its commit (a crash is tested with killed
// processes in resume_test.cpp) leaves the previous checkpoint in place and
// loadable; the next save clears what it left.
TEST_F(Checkpoints, AnInterruptedSaveLeavesThePreviousOne) {
  for (const char* point : {"rank_files", "meta"}) {
    zero::detail::CheckpointHooks hooks;
    hooks.at = [point](const std::string& at) {
      if (at == point) throw std::runtime_error(std::string("interrupted at ") + point);
    };
    zero::detail::set_checkpoint_hooks(*trainer_->engine, hooks);
    EXPECT_ANY_THROW(trainer_->engine->save_checkpoint(dir_, "second")) << point;
    EXPECT_EQ(zero::ckpt::read_small_file(dir_ + "/latest"), "first\n");
    EXPECT_FALSE(ck::path_exists(dir_ + "/second"));
    EXPECT_EQ(load_error<zero::Error>(), "") << point;
  }
  zero::detail::set_checkpoint_hooks(*trainer_->engine, {});
  trainer_->engine->save_checkpoint(dir_, "second");
  EXPECT_EQ(zero::ckpt::read_small_file(dir_ + "/latest"), "second\n");
  for (const auto& name : ck::list_folder(dir_))  // the writer lock is the living engine's
    if (name != ".zero-lock") {
      EXPECT_NE(name[0], '.') << "left behind: " << name;
    }
}

// Saving a tag again replaces its folder: the old one goes aside first, so
// a failure there puts it back, and a kill there leaves it to be read.
TEST_F(Checkpoints, ReplacingATagLeavesOneWholeCopyAtEveryPoint) {
  auto steps_loaded = [&] {
    Trainer fresh(6, config(R"(, "zero_optimization": {"stage": 1})"));
    fresh.engine->load_checkpoint(dir_);
    return fresh.engine->global_steps();
  };
  zero::detail::CheckpointHooks hooks;
  hooks.at = [](const std::string& at) {
    if (at == "aside") throw std::runtime_error("interrupted with the old folder aside");
  };
  zero::detail::set_checkpoint_hooks(*trainer_->engine, hooks);
  EXPECT_THROW(trainer_->engine->save_checkpoint(dir_, "first"), zero::IoError);
  EXPECT_EQ(steps_loaded(), 2);
  ck::rename_path(dir_ + "/first", dir_ + "/.first.old");  // as a kill at that point leaves it
  EXPECT_EQ(steps_loaded(), 2);
  zero::detail::set_checkpoint_hooks(*trainer_->engine, {});
  trainer_->engine->save_checkpoint(dir_, "first");
  EXPECT_EQ(steps_loaded(), 3);
  EXPECT_EQ(ck::list_folder(dir_), (std::vector<std::string>{".zero-lock", "first", "latest"}));  // the engine's lock
}

TEST_F(Checkpoints, AFullDiskFailsTheSaveBeforeWritingNamingTheBytes) {
  zero::detail::CheckpointHooks hooks;
  hooks.free_bytes = [](const std::string&) { return int64_t{10000}; };
  zero::detail::set_checkpoint_hooks(*trainer_->engine, hooks);
  try {
    trainer_->engine->save_checkpoint(dir_, "second");
    FAIL() << "saved on a full disk";
  } catch (const zero::IoError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(dir_ + "/.second.incoming has 9.77 KiB free; this rank's files need"), std::string::npos) << msg;
    EXPECT_NE(msg.find("the previous checkpoints are as they were"), std::string::npos) << msg;
  }
  EXPECT_EQ(zero::ckpt::read_small_file(dir_ + "/latest"), "first\n");
  for (const auto& name : ck::list_folder(dir_)) EXPECT_NE(name, ".second.incoming");
  EXPECT_EQ(load_error<zero::Error>(), "");
}

TEST_F(Checkpoints, MisuseIsRefusedClearly) {
  EXPECT_THROW(trainer_->engine->save_checkpoint(dir_, "a/b"), zero::UsageError);
  EXPECT_THROW(trainer_->engine->save_checkpoint(dir_, ".hidden"), zero::UsageError);
  EXPECT_THROW(trainer_->engine->save_checkpoint(dir_, "latest"), zero::UsageError);
  EXPECT_THROW(trainer_->engine->save_checkpoint(dir_, "x", "[1, 2]"), zero::ConfigError);
  EXPECT_THROW(trainer_->engine->load_checkpoint(dir_ + "/nothing_here"), zero::IoError);
  Trainer gas2(5, config("", 2));
  auto task = mingpt::make_addition_task(2);
  auto b = task->train_batch({0, 1, 2, 3});
  auto logits = gas2.model->forward(b.x);
  gas2.engine->backward(torch::nn::functional::cross_entropy(
      logits.view({-1, logits.size(-1)}), b.y.view({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1)));
  gas2.engine->step();
  try {
    gas2.engine->save_checkpoint(dir_);
    FAIL() << "saved between micro-steps";
  } catch (const zero::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("between the micro-steps of an accumulation"), std::string::npos) << e.what();
  }
}

// The bytes a rank reads to load are its share: its states, the headers and
// checksums, little more.
TEST_F(Checkpoints, LoadReadsItsShare) {
  Trainer fresh(6, config(R"(, "zero_optimization": {"stage": 1})"));
  const auto st = fresh.engine->load_checkpoint(dir_);
  const double share = 3.0 * 4.0 * static_cast<double>(fresh.engine->num_parameters());
  EXPECT_GT(static_cast<double>(st.bytes), share);
  EXPECT_LT(static_cast<double>(st.bytes), 1.1 * share);
}

int64_t resident_bytes() {
  std::ifstream in("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  in >> pages >> resident;
  return resident * ::sysconf(_SC_PAGESIZE);
}

// DeepSpeed issue 3582: host memory grew with every save. Here RSS before the
// 2nd save and after the 20th are within 5% (the states: ~40 MB a save).
TEST(CheckpointMemory, TwentySavesDoNotGrowTheProcess) {
  const std::string dir = kWork + "twenty";
  Trainer t(1, config(R"(, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}})"),
            gpt(256, 4));
  t.train(0, 1);
  t.engine->save_checkpoint(dir, "t");
  const int64_t before = resident_bytes();
  for (int i = 2; i <= 20; ++i) t.engine->save_checkpoint(dir, "t");
  const int64_t after = resident_bytes();
  EXPECT_LT(std::abs(static_cast<double>(after - before)) / static_cast<double>(before), 0.05)
      << "RSS " << before << " -> " << after;
}

// The consolidated file is what Python's safetensors reads, equal to the
// engine's parameters bit for bit (tests/runtime/check_consolidated.py).
TEST(Consolidate, PythonReadsTheEnginesParameters) {
  const std::string dir = kWork + "consolidate";
  ck::remove_tree(dir);
  ck::make_folders(dir + "/raw");
  Trainer t(2, config(R"(, "zero_optimization": {"stage": 2})"));
  t.train(0, 3);
  t.engine->save_checkpoint(dir + "/ckpt");
  for (const auto& item : t.model->named_parameters()) {
    auto v = item.value().detach().contiguous();
    std::ofstream(dir + "/raw/" + item.key() + ".bin", std::ios::binary)
        .write(static_cast<const char*>(v.data_ptr()), static_cast<std::streamsize>(v.nbytes()));
  }
  const std::string out = dir + "/weights.safetensors";
  const std::string cmd = std::string(ZERO_BINARY_DIR) + "/bin/zero checkpoint consolidate " + dir + "/ckpt " + out +
                          " > " + dir + "/consolidate.log 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const std::string py = "python3 " + std::string(ZERO_SOURCE_DIR) + "/tests/runtime/check_consolidated.py " + out + " " +
                         dir + "/raw > " + dir + "/python.log 2>&1";
  const int rc = std::system(py.c_str());
  std::ifstream log(dir + "/python.log");
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("equal bit for bit"), std::string::npos) << text;
}

// Weights from a full-weight file into a model built partitioned under
// zero::Init (no rank ever holds it whole): the same weights, and a fresh
// optimizer state.
TEST(LoadWeights, FillsAModelBuiltUnderInit) {
  const std::string dir = kWork + "load_weights";
  ck::remove_tree(dir);
  Trainer source(3, config(R"(, "zero_optimization": {"stage": 1})"));
  source.train(0, 2);
  source.engine->save_checkpoint(dir + "/src");
  const std::string weights = dir + "/weights.safetensors";
  zero::ckpt::consolidate(zero::ckpt::tag_folder(dir + "/src", ""), weights, torch::kFloat, "fp32_master", {});

  const std::string cfg = config(R"(, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0})");
  zero::Init init(cfg, quiet());
  torch::manual_seed(77);
  mingpt::GPT model(gpt(), &init);
  auto engine = zero::initialize(model.ptr(), init, model->stage3_layers());
  engine.load_weights(weights);
  EXPECT_EQ(engine.global_steps(), 0);
  engine.save_checkpoint(dir + "/dst");
  const auto got = all_states(dir + "/dst");
  const auto want = read_weights(weights);
  ASSERT_EQ(got.at("fp32_master").size(), want.size());
  for (const auto& [name, t] : want) EXPECT_TRUE(torch::equal(got.at("fp32_master").at(name), t)) << name;
  for (const auto& [name, t] : got.at("exp_avg")) EXPECT_EQ(t.abs().max().item<float>(), 0.f) << name;

  // A file without one of the parameters is refused, naming it.
  zero::Init init2(cfg, quiet());
  mingpt::GPT bigger(gpt(32, 3), &init2);
  auto engine2 = zero::initialize(bigger.ptr(), init2, bigger->stage3_layers());
  try {
    engine2.load_weights(weights);
    FAIL() << "loaded weights of another model";
  } catch (const zero::IoError& e) {
    EXPECT_NE(std::string(e.what()).find(weights + ": has no tensor for 16 of the model's 53 parameters: blocks.2."), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("blocks.2."), std::string::npos) << e.what();
  }
}

// Hugging Face's layout: a sharded set (an index and 3 files), names under
// "model.", bf16, a tensor the model lacks. load_weights reads the index (or
// its folder), maps the names, converts with a warning naming the dtypes,
// warns of the unused tensor, and, without the mapping, refuses naming the
// missing parameters and the prefix that would match.
TEST(LoadWeights, ReadsAShardedSetWithMappedNamesAndOtherDtypes) {
  const std::string dir = kWork + "sharded";
  ck::remove_tree(dir);
  Trainer source(3, config(R"(, "zero_optimization": {"stage": 1})"));
  source.train(0, 2);
  source.engine->save_checkpoint(dir + "/src");
  const std::string weights = dir + "/weights.safetensors";
  zero::ckpt::consolidate(zero::ckpt::tag_folder(dir + "/src", ""), weights, torch::kFloat, "fp32_master", {});
  const std::string hf = dir + "/hf";
  ASSERT_EQ(std::system(("python3 " + std::string(ZERO_SOURCE_DIR) + "/tests/runtime/shard_weights.py " + weights + " " +
                         hf + " model. bfloat16 3")
                            .c_str()),
            0);
  const auto want = read_weights(weights);
  for (const std::string& path : {hf, hf + "/model.safetensors.index.json"}) {
    const std::string cfg = config(R"(, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0})");
    zero::Init init(cfg, quiet());
    mingpt::GPT model(gpt(), &init);
    auto engine = zero::initialize(model.ptr(), init, model->stage3_layers());
    try {
      engine.load_weights(path);
      FAIL() << "loaded names under a prefix the model does not have";
    } catch (const zero::IoError& e) {
      EXPECT_NE(std::string(e.what()).find("LoadWeightsOptions::strip_prefix \"model.\" would match"), std::string::npos)
          << e.what();
    }
    zero::LoadWeightsOptions o;
    o.strip_prefix = "model.";
    testing::internal::CaptureStderr();
    engine.load_weights(path, o);
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find("tensor(s) in BF16, the model computes in F32: converted (the fp32 master starts from the BF16 values)"), std::string::npos) << err;
    EXPECT_NE(err.find("1 tensor(s) the model has no parameter or buffer for, not loaded: rotary.inv_freq_unused"),
              std::string::npos)
        << err;
    engine.save_checkpoint(dir + "/dst");
    const auto got = all_states(dir + "/dst");
    for (const auto& [name, t] : want)
      EXPECT_TRUE(torch::equal(got.at("fp32_master").at(name), t.to(torch::kBFloat16).to(torch::kFloat))) << name;
    ck::remove_tree(dir + "/dst");
  }
}

// save_hf: Hugging Face's layout, a layer at a time at stage 3 (shards,
// index, config.json), which load_weights reads back to the same values and
// Python's safetensors reads as they are; a second export replaces the
// first's weight files and leaves other files; a single .safetensors from
// save_16bit_model; without the stage-3 gather key, refused.
TEST(SaveHf, ShardsThatLoadBackAndPythonReads) {
  const std::string dir = kWork + "save_hf";
  ck::remove_tree(dir);
  const std::string cfg = config(R"(, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                     "stage3_gather_16bit_weights_on_model_save": true})");
  Trainer source(5, cfg);
  source.train(0, 2);
  const std::string hf = dir + "/hf";
  ck::make_folders(hf);
  std::ofstream(hf + "/tokenizer.json") << "{}\n";
  std::ofstream(hf + "/model-best-of-3.safetensors") << "the user's own\n";
  zero::SaveHfOptions o;
  o.max_shard_bytes = 4 << 10;  // an earlier export of many shards
  o.config_json = "{\"model_type\": \"test\"}\n";
  source.engine->save_hf(hf, o);
  int earlier = 0;
  for (const auto& n : ck::list_folder(hf)) earlier += n.rfind("model-0", 0) == 0;
  o.max_shard_bytes = 16 << 10;
  source.engine->save_hf(hf, o);
  const auto names = ck::list_folder(hf);
  int shards = 0;
  for (const auto& n : names) {
    shards += n.rfind("model-0", 0) == 0;
    if (n != ".zero-export.json") EXPECT_NE(n[0], '.') << "left behind: " << n;
  }
  EXPECT_GE(shards, 3) << "a small shard size makes several";
  EXPECT_GT(earlier, shards) << "the earlier export had more shards";
  for (const auto& n : names)  // its shard names say of how many: none of the earlier export's stayed
    if (n.rfind("model-0", 0) == 0) EXPECT_NE(n.find("-of-" + std::string(5 - std::to_string(shards).size(), '0') +
                                                     std::to_string(shards)), std::string::npos) << n;
  EXPECT_EQ(std::count(names.begin(), names.end(), "tokenizer.json"), 1) << "another file was removed";
  EXPECT_EQ(ck::read_small_file(hf + "/model-best-of-3.safetensors"), "the user's own\n");
  // A folder holding a weight file no export recorded: refused, nothing changed.
  const std::string theirs = dir + "/theirs";
  ck::make_folders(theirs);
  std::ofstream(theirs + "/model.safetensors") << "their weights\n";
  EXPECT_THROW(source.engine->save_hf(theirs, o), zero::IoError);
  EXPECT_EQ(ck::read_small_file(theirs + "/model.safetensors"), "their weights\n");
  EXPECT_EQ(ck::read_small_file(hf + "/config.json"), o.config_json);
  const auto index = nlohmann::json::parse(ck::read_small_file(hf + "/model.safetensors.index.json"));
  EXPECT_EQ(index["weight_map"].size(), source.model->named_parameters(true).size());

  Trainer fresh(6, cfg);
  EXPECT_NE(fresh.engine->parameter_l2(), source.engine->parameter_l2());
  fresh.engine->load_weights(hf);
  EXPECT_EQ(fresh.engine->parameter_l2(), source.engine->parameter_l2());

  const std::string py =
      "python3 -c \"import glob, math, sys; from safetensors.torch import load_file; "
      "print(repr(math.sqrt(sum(float(t.double().pow(2).sum()) for f in sorted(glob.glob(sys.argv[1] + "
      "'/model-0*.safetensors')) for t in load_file(f).values()))))\" " + hf + " 2>/dev/null";
  FILE* p = ::popen(py.c_str(), "r");
  ASSERT_NE(p, nullptr);
  char buf[128] = {0};
  const size_t n = std::fread(buf, 1, sizeof buf - 1, p);
  ASSERT_EQ(::pclose(p), 0);
  EXPECT_NEAR(std::stod(std::string(buf, n)), source.engine->parameter_l2(), 1e-9 * source.engine->parameter_l2());

  // Again into the same folder in one file: the shards and their index go.
  source.engine->save_hf(hf, zero::SaveHfOptions{});
  for (const auto& n : ck::list_folder(hf))
    EXPECT_TRUE(n == "model.safetensors" || n == "config.json" || n == "tokenizer.json" || n == ".zero-export.json" ||
                n == "model-best-of-3.safetensors")
        << "left behind: " << n;
  Trainer again(6, cfg);
  again.engine->load_weights(hf);
  EXPECT_EQ(again.engine->parameter_l2(), source.engine->parameter_l2());

  source.engine->save_16bit_model(dir + "/one.safetensors");
  Trainer third(7, cfg);
  third.engine->load_weights(dir + "/one.safetensors");
  EXPECT_EQ(third.engine->parameter_l2(), source.engine->parameter_l2());
  // A name the file cannot take (a folder holds it): the error, and no scratch left.
  ck::make_folders(dir + "/taken.safetensors/inside");
  EXPECT_THROW(source.engine->save_16bit_model(dir + "/taken.safetensors"), zero::IoError);
  for (const auto& n : ck::list_folder(dir)) EXPECT_NE(n[0], '.') << "left behind: " << n;

  Trainer no_key(5, config(R"(, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0})"));
  EXPECT_THROW(no_key.engine->save_hf(dir + "/refused"), zero::ConfigError);
}

// Parameter groups: a no-decay group and a group with twice the lr train
// differently from one group, and a checkpoint brings each group's values
// back (a run that resumes with other values goes on with the saved ones,
// bit for bit as the uninterrupted run), at stage 1 and at stage 3.
TEST(ParamGroups, StepWithTheirValuesAndComeBackFromACheckpoint) {
  auto groups = [](double wd, double head_lr) {
    return std::vector<zero::ParamGroup>{
        zero::ParamGroup::by_name("no_decay", {".bias", "ln1.weight", "ln2.weight", "ln_f.weight"}, {}, wd),
        zero::ParamGroup::by_name("head", {}, {"head.weight"}, std::nullopt, head_lr)};
  };
  for (const char* stage : {R"(, "zero_optimization": {"stage": 1})",
                            R"(, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0})"}) {
    const std::string dir = kWork + "groups";
    ck::remove_tree(dir);
    const std::string cfg = config(stage);
    // One trainer at a time: dropout draws from the one global generator.
    Trainer plain(4, cfg);
    plain.train(0, 4);
    Trainer grouped(4, cfg, gpt(), groups(0.0, 0.006));
    grouped.train(0, 4);
    EXPECT_NE(plain.engine->parameter_l2(), grouped.engine->parameter_l2()) << "the groups changed nothing";

    Trainer first(4, cfg, gpt(), groups(0.0, 0.006));
    first.train(0, 2);
    first.engine->save_checkpoint(dir);
    Trainer second(4, cfg, gpt(), groups(0.5, 0.1));  // other values: the checkpoint's come back
    testing::internal::CaptureStderr();
    second.engine->load_checkpoint(dir);
    std::string err = testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find("parameter group no_decay has the checkpoint's lr and weight_decay (null, 0.0)"), std::string::npos)
        << err;
    second.train(2, 4);
    EXPECT_EQ(second.engine->parameter_l2(), grouped.engine->parameter_l2()) << stage;
    // A run without the groups, and one whose group takes other parameters: told.
    Trainer none(4, cfg);
    testing::internal::CaptureStderr();
    none.engine->load_checkpoint(dir);
    err = testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find("saved with parameter groups (meta.json param_groups) and this run has none"), std::string::npos)
        << err;
    Trainer other(4, cfg, gpt(), {zero::ParamGroup::by_name("no_decay", {".bias"}, {}, 0.0)});
    testing::internal::CaptureStderr();
    other.engine->load_checkpoint(dir);
    err = testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find("parameter group no_decay held "), std::string::npos) << err;
    ck::remove_tree(dir);
  }
}

}  // namespace
