// NOTE [quantized gather] in quantized_gather.h.
#include "zero/partition/quantized_gather.h"

#include <algorithm>

#include <ATen/ATen.h>

#include "zero/core/error.h"

namespace zero::partition {
namespace {
int64_t blocks_of(int64_t n, int64_t block) { return (n + block - 1) / block; }
// The codes take n bytes, rounded up to 4 so that the scales after them are aligned.
int64_t codes_bytes(int64_t n) { return (n + 3) / 4 * 4; }

// A block no longer than the shard's codes: a large block size costs no
// padding (the same on every rank: the shards are of one size).
int64_t block_for(int64_t n, int64_t block) {
  ZERO_CHECK(block > 0 && block % 4 == 0, "the quantization block is a positive multiple of 4");
  return std::max<int64_t>(4, std::min(block, codes_bytes(n)));
}
}  // namespace

int64_t quantized_payload_bytes(int64_t shard_numel, int64_t block) {
  return codes_bytes(shard_numel) + blocks_of(shard_numel, block_for(shard_numel, block)) * 4;
}

void quantize_shard(const at::Tensor& shard, at::Tensor& payload, int64_t block_size) {
  const int64_t n = shard.numel(), block = block_for(n, block_size), blocks = blocks_of(n, block);
  ZERO_CHECK(payload.scalar_type() == at::kByte && payload.numel() == quantized_payload_bytes(n, block_size),
             "quantized payload size");
  at::Tensor x = at::zeros({blocks * block}, shard.options().dtype(at::kFloat));
  x.narrow(0, 0, n).copy_(shard.reshape({-1}));
  x = x.view({blocks, block});
  const at::Tensor scale = x.abs().amax(1).div_(127.0);
  // A block of zeros has scale 0: its codes are 0 (not 0/0).
  const at::Tensor divisor = at::where(scale > 0, scale, at::ones_like(scale)).unsqueeze(1);
  const at::Tensor codes = x.div(divisor).round_().clamp_(-127, 127).to(at::kChar);
  payload.narrow(0, 0, n).view(at::kChar).copy_(codes.view({-1}).narrow(0, 0, n));
  payload.narrow(0, codes_bytes(n), blocks * 4).view(at::kFloat).copy_(scale);
}

at::Tensor decode_payload(const at::Tensor& payload, int64_t n, int64_t block_size) {
  const int64_t block = block_for(n, block_size), blocks = blocks_of(n, block);
  ZERO_CHECK(payload.numel() == quantized_payload_bytes(n, block_size), "quantized payload size");
  // The short last block's codes padded with zeros, to multiply block by block.
  const at::Tensor codes = at::constant_pad_nd(payload.narrow(0, 0, n).view(at::kChar).to(at::kFloat), {0, blocks * block - n});
  const at::Tensor scales = payload.narrow(0, codes_bytes(n), blocks * 4).view(at::kFloat).unsqueeze(1);
  return codes.view({blocks, block}).mul_(scales).view({-1}).narrow(0, 0, n);
}

void dequantize_gathered(const at::Tensor& gathered, at::Tensor& full, int64_t world_size, int64_t block_size) {
  const int64_t n = full.numel() / world_size;
  const int64_t bytes = quantized_payload_bytes(n, block_size);
  ZERO_CHECK(full.numel() == n * world_size && gathered.numel() == bytes * world_size, "quantized gather sizes");
  // A rank's shard at a time: the fp32 temporaries are a shard's, not the layer's.
  for (int64_t r = 0; r < world_size; ++r)
    full.narrow(0, r * n, n).copy_(decode_payload(gathered.narrow(0, r * bytes, bytes), n, block_size));
}

}  // namespace zero::partition
