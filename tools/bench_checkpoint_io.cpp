// zero bench checkpoint-io: engine checkpoints' save and load rates per rank
// (minGPT on N ranks through mingpt --save_dir / --resume), beside the AIO
// engine's and fio's sequential write and read rates on the same folder
// (zero bench aio, with the size of one rank's file). Before each load the
// checkpoint's pages are dropped from the page cache (posix_fadvise
// DONTNEED on the flushed files), so loads read the disk.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>

#include <nlohmann/json.hpp>

#include "bench.h"
#include "zero/runs/runs.h"
#include "zero/core/text.h"
#include "zero/snapshots/checkpoint_format.h"

namespace zero::tools {
namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Drops the pages of every file under `dir` from the page cache; returns the bytes.
int64_t evict(const std::string& dir) {
  int64_t bytes = 0;
  for (const auto& tag : ckpt::list_folder(dir)) {
    const std::string sub = dir + "/" + tag;
    if (ckpt::file_size(sub + "/meta.json") < 0) continue;
    for (const auto& name : ckpt::list_folder(sub)) {
      const std::string path = sub + "/" + name;
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;
      ::fdatasync(fd);
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      ::close(fd);
      bytes += ckpt::file_size(path);
    }
  }
  return bytes;
}

}  // namespace

int bench_checkpoint_io(const std::vector<std::string>& args) {
  std::map<std::string, int64_t> ints = {{"--nproc", 2}, {"--n_layer", 8}, {"--n_embd", 512}, {"--stage", 2},
                                         {"--rounds", 3}};
  std::string path, json_path;
  std::vector<std::string> rest;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--path" && i + 1 < args.size()) path = args[++i];
    else rest.push_back(args[i]);
  }
  if (!parse_bench_options("zero bench checkpoint-io", rest, ints, json_path)) return 2;
  if (path.empty()) {
    std::cerr << "zero bench checkpoint-io: --path DIR is required (a folder on the disk to measure)\n";
    return 2;
  }
  const int64_t nproc = ints["--nproc"], rounds = ints["--rounds"], stage = ints["--stage"];
  if (stage > 3) {
    std::cerr << "zero bench checkpoint-io: --stage: expected 0-3; got " << stage << "\n";
    return 2;
  }
  ScratchDir scratch_dir("checkpoint-io");
  const std::string& scratch = scratch_dir.path();
  const std::string ckpt_dir = path + "/zero-bench-checkpoint-io-" + std::to_string(::getpid());
  scratch_dir.also_remove(ckpt_dir);
  const nlohmann::json config = mingpt_bench_config(8, {{"stage", stage}});
  // minGPT's flags: the model, then what each run adds.
  auto model = [&](std::vector<std::string> more) {
    std::vector<std::string> a = {"--n_layer", std::to_string(ints["--n_layer"]), "--n_embd",
                                  std::to_string(ints["--n_embd"]), "--n_head", "8", "--dropout", "0"};
    a.insert(a.end(), more.begin(), more.end());
    return a;
  };
  const std::string cmd = "zero bench checkpoint-io";

  // Saves: one after each of `rounds` steps.
  auto saved = run_mingpt_ranks(cmd, scratch, "save", nproc, config,
                                model({"--limit_train_batches", std::to_string(rounds), "--save_dir", ckpt_dir,
                                       "--save_every", "1"}));
  if (!saved) return 1;
  std::vector<double> save_rate;  // per rank, GB/s over its saves
  int64_t save_bytes_per_rank = 0;
  double save_job_s = 0;
  int64_t save_job_bytes = 0;
  for (const auto& r : (*saved)["ranks"]) {
    const double b = r["checkpoint"]["save_bytes"].get<double>(), s = r["checkpoint"]["save_s"].get<double>();
    save_rate.push_back(s > 0 ? b / s / 1e9 : 0);
    save_bytes_per_rank = std::max<int64_t>(save_bytes_per_rank, static_cast<int64_t>(b) / rounds);
    save_job_bytes += static_cast<int64_t>(b);
    save_job_s = std::max(save_job_s, s);
  }

  // Loads of the last checkpoint, the page cache emptied before each.
  std::vector<double> load_rate, load_job_rate;
  for (int64_t i = 0; i < rounds; ++i) {
    evict(ckpt_dir);
    auto loaded = run_mingpt_ranks(cmd, scratch, "load" + std::to_string(i), nproc, config,
                                   model({"--limit_train_batches", std::to_string(rounds), "--resume", ckpt_dir,
                                          "--stop_after_steps", std::to_string(rounds)}));
    if (!loaded) return 1;
    double job_b = 0, job_s = 0;
    for (const auto& r : (*loaded)["ranks"]) {
      const double b = r["checkpoint"]["load_bytes"].get<double>(), s = r["checkpoint"]["load_s"].get<double>();
      load_rate.push_back(s > 0 ? b / s / 1e9 : 0);
      job_b += b;
      job_s = std::max(job_s, s);
    }
    load_job_rate.push_back(job_s > 0 ? job_b / job_s / 1e9 : 0);
  }
  const int64_t params = (*saved)["num_parameters"].get<int64_t>();
  ckpt::remove_tree(ckpt_dir);

  // The AIO engine and fio on the same folder, one rank's file size.
  const std::string aio_json = scratch + "/aio.json";
  const std::vector<std::string> aio_cmd = {self_dir() + "/zero", "bench", "aio", "--path", path, "--size",
                                            std::to_string(std::max<int64_t>(save_bytes_per_rank, 1 << 20)), "--rounds",
                                            std::to_string(rounds), "--json", aio_json};
  std::fprintf(stderr, "%s: running zero bench aio on %s ...\n", cmd.c_str(), path.c_str());
  if (zero::runs::run_logged(aio_cmd, scratch + "/aio.log") != 0) {
    std::cerr << cmd << ": zero bench aio failed:\n" << std::ifstream(scratch + "/aio.log").rdbuf();
    return 1;
  }
  const auto aio = nlohmann::json::parse(std::ifstream(aio_json));

  const double save_r = median(save_rate), load_r = median(load_rate);
  const double save_job = save_job_s > 0 ? static_cast<double>(save_job_bytes) / save_job_s / 1e9 : 0;
  const double load_job = median(load_job_rate);
  const double aio_w = aio["write_gb_per_s"].get<double>(), aio_r = aio["read_gb_per_s"].get<double>();
  const double fio_w = aio["fio_write_gb_per_s"].get<double>(), fio_r = aio["fio_read_gb_per_s"].get<double>();
  std::printf("zero bench checkpoint-io: minGPT %lld parameters, ZeRO stage %lld, %lld ranks, %s per rank file, %s\n",
              static_cast<long long>(params), static_cast<long long>(stage), static_cast<long long>(nproc),
              format_bytes(save_bytes_per_rank).c_str(), path.c_str());
  std::printf("  %-6s %16s %12s %20s %12s %12s\n", "", "per rank GB/s", "job GB/s", "aio engine GB/s (1)", "fio GB/s (1)",
              "job/aio");
  std::printf("  %-6s %16.3f %12.3f %20.3f %12.3f %12.2f\n", "save", save_r, save_job, aio_w, fio_w,
              aio_w > 0 ? save_job / aio_w : 0.0);
  std::printf("  %-6s %16.3f %12.3f %20.3f %12.3f %12.2f\n", "load", load_r, load_job, aio_r, fio_r,
              aio_r > 0 ? load_job / aio_r : 0.0);
  std::printf("  (1) one process, O_DIRECT where the filesystem allows it, %s per request stream; saves include the\n"
              "      flush to disk and the commit, loads the checksum checks, from a dropped page cache; medians of %lld\n",
              format_bytes(save_bytes_per_rank).c_str(), static_cast<long long>(rounds));
  if (!json_path.empty()) {
    nlohmann::json j = {{"benchmark", "checkpoint-io"},
                        {"num_parameters", params},
                        {"stage", stage},
                        {"nproc", nproc},
                        {"rounds", rounds},
                        {"rank_file_bytes", save_bytes_per_rank},
                        {"save_gb_per_s_per_rank", save_r},
                        {"save_gb_per_s_job", save_job},
                        {"load_gb_per_s_per_rank", load_r},
                        {"load_gb_per_s_job", load_job},
                        {"aio_write_gb_per_s", aio_w},
                        {"aio_read_gb_per_s", aio_r},
                        {"fio_write_gb_per_s", fio_w},
                        {"fio_read_gb_per_s", fio_r},
                        {"aio_direct", aio["direct"]},
                        {"ratio_save_job_vs_aio", aio_w > 0 ? save_job / aio_w : 0.0},
                        {"ratio_load_job_vs_aio", aio_r > 0 ? load_job / aio_r : 0.0}};
    write_json_output(json_path, j);
  }
  return 0;
}

}  // namespace zero::tools
