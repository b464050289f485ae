#include "zero/checkpointing/checkpoint.h"

#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/cuda.h>

#include "zero/core/error.h"
#include "zero/core/comm.h"
#include "zero/core/ledger_alloc.h"
#include "zero/core/log.h"
#include "zero/core/streams.h"

namespace zero::checkpointing {
namespace {
// Reentrant backwards in progress on this thread (checkpoint recomputes),
// and what waits for the outermost pass to end.
thread_local int t_reentrant_depth = 0;
thread_local std::vector<std::function<void()>> t_deferred;
}  // namespace
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// One kept input of a checkpoint.
struct KeptInput {
  enum class Where { kAsIs, kPartition, kHost } where = Where::kAsIs;
  at::Tensor kept;  // the input, this rank's chunk of it, or its host copy
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  int64_t numel = 0;
  bool requires_grad = false;
  LedgerReservation reservation;  // kAsIs: the input's own bytes
  StreamEvent copied;                     // the end of the copy into `kept` (a host copy)
};

at::Tensor generator_state(at::Device device) {
  return at::globalContext().defaultGenerator(device).get_state();
}
void set_generator_state(at::Device device, const at::Tensor& state) {
  auto gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// What forward leaves for backward.
struct State : torch::CustomClassHolder {
  Function fn;
  Checkpointer::Impl* owner = nullptr;
  int index = 0;
  std::vector<KeptInput> inputs;
  at::Tensor cpu_rng;
  at::Tensor device_rng;
  at::Device rng_device = at::kCPU;
};

}  // namespace

struct Checkpointer::Impl {
  config::ActivationCheckpointingConfig config;
  MemoryLedger* ledger = nullptr;
  Comm* group = nullptr;
  CopyMode copy_mode = CopyMode::kImmediate;
  std::unique_ptr<CopyStream> copies;  // cpu_checkpointing: device-to-host, made on first use

  // Copies a kept input to host memory off the compute stream.
  StreamEvent to_host(const at::Tensor& dst, const at::Tensor& src) {
    if (!copies || copies->device() != src.device()) copies = std::make_unique<CopyStream>(src.device(), copy_mode);
    return copies->copy(dst, src);
  }
  // contiguous_memory_optimization: one buffer per tier kind, number_checkpoints slots.
  at::Tensor slots;
  int64_t slot_numel = 0;
  int64_t next_slot = 0;
  // This micro-step's checkpoints, for profile.
  int count = 0;
  std::vector<double> forward_s, recompute_s;

  at::Tensor allocate(int64_t numel, at::ScalarType dtype, at::Device device, Tier tier,
                      const std::string& what) {
    if (config.contiguous_memory_optimization) {
      const int64_t n = *config.number_checkpoints;
      if (!slots.defined()) {
        // Sized from the first checkpoint: every checkpoint of a stack of
        // identical blocks keeps the same bytes.
        slot_numel = numel;
        slots = ledger ? LedgerAlloc::empty(*ledger, n * numel, dtype, device, tier, Kind::kActivations,
                                       "contiguous activation checkpoint buffer")
                       : at::empty({n * numel}, at::TensorOptions().dtype(dtype).device(device));
      }
      if (next_slot >= n) {
        throw ConfigError({"activation_checkpointing.number_checkpoints: expected at least the " +
                           std::to_string(next_slot + 1) + " checkpoints this micro-step makes; got " +
                           std::to_string(n) + " (contiguous_memory_optimization preallocates that many)"});
      }
      if (numel > slot_numel || dtype != slots.scalar_type() || device != slots.device()) {
        throw ConfigError({"activation_checkpointing.contiguous_memory_optimization: checkpoint " +
                           std::to_string(next_slot) + " keeps " + std::to_string(numel) +
                           " elements, more than the " + std::to_string(slot_numel) +
                           " of the first checkpoint (the buffer's slot); it needs checkpoints of equal size"});
      }
      return slots.narrow(0, (next_slot++) * slot_numel, numel);
    }
    if (ledger) return LedgerAlloc::empty(*ledger, numel, dtype, device, tier, Kind::kActivations, what);
    return at::empty({numel}, at::TensorOptions().dtype(dtype).device(device));
  }

  KeptInput keep(const at::Tensor& input) {
    KeptInput k;
    k.shape = input.sizes().vec();
    k.dtype = input.scalar_type();
    k.device = input.device();
    k.numel = input.numel();
    k.requires_grad = input.requires_grad();
    const at::Tensor flat = input.detach().reshape({-1});
    const bool floating = input.is_floating_point();
    if (config.partition_activations && group != nullptr && floating) {
      const int64_t m = group->world_size();
      const int64_t chunk = (k.numel + m - 1) / m;
      k.where = KeptInput::Where::kPartition;
      const Tier tier = config.cpu_checkpointing ? host_tier(k.device) : Tier::kDevice;
      const at::Device at_dev = config.cpu_checkpointing ? at::Device(at::kCPU) : k.device;
      k.kept = allocate(chunk, k.dtype, at_dev, tier, "partitioned activation checkpoint");
      k.kept.zero_();
      const int64_t begin = std::min<int64_t>(k.numel, group->rank() * chunk);
      const int64_t len = std::min<int64_t>(chunk, k.numel - begin);
      if (len > 0) {
        if (config.cpu_checkpointing) k.copied = to_host(k.kept.narrow(0, 0, len), flat.narrow(0, begin, len));
        else k.kept.narrow(0, 0, len).copy_(flat.narrow(0, begin, len));
      }
    } else if (config.cpu_checkpointing && floating) {
      k.where = KeptInput::Where::kHost;
      k.kept = allocate(k.numel, k.dtype, at::kCPU, host_tier(k.device), "activation checkpoint (host)");
      k.copied = to_host(k.kept, flat);
    } else if (config.contiguous_memory_optimization && floating) {
      k.where = KeptInput::Where::kHost;  // a copy in the device buffer, restored the same way
      k.kept = allocate(k.numel, k.dtype, k.device, Tier::kDevice, "activation checkpoint");
      k.kept.copy_(flat);
    } else {
      k.kept = input.detach();
      if (ledger && k.kept.is_floating_point())
        k.reservation = LedgerAlloc::reserve(*ledger, Tier::kDevice, Kind::kActivations, k.kept.nbytes(), "activation checkpoint");
    }
    return k;
  }

  at::Tensor restore(const KeptInput& k) {
    at::Tensor full;
    switch (k.where) {
      case KeptInput::Where::kAsIs: return k.kept;
      case KeptInput::Where::kHost:
        k.copied.block_current();  // the copy to the host has ended before the copy back starts
        full = k.kept.to(k.device, /*non_blocking=*/true);
        break;
      case KeptInput::Where::kPartition: {
        const int64_t m = group->world_size();
        k.copied.block_current();
        at::Tensor chunk = k.kept.to(k.device, /*non_blocking=*/true);
        full = at::empty({chunk.numel() * m}, chunk.options());
        group->all_gather(full, chunk).wait();
        break;
      }
    }
    return full.narrow(0, 0, k.numel).view(k.shape);
  }

  static Tier host_tier(at::Device device) { return device.is_cuda() ? Tier::kPinnedHost : Tier::kHost; }
};

namespace {

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<State> state, at::TensorList inputs) {
    auto* impl = state->owner;
    const auto t0 = Clock::now();
    at::Device device = at::kCPU;
    for (const auto& t : inputs) if (t.defined() && !t.device().is_cpu()) device = t.device();
    if (impl->config.synchronize_checkpoint_boundary && device.is_cuda()) torch::cuda::synchronize();
    state->cpu_rng = generator_state(at::kCPU);
    if (device.is_cuda()) {
      state->rng_device = device;
      state->device_rng = generator_state(device);
    }
    std::vector<at::Tensor> args;
    for (const auto& t : inputs) args.push_back(t.detach());
    std::vector<at::Tensor> outputs;
    {
      at::NoGradGuard no_grad;
      outputs = state->fn(args);
    }
    for (const auto& t : inputs) state->inputs.push_back(impl->keep(t));
    torch::autograd::variable_list non_differentiable;  // one call: it replaces, not adds
    for (const auto& o : outputs)
      if (o.defined() && !o.is_floating_point()) non_differentiable.push_back(o);
    if (!non_differentiable.empty()) ctx->mark_non_differentiable(non_differentiable);
    state->index = impl->count++;
    if (impl->config.profile) impl->forward_s.push_back(since(t0));
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto state = c10::static_intrusive_pointer_cast<State>(ctx->saved_data["state"].toCapsule());
    auto* impl = state->owner;
    const auto t0 = Clock::now();
    std::vector<at::Tensor> inputs;
    for (const auto& k : state->inputs) {
      at::Tensor t = impl->restore(k).detach();
      if (k.requires_grad) t.requires_grad_(true);
      inputs.push_back(t);
    }
    // Recompute under the forward's RNG states, then give the caller theirs back.
    const at::Tensor cpu_now = generator_state(at::kCPU);
    at::Tensor dev_now;
    if (state->device_rng.defined()) dev_now = generator_state(state->rng_device);
    set_generator_state(at::kCPU, state->cpu_rng);
    if (state->device_rng.defined()) set_generator_state(state->rng_device, state->device_rng);
    std::vector<at::Tensor> outputs;
    {
      at::AutoGradMode grad_on(true);
      outputs = state->fn(inputs);
    }
    set_generator_state(at::kCPU, cpu_now);
    if (dev_now.defined()) set_generator_state(state->rng_device, dev_now);

    std::vector<at::Tensor> outs, out_grads;
    for (size_t i = 0; i < outputs.size() && i < grads.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grads[i].defined()) {
        outs.push_back(outputs[i]);
        out_grads.push_back(grads[i]);
      }
    }
    if (!outs.empty()) {
      // A pass of its own inside the outer one: what asks to run when "the"
      // backward ends waits for the outer pass (queue_when_backward_ends).
      ++t_reentrant_depth;
      try {
        torch::autograd::backward(outs, out_grads);
      } catch (...) {
        if (--t_reentrant_depth == 0) t_deferred.clear();
        throw;
      }
      if (--t_reentrant_depth == 0) {
        auto deferred = std::move(t_deferred);
        t_deferred.clear();
        for (auto& fn : deferred) torch::autograd::Engine::get_default_engine().queue_callback(std::move(fn));
      }
    }
    torch::autograd::variable_list result{at::Tensor()};  // the state argument
    for (auto& t : inputs) result.push_back(t.requires_grad() ? t.grad() : at::Tensor());
    if (impl->config.profile) {
      if (impl->recompute_s.size() <= static_cast<size_t>(state->index))
        impl->recompute_s.resize(state->index + 1, 0.0);
      impl->recompute_s[state->index] = since(t0);
    }
    state->inputs.clear();  // free what was kept as soon as it is used
    return result;
  }
};

}  // namespace

Checkpointer::Checkpointer(config::ActivationCheckpointingConfig config, MemoryLedger* ledger,
                           Comm* partition_group, CopyMode cpu_copy_mode)
    : config_(std::move(config)), partition_group_(nullptr), impl_(std::make_unique<Impl>()) {
  impl_->copy_mode = cpu_copy_mode;
  if (config_.contiguous_memory_optimization && (!config_.number_checkpoints || *config_.number_checkpoints < 1)) {
    throw ConfigError({"activation_checkpointing.contiguous_memory_optimization: expected "
                       "activation_checkpointing.number_checkpoints (a positive integer) to size its buffer; "
                       "got none"});
  }
  if (config_.partition_activations) {
    if (partition_group != nullptr && partition_group->world_size() > 1) {
      partition_group_ = partition_group;
    } else {
      log::warning_once("checkpointing.partition",
                        "activation_checkpointing.partition_activations: no model-parallel group of "
                        "more than one rank, so there is nothing to partition across; checkpoints keep whole inputs");
    }
  }
  impl_->config = config_;
  impl_->ledger = ledger;
  impl_->group = partition_group_;
}

Checkpointer::~Checkpointer() = default;

std::vector<at::Tensor> Checkpointer::checkpoint(const Function& fn, const std::vector<at::Tensor>& inputs) {
  auto state = c10::make_intrusive<State>();
  state->fn = fn;
  state->owner = impl_.get();
  return CheckpointFunction::apply(state, at::TensorList(inputs));
}

at::Tensor Checkpointer::checkpoint(const UnaryFunction& fn, const at::Tensor& x) {
  return checkpoint(Function([fn](const std::vector<at::Tensor>& in) {
                      return std::vector<at::Tensor>{fn(in[0])};
                    }),
                    {x})[0];
}

void Checkpointer::end_micro_step() {
  if (config_.profile && impl_->count > 0) {
    std::ostringstream line;
    line << "activation checkpoints this micro-step (forward / recompute ms):";
    char buf[64];
    for (int i = 0; i < impl_->count; ++i) {
      const double f = i < static_cast<int>(impl_->forward_s.size()) ? impl_->forward_s[i] : 0;
      const double r = i < static_cast<int>(impl_->recompute_s.size()) ? impl_->recompute_s[i] : 0;
      std::snprintf(buf, sizeof buf, " #%d %.2f/%.2f", i, 1e3 * f, 1e3 * r);
      line << buf;
    }
    log::info(line.str());
  }
  impl_->count = 0;
  impl_->next_slot = 0;
  impl_->forward_s.clear();
  impl_->recompute_s.clear();
}

namespace {
// The engines' checkpointers by the thread that made them, newest last: an
// engine may go on another thread than the one it was made on.
std::mutex g_current_mutex;
std::map<std::thread::id, std::vector<Checkpointer*>>& registered() {
  static auto* m = new std::map<std::thread::id, std::vector<Checkpointer*>>;
  return *m;
}

Checkpointer& plain() {
  static Checkpointer p(config::ActivationCheckpointingConfig{});
  return p;
}

}  // namespace

Checkpointer* current() {
  std::lock_guard<std::mutex> lock(g_current_mutex);
  const auto it = registered().find(std::this_thread::get_id());
  return it == registered().end() || it->second.empty() ? nullptr : it->second.back();
}

void register_current(Checkpointer* checkpointer) {
  std::lock_guard<std::mutex> lock(g_current_mutex);
  registered()[std::this_thread::get_id()].push_back(checkpointer);
}

void unregister_current(Checkpointer* checkpointer) {
  std::lock_guard<std::mutex> lock(g_current_mutex);
  for (auto it = registered().begin(); it != registered().end(); ++it) {
    auto& v = it->second;
    v.erase(std::remove(v.begin(), v.end(), checkpointer), v.end());
    if (v.empty()) {
      registered().erase(it);
      return;
    }
  }
}

void queue_when_backward_ends(std::function<void()> fn) {
  if (t_reentrant_depth > 0) t_deferred.push_back(std::move(fn));
  else torch::autograd::Engine::get_default_engine().queue_callback(std::move(fn));
}

std::vector<at::Tensor> checkpoint(const Function& fn, const std::vector<at::Tensor>& inputs) {
  Checkpointer* c = current();
  return (c != nullptr ? *c : plain()).checkpoint(fn, inputs);
}

at::Tensor checkpoint(const UnaryFunction& fn, const at::Tensor& x) {
  Checkpointer* c = current();
  return (c != nullptr ? *c : plain()).checkpoint(fn, x);
}

}  // namespace zero::checkpointing
