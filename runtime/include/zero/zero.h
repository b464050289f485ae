// The umbrella header: everything a training program needs from zero.
#pragma once

#include "zero/checkpointing/checkpoint.h"
#include "zero/config/config.h"
#include "zero/runtime/engine.h"
#include "zero/runtime/estimate.h"
#include "zero/core/error.h"
#include "zero/runtime/init.h"
#include "zero/core/memory_ledger.h"
#include "zero/partition/layer.h"
