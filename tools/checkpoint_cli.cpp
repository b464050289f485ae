// zero checkpoint: engine checkpoints from the command line
// (docs/checkpoints.md).
//   consolidate DIR OUT.safetensors   full weights by parameter name, streamed
//   verify DIR                        every file read whole, every block checked
//   info DIR                          what a checkpoint holds
//   export-deepspeed DIR OUT          DeepSpeed's layout (NOTE [deepspeed checkpoints])
//   import-deepspeed DIR OUT          a DeepSpeed checkpoint as zero's
// Each reads DeepSpeed's checkpoints too.
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>

#include <nlohmann/json.hpp>

#include "bench.h"
#include "zero/core/command_files.h"
#include "zero/core/error.h"
#include "zero/core/progress.h"
#include "zero/core/text.h"
#include "zero/snapshots/checkpoint_format.h"
#include "zero/snapshots/checkpoint_io.h"
#include "zero/snapshots/deepspeed_checkpoint.h"
#include "zero/snapshots/hf_export.h"
#include "zero/config/config.h"
#include "zero/optim/lr_scheduler.h"
#include "zero/runs/runs.h"

namespace zero::tools {
namespace {

const char* kCheckpointUsage = R"(usage: zero checkpoint COMMAND DIR [options]

  consolidate DIR OUT.safetensors [--tag T] [--dtype fp32|bf16|fp16] [--state NAME] [--force]
      Writes the full weights of DIR's latest checkpoint (or tag T) to one
      safetensors file, by parameter name, with the model's buffers: what
      Python's safetensors, torch and Hugging Face tools read, and what
      Engine::load_weights and mingpt --load_weights start from. Reads the
      rank files piece by piece, so host memory stays bounded whatever the
      model's size; prints the peak. --state exp_avg (or another state of the
      optimizer) writes that state instead of the fp32 weights. OUT may not be
      inside DIR; an existing OUT is replaced only when an earlier
      consolidate wrote it, or with --force.
  export DIR OUT_DIR --hf [--tag T] [--dtype fp32|bf16|fp16] [--max-shard-size 5GB] [--config config.json]
      The full weights of DIR's latest checkpoint (or tag T), the fp32 master
      in --dtype, as Hugging Face's save_pretrained lays them out in OUT_DIR:
      model.safetensors, or model-0000k-of-0000n.safetensors shards with
      model.safetensors.index.json; --config copies a config.json beside
      them (what from_pretrained needs). Streamed piece by piece; an earlier
      export's weight files in OUT_DIR are replaced, other files stay.
  verify DIR [--tag T] [--clean]
      Reads every file of the checkpoint whole and checks its sizes and
      checksums against meta.json; exits 1 naming the first damage. --clean
      first removes what interrupted saves left in DIR (hidden .TAG.incoming
      folders), unless a job is saving there now.
  info DIR [--tag T]
      Prints what the checkpoint holds: steps, world size, stage, optimizer,
      parameters, files.
  export-deepspeed DIR OUT [--tag T] [--world-size N] [--stage 1|2|3] [--universal]
      Writes DIR's latest checkpoint (or tag T) as DeepSpeed saves one, into
      the new folder OUT (OUT/TAG and OUT/latest): the model file, one
      optimizer file per rank of N (default: the ranks it was saved by) at
      the stage given (default: its own; stage 0 as 2), with the fp32
      master, Adam's moments and step, the LR schedule and the client state.
      deepspeed.initialize + load_checkpoint resumes it at N ranks, and
      DeepSpeed's zero_to_fp32.py consolidates it. --universal writes
      ds_to_universal's form (OUT/latest_universal), which DeepSpeed resumes
      at any number of ranks with "checkpoint": {"load_universal": true}.
  import-deepspeed DIR OUT [--tag T]
      Converts DIR's DeepSpeed checkpoint (stages 1-3, or the universal
      form) into a zero checkpoint in the new folder OUT, with its states,
      steps, LR schedule, buffers and client state, a window at a time.
      load_checkpoint reads DeepSpeed's checkpoints directly; the import
      gives a checkpoint with zero's checksums, which verify checks.

Every command reads DeepSpeed's checkpoints too (DIR/latest or
DIR/latest_universal naming a folder of *.pt files), without running any
code they name (NOTE [restricted unpickling]); load_checkpoint resumes them.
)";

// VmHWM / VmRSS of this process, bytes.
int64_t proc_status_bytes(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string k = std::string(key) + ":";
  while (std::getline(in, line))
    if (line.rfind(k, 0) == 0) return std::stoll(line.substr(k.size())) * 1024;  // "  1234 kB"
  return -1;
}

struct Parsed {
  std::vector<std::string> positional;
  std::string tag, dtype = "fp32", state = "fp32_master", max_shard = "5GB", config;
  std::string world_size, stage;
  bool force = false, clean = false, hf = false, universal = false;
};

// Returns false (having printed why) on an unknown option or a missing value.
// Flags without a value (--force, --clean) are in `options` too. Each
// option once; a tag, when given, names one ("" is not "the latest").
bool parse(const std::string& command, const std::vector<std::string>& args, const std::vector<std::string>& options,
           Parsed& out) {
  std::vector<std::string> seen;
  auto refuse = [&](const std::string& message) {
    std::cerr << "zero checkpoint " << command << ": " << message << "\n\n" << kCheckpointUsage;
    return false;
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0) {
      out.positional.push_back(a);
      continue;
    }
    const bool known = std::find(options.begin(), options.end(), a) != options.end();
    if (known && std::find(seen.begin(), seen.end(), a) != seen.end()) return refuse(a + " given twice: give it once");
    seen.push_back(a);
    if (known && (a == "--force" || a == "--clean" || a == "--hf" || a == "--universal")) {
      (a == "--force" ? out.force : a == "--clean" ? out.clean : a == "--hf" ? out.hf : out.universal) = true;
      continue;
    }
    if (!known || i + 1 >= args.size()) {
      const auto near = nearest(a, options);
      std::cerr << "zero checkpoint " << command << ": " << a << ": unknown option or missing value"
                << (near.empty() ? "" : "; did you mean " + near + "?") << "\n\n"
                << kCheckpointUsage;
      return false;
    }
    const std::string& v = args[++i];
    if (a == "--tag" && v.empty())
      return refuse("--tag: expected a checkpoint's tag; got \"\" (leave --tag out for the latest)");
    if (a == "--tag") out.tag = v;
    else if (a == "--dtype") out.dtype = v;
    else if (a == "--state") out.state = v;
    else if (a == "--max-shard-size") out.max_shard = v;
    else if (a == "--config") out.config = v;
    else if (a == "--world-size") out.world_size = v;
    else if (a == "--stage") out.stage = v;
  }
  return true;
}

// Whether `path` is a safetensors file an earlier consolidate wrote: its
// header's metadata has the "source" and "state" consolidate records.
bool written_by_consolidate(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  if (!in.read(reinterpret_cast<char*>(&n), 8) || n == 0 || n > (uint64_t{100} << 20)) return false;
  std::string header(static_cast<size_t>(n), '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(n))) return false;
  try {
    const auto j = nlohmann::json::parse(header);
    const auto& meta = j.at("__metadata__");
    return meta.contains("source") && meta.contains("state") && meta.contains("global_steps");
  } catch (const std::exception&) {
    return false;
  }
}

// Why consolidate must not write `out` (checkpoint folder `dir`, the tag's
// folder `tag_dir`), or "": an output that cannot be written, one over what
// is read (NOTE [outputs and inputs]: inside the checkpoint folder, a file
// of the checkpoint under another name), or an existing file that no
// earlier consolidate wrote, unless `force`.
std::string consolidate_output_problem(const std::string& dir, const std::string& tag_dir, const std::string& out,
                                       bool force) {
  if (std::string problem = ckpt::output_file_problem("OUT", out); !problem.empty()) return problem;
  CommandFiles files;
  files.reads_folder("the checkpoint folder DIR", dir);
  files.reads_folder("the checkpoint's tag folder", tag_dir);
  for (const std::string& name : ckpt::list_folder(tag_dir)) files.reads("the checkpoint's file", tag_dir + "/" + name);
  files.writes("OUT", out);
  if (std::string problem = files.problem(); !problem.empty()) return problem;
  if (!ckpt::path_exists(out)) return "";
  if (!force && !written_by_consolidate(out))
    return "OUT " + out + " exists and is not a file zero checkpoint consolidate wrote; give --force to replace it";
  return "";
}

// verify --clean: what interrupted saves left in `dir`, removed when no job
// holds its writer lock (NOTE [checkpoint commit]).
void clean_interrupted_saves(const std::string& dir) {
  if (!ckpt::is_folder(dir)) return;  // verify names the problem
  auto attempt = ckpt::FolderLock::try_acquire(dir);
  if (attempt.state != ckpt::FolderLock::State::kAcquired) {
    std::printf("%s: %s: nothing removed\n", dir.c_str(),
                attempt.state == ckpt::FolderLock::State::kUnsupported
                    ? ("its file system has no flock (" + attempt.holder + "), so a job saving there cannot be told")
                          .c_str()
                    : ("a job is saving checkpoints here (" + attempt.holder + ")").c_str());
    return;
  }
  const auto removed = ckpt::remove_interrupted_saves(dir);
  if (removed.empty()) std::printf("%s: nothing left by interrupted saves\n", dir.c_str());
  for (const auto& name : removed) std::printf("%s: removed %s (left by an interrupted save)\n", dir.c_str(), name.c_str());
}

// --dtype's value, or nullopt having said why.
std::optional<at::ScalarType> parse_dtype(const std::string& command, const std::string& v) {
  if (v == "fp32") return at::kFloat;
  if (v == "bf16") return at::kBFloat16;
  if (v == "fp16") return at::kHalf;
  std::cerr << "zero checkpoint " << command << ": --dtype: expected fp32, bf16 or fp16; got \"" << v << "\"\n";
  return std::nullopt;
}

// NOTE [frozen groups]: a checkpoint saved with exclude_frozen holds the
// trainable parameters only; what it is written to lacks the base.
void warn_if_without_frozen(const std::string& tag_dir, const char* command) {
  if (!ckpt::deepspeed::find(tag_dir, "").empty()) return;  // DeepSpeed's: its model file holds them
  if (ckpt::read_meta(tag_dir).value("frozen_parameters", std::string("included")) != "excluded") return;
  std::cerr << "zero checkpoint " << command << ": " << tag_dir
            << " was saved without its frozen parameters (exclude_frozen: a LoRA run's adapters, say): the output has "
               "the trained parameters only; the frozen ones are in the weights the run started from\n";
}

int consolidate_command(const std::vector<std::string>& args) {
  Parsed p;
  if (!parse("consolidate", args, {"--tag", "--dtype", "--state", "--force"}, p)) return 2;
  if (p.positional.size() != 2) {
    std::cerr << "zero checkpoint consolidate: expected DIR and OUT.safetensors\n\n" << kCheckpointUsage;
    return 2;
  }
  const auto dtype = parse_dtype("consolidate", p.dtype);
  if (!dtype) return 2;
  const int64_t rss_before = proc_status_bytes("VmRSS");
  const std::string tag_dir = ckpt::deepspeed::tag_folder_any(p.positional[0], p.tag);
  if (const std::string problem = consolidate_output_problem(p.positional[0], tag_dir, p.positional[1], p.force);
      !problem.empty()) {
    std::cerr << "zero checkpoint consolidate: " << problem << "\n";
    return 2;
  }
  std::optional<ProgressLine> progress;
  ckpt::ConsolidateStats st;
  runs::CatchStopSignals stop;  // Ctrl-C unwinds: the unfinished file goes with its writer
  const double secs = seconds([&] {
    st = ckpt::consolidate(tag_dir, p.positional[1], *dtype, p.state, offload::AioOptions{},
                           [&](int64_t done, int64_t total) {
                             runs::check_stop();
                             if (!progress) progress.emplace("consolidate", total, "elements");
                             progress->update(done);
                           });
  });
  if (progress) progress->finish();
  warn_if_without_frozen(tag_dir, "consolidate");
  const int64_t peak = proc_status_bytes("VmHWM");
  std::printf("%s: %lld tensors, %s (%s) from %s in %.2f s (%.2f GB/s read)\n", p.positional[1].c_str(),
              static_cast<long long>(st.tensors), format_bytes(st.bytes_written).c_str(), p.state.c_str(),
              tag_dir.c_str(), secs, secs > 0 ? static_cast<double>(st.bytes_read) / secs / 1e9 : 0.0);
  std::printf("peak host memory %s (%s before consolidating: the program and LibTorch)\n",
              format_bytes(peak).c_str(), format_bytes(rss_before).c_str());
  return 0;
}

// Why `text` (export's --config, written as OUT_DIR/config.json) is not a
// Hugging Face model config for the checkpoint in `tag_dir`, or "":
// transformers reads config.json by its model_type, and a config whose
// vocabulary or width differs from the weights' loads as an error there.
std::string export_config_problem(const std::string& path, const std::string& text, const std::string& tag_dir) {
  const std::string head = "--config " + path + ": ";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    return head + "not valid JSON (" + e.what() + ")";
  }
  if (!j.is_object() || !j.contains("model_type") || !j.at("model_type").is_string())
    return head + "has no \"model_type\": expected the model's Hugging Face config.json (transformers picks the "
                  "model class by it), not a DeepSpeed config";
  const auto meta = ckpt::read_meta(tag_dir);
  const auto layout = ckpt::SavedLayout::from_json(meta.at("layout"), tag_dir + "/meta.json");
  for (const auto& g : layout.groups)
    for (const auto& sp : g.params) {
      const bool embedding = sp.name.size() >= 19 && sp.name.compare(sp.name.size() - 19, 19, "embed_tokens.weight") == 0;
      if (!embedding || sp.shape.size() != 2) continue;
      for (const auto& [key, dim] : {std::pair<const char*, int64_t>{"vocab_size", sp.shape[0]}, {"hidden_size", sp.shape[1]}})
        if (j.contains(key) && (!j.at(key).is_number_integer() || j.at(key).get<int64_t>() != dim))
          return head + key + " is " + j.at(key).dump() + ", but the checkpoint's " + sp.name + " has shape [" +
                 std::to_string(sp.shape[0]) + ", " + std::to_string(sp.shape[1]) + "]: the config of another model?";
    }
  return "";
}

int export_command(const std::vector<std::string>& args) {
  Parsed p;
  if (!parse("export", args, {"--tag", "--dtype", "--max-shard-size", "--config", "--hf"}, p)) return 2;
  if (p.positional.size() != 2 || !p.hf) {
    std::cerr << "zero checkpoint export: expected DIR OUT_DIR --hf (Hugging Face's layout, the one format)\n\n"
              << kCheckpointUsage;
    return 2;
  }
  const auto dtype = parse_dtype("export", p.dtype);
  if (!dtype) return 2;
  const auto shard = parse_byte_size(p.max_shard);
  if (!shard) {
    std::cerr << "zero checkpoint export: --max-shard-size: expected a size such as 5GB or 500MiB; got \"" << p.max_shard
              << "\"\n";
    return 2;
  }
  if (!p.config.empty())
    if (const std::string problem = input_file_problem("--config", p.config); !problem.empty()) {
      std::cerr << "zero checkpoint export: " << problem << " (the config.json to write beside the weights)\n";
      return 2;
    }
  const std::string tag_dir = ckpt::tag_folder(p.positional[0], p.tag);
  {
    // NOTE [outputs and inputs]: not inside the checkpoint, not over --config;
    // NOTE [export folder]: only an earlier export's files are replaced.
    CommandFiles files;
    files.reads_folder("the checkpoint folder DIR", p.positional[0]);
    files.reads_folder("the checkpoint's tag folder", tag_dir);
    if (!p.config.empty()) files.reads("--config", p.config);
    files.writes_folder("OUT_DIR", p.positional[1]);
    std::string problem = files.problem();
    if (problem.empty()) problem = ckpt::HfWriter::folder_problem("OUT_DIR", p.positional[1], !p.config.empty());
    if (!problem.empty()) {
      std::cerr << "zero checkpoint export: " << problem << "\n";
      return 2;
    }
  }
  const std::string config_json = p.config.empty() ? "" : ckpt::read_small_file(p.config);
  if (!p.config.empty())
    if (const std::string problem = export_config_problem(p.config, config_json, tag_dir); !problem.empty()) {
      std::cerr << "zero checkpoint export: " << problem << "\n";
      return 2;
    }
  std::optional<ProgressLine> progress;
  ckpt::ConsolidateStats st;
  runs::CatchStopSignals stop;  // Ctrl-C unwinds: the fresh folder goes, OUT_DIR stays as it was
  const double secs = seconds([&] {
    st = ckpt::export_hf(tag_dir, p.positional[1], *dtype, *shard, config_json, offload::AioOptions{},
                         [&](int64_t done, int64_t total) {
                           runs::check_stop();
                           if (!progress) progress.emplace("export", total, "elements");
                           progress->update(done);
                         });
  });
  if (progress) progress->finish();
  warn_if_without_frozen(tag_dir, "export");
  std::printf("%s: %lld tensors, %s in Hugging Face's layout from %s in %.2f s\n", p.positional[1].c_str(),
              static_cast<long long>(st.tensors), format_bytes(st.bytes_written).c_str(), tag_dir.c_str(), secs);
  return 0;
}

int verify_command(const std::vector<std::string>& args) {
  Parsed p;
  if (!parse("verify", args, {"--tag", "--clean"}, p)) return 2;
  if (p.positional.size() != 1) {
    std::cerr << "zero checkpoint verify: expected DIR\n\n" << kCheckpointUsage;
    return 2;
  }
  if (p.clean) clean_interrupted_saves(p.positional[0]);
  if (const std::string ds = ckpt::deepspeed::find(p.positional[0], p.tag); !ds.empty()) {
    int64_t files = 0, total = 0;
    const double secs = seconds([&] {
      total = ckpt::deepspeed::verify(ds, [&](const std::string& path, int64_t n) {
        ++files;
        std::printf("  %-48s %12s  ok\n", path.substr(ds.size() + 1).c_str(), format_bytes(n).c_str());
      });
    });
    std::printf("%s: a DeepSpeed checkpoint: %lld files, %s read in %.2f s; every pickle parsed, every tensor "
                "within its file: OK (torch.save files carry no checksums zero can check)\n",
                ds.c_str(), static_cast<long long>(files), format_bytes(total).c_str(), secs);
    return 0;
  }
  const std::string tag_dir = ckpt::tag_folder(p.positional[0], p.tag);
  const auto meta = ckpt::read_meta(tag_dir);
  auto reader = ckpt::PieceReader::checkpoint(tag_dir, meta, offload::AioOptions{});
  ckpt::check_saved_states(tag_dir, meta, *reader);
  int64_t total = 0;
  const double secs = seconds([&] {
    for (const auto& [name, f] : meta.at("files").items()) {
      const int64_t n = reader->verify_file(name);
      total += n;
      std::printf("  %-24s %12s  ok\n", name.c_str(), format_bytes(n).c_str());
    }
  });
  std::printf("%s: %zu files, %s checked in %.2f s (%.2f GB/s): OK\n", tag_dir.c_str(), meta.at("files").size(),
              format_bytes(total).c_str(), secs, secs > 0 ? static_cast<double>(total) / secs / 1e9 : 0.0);
  return 0;
}

// Why OUT cannot be the new folder an export or import writes, or "".
std::string new_folder_problem(const std::string& out) {
  if (ckpt::path_exists(out) && !(ckpt::is_folder(out) && ckpt::list_folder(out).empty()))
    return out + " exists and is not an empty folder; the command writes a new folder";
  return ckpt::save_folder_problem("OUT", out);
}

// Whole numbers from `min` up, for the option `flag`.
std::optional<int64_t> parse_count(const std::string& flag, const std::string& v, int64_t min) {
  char* end = nullptr;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || n < min) {
    std::cerr << "zero checkpoint export-deepspeed: " << flag << " " << v << ": expected a whole number of at least "
              << min << "\n";
    return std::nullopt;
  }
  return n;
}

int export_deepspeed_command(const std::vector<std::string>& args) {
  Parsed p;
  if (!parse("export-deepspeed", args, {"--tag", "--world-size", "--stage", "--universal"}, p)) return 2;
  if (p.positional.size() != 2) {
    std::cerr << "zero checkpoint export-deepspeed: expected DIR and OUT\n\n" << kCheckpointUsage;
    return 2;
  }
  ckpt::deepspeed::ExportOptions o;
  if (!p.world_size.empty()) {
    auto n = parse_count("--world-size", p.world_size, 1);
    if (!n) return 2;
    o.world_size = *n;
  }
  if (!p.stage.empty()) {
    auto n = parse_count("--stage", p.stage, 1);
    if (!n) return 2;
    if (*n > 3) {
      std::cerr << "zero checkpoint export-deepspeed: --stage " << p.stage << ": expected 1, 2 or 3\n";
      return 2;
    }
    o.stage = static_cast<int>(*n);
  }
  o.universal = p.universal;
  const std::string tag_dir = ckpt::tag_folder(p.positional[0], p.tag);
  const std::string& out = p.positional[1];
  if (const std::string problem = new_folder_problem(out); !problem.empty()) {
    std::cerr << "zero checkpoint export-deepspeed: " << problem << "\n";
    return 2;
  }
  // The optimizer group DeepSpeed restores: the run's config, its lr the
  // one the schedule gives the next step.
  const auto meta = ckpt::read_meta(tag_dir);
  config::LoadOptions lo;
  lo.world_size = meta.at("world_size").get<int64_t>();
  const config::Config cfg = config::load_string(meta.at("config").dump(), lo, tag_dir + "/meta.json config");
  if (cfg.optimizer) {
    o.lr = cfg.optimizer->lr;
    o.beta1 = cfg.optimizer->betas[0];
    o.beta2 = cfg.optimizer->betas[1];
    o.eps = cfg.optimizer->eps;
    o.weight_decay = cfg.optimizer->weight_decay;
    o.adam_w_mode = cfg.optimizer->type == config::OptimizerType::kAdamW || cfg.optimizer->adam_w_mode;
  }
  if (cfg.scheduler && meta.at("scheduler").is_object()) {
    auto sched = optim::LrScheduler::create(*cfg.scheduler, o.lr, o.beta1);
    sched->set_last_batch_iteration(meta.at("scheduler").at("last_batch_iteration").get<int64_t>());
    o.lr = sched->lr();
  }
  if (meta.contains("lr_set")) o.lr = meta.at("lr_set").get<double>();
  o.clip_grad = cfg.gradient_clipping;
  o.sub_group_size = cfg.zero.sub_group_size;
  o.train_batch_size = cfg.batch.train_batch_size;
  std::optional<ProgressLine> progress;
  ckpt::deepspeed::ExportStats st;
  runs::CatchStopSignals stop;
  const double secs = seconds([&] {
    st = ckpt::deepspeed::export_checkpoint(tag_dir, out, o, [&](int64_t done, int64_t total) {
      runs::check_stop();
      if (!progress) progress.emplace("export-deepspeed", total, o.universal ? "parameters" : "ranks");
      progress->update(done);
    });
  });
  if (progress) progress->finish();
  std::printf("%s: DeepSpeed's %s layout, %lld files, %s from %s in %.2f s\n", st.tag_dir.c_str(),
              o.universal ? "universal" : ("stage-" + std::to_string(o.stage > 0 ? o.stage : meta.at("stage").get<int>() == 0 ? 2 : meta.at("stage").get<int>()) + " " +
                                           std::to_string(o.world_size > 0 ? o.world_size : lo.world_size) + "-rank").c_str(),
              static_cast<long long>(st.files), format_bytes(st.bytes_written).c_str(), tag_dir.c_str(), secs);
  return 0;
}

int import_deepspeed_command(const std::vector<std::string>& args) {
  Parsed p;
  if (!parse("import-deepspeed", args, {"--tag"}, p)) return 2;
  if (p.positional.size() != 2) {
    std::cerr << "zero checkpoint import-deepspeed: expected DIR and OUT\n\n" << kCheckpointUsage;
    return 2;
  }
  const std::string ds = ckpt::deepspeed::find(p.positional[0], p.tag);
  if (ds.empty()) {
    std::cerr << "zero checkpoint import-deepspeed: " << p.positional[0]
              << " holds no DeepSpeed checkpoint" << (p.tag.empty() ? "" : " of tag " + p.tag)
              << " (DIR/latest or DIR/latest_universal naming a folder of DeepSpeed's *.pt files)\n";
    return 2;
  }
  const std::string& out = p.positional[1];
  if (const std::string problem = new_folder_problem(out); !problem.empty()) {
    std::cerr << "zero checkpoint import-deepspeed: " << problem << "\n";
    return 2;
  }
  std::optional<ProgressLine> progress;
  ckpt::deepspeed::ExportStats st;
  runs::CatchStopSignals stop;
  const double secs = seconds([&] {
    st = ckpt::deepspeed::import_checkpoint(ds, out, [&](int64_t done, int64_t total) {
      runs::check_stop();
      if (!progress) progress.emplace("import-deepspeed", total, "elements");
      progress->update(done);
    });
  });
  if (progress) progress->finish();
  std::printf("%s: a zero checkpoint, %lld files, %s from %s (%s read) in %.2f s\n", st.tag_dir.c_str(),
              static_cast<long long>(st.files), format_bytes(st.bytes_written).c_str(), ds.c_str(),
              format_bytes(st.bytes_read).c_str(), secs);
  return 0;
}

int info_command(const std::vector<std::string>& args) {
  Parsed p;
  if (!parse("info", args, {"--tag"}, p)) return 2;
  if (p.positional.size() != 1) {
    std::cerr << "zero checkpoint info: expected DIR\n\n" << kCheckpointUsage;
    return 2;
  }
  const std::string tag_dir = ckpt::deepspeed::tag_folder_any(p.positional[0], p.tag);
  const auto meta = ckpt::deepspeed::open_any(tag_dir, offload::AioOptions{}).meta;
  const auto layout = ckpt::SavedLayout::from_json(meta.at("layout"), tag_dir + "/meta.json");
  if (meta.value("format", "") == "deepspeed")
    std::printf("%s: a DeepSpeed checkpoint (DeepSpeed %s%s)\n", tag_dir.c_str(),
                meta.value("ds_version", std::string("?")).c_str(),
                ckpt::is_folder(tag_dir + "/zero") ? ", universal form" : "");
  int64_t params = 0, tensors = 0;
  for (const auto& g : layout.groups)
    for (const auto& sp : g.params) params += sp.numel, ++tensors;
  int64_t bytes = 0;
  for (const auto& [name, f] : meta.at("files").items()) bytes += f.at("bytes").get<int64_t>();
  std::string states;
  for (const auto& s : meta.at("states")) states += (states.empty() ? "" : ", ") + s.get<std::string>();
  std::printf("%s\n  step %lld (%lld skipped) | world size %lld | ZeRO stage %lld | compute dtype %s\n"
              "  optimizer %s: %s\n  %lld parameters in %lld tensors, %zu groups, %lld partitions\n"
              "  %zu files, %s\n  client state %s\n",
              tag_dir.c_str(), static_cast<long long>(meta.at("global_steps").get<int64_t>()),
              static_cast<long long>(meta.value("skipped_steps", int64_t{0})),
              static_cast<long long>(meta.at("world_size").get<int64_t>()),
              static_cast<long long>(meta.value("stage", int64_t{0})), meta.value("compute_dtype", "?").c_str(),
              meta.value("optimizer", "?").c_str(), states.c_str(), static_cast<long long>(params),
              static_cast<long long>(tensors), layout.groups.size(), static_cast<long long>(layout.partitions),
              meta.at("files").size(), format_bytes(bytes).c_str(), meta.at("client_state").dump().c_str());
  return 0;
}

}  // namespace

int checkpoint_command(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    std::cout << kCheckpointUsage;
    return args.empty() ? 2 : 0;
  }
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  const bool known = args[0] == "consolidate" || args[0] == "verify" || args[0] == "export" || args[0] == "info" ||
                     args[0] == "export-deepspeed" || args[0] == "import-deepspeed";
  if (known && (std::find(rest.begin(), rest.end(), "--help") != rest.end() ||
                std::find(rest.begin(), rest.end(), "-h") != rest.end())) {
    std::cout << kCheckpointUsage;
    return 0;
  }
  try {
    if (args[0] == "consolidate") return consolidate_command(rest);
    if (args[0] == "verify") return verify_command(rest);
    if (args[0] == "export") return export_command(rest);
    if (args[0] == "info") return info_command(rest);
    if (args[0] == "export-deepspeed") return export_deepspeed_command(rest);
    if (args[0] == "import-deepspeed") return import_deepspeed_command(rest);
  } catch (const Error& e) {
    std::cerr << "zero checkpoint " << args[0] << ": " << zero::error_text(e) << "\n";
    return 1;
  } catch (const runs::Interrupted& e) {
    std::cerr << "\nzero checkpoint " << args[0] << ": " << e.what()
              << "; nothing was written (what it had begun is removed)\n";
    return 128 + e.signal();
  }
  const auto near = nearest(args[0], {"consolidate", "export", "verify", "info", "export-deepspeed", "import-deepspeed"});
  std::cerr << "zero checkpoint: unknown command \"" << args[0] << "\""
            << (near.empty() ? "" : "; did you mean " + near + "?") << "\n\n"
            << kCheckpointUsage;
  return 2;
}

}  // namespace zero::tools
