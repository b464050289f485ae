// Swap files for NVMe offload, in a per-run folder under the user's nvme_path.
//
// NOTE [swap files]
// Each engine makes one folder, `<nvme_path>/zero-swap-<host>-<pid>-<tag>-<n>`,
// after checking that nvme_path is a writable folder, and checks that the disk
// has room for every file it will hold (statvfs, before anything is written). Each file is created,
// its full size allocated at once (fallocate: a full disk fails here, before
// training, naming the file), and then unlinked: the open descriptors keep
// the data, and the space goes back to the disk when they close, however the
// process ends (an exception, a signal, the OOM killer). The folder itself is
// removed once its files are open. Nothing is left under nvme_path after a
// run, and two runs (or ranks) on one disk never see each other's files.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "zero/offload/aio.h"

namespace zero::offload {

/// One file to create: its name (for messages) and size.
struct SwapFileSpec {
  std::string name;
  int64_t bytes = 0;
};

/// Creates the swap files under `nvme_path` (see NOTE). `config_key` is the
/// config entry that named the path ("zero_optimization.offload_optimizer.nvme_path"),
/// named in every error; `what` says what the files hold, for the space error.
/// Throws zero::ConfigError when the path is missing, not a folder or not
/// writable, zero::IoError when the disk has too little free space (naming
/// what is needed and what is free) or a file cannot be created or allocated.
std::vector<std::shared_ptr<AioFile>> create_swap_files(const std::string& nvme_path, const std::string& config_key,
                                                        const std::string& tag, const std::string& what,
                                                        const std::vector<SwapFileSpec>& files);

/// Free bytes for an unprivileged user on the filesystem holding `path`
/// (statvfs), or -1 when it cannot be read.
int64_t free_bytes(const std::string& path);

}  // namespace zero::offload
