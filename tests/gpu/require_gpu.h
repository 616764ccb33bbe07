// GPU test support: the skip that every GPU test starts with, so that the suites run (and skip)
// on a machine without a GPU.
#pragma once

#include <gtest/gtest.h>

#include "epmoe/cuda.h"

// First statement of every GPU test.
#define EPMOE_REQUIRE_GPU()                                       \
  do {                                                            \
    if (::epmoe::cuda_device_count() == 0) {                      \
      GTEST_SKIP() << "no CUDA device: GPU tests skipped";        \
    }                                                             \
  } while (0)
