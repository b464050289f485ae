// mingpt's command line: its options (Args), their parsing and checks, and
// the usage errors that name the flag and what it expected.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "zero/core/copy_mode.h"

namespace mingpt::cli {

extern const char* kUsage;

struct Args {
  std::string config;
  int64_t n_layer = 2, n_head = 4, n_embd = 128;
  std::optional<int64_t> block_size;
  int64_t batch_size = 64;
  bool batch_size_given = false;
  std::optional<int64_t> limit_train_batches;
  int64_t max_epochs = 1;
  std::optional<std::string> precision;
  double lr = 5e-4;
  bool lr_given = false;  // --lr on the command line (NOTE [config warnings]: unused where the config fixes lr)
  std::optional<std::string> optimizer;
  double weight_decay = 0.1;
  bool weight_decay_given = false;
  std::string data;
  std::optional<int64_t> vocab_size;
  int64_t ndigit = 2;
  uint64_t seed = 42;
  std::string summary_json;
  double dropout = 0.1;
  bool checkpoint = false;
  bool tie_weights = false;
  std::optional<std::string> device;
  zero::CopyMode cpu_copy_mode = zero::CopyMode::kImmediate;
  std::string save_dir, resume, resume_tag, load_weights;
  int64_t save_every = 0;
  std::optional<int64_t> stop_after_steps;
  std::optional<int64_t> device_memory, host_memory, nvme_bytes;
  bool find_max = false, oversubscribe = false;
  int64_t nproc = 1, probe_steps = 3, head_dim = 64;
  double probe_timeout = 1800;
  bool n_layer_given = false, n_embd_given = false, n_head_given = false;
  std::vector<std::string> forward;  // flags a --find-max-params probe gets as given
  // Test seam (not in --help): "RANK:POINT:N" kills rank RANK at point POINT
  // of its N-th save (CheckpointHooks::at), as a crash would.
  std::string test_kill_save;
};

// Upper bounds of the model and run flags: far above what trains on any
// machine, low enough that sizes computed from them cannot overflow.
constexpr int64_t kMaxLayers = 100000, kMaxWidth = 1 << 20, kMaxBatch = 1 << 24, kMaxBlock = 1 << 20;
constexpr int64_t kMaxCount = int64_t{1} << 40;  // epochs, batches, steps
constexpr int64_t kMaxDigits = 4;  // the addition task enumerates (10^n)^2 pairs

/// Prints "mingpt: MESSAGE" and the pointer to --help; exits with status 2.
[[noreturn]] void usage_error(const std::string& message);
/// Decimal digits within [min_value, max_value], else a usage error naming the flag.
int64_t parse_int(const std::string& flag, const std::string& v, int64_t min_value, int64_t max_value);
/// A finite number in [min_value, max_value] (below_max: max_value excluded).
double parse_double(const std::string& flag, const std::string& v, double min_value, double max_value,
                    bool below_max = false);
/// An output file's folder exists and takes files, and the name is not a folder.
void check_writable(const std::string& flag, const std::string& path);
/// The command line, every flag checked (usage errors exit with status 2).
Args parse_args(int argc, char** argv);
/// NOTE [outputs and inputs]: no output over what the run reads, before any work.
void check_outputs(const Args& a);

}  // namespace mingpt::cli
