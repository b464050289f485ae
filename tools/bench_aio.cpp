// zero bench aio: the AIO engine's sequential read and write throughput on a
// file under --path, side by side with fio (io_uring, O_DIRECT) on the same
// file, block size and queue depth, in one run.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <fstream>
#include <functional>
#include <optional>
#include <iostream>

#include <nlohmann/json.hpp>

#include "bench.h"
#include "zero/snapshots/checkpoint_format.h"
#include "zero/runs/runs.h"
#include "zero/offload/aio.h"
#include "zero/offload/swap_folder.h"
#include "zero/core/error.h"
#include "zero/core/memory_ledger.h"
#include "zero/core/progress.h"
#include "zero/core/text.h"

namespace zero::tools {
namespace {

// fio's bandwidth (bytes/s) for rw = "write" or "read"; -1 when fio failed
// or is not there. Run without a shell (probe.h), so a stop signal reaches it.
double fio_bw(const std::string& file, const std::string& rw, int64_t size, int64_t block, int64_t depth,
              bool overwrite, const std::string& log) {
  std::vector<std::string> argv = {"fio", "--name=zero-bench", "--filename=" + file, "--rw=" + rw,
                                   "--bs=" + std::to_string(block), "--iodepth=" + std::to_string(depth),
                                   "--ioengine=io_uring", "--direct=1", "--size=" + std::to_string(size),
                                   "--numjobs=1", "--output-format=json"};
  if (overwrite) argv.push_back("--overwrite=1");
  try {
    if (zero::runs::run_logged(argv, log) != 0) return -1;
  } catch (const IoError&) {  // no fio on this machine
    return -1;
  }
  std::ifstream in(log);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto brace = text.find('{');  // fio may print notes before its JSON
  if (brace == std::string::npos) return -1;
  auto j = nlohmann::json::parse(text.substr(brace), nullptr, false);
  if (j.is_discarded()) return -1;
  return j["jobs"][0][rw]["bw_bytes"].get<double>();
}

}  // namespace

int bench_aio(const std::vector<std::string>& args) {
  std::string path, json_path, mode = "fresh";
  int64_t size = int64_t{1} << 30, block = 1 << 20, depth = 8, threads = 1, rounds = 3, buffer = 0;
  const std::vector<std::string> known = {"--path",    "--size",   "--block-size", "--queue-depth",
                                          "--threads", "--rounds", "--buffer",      "--json", "--mode"};
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (i + 1 >= args.size() || std::find(known.begin(), known.end(), a) == known.end()) {
      const std::string near = nearest(a, known);
      std::cerr << "zero bench aio: " << a << ": unknown option or missing value"
                << (near.empty() ? "" : "; did you mean " + near + "?") << "\n";
      return 2;
    }
    if (std::count(args.begin(), args.begin() + static_cast<std::ptrdiff_t>(i), a) != 0) {
      std::cerr << "zero bench aio: " << a << " given twice: give it once\n";
      return 2;
    }
    const std::string& v = args[++i];
    if (a == "--path") path = v;
    else if (a == "--json") json_path = v;
    else if (a == "--mode") {
      if (v != "fresh" && v != "overwrite") {
        std::cerr << "zero bench aio: --mode: expected fresh (each round writes a newly allocated file) or "
                     "overwrite (rounds rewrite one file, as swap files are); got \"" << v << "\"\n";
        return 2;
      }
      mode = v;
    } else {
      auto n = parse_size(v);
      if (!n) {
        std::cerr << "zero bench aio: " << a << ": expected a size such as 1GiB, 512KiB or 4096; got \"" << v << "\"\n";
        return 2;
      }
      (a == "--size" ? size : a == "--block-size" ? block : a == "--queue-depth" ? depth : a == "--rounds" ? rounds : a == "--buffer" ? buffer : threads) = *n;
    }
  }
  if (!json_path.empty())
    if (const std::string problem = ckpt::output_file_problem("--json", json_path); !problem.empty()) {
      std::cerr << "zero bench aio: " << problem << "\n";
      return 2;
    }
  if (path.empty()) {
    std::cerr << "zero bench aio: --path DIR is required (a folder on the disk to measure)\n";
    return 2;
  }
  if (!ckpt::is_folder(path)) {
    std::cerr << "zero bench aio: --path " << path << ": " << (ckpt::path_exists(path) ? "is a file" : "no such folder")
              << "; expected a folder on the disk to measure (its test files are made and removed there)\n";
    return 2;
  }
  const std::string file_path = path + "/zero-bench-aio-" + std::to_string(getpid());
  const std::string log = file_path + ".fio.json";
  // The test file and fio's log go whatever happens: a failed run leaves
  // neither the file nor a full disk behind.
  struct Cleanup {
    std::vector<std::string> paths;
    ~Cleanup() {
      for (const auto& p : paths) ::unlink(p.c_str());
    }
  } cleanup{{file_path, log}};
  try {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      std::cerr << "zero bench aio: --path " << path << ": " << std::strerror(errno) << "\n";
      return 2;
    }
    if (!S_ISDIR(st.st_mode)) {
      std::cerr << "zero bench aio: --path " << path << ": not a folder\n";
      return 2;
    }
    // The file needs its size, rounded to whole blocks, free on the disk.
    const int64_t needed = (size + block - 1) / block * block;
    if (const int64_t free = offload::free_bytes(path); free >= 0 && free < needed) {
      std::cerr << "zero bench aio: " << path << " has " << format_bytes(free) << " free; the test file needs "
                << format_bytes(needed) << " (--size " << size << "): free space there or give a smaller --size\n";
      return 1;
    }
    offload::AioOptions o;
    o.block_size = block;
    o.queue_depth = depth;
    o.threads = threads;
    offload::AioEngine engine(o);
    // The memory the file is written from and read into: the whole size, or
    // (--buffer) a smaller buffer cycled through, requests for every slice of
    // the file in flight at once.
    if (buffer <= 0 || buffer > size) buffer = size;
    offload::AlignedBuffer buf(buffer);
    std::memset(buf.data(), 0x5a, static_cast<size_t>(buf.size()));
    auto file = offload::AioFile::open(file_path, true);
    const bool direct = file->direct();
    auto transfer = [&](bool write) {
      std::vector<offload::AioHandle> hs;
      for (int64_t off = 0; off < size; off += buffer) {
        const int64_t n = std::min(buffer, size - off);
        hs.push_back(write ? engine.write(file, buf.data(), n, off) : engine.read(file, buf.data(), n, off));
      }
      for (auto& h : hs) h.wait();
    };
    std::fprintf(stderr, "zero bench aio: %s, %s, block %lld, queue depth %lld, %lld thread(s)%s\n", file_path.c_str(),
                 format_bytes(size).c_str(), static_cast<long long>(block), static_cast<long long>(depth),
                 static_cast<long long>(threads), direct ? ", O_DIRECT" : ", buffered (no O_DIRECT here)");
    // Rounds that interleave ours and fio's, so that a disk whose speed drifts
    // treats both alike. Medians are reported. --mode fresh: each write goes
    // to a newly allocated file (fallocated: unwritten extents); overwrite:
    // one file, written once before the rounds, rewritten by every round (fio
    // with --overwrite=1), the steady state of swap files.
    const bool overwrite = mode == "overwrite";
    if (overwrite) {
      file->reserve(size);
      transfer(true);
    }
    std::vector<double> ours_w_runs, ours_r_runs, fio_w_runs, fio_r_runs;
    ProgressLine progress("aio vs fio", rounds, "rounds");
    for (int64_t round = 0; round < rounds; ++round) {
      zero::runs::check_stop();  // a stop signal ends the bench here (zero_cli.cpp); Cleanup removes the files
      // In fresh mode each side starts with no file and leaves none behind,
      // closed and removed outside the timed part: freeing a 1 GiB file's
      // extents is disk work that must not land in the other side's timing.
      auto ours = [&] {
        if (!overwrite) {
          ::unlink(file_path.c_str());
          file = offload::AioFile::open(file_path, true);
          file->reserve(size);  // as fio lays its file out before writing (fallocate)
        }
        ours_w_runs.push_back(size / seconds([&] { transfer(true); }));
        ::fsync(file->buffered_fd());
        zero::runs::check_stop();
        ours_r_runs.push_back(size / seconds([&] { transfer(false); }));
        if (!overwrite) {
          file.reset();
          ::unlink(file_path.c_str());
        }
      };
      auto theirs = [&] {
        fio_w_runs.push_back(fio_bw(file_path, "write", size, block, depth, overwrite, log));
        fio_r_runs.push_back(fio_bw(file_path, "read", size, block, depth, overwrite, log));
        if (!overwrite) ::unlink(file_path.c_str());
      };
      if (round % 2 == 0) ours(), theirs();  // who goes first alternates
      else theirs(), ours();
      progress.update(round + 1, "");
    }
    progress.finish("");
    ::unlink(file_path.c_str());
    ::unlink(log.c_str());
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const double ours_w = median(ours_w_runs), ours_r = median(ours_r_runs);
    const double fio_w = median(fio_w_runs), fio_r = median(fio_r_runs);
    std::printf("zero bench aio: %s sequential (%s file), block %lld, queue depth %lld, %lld thread(s), median of %lld "
                "interleaved rounds\n",
                format_bytes(size).c_str(), overwrite ? "an already written" : "a freshly allocated", static_cast<long long>(block), static_cast<long long>(depth),
                static_cast<long long>(threads), static_cast<long long>(rounds));
    std::printf("  %-8s %14s %14s %10s\n", "", "zero GB/s", "fio GB/s", "zero/fio");
    std::printf("  %-8s %14.3f %14.3f %10.3f\n", "write", ours_w / 1e9, fio_w / 1e9, fio_w > 0 ? ours_w / fio_w : 0.0);
    std::printf("  %-8s %14.3f %14.3f %10.3f\n", "read", ours_r / 1e9, fio_r / 1e9, fio_r > 0 ? ours_r / fio_r : 0.0);
    auto list = [](const std::vector<double>& v) {
      std::string out;
      for (double x : v) out += (out.empty() ? "" : " ") + std::to_string(x / 1e9).substr(0, 5);
      return out;
    };
    std::printf("  rounds (GB/s): zero write %s | fio write %s | zero read %s | fio read %s\n", list(ours_w_runs).c_str(),
                list(fio_w_runs).c_str(), list(ours_r_runs).c_str(), list(fio_r_runs).c_str());
    if (fio_w < 0 || fio_r < 0) std::printf("  (fio failed; see its output with the same options)\n");
    if (!json_path.empty()) {
      nlohmann::json j = {{"benchmark", "aio"},          {"size_bytes", size},
                          {"block_size_bytes", block},   {"queue_depth", depth},
                          {"threads", threads},          {"direct", direct},
                          {"rounds", rounds},              {"buffer_bytes", buffer},
                          {"mode", mode},
                          {"write_gb_per_s", ours_w / 1e9}, {"read_gb_per_s", ours_r / 1e9},
                          {"fio_write_gb_per_s", fio_w / 1e9}, {"fio_read_gb_per_s", fio_r / 1e9},
                          {"ratio_write_vs_fio", fio_w > 0 ? ours_w / fio_w : 0.0},
                          {"ratio_read_vs_fio", fio_r > 0 ? ours_r / fio_r : 0.0}};
      write_json_output(json_path, j);
    }
    return 0;
  } catch (const zero::runs::Interrupted&) {
    throw;  // zero_cli.cpp says so; Cleanup has removed the files
  } catch (const std::exception& e) {
    std::cerr << "zero bench aio: " << zero::error_text(e) << "\n";
    return 1;
  }
}

}  // namespace zero::tools
