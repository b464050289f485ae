// The Llama model against Hugging Face transformers (issue 25): a small
// random LlamaForCausalLM saved by transformers in shards (grouped-query
// attention or not, tied or untied head, Llama 3's rotary scaling) gives
// `llama logits` transformers' logits to 1e-4; trained at stage 3 on two
// ranks and saved with --save_hf, transformers loads it and agrees with
// `llama logits` on it. transformers comes from scripts/setup.sh: without it
// these tests fail, they do not skip.
#include <algorithm>
#include <cmath>
#include <vector>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "zero/core/error.h"
#include "zero/models/llama.h"
#include "zero/snapshots/checkpoint_format.h"
#include "zero/snapshots/checkpoint_io.h"
#include "zero/runtime/estimate.h"
#include "models_test_util.h"

namespace {

namespace ck = zero::ckpt;

using zero::test::kBin;
using zero::test::py;
using zero::test::read;
using zero::test::sh;
using zero::test::write_tokens;

const std::string kWork = std::string(ZERO_BINARY_DIR) + "/tests/llama_" + std::to_string(::getpid()) + "/";

struct Case {
  std::string name;
  int tie, kv_heads;
  std::string rope;
};

class LlamaLogits : public testing::TestWithParam<Case> {};

TEST_P(LlamaLogits, EqualTransformers) {
  const Case c = GetParam();
  const std::string dir = kWork + c.name;
  ck::remove_tree(dir);
  ck::make_folders(dir);
  const std::string tokens = "1,5,9,2,33,7,63,0";
  ASSERT_EQ(sh(py(dir) + dir + "/hf --tie " + std::to_string(c.tie) + " --kv-heads " + std::to_string(c.kv_heads) +
                   " --rope " + c.rope + " --tokens " + tokens,
               dir + "/make.log"),
            0)
      << ck::read_small_file(dir + "/make.log");
  int shards = 0;
  for (const auto& n : ck::list_folder(dir + "/hf")) shards += n.rfind("model-", 0) == 0;
  EXPECT_GE(shards, 3);
  ASSERT_EQ(sh(kBin + "llama logits --model " + dir + "/hf --tokens " + tokens + " --out " + dir + "/got.safetensors",
               dir + "/logits.log"),
            0)
      << ck::read_small_file(dir + "/logits.log");
  const auto got = read(dir + "/got.safetensors", "logits"), want = read(dir + "/hf/ref_logits.safetensors", "logits");
  ASSERT_EQ(got.sizes(), want.sizes());
  EXPECT_LT((got - want).abs().max().item<double>(), 1e-4);
  ck::remove_tree(dir);
}

INSTANTIATE_TEST_SUITE_P(Shapes, LlamaLogits,
                         testing::Values(Case{"untied_gqa", 0, 2, "default"}, Case{"tied_mha_llama3", 1, 4, "llama3"}),
                         [](const testing::TestParamInfo<Case>& i) { return i.param.name; });

// Trained at stage 3 on two ranks from the transformers model, saved with
// --save_hf: transformers loads it, its logits equal `llama logits`' on it,
// and training changed them.
TEST(LlamaTrain, SaveHfAtStage3OnTwoRanksLoadsInTransformers) {
  const std::string dir = kWork + "train";
  ck::remove_tree(dir);
  ck::make_folders(dir);
  const std::string tokens = "3,1,4,1,5,9,2,6";
  ASSERT_EQ(sh(py(dir) + dir + "/hf --tie 0 --kv-heads 2 --rope default --tokens " + tokens, dir + "/make.log"), 0)
      << ck::read_small_file(dir + "/make.log");
  write_tokens(dir + "/tokens.bin", 4000, 7, 13, 64);  // token ids 0..63, uint16
  std::ofstream(dir + "/ds.json")
      << R"({"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 1.0,
             "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.1}},
             "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                   "stage3_gather_16bit_weights_on_model_save": true}})";
  ASSERT_EQ(sh("env OMP_NUM_THREADS=1 " + kBin + "zero launch --nproc_per_node 2 -- " + kBin + "llama train --model " +
                   dir + "/hf --config " + dir + "/ds.json --data " + dir + "/tokens.bin --block_size 16 --batch_size 4 "
                   "--steps 10 --save_hf " + dir + "/out --save_dir " + dir + "/ck --summary-json " + dir + "/summary.json",
               dir + "/train.log"),
            0)
      << ck::read_small_file(dir + "/train.log");
  const auto summary = nlohmann::json::parse(ck::read_small_file(dir + "/summary.json"));
  EXPECT_EQ(summary["world_size"], 2);
  EXPECT_EQ(summary["zero_stage"], 3);
  EXPECT_EQ(summary["steps"], 10);
  EXPECT_TRUE(summary.contains("param_gather_wait_s")) << summary.dump();
  EXPECT_GT(summary["stage3"]["gathers"].get<int64_t>(), 0) << summary.dump();
  EXPECT_LT(summary["loss_curve"].back().get<double>(), summary["loss_curve"].front().get<double>());
  {  // config.json keeps every key of the input's (token ids, generation settings); its dtype is the saved one
    const auto in = nlohmann::json::parse(ck::read_small_file(dir + "/hf/config.json"));
    const auto out = nlohmann::json::parse(ck::read_small_file(dir + "/out/config.json"));
    ASSERT_TRUE(in.contains("bos_token_id")) << in.dump();
    for (const auto& [key, value] : in.items()) {
      if (key == "dtype" || key == "torch_dtype") continue;
      EXPECT_EQ(out.value(key, nlohmann::json()), value) << key;
    }
    EXPECT_EQ(out.value("dtype", out.value("torch_dtype", nlohmann::json())), "float32") << out.dump();
  }
  ASSERT_EQ(sh(py(dir) + "--logits " + dir + "/out --tokens " + tokens + " --outfile " + dir + "/hf_out.safetensors",
               dir + "/ref.log"),
            0)
      << ck::read_small_file(dir + "/ref.log");
  ASSERT_EQ(sh(kBin + "llama logits --model " + dir + "/out --tokens " + tokens + " --out " + dir + "/got.safetensors",
               dir + "/logits.log"),
            0)
      << ck::read_small_file(dir + "/logits.log");
  const auto got = read(dir + "/got.safetensors", "logits"), want = read(dir + "/hf_out.safetensors", "logits");
  const auto before = read(dir + "/hf/ref_logits.safetensors", "logits");
  const double off = (got - want).abs().max().item<double>(), moved = (got - before).abs().max().item<double>();
  std::cout << "saved model's logits: transformers vs llama differ by " << off << ", moved " << moved
            << " from the initial model's\n";
  EXPECT_LT(off, 1e-4);
  EXPECT_GT(moved, 1e-3) << "training left the logits as they were";
  // The engine checkpoint exported with `zero checkpoint export --hf` is the
  // same model (its fp32 master; the run was fp32).
  ASSERT_EQ(sh(kBin + "zero checkpoint export " + dir + "/ck " + dir + "/exported --hf --max-shard-size 20KB --config " +
                   dir + "/out/config.json",
               dir + "/export.log"),
            0)
      << ck::read_small_file(dir + "/export.log");
  ASSERT_EQ(sh(kBin + "llama logits --model " + dir + "/exported --tokens " + tokens + " --out " + dir + "/exp.safetensors",
               dir + "/exp.log"),
            0)
      << ck::read_small_file(dir + "/exp.log");
  EXPECT_TRUE(torch::equal(read(dir + "/exp.safetensors", "logits"), got));
  // A resume past --steps is refused (--steps counts from the run's start).
  EXPECT_NE(sh(kBin + "llama train --model " + dir + "/hf --config " + dir + "/ds.json --data " + dir + "/tokens.bin " +
                   "--block_size 16 --batch_size 8 --steps 5 --resume " + dir + "/ck",
               dir + "/past.log"),
            0);
  EXPECT_NE(ck::read_small_file(dir + "/past.log").find("--steps 5: " + dir + "/ck/global_step10 is at step 10 already"),
            std::string::npos)
      << ck::read_small_file(dir + "/past.log");
  // Weights only in torch's pickle format: refused, not passed over.
  ck::make_folders(dir + "/pickled");
  std::ofstream(dir + "/pickled/config.json") << ck::read_small_file(dir + "/hf/config.json");
  std::ofstream(dir + "/pickled/pytorch_model.bin") << "pickle";
  EXPECT_NE(sh(kBin + "llama train --model " + dir + "/pickled --config " + dir + "/ds.json --data " + dir +
                   "/tokens.bin --block_size 16 --steps 1",
               dir + "/pickled.log"),
            0);
  EXPECT_NE(ck::read_small_file(dir + "/pickled.log").find("torch's pickle format (pytorch_model.bin)"), std::string::npos)
      << ck::read_small_file(dir + "/pickled.log");
  ck::remove_tree(dir);
}

// Three optimizer steps on 2 ranks at every stage, AdamW with the trainer's
// no-decay group (norms and embedding) and a weight decay large enough to
// tell the groups apart, equal torch.optim.AdamW with the same groups on the
// same global batches (transformers' model, in Python).
class LlamaStep : public testing::TestWithParam<int> {};

TEST_P(LlamaStep, EqualsTorchAdamWWithTheSameGroups) {
  const int stage = GetParam();
  const std::string dir = kWork + "step" + std::to_string(stage);
  ck::remove_tree(dir);
  ck::make_folders(dir);
  // pad_token_id 0 (token 0 is in the data): its embedding row takes no gradient.
  ASSERT_EQ(sh(py(dir) + dir + "/hf --tie 0 --kv-heads 2 --rope default --tokens 1 --pad 0", dir + "/make.log"), 0)
      << ck::read_small_file(dir + "/make.log");
  write_tokens(dir + "/tokens.bin", 2000, 11, 7, 64);
  std::ofstream(dir + "/ds.json") << R"({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
      "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.5}},
      "zero_optimization": {"stage": )" << stage
                                  << R"(, "stage3_param_persistence_threshold": 0,
                                          "stage3_gather_16bit_weights_on_model_save": true}})";
  ASSERT_EQ(sh("env OMP_NUM_THREADS=1 " + kBin + "zero launch --nproc_per_node 2 -- " + kBin + "llama train --model " +
                   dir + "/hf --config " + dir + "/ds.json --data " + dir + "/tokens.bin --block_size 16 --steps 3 "
                   "--save_hf " + dir + "/out",
               dir + "/train.log"),
            0)
      << ck::read_small_file(dir + "/train.log");
  EXPECT_NE(ck::read_small_file(dir + "/train.log").find("parameter groups: default"), std::string::npos);
  ASSERT_EQ(sh(py(dir) + "--adamw-step " + dir + "/hf --data " + dir + "/tokens.bin --block-size 16 --samples 8 --steps 3 "
                   "--lr 0.01 --weight-decay 0.5 --tokens 0 --outfile " + dir + "/torch.safetensors",
               dir + "/ref.log"),
            0)
      << ck::read_small_file(dir + "/ref.log");
  ck::SavedLayout layout;
  std::vector<ck::WeightTensor> tensors;
  auto want = ck::PieceReader::weights(ck::WeightFiles::resolve(dir + "/torch.safetensors"), {}, &layout, &tensors, {});
  auto got = ck::PieceReader::weights(ck::WeightFiles::resolve(dir + "/out"), {}, &layout, nullptr, {});
  auto before = ck::PieceReader::weights(ck::WeightFiles::resolve(dir + "/hf"), {}, &layout, nullptr, {});
  ASSERT_FALSE(tensors.empty());
  double worst = 0, moved = 0;
  for (const auto& t : tensors) {
    const auto w = want->read_tensor("", t.name), g = got->read_tensor("", t.name);
    worst = std::max(worst, (w - g).abs().max().item<double>());
    moved = std::max(moved, (g - before->read_tensor("", t.name)).abs().max().item<double>());
  }
  EXPECT_LT(worst, 1e-5) << "stage " << stage;
  EXPECT_GT(moved, 1e-3) << "the steps changed nothing";
  ck::remove_tree(dir);
}

INSTANTIATE_TEST_SUITE_P(Stages, LlamaStep, testing::Values(0, 1, 2, 3),
                         [](const testing::TestParamInfo<int>& i) { return "stage" + std::to_string(i.param); });

// zero tune on the llama program, unchanged: its model read from a run that
// builds it and stops, each candidate run as `llama train --config {config}`
// on 2 ranks under the budgets; the config written passes zero config check
// and trains.
TEST(LlamaTune, TunesTheLlamaProgram) {
  const std::string dir = kWork + "tune";
  ck::remove_tree(dir);
  ck::make_folders(dir + "/tmp");
  ASSERT_EQ(sh(py(dir) + dir + "/hf --tie 0 --kv-heads 2 --rope default --tokens 1,2", dir + "/make.log"), 0)
      << ck::read_small_file(dir + "/make.log");
  write_tokens(dir + "/tokens.bin", 20000, 5, 7, 64);
  std::ofstream(dir + "/base.json") << R"({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
      "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "weight_decay": 0.1}}})";
  const std::string train = kBin + "llama train --model " + dir + "/hf --data " + dir +
                            "/tokens.bin --block_size 16 --config ";
  ASSERT_EQ(sh("env TMPDIR=" + dir + "/tmp OMP_NUM_THREADS=1 " + kBin +
                   "zero tune --ranks 2 --device-memory 256MiB --host-memory 1GiB --stages 0,3 --offload none,cpu "
                   "--micro-batches 1,2 --steps 2 --trials 3 --config " + dir + "/base.json --out " + dir +
                   "/best.json --json " + dir + "/tune.json -- " + train + "{config} --steps 50",
               dir + "/tune.log"),
            0)
      << ck::read_small_file(dir + "/tune.log");
  const std::string log = ck::read_small_file(dir + "/tune.log");
  EXPECT_NE(log.find("tokens/s"), std::string::npos) << log;  // llama says its tokens per sample
  const auto report = nlohmann::json::parse(ck::read_small_file(dir + "/tune.json"));
  EXPECT_GT(report["best"]["tokens_per_s"].get<double>(), 0) << report.dump();
  EXPECT_TRUE(ck::list_folder(dir + "/tmp").empty()) << "left behind in TMPDIR";
  ASSERT_EQ(sh(kBin + "zero config check " + dir + "/best.json --world-size 2", dir + "/check.log"), 0)
      << ck::read_small_file(dir + "/check.log");
  ASSERT_EQ(sh("env OMP_NUM_THREADS=1 " + kBin + "zero launch --nproc_per_node 2 -- " + train + dir +
                   "/best.json --steps 3",
               dir + "/train.log"),
            0)
      << ck::read_small_file(dir + "/train.log");
  ck::remove_tree(dir);
}

// zero estimate of a Llama from its config.json (--hf-config) and from its
// weights (--weights): each rank's model-state bytes per tier and kind
// within 5% of the ledger's on 2 ranks, at every stage and offload tier;
// with --calibrate (a stage-2 run's report), the device peak of a stage-3
// step within 10% of a stage-3 run's. The model's parameters from the
// module itself (zero::parameter_shapes) and from llama_parameters agree
// with the engine's layout.
TEST(LlamaEstimate, FromItsConfigAndWeightsWithin5PercentOfTheLedger) {
  const std::string dir = kWork + "estimate";
  ck::remove_tree(dir);
  ck::make_folders(dir);
  ASSERT_EQ(sh(py(dir) + dir + "/hf --tie 0 --kv-heads 2 --rope default --tokens 1,2 --hidden 128 --inter 256 "
                   "--layers 4 --heads 4 --vocab 512 --shard-kb 400",
               dir + "/make.log"),
            0)
      << ck::read_small_file(dir + "/make.log");
  write_tokens(dir + "/tokens.bin", 20000, 5, 7, 512);
  {  // the parameters three ways
    const auto cfg = zero::models::LlamaConfig::from_file(dir + "/hf");
    zero::models::LlamaForCausalLM model(cfg);
    const auto from_module = zero::parameter_shapes(*model, model->stage3_layers());
    const auto from_config = zero::models::llama_parameters(cfg);
    ASSERT_EQ(from_module.size(), from_config.size());
    for (size_t i = 0; i < from_module.size(); ++i) {
      EXPECT_EQ(from_module[i].name, from_config[i].name);
      EXPECT_EQ(from_module[i].numel, from_config[i].numel) << from_config[i].name;
      EXPECT_EQ(from_module[i].layer, from_config[i].layer) << from_config[i].name;
    }
  }
  struct Setup {
    std::string name, zero;
  };
  const std::vector<Setup> setups = {
      {"s0", R"({"stage": 0})"},
      {"s1", R"({"stage": 1})"},
      {"s2", R"({"stage": 2})"},
      {"s2cpu", R"({"stage": 2, "offload_optimizer": {"device": "cpu"}})"},
      {"s3", R"({"stage": 3, "stage3_param_persistence_threshold": 1000})"},
      {"s3cpu", R"({"stage": 3, "stage3_param_persistence_threshold": 1000, "offload_optimizer": {"device": "cpu"},
                    "offload_param": {"device": "cpu"}})"},
      {"s3nvme", R"({"stage": 3, "stage3_param_persistence_threshold": 1000, "offload_optimizer": {"device": "nvme",
                     "nvme_path": "NVME"}, "offload_param": {"device": "nvme", "nvme_path": "NVME", "max_in_cpu": 0}})"}};
  ck::make_folders(dir + "/nvme");
  double worst = 0;
  for (const auto& st : setups) {
    std::string zero = st.zero;
    for (size_t at; (at = zero.find("NVME")) != std::string::npos;) zero.replace(at, 4, dir + "/nvme");
    const std::string cfg = dir + "/" + st.name + ".json";
    std::ofstream(cfg) << R"({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
                            "zero_optimization": )" << zero << "}";
    ASSERT_EQ(sh("env OMP_NUM_THREADS=1 ZERO_RUN_REPORT=" + dir + "/" + st.name + ".report " + kBin +
                     "zero launch --nproc_per_node 2 -- " + kBin + "llama train --model " + dir + "/hf --config " + cfg +
                     " --data " + dir + "/tokens.bin --block_size 64 --steps 2 --summary-json " + dir + "/" + st.name +
                     ".summary.json",
                 dir + "/" + st.name + ".log"),
              0)
        << ck::read_small_file(dir + "/" + st.name + ".log");
    const auto measured = nlohmann::json::parse(ck::read_small_file(dir + "/" + st.name + ".summary.json"));
    const double psi = measured["num_parameters"].get<double>();
    for (const char* source : {"--hf-config", "--weights"}) {
      const std::string e = dir + "/" + st.name + source + ".json";
      ASSERT_EQ(sh(kBin + "zero estimate " + source + " " + dir + "/hf --ranks-per-node 2 --config " + cfg + " --json " + e,
                   e + ".log"),
                0)
          << ck::read_small_file(e + ".log");
      const auto estimated = nlohmann::json::parse(ck::read_small_file(e));
      ASSERT_EQ(estimated["num_parameters"], measured["num_parameters"]) << source;
      const auto& row = estimated["configurations"][0];
      for (const auto& rank : measured["ranks"])
        for (const char* tier : {"device", "host", "nvme"})
          for (const char* kind : {"parameters", "gradients", "optimizer_states"}) {
            const double got = rank["model_state_bytes_by_tier"][tier][kind].get<double>();
            const double want = row[tier][kind].get<double>();
            if (std::max(want, got) > 0) worst = std::max(worst, std::abs(want - got) / std::max(want, got));
            EXPECT_TRUE(std::abs(want - got) <= 0.05 * std::max(want, got) || std::max(want, got) < 0.01 * psi)
                << st.name << " " << source << " rank " << rank["rank"] << " " << tier << " " << kind << ": estimated "
                << want << ", the ledger " << got;
          }
    }
  }
  std::printf("zero estimate --hf-config / --weights: largest difference from the ledger %.2f%%\n", 100 * worst);
  // --calibrate: stage 2's measured activations predict stage 3's peak.
  const std::string e = dir + "/calibrated.json";
  ASSERT_EQ(sh(kBin + "zero estimate --hf-config " + dir + "/hf --ranks-per-node 2 --backend gloo --config " + dir +
                   "/s3.json --calibrate " + dir + "/s2.report.rank0 --json " + e,
               e + ".log"),
            0)
      << ck::read_small_file(e + ".log");
  const auto calibrated = nlohmann::json::parse(ck::read_small_file(e));
  const double predicted = calibrated["configurations"][0]["peak"]["device"].get<double>();
  const double actual = nlohmann::json::parse(ck::read_small_file(dir + "/s3.report.rank0"))["peak_bytes"]["device"].get<double>();
  std::printf("zero estimate --calibrate: stage-3 device peak predicted %.0f, measured %.0f (%+.1f%%)\n", predicted, actual,
              100 * (predicted / actual - 1));
  EXPECT_NEAR(predicted, actual, 0.10 * actual) << ck::read_small_file(e + ".log");
  ck::remove_tree(dir);
}

// A stage-3 load reads each rank's own bytes (NOTE [checkpoint mapping]): a
// 128 MB model on 2 ranks, each under a host budget of a quarter of the
// model, reads about half of the file and its resident memory rises by far
// less than the file.
TEST(LlamaLoad, Stage3RanksReadTheirOwnBytes) {
  const std::string dir = kWork + "big";
  ck::remove_tree(dir);
  ck::make_folders(dir);
  ASSERT_EQ(sh(py(dir) + dir + "/hf --tie 0 --kv-heads 4 --rope default --tokens 1,2 --hidden 512 --inter 1408 "
                   "--layers 8 --heads 8 --vocab 8192 --shard-kb 40000",
               dir + "/make.log"),
            0)
      << ck::read_small_file(dir + "/make.log");
  int64_t file_bytes = 0;
  for (const auto& n : ck::list_folder(dir + "/hf"))
    if (n.rfind("model-", 0) == 0) file_bytes += ck::file_size(dir + "/hf/" + n);
  ASSERT_GT(file_bytes, int64_t{100} << 20);
  std::ofstream(dir + "/ds.json") << R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.0}},
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})";
  const std::string log = dir + "/logits.log";
  ASSERT_EQ(sh("env OMP_NUM_THREADS=1 " + kBin + "zero launch --nproc_per_node 2 -- " + kBin + "llama logits --model " + dir +
                   "/hf --config " + dir + "/ds.json --tokens 1,2 --out " + dir + "/got.safetensors --host-memory " +
                   std::to_string(file_bytes / 4),
               log),
            0)
      << ck::read_small_file(log);
  const std::string text = ck::read_small_file(log);
  int ranks = 0;
  for (size_t at = text.find("this rank read "); at != std::string::npos; at = text.find("this rank read ", at + 1)) {
    const int64_t read = std::stoll(text.substr(at + 15));
    const auto rose_at = text.find("rose ", at);
    const int64_t rose = std::stoll(text.substr(rose_at + 5));
    EXPECT_LT(read, file_bytes * 6 / 10) << "a rank read more than its half:\n" << text;
    EXPECT_GT(read, file_bytes * 4 / 10) << text;
    EXPECT_LT(rose, file_bytes / 2) << "a rank's memory rose by more than half the file:\n" << text;
    ++ranks;
  }
  EXPECT_EQ(ranks, 2) << text;
  EXPECT_EQ(text.find("did not reset the peak"), std::string::npos) << "the rise is not the load's own:\n" << text;
  ck::remove_tree(dir);
}

// config.json problems are named by file and key, all at once.
TEST(LlamaConfig, ProblemsNameTheKey) {
  try {
    zero::models::LlamaConfig::from_json_text(
        R"({"model_type": "mistral", "vocab_size": 0, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_act": "gelu"})",
        "x/config.json");
    FAIL() << "accepted";
  } catch (const zero::ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("x/config.json: model_type: expected \"llama\""), std::string::npos) << m;
    EXPECT_NE(m.find("x/config.json: hidden_act: expected \"silu\""), std::string::npos) << m;
    EXPECT_NE(m.find("x/config.json: vocab_size: expected an integer in 1.."), std::string::npos) << m;
  }
  try {
    zero::models::LlamaConfig::from_json_text(
        R"({"vocab_size": 8, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 3})",
        "y.json");
    FAIL() << "accepted";
  } catch (const zero::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("num_key_value_heads: 3 does not divide num_attention_heads 4"),
              std::string::npos)
        << e.what();
  }
  // What to_json writes reads back the same.
  auto c = zero::models::LlamaConfig::from_json_text(
      R"({"vocab_size": 8, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, "rope_theta": 500000.0,
          "tie_word_embeddings": true})",
      "z.json");
  const auto back = zero::models::LlamaConfig::from_json_text(c.to_json(), "back.json");
  EXPECT_EQ(back.rope_type, "llama3");
  EXPECT_EQ(back.rope_theta, 500000.0);
  EXPECT_EQ(back.num_key_value_heads, 2);
  EXPECT_TRUE(back.tie_word_embeddings);
  EXPECT_EQ(back.num_parameters(), c.num_parameters());
}

}  // namespace
