// Precompiled once, reused by every target that includes LibTorch (see the
// root CMakeLists.txt). Only headers that most translation units use.
#pragma once
#include <ATen/ATen.h>
#include <torch/nn.h>
#include <torch/optim.h>
#include <torch/autograd.h>
