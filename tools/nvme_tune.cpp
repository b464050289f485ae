// zero nvme-tune: finds the `aio` settings that move data fastest between
// memory and a file under --path, the way NVMe offload does (O_DIRECT
// sequential writes and reads of swap-file-sized transfers). Every
// combination of block size, queue depth, thread count, single_submit and
// overlap_events writes and then reads the same file once (a fallocated file,
// written once before the sweep, as swap files are overwritten every step);
// the five fastest are measured again, alternating, and ranked by the median.
// The score is the rate of a write and a read of the same bytes (2 x size /
// (write time + read time)): an optimizer step does both.
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>

#include <nlohmann/json.hpp>

#include "bench.h"
#include "zero/snapshots/checkpoint_format.h"
#include "zero/offload/aio.h"
#include "zero/core/error.h"
#include "zero/core/progress.h"
#include "zero/core/text.h"

namespace zero::tools {
namespace {

struct Setting {
  offload::AioOptions aio;
  std::vector<double> write_gbs, read_gbs, both_gbs;

  double median(std::vector<double> v) const {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : v[v.size() / 2];
  }
  double score() const { return median(both_gbs); }
  nlohmann::json section() const {  // the config's names
    return {{"block_size", aio.block_size},
            {"queue_depth", aio.queue_depth},
            {"intra_op_parallelism", aio.threads},
            {"single_submit", aio.single_submit},
            {"overlap_events", aio.overlap_events}};
  }
};

// A whole number of 1 or more, digits only ("2.5", "1MiB" and "0x10" are not).
std::optional<int64_t> parse_count(const std::string& v) {
  if (v.empty() || v.size() > 12 || v.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  const int64_t n = std::stoll(v);
  return n >= 1 ? std::optional<int64_t>(n) : std::nullopt;
}

// /proc/meminfo's MemAvailable (free memory and the page cache the kernel
// would give up), in bytes; -1 when it cannot be read.
int64_t available_memory() {
  std::ifstream in("/proc/meminfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("MemAvailable:", 0) == 0) {
      try {
        return std::stoll(line.substr(13)) * 1024;
      } catch (const std::exception&) {
        return -1;
      }
    }
  return -1;
}

const char* kNvmeTuneUsage = R"(usage: zero nvme-tune --path DIR [--size 256MiB] [--rounds 3] [--json FILE]

Finds the `aio` settings that move data fastest between memory and a file
under DIR (the folder offload_*.nvme_path will name): every combination of
block size, queue depth, threads, single_submit and overlap_events writes and
reads a file of --size once; the five fastest are measured --rounds times
more. Prints the config's `aio` section; --json writes the measurements.
)";

}  // namespace

int nvme_tune(const std::vector<std::string>& args) {
  std::string path, json_path;
  int64_t size = 256 << 20, rounds = 3;
  const std::vector<std::string> known = {"--path", "--size", "--rounds", "--json"};
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      std::cout << kNvmeTuneUsage;
      return 0;
    }
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (i + 1 >= args.size() || std::find(known.begin(), known.end(), a) == known.end()) {
      const std::string near = nearest(a, known);
      std::cerr << "zero nvme-tune: " << a << ": unknown option or missing value"
                << (near.empty() ? "" : "; did you mean " + near + "?") << "\noptions: --path DIR [--size 256MiB "
                << "--rounds N --json FILE]\n";
      return 2;
    }
    if (std::count(args.begin(), args.begin() + static_cast<std::ptrdiff_t>(i), a) != 0) {
      std::cerr << "zero nvme-tune: " << a << " given twice: give it once\n";
      return 2;
    }
    const std::string& v = args[++i];
    if (a == "--path") {
      path = v;
    } else if (a == "--json") {
      json_path = v;
    } else if (a == "--size") {
      const auto n = parse_byte_size(v);
      if (!n) {
        std::cerr << "zero nvme-tune: --size: expected a size in bytes of 1 or more, with a unit of B, KB, MB, GB, TB, "
                  << "KiB, MiB, GiB or TiB (such as 256MiB or 1GiB); got \"" << v << "\"\n";
        return 2;
      }
      size = *n;
    } else {
      const auto n = parse_count(v);
      if (!n || *n > 1000) {
        std::cerr << "zero nvme-tune: --rounds: expected a whole number of rounds from 1 to 1000; got \"" << v << "\"\n";
        return 2;
      }
      rounds = *n;
    }
  }
  if (!json_path.empty())
    if (const std::string problem = ckpt::output_file_problem("--json", json_path); !problem.empty()) {
      std::cerr << "zero nvme-tune: " << problem << "\n";
      return 2;
    }
  if (path.empty()) {
    std::cerr << "zero nvme-tune: --path DIR is required (a folder on the disk that nvme_path will name)\n";
    return 2;
  }
  if (!ckpt::is_folder(path)) {
    std::cerr << "zero nvme-tune: --path " << path << ": " << (ckpt::path_exists(path) ? "is a file" : "no such folder")
              << "; expected a folder on the disk to measure (its test files are made and removed there)\n";
    return 2;
  }
  // A folder that takes no files (/proc, a read-only mount) is named here,
  // not by the first write's errno.
  if (const std::string problem = ckpt::save_folder_problem("--path", path); !problem.empty()) {
    std::cerr << "zero nvme-tune: " << problem << "; expected a folder on the disk to measure, where files can be "
              << "made (its test files are made and removed there)\n";
    return 2;
  }
  size = std::max<int64_t>(offload::kAioAlignment, size / offload::kAioAlignment * offload::kAioAlignment);
  // The test file is made on the disk and its bytes held in memory: both
  // must have room, said here rather than by a failed allocation.
  if (struct statvfs fs {}; ::statvfs(path.c_str(), &fs) == 0) {
    const int64_t free_bytes = static_cast<int64_t>(fs.f_bavail) * static_cast<int64_t>(fs.f_frsize);
    if (size > free_bytes) {
      std::cerr << "zero nvme-tune: --size " << format_bytes(size) << ": more than the " << format_bytes(free_bytes)
                << " free under --path " << path << "; give a smaller --size (256MiB, the default, measures a disk "
                << "well)\n";
      return 2;
    }
  }
  if (const int64_t available = available_memory(); available > 0 && size > available / 2) {
    std::cerr << "zero nvme-tune: --size " << format_bytes(size) << ": more than half of the "
              << format_bytes(available) << " of memory available here (MemAvailable), which holds the transfer's "
              << "bytes; give a smaller --size\n";
    return 2;
  }
  std::vector<Setting> settings;
  for (int64_t block : {256 << 10, 1 << 20, 4 << 20, 16 << 20})
    for (int64_t depth : {4, 8, 16, 32})
      for (int64_t threads : {1, 2, 4})
        for (bool single : {false, true})
          for (bool overlap : {true, false})
            settings.push_back({offload::AioOptions{block, depth, threads, single, overlap}, {}, {}, {}});
  const std::string file_path = path + "/zero-nvme-tune-" + std::to_string(getpid());
  try {
    auto file = offload::AioFile::open(file_path, true);
    ::unlink(file_path.c_str());  // the open descriptor keeps it; nothing is left behind
    file->reserve(size);
    offload::AlignedBuffer buf(size);
    std::memset(buf.data(), 0x5a, static_cast<size_t>(buf.size()));
    std::fprintf(stderr, "zero nvme-tune: %s, %s per transfer, %zu settings%s\n", path.c_str(),
                 format_bytes(size).c_str(), settings.size(),
                 file->direct() ? ", O_DIRECT" : ", buffered (this filesystem refuses O_DIRECT)");
    {
      offload::AioEngine first(offload::AioOptions{});
      first.write(file, buf.data(), size, 0).wait();  // from now on every write overwrites
    }
    auto measure = [&](Setting& s) {
      offload::AioEngine engine(s.aio);
      const double tw = seconds([&] { engine.write(file, buf.data(), size, 0).wait(); });
      const double tr = seconds([&] { engine.read(file, buf.data(), size, 0).wait(); });
      s.write_gbs.push_back(size / tw / 1e9);
      s.read_gbs.push_back(size / tr / 1e9);
      s.both_gbs.push_back(2.0 * size / (tw + tr) / 1e9);
    };
    ProgressLine sweep("sweep", static_cast<int64_t>(settings.size()), "settings");
    for (size_t i = 0; i < settings.size(); ++i) {
      measure(settings[i]);
      sweep.update(static_cast<int64_t>(i + 1));
    }
    sweep.finish();
    std::sort(settings.begin(), settings.end(), [](const Setting& a, const Setting& b) { return a.score() > b.score(); });
    // The disk's speed drifts: the leaders go again, in turns, and the median ranks them.
    const size_t top = std::min<size_t>(5, settings.size());
    ProgressLine again("re-measuring the fastest", static_cast<int64_t>(top * rounds), "runs");
    for (int64_t r = 0; r < rounds; ++r) {
      for (size_t i = 0; i < top; ++i) {
        measure(settings[i]);
        again.update(static_cast<int64_t>(r * top + i + 1));
      }
    }
    again.finish();
    std::sort(settings.begin(), settings.begin() + static_cast<std::ptrdiff_t>(top),
              [](const Setting& a, const Setting& b) { return a.score() > b.score(); });
    std::printf("zero nvme-tune: %s, %s write then read per setting (GB/s = 1e9 bytes/s; medians)\n", path.c_str(),
                format_bytes(size).c_str());
    std::printf("  %10s %6s %8s %7s %8s %10s %10s %10s\n", "block", "depth", "threads", "single", "overlap",
                "write", "read", "both");
    const size_t shown = std::min<size_t>(12, settings.size());
    for (size_t i = 0; i < shown; ++i) {
      const Setting& s = settings[i];
      std::printf("  %10s %6lld %8lld %7s %8s %10.3f %10.3f %10.3f%s\n", format_bytes(s.aio.block_size).c_str(),
                  static_cast<long long>(s.aio.queue_depth), static_cast<long long>(s.aio.threads),
                  s.aio.single_submit ? "yes" : "no", s.aio.overlap_events ? "yes" : "no", s.median(s.write_gbs),
                  s.median(s.read_gbs), s.score(), i < top ? "" : "  (one run)");
    }
    const Setting& best = settings.front();
    const Setting* dflt = nullptr;
    for (const auto& s : settings)
      if (s.section() == Setting{}.section()) dflt = &s;  // AioOptions' defaults are DeepSpeed's
    if (dflt != nullptr) {
      std::printf("  best / DeepSpeed's defaults (1 MiB, depth 8, 1 thread): %.2f (the defaults: median of %zu run%s)\n",
                  best.score() / dflt->score(), dflt->both_gbs.size(), dflt->both_gbs.size() == 1 ? "" : "s");
    }
    std::printf("\nPaste into the DeepSpeed config:\n\"aio\": %s\n", best.section().dump().c_str());
    if (!json_path.empty()) {
      nlohmann::json rows = nlohmann::json::array();
      for (const auto& s : settings) {
        rows.push_back({{"aio", s.section()},
                        {"write_gb_per_s", s.median(s.write_gbs)},
                        {"read_gb_per_s", s.median(s.read_gbs)},
                        {"both_gb_per_s", s.score()},
                        {"runs", s.both_gbs.size()}});
      }
      nlohmann::json j = {{"tool", "nvme-tune"}, {"path", path}, {"transfer_bytes", size}, {"best_aio", best.section()},
                          {"best_both_gb_per_s", best.score()}, {"settings", rows}};
      write_json_output(json_path, j);
    }
  } catch (const zero::Error& e) {
    std::cerr << "zero nvme-tune: " << zero::error_text(e) << "\n";
    return 1;
  }
  return 0;
}

}  // namespace zero::tools
