// `zero bench ...` subcommands. Each prints a readable table and, with
// --json FILE, writes the same figures as JSON (units in the key names).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "zero/runs/runs.h"

namespace zero::tools {

/// zero bench engine: minGPT training steps through zero's engine against a
/// plain LibTorch loop (torch::optim::AdamW, clip_grad_norm_), same model and
/// data, in one run. Returns the process exit code.
int bench_engine(const std::vector<std::string>& args);

/// zero bench overlap: stage 2 against stage 0 on real ranks (zero launch),
/// and the share of gradient communication hidden behind backward (exposed
/// wait with overlap_comm against the wait without it).
int bench_overlap(const std::vector<std::string>& args);

/// zero bench adam: zero's CPU Adam against torch::optim::Adam and the
/// stream-triad bandwidth, same sizes, one run.
int bench_adam(const std::vector<std::string>& args);
/// zero bench transfer: host-device copies on the engine's copy stream from
/// the pinned tier, LibTorch's pinned allocator and pageable memory (a GPU only).
int bench_transfer(const std::vector<std::string>& args);
/// zero estimate: model-state memory per rank for each ZeRO configuration (tools/estimate.cpp).
int estimate(const std::vector<std::string>& args);

/// zero tune: the fastest config that fits a model and per-rank budgets,
/// chosen by the estimator and short runs on real ranks (tools/tune.cpp).
int tune(const std::vector<std::string>& args);

/// zero memcheck record|check: a program's memory held to a baseline (tools/memcheck.cpp).
int memcheck(const std::vector<std::string>& args);

/// zero trace merge: ZERO_TRACE's per-rank files as one trace (tools/trace_cli.cpp).
int trace_command(const std::vector<std::string>& args);

/// --model mingpt:L,C[,V,T] (V default 50257, T default 1024); nullopt with
/// `error` set when malformed.
std::optional<std::array<int64_t, 4>> parse_mingpt_model(const std::string& text, std::string& error);

/// zero bench stage3: ZeRO stage 3 on real ranks with prefetch on and off
/// (and stage 2 for reference): step time, the time the training thread
/// waited for parameter gathers, and how many gathers were prefetched.
int bench_stage3(const std::vector<std::string>& args);

/// zero bench aio: the AIO engine's sequential write and read throughput on
/// a file under --path, and fio's on the same file and options.
int bench_aio(const std::vector<std::string>& args);

/// zero bench offload: the optimizer states offloaded to the CPU, and to NVMe
/// (--path) with and without the swap pipeline: step time, the time the
/// optimizer waited for the disk, and the share of it the pipeline hides.
int bench_offload(const std::vector<std::string>& args);

/// zero nvme-tune: sweeps the aio settings on a file under --path and prints
/// the best `aio` section for the config.
int nvme_tune(const std::vector<std::string>& args);

/// zero bench checkpoint: minGPT's activation peak (counting allocator) and
/// step time without checkpointing, with it, and with cpu_checkpointing.
int bench_checkpoint(const std::vector<std::string>& args);

/// zero bench checkpoint-io: engine checkpoints' save and load GB/s per rank
/// on N ranks, beside zero bench aio's (and fio's) rates on the same folder.
int bench_checkpoint_io(const std::vector<std::string>& args);

/// zero checkpoint consolidate|verify|info: engine checkpoints from the
/// command line (docs/checkpoints.md).
int checkpoint_command(const std::vector<std::string>& args);

}  // namespace zero::tools

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <optional>

#include <nlohmann/json.hpp>

namespace zero::tools {

/// The folder of the running executable (build/bin), where mingpt is too.
std::string self_dir();

/// Why option `a` is refused, or "" when it is one of `known` not given
/// before (it is then added to `seen`): an unknown option names the nearest
/// known one, a second one says to give it once.
std::string option_problem(const std::string& a, const std::vector<std::string>& known, std::set<std::string>& seen);

/// --run-timeout's value: seconds, 0 to 1e7 (0: no limit); nullopt when it is not one.
std::optional<double> parse_run_timeout(const std::string& v);

/// A fresh folder $TMPDIR/zero-bench-NAME-XXXXXX (TMPDIR or /tmp) for a bench's configs, logs and
/// summaries, removed with everything in it (and any path given to
/// also_remove) when the bench returns, failed or not: a failed run's error
/// is printed from its log first (run_mingpt_ranks).
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& name);
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return dir_.path(); }
  void also_remove(std::string path) { extra_.push_back(std::move(path)); }

 private:
  zero::runs::ScratchDir dir_;  // removed after the extra paths
  std::vector<std::string> extra_;
};

/// The config every multi-rank bench trains minGPT with: micro-batch
/// `micro_batch` per rank, AdamW (lr 1e-3), clipping 1.0, and `zero` as the
/// zero_optimization section.
nlohmann::json mingpt_bench_config(int64_t micro_batch, nlohmann::json zero);

/// minGPT's flags for a bench run: L blocks of width C with 4 heads, no
/// dropout, `steps` batches of one epoch, then `more`.
std::vector<std::string> mingpt_bench_args(int64_t n_layer, int64_t n_embd, int64_t steps,
                                           std::vector<std::string> more = {});

/// Runs minGPT on `nproc` ranks (zero launch) with `config` (written to
/// dir/name.json) and `mingpt_args` (no shell between: paths may hold
/// spaces), its output in dir/name.log. Returns rank 0's summary; nullopt,
/// having printed the end of the log (the error), when the run failed.
/// The run has its own process group; a stop signal is passed on to it and
/// then thrown as zero::runs::Interrupted (probe.h's run_logged), so the bench's
/// ScratchDir goes: the benches that run other programs (these, and bench
/// aio's fio) are called under CatchStopSignals (zero_cli.cpp).
std::optional<nlohmann::json> run_mingpt_ranks(const std::string& command, const std::string& dir,
                                               const std::string& name, int64_t nproc, const nlohmann::json& config,
                                               const std::vector<std::string>& mingpt_args);

/// "1GiB", "64MiB", "512KiB", "4096": bytes (at least 1); nullopt when
/// malformed or below 1.
std::optional<int64_t> parse_size(const std::string& s);

/// Seconds `fn` takes.
double seconds(const std::function<void()>& fn);

/// Writes a bench's figures to `path` whole or not at all. Throws IoError.
void write_json_output(const std::string& path, const nlohmann::json& j);
bool parse_bench_options(const std::string& command, const std::vector<std::string>& args,
                         std::map<std::string, int64_t>& ints, std::string& json_path);

/// zero checkpoint consolidate|verify|info: engine checkpoints from the
/// command line (docs/checkpoints.md).
int checkpoint_command(const std::vector<std::string>& args);

}  // namespace zero::tools
