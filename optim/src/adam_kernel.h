// The fused CPU optimizer passes over fp32 arrays (internal to optim/): Adam,
// Adagrad and Lion.
// One pass per element: read param, grad, exp_avg, exp_avg_sq; write param,
// exp_avg, exp_avg_sq. Same order of operations as LibTorch's Adam/AdamW
// (see flat_adam.cpp), so results agree with torch::optim to rounding.
#pragma once

#include <cstdint>

namespace zero::optim::detail {

/// Per-step constants, computed in double and rounded to float once, as ATen
/// does with a Scalar operand.
struct AdamScalars {
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float eps;
  float weight_decay;            // L2 mode: added to the gradient as weight_decay * param
  float decay;                   // decoupled mode: param *= 1 - lr * weight_decay
  float bias_correction2_sqrt;   // sqrt(1 - beta2^step), or 1
  float neg_step_size;           // -lr / (1 - beta1^step)
  bool decoupled;
};

enum class Isa { kScalar, kAvx2, kAvx512 };

/// Optional 16-bit copy of the updated parameters, written in the same pass.
enum class LowPrecision { kNone, kFp16, kBf16 };

/// float -> fp16 / bf16 with round-to-nearest-even, as LibTorch casts.
uint16_t to_fp16(float x);
uint16_t to_bf16(float x);
/// 16-bit floats widened to fp32 (exact), and fp32 rounded back to nearest
/// even or stochastically, element i with rounding_word(index + i, key)
/// (NOTE [16-bit master] in flat_optimizer.h); vectorised, every CPU alike.
void widen_16bit(const uint16_t* src, float* dst, int64_t n, bool bf16);
/// dst[i] = src[i] widened, times `mul` in fp32; and the same from fp32
/// (a gradient unscaled in cache, NOTE [16-bit gradients] in partition/).
void widen_16bit(const uint16_t* src, float* dst, int64_t n, bool bf16, float mul);
void scale_into(const float* src, float* dst, int64_t n, float mul);
void round_16bit(const float* src, uint16_t* dst, int64_t n, bool bf16, bool stochastic, uint64_t index, uint32_t key);
/// The key of a step's tensor `stream` (0 the master, 1 + i state i), and
/// the random word of element `index` under it.
uint32_t rounding_key(int64_t step, uint32_t stream);
uint32_t rounding_word(uint64_t index, uint32_t key);

/// Adam (adam_fused_fp32's operations) over a bf16 master and bf16 moments
/// in one pass, each rounded back as round_16bit would with streams 0, 1
/// and 2 of `step`, element i at index + i. Not split across threads.
void adam_fused_bf16(uint16_t* p, const float* g, uint16_t* m, uint16_t* v, int64_t n, const AdamScalars& s,
                     bool stochastic, uint64_t index, int64_t step);

/// low[i] = p[i] in `type` (fp16 or bf16), as above.
void write_low(const float* p, uint16_t* low, int64_t n, LowPrecision type);

/// The widest kernel this CPU runs (AVX-512F, else AVX2, else scalar), chosen
/// once from the CPU's features.
Isa best_isa();
const char* to_string(Isa isa);

/// Splits [0, n) across oneTBB's workers; each runs the fused loop of `isa`
/// (default: best_isa()). Every ISA computes the same operations in the same
/// order (multiply, then add: no FMA), so all give bit-identical results.
void adam_fused_fp32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                     const AdamScalars& s, Isa isa = best_isa(), uint16_t* low = nullptr,
                     LowPrecision low_type = LowPrecision::kNone);

/// Adagrad (torch::optim::Adagrad without lr_decay):
///   g += weight_decay * p (when has_weight_decay); sum += g * g;
///   p += neg_lr * g / (sqrt(sum) + eps)
struct AdagradScalars {
  float weight_decay;
  bool has_weight_decay;
  float eps;
  float neg_lr;
};

/// Lion, as DeepSpeed's CPU Lion:
///   p *= decay (when has_decay); p += neg_lr * sign(m * beta1 + (1 - beta1) * g);
///   m = m * beta2 + (1 - beta2) * g
struct LionScalars {
  float decay;
  bool has_decay;
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float neg_lr;
};

/// The same structure as adam_fused_fp32: one pass, the ISA's kernel with a
/// scalar tail, oneTBB across cores, the optional 16-bit copy in the same pass;
/// each ISA bit-identical to the scalar loop, which matches the ATen
/// operations to rounding (ATen's vector kernels fuse multiply-adds).
void adagrad_fused_fp32(float* param, const float* grad, float* sum, int64_t n, const AdagradScalars& s,
                        Isa isa = best_isa(), uint16_t* low = nullptr, LowPrecision low_type = LowPrecision::kNone);
void lion_fused_fp32(float* param, const float* grad, float* exp_avg, int64_t n, const LionScalars& s,
                     Isa isa = best_isa(), uint16_t* low = nullptr, LowPrecision low_type = LowPrecision::kNone);

}  // namespace zero::optim::detail

namespace zero::optim::detail {

// NOTE [8-bit states]
// Adam's two moments in 8 bits a parameter, block-wise as bitsandbytes' and
// torchao's 8-bit Adam: each block of kQuantBlock elements keeps one fp32
// scale (the block's largest magnitude) and one byte per element, a
// non-linear code: OCP fp8 E4M3 ("e4m3fn", torch.float8_e4m3fn) of the value
// over the scale times 448 (E4M3's largest), round to nearest even. E4M3
// spans 2^-9..448 with three significand bits, ~6% at worst, far finer
// near the top; the first moment is coded signed, the second moment as its
// square root (non-negative), whose range in a block is half as many
// binades, so that small v are not flushed to zero (a zero v under a
// non-zero m is the large step to avoid). Each block is dequantized,
// updated with the fp32 kernel's operations in its order (but for sqrt(v)
// times 1 / sqrt(bias_correction2), one division fewer: the divider bounds
// this loop), then requantized against its new largest magnitude: a decay
// that every element of a block shares moves the scale, not the codes.
// Blocks of a thread's range are finished one at a time in L1, so memory
// sees one pass: param 4+4, grad 4, two codes 1+1 read and written, scales
// 2 x (4+4)/256 bytes, 16.06 bytes a parameter against fp32 states' 28.
// Every path gives the same codes, scales and parameters for finite values.
// A NaN lane is skipped by the block maxima (and codes as E4M3's NaN, 0x7f
// with its sign); a scale whose inverse 448 / scale is not finite (a block
// below about 1.3e-36, whose gradients stopped long ago) becomes zero,
// codes and all.
// Small tensors keep fp32 moments, as bitsandbytes' min_8bit_size (default
// 4096 elements; optimizer.params.min_8bit_size, 0: none): in a flat
// partition their elements share blocks with their neighbours', so every
// block that holds an element of a parameter with fewer elements stays
// fp32 (biases and norms, with the few elements of larger tensors in the
// same blocks). The store finds these blocks from the layout and marks
// them in the states themselves: block j of a slice's fp32 blocks has
// scale -(1 + j) (a true scale is never negative) and its moments at
// [256 j, 256 j + 256) of two fp32 side states, laid out sub-group by
// sub-group as the scales are. The step takes the stretches of 8-bit blocks
// to this kernel and the fp32 ones to fp32 Adam (on a device it reads the
// piece's scales back to find them: a small copy per piece, and only in
// sub-groups with fp32 blocks, the others get no side states); every tier
// and checkpoint carries the marks with the scales.
// Arithmetic, not memory, bounds it where cores are few per memory channel:
// the sqrt and the division keep the divider as busy as in fp32 Adam, and
// decoding, two maxima and encoding come on top. The vector paths keep
// that extra small: a code decodes through the F16C conversion (three
// integer operations and a widening, no branch), a block's maxima reduce
// in registers, and the encoder runs without branches, blended under
// masks (AVX2 packs four vectors of codes at a time). `zero bench adam`
// reports both kernels side by side.
constexpr int64_t kQuantBlock = 256;

/// E4M3 (fn) byte <-> float, as c10's Float8_e4m3fn conversions (round to
/// nearest even; |x| >= 480 gives the NaN code 0x7f with x's sign).
uint8_t to_e4m3(float x);
float from_e4m3(uint8_t code);

/// The quantized state of one moment: codes[n], absmax[ceil(n / kQuantBlock)].
struct Quantized8 {
  uint8_t* codes;
  float* absmax;
};

/// A run of elements [start, start + numel) updated with one set of scalars
/// (one parameter group); runs are in order and cover [0, n).
struct AdamRun {
  int64_t start, numel;
  AdamScalars s;
};

/// One Adam step over 8-bit states (NOTE [8-bit states]): blocks are
/// kQuantBlock elements from element 0; runs may split a block (its elements
/// then use their own run's scalars and share the block's scale). oneTBB
/// across cores by whole blocks; every ISA bit-identical to the scalar loop.
void adam_fused_8bit(float* param, const float* grad, Quantized8 exp_avg, Quantized8 exp_avg_sq_sqrt, int64_t n,
                     const AdamRun* runs, int64_t n_runs, Isa isa = best_isa(), uint16_t* low = nullptr,
                     LowPrecision low_type = LowPrecision::kNone);

}  // namespace zero::optim::detail
