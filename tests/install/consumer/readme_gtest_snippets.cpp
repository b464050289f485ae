// docs/tools.md's memory-regression check, as written, in a GoogleTest
// function against the installed package (tests/install/run.sh extracts it).
#include <gtest/gtest.h>
#include <zero/testing/memory.h>
#include <zero/zero.h>

void tools_memory_test(zero::Engine& engine) {
#include "tools_memory_test.inc"
}
