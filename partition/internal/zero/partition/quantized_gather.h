// qwZ: stage 3's all-gather of block-quantized weights (ZeRO++'s
// zero_quantized_weights).
//
// NOTE [quantized gather]
// Each rank quantizes its shard of a group (compute dtype) in blocks of
// `block` elements: a block's scale s = max|x| / 127 (fp32), its codes
// q = round(x / s) in [-127, 127] (int8), and a shard's payload is its codes,
// then its scales. The all-gather sends the payloads (uint8, one collective);
// every rank, its own shard included, decodes q * s into the gathered tensor,
// so all ranks compute with the same weights. An element is off by at most
// s / 2 = max|x| / 254 of its block, plus the rounding of q * s to the
// compute dtype. Only the gathered copy is approximate: the shards, the
// master and the update stay exact, and the error does not accumulate from
// step to step. A payload is a quarter of an fp32 shard's bytes and half a
// 16-bit one's, plus 4 bytes a block. Block: 8000 elements, DeepSpeed's
// target group size for qwZ, unless zero_optimization.
// zero_quantized_weights_block_size (zero's own key, a multiple of 4) sets
// it; a shard's last block may be short (a small layer's shard is one short
// block: its payload is not padded to the block).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace zero::partition {

inline constexpr int64_t kDefaultQuantBlock = 8000;

/// Bytes of one shard's payload: a code an element (rounded up to 4 bytes),
/// then a 4-byte scale per block.
int64_t quantized_payload_bytes(int64_t shard_numel, int64_t block);

/// Writes `shard`'s codes and scales into `payload` (uint8,
/// quantized_payload_bytes), on the shard's device.
void quantize_shard(const at::Tensor& shard, at::Tensor& payload, int64_t block);

/// One payload of `n` elements decoded, in fp32.
at::Tensor decode_payload(const at::Tensor& payload, int64_t n, int64_t block);

/// Decodes `gathered` (world_size payloads back to back) into `full`
/// (world_size shards of `full.numel() / world_size` elements).
void dequantize_gathered(const at::Tensor& gathered, at::Tensor& full, int64_t world_size, int64_t block);

}  // namespace zero::partition
