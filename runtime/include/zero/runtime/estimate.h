// The estimate of a model itself (zero::estimate) and of a CUDA device's
// memory: what needs the engine's options or LibTorch's modules. The
// estimator (model states, a step's peak) is zero/runs/estimate.h, which
// this includes.
#pragma once

#include <memory>
#include <vector>

#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include "zero/config/config.h"
#include "zero/runs/estimate.h"

namespace zero {

struct InitOptions;

/// The parameters of `model` as the engine would lay them out (frozen ones
/// marked: ParameterShape::frozen, NOTE [frozen groups])
/// (NOTE [stage-3 plan]): named_parameters' names (a tied parameter once,
/// under its first name), full sizes, and the stage-3 layer of each: the
/// children of the outermost ModuleList and Sequential containers and the
/// modules in `layers` (InitOptions::layers), in the model's order, none
/// inside another; a parameter in the first layer that has it, -1 outside
/// every layer. For a model built whole: one built under zero::Init holds
/// only its shards.
std::vector<ParameterShape> parameter_shapes(const torch::nn::Module& model,
                                             const std::vector<std::shared_ptr<torch::nn::Module>>& layers = {});

/// zero::estimate(model, config, options): the model states per rank that
/// zero::initialize(model, config, options) would lay out, from the model
/// itself (its stage-3 layers from options.layers).
MemoryEstimate estimate(const torch::nn::Module& model, const config::Config& config, const InitOptions& options);

/// A CUDA device's memory in bytes (what a budget of the whole card is, as
/// the caching allocator's memory fraction counts it).
int64_t cuda_total_memory(const c10::Device& device);

}  // namespace zero
