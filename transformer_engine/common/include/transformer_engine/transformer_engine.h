/*! \file transformer_engine.h
 *  \brief Core types of the transformer_engine C ABI.
 *
 *  Every entry point (`nvte_*`) takes the CUDA device index and the stream explicitly. It makes
 *  that device current for the duration of the call (an RAII guard restores the caller's device
 *  on every path, exceptions included), checks that every buffer lives on that device and that
 *  the stream belongs to it, and only then launches. Failures are reported as C++ exceptions
 *  (std::runtime_error for CUDA and placement errors, std::invalid_argument for bad arguments)
 *  whose messages name the operation and the offending values; callers must be C++.
 *
 *  The library never allocates device memory: callers pass every buffer it writes.
 */
#ifndef TRANSFORMER_ENGINE_TRANSFORMER_ENGINE_H_
#define TRANSFORMER_ENGINE_TRANSFORMER_ENGINE_H_

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/*! \brief Marks the exported symbols; everything else in the library is hidden. */
#define NVTE_API __attribute__((visibility("default")))

/*! \brief Largest tensor rank an NVTEBuffer can describe. */
#define NVTE_MAX_DIMS 8

/*! \brief Element types. Values are part of the ABI (Python's `DType` mirrors them). */
typedef enum {
  kNVTEByte = 0,        /*!< uint8 */
  kNVTEInt16 = 1,       /*!< int16 */
  kNVTEInt32 = 2,       /*!< int32 */
  kNVTEInt64 = 3,       /*!< int64 */
  kNVTEFloat32 = 4,     /*!< IEEE float32 */
  kNVTEFloat16 = 5,     /*!< IEEE float16 */
  kNVTEBFloat16 = 6,    /*!< bfloat16 */
  kNVTEFloat8E4M3 = 7,  /*!< FP8 E4M3 (finite max 448, no infinities) */
  kNVTEFloat8E5M2 = 8,  /*!< FP8 E5M2 (finite max 57344) */
  kNVTEFloat8E8M0 = 9,  /*!< FP8 E8M0 scale type (not used by these kernels) */
  kNVTEFloat4E2M1 = 10, /*!< FP4 E2M1 (not used by these kernels) */
  kNVTENumTypes
} NVTEDType;

/*! \brief A CUDA stream, ABI-compatible with `cudaStream_t` / `CUstream`, so this header needs no
 *  CUDA headers. A null stream is the legacy default stream of the call's device.
 */
typedef struct CUstream_st* NVTEStream;

/*! \brief A dense, contiguous, row-major tensor in device memory, described but not owned. */
typedef struct {
  void* data;                  /*!< Device pointer (may be null only when the tensor is empty). */
  NVTEDType dtype;             /*!< Element type. */
  size_t ndim;                 /*!< Rank, at most NVTE_MAX_DIMS; 0 is a scalar (one element). */
  size_t shape[NVTE_MAX_DIMS]; /*!< Extents; only the first `ndim` are read. */
} NVTEBuffer;

/*! \brief Version string of the native library, e.g. "2.20.0". */
NVTE_API const char* nvte_version(void);

/*! \brief CUDA runtime version the library was built against (e.g. 13000). */
NVTE_API int nvte_cuda_runtime_version(void);

/*! \brief Number of CUDA devices visible to the library (throws if the driver is unusable). */
NVTE_API int nvte_device_count(void);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // TRANSFORMER_ENGINE_TRANSFORMER_ENGINE_H_
