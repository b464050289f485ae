// Optimizers over flat fp32 partitions.
//
// The engine never hands an optimizer per-parameter tensors: it gives one
// contiguous fp32 slice of master parameters, the matching fp32 gradient slice
// and the optimizer's state slices (allocated by the caller, so they can live
// on any tier and be counted by the memory ledger). The math follows
// DeepSpeed's FusedAdam / DeepSpeedCPUAdam (adam_w_mode, bias_correction),
// which is also LibTorch's torch::optim::Adam/AdamW; Adagrad and Lion as
// DeepSpeed's CPU versions. Stateless apart from hyper-parameters: safe to
// call on disjoint slices from several threads.
#pragma once

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "zero/config/config.h"

namespace zero::optim {

/// Per-step values that a schedule may change.
struct StepParams {
  int64_t step = 1;   // 1-based count of applied optimizer steps
  double lr = 1e-3;
  double beta1 = 0.9;   // OneCycle cycles it
  double beta2 = 0.999; // OneCycle with cycle_momentum pins it to 0.99, as DeepSpeed
  /// A parameter group's own weight decay; none: the config's.
  std::optional<double> weight_decay;
};

/// How a 16-bit master and states are rounded back (NOTE [16-bit master]).
struct Rounding {
  bool stochastic = true;
  uint64_t index = 0;  // the flat index of element 0
  int64_t step = 1;
};

class FlatOptimizer {
 public:
  /// Throws zero::ConfigError for an optimizer type this build cannot run.
  static std::unique_ptr<FlatOptimizer> create(const config::OptimizerConfig& config);
  virtual ~FlatOptimizer() = default;

  const config::OptimizerConfig& config() const { return config_; }
  /// How many state tensors (of the parameter's numel, fp32, at initial_state()) update() needs.
  virtual int num_states() const = 0;
  /// Names of the states, for checkpoints ("exp_avg", "exp_avg_sq").
  virtual std::vector<std::string> state_names() const = 0;
  /// The value state `i` starts at (Adagrad: initial_accumulator_value; else 0).
  virtual double initial_state(int i) const { return 0.0; }

  /// One state tensor: its name (checkpoints), dtype, length for a slice of
  /// n elements (n, or one per `per_block` elements, rounded up) and start
  /// value. fp32 per element unless the optimizer says otherwise (8-bit Adam:
  /// NOTE [8-bit states] in optim/src/adam_kernel.h).
  /// A `side` state holds the fp32 moments of the 8-bit blocks that stay
  /// fp32 (min_8bit_size, NOTE [8-bit states]): per_block elements for each
  /// such block of a slice, at least one block's; its length comes from the
  /// layout (StateStore), its numel_for() is that least, and a window of
  /// the slice takes it whole (state_window).
  struct StateSpec {
    std::string name;
    at::ScalarType dtype = at::kFloat;
    int64_t per_block = 0;
    double initial = 0.0;
    bool side = false;
    int64_t numel_for(int64_t n) const {
      return side ? per_block : per_block > 0 ? (n + per_block - 1) / per_block : n;
    }
    /// A side state's length for `fp32_blocks` such blocks.
    int64_t side_numel(int64_t fp32_blocks) const { return per_block * std::max<int64_t>(1, fp32_blocks); }
  };
  virtual std::vector<StateSpec> state_specs() const;
  /// Whether every state is one element per parameter, fp32 or 16-bit (its
  /// slices may then be narrowed anywhere; update() takes them widened to
  /// fp32, update_stored); false for block-wise states, whose slices
  /// are whole sub-groups and which are updated a sub-group at a time by
  /// update_runs.
  bool elementwise_states() const;
  /// Bytes of optimizer state per parameter (2 fp32 moments: 8; 8-bit: 2 and
  /// the block scales).
  double state_bytes_per_param() const;

  /// A run of elements [start, start + numel) of one update with its own
  /// step values (a parameter group's lr and weight decay).
  struct Run {
    int64_t start = 0, numel = 0;
    StepParams params;
  };
  /// One update over runs in order that cover [0, param.numel()): the same as
  /// update() on each run's slices, which is what this default does; an
  /// optimizer with block-wise states overrides it (a block may hold two runs).
  virtual void update_runs(const std::vector<Run>& runs, at::Tensor& param, const at::Tensor& grad,
                           std::vector<at::Tensor>& states, at::Tensor* low_precision_out = nullptr) const;

  /// update_runs over raw fp32 CPU arrays of n elements (element-wise states,
  /// in state_specs() order; runs relative to them) by the fused pass, no
  /// tensors made (update_stored's windows, NOTE [16-bit master]); false
  /// where this optimizer has no such pass (then nothing is changed).
  virtual bool update_fp32_arrays(const std::vector<Run>& runs, float* param, const float* grad, float* const* states,
                                  int64_t n) const {
    return false;
  }

  /// The same over a bf16 master and bf16 element-wise states, each rounded
  /// back as `rounding` says (NOTE [16-bit master]), in one pass; false where
  /// this optimizer has none (then update_stored widens to fp32 arrays).
  virtual bool update_bf16_arrays(const std::vector<Run>& runs, uint16_t* param, const float* grad,
                                  uint16_t* const* states, int64_t n, const Rounding& rounding) const {
    return false;
  }

  /// One update of `param` in place from `grad`; `states` are updated in place.
  /// All tensors are 1-D fp32 of equal numel. `low_precision_out`, when given
  /// (fp16 or bf16, same numel), receives the updated parameters cast to its
  /// dtype, exactly as Tensor::to would, in the same pass where the CPU kernel
  /// allows it.
  virtual void update(const StepParams& p, at::Tensor& param, const at::Tensor& grad,
                      std::vector<at::Tensor>& states, at::Tensor* low_precision_out = nullptr) const = 0;

 protected:
  explicit FlatOptimizer(config::OptimizerConfig config) : config_(std::move(config)) {}
  config::OptimizerConfig config_;
};

/// State `state` (a slice's, as `spec` says) for elements [a, a + len) of
/// the slice, `a` on a block boundary: an element-wise state's elements, a
/// block-wise one's blocks, a side state whole.
at::Tensor state_window(const FlatOptimizer::StateSpec& spec, const at::Tensor& state, int64_t a, int64_t len);

/// The runs' parts within elements [start, start + numel), relative to start:
/// the runs of one window or piece of an update.
std::vector<FlatOptimizer::Run> runs_within(const std::vector<FlatOptimizer::Run>& runs, int64_t start, int64_t numel);

/// Adam over 8-bit block-wise states (NOTE [8-bit states] in
/// optim/src/adam_kernel.h) as ATen operations, for states on a device (or
/// any tensors the fused CPU pass does not take): the fused pass's operations
/// in its order, no fused multiply-add, every division by a tensor (CUDA
/// turns a division by a scalar into a multiplication), the square root
/// through fp64 (ATen's CPU sqrt is not always correctly rounded), so on the CPU it
/// gives the fused pass's codes, scales and parameters bit for bit.
/// `states`: exp_avg's codes (uint8, n) and block scales (fp32,
/// ceil(n / 256)), then the same for the square root of exp_avg_sq.
void adam_8bit_aten(const std::vector<FlatOptimizer::Run>& runs, const config::OptimizerConfig& config,
                    at::Tensor& param, const at::Tensor& grad, std::vector<at::Tensor>& states, at::Tensor* low);

/// 8-bit states by value (NOTE [8-bit states]), for a checkpoint saved at
/// another layout: dequantize_8bit gives element i of a moment whose block
/// of `block_of(i)` has scale absmax[block_of(i)]: code(i) * scale / 448;
/// quantize_8bit codes n values in blocks of 256 from values[0], as the
/// step does (a scale too small to invert is zero).
float dequantize_8bit(uint8_t code, float absmax);
void quantize_8bit(const float* values, int64_t n, uint8_t* codes, float* absmax);

/// min_8bit_size (NOTE [8-bit states]): marks blocks `fp32_blocks` (in
/// order, of a slice's 8-bit Adam states: codes and scales of both
/// moments, then the two side states) as kept in fp32: block fp32_blocks[j]'s
/// scales become -(1 + j), its moments are elements [256 j, 256 j + 256) of
/// the side states, and its codes are zero. Values are untouched.
void mark_fp32_blocks(const std::vector<int64_t>& fp32_blocks, std::vector<at::Tensor>& states);

/// A slice's 8-bit Adam states from values (a checkpoint of another layout
/// or precision): exp_avg `m`, exp_avg_sq `v` and its square root `s` (the
/// kernel's, correctly rounded), n elements; the marked blocks keep m and v
/// in the side states, the others are quantized from m and s.
void store_8bit(const float* m, const float* s, const float* v, int64_t n, const std::vector<int64_t>& fp32_blocks,
                std::vector<at::Tensor>& states);

// NOTE [16-bit master]
// DeepSpeed's low-precision master (bf16.bf16_master_weights_and_grads,
// fp16.fp16_master_weights_and_grads) and states (bf16.bf16_optimizer_states)
// are stored in 16 bits; the optimizer still computes in fp32. A step widens
// a window of the master and of the 16-bit states to fp32 (exact), runs the
// fp32 optimizer on it and rounds the new values back. On the CPU the
// windows are 32K elements in a worker's cache, so memory sees only the
// stored bytes: a bf16 master and bf16 states read and write 2 + 2 + 2
// bytes each and the fp32 gradient 4, against 12 + 4 with fp32 ones, and
// the model's 16-bit copy is the master's own bits. On a device, windows of
// 1M elements as ATen operations.
// Rounding back to nearest loses every update below half a step of the
// value's 16-bit grid: a bf16 weight of 1.0 ignores any lr * update under
// 2^-9, so at small learning rates training stalls. Stochastic rounding (on
// by default; bf16.stochastic_rounding / fp16.stochastic_rounding false
// rounds to nearest, as DeepSpeed) rounds up with probability equal to the
// fraction of a step: unbiased, so small updates add up on average. Its
// random word for element i of a tensor is a hash of (i's index in the flat
// layout, the step, which tensor), the same on every path, thread count and
// ISA: a run is reproducible. bf16 keeps the top 16 bits of x's pattern
// after adding 16 random bits; fp16 does the same at its own step (2^-24
// below its normal range; below its smallest step, inf and NaN round to
// nearest).

/// One update as update_runs, with the master (`param`) and the element-wise
/// states in their stored dtypes: fp32, or bf16/fp16 (NOTE [16-bit master]);
/// block-wise states as the optimizer takes them (side states may be left
/// out where no block is marked fp32). `low` (the model's copy):
/// the master's bits when it has the master's dtype.
/// The gradient is fp32, or bf16/fp16 widened a window at a time inside the
/// pass (NOTE [16-bit gradients] in partition/), and multiplied by
/// `grad_mul` there when it is not 1: the bits of
/// grad.to(kFloat).mul_(grad_mul) without a pass over memory for either;
/// `grad` itself is left as it is.
void update_stored(const FlatOptimizer& opt, const std::vector<FlatOptimizer::Run>& runs, at::Tensor& param,
                   const at::Tensor& grad, std::vector<at::Tensor>& states, at::Tensor* low, const Rounding& rounding,
                   float grad_mul = 1.0f);

/// fp32 `x` rounded to `dtype` (bf16 or fp16) as a step rounds tensor
/// `stream` (0 the master, 1 + i state i); `aten`: by ATen operations even
/// on the CPU (the device path), which gives the same bits.
at::Tensor round_to(const at::Tensor& x, at::ScalarType dtype, const Rounding& r, uint32_t stream = 0, bool aten = false);

/// The instruction set of the fused CPU Adam kernel on this machine:
/// "avx512", "avx2" or "scalar" (chosen at run time from the CPU's features).
const char* cpu_adam_isa();

/// Σ x² over n floats with every square and sum in fp64, in fixed blocks
/// added in order: the same bits on any number of threads and any of the
/// kernel's instruction sets (`isa`: 0 the best this CPU runs, else 1
/// scalar, 2 AVX2, 3 AVX-512), off from the exact sum by far less than
/// fp32's resolution (NOTE [gradient norm] in partition/).
double sum_of_squares_fp64(const float* x, int64_t n, int isa = 0);
/// The same over n bf16 (`bf16`) or fp16 values, widened a block at a time:
/// the bits sum_of_squares_fp64 gives for their fp32 copy.
double sum_of_squares_fp64(const uint16_t* x, int64_t n, bool bf16);

/// One stream-triad pass, a = b + scalar * c over n floats, split across
/// oneTBB's workers and compiled as the CPU Adam kernel is: the reference for
/// how fast a streaming loop can touch memory on this machine.
void stream_triad(float* a, const float* b, const float* c, float scalar, int64_t n);

/// A pass with Adam's memory traffic and next to no arithmetic: in one loop,
/// p += s*g, m += s*g, v += s*g (four arrays read, three written back, 28
/// bytes per element, no write-allocate), split and compiled as the Adam
/// kernel is. On a machine with few cores per memory channel a two-array pass
/// cannot reach what four concurrent streams reach, so this, not the triad,
/// is the roof Adam is measured against.
void stream_adam_pattern(float* p, const float* g, float* m, float* v, float scalar, int64_t n);

}  // namespace zero::optim
