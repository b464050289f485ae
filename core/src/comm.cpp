// c10d behind zero::Comm. ProcessGroupGloo.hpp needs Gloo's headers for its
// declarations; they come from Debian's libgloo-dev. Nothing links Debian's
// libgloo: LibTorch carries its own Gloo, and this file only calls
// ProcessGroupGloo's out-of-line functions (its members are pointers and
// standard containers, so its layout does not depend on Gloo's).
#include "zero/core/comm.h"

#include <sstream>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "zero/core/error.h"
#include "zero/core/log.h"

namespace zero {
namespace {

std::string describe(const std::string& op, const at::Tensor& t) {
  std::ostringstream s;
  s << op << " of " << t.numel() << " " << c10::toString(t.scalar_type()) << " elements";
  return s.str();
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

}  // namespace

CommWork::CommWork(c10::intrusive_ptr<c10d::Work> work, std::string what, int rank,
                   std::chrono::milliseconds timeout)
    : work_(std::move(work)), what_(std::move(what)), rank_(rank), timeout_(timeout) {}

CommWork::CommWork(CommWork&& o) noexcept { *this = std::move(o); }

CommWork& CommWork::operator=(CommWork&& o) noexcept {
  if (this != &o) {
    if (work_) {
      try {
        wait();
      } catch (const std::exception& e) {
        log::error(e.what());
      }
    }
    work_ = std::move(o.work_);
    what_ = std::move(o.what_);
    rank_ = o.rank_;
    timeout_ = o.timeout_;
  }
  return *this;
}

CommWork::~CommWork() {
  if (!work_) return;
  try {
    wait();
  } catch (const std::exception& e) {
    log::error(e.what());
  }
}

void CommWork::abandon() {
  // Kept alive for good: destroying a c10d work that never completes would block.
  if (work_) new c10::intrusive_ptr<c10d::Work>(std::move(work_));
  work_.reset();
}

void CommWork::wait() {
  if (!work_) return;
  auto work = std::move(work_);
  work_.reset();
  try {
    work->wait();
  } catch (const std::exception& e) {
    std::ostringstream m;
    m << what_ << " failed on rank " << rank_ << " (collective timeout "
      << timeout_.count() / 1000 << " s, ZERO_COMM_TIMEOUT_S): " << e.what()
      << "\n  another rank probably exited or hung; its own log names the cause";
    throw CommunicationError(m.str());
  }
}

Comm::Comm(DistEnv env, c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Backend> backend,
           at::Device device)
    : env_(std::move(env)), store_(std::move(store)), backend_(std::move(backend)), device_(device) {}

Comm::~Comm() = default;

std::unique_ptr<Comm> Comm::connect(const DistEnv& env, at::Device device) {
  c10::intrusive_ptr<c10d::Store> store;
  try {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(env.master_port);
    opts.isServer = env.rank == 0 && !env.agent_store;
    opts.numWorkers = static_cast<size_t>(env.world_size);
    opts.waitWorkers = true;
    opts.timeout = env.timeout;
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
  } catch (const std::exception& e) {
    throw CommunicationError("rendezvous at " + env.master_addr + ":" + std::to_string(env.master_port) +
                             " failed on rank " + std::to_string(env.rank) + " of " +
                             std::to_string(env.world_size) + " (" + env.launcher +
                             " environment): " + e.what());
  }
  return join(store, env, device);
}

std::unique_ptr<Comm> Comm::join(c10::intrusive_ptr<c10d::Store> store, const DistEnv& env, at::Device device) {
  auto backend_store = c10::make_intrusive<c10d::PrefixStore>("zero/pg", store);
  c10::intrusive_ptr<c10d::Backend> backend;
  const bool loopback = is_loopback(env.master_addr);
  const bool nccl = device.is_cuda() && env.backend != "gloo";
  if (env.backend == "nccl" && !device.is_cuda()) {
    throw ConfigError({"ZERO_DIST_BACKEND=nccl: NCCL communicates CUDA tensors, but this rank trains on " +
                       device.str() + "; use gloo or auto"});
  }
  try {
    if (nccl) {
#ifdef USE_C10D_NCCL
      auto opts = c10d::ProcessGroupNCCL::Options::create();
      opts->timeout = env.timeout;
      backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(backend_store, env.rank, env.world_size, opts);
#else
      throw UnsupportedError("this LibTorch has no NCCL; CUDA tensors cannot be communicated");
#endif
    } else {
      backend = make_gloo(backend_store, env, loopback);
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw CommunicationError(std::string("creating the ") + (nccl ? "NCCL" : "Gloo") +
                             " process group failed on rank " + std::to_string(env.rank) + ": " + e.what());
  }
  return std::unique_ptr<Comm>(new Comm(env, store, backend, device));
}

// A Gloo group over `store` (CPU tensors), on loopback when the job is local.
c10::intrusive_ptr<c10d::Backend> Comm::make_gloo(const c10::intrusive_ptr<c10d::Store>& store, const DistEnv& env,
                                                  bool loopback) {
  auto opts = c10d::ProcessGroupGloo::Options::create(env.timeout);
  opts->devices.push_back(loopback ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                   : c10d::ProcessGroupGloo::createDefaultDevice());
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, env.rank, env.world_size, opts);
}

std::vector<int64_t> Comm::exchange(int64_t value, const std::string& what) {
  Exchange e = start_exchange(value, what);
  return finish(e);
}

std::vector<int64_t> Comm::finish(Exchange& e) {
  e.work.wait();
  return std::vector<int64_t>(e.out.data_ptr<int64_t>(), e.out.data_ptr<int64_t>() + e.out.numel());
}

Comm::Exchange Comm::start_exchange(int64_t value, const std::string& what) {
  if (!control_) {
    // Made on first use, at the same point on every rank: its own connections,
    // so these small messages never queue behind the data collectives.
    try {
      control_ = make_gloo(c10::make_intrusive<c10d::PrefixStore>("zero/control", store_), env_,
                           is_loopback(env_.master_addr));
    } catch (const std::exception& e) {
      throw CommunicationError("creating the control group failed on rank " + std::to_string(env_.rank) + ": " +
                               e.what());
    }
  }
  at::Tensor in = at::full({1}, value, at::kLong);
  Exchange e;
  e.out = at::empty({env_.world_size}, at::kLong);
  e.work = CommWork(control_->_allgather_base(e.out, in), what, env_.rank, env_.timeout);
  return e;
}

CommWork Comm::wrap(c10::intrusive_ptr<c10d::Work> work, const std::string& op, const at::Tensor& t) {
  return CommWork(std::move(work), describe(op, t), env_.rank, env_.timeout);
}

CommWork Comm::all_reduce_sum(at::Tensor& tensor) {
  std::vector<at::Tensor> ts{tensor};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::SUM;
  return wrap(backend_->allreduce(ts, o), "all_reduce", tensor);
}

CommWork Comm::all_reduce_max(at::Tensor& tensor) {
  std::vector<at::Tensor> ts{tensor};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  return wrap(backend_->allreduce(ts, o), "all_reduce(max)", tensor);
}

CommWork Comm::reduce_scatter_sum(at::Tensor& output, const at::Tensor& input) {
  ZERO_CHECK(input.numel() == output.numel() * env_.world_size, "reduce_scatter sizes");
  at::Tensor in = input;
  c10d::ReduceScatterOptions o;
  o.reduceOp = c10d::ReduceOp::SUM;
  return wrap(backend_->_reduce_scatter_base(output, in, o), "reduce_scatter", input);
}

CommWork Comm::all_gather(at::Tensor& output, const at::Tensor& input) {
  ZERO_CHECK(output.numel() == input.numel() * env_.world_size, "all_gather sizes");
  at::Tensor in = input;
  return wrap(backend_->_allgather_base(output, in), "all_gather", output);
}

CommWork Comm::broadcast(at::Tensor& tensor, int root) {
  std::vector<at::Tensor> ts{tensor};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  return wrap(backend_->broadcast(ts, o), "broadcast", tensor);
}

void Comm::barrier() {
  auto t = at::zeros({1}, at::TensorOptions().device(device_));  // NCCL takes CUDA tensors only
  all_reduce_sum(t).wait();
}

void Comm::check_same(const std::string& what, const std::string& value) {
  const std::string prefix = "zero/check/" + std::to_string(check_counter_++) + "/";
  store_->set(prefix + std::to_string(env_.rank), std::vector<uint8_t>(value.begin(), value.end()));
  std::vector<int> differ;
  std::string first;
  for (int r = 0; r < env_.world_size; ++r) {
    std::vector<uint8_t> v;
    try {
      v = store_->get(prefix + std::to_string(r));
    } catch (const std::exception& e) {
      throw CommunicationError("checking that all ranks hold the same " + what + ": rank " +
                               std::to_string(r) + " did not answer within " +
                               std::to_string(env_.timeout.count() / 1000) + " s: " + e.what());
    }
    std::string s(v.begin(), v.end());
    if (r == 0) first = s;
    else if (s != first) differ.push_back(r);
  }
  if (!differ.empty()) {
    std::ostringstream m;
    m << "ranks disagree on the " << what << ": rank";
    if (differ.size() > 1) m << "s";
    for (size_t i = 0; i < differ.size(); ++i) m << (i ? ", " : " ") << differ[i];
    m << " differ from rank 0 (every rank must be started with the same " << what << ")";
    throw ConfigError({m.str()});
  }
}

}  // namespace zero
