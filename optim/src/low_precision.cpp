// A 16-bit master and 16-bit optimizer states (NOTE [16-bit master] in
// flat_optimizer.h): windows widened to fp32, the fp32 optimizer, and the
// new values rounded back, stochastically or to nearest.
#include <algorithm>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Half.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include "adam_kernel.h"
#include "zero/core/error.h"
#include "zero/optim/flat_optimizer.h"

namespace zero::optim {
namespace {

constexpr uint32_t kMask16 = 0xFFFFu;

bool is_16bit(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// dst[i] = src[i] rounded to `t`, element i's random word from index + i.
void round_into(const float* src, uint16_t* dst, int64_t n, at::ScalarType t, const Rounding& r, uint32_t stream) {
  detail::round_16bit(src, dst, n, t == at::kBFloat16, r.stochastic, r.index, detail::rounding_key(r.step, stream));
}

// ---- The same with ATen operations (a device's tensors) -------------------

// Low 32 bits of a * c for 0 <= a < 2^32 in int64, without overflow.
at::Tensor mul32(const at::Tensor& a, uint32_t c) {
  const int64_t lo = c & kMask16, hi = c >> 16;
  return a.mul(lo).add(a.mul(hi).bitwise_and(kMask16).bitwise_left_shift(16)).bitwise_and(0xFFFFFFFFll);
}
at::Tensor words_aten(int64_t n, const at::TensorOptions& device, const Rounding& r, uint32_t stream) {
  const auto i64 = device.dtype(at::kLong);
  // index + i, as unsigned 64-bit: its low and high words.
  const uint64_t base = r.index;
  at::Tensor lo = at::arange(static_cast<int64_t>(base & 0xFFFFFFFFu), static_cast<int64_t>(base & 0xFFFFFFFFu) + n, i64);
  at::Tensor hi = at::full({n}, static_cast<int64_t>(base >> 32), i64).add(lo.bitwise_right_shift(32));
  lo = lo.bitwise_and(0xFFFFFFFFll);
  at::Tensor x = lo.bitwise_xor(mul32(hi.bitwise_and(0xFFFFFFFFll), 0x9E3779B1u))
                     .bitwise_xor(int64_t{detail::rounding_key(r.step, stream)});
  x = x.bitwise_xor(x.bitwise_right_shift(16));
  x = mul32(x, 0x7FEB352Du);
  x = x.bitwise_xor(x.bitwise_right_shift(15));
  x = mul32(x, 0x846CA68Bu);
  return x.bitwise_xor(x.bitwise_right_shift(16));
}

// A float's pattern as an int64 in [0, 2^32), and back.
at::Tensor pattern_of(const at::Tensor& x32) { return x32.view(at::kInt).to(at::kLong).bitwise_and(0xFFFFFFFFll); }
at::Tensor float_of(const at::Tensor& bits) {
  return bits.sub(bits.bitwise_right_shift(31).bitwise_left_shift(32)).to(at::kInt).view(at::kFloat);
}

// 16-bit patterns (int64 in [0, 2^16)) as a tensor of dtype t.
at::Tensor as_16bit(at::Tensor bits, at::ScalarType t) {
  bits = bits.sub(bits.bitwise_right_shift(15).bitwise_left_shift(16));  // as int16
  return bits.to(at::kShort).view(t);
}

at::Tensor round_aten(const at::Tensor& x, at::ScalarType t, const Rounding& r, uint32_t stream) {
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  const at::Tensor bits = pattern_of(x32);
  // NaN as the CPU loop makes it: quiet, its sign and top payload kept
  // (bf16), or sign | 0x7e00 (fp16), not the device's own NaN.
  const at::Tensor nan = x32.isnan();
  const at::Tensor nan_bits = t == at::kBFloat16
                                  ? as_16bit(bits.bitwise_right_shift(16).bitwise_or(0x40), t)
                                  : as_16bit(bits.bitwise_right_shift(16).bitwise_and(0x8000).bitwise_or(0x7e00), t);
  if (!r.stochastic) return at::where(nan, nan_bits, x32.to(t));
  const at::Tensor w = words_aten(x32.numel(), x32.options(), r, stream);
  if (t == at::kBFloat16) {
    const at::Tensor top = bits.add(w.bitwise_and(kMask16)).bitwise_right_shift(16).bitwise_and(kMask16);
    return at::where(nan, nan_bits, as_16bit(top, t));
  }
  const at::Tensor e = bits.bitwise_right_shift(23).bitwise_and(0xFF);
  const at::Tensor k = at::where(e.ge(113), at::full_like(e, 13), e.neg().add(126).clamp(13, 23));
  const at::Tensor drop = at::ones_like(e).bitwise_left_shift(k).sub(1);
  const at::Tensor kept = bits.add(w.bitwise_and(drop)).bitwise_and(drop.bitwise_not()).bitwise_and(0xFFFFFFFFll);
  const at::Tensor sr = float_of(kept).to(at::kHalf);
  return at::where(nan, nan_bits, at::where(e.eq(255).logical_or(e.lt(103)), x32.to(at::kHalf), sr));
}

bool cpu_contiguous(const at::Tensor& t) { return t.device().is_cpu() && t.is_contiguous(); }


}  // namespace

at::Tensor round_to(const at::Tensor& x, at::ScalarType dtype, const Rounding& r, uint32_t stream, bool aten) {
  ZERO_CHECK(is_16bit(dtype), "round_to: bf16 or fp16");
  if (aten || !cpu_contiguous(x) || x.scalar_type() != at::kFloat) return round_aten(x, dtype, r, stream);
  at::Tensor out = at::empty_like(x, x.options().dtype(dtype));
  round_into(x.data_ptr<float>(), static_cast<uint16_t*>(out.data_ptr()), x.numel(), dtype, r, stream);
  return out;
}

void update_stored(const FlatOptimizer& opt, const std::vector<FlatOptimizer::Run>& runs, at::Tensor& master,
                   const at::Tensor& grad, std::vector<at::Tensor>& states, at::Tensor* low, const Rounding& rounding,
                   float grad_mul) {
  const auto specs = opt.state_specs();
  const size_t sides = static_cast<size_t>(std::count_if(specs.begin(), specs.end(), [](const auto& s) { return s.side; }));
  ZERO_CHECK(states.size() == specs.size() || states.size() + sides == specs.size(),
             "a tensor per optimizer state (the side states may be left out)");
  std::vector<size_t> narrow;  // the 16-bit element-wise states
  for (size_t i = 0; i < states.size(); ++i)
    if (is_16bit(states[i].scalar_type())) {
      ZERO_CHECK(specs[i].per_block == 0, "a 16-bit state is one element per parameter");
      narrow.push_back(i);
    }
  const at::ScalarType mt = master.scalar_type();
  const bool grad16 = is_16bit(grad.scalar_type());
  if (mt == at::kFloat && narrow.empty() && !grad16 && grad_mul == 1.0f) {
    opt.update_runs(runs, master, grad, states, low);
    return;
  }
  ZERO_CHECK(mt == at::kFloat || is_16bit(mt), "the master is fp32, bf16 or fp16");
  const int64_t n = master.numel();
  // The model's copy is the master's bits when they share a dtype.
  const bool low_is_master = low != nullptr && mt != at::kFloat && low->scalar_type() == mt;
  // 16-bit gradients (a 16-bit master's, and stage 3's: NOTE [16-bit
  // gradients] in partition/) are widened a window at a time, as the master
  // is, and unscaled there: the ATen path below took 4.9x the fp32
  // offload's step on the H200 (RESULTS, round 2).
  const bool scaled = grad_mul != 1.0f;
  bool fused = cpu_contiguous(master) && cpu_contiguous(grad) && (grad.scalar_type() == at::kFloat || grad16) &&
               (low == nullptr || cpu_contiguous(*low));
  for (const auto& s : states) fused = fused && cpu_contiguous(s);
  if (fused) {
    // Windows of 32K elements (a multiple of 8-bit states' blocks) on
    // oneTBB's workers, their fp32 copies in the worker's cache: memory
    // sees the stored bytes once. The optimizer's fused pass runs on raw
    // arrays where it has one (update_fp32_arrays), else on tensors.
    constexpr int64_t kWindow = int64_t{1} << 15;
    const int64_t windows = (n + kWindow - 1) / kWindow;
    bool elementwise = true;
    for (const auto& spec : specs) elementwise = elementwise && spec.per_block == 0 && spec.dtype != at::kByte;
    const bool all_bf16 = mt == at::kBFloat16 && narrow.size() == states.size() && (low == nullptr || low_is_master) &&
                          std::all_of(states.begin(), states.end(),
                                      [](const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; });
    // A window's kernels run inline (32K elements is their grain); isolated
    // all the same, so a worker waiting inside one never picks up another
    // window, which would reuse its thread's scratch.
    auto body = [&](const tbb::blocked_range<int64_t>& range) {
      thread_local std::vector<float> scratch;
      // [master][a window per 16-bit state][the gradient, when 16-bit]
      scratch.resize(static_cast<size_t>(kWindow) * (2 + narrow.size()));
      float* const g_scratch = scratch.data() + kWindow * static_cast<int64_t>(1 + narrow.size());
      for (int64_t w = range.begin(); w < range.end(); ++w) {
        const int64_t a = w * kWindow, len = std::min(kWindow, n - a);
        Rounding r = rounding;
        r.index = rounding.index + static_cast<uint64_t>(a);
        const auto wr = runs_within(runs, a, len);
        float* g32 = grad16 || scaled ? g_scratch : grad.data_ptr<float>() + a;
        // (ATen's mul by a Scalar: in fp32, the factor rounded to fp32.)
        if (grad16 && scaled)
          detail::widen_16bit(static_cast<const uint16_t*>(grad.data_ptr()) + a, g32, len,
                              grad.scalar_type() == at::kBFloat16, grad_mul);
        else if (grad16)
          detail::widen_16bit(static_cast<const uint16_t*>(grad.data_ptr()) + a, g32, len,
                              grad.scalar_type() == at::kBFloat16);
        else if (scaled)
          detail::scale_into(grad.data_ptr<float>() + a, g32, len, grad_mul);
        const at::Tensor g_window = at::from_blob(g32, {len}, at::kFloat);
        if (all_bf16) {  // the optimizer's one-pass bf16 kernel, where it has one
          std::vector<uint16_t*> s16;
          for (auto& t : states) s16.push_back(static_cast<uint16_t*>(t.data_ptr()) + a);
          uint16_t* p16 = static_cast<uint16_t*>(master.data_ptr()) + a;
          if (opt.update_bf16_arrays(wr, p16, g32, s16.data(), len, r)) {
            if (low_is_master) std::memcpy(static_cast<uint16_t*>(low->data_ptr()) + a, p16, static_cast<size_t>(len) * 2);
            continue;
          }
        }
        float* m32 = mt == at::kFloat ? master.data_ptr<float>() + a : scratch.data();
        if (mt != at::kFloat)
          detail::widen_16bit(static_cast<const uint16_t*>(master.data_ptr()) + a, m32, len, mt == at::kBFloat16);
        // Each state's window: its fp32 copy (16-bit ones) or itself.
        std::vector<float*> s32(states.size(), nullptr);
        for (size_t j = 0; j < narrow.size(); ++j) {
          const size_t i = narrow[j];
          s32[i] = scratch.data() + kWindow * static_cast<int64_t>(1 + j);
          detail::widen_16bit(static_cast<const uint16_t*>(states[i].data_ptr()) + a, s32[i], len,
                              states[i].scalar_type() == at::kBFloat16);
        }
        at::Tensor l = low != nullptr && !low_is_master ? low->narrow(0, a, len) : at::Tensor();
        bool done = false;
        if (elementwise && !l.defined()) {
          for (size_t i = 0; i < states.size(); ++i)
            if (s32[i] == nullptr) s32[i] = states[i].data_ptr<float>() + a;
          done = opt.update_fp32_arrays(wr, m32, g32, s32.data(), len);
        }
        if (!done) {
          at::Tensor mt32 = at::from_blob(m32, {len}, at::kFloat);
          std::vector<at::Tensor> st;
          for (size_t i = 0; i < states.size(); ++i) {
            if (is_16bit(states[i].scalar_type())) st.push_back(at::from_blob(s32[i], {len}, at::kFloat));
            else st.push_back(state_window(specs[i], states[i], a, len));
          }
          opt.update_runs(wr, mt32, g_window, st, l.defined() ? &l : nullptr);
        }
        if (mt != at::kFloat) {
          uint16_t* dst = static_cast<uint16_t*>(master.data_ptr()) + a;
          round_into(m32, dst, len, mt, r, 0);
          if (low_is_master) std::memcpy(static_cast<uint16_t*>(low->data_ptr()) + a, dst, static_cast<size_t>(len) * 2);
        }
        for (size_t i : narrow)
          round_into(s32[i], static_cast<uint16_t*>(states[i].data_ptr()) + a, len, states[i].scalar_type(), r,
                     static_cast<uint32_t>(1 + i));
      }
    };
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, windows, 1), [&](const tbb::blocked_range<int64_t>& range) {
      tbb::this_task_arena::isolate([&] { body(range); });
    });
    return;
  }
  // A device's tensors: windows of 1M elements as ATen operations (the
  // rounding's int64 temporaries are some 8 bytes an element each).
  constexpr int64_t kWindow = int64_t{1} << 20;
  for (int64_t a = 0; a < n; a += kWindow) {
    const int64_t len = std::min(kWindow, n - a);
    Rounding r = rounding;
    r.index = rounding.index + static_cast<uint64_t>(a);
    at::Tensor mw = master.narrow(0, a, len);
    at::Tensor m32 = mt == at::kFloat ? mw : mw.to(at::kFloat);
    std::vector<at::Tensor> s32;
    for (size_t i = 0; i < states.size(); ++i) {
      at::Tensor sw = state_window(specs[i], states[i], a, len);
      s32.push_back(is_16bit(sw.scalar_type()) ? sw.to(at::kFloat) : sw);
    }
    at::Tensor l = low != nullptr && !low_is_master ? low->narrow(0, a, len) : at::Tensor();
    // 16-bit gradients widened first, as the CPU's windows do: every product
    // in fp32, not some in the gradient's dtype by ATen's type promotion.
    at::Tensor gw = grad.narrow(0, a, len);
    if (gw.scalar_type() != at::kFloat) gw = gw.to(at::kFloat);
    if (scaled) gw = gw.mul(grad_mul);  // out of place: `grad` stays as it is
    opt.update_runs(runs_within(runs, a, len), m32, gw, s32, l.defined() ? &l : nullptr);
    if (mt != at::kFloat) {
      mw.copy_(round_aten(m32, mt, r, 0));
      if (low_is_master) low->narrow(0, a, len).copy_(mw);
    }
    for (size_t i : narrow) states[i].narrow(0, a, len).copy_(round_aten(s32[i], states[i].scalar_type(), r, static_cast<uint32_t>(1 + i)));
  }
}

}  // namespace zero::optim
