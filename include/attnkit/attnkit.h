// Umbrella header of the attnkit C++ API.
#pragma once

#include "attnkit/attention.h"
#include "attnkit/config.h"
#include "attnkit/context_parallel.h"
#include "attnkit/device_errors.h"
#include "attnkit/info.h"
#include "attnkit/interrupt.h"
#include "attnkit/kv_cache.h"
#include "attnkit/kv_cache_manager.h"
#include "attnkit/spec.h"
#include "attnkit/types.h"
