// The collectives zero uses, over c10d: a TCPStore for rendezvous, and
// ProcessGroupGloo for CPU tensors or ProcessGroupNCCL for CUDA tensors. The
// rest of the code uses only this interface; nothing here is hand-written
// communication.
//
// Every operation is asynchronous and returns a CommWork; wait() on it
// rethrows a failure (a peer that died, a timeout) as zero::CommunicationError
// naming the collective, the tensor size, this rank and the timeout. Calls
// must be made in the same order on every rank (collectives match by order).
// A Comm is used from one thread at a time; its works may complete on
// background threads.
#pragma once

#include <chrono>
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "zero/core/dist_env.h"

namespace c10d {
class Backend;
class Store;
class Work;
}  // namespace c10d

namespace zero {

namespace detail {
class Liveness;  // NOTE [liveness] in comm.cpp
}

/// A collective in flight. Move-only; destroying an unwaited work waits for it
/// (errors are then logged, not thrown). Once a collective of its Comm has
/// failed, a work not yet complete is given up instead of waited for
/// (NOTE [failed collectives] in comm.cpp).
class CommWork {
 public:
  CommWork() = default;
  CommWork(c10::intrusive_ptr<c10d::Work> work, std::string what, int rank,
           std::chrono::milliseconds timeout, std::shared_ptr<const detail::Liveness> live = nullptr,
           std::shared_ptr<std::atomic<bool>> comm_failed = nullptr);
  CommWork(CommWork&&) noexcept;
  CommWork& operator=(CommWork&&) noexcept;
  ~CommWork();

  /// Blocks until done; throws zero::CommunicationError on failure or timeout,
  /// naming the ranks whose heartbeat stopped when there are any.
  void wait();
  bool pending() const { return static_cast<bool>(work_); }
  /// Gives up on the collective without waiting (after an error that makes
  /// it meaningless): it is never waited for, also not on destruction.
  void abandon();

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::string what_;
  int rank_ = 0;
  std::chrono::milliseconds timeout_{0};
  std::shared_ptr<const detail::Liveness> live_;  // names the ranks that stopped answering
  std::shared_ptr<std::atomic<bool>> comm_failed_;  // set by the first collective of the Comm that fails
};

/// Bytes a rank's data collectives sent, by whether the receiving rank is on
/// the sender's node (NOTE [bytes across nodes] in comm.cpp).
struct CommBytes {
  int64_t within_node = 0;
  int64_t across_nodes = 0;
};
inline CommBytes operator-(CommBytes a, CommBytes b) {
  return {a.within_node - b.within_node, a.across_nodes - b.across_nodes};
}
inline CommBytes operator+(CommBytes a, CommBytes b) {
  return {a.within_node + b.within_node, a.across_nodes + b.across_nodes};
}

class Comm {
 public:
  /// Joins the job described by `env`: TCPStore at master_addr:master_port
  /// (rank 0 serves it), then the backend for `device` (Gloo for CPU, NCCL for
  /// CUDA). Throws zero::CommunicationError when the rendezvous fails or times out.
  static std::unique_ptr<Comm> connect(const DistEnv& env, at::Device device);
  /// The same over a store already made: several ranks as threads of one
  /// process can share a c10d::HashStore (in-process tests). Throws
  /// zero::CommunicationError, zero::ConfigError (NCCL without a CUDA device).
  static std::unique_ptr<Comm> join(c10::intrusive_ptr<c10d::Store> store, const DistEnv& env, at::Device device);
  /// After a failed collective a Gloo backend is not destroyed but let go
  /// (NOTE [failed collectives]): its threads and sockets stay until the
  /// process exits, which a failed run is about to do.
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  /// The device whose tensors the data collectives take (connect's).
  at::Device device() const { return device_; }
  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }
  const DistEnv& env() const { return env_; }
  /// This rank's node (DistEnv::node), and those of the ranks after and
  /// before it, whom a ring sends to (NOTE [bytes across nodes]).
  int node() const { return env_.node; }
  int next_node() const { return next_node_; }
  int previous_node() const { return previous_node_; }
  /// What this rank's data collectives sent since the Comm was made.
  CommBytes bytes_sent() const {
    return {counts_->within.load(std::memory_order_relaxed), counts_->across.load(std::memory_order_relaxed)};
  }

  /// In-place sum over ranks.
  CommWork all_reduce_sum(at::Tensor& tensor);
  /// In-place max over ranks.
  CommWork all_reduce_max(at::Tensor& tensor);
  /// input: world_size * output.numel() elements; rank r receives the sum of
  /// every rank's r-th chunk in `output`.
  CommWork reduce_scatter_sum(at::Tensor& output, const at::Tensor& input);
  /// Whether reduce_scatter_sum makes a whole copy of its input (Gloo's does:
  /// it all-reduces a clone and keeps a chunk). Where it does, a caller whose
  /// input is scratch all-reduces it in place instead: the same sums, the
  /// same traffic, one bucket less in memory.
  bool reduce_scatter_copies_input() const;
  /// output: world_size * input.numel() elements, rank r's input at chunk r.
  CommWork all_gather(at::Tensor& output, const at::Tensor& input);
  /// input and output: world_size equal chunks; input's chunk r goes to
  /// rank r, and output's chunk r comes from rank r.
  CommWork all_to_all(at::Tensor& output, const at::Tensor& input);
  CommWork broadcast(at::Tensor& tensor, int root);
  void barrier();
  /// Every rank's `value`, by rank, through a separate small-message group
  /// that data collectives in flight do not delay. Blocking. `what` names the
  /// exchange in timeout errors.
  std::vector<int64_t> exchange(int64_t value, const std::string& what);
  /// The same, started now and finished later; exchanges pair up in the order
  /// they are started.
  struct Exchange {
    CommWork work;
    at::Tensor out;
  };
  Exchange start_exchange(int64_t value, const std::string& what);
  std::vector<int64_t> finish(Exchange& exchange);

  /// A Comm over some of this one's ranks: `ranks` holds this rank, in
  /// increasing order. Every rank calls it at the same point, each with the
  /// ranks of its own group, the groups a partition of the world (a node's
  /// ranks, a MiCS shard group); `name` tells the partitions apart. The
  /// subgroup's ranks are positions in `ranks`; its collectives count their
  /// bytes into this Comm's (bytes_sent), and a failure of either fails both.
  /// Throws zero::CommunicationError when its backend cannot be made.
  std::unique_ptr<Comm> subgroup(const std::vector<int>& ranks, const std::string& name);

  /// Every rank's node (DistEnv::node), by this Comm's ranks: read from the
  /// store the first time (an all-to-all, which sends to every rank, or a
  /// caller forming groups by node), then kept. Throws
  /// zero::CommunicationError when the store cannot be read.
  const std::vector<int>& nodes();

  /// Fails on every rank, with a message naming `what` and the ranks that
  /// differ, unless all ranks pass the same `value` (compared through the
  /// store: keep it short, e.g. a hash). `detail`, when given, is the text the
  /// value stands for, one item per line (a model's parameters): only when
  /// ranks differ do rank 0 and the first differing rank publish it, and the
  /// message gives the first line where they part.
  void check_same(const std::string& what, const std::string& value, const std::string& detail = {});

 private:
  Comm(DistEnv env, c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Backend> backend,
       at::Device device);
  CommWork wrap(c10::intrusive_ptr<c10d::Work> work, const std::string& op, const at::Tensor& t);
  /// Counts `bytes` sent to a rank on `node` (NOTE [bytes across nodes]).
  void count_sent(int64_t bytes, int node);
  static std::unique_ptr<Comm> make(c10::intrusive_ptr<c10d::Store> store, const DistEnv& env, at::Device device);
  static c10::intrusive_ptr<c10d::Backend> make_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                        const DistEnv& env, at::Device device);
  static c10::intrusive_ptr<c10d::Backend> make_gloo(const c10::intrusive_ptr<c10d::Store>& store,
                                                     const DistEnv& env, bool loopback);

  DistEnv env_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  c10::intrusive_ptr<c10d::Backend> control_;  // made by exchange()
  int64_t check_counter_ = 0;
  at::Device device_;  // where the data collectives' tensors live (NCCL: CUDA)
  std::shared_ptr<detail::Liveness> live_;
  std::shared_ptr<std::atomic<bool>> failed_ = std::make_shared<std::atomic<bool>>(false);
  bool gloo_;  // the backend is Gloo (its all-reduce sends to the rank before: NOTE [bytes across nodes])
  int next_node_ = 0, previous_node_ = 0;
  std::vector<int> nodes_;
  c10::intrusive_ptr<c10d::Store> world_store_;  // where make() published the nodes
  std::vector<int> world_ranks_;                 // a subgroup's ranks in the world (empty: the world)
  struct Counts {
    std::atomic<int64_t> within{0}, across{0};
  };
  std::shared_ptr<Counts> counts_ = std::make_shared<Counts>();  // a subgroup shares its parent's
};

}  // namespace zero
