// Trains a linear model for a few steps through the installed zero package.
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <torch/nn/modules/linear.h>
#include <zero/testing/memory.h>
#include <zero/zero.h>

int main() {
  torch::manual_seed(0);
  auto model = std::make_shared<torch::nn::LinearImpl>(4, 1);
  zero::InitOptions options;
  options.print_progress = false;
  auto engine = zero::initialize(
      model, R"({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 0.05}}})",
      options);
  auto x = torch::randn({8, 4});
  auto y = x.sum(1, true);
  double first = 0, last = 0;
  for (int i = 0; i < 50; ++i) {
    auto loss = (model->forward(x) - y).pow(2).mean();
    if (i == 0) first = loss.item<double>();
    last = loss.item<double>();
    engine.backward(loss);
    engine.step();
  }
  std::printf("consumer: loss %.4f -> %.4f over %lld steps\n", first, last,
              static_cast<long long>(engine.global_steps()));
  // A memory-regression check from another project's test.
  const auto check = zero::testing::expect_model_states_near_formula(engine, 0.05);
  if (!check) std::printf("%s", check.message.c_str());
  // NOTE [standard library first]: the user's own std::filesystem calls bind to
  // libstdc++ (LibTorch's copy of remove_all crashes on a folder with files).
  const auto dir = std::filesystem::temp_directory_path() / ("zero-consumer-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "sub");
  std::ofstream(dir / "sub" / "file") << "x";
  const auto removed = std::filesystem::remove_all(dir);
  std::printf("consumer: std::filesystem::remove_all removed %llu entries\n", static_cast<unsigned long long>(removed));
  return last < first && check && removed == 3 ? 0 : 1;
}
