// How device-host transfers behave where there is no GPU (NOTE [device
// streams], zero/core/streams.h, internal).
#pragma once

namespace zero {

/// How a CopyStream on the CPU carries out a device-host transfer. No effect
/// on a CUDA device, whose transfers run on a CUDA stream.
enum class CopyMode {
  kImmediate,  ///< on the CPU, a transfer is a copy done when it is issued
  kDeferred,   ///< on the CPU, a transfer waits for its event (a test seam: a missing wait then fails)
};

}  // namespace zero
