// moe: the mixture-of-experts example (zero/models/moe.h) trained through
// zero on any number of ranks, on synthetic token data.
//   moe train --config ds_config.json --steps N [options]
// Each optimizer step takes the next global batch: sample i of the run is
// a random sequence drawn from a generator seeded by (--seed, i), so any
// number of ranks sees the same data split their way (plain data parallel
// and every ZeRO stage compare step by step).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <torch/nn/functional/loss.h>

#include "zero/core/command_files.h"
#include "zero/core/crash_report.h"
#include "zero/core/text.h"
#include "zero/models/moe.h"
#include "zero/snapshots/checkpoint_io.h"
#include "zero/zero.h"

namespace {

const char* kUsage = R"(usage: moe train --config ds_config.json --steps N [options]

Trains zero::models::MoEModel (top-k routing; an expert with no token does
not run) on synthetic sequences, on any number of ranks (zero launch).
  --experts E         experts per block (default 4)
  --top_k K           experts a token goes to (default 1)
  --layers L          MoE blocks (default 2)
  --hidden C          width (default 32); each expert 2C wide
  --vocab V           vocabulary (default 64)
  --block_size T      tokens per sample (default 16)
  --batch_size B      micro-batch per rank; fills "auto" (default 4)
  --lr X              fills "auto" lr (default 1e-3)
  --seed N            model and data (default 1)
  --route router|one  one: every token of rank 0 goes to expert 0 (default router)
  --no_leaf           at stage 3, leave the mixtures' experts layers of their own
                      (ranks that route differently then fail: NOTE [leaf modules])
  --summary-json FILE the run's losses and routing (rank 0)
)";

[[noreturn]] void usage_error(const std::string& m) {
  std::cerr << "moe: " << m << "\n(run moe --help for the options)\n";
  std::exit(2);
}

int64_t to_int(const std::string& flag, const std::string& v, int64_t lo, int64_t hi) {
  try {
    size_t used = 0;
    const long long x = std::stoll(v, &used);
    if (used == v.size() && x >= lo && x <= hi) return x;
  } catch (const std::exception&) {
  }
  usage_error(flag + ": expected an integer in " + std::to_string(lo) + ".." + std::to_string(hi) + "; got \"" + v + "\"");
}

int train(int argc, char** argv) {
  const std::vector<std::string> known = {"--config", "--steps", "--experts", "--top_k", "--layers", "--hidden",
                                          "--vocab", "--block_size", "--batch_size", "--lr", "--seed", "--route",
                                          "--no_leaf", "--summary-json"};
  std::map<std::string, std::string> f;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (std::find(known.begin(), known.end(), a) == known.end()) {
      const auto near = zero::nearest(a, known);
      usage_error(a + ": unknown option" + (near.empty() ? "" : "; did you mean " + near + "?"));
    }
    if (f.count(a)) usage_error(a + " given twice: give it once");
    if (a == "--no_leaf") {
      f[a] = "1";
      continue;
    }
    if (i + 1 >= argc) usage_error(a + ": expected a value");
    f[a] = argv[++i];
  }
  for (const char* need : {"--config", "--steps"})
    if (!f.count(need)) usage_error(std::string("expected ") + need);
  auto get = [&](const char* flag, int64_t def, int64_t lo, int64_t hi) {
    return f.count(flag) ? to_int(flag, f[flag], lo, hi) : def;
  };
  zero::models::MoEConfig cfg;
  cfg.num_experts = get("--experts", 4, 1, 1024);
  cfg.top_k = get("--top_k", 1, 1, 1024);
  cfg.num_layers = get("--layers", 2, 1, 1024);
  cfg.hidden_size = get("--hidden", 32, 1, 1 << 16);
  cfg.intermediate_size = 2 * cfg.hidden_size;
  cfg.vocab_size = get("--vocab", 64, 2, 1 << 20);
  cfg.check();
  const int64_t steps = get("--steps", 0, 1, int64_t{1} << 40);
  const int64_t T = get("--block_size", 16, 1, 1 << 20), B = get("--batch_size", 4, 1, 1 << 20);
  const int64_t seed = get("--seed", 1, 0, int64_t{1} << 40);
  const std::string route = f.count("--route") ? f["--route"] : "router";
  if (route != "router" && route != "one") usage_error("--route: expected router or one; got \"" + route + "\"");
  double lr = 1e-3;
  if (f.count("--lr")) {
    try {
      lr = std::stod(f["--lr"]);
    } catch (const std::exception&) {
      usage_error("--lr: expected a number; got \"" + f["--lr"] + "\"");
    }
  }
  zero::InitOptions opts;
  opts.dist = zero::DistEnv::from_environment();
  opts.auto_values.train_micro_batch_size_per_gpu = B;
  opts.auto_values.gradient_accumulation_steps = 1;
  opts.auto_values.lr = lr;
  if (f.count("--lr")) opts.auto_value_flags["lr"] = "--lr";
  opts.tokens_per_sample = T;
  const bool rank0 = opts.dist->rank == 0;
  {
    zero::CommandFiles files;  // NOTE [outputs and inputs]
    files.reads("--config", zero::config_file_argument("--config", f["--config"]));
    if (f.count("--summary-json")) files.writes("--summary-json", f["--summary-json"]);
    files.writes_environment_outputs(opts.dist->rank, opts.dist->world_size);
    if (const auto p = files.problem(); !p.empty()) usage_error(p);
    zero::CommandFiles::declare(files);
  }
  if (f.count("--summary-json") && rank0)
    if (const auto p = zero::ckpt::output_file_problem("--summary-json", f["--summary-json"]); !p.empty()) usage_error(p);
  torch::manual_seed(static_cast<uint64_t>(seed));
  zero::models::MoEModel model(cfg);
  opts.layers = model->stage3_layers();
  if (!f.count("--no_leaf")) opts.leaf_modules = model->stage3_leaf_modules();
  if (route == "one" && opts.dist->rank == 0)
    for (auto& b : model->blocks) b->moe->force_expert(0);
  auto engine = zero::initialize(model.ptr(), f["--config"], opts);
  const int64_t ws = engine.world_size(), rank = engine.rank();
  const int64_t mbs = engine.config().batch.train_micro_batch_size_per_gpu;
  const int64_t gas = engine.config().batch.gradient_accumulation_steps, G = engine.config().batch.train_batch_size;
  // Sample i: T + 1 tokens from its own generator.
  auto sample = [&](int64_t i) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed * 1000003 + i));
    return torch::randint(cfg.vocab_size, {T + 1}, gen, torch::kLong);
  };
  std::vector<double> losses;
  std::vector<int64_t> routed(static_cast<size_t>(cfg.num_experts), 0);  // this rank's, over the run
  model->train();
  for (int64_t step = 0; step < steps; ++step) {
    torch::Tensor step_loss = torch::zeros({}, torch::kFloat);
    for (int64_t a = 0; a < gas; ++a) {
      std::vector<torch::Tensor> rows;
      for (int64_t j = 0; j < mbs; ++j) rows.push_back(sample(step * G + (a * ws + rank) * mbs + j));
      const auto s = torch::stack(rows).to(engine.device());
      const auto x = s.narrow(1, 0, T), y = s.narrow(1, 1, T);
      const auto logits = model->forward(x);
      const auto loss = torch::nn::functional::cross_entropy(logits.to(torch::kFloat).reshape({-1, cfg.vocab_size}),
                                                             y.reshape({-1}));
      for (const auto& b : model->blocks)
        for (size_t e = 0; e < routed.size(); ++e) routed[e] += b->moe->last_counts()[e];
      step_loss += loss.detach().cpu() / static_cast<double>(gas);
      engine.backward(loss);
      engine.step();
    }
    losses.push_back(engine.all_reduce_mean(step_loss).item<double>());
  }
  const double l2 = engine.parameter_l2();
  // Every rank's routing, for the summary.
  auto counts = torch::tensor(routed, torch::kLong);
  std::vector<torch::Tensor> all;
  for (int64_t r = 0; r < ws; ++r) all.push_back(engine.all_reduce_mean((counts * (r == rank ? ws : 0)).to(torch::kDouble)));
  if (rank0) {
    nlohmann::json per_rank = nlohmann::json::array();
    for (const auto& t : all) {
      std::vector<int64_t> v;
      for (int64_t e = 0; e < t.numel(); ++e) v.push_back(std::llround(t[e].item<double>()));
      per_rank.push_back(v);
    }
    nlohmann::json out = {{"world_size", ws},
                          {"zero_stage", engine.config().zero.stage},
                          {"losses", losses},
                          {"param_l2", l2},
                          {"routed_tokens", per_rank},
                          {"leaf_modules", !f.count("--no_leaf")}};
    if (auto st = engine.stage3_stats()) out["stage3_layers"] = st->layers;
    std::fprintf(stderr, "moe: %lld steps on %lld ranks at stage %d, final loss %.6f\n", static_cast<long long>(steps),
                 static_cast<long long>(ws), engine.config().zero.stage, losses.empty() ? NAN : losses.back());
    if (f.count("--summary-json")) zero::ckpt::write_file_atomically(f["--summary-json"], out.dump(2) + "\n");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  zero::install_crash_reporter("moe");  // NOTE [crash report]
  if (argc < 2 || std::string(argv[1]) == "-h" || std::string(argv[1]) == "--help") {
    std::cout << kUsage;
    return argc < 2 ? 2 : 0;
  }
  if (std::string(argv[1]) != "train") usage_error(std::string("unknown command \"") + argv[1] + "\"; expected train");
  try {
    return train(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "moe: " << zero::error_text(e) << "\n";
    return 1;
  }
}
