// A small training program for the stage-3 tests (run by stage3_test.cpp
// through `zero launch`): an MLP of Linear layers (each followed by an
// in-place ReLU), trained on a fixed random regression task, in one of these
// modes:
//   plain    the model built whole; the stage comes from the config
//   init     built under zero::Init (each layer partitioned as it is made),
//            with a cap on the host tier that the whole model would pass
//   branch   layers held in a ModuleList and run through zero::forward; from
//            step 3 on, every rank runs two of them in the other order
//   diverge  like branch, but only rank 1 switches the order at step 3
//   save16   trains, then saves the 16-bit weights (gathered layer by layer)
//   load16   trains whole, then compares its parameters with a saved file
//   frozen   layers of a frozen base and trainable adapters (NOTE [frozen
//            groups]); half way, GatheredParameters with a modifier rank
//            changes an adapter
//   frozen_whole  the same model with the bases outside every layer (whole)
// Rank 0 writes a JSON summary to --out.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "zero/core/ledger_alloc.h"
#include "zero/runtime/engine_internal.h"
#include "zero/zero.h"

namespace {

struct Args {
  std::string mode = "plain", config, out, save;
  std::string backward = "engine";  // engine | plain (loss.backward()) | scaled (engine.scale(loss).backward())
  int64_t layers = 4, dim = 64, steps = 5, batch = 16;
  int64_t cap_bytes = 0;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i], v = argv[i + 1];
    if (f == "--mode") a.mode = v;
    else if (f == "--backward") a.backward = v;
    else if (f == "--config") a.config = v;
    else if (f == "--out") a.out = v;
    else if (f == "--save") a.save = v;
    else if (f == "--layers") a.layers = std::stoll(v);
    else if (f == "--dim") a.dim = std::stoll(v);
    else if (f == "--steps") a.steps = std::stoll(v);
    else if (f == "--cap_bytes") a.cap_bytes = std::stoll(v);
    else throw std::runtime_error("unknown option " + f);
  }
  return a;
}

// Layers in a ModuleList, run in an order that may change with the step.
struct ListNetImpl : torch::nn::Module {
  torch::nn::ModuleList layers;
  ListNetImpl(int64_t n, int64_t d) : layers(register_module("layers", torch::nn::ModuleList())) {
    for (int64_t i = 0; i < n; ++i) layers->push_back(torch::nn::Linear(d, d));
  }
  torch::Tensor forward(torch::Tensor x, bool swap) {
    const int64_t n = static_cast<int64_t>(layers->size());
    for (int64_t i = 0; i < n; ++i) {
      int64_t k = i;
      if (swap && n >= 3 && (i == 1 || i == 2)) k = 3 - i;  // layers 1 and 2 change places
      x = torch::tanh(zero::forward(layers[k]->as<torch::nn::Linear>(), x));
    }
    return x;
  }
};
TORCH_MODULE(ListNet);

// Layers of a frozen base and trainable adapters (NOTE [frozen groups]):
// with `whole`, the bases live in a module of their own outside every layer
// (so stage 3 keeps them whole); else each in its layer (partitioned). The
// values are the same either way; so is the trainable layout.
struct AdaptedImpl : torch::nn::Module {
  torch::Tensor w, a, b;
  torch::Tensor forward(const torch::Tensor& x) {
    namespace F = torch::nn::functional;
    return torch::tanh(F::linear(x, w) + F::linear(F::linear(x, a), b));
  }
};
TORCH_MODULE(Adapted);
struct FrozenNetImpl : torch::nn::Module {
  torch::nn::ModuleList layers;
  std::shared_ptr<torch::nn::Module> bank;
  FrozenNetImpl(int64_t n, int64_t d, bool whole)
      : layers(register_module("layers", torch::nn::ModuleList())) {
    std::vector<torch::Tensor> ws, as, bs;
    for (int64_t i = 0; i < n; ++i) ws.push_back(torch::randn({d, d}) * 0.3);
    for (int64_t i = 0; i < n; ++i) as.push_back(torch::randn({4, d}) * 0.2), bs.push_back(torch::randn({d, 4}) * 0.2);
    if (whole) bank = register_module("bank", std::make_shared<torch::nn::Module>());
    for (int64_t i = 0; i < n; ++i) {
      Adapted l;
      l->w = (whole ? *bank : *l).register_parameter(whole ? "w" + std::to_string(i) : "w", ws[i], false);
      l->a = l->register_parameter("a", as[i]);
      l->b = l->register_parameter("b", bs[i]);
      layers->push_back(l);
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (const auto& l : *layers) x = zero::forward(l->as<Adapted>(), x);
    return x;
  }
};
TORCH_MODULE(FrozenNet);

torch::nn::Sequential build_mlp(const Args& a, zero::Init* init) {
  torch::nn::Sequential net;
  for (int64_t i = 0; i < a.layers; ++i) {
    torch::nn::Linear lin(a.dim, a.dim);
    net->push_back(init != nullptr ? init->partition(lin) : lin);
    // In place on a layer's output: stage 3's wrappers must allow it.
    net->push_back(torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)));
  }
  return net;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    const auto dist = zero::DistEnv::from_environment();
    nlohmann::json out;
    torch::manual_seed(7);
    std::unique_ptr<zero::Init> init;
    torch::nn::Sequential mlp{nullptr};
    ListNet list{nullptr};
    FrozenNet frozen{nullptr};
    std::shared_ptr<torch::nn::Module> model;
    const int64_t full_bytes = a.layers * (a.dim * a.dim + a.dim) * 4;  // the whole model in fp32
    if (a.mode == "init") {
      init = std::make_unique<zero::Init>(a.config);
      if (a.cap_bytes > 0) {
        init->ledger().set_limit(zero::Tier::kHost, a.cap_bytes, "the test's host cap");
        init->ledger().set_limit(zero::Tier::kPinnedHost, a.cap_bytes, "the test's host cap");
      }
      zero::reset_cpu_allocator_peak();
      const int64_t before = zero::cpu_allocator_stats().current_bytes;
      mlp = build_mlp(a, init.get());
      out["construction_peak_bytes"] = zero::cpu_allocator_stats().peak_bytes - before;
      out["full_fp32_bytes"] = full_bytes;
      model = mlp.ptr();
    } else if (a.mode == "frozen" || a.mode == "frozen_whole") {
      frozen = FrozenNet(a.layers, a.dim, a.mode == "frozen_whole");
      model = frozen.ptr();
    } else if (a.mode == "branch" || a.mode == "diverge") {
      list = ListNet(a.layers, a.dim);
      model = list.ptr();
    } else {
      mlp = build_mlp(a, nullptr);
      model = mlp.ptr();
    }
    zero::InitOptions opts;
    opts.print_progress = false;
    auto engine = init ? zero::initialize(model, *init) : zero::initialize(model, a.config, opts);
    out["param_l2_initial"] = engine.parameter_l2();
    const int64_t ws = engine.world_size(), rank = engine.rank();
    std::vector<double> losses;
    for (int64_t step = 0; step < a.steps; ++step) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
      auto x = torch::randn({a.batch, a.dim}, gen);
      auto y = torch::randn({a.batch, a.dim}, gen);
      const int64_t per = a.batch / ws;
      x = x.narrow(0, rank * per, per);
      y = y.narrow(0, rank * per, per);
      bool swap = step >= 3 && (a.mode == "branch" || (a.mode == "diverge" && rank == 1));
      x = x.to(engine.compute_dtype());  // an fp16 or bf16 model takes its dtype
      if (frozen && step == a.steps / 2) {
        // GatheredParameters with a modifier rank: rank 1 (or 0 alone)
        // changes the first layer's adapter; every rank gets it.
        auto& first = *frozen->layers[0]->as<Adapted>();
        {
          zero::GatheredParameters g(engine, {first.a}, /*modifier_rank=*/ws > 1 ? 1 : 0);
          torch::NoGradGuard no_grad;
          if (rank == (ws > 1 ? 1 : 0)) first.a.mul_(0.5).add_(0.125);
          g.done();
        }
        zero::GatheredParameters read(engine, {first.a});
        auto sum = first.a.detach().to(torch::kDouble).sum().reshape({1});
        auto sums = torch::zeros({ws}, torch::kDouble);
        sums[rank] = sum.item<double>();
        if (auto* c = zero::detail::comm_of(engine)) c->all_reduce_sum(sums).wait();
        out["gathered_sums"] = std::vector<double>(sums.data_ptr<double>(), sums.data_ptr<double>() + ws);
      }
      auto pred = list ? list->forward(x, swap) : frozen ? frozen->forward(x) : mlp->forward(x);
      auto loss = torch::mse_loss(pred.to(torch::kFloat), y);
      if (a.backward == "plain") loss.backward();
      else if (a.backward == "scaled") engine.scale(loss).backward();
      else engine.backward(loss);
      engine.step();
      auto l = loss.detach().reshape({1});
      if (auto* c = zero::detail::comm_of(engine)) c->all_reduce_sum(l).wait();
      losses.push_back(l.item<double>() / static_cast<double>(ws));
    }
    out["losses"] = losses;
    out["param_l2"] = engine.parameter_l2();
    if (auto st = engine.stage3_stats()) {
      out["trace_valid"] = st->trace_valid;
      out["gathers"] = st->gathers;
      out["prefetched_gathers"] = st->prefetched_gathers;
    }
    // Each rank's master and optimizer states, as a 32-bit FNV-1a digest of
    // their bytes (exact in a double), gathered: runs compared bit for bit.
    {
      uint32_t h = 2166136261u;
      for (const auto& t : zero::detail::optimizer_states_of(engine)) {
        const auto c = t.contiguous();
        const auto* p = static_cast<const unsigned char*>(c.data_ptr());
        for (size_t i = 0; i < c.nbytes(); ++i) h = (h ^ p[i]) * 16777619u;
      }
      auto digests = torch::zeros({ws}, torch::kDouble);
      digests[rank] = static_cast<double>(h);
      if (auto* c = zero::detail::comm_of(engine)) c->all_reduce_sum(digests).wait();
      std::vector<double> d(digests.data_ptr<double>(), digests.data_ptr<double>() + ws);
      out["states_digest"] = d;
    }
    const auto spec = zero::detail::speculation_counts(engine);
    out["speculation"] = {{"planned", spec.planned}, {"validated", spec.validated}, {"redone", spec.redone},
                          {"undone", spec.undone}};
    out["skipped_steps"] = engine.skipped_steps();
    out["host_peak_bytes"] = engine.ledger().get(zero::Tier::kHost).peak_bytes;
    for (const auto t : {zero::Tier::kDevice, zero::Tier::kPinnedHost, zero::Tier::kHost, zero::Tier::kNvme})
      out["frozen_bytes"][zero::to_string(t)] = engine.ledger().get(t, zero::Kind::kFrozenParameters).current_bytes;
    {  // every rank's resident memory now (VmRSS)
      int64_t rss = 0;
      std::ifstream status("/proc/self/status");
      for (std::string line; std::getline(status, line);)
        if (line.rfind("VmRSS:", 0) == 0) rss = std::stoll(line.substr(6)) * 1024;
      auto all = torch::zeros({ws}, torch::kDouble);
      all[rank] = static_cast<double>(rss);
      if (auto* c = zero::detail::comm_of(engine)) c->all_reduce_sum(all).wait();
      out["resident_bytes"] = std::vector<double>(all.data_ptr<double>(), all.data_ptr<double>() + ws);
    }
    out["model_state_bytes"] = engine.model_state_bytes().total();
    if (a.mode == "save16") {
      engine.save_16bit_model(a.save);
      out["saved"] = a.save;
    }
    if (a.mode == "load16") {  // compare a saved file with this run's parameters
      std::ifstream in(a.save, std::ios::binary);
      std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      auto dict = torch::pickle_load(bytes).toGenericDict();
      double diff = 0;
      int64_t n = 0;
      for (const auto& item : model->named_parameters(true)) {
        auto t = dict.at(item.key()).toTensor();
        diff = std::max(diff, (t - item.value().detach()).abs().max().item<double>());
        ++n;
      }
      out["loaded_tensors"] = n;
      out["max_abs_diff"] = diff;
    }
    if (rank == 0 && !a.out.empty()) std::ofstream(a.out) << out.dump(2) << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "stage3_worker: " << e.what() << "\n";
    return 1;
  }
}
