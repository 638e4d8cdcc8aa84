/* Host-side checks and views of NVTEBuffer. All of these run before any CUDA call. */
#ifndef TRANSFORMER_ENGINE_COMMON_UTIL_BUFFER_H_
#define TRANSFORMER_ENGINE_COMMON_UTIL_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "transformer_engine/transformer_engine.h"

namespace transformer_engine {

const char* dtype_name(NVTEDType dtype);
size_t element_size(NVTEDType dtype);
bool is_fp8(NVTEDType dtype);
/* The largest finite value of an FP8 format (448 or 57344). */
float fp8_max(const char* op, NVTEDType dtype);

size_t numel(const NVTEBuffer& buffer);
/* The 2-D view `[rows, cols]` with cols the last extent (a scalar is 1 x 1). */
size_t last_dim(const NVTEBuffer& buffer);
size_t leading_rows(const NVTEBuffer& buffer);

/* Throws std::invalid_argument naming `op` and `name` when a check fails. */
const NVTEBuffer& require(const char* op, const char* name, const NVTEBuffer* buffer);
void check_well_formed(const char* op, const char* name, const NVTEBuffer& buffer);
void check_dtype(const char* op, const char* name, const NVTEBuffer& buffer,
                 std::initializer_list<NVTEDType> allowed);
/* One Float32 element (scale, amax, scale_inv, noop flag). */
void check_fp32_scalar(const char* op, const char* name, const NVTEBuffer& buffer);
void check_same_numel(const char* op, const char* name, const NVTEBuffer& buffer,
                      const char* other_name, const NVTEBuffer& other);

/* Extents of block layouts (scale tensors, tiles). */
inline size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }
inline size_t round_up(size_t a, size_t b) { return ceil_div(a, b) * b; }

inline bool aligned_to(const void* pointer, size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(pointer) % bytes == 0;
}

}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_UTIL_BUFFER_H_
