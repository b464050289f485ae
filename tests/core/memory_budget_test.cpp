// Memory budgets: the ledger's host cap (pinned and pageable together) and a
// CPU run's device cap in the counting allocator (NOTE [emulated device
// memory]); the byte counts users write for them.
#include <gtest/gtest.h>

#include <functional>

#include <ATen/ATen.h>

#include "zero/core/error.h"
#include "zero/core/ledger_alloc.h"
#include "zero/core/memory_ledger.h"
#include "zero/core/text.h"

namespace {

using zero::Kind;
using zero::LedgerAlloc;
using zero::Tier;

constexpr int64_t kMiB = 1 << 20;

std::string oom_text(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const zero::OutOfMemoryError& e) {
    return e.what();
  }
  return "";
}

TEST(MemoryBudget, HostCapCountsPinnedAndPageableTogether) {
  zero::MemoryLedger ledger;
  ledger.set_host_limit(10 * kMiB, "the test's --host-memory");
  auto a = LedgerAlloc::empty(ledger, 6 * kMiB, at::kByte, at::kCPU, Tier::kPinnedHost, Kind::kOptimizerStates, "a");
  auto b = LedgerAlloc::empty(ledger, 3 * kMiB, at::kByte, at::kCPU, Tier::kHost, Kind::kOptimizerStates, "b");
  const auto text = oom_text([&] {
    LedgerAlloc::empty(ledger, 2 * kMiB, at::kByte, at::kCPU, Tier::kHost, Kind::kGradients, "the grads");
  });
  EXPECT_NE(text.find("out of memory on the host (pinned and pageable)"), std::string::npos) << text;
  EXPECT_NE(text.find("the grads needs 2.00 MiB"), std::string::npos) << text;
  EXPECT_NE(text.find("9.00 MiB already in use"), std::string::npos) << text;
  EXPECT_NE(text.find("limit 10.00 MiB"), std::string::npos) << text;
  EXPECT_NE(text.find("the test's --host-memory"), std::string::npos) << text;
  // A pinned buffer past the host cap does not fall back to pageable memory.
  EXPECT_NE(oom_text([&] { LedgerAlloc::host_empty(ledger, 2 * kMiB, at::kByte, true, Kind::kGradients, "g"); }), "");
  // Within it, it does (and counts once).
  b.reset();
  auto c = LedgerAlloc::host_empty(ledger, 2 * kMiB, at::kByte, true, Kind::kGradients, "g");
  EXPECT_EQ(ledger.get(Tier::kPinnedHost).current_bytes + ledger.get(Tier::kHost).current_bytes, 8 * kMiB);
}

// Removes the process-wide device cap however the test ends.
struct DeviceCap {
  DeviceCap(int64_t n, const std::string& help) { zero::limit_cpu_device_memory(n, help); }
  ~DeviceCap() { zero::limit_cpu_device_memory(0, ""); }
};

TEST(MemoryBudget, CpuDeviceCapRefusesTheAllocationPastIt) {
  zero::install_counting_cpu_allocator();
  const int64_t before = zero::cpu_device_stats().current_bytes;
  DeviceCap cap(before + 8 * kMiB, "the test's --device-memory; would help: stage 3");
  EXPECT_EQ(zero::cpu_device_stats().limit_bytes, before + 8 * kMiB);
  auto a = at::empty({5 * kMiB}, at::kByte);
  const auto text = oom_text([&] { auto b = at::empty({4 * kMiB}, at::kByte); });
  EXPECT_NE(text.find("out of memory on the device"), std::string::npos) << text;
  EXPECT_NE(text.find("4.00 MiB asked"), std::string::npos) << text;
  EXPECT_NE(text.find("the test's --device-memory; would help: stage 3"), std::string::npos) << text;
  // Host-tier buffers are host memory, not the device's.
  zero::MemoryLedger ledger;
  auto host = LedgerAlloc::empty(ledger, 16 * kMiB, at::kByte, at::kCPU, Tier::kHost, Kind::kOptimizerStates, "h");
  EXPECT_LE(zero::cpu_device_stats().current_bytes, before + 6 * kMiB);
  // Device-tier ones are the device's.
  EXPECT_NE(oom_text([&] {
              LedgerAlloc::empty(ledger, 4 * kMiB, at::kByte, at::kCPU, Tier::kDevice, Kind::kParameters, "p");
            }),
            "");
  EXPECT_GE(zero::cpu_device_stats().peak_bytes, before + 5 * kMiB);
  a.reset();
  auto c = at::empty({7 * kMiB}, at::kByte);  // room again
}

// A CPU run's pinned tier is ordinary host memory counted as pinned_host
// (NOTE [pinned host memory]); no buffer of zero elements is counted.
TEST(MemoryBudget, PinnedTierWithoutPageLockingIsCountedHostMemory) {
  zero::MemoryLedger ledger;
  ledger.set_page_locking(false);
  auto t = LedgerAlloc::host_empty(ledger, kMiB + 3, at::kFloat, /*pin=*/true, Kind::kCommBuffers, "ring");
  EXPECT_FALSE(t.is_pinned());
  EXPECT_EQ(ledger.get(Tier::kPinnedHost).current_bytes, (kMiB + 3) * 4);
  t.fill_(1);
  EXPECT_EQ(t.sum().item<double>(), static_cast<double>(kMiB + 3));
  t.reset();
  EXPECT_EQ(ledger.get(Tier::kPinnedHost).current_bytes, 0);
  auto none = LedgerAlloc::empty(ledger, 0, at::kFloat, at::kCPU, Tier::kDevice, Kind::kActivations, "nothing");
  EXPECT_EQ(none.numel(), 0);
  EXPECT_EQ(ledger.get(Tier::kDevice).peak_bytes, 0);
}

TEST(MemoryBudget, ByteSizesAsUsersWriteThem) {
  EXPECT_EQ(zero::parse_byte_size("4096"), 4096);
  EXPECT_EQ(zero::parse_byte_size("80e9"), 80000000000);
  EXPECT_EQ(zero::parse_byte_size("512MiB"), 512 * kMiB);
  EXPECT_EQ(zero::parse_byte_size("1.5GiB"), 1536 * kMiB);
  EXPECT_EQ(zero::parse_byte_size("2GB"), 2000000000);
  EXPECT_EQ(zero::parse_byte_size("1TiB"), int64_t{1} << 40);
  for (const char* bad : {"", "MiB", "-1", "0", "0.5", "1e30", "12 MiB", "1XB", "0x10", "nan", "inf"})
    EXPECT_FALSE(zero::parse_byte_size(bad).has_value()) << bad;
}

}  // namespace
