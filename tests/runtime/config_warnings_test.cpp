// NOTE [config warnings]: zero::Init, zero::initialize and `zero config
// check` (the loader's list, as it prints it) say the same warnings for the
// same config, each once: a stage-3 program built under zero::Init used to
// print none of them.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "zero/config/config.h"
#include "zero/zero.h"

namespace {

zero::InitOptions quiet() {
  zero::InitOptions o;
  o.print_progress = false;
  o.device = torch::Device(torch::kCPU);
  o.cpu_copy_mode = zero::CopyMode::kDeferred;
  return o;
}

torch::nn::Sequential build(zero::Init* init) {
  torch::manual_seed(1);
  torch::nn::Sequential net;
  for (int i = 0; i < 2; ++i) {
    torch::nn::Linear l(16, 16);
    net->push_back(init != nullptr ? init->partition(l) : l);
  }
  return net;
}

// A folder removed with the test, whatever ends it.
struct Removed {
  std::filesystem::path dir;
  ~Removed() { std::filesystem::remove_all(dir); }
};

// The warnings a stretch of stderr holds, with `file` written as CFG.
std::vector<std::string> warnings_in(const std::string& text, const std::string& file) {
  std::vector<std::string> out;
  std::istringstream lines(text);
  const std::string tag = "[zero] warning: ";
  for (std::string line; std::getline(lines, line);) {
    const auto at = line.find(tag);
    if (at == std::string::npos || line.find(file) == std::string::npos) continue;
    std::string w = line.substr(at + tag.size());
    w.replace(w.find(file), file.size(), "CFG");
    out.push_back(w);
  }
  return out;
}

std::vector<std::string> named(std::vector<std::string> ws, const std::string& file) {
  for (auto& w : ws)
    if (const auto at = w.find(file); at != std::string::npos) w.replace(at, file.size(), "CFG");
  return ws;
}

TEST(ConfigWarnings, InitInitializeAndConfigCheckSayTheSameOnce) {
  const std::string nvme = std::filesystem::temp_directory_path().string();
  const std::string head = R"({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},)";
  const std::vector<std::string> zero_sections = {
      R"("zero_optimization": {"stage": 3, "offload_optimizer": {"ratio": 0.5}})",
      R"("zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": true, "ratio": 0.0}})",
      R"("zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + nvme +
          R"(", "super_offload": true}})",
      R"("zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": true}, "offload_param": {"device": "cpu"}})",
      R"("zero_optimization": {"stage": 3, "offload_optimizer": {"gradients_on_device": true}})",
      R"("zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "max_in_cpu": 1000000}})",
      R"("zero_optimization": {"stage": 3, "mics_hierarchical_params_gather": true})",
      R"("zero_optimization": {"stage": 3, "zero_quantized_weights_block_size": 512})",
      R"("zero_optimization": {"stage": 3, "cpu_offload": true})",
      R"("zero_optimization": {"stage": 3}, "trian_batch_size": 4)",
  };
  const auto dir = std::filesystem::temp_directory_path() / ("zero-warnings-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const Removed remove{dir};
  for (size_t i = 0; i < zero_sections.size(); ++i) {
    SCOPED_TRACE(zero_sections[i]);
    // A file for each entry: each warning is printed once a process, and
    // names its file.
    std::string files[3];
    for (int e = 0; e < 3; ++e) {
      files[e] = (dir / ("case" + std::to_string(i) + "-" + std::to_string(e) + ".json")).string();
      std::ofstream(files[e]) << head << zero_sections[i] << "}";
    }
    // config check's list: the loader's, with the options it reads a file with.
    zero::config::LoadOptions check;
    check.for_training = true;
    check.auto_stand_ins = true;
    const auto listed = named(zero::config::load_file(files[0], check).warnings, files[0]);
    ASSERT_FALSE(listed.empty()) << "no warning for this case";

    testing::internal::CaptureStderr();
    {
      zero::Init init(files[1], quiet());
      auto net = build(&init);
      auto engine = zero::initialize(net.ptr(), init);
    }
    const std::string under_init = testing::internal::GetCapturedStderr();
    EXPECT_EQ(warnings_in(under_init, files[1]), listed) << under_init;

    testing::internal::CaptureStderr();
    {
      auto net = build(nullptr);
      auto engine = zero::initialize(net.ptr(), files[2], quiet());
      auto again = zero::initialize(build(nullptr).ptr(), files[2], quiet());  // a second engine: no repeat
    }
    const std::string plain = testing::internal::GetCapturedStderr();
    EXPECT_EQ(warnings_in(plain, files[2]), listed) << plain;
  }
}

// A program's flag that fills an "auto" is unused where the config gives
// the key itself: said once, and not where the config leaves it "auto".
TEST(ConfigWarnings, AFlagTheConfigOverridesIsSaidUnused) {
  const auto dir = std::filesystem::temp_directory_path() / ("zero-flags-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const Removed remove{dir};
  const std::string fixed = (dir / "fixed.json").string(), automatic = (dir / "auto.json").string();
  std::ofstream(fixed) << R"({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}})";
  std::ofstream(automatic) << R"({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})";
  for (const auto& [file, said] : {std::pair<std::string, bool>{fixed, true}, {automatic, false}}) {
    auto o = quiet();
    o.auto_values.lr = 0.01;
    o.auto_value_flags["lr"] = "--lr";
    testing::internal::CaptureStderr();
    {
      auto engine = zero::initialize(build(nullptr).ptr(), file, o);
      EXPECT_DOUBLE_EQ(engine.param_groups().at(0).lr, said ? 0.001 : 0.01);
    }
    const std::string text = testing::internal::GetCapturedStderr();
    EXPECT_EQ(text.find("--lr is not used: " + file + " gives optimizer.params.lr = 0.001 itself") != std::string::npos,
              said)
        << text;
  }
}

}  // namespace
