/* Library-wide entry points: version and runtime queries. */
#include "transformer_engine/transformer_engine.h"

#include <cuda_runtime_api.h>

#include "util/errors.h"

#ifndef NVTE_VERSION_STRING
#define NVTE_VERSION_STRING "unknown"
#endif

extern "C" const char* nvte_version(void) { return NVTE_VERSION_STRING; }

extern "C" int nvte_cuda_runtime_version(void) { return CUDART_VERSION; }

extern "C" int nvte_device_count(void) {
  int count = 0;
  transformer_engine::check_cuda("nvte_device_count", cudaGetDeviceCount(&count),
                                 "cudaGetDeviceCount");
  return count;
}
