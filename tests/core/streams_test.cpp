// CopyStream and WaitClock on the CPU (NOTE [device streams]): copies at once
// by default; in CopyMode::kDeferred held back until their event is waited
// for, in issue order, with a host source written too early caught.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include <ATen/ATen.h>

#include "zero/core/error.h"
#include "zero/core/streams.h"

namespace {

using zero::CopyMode;
using zero::CopyStream;
using zero::StreamEvent;

TEST(CopyStream, OnTheCpuACopyIsDoneWhenCalled) {
  CopyStream stream(at::kCPU);
  at::Tensor src = at::arange(10, at::kFloat), dst = at::zeros({10});
  StreamEvent done = stream.copy(dst, src);
  EXPECT_TRUE(at::equal(dst, src));
  EXPECT_TRUE(done.query());
  done.synchronize();
  done.block_current();
  EXPECT_TRUE(StreamEvent().query()) << "a default event is complete";
}

TEST(CopyStream, DeferredHoldsACopyUntilItsEventIsWaitedFor) {
  CopyStream stream(at::kCPU, CopyMode::kDeferred);
  at::Tensor src = at::arange(10, at::kFloat), dst = at::zeros({10});
  StreamEvent done = stream.copy(dst, src);
  EXPECT_FALSE(done.query());
  EXPECT_EQ(dst.sum().item<float>(), 0.0f) << "read before its event: still the old values";
  done.block_current();
  EXPECT_TRUE(at::equal(dst, src));
  EXPECT_FALSE(done.query()) << "done for the host only once it has synchronized";
  done.synchronize();
  EXPECT_TRUE(done.query());
  // synchronize() does it as well.
  at::Tensor dst2 = at::zeros({10});
  StreamEvent done2 = stream.copy(dst2, src * 2);
  done2.synchronize();
  EXPECT_TRUE(at::equal(dst2, src * 2));
}

TEST(CopyStream, DeferredCopiesEndInIssueOrder) {
  CopyStream stream(at::kCPU, CopyMode::kDeferred);
  at::Tensor a = at::zeros({4}), b = at::zeros({4});
  StreamEvent first = stream.copy(a, at::ones({4}));
  StreamEvent second = stream.copy(b, at::full({4}, 2.0f));
  second.synchronize();  // one stream: the earlier copy has ended too
  EXPECT_TRUE(first.query());
  EXPECT_EQ(a.sum().item<float>(), 4.0f);
  EXPECT_EQ(b.sum().item<float>(), 8.0f);
}

// The race of a reused host buffer: written while an asynchronous copy out of
// it may still run. Waiting on the GPU side (block_current) is not enough for
// the host; synchronize() is.
TEST(CopyStream, DeferredCatchesAHostSourceWrittenBeforeItsCopyWasSynchronized) {
  CopyStream stream(at::kCPU, CopyMode::kDeferred);
  at::Tensor buffer = at::arange(8, at::kFloat), device = at::zeros({8});
  StreamEvent out = stream.copy(device, buffer, /*host_source=*/true);
  out.block_current();
  buffer.fill_(-1);  // reused too early
  try {
    stream.copy(at::zeros({1}), at::ones({1}));
    FAIL() << "expected the early write to be caught";
  } catch (const zero::InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("written before the host synchronize()d"), std::string::npos) << e.what();
  }
  // Done right: the host waits, then writes.
  at::Tensor buffer2 = at::arange(8, at::kFloat), device2 = at::zeros({8});
  StreamEvent out2 = stream.copy(device2, buffer2, /*host_source=*/true);
  out2.block_current();
  out2.synchronize();
  buffer2.fill_(-1);
  EXPECT_NO_THROW(stream.copy(at::zeros({1}), at::ones({1})).synchronize());
  EXPECT_TRUE(at::equal(device2, at::arange(8, at::kFloat)));
}

TEST(CopyStream, RunEndsAfterWhatItQueued) {
  CopyStream stream(at::kCPU, CopyMode::kDeferred);
  at::Tensor dst = at::zeros({3});
  bool ran = false;
  StreamEvent end = stream.run([&] {
    ran = true;
    stream.copy(dst, at::ones({3}));
  });
  EXPECT_TRUE(ran);
  EXPECT_EQ(dst.sum().item<float>(), 0.0f);
  end.block_current();
  EXPECT_EQ(dst.sum().item<float>(), 3.0f);
}

TEST(CopyStream, DestroyingADeferredStreamEndsItsCopies) {
  at::Tensor dst = at::zeros({3});
  {
    CopyStream stream(at::kCPU, CopyMode::kDeferred);
    stream.copy(dst, at::ones({3}));
  }
  EXPECT_EQ(dst.sum().item<float>(), 3.0f);
}

TEST(WaitClock, OnTheCpuCountsTheHostTimeOfTheWait) {
  zero::WaitClock clock(at::kCPU);
  clock.time([] { std::this_thread::sleep_for(std::chrono::milliseconds(30)); });
  EXPECT_GE(clock.seconds(), 0.029);
  EXPECT_LT(clock.seconds(), 5.0);
  clock.reset();
  EXPECT_EQ(clock.seconds(), 0.0);
}

}  // namespace
