// NOTE [quantized gradients] in quantized_reduce.h.
#include "zero/partition/quantized_reduce.h"

#include <numeric>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "zero/core/error.h"
#include "zero/partition/quantized_gather.h"

namespace zero::partition {
namespace {

// `rows` (k rows of n elements) quantized row by row into k payloads.
at::Tensor encode_rows(const at::Tensor& rows, int64_t block) {
  const int64_t k = rows.size(0), n = rows.size(1), bytes = quantized_payload_bytes(n, block);
  at::Tensor out = at::empty({k * bytes}, rows.options().dtype(at::kByte));
  for (int64_t i = 0; i < k; ++i) {
    at::Tensor payload = out.narrow(0, i * bytes, bytes);
    quantize_shard(rows[i], payload, block);
  }
  return out;
}

// The sum in fp32 of k payloads of n elements, in their order.
at::Tensor sum_payloads(const at::Tensor& payloads, int64_t k, int64_t n, int64_t block) {
  const int64_t bytes = quantized_payload_bytes(n, block);
  at::Tensor sum = at::zeros({n}, payloads.options().dtype(at::kFloat));
  for (int64_t i = 0; i < k; ++i) sum.add_(decode_payload(payloads.narrow(0, i * bytes, bytes), n, block));
  return sum;
}

}  // namespace

QuantizedReduceScatter::QuantizedReduceScatter(Comm& world, int64_t block) : world_(world), block_(block) {
  const int64_t P = world.world_size();
  per_node_ = std::max(1, world.env().local_world_size);
  if (P % per_node_ != 0) {
    throw ConfigError({"zero_optimization.zero_quantized_gradients: the ranks of a node (LOCAL_WORLD_SIZE " +
                       std::to_string(per_node_) + ") must divide the world size " + std::to_string(P) +
                       " for the two hops of the reduction"});
  }
  nodes_ = P / per_node_;
  const int rank = world.rank(), L = static_cast<int>(per_node_);
  std::vector<int> node(static_cast<size_t>(L));
  std::iota(node.begin(), node.end(), rank / L * L);
  std::vector<int> cross;
  for (int m = 0; m < nodes_; ++m) cross.push_back(m * L + rank % L);
  if (per_node_ > 1) node_ = world.subgroup(node, "qgz_node");
  if (nodes_ > 1) cross_ = world.subgroup(cross, "qgz_cross");
}

int64_t QuantizedReduceScatter::payload_bytes(int64_t numel) const {
  const int64_t row = quantized_payload_bytes(numel / per_node_, block_) * per_node_;
  return node_ != nullptr ? 2 * row : row;  // one rank a node receives what it sent
}

QuantizedReduceScatter::Pending QuantizedReduceScatter::start(const at::Tensor& input) {
  const int64_t P = nodes_ * per_node_;
  ZERO_CHECK(input.numel() % P == 0, "quantized reduce-scatter: the bucket is whole chunks");
  Pending p;
  p.chunk = input.numel() / P;
  // [M, L, c] -> to local rank l' the rows [M, c] of ranks m' L + l'.
  const at::Tensor by_local = input.reshape({nodes_, per_node_, p.chunk}).transpose(0, 1).reshape({per_node_, -1});
  p.sent = encode_rows(by_local, block_);
  if (node_ == nullptr) {  // one rank a node: nothing to exchange within it
    p.received = p.sent;
    return p;
  }
  p.received = at::empty_like(p.sent);
  p.work = node_->all_to_all(p.received, p.sent);
  return p;
}

void QuantizedReduceScatter::finish(Pending& p, at::Tensor& out) {
  ZERO_CHECK(out.numel() == p.chunk, "quantized reduce-scatter: the output is one chunk");
  if (p.work.pending()) p.work.wait();
  // Hop 1's sum: the partial sums of chunks m' L + l, for every node m'.
  const at::Tensor partial = sum_payloads(p.received, per_node_, nodes_ * p.chunk, block_).view({nodes_, p.chunk});
  if (cross_ == nullptr) {
    out.copy_(partial.view({-1}));
  } else {
    const at::Tensor sent = encode_rows(partial, block_);
    at::Tensor received = at::empty_like(sent);
    cross_->all_to_all(received, sent).wait();
    out.copy_(sum_payloads(received, nodes_, p.chunk, block_));
  }
  p = Pending();
}

}  // namespace zero::partition
