// The io_uring AIO engine (NOTE [aio engine]): exact round trips at sizes that
// are not multiples of the block size or of O_DIRECT's alignment, every
// option combination, and failures that name the file, offset and errno.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "zero/offload/aio.h"
#include "zero/core/error.h"

namespace {

using zero::offload::AioEngine;
using zero::offload::AioFile;
using zero::offload::AioOptions;
using zero::offload::AlignedBuffer;

std::string temp_path(const std::string& name) {
  return std::string(ZERO_BINARY_DIR) + "/tests/aio_" + std::to_string(getpid()) + "_" + name;
}

void fill_random(void* p, int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  auto* b = static_cast<unsigned char*>(p);
  for (int64_t i = 0; i < n; ++i) b[i] = static_cast<unsigned char>(rng());
}

struct RoundTrip {
  int64_t size, block, depth, threads;
  bool single_submit, overlap_events;
};

class AioRoundTrip : public ::testing::TestWithParam<RoundTrip> {};

TEST_P(AioRoundTrip, ReadsBackExactlyWhatWasWritten) {
  const RoundTrip c = GetParam();
  AioOptions o;
  o.block_size = c.block;
  o.queue_depth = c.depth;
  o.threads = c.threads;
  o.single_submit = c.single_submit;
  o.overlap_events = c.overlap_events;
  AioEngine engine(o);
  const std::string path = temp_path("rt");
  auto file = AioFile::open(path, true);
  AlignedBuffer out(c.size), in(c.size);
  fill_random(out.data(), c.size, static_cast<unsigned>(c.size));
  std::memset(in.data(), 0, static_cast<size_t>(in.size()));
  // At offset 0 and at an aligned offset further on.
  for (int64_t offset : {int64_t{0}, int64_t{3} * zero::offload::kAioAlignment}) {
    engine.write(file, out.data(), c.size, offset).wait();
    engine.read(file, in.data(), c.size, offset).wait();
    EXPECT_EQ(std::memcmp(out.data(), in.data(), static_cast<size_t>(c.size)), 0) << "offset " << offset;
  }
  ::unlink(path.c_str());
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, AioRoundTrip,
    ::testing::Values(RoundTrip{1, 1 << 20, 8, 1, false, true}, RoundTrip{4095, 1 << 20, 8, 1, false, true},
                      RoundTrip{4097, 4096, 2, 1, false, true}, RoundTrip{(1 << 20) + 7, 1 << 16, 8, 2, false, true},
                      RoundTrip{(3 << 20) + 12345, 1 << 20, 4, 3, true, true},
                      RoundTrip{(2 << 20) + 1, 1 << 18, 16, 1, false, false},
                      RoundTrip{(2 << 20) + 513, 1 << 18, 1, 2, true, false}),
    [](const auto& info) {
      const RoundTrip& c = info.param;
      return "size" + std::to_string(c.size) + "_block" + std::to_string(c.block) + "_qd" + std::to_string(c.depth) +
             "_t" + std::to_string(c.threads) + (c.single_submit ? "_single" : "") +
             (c.overlap_events ? "_overlap" : "");
    });

// Buffers that are not aligned go through the page cache, still exact.
TEST(Aio, UnalignedBufferAndOffsetRoundTrip) {
  AioEngine engine({});
  const std::string path = temp_path("unaligned");
  auto file = AioFile::open(path, true);
  std::vector<char> out(100001), in(100001);
  fill_random(out.data(), static_cast<int64_t>(out.size()), 5);
  engine.write(file, out.data() + 1, 99999, 777).wait();
  engine.read(file, in.data() + 1, 99999, 777).wait();
  EXPECT_EQ(std::memcmp(out.data() + 1, in.data() + 1, 99999), 0);
  ::unlink(path.c_str());
}

// Once a request is done the engine holds nothing of it: the file is closed
// when its owner lets go, not later, in the middle of other I/O (closing an
// unlinked swap file frees its extents, which cost a later write a quarter of
// its throughput), for finished, failed and injected-failure blocks alike.
TEST(Aio, FinishedRequestsDoNotKeepTheirFileOpen) {
  AioOptions o;
  o.block_size = 8192;
  o.queue_depth = 4;
  o.threads = 2;
  AioEngine engine(o);
  AlignedBuffer buf(1 << 16);
  const std::string path = temp_path("release");
  std::weak_ptr<AioFile> watch;
  {
    auto file = AioFile::open(path, true);
    watch = file;
    engine.write(file, buf.data(), 1 << 16, 0).wait();
    engine.read(file, buf.data(), 1 << 16, 0).wait();
    EXPECT_THROW(engine.read(file, buf.data(), 1 << 16, 4096).wait(), zero::IoError);  // meets the end
    engine.inject_fault(true, EIO);
    EXPECT_THROW(engine.write(file, buf.data(), 1 << 16, 0).wait(), zero::IoError);
  }
  EXPECT_TRUE(watch.expired()) << "the engine still holds the file after every request on it finished";
  ::unlink(path.c_str());
}

// Reading past the end of the file fails naming the file and the offset.
TEST(Aio, ReadPastTheEndFailsNamingFileAndOffset) {
  AioEngine engine({});
  const std::string path = temp_path("short");
  auto file = AioFile::open(path, true);
  AlignedBuffer buf(1 << 20);
  engine.write(file, buf.data(), 8192, 0).wait();
  try {
    engine.read(file, buf.data(), 1 << 20, 0).wait();
    FAIL() << "expected an error";
  } catch (const zero::IoError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("unexpected end of file"), std::string::npos) << m;
    EXPECT_NE(m.find(path), std::string::npos) << m;
    EXPECT_NE(m.find("offset 8192"), std::string::npos) << m;
  }
  ::unlink(path.c_str());
}

// A real failing write: the process's file size limit (EFBIG), as a full disk
// would fail (ENOSPC); the error names the file, offset and errno.
TEST(Aio, FailingWriteNamesFileOffsetAndErrno) {
  const std::string path = temp_path("efbig");
  std::signal(SIGXFSZ, SIG_IGN);
  rlimit old{};
  getrlimit(RLIMIT_FSIZE, &old);
  rlimit lim = old;
  lim.rlim_cur = 1 << 20;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &lim), 0);
  std::string message;
  {
    AioEngine engine({});
    auto file = AioFile::open(path, true);
    AlignedBuffer buf(2 << 20);
    try {
      engine.write(file, buf.data(), 2 << 20, 0).wait();
    } catch (const zero::IoError& e) {
      message = e.what();
    }
  }
  setrlimit(RLIMIT_FSIZE, &old);
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find("offset 1048576"), std::string::npos) << message;
  EXPECT_NE(message.find("errno " + std::to_string(EFBIG)), std::string::npos) << message;
  ::unlink(path.c_str());
}

// The fault seam: a read that fails (EIO) surfaces in wait() with the errno;
// the next request works.
TEST(Aio, InjectedReadErrorSurfacesAndTheEngineGoesOn) {
  AioEngine engine({});
  const std::string path = temp_path("eio");
  auto file = AioFile::open(path, true);
  AlignedBuffer buf(1 << 16);
  engine.write(file, buf.data(), 1 << 16, 0).wait();
  engine.inject_fault(false, EIO);
  try {
    engine.read(file, buf.data(), 1 << 16, 0).wait();
    FAIL() << "expected an error";
  } catch (const zero::IoError& e) {
    EXPECT_NE(std::string(e.what()).find("errno " + std::to_string(EIO)), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(engine.read(file, buf.data(), 1 << 16, 0).wait());
  ::unlink(path.c_str());
}

// Reserving space up front fails with the errno when the size cannot be had.
TEST(Aio, ReserveAllocatesUpFrontAndFailsClearly) {
  const std::string path = temp_path("reserve");
  auto file = AioFile::open(path, true);
  file->reserve(1 << 20);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 1 << 20);
  try {
    file->reserve(int64_t{1} << 62);  // more than any disk
    FAIL() << "expected an error";
  } catch (const zero::IoError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("errno"), std::string::npos) << e.what();
  }
  ::unlink(path.c_str());
}

TEST(Aio, MissingFolderAndBadOptionsAreClearErrors) {
  try {
    AioFile::open("/nonexistent-zero-dir/swap", true);
    FAIL();
  } catch (const zero::IoError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-zero-dir/swap"), std::string::npos);
  }
  AioOptions o;
  o.queue_depth = 0;
  try {
    AioEngine engine(o);
    FAIL();
  } catch (const zero::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("aio.queue_depth"), std::string::npos) << e.what();
  }
}

}  // namespace
