// zero bench transfer: host-device copies on the copy stream the engine uses
// (CopyStream), host-to-device and device-to-host, from and to three kinds of
// host memory side by side in one run: the pinned tier (LedgerAlloc's
// cudaHostAlloc buffers, NOTE [pinned host memory]), LibTorch's caching
// pinned allocator (at::empty with pinned_memory) and pageable memory. Each
// is said page-locked or not as the driver reports it (zero::page_locked),
// not as Tensor::is_pinned() does. A GPU only: without one it says so.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>

#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#include "bench.h"
#include "zero/core/ledger_alloc.h"
#include "zero/core/memory_ledger.h"
#include "zero/core/streams.h"
#include "zero/core/text.h"

namespace zero::tools {
namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int bench_transfer(const std::vector<std::string>& args) {
  std::map<std::string, int64_t> ints = {{"--bytes", int64_t{1} << 30}, {"--rounds", 5}};
  std::string json_path;
  if (!parse_bench_options("zero bench transfer", args, ints, json_path)) return 2;
  if (!torch::cuda::is_available()) {
    std::cerr << "zero bench transfer: needs a CUDA device (it times host-device copies); this machine has none\n";
    return 2;
  }
  const int64_t dev_index = 0;  // cuda:0, as the engine's rank 0
  const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(dev_index));
  const int64_t numel = std::max<int64_t>(1, ints["--bytes"] / 4), rounds = ints["--rounds"];
  const double gb = static_cast<double>(numel) * 4 / 1e9;
  MemoryLedger ledger;
  ledger.set_page_locking(true, static_cast<int>(dev_index));
  struct Kind_ {
    std::string name;
    at::Tensor host;
    std::vector<double> h2d, d2h;
  };
  std::vector<Kind_> kinds;
  kinds.push_back({"pinned tier (cudaHostAlloc)", LedgerAlloc::host_empty(ledger, numel, at::kFloat, /*pin=*/true,
                                                                            Kind::kOptimizerStates, "bench buffer"), {}, {}});
  kinds.push_back({"LibTorch pinned allocator",
                   at::empty({numel}, at::TensorOptions().dtype(at::kFloat).pinned_memory(true)), {}, {}});
  kinds.push_back({"pageable", at::empty({numel}, at::kFloat), {}, {}});
  for (auto& k : kinds) k.host.fill_(1.0f);
  at::Tensor dev = at::empty({numel}, at::TensorOptions().dtype(at::kFloat).device(device));
  CopyStream stream(device);
  // Round 0 warms up (first touch, the driver's staging); rounds rotate the
  // order so a drifting machine treats the kinds alike; medians are reported.
  for (int64_t r = 0; r <= rounds; ++r) {
    for (size_t j = 0; j < kinds.size(); ++j) {
      auto& k = kinds[(j + static_cast<size_t>(r)) % kinds.size()];
      const double up = seconds([&] { stream.copy(dev, k.host, /*host_source=*/true).synchronize(); });
      const double down = seconds([&] { stream.copy(k.host, dev).synchronize(); });
      if (r > 0) k.h2d.push_back(up), k.d2h.push_back(down);
    }
  }
  std::printf("zero bench transfer: %s per copy on %s (CopyStream, %lld rounds, medians)\n",
              format_bytes(numel * 4).c_str(), device.str().c_str(), static_cast<long long>(rounds));
  std::printf("%-30s %12s %12s %12s\n", "host memory", "page-locked", "H2D GB/s", "D2H GB/s");
  nlohmann::json out = {{"bytes", numel * 4}, {"rounds", rounds}, {"device", device.str()},
                        {"kinds", nlohmann::json::array()}};
  for (const auto& k : kinds) {
    const double up = gb / median(k.h2d), down = gb / median(k.d2h);
    std::printf("%-30s %12s %12.1f %12.1f\n", k.name.c_str(), page_locked(k.host) ? "yes" : "no", up, down);
    out["kinds"].push_back({{"name", k.name},
                            {"page_locked", page_locked(k.host)},
                            {"h2d_gb_per_s", up},
                            {"d2h_gb_per_s", down},
                            {"h2d_s", k.h2d},
                            {"d2h_s", k.d2h}});
  }
  if (!json_path.empty()) write_json_output(json_path, out);
  return 0;
}

}  // namespace zero::tools
