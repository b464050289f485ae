// TinyNet trained by zero for the DeepSpeed interoperability tests
// (deepspeed_test.cpp), on the ranks `zero launch` starts:
//   ds_tiny --config CFG [--load DIR] --first S --steps N [--save DIR] --losses FILE
// trains global steps [S, S + N) on tiny_batch (each rank its share of the
// 8 samples), after loading DIR (a DeepSpeed or zero checkpoint) when
// given, saves to --save, and writes each step's loss (rank 0: the mean of
// the ranks' losses) as a JSON list, with each value's hex.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <torch/nn/functional/loss.h>

#include "tiny_net.h"
#include "zero/zero.h"

int main(int argc, char** argv) {
  std::string config, load, save, losses_out;
  int64_t first = 0, steps = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--config") config = v;
    else if (k == "--load") load = v;
    else if (k == "--save") save = v;
    else if (k == "--losses") losses_out = v;
    else if (k == "--first") first = std::atoll(v.c_str());
    else if (k == "--steps") steps = std::atoll(v.c_str());
    else {
      std::fprintf(stderr, "ds_tiny: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  torch::manual_seed(7);
  zero::testing::TinyNet model;
  zero::InitOptions o;
  o.print_progress = false;
  o.device = torch::Device(torch::kCPU);
  auto engine = zero::initialize(model.ptr(), config, o);
  if (!load.empty()) engine.load_checkpoint(load);
  const int64_t world = engine.world_size(), rank = engine.rank(), per_rank = 8 / world;
  std::vector<double> losses;
  for (int64_t s = first; s < first + steps; ++s) {
    auto [x, y] = zero::testing::tiny_batch(s);
    x = x.narrow(0, rank * per_rank, per_rank);
    y = y.narrow(0, rank * per_rank, per_rank);
    auto loss = torch::nn::functional::mse_loss(model->forward(x), y);
    engine.backward(loss);
    engine.step();
    // The mean over the ranks, as DeepSpeed's probe prints it.
    losses.push_back(engine.all_reduce_mean(loss.detach().reshape({1})).item<double>());
  }
  // A client state, as a program saves its data position: DeepSpeed's load
  // returns it (ds_train.py --expect-next-step).
  if (!save.empty())
    engine.save_checkpoint(save, "", "{\"next_step\": " + std::to_string(first + steps) + ", \"data\": {\"seen\": [1, 2]}}");
  if (rank == 0 && !losses_out.empty()) {
    std::ofstream f(losses_out);
    f << "{\"losses\": [";
    for (size_t i = 0; i < losses.size(); ++i) {
      char text[64];
      std::snprintf(text, sizeof text, "%.17g", losses[i]);
      f << (i ? ", " : "") << text;
    }
    f << "], \"hex\": [";
    for (size_t i = 0; i < losses.size(); ++i) {
      char hex[64];
      std::snprintf(hex, sizeof hex, "\"%a\"", losses[i]);
      f << (i ? ", " : "") << hex;
    }
    f << "]}\n";
  }
  return 0;
}
