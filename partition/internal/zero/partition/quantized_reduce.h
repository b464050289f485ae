// qgZ: ZeRO++'s quantized gradient reduce-scatter (zero_quantized_gradients).
//
// NOTE [quantized gradients]
// The ranks are M nodes of L consecutive ranks (DistEnv::local_world_size);
// rank r = m L + l. A bucket of P = M L chunks (chunk j belongs to rank j) is
// reduced in two hops, each an all-to-all of block-quantized int8 payloads
// (NOTE [quantized gather]'s codes and scales) summed in fp32 on arrival:
//   1. within the node: to each local rank l' the M chunks of the ranks
//      m' L + l' (one payload); rank l sums the L payloads it receives into
//      the partial sums of the M chunks of its own local index;
//   2. across the nodes, among the M ranks of local index l: the partial sum
//      of chunk m' L + l goes to node m'; the M payloads received sum to this
//      rank's chunk, over all P ranks.
// Only the second hop crosses nodes, and it sends one int8 chunk a node
// instead of a ring's fp32 traffic: about a quarter of an fp32 reduction's
// bytes across nodes. Each hop's error is its quantization's, max|x| / 254
// of each block, of the values it sent; the sums are fp32. One node (M = 1)
// skips the second hop, one rank a node (L = 1) the first. The bytes are
// those of the all-to-alls (Comm::all_to_all), counted as each rank sends.
// The bucket is quantized from, and the sum written in, the gradient
// accumulation dtype: communication_data_type does not apply (the wire is
// int8), nor does reduce_scatter false.
#pragma once

#include <cstdint>
#include <memory>

#include <ATen/core/Tensor.h>

#include "zero/core/comm.h"

namespace zero::partition {

class QuantizedReduceScatter {
 public:
  /// Makes the node's and the cross-node groups of `world` (every rank, at
  /// the same point). Throws ConfigError when the ranks a node do not divide
  /// the world.
  QuantizedReduceScatter(Comm& world, int64_t block);
  /// Bytes of the first hop's payloads, sent and received, for a bucket of
  /// `numel` elements (what the ledger counts while it is in flight).
  int64_t payload_bytes(int64_t numel) const;
  /// A reduction between its two hops.
  struct Pending {
    CommWork work;  // the first hop, in flight
    at::Tensor sent, received;
    int64_t chunk = 0;
  };
  /// Starts the first hop of reducing `input` (world_size chunks; fp32,
  /// bf16 or fp16). Several may be in flight; they finish in start's order.
  Pending start(const at::Tensor& input);
  /// After the pending work has ended: the second hop, and this rank's
  /// reduced chunk into `out` (input.numel() / world_size elements).
  void finish(Pending& pending, at::Tensor& out);

 private:
  Comm& world_;
  int64_t block_;
  int64_t nodes_ = 1, per_node_ = 1;  // M, L
  std::unique_ptr<Comm> node_, cross_;
};

}  // namespace zero::partition
