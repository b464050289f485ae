// The optimizer-state swapper (NOTE [optimizer swapping]) and the parameter
// swapper (NOTE [parameter swapping]): exact round trips
// through every pipeline setting at sub-group sizes that are not multiples of
// the block size, and failed reads and writes that name the file and leave
// nothing silently wrong.
#include <gtest/gtest.h>

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "zero/core/error.h"
#include "zero/core/streams.h"
#include "zero/partition/flat_parameters.h"
#include "zero/partition/param_swapper.h"
#include "zero/partition/state_swapper.h"

namespace {

using zero::partition::StateSwapper;
using zero::partition::SwapOptions;

std::string fresh_dir(const std::string& name) {
  const std::string d = std::string(ZERO_BINARY_DIR) + "/tests/swapper_" + std::to_string(getpid()) + "_" + name;
  ::mkdir(d.c_str(), 0700);
  return d;
}

bool empty_dir(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return false;
  int n = 0;
  while (::readdir(d) != nullptr) ++n;
  ::closedir(d);
  return n == 2;
}

// The value tensor i of sub-group k holds at element j after `round` updates.
float value(size_t k, size_t i, int64_t j, int round) {
  return static_cast<float>(k * 1000003 + i * 7919 + static_cast<size_t>(j)) * 0.5f + static_cast<float>(round);
}

void fill(size_t k, const std::vector<at::Tensor>& t, int round) {
  for (size_t i = 0; i < t.size(); ++i) {
    float* p = t[i].data_ptr<float>();
    for (int64_t j = 0; j < t[i].numel(); ++j) p[j] = value(k, i, j, round);
  }
}

// Counts the elements that differ from round `round`.
int64_t mismatches(size_t k, const std::vector<at::Tensor>& t, int round) {
  int64_t bad = 0;
  for (size_t i = 0; i < t.size(); ++i) {
    const float* p = t[i].data_ptr<float>();
    for (int64_t j = 0; j < t[i].numel(); ++j) bad += p[j] != value(k, i, j, round);
  }
  return bad;
}

struct Pipeline {
  int64_t buffers;
  bool read, write;
};

class SwapperRoundTrip : public ::testing::TestWithParam<Pipeline> {};

TEST_P(SwapperRoundTrip, EveryValueComesBackExactlyAfterEachPass) {
  const Pipeline p = GetParam();
  const std::string dir = fresh_dir("rt" + std::to_string(p.buffers) + (p.read ? "r" : "") + (p.write ? "w" : ""));
  zero::MemoryLedger ledger;
  SwapOptions o;
  o.nvme_path = dir;
  o.buffer_count = p.buffers;
  o.pipeline_read = p.read;
  o.pipeline_write = p.write;
  o.aio.block_size = 65536;  // several blocks per transfer
  // Sizes off every boundary: 1 element, a 4 KiB block less one float, more
  // than a block, and one of many blocks with a ragged end.
  const std::vector<int64_t> sizes{1, 1023, 70001, 3, 262151};
  {
    StateSwapper sw(sizes, {"fp32_master", "exp_avg", "exp_avg_sq"}, o, ledger);
    EXPECT_TRUE(empty_dir(dir)) << "swap files are unlinked once open";
    EXPECT_EQ(ledger.get(zero::Tier::kNvme).current_bytes, sw.file_bytes());
    sw.pass(false, true, [](size_t k, const std::vector<at::Tensor>& t) { fill(k, t, 0); });
    for (int round = 1; round <= 3; ++round) {
      if (round != 2) sw.prefetch();  // as the engine does when backward starts
      std::vector<size_t> seen;
      sw.pass(true, true, [&](size_t k, const std::vector<at::Tensor>& t) {
        seen.push_back(k);
        EXPECT_EQ(t[0].numel(), sizes[k]);
        EXPECT_EQ(mismatches(k, t, round - 1), 0) << "sub-group " << k << " before round " << round;
        fill(k, t, round);
      });
      EXPECT_EQ(seen, (std::vector<size_t>{0, 1, 2, 3, 4}));
    }
    int64_t bad = 0;
    sw.pass(true, false, [&](size_t k, const std::vector<at::Tensor>& t) { bad += mismatches(k, t, 3); });
    EXPECT_EQ(bad, 0);
    // Prefetched reads are not written over the values of a pass that sets them.
    sw.prefetch();
    sw.pass(false, true, [](size_t k, const std::vector<at::Tensor>& t) { fill(k, t, 4); });
    sw.pass(true, false, [&](size_t k, const std::vector<at::Tensor>& t) { bad += mismatches(k, t, 4); });
    EXPECT_EQ(bad, 0);
    EXPECT_GT(sw.stats().bytes_read, 0);
    EXPECT_EQ(sw.stats().passes, 7);
  }
  EXPECT_EQ(ledger.get(zero::Tier::kNvme).current_bytes, 0);
  EXPECT_TRUE(empty_dir(dir));
  ::rmdir(dir.c_str());
}

INSTANTIATE_TEST_SUITE_P(Pipelines, SwapperRoundTrip,
                         ::testing::Values(Pipeline{1, false, false}, Pipeline{1, true, true},
                                           Pipeline{2, true, false}, Pipeline{2, true, true},
                                           Pipeline{3, false, true}, Pipeline{4, true, true},
                                           Pipeline{8, true, true}),
                         [](const auto& info) {
                           const Pipeline& p = info.param;
                           return "buffers" + std::to_string(p.buffers) + (p.read ? "_read" : "") +
                                  (p.write ? "_write" : "");
                         });

// 8-bit Adam's tensors (NOTE [8-bit states]): bytes per element and an fp32
// scale per 256 elements come back exactly, in files of their own sizes.
TEST(SwapperRoundTrip, TensorsOfOtherDtypesAndBlockLengths) {
  const std::string dir = fresh_dir("mixed");
  zero::MemoryLedger ledger;
  SwapOptions o;
  o.nvme_path = dir;
  o.buffer_count = 2;
  o.pipeline_read = o.pipeline_write = true;
  const std::vector<int64_t> sizes{300, 70001, 5};
  {
    StateSwapper sw(sizes, std::vector<zero::partition::SwapTensor>{{"fp32_master", at::kFloat, 0},
                                                                     {"codes", at::kByte, 0},
                                                                     {"scales", at::kFloat, 256}},
                    o, ledger);
    auto aligned = [](int64_t b) { return (b + 4095) / 4096 * 4096; };
    int64_t want = 0;
    for (int64_t n : sizes) want += aligned(4 * n) + aligned(n) + aligned(4 * ((n + 255) / 256));
    EXPECT_EQ(sw.file_bytes(), want);
    auto fill8 = [&](size_t k, const std::vector<at::Tensor>& t, int round) {
      ASSERT_EQ(t[1].scalar_type(), at::kByte);
      ASSERT_EQ(t[2].numel(), (sizes[k] + 255) / 256);
      t[0].copy_(at::arange(sizes[k], at::kFloat).add_(round));
      t[1].copy_(at::arange(sizes[k], at::kInt).add_(round * 7 + static_cast<int>(k)).remainder_(251).to(at::kByte));
      t[2].copy_(at::arange(t[2].numel(), at::kFloat).mul_(0.5).add_(round));
    };
    sw.pass(false, true, [&](size_t k, const std::vector<at::Tensor>& t) { fill8(k, t, 1); });
    int64_t bad = 0;
    sw.pass(true, false, [&](size_t k, const std::vector<at::Tensor>& t) {
      std::vector<at::Tensor> want_t{at::empty_like(t[0]), at::empty_like(t[1]), at::empty_like(t[2])};
      fill8(k, want_t, 1);
      for (size_t i = 0; i < 3; ++i) bad += !t[i].equal(want_t[i]);
    });
    EXPECT_EQ(bad, 0);
  }
  EXPECT_TRUE(empty_dir(dir));
  ::rmdir(dir.c_str());
}

SwapOptions small_options(const std::string& dir) {
  SwapOptions o;
  o.nvme_path = dir;
  o.buffer_count = 3;
  o.pipeline_read = true;
  o.pipeline_write = true;
  return o;
}

// A write that fails (the disk full, say) fails the step that issued it, or
// with pipeline_write (the last writes finish behind the next forward) the
// next one, naming the file, the offset and the errno; the files then mix two
// steps, so every later pass refuses to run instead of training on them.
TEST(SwapperFaults, FailedWriteNamesTheFileAndStopsLaterSteps) {
  for (bool pipelined : {false, true}) {
    SCOPED_TRACE(pipelined ? "pipelined" : "serial");
    const std::string dir = fresh_dir(std::string("wfault") + (pipelined ? "p" : "s"));
    zero::MemoryLedger ledger;
    SwapOptions o = small_options(dir);
    o.pipeline_read = o.pipeline_write = pipelined;
    StateSwapper sw({5000, 5000, 5000}, std::vector<std::string>{"fp32_master", "exp_avg"}, o, ledger);
    sw.pass(false, true, [](size_t k, const std::vector<at::Tensor>& t) { fill(k, t, 0); });
    sw.engine_for_testing().inject_fault(/*on_write=*/true, ENOSPC);
    std::vector<std::string> errors;
    for (int step = 1; step <= 3; ++step) {
      try {
        sw.pass(true, true, [&](size_t k, const std::vector<at::Tensor>& t) {
          EXPECT_TRUE(errors.empty()) << "visited after a failed write was reported";
          fill(k, t, step);
        });
      } catch (const zero::IoError& e) {
        errors.push_back(e.what());
      }
    }
    ASSERT_GE(errors.size(), 2u) << "the failed write went unnoticed";
    EXPECT_EQ(errors.size(), pipelined ? 2u : 3u);
    const std::string& first = errors.front();
    EXPECT_NE(first.find("write of"), std::string::npos) << first;
    EXPECT_NE(first.find("fp32_master.swp"), std::string::npos) << first;
    EXPECT_NE(first.find("at offset 0"), std::string::npos) << first;
    EXPECT_NE(first.find("No space left on device"), std::string::npos) << first;
    const std::string& last = errors.back();
    EXPECT_NE(last.find("inconsistent"), std::string::npos) << last;
    EXPECT_NE(last.find("No space left on device"), std::string::npos) << last;  // the first error
    ::rmdir(dir.c_str());
  }
}

// A read that fails before anything was written leaves the files as they
// were: the error names the file, and the next pass sees the old values.
TEST(SwapperFaults, FailedReadNamesTheFileAndLosesNothing) {
  const std::string dir = fresh_dir("rfault");
  zero::MemoryLedger ledger;
  StateSwapper sw({5000, 7000}, std::vector<std::string>{"fp32_master", "exp_avg"}, small_options(dir), ledger);
  sw.pass(false, true, [](size_t k, const std::vector<at::Tensor>& t) { fill(k, t, 0); });
  sw.engine_for_testing().inject_fault(/*on_write=*/false, EIO);
  int visited = 0;
  try {
    sw.pass(true, true, [&](size_t k, const std::vector<at::Tensor>& t) {
      ++visited;
      fill(k, t, 1);
    });
    FAIL() << "the failed read went unnoticed";
  } catch (const zero::IoError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("read of"), std::string::npos) << msg;
    EXPECT_NE(msg.find("fp32_master.swp"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Input/output error"), std::string::npos) << msg;
  }
  EXPECT_EQ(visited, 0) << "a sub-group was stepped from a buffer that was never filled";
  int64_t bad = 0;
  sw.pass(true, false, [&](size_t k, const std::vector<at::Tensor>& t) { bad += mismatches(k, t, 0); });
  EXPECT_EQ(bad, 0);
  ::rmdir(dir.c_str());
}

TEST(SwapperOptions, BufferCountBelowOneIsAConfigError) {
  const std::string dir = fresh_dir("opts");
  zero::MemoryLedger ledger;
  SwapOptions o = small_options(dir);
  o.buffer_count = 0;
  try {
    StateSwapper sw({10}, {"fp32_master"}, o, ledger);
    FAIL() << "buffer_count 0 accepted";
  } catch (const zero::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("zero_optimization.offload_optimizer.buffer_count"), std::string::npos)
        << e.what();
  }
  ::rmdir(dir.c_str());
}

// The swap buffers are pinned host memory when pin_memory asks (the pinned
// tier on the ledger), pageable when it does not, and pageable with a warning
// when the pinned limit is too small; each is aligned for O_DIRECT, and the
// ledger gives their bytes back when the swapper goes.
TEST(SwapperOptions, BuffersArePinnedWhenAskedAndWithinTheLimit) {
  const std::string dir = fresh_dir("pinned");
  using zero::Kind;
  using zero::Tier;
  struct Case {
    bool pin;
    int64_t pinned_limit;
    Tier want;
  };
  for (const Case c : {Case{true, int64_t{1} << 30, Tier::kPinnedHost}, Case{false, int64_t{1} << 30, Tier::kHost},
                       Case{true, 4096, Tier::kHost}}) {
    zero::MemoryLedger ledger;
    ledger.set_limit(Tier::kPinnedHost, c.pinned_limit, "test.pinned_limit");
    SwapOptions o = small_options(dir);
    o.pin_memory = c.pin;
    const Tier other = c.want == Tier::kHost ? Tier::kPinnedHost : Tier::kHost;
    {
      StateSwapper sw({5000, 5000, 5000}, std::vector<std::string>{"fp32_master", "exp_avg"}, o, ledger);
      // Three buffers of one 5,000-element sub-group of two tensors.
      const int64_t want = 3 * 2 * zero::offload::aio_aligned(5000 * 4);
      EXPECT_GE(ledger.get(c.want, Kind::kOptimizerStates).current_bytes, want) << "pin " << c.pin;
      EXPECT_LE(ledger.get(c.want, Kind::kOptimizerStates).current_bytes, want + zero::offload::kAioAlignment);
      EXPECT_EQ(ledger.get(other, Kind::kOptimizerStates).current_bytes, 0);
      // The buffers work: a pass writes and reads back through them.
      sw.pass(false, true, [&](size_t k, const std::vector<at::Tensor>& t) { t[0].fill_(static_cast<float>(k)); });
      sw.pass(true, false, [&](size_t k, const std::vector<at::Tensor>& t) {
        EXPECT_EQ(reinterpret_cast<uintptr_t>(t[0].data_ptr()) % zero::offload::kAioAlignment, 0u);
        EXPECT_TRUE(at::equal(t[0], at::full({5000}, static_cast<float>(k))));
      });
    }
    EXPECT_EQ(ledger.get(c.want, Kind::kOptimizerStates).current_bytes, 0);
  }
  ::rmdir(dir.c_str());
}

}  // namespace

// ---- stage 3's parameter shards (NOTE [parameter swapping]) ----------------

namespace {

using zero::partition::FlatParameters;
using zero::partition::GroupSpec;
using zero::partition::ParamSwapOptions;
using zero::partition::ParamSwapper;

// Group 0 (always in memory) and three layer groups of awkward sizes.
std::vector<GroupSpec> layer_groups() {
  std::vector<GroupSpec> specs(4);
  specs[0].params = {{"pos", at::arange(7, at::kFloat).requires_grad_()}};
  const int64_t sizes[] = {1, 3000, 70001};
  for (int i = 1; i <= 3; ++i) {
    specs[i].name = "blocks." + std::to_string(i);
    specs[i].params = {
        {"w" + std::to_string(i), at::arange(sizes[i - 1], at::kFloat).mul_(0.25).add_(i).requires_grad_()}};
  }
  return specs;
}

ParamSwapOptions param_options(const std::string& dir) {
  ParamSwapOptions o;
  o.swap.nvme_path = dir;
  o.swap.config_key = "zero_optimization.offload_param";
  o.swap.buffer_count = 2;
  o.buffer_size = 100000;
  o.max_in_cpu = 0;
  return o;
}

at::Tensor expected_shard(size_t g) { return layer_groups()[g].params[0].second.detach(); }

// The shard's first elements (the rest of the chunk is padding).
at::Tensor shard_of(const FlatParameters& flat, size_t g) {
  return flat.part(g).narrow(0, 0, expected_shard(g).numel());
}

TEST(ParamSwapper, ShardsRoundTripThroughTwoBuffersAndStepsWriteBack) {
  const std::string dir = fresh_dir("params");
  zero::MemoryLedger ledger;
  FlatParameters flat(layer_groups(), at::kFloat, at::kCPU, 1, 0, zero::Tier::kHost, ledger);
  {
    ParamSwapper sw(flat, param_options(dir), ledger);
    // Until swap_out() the shards stay in host memory (the start-up reads them).
    for (size_t g = 1; g <= 3; ++g) {
      EXPECT_FALSE(sw.on_disk(g));
      EXPECT_TRUE(at::equal(shard_of(flat, g), expected_shard(g))) << "group " << g;
    }
    sw.swap_out();
    EXPECT_TRUE(empty_dir(dir));
    EXPECT_FALSE(sw.on_disk(0));
    for (size_t g = 1; g <= 3; ++g) {
      EXPECT_TRUE(sw.on_disk(g));
      EXPECT_EQ(flat.part(g).numel(), 0) << "a shard on disk holds no memory";
    }
    // Three shards, two buffers: the third read takes a buffer back from a
    // shard that was only read ahead.
    for (size_t g = 1; g <= 3; ++g) EXPECT_TRUE(sw.start_read(g, /*may_wait=*/true));
    for (size_t g = 1; g <= 3; ++g) {
      sw.wait_read(g);
      EXPECT_TRUE(at::equal(shard_of(flat, g), expected_shard(g))) << "group " << g;
      sw.release(g);
    }
    for (size_t g = 1; g <= 3; ++g) {
      const at::Tensor& part = sw.begin_update(g);
      part.fill_(static_cast<float>(g) * 10);
      sw.end_update(g);
    }
    for (size_t g = 3; g >= 1; --g) {  // each read waits for its shard's write
      sw.wait_read(g);
      EXPECT_TRUE(at::equal(shard_of(flat, g), at::full({expected_shard(g).numel()}, static_cast<float>(g) * 10)));
      sw.release(g);
    }
  }
  EXPECT_TRUE(empty_dir(dir));
  ::rmdir(dir.c_str());
}

// A shard let go stays in its buffer: reading it again costs no disk read
// until the buffer is taken for another shard, and the one let go most
// recently is the one given up (NOTE [parameter swapping]). A step's new
// values are read back from the buffer too, after their write is done.
TEST(ParamSwapper, ALetGoShardIsReadAgainFromItsBuffer) {
  const std::string dir = fresh_dir("pcache");
  zero::MemoryLedger ledger;
  FlatParameters flat(layer_groups(), at::kFloat, at::kCPU, 1, 0, zero::Tier::kHost, ledger);
  ParamSwapper sw(flat, param_options(dir), ledger);  // two buffers, three shards
  sw.swap_out();
  // Reads group g and checks its values; true when it came from the disk.
  auto read = [&](size_t g, const at::Tensor& want) {
    const int64_t before = sw.stats().bytes_read;
    sw.wait_read(g);
    EXPECT_TRUE(at::equal(shard_of(flat, g), want)) << "group " << g;
    sw.release(g);
    EXPECT_EQ(flat.part(g).numel(), 0) << "a released shard is not the model's memory any more";
    return sw.stats().bytes_read > before;
  };
  // The buffers keep the last shards written to disk at the start: 2 and 3.
  EXPECT_FALSE(read(3, expected_shard(3))) << "group 3 was still in a buffer";
  EXPECT_FALSE(read(2, expected_shard(2)));
  EXPECT_GT(sw.stats().bytes_cached, 0);
  // Group 1 takes the buffer let go last (group 2's); group 3 stays.
  EXPECT_TRUE(read(1, expected_shard(1)));
  EXPECT_FALSE(read(3, expected_shard(3)));
  EXPECT_TRUE(read(2, expected_shard(2)));  // takes group 3's
  EXPECT_FALSE(read(1, expected_shard(1)));
  // New values: written back, and read again from the buffer they were written from.
  at::Tensor& part = const_cast<at::Tensor&>(sw.begin_update(2));
  part.fill_(-3);
  sw.end_update(2);
  const at::Tensor updated = at::full({expected_shard(2).numel()}, -3.0f);
  EXPECT_FALSE(read(2, updated));
  // Group 3 takes group 2's buffer, then group 2 comes from the disk: the
  // write-back landed.
  EXPECT_TRUE(read(3, expected_shard(3)));
  EXPECT_TRUE(read(2, updated));
  ::rmdir(dir.c_str());
}

TEST(ParamSwapper, MaxInCpuKeepsTheFirstLayersInMemory) {
  const std::string dir = fresh_dir("maxincpu");
  zero::MemoryLedger ledger;
  FlatParameters flat(layer_groups(), at::kFloat, at::kCPU, 1, 0, zero::Tier::kHost, ledger);
  ParamSwapOptions o = param_options(dir);
  o.max_in_cpu = 5000;  // groups 1 and 2 (256 + 3072 padded elements) fit; group 3 does not
  ParamSwapper sw(flat, o, ledger);
  sw.swap_out();
  EXPECT_FALSE(sw.on_disk(1));
  EXPECT_FALSE(sw.on_disk(2));
  EXPECT_TRUE(sw.on_disk(3));
  EXPECT_TRUE(at::equal(shard_of(flat, 2), expected_shard(2)));
  ::rmdir(dir.c_str());
}

TEST(ParamSwapper, FailedReadNamesTheFileAndCanBeRetried) {
  const std::string dir = fresh_dir("preadfault");
  zero::MemoryLedger ledger;
  FlatParameters flat(layer_groups(), at::kFloat, at::kCPU, 1, 0, zero::Tier::kHost, ledger);
  ParamSwapper sw(flat, param_options(dir), ledger);
  sw.swap_out();
  sw.engine_for_testing().inject_fault(/*on_write=*/false, EIO);
  try {
    sw.wait_read(1);  // (groups 2 and 3 are still in the buffers they were written from)
    FAIL() << "the failed read went unnoticed";
  } catch (const zero::IoError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("params.swp"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Input/output error"), std::string::npos) << msg;
  }
  sw.wait_read(1);  // on disk still: read again
  EXPECT_TRUE(at::equal(shard_of(flat, 1), expected_shard(1)));
  ::rmdir(dir.c_str());
}

TEST(ParamSwapper, FailedWriteBackStopsLaterReads) {
  const std::string dir = fresh_dir("pwritefault");
  zero::MemoryLedger ledger;
  FlatParameters flat(layer_groups(), at::kFloat, at::kCPU, 1, 0, zero::Tier::kHost, ledger);
  ParamSwapper sw(flat, param_options(dir), ledger);
  sw.swap_out();
  sw.engine_for_testing().inject_fault(/*on_write=*/true, ENOSPC);
  sw.begin_update(1).fill_(1);
  sw.end_update(1);
  std::vector<std::string> errors;
  for (size_t g : {1, 2}) {
    try {
      sw.wait_read(g);
      sw.release(g);
    } catch (const zero::IoError& e) {
      errors.push_back(e.what());
    }
  }
  ASSERT_EQ(errors.size(), 2u) << "a read went on after a failed write-back";
  EXPECT_NE(errors[0].find("No space left on device"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("params.swp"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("not the current ones"), std::string::npos) << errors[1];
  ::rmdir(dir.c_str());
}

}  // namespace

// NOTE [stage-3 gather stream]: a gather copies a shard out of its swap
// buffer to the device asynchronously; release() takes that copy's event and
// the buffer is written again (by a disk read) only after it. With the copies
// held back (CopyMode::kDeferred), a buffer reused without that wait is
// caught; with it, the copy reads the shard it was given.
TEST(ParamSwapper, ABufferIsWrittenAgainOnlyAfterTheCopyOutOfItHasEnded) {
  for (const bool give_event : {true, false}) {
    const std::string dir = fresh_dir(give_event ? "fence" : "nofence");
    zero::MemoryLedger ledger;
    FlatParameters flat(layer_groups(), at::kFloat, at::kCPU, 1, 0, zero::Tier::kHost, ledger);
    ParamSwapper sw(flat, param_options(dir), ledger);  // two buffers, three shards
    sw.swap_out();
    zero::CopyStream stream(at::kCPU, zero::CopyMode::kDeferred);
    sw.wait_read(1);
    at::Tensor device = at::empty({flat.part(1).numel()});
    zero::StreamEvent copied = stream.copy(device, flat.part(1), /*host_source=*/true);
    copied.block_current();  // the gather waits on the GPU side; the host goes on
    sw.release(1, give_event ? copied : zero::StreamEvent());
    // Groups 2 and 3 need both buffers: one of them is group 1's.
    sw.wait_read(2);
    sw.wait_read(3);
    EXPECT_TRUE(at::equal(shard_of(flat, 3), expected_shard(3)));
    if (give_event) {
      EXPECT_NO_THROW(stream.copy(at::zeros({1}), at::ones({1})).synchronize());
      EXPECT_TRUE(at::equal(device.narrow(0, 0, expected_shard(1).numel()), expected_shard(1)));
    } else {
      EXPECT_THROW(stream.copy(at::zeros({1}), at::ones({1})), zero::InternalError)
          << "the buffer was read into while the copy out of it could still run";
    }
    sw.release(2);
    sw.release(3);
    ::rmdir(dir.c_str());
  }
}
