// c10d behind zero::Comm. ProcessGroupGloo.hpp needs Gloo's headers for its
// declarations; they come from Debian's libgloo-dev. Nothing links Debian's
// libgloo: LibTorch carries its own Gloo, and this file only calls
// ProcessGroupGloo's out-of-line functions (its members are pointers and
// standard containers, so its layout does not depend on Gloo's).
#include "zero/core/comm.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <cstdlib>
#include <condition_variable>
#include <mutex>
#include <sstream>
#include <thread>

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

// NOTE [liveness]
// A collective that fails cannot say which rank is to blame: Gloo and NCCL
// only see their own side. So each rank beats: a thread adds 1 to the store
// key zero/alive/RANK every 2 s (over its own store connection with a short
// timeout, so a slow store never holds up a collective), and a rank that
// ends sets zero/exited/RANK. When a collective fails, the counters are read,
// read again 6 s (three beats) later, and the ranks whose counter did not move
// are named: a rank killed, crashed or stopped (SIGSTOP) stops beating, one
// stuck in its own code does not, and the message says which case it is.
// Counters, not times: no clocks are compared across hosts.
namespace detail {
class Liveness {
 public:
  Liveness(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size)
      : store_(std::move(store)), rank_(rank), world_size_(world_size) {
    try {
      beat();
    } catch (const std::exception&) {
      // the first beat is retried by the thread; a store that never answers leaves report() to say so
    }
    thread_ = std::thread([this] { run(); });
  }
  ~Liveness() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    try {
      store_->set("zero/exited/" + std::to_string(rank_), std::vector<uint8_t>{1});
    } catch (const std::exception&) {
      // the store is gone with rank 0: nobody is left to ask
    }
  }

  // "\n  not answering: rank 1 (...)" or a note that every rank beats. Takes
  // kStaleMs: the counters are read twice.
  std::string report() const {
    try {
      std::vector<int64_t> before(static_cast<size_t>(world_size_));
      for (int r = 0; r < world_size_; ++r) before[static_cast<size_t>(r)] = count(r);
      std::this_thread::sleep_for(std::chrono::milliseconds(kStaleMs));
      std::string silent, exited;
      for (int r = 0; r < world_size_; ++r) {
        if (r == rank_) continue;
        if (store_->check({"zero/exited/" + std::to_string(r)})) {
          exited += (exited.empty() ? "rank " : ", ") + std::to_string(r);
        } else if (count(r) == before[static_cast<size_t>(r)]) {
          silent += (silent.empty() ? "rank " : ", ") + std::to_string(r);
        }
      }
      std::string out;
      if (!silent.empty())
        out += "\n  not answering: " + silent + " (killed, crashed or stopped; its own log may name the cause)";
      if (!exited.empty()) out += "\n  ended its run: " + exited;
      if (out.empty())
        out = "\n  every other rank is alive: one of them is busy elsewhere or called the collectives in another order";
      return out;
    } catch (const std::exception&) {
      return "\n  the store does not answer either: rank 0, which serves it, is probably gone";
    }
  }

 private:
  static constexpr auto kEvery = std::chrono::seconds(2);
  static constexpr int64_t kStaleMs = 6000;  // three beats
  int64_t count(int r) const { return store_->add("zero/alive/" + std::to_string(r), 0); }
  void beat() { store_->add("zero/alive/" + std::to_string(rank_), 1); }
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, kEvery, [this] { return stop_; })) {
      lock.unlock();
      try {
        beat();
      } catch (const std::exception&) {
        return;  // the store is gone (rank 0 ended): nothing left to tell
      }
      lock.lock();
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_, world_size_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};
}  // namespace detail

// NOTE [failed collectives]
// When one collective fails on a rank (a peer died, a timeout, an allocation
// inside the backend), that rank's process group is of no further use, and
// the run is ending: its exception unwinds through destructors that own
// works still in flight. Waiting for each of them would cost a full
// collective timeout apiece while the peers, blocked on this rank, wait too;
// so after the first failure a work that has not completed is given up
// (abandoned) at once: wait() throws saying an earlier collective failed, and
// a destructor lets it go in silence. A destructor run by an exception
// (std::uncaught_exceptions) does the same whatever failed: this rank's
// main thread may have run out of memory between a collective's launch and
// its wait, and the peers may be blocked on one of this rank's that will
// never come; and since the rank is then out of step with its peers, its
// later waits are refused as after a failure. An abandoned c10d work keeps
// its tensors, so nothing it still writes is freed under it. The rank exits
// promptly, its sockets close, and its peers fail at once instead of at
// their timeout. A Gloo backend is not destroyed after a failure (its
// destructor joins worker threads that may be blocked in a collective the
// peers never join): ~Comm lets it go.
CommWork::CommWork(c10::intrusive_ptr<c10d::Work> work, std::string what, int rank,
                   std::chrono::milliseconds timeout, std::shared_ptr<const detail::Liveness> live,
                   std::shared_ptr<std::atomic<bool>> comm_failed)
    : work_(std::move(work)), what_(std::move(what)), rank_(rank), timeout_(timeout), live_(std::move(live)),
      comm_failed_(std::move(comm_failed)) {}

CommWork::CommWork(CommWork&& o) noexcept { *this = std::move(o); }

CommWork& CommWork::operator=(CommWork&& o) noexcept {
  if (this != &o) {
    if (work_) {
      try {
        wait();
      } catch (const std::exception& e) {
        log::error(error_text(e));
      }
    }
    work_ = std::move(o.work_);
    what_ = std::move(o.what_);
    rank_ = o.rank_;
    timeout_ = o.timeout_;
    live_ = std::move(o.live_);
    comm_failed_ = std::move(o.comm_failed_);
  }
  return *this;
}

CommWork::~CommWork() {
  if (!work_) return;
  // NOTE [failed collectives]: unwinding, or after a failure, nothing waits.
  if ((std::uncaught_exceptions() > 0 || (comm_failed_ && comm_failed_->load())) && !work_->isCompleted()) {
    // A collective left behind puts this rank out of step with its peers:
    // later waits are refused too, not matched against the wrong work.
    if (comm_failed_) comm_failed_->store(true);
    abandon();
    return;
  }
  try {
    wait();
  } catch (const std::exception& e) {
    log::error(error_text(e));
  }
}

void CommWork::abandon() {
  // Kept alive for good: destroying a c10d work that never completes would block.
  if (work_) new c10::intrusive_ptr<c10d::Work>(std::move(work_));
  work_.reset();
}

void CommWork::wait() {
  if (!work_) return;
  if (comm_failed_ && comm_failed_->load() && !work_->isCompleted()) {
    abandon();  // NOTE [failed collectives]
    throw CommunicationError(what_ + " on rank " + std::to_string(rank_) +
                             " given up: an earlier collective of this rank failed (its error says why)");
  }
  auto work = std::move(work_);
  work_.reset();
  try {
    work->wait();
  } catch (const std::exception& e) {
    if (comm_failed_) comm_failed_->store(true);
    // An allocation of this rank's part failed inside the backend: this rank
    // is out of memory, and its peers are not the story.
    const std::string text = error_text(e);
    if (text.find("out of memory on the") != std::string::npos)
      throw OutOfMemoryError(what_ + " on rank " + std::to_string(rank_) + ": " + text);
    std::ostringstream m;
    m << what_ << " failed on rank " << rank_ << " (collective timeout "
      << timeout_.count() / 1000 << " s, ZERO_COMM_TIMEOUT_S): " << error_text(e)
      << (live_ ? live_->report() : "\n  another rank probably exited or hung; its own log names the cause");
    throw CommunicationError(m.str());
  }
}

Comm::Comm(DistEnv env, c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Backend> backend,
           at::Device device)
    : env_(std::move(env)), store_(std::move(store)), backend_(std::move(backend)), device_(device),
      gloo_(backend_->getBackendName() == "gloo") {}

Comm::~Comm() {
  // NOTE [failed collectives]: after a failure (or a work abandoned while
  // unwinding, which counts as one) Gloo's worker threads may sit in a
  // collective no peer will match (each rank was in another one when the run
  // broke), and destroying the backend joins them: every rank would wait out
  // the collective timeout in its destructor. A failed Gloo backend is let go
  // instead: the process is ending, its sockets close at exit, and that ends
  // the peers' waits at once. An NCCL backend is destroyed as usual: its
  // teardown is NCCL's own, and no test here (one GPU at most) fails one.
  if (failed_->load()) {
    for (auto* b : {&backend_, &control_})
      if (*b && (*b)->getBackendName() == "gloo") (void)b->release();
  }
}

// NOTE [rendezvous]
// Joining the job says what it waits for. A rank that does not run the
// store's server first waits until the server's port takes connections,
// probing it itself (c10d's client would retry in silence, log a warning per
// try and then wait a second timeout); the store is made once it answers.
// Then every rank counts itself in through the store and waits until all N
// have, printing "k of N joined, waiting for ranks ..." every few seconds;
// at the timeout it fails once, naming the missing ranks. Under torchrun the
// agent's store outlives a restart of the workers, so each restart's keys go
// under their own prefix (TORCHELASTIC_RESTART_COUNT).
namespace {

constexpr auto kProgressEvery = std::chrono::seconds(5);

std::string where(const DistEnv& env) {
  return env.master_addr + ":" + std::to_string(env.master_port) + " (" + env.launcher + " environment)";
}

// Whether a TCP connection to the store's address can be made now. An
// address that does not resolve at all is an error at once.
bool server_answers(const DistEnv& env) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(env.master_addr.c_str(), std::to_string(env.master_port).c_str(), &hints, &found);
  if (rc == EAI_NONAME) {
    throw CommunicationError("rendezvous: MASTER_ADDR " + env.master_addr + " (" + env.launcher +
                             " environment) does not resolve: " + ::gai_strerror(rc));
  }
  if (rc != 0) return false;
  bool ok = false;
  for (addrinfo* a = found; a != nullptr && !ok; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    ok = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0;
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return ok;
}

std::string missing_ranks(c10d::Store& store, const std::string& prefix, int world_size) {
  std::string out;
  int shown = 0, missing = 0;
  for (int r = 0; r < world_size; ++r) {
    if (store.check({prefix + std::to_string(r)})) continue;
    ++missing;
    if (shown++ < 16) out += (out.empty() ? "" : ", ") + std::to_string(r);
  }
  if (missing > shown) out += ", ... (" + std::to_string(missing) + " in all)";
  return out;
}

}  // namespace

std::unique_ptr<Comm> Comm::connect(const DistEnv& env, at::Device device) {
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start); };
  const long long timeout_s = static_cast<long long>(env.timeout.count() / 1000);
  const bool server = env.rank == 0 && !env.agent_store;
  const std::string me = "rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size);
  if (!server) {
    auto next_note = kProgressEvery;
    while (!server_answers(env)) {
      if (elapsed() >= env.timeout) {
        throw CommunicationError("rendezvous: " + me + " found no store at " + where(env) + " within " +
                                 std::to_string(timeout_s) + " s (ZERO_COMM_TIMEOUT_S): " +
                                 (env.agent_store ? "the launcher's agent is not running"
                                                  : "rank 0 did not start, or MASTER_ADDR/MASTER_PORT differ"));
      }
      if (elapsed() >= next_note) {
        log::info(me + ": waiting for the store at " + where(env) + " (" +
                  std::to_string(elapsed().count() / 1000) + " s of " + std::to_string(timeout_s) + ")");
        next_note += kProgressEvery;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
  c10::intrusive_ptr<c10d::Store> store;
  try {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(env.master_port);
    opts.isServer = server;
    opts.numWorkers = static_cast<size_t>(env.world_size);
    opts.waitWorkers = false;  // counted below, with progress
    opts.timeout = std::max(std::chrono::milliseconds(1000), env.timeout - elapsed());
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
    store->setTimeout(env.timeout);  // the rest of the run waits the whole timeout, not what was left of it
    // torchrun's agent keeps its store across restarts: each restart's keys apart.
    if (const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT"); env.agent_store && restart != nullptr)
      store = c10::make_intrusive<c10d::PrefixStore>(std::string("zero/restart") + restart, store);
  } catch (const std::exception& e) {
    throw CommunicationError("rendezvous at " + where(env) + " failed on " + me + ": " + error_text(e) +
                             (server ? " (is another job using this port? set MASTER_PORT)" : ""));
  }
  // Count in, per generation, and wait for all.
  const int64_t ws = env.world_size;
  int64_t generation = 0;
  std::string prefix;
  try {
    const int64_t n = store->add("zero/rendezvous/count", 1);
    generation = (n - 1) / ws;
    prefix = "zero/rendezvous/" + std::to_string(generation) + "/";
    store->set(prefix + std::to_string(env.rank), std::vector<uint8_t>{1});
    auto next_note = elapsed() + kProgressEvery;
    for (;;) {
      const int64_t joined = store->add("zero/rendezvous/count", 0) - generation * ws;
      if (joined >= ws) break;
      if (elapsed() >= env.timeout) {
        throw CommunicationError("rendezvous at " + where(env) + ": " + me + " saw " + std::to_string(joined) + " of " +
                                 std::to_string(ws) + " ranks join within " + std::to_string(timeout_s) +
                                 " s (ZERO_COMM_TIMEOUT_S); missing: rank " + missing_ranks(*store, prefix, env.world_size) +
                                 " (not started, failed before joining, or started with another WORLD_SIZE or "
                                 "MASTER_PORT)");
      }
      if (elapsed() >= next_note) {
        // Rank 0 names the missing ranks (N store requests); the others give the count.
        log::info(me + ": " + std::to_string(joined) + " of " + std::to_string(ws) + " ranks joined at " + where(env) +
                  (env.rank == 0 ? ", waiting for rank " + missing_ranks(*store, prefix, env.world_size) : "") + " (" +
                  std::to_string(elapsed().count() / 1000) + " s of " + std::to_string(timeout_s) + ")");
        next_note += kProgressEvery;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw CommunicationError("rendezvous at " + where(env) + " failed on " + me + ": " + error_text(e));
  }
  auto comm = make(store, env, device);
  // The heartbeat's own connection, with a short timeout (NOTE [liveness]).
  c10::intrusive_ptr<c10d::Store> beat_store = store;
  try {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(env.master_port);
    opts.isServer = false;
    opts.waitWorkers = false;
    opts.timeout = std::chrono::milliseconds(5000);
    beat_store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
    if (const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT"); env.agent_store && restart != nullptr)
      beat_store = c10::make_intrusive<c10d::PrefixStore>(std::string("zero/restart") + restart, beat_store);
  } catch (const std::exception& e) {
    log::warning("the heartbeat's store connection failed (" + error_text(e) + "); sharing the main one");
  }
  comm->live_ = std::make_shared<detail::Liveness>(beat_store, env.rank, env.world_size);
  return comm;
}

std::unique_ptr<Comm> Comm::join(c10::intrusive_ptr<c10d::Store> store, const DistEnv& env, at::Device device) {
  auto comm = make(store, env, device);
  if (env.world_size > 1) comm->live_ = std::make_shared<detail::Liveness>(store, env.rank, env.world_size);
  return comm;
}

c10::intrusive_ptr<c10d::Backend> Comm::make_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                     const DistEnv& env, at::Device device) {
  auto backend_store = c10::make_intrusive<c10d::PrefixStore>("zero/pg", store);
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
      return c10::make_intrusive<c10d::ProcessGroupNCCL>(backend_store, env.rank, env.world_size, opts);
#else
      throw UnsupportedError("this LibTorch has no NCCL; CUDA tensors cannot be communicated");
#endif
    }
    return make_gloo(backend_store, env, is_loopback(env.master_addr));
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw CommunicationError(std::string("creating the ") + (nccl ? "NCCL" : "Gloo") +
                             " process group failed on rank " + std::to_string(env.rank) + ": " + error_text(e));
  }
}

namespace {
// World rank r's node, as make() published it (NOTE [bytes across nodes]).
int node_in_store(c10d::Store& store, int r) {
  const auto v = store.get("zero/node/" + std::to_string(r));
  return std::stoi(std::string(v.begin(), v.end()));
}
}  // namespace

std::unique_ptr<Comm> Comm::make(c10::intrusive_ptr<c10d::Store> store, const DistEnv& env, at::Device device) {
  auto backend = make_backend(store, env, device);
  std::unique_ptr<Comm> comm(new Comm(env, store, backend, device));
  if (env.world_size > 1) {
    // Each rank's node through the store: a ring's next and previous ranks
    // are the ones this rank's bytes go to (NOTE [bytes across nodes]).
    try {
      store->set("zero/node/" + std::to_string(env.rank), std::to_string(env.node));
      comm->next_node_ = node_in_store(*store, (env.rank + 1) % env.world_size);
      comm->previous_node_ = node_in_store(*store, (env.rank + env.world_size - 1) % env.world_size);
    } catch (const std::exception& e) {
      throw CommunicationError("reading the neighbouring ranks' nodes from the store failed on rank " +
                               std::to_string(env.rank) + ": " + error_text(e));
    }
  }
  return comm;
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
                               error_text(e));
    }
  }
  at::Tensor in = at::full({1}, value, at::kLong);
  Exchange e;
  e.out = at::empty({env_.world_size}, at::kLong);
  e.work = CommWork(control_->_allgather_base(e.out, in), what, env_.rank, env_.timeout, live_, failed_);
  return e;
}

// NOTE [bytes across nodes]
// Every data collective counts the bytes this rank sends, within its node
// (DistEnv::node) or to another node, as the backend's ring algorithm sends
// them: all to one neighbour in rank order. Gloo's all-reduce sends to the
// rank before (so does its reduce-scatter, an all-reduce of the input:
// reduce_scatter_copies_input), its all-gather to the rank after; NCCL's
// rings are counted as sending to the rank after. With P ranks:
//   all_gather, output N bytes:      N (P-1)/P
//   reduce_scatter, input N bytes:   N (P-1)/P; Gloo's 2 N (P-1)/P
//   all_reduce, N bytes:             2 N (P-1)/P
//   broadcast, N bytes:              N to the rank after, but for the rank
//                                    before the root (a chain from the root)
//   all_to_all, input N bytes:       N/P to each other rank, straight
// Under the launchers zero reads a node's ranks are consecutive, so a ring
// in rank order crosses between nodes once a node, whichever way it turns:
// the sums over ranks are what crosses. Which rank's bytes cross is the
// model's: NCCL orders its rings by the topology, may pick a tree for an
// all-reduce over many nodes (about the same bytes, split otherwise between
// links), and Gloo's broadcast is a tree (the same N a receiving rank, from
// other senders); ranks placed round-robin over the nodes (srun -m cyclic,
// mpirun --map-by node) cross at every link. Not counted: the control
// group's exchanges and the store's checks, a few bytes a step. The engine
// counts from the end of initialize, leaving out what loading a checkpoint
// or weights sends (Engine::Impl::comm_bytes_uncounted);
// evaluation between steps counts toward the steps. The run summary
// (rank_figures, traffic_per_step: summed over ranks) and the run report
// (this rank's) give each kind per step.
void Comm::count_sent(int64_t bytes, int node) {
  (node == env_.node ? counts_->within : counts_->across).fetch_add(bytes, std::memory_order_relaxed);
}

std::unique_ptr<Comm> Comm::subgroup(const std::vector<int>& ranks, const std::string& name) {
  const auto me = std::find(ranks.begin(), ranks.end(), env_.rank);
  ZERO_CHECK(me != ranks.end() && std::is_sorted(ranks.begin(), ranks.end()) && ranks.front() >= 0 &&
                 ranks.back() < env_.world_size,
             "a subgroup holds this rank, in increasing order");
  // The members' places in the world (this Comm may be a subgroup itself).
  std::vector<int> world(ranks);
  if (!world_ranks_.empty())
    for (int& r : world) r = world_ranks_[static_cast<size_t>(r)];
  DistEnv sub = env_;
  sub.rank = static_cast<int>(me - ranks.begin());
  sub.world_size = static_cast<int>(ranks.size());
  // Each group's keys apart: its first rank names it within the partition.
  auto store = c10::make_intrusive<c10d::PrefixStore>("zero/group/" + name + "/" + std::to_string(ranks.front()),
                                                      store_);
  std::unique_ptr<Comm> comm(new Comm(sub, store, make_backend(store, sub, device_), device_));
  comm->live_ = live_;  // names ranks by their place in the world
  comm->world_store_ = world_store_ ? world_store_ : store_;
  comm->world_ranks_ = world;
  comm->failed_ = failed_;
  comm->counts_ = counts_;
  if (sub.world_size > 1) {
    // The neighbours' nodes, which make() published for the world.
    try {
      const size_t i = static_cast<size_t>(sub.rank), n = world.size();
      comm->next_node_ = node_in_store(*comm->world_store_, world[(i + 1) % n]);
      comm->previous_node_ = node_in_store(*comm->world_store_, world[(i + n - 1) % n]);
    } catch (const std::exception& e) {
      throw CommunicationError("reading the nodes of subgroup " + name + "'s ranks from the store failed on rank " +
                               std::to_string(env_.rank) + ": " + error_text(e));
    }
  }
  return comm;
}

namespace {
// N (P-1)/P, times `rounds` (two for an all-reduce: reduce-scatter, then all-gather).
int64_t ring_bytes(int64_t n, int world, int rounds) { return world > 1 ? n * rounds * (world - 1) / world : 0; }
}  // namespace

CommWork Comm::wrap(c10::intrusive_ptr<c10d::Work> work, const std::string& op, const at::Tensor& t) {
  return CommWork(std::move(work), describe(op, t), env_.rank, env_.timeout, live_, failed_);
}

CommWork Comm::all_reduce_sum(at::Tensor& tensor) {
  std::vector<at::Tensor> ts{tensor};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::SUM;
  count_sent(ring_bytes(static_cast<int64_t>(tensor.nbytes()), env_.world_size, 2), (gloo_ ? previous_node_ : next_node_));
  return wrap(backend_->allreduce(ts, o), "all_reduce", tensor);
}

CommWork Comm::all_reduce_max(at::Tensor& tensor) {
  std::vector<at::Tensor> ts{tensor};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  count_sent(ring_bytes(static_cast<int64_t>(tensor.nbytes()), env_.world_size, 2), (gloo_ ? previous_node_ : next_node_));
  return wrap(backend_->allreduce(ts, o), "all_reduce(max)", tensor);
}

CommWork Comm::reduce_scatter_sum(at::Tensor& output, const at::Tensor& input) {
  ZERO_CHECK(input.numel() == output.numel() * env_.world_size, "reduce_scatter sizes");
  at::Tensor in = input;
  c10d::ReduceScatterOptions o;
  o.reduceOp = c10d::ReduceOp::SUM;
  count_sent(ring_bytes(static_cast<int64_t>(input.nbytes()), env_.world_size, reduce_scatter_copies_input() ? 2 : 1),
             (gloo_ ? previous_node_ : next_node_));
  return wrap(backend_->_reduce_scatter_base(output, in, o), "reduce_scatter", input);
}

bool Comm::reduce_scatter_copies_input() const { return gloo_; }

CommWork Comm::all_gather(at::Tensor& output, const at::Tensor& input) {
  ZERO_CHECK(output.numel() == input.numel() * env_.world_size, "all_gather sizes");
  at::Tensor in = input;
  count_sent(ring_bytes(static_cast<int64_t>(output.nbytes()), env_.world_size, 1), next_node_);
  return wrap(backend_->_allgather_base(output, in), "all_gather", output);
}

const std::vector<int>& Comm::nodes() {
  if (!nodes_.empty()) return nodes_;
  const auto& store = world_store_ ? world_store_ : store_;
  try {
    for (int r = 0; r < env_.world_size; ++r) {
      nodes_.push_back(node_in_store(*store, world_ranks_.empty() ? r : world_ranks_[static_cast<size_t>(r)]));
    }
  } catch (const std::exception& e) {
    nodes_.clear();
    throw CommunicationError("reading the ranks' nodes from the store failed on rank " + std::to_string(env_.rank) +
                             ": " + error_text(e));
  }
  return nodes_;
}

CommWork Comm::all_to_all(at::Tensor& output, const at::Tensor& input) {
  const int64_t world = env_.world_size;
  ZERO_CHECK(output.numel() == input.numel() && input.numel() % world == 0, "all_to_all sizes");
  // Each rank sends its chunk straight to its owner (NOTE [bytes across nodes]).
  if (world > 1) {
    const auto& node = nodes();
    const int64_t piece = static_cast<int64_t>(input.nbytes()) / world;
    for (int r = 0; r < world; ++r)
      if (r != env_.rank) count_sent(piece, node[static_cast<size_t>(r)]);
  }
  at::Tensor in = input;
  std::vector<int64_t> even;  // empty: equal splits
  return wrap(backend_->alltoall_base(output, in, even, even), "all_to_all", input);
}

CommWork Comm::broadcast(at::Tensor& tensor, int root) {
  std::vector<at::Tensor> ts{tensor};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  if (env_.world_size > 1 && (env_.rank + 1) % env_.world_size != root)
    count_sent(static_cast<int64_t>(tensor.nbytes()), next_node_);
  return wrap(backend_->broadcast(ts, o), "broadcast", tensor);
}

void Comm::barrier() {
  auto t = at::zeros({1}, at::TensorOptions().device(device_));  // NCCL takes CUDA tensors only
  all_reduce_sum(t).wait();
}

namespace {
// "K: rank 0 has \"A\", rank R has \"B\"" for the first line where a and b differ.
std::string first_difference(const std::string& a, const std::string& b, int rank) {
  std::istringstream sa(a), sb(b);
  std::string la, lb;
  for (int line = 1;; ++line) {
    const bool ha = static_cast<bool>(std::getline(sa, la)), hb = static_cast<bool>(std::getline(sb, lb));
    if (!ha && !hb) return std::to_string(line) + ": none found";
    if (ha && hb && la == lb) continue;
    auto shown = [](bool has, const std::string& l) { return has ? "\"" + l + "\"" : std::string("nothing more"); };
    return std::to_string(line) + ": rank 0 has " + shown(ha, la) + ", rank " + std::to_string(rank) + " has " +
           shown(hb, lb);
  }
}
}  // namespace

void Comm::check_same(const std::string& what, const std::string& value, const std::string& detail) {
  const std::string prefix = "zero/check/" + std::to_string(check_counter_++) + "/";
  auto get = [&](const std::string& key, int r) {
    try {
      const auto v = store_->get(key);
      return std::string(v.begin(), v.end());
    } catch (const std::exception& e) {
      throw CommunicationError("checking that all ranks hold the same " + what + ": rank " + std::to_string(r) +
                               " did not answer within " + std::to_string(env_.timeout.count() / 1000) +
                               " s: " + error_text(e));
    }
  };
  store_->set(prefix + std::to_string(env_.rank), std::vector<uint8_t>(value.begin(), value.end()));
  std::vector<int> differ;
  std::string first;
  for (int r = 0; r < env_.world_size; ++r) {
    std::string v = get(prefix + std::to_string(r), r);
    if (r == 0) first = std::move(v);
    else if (v != first) differ.push_back(r);
  }
  if (differ.empty()) return;
  std::ostringstream m;
  m << "ranks disagree on the " << what << ": rank";
  if (differ.size() > 1) m << "s";
  for (size_t i = 0; i < differ.size(); ++i) m << (i ? ", " : " ") << differ[i];
  m << (differ.size() > 1 ? " differ" : " differs") << " from rank 0 (every rank must be started with the same "
    << what << ")";
  if (!detail.empty()) {
    // Only rank 0 and the first rank that differs publish the whole text.
    const int other = differ.front();
    if (env_.rank == 0 || env_.rank == other)
      store_->set(prefix + "detail/" + std::to_string(env_.rank), std::vector<uint8_t>(detail.begin(), detail.end()));
    const std::string a = get(prefix + "detail/0", 0), b = get(prefix + "detail/" + std::to_string(other), other);
    m << "; first difference, line " << first_difference(a, b, other);
  }
  throw ConfigError({m.str()});
}

}  // namespace zero
