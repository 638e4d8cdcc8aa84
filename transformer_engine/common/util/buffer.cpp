#include "util/buffer.h"

#include <string>

#include "util/errors.h"

namespace transformer_engine {

const char* dtype_name(NVTEDType dtype) {
  switch (dtype) {
    case kNVTEByte:
      return "Byte";
    case kNVTEInt16:
      return "Int16";
    case kNVTEInt32:
      return "Int32";
    case kNVTEInt64:
      return "Int64";
    case kNVTEFloat32:
      return "Float32";
    case kNVTEFloat16:
      return "Float16";
    case kNVTEBFloat16:
      return "BFloat16";
    case kNVTEFloat8E4M3:
      return "Float8E4M3";
    case kNVTEFloat8E5M2:
      return "Float8E5M2";
    case kNVTEFloat8E8M0:
      return "Float8E8M0";
    case kNVTEFloat4E2M1:
      return "Float4E2M1";
    default:
      return "unknown";
  }
}

size_t element_size(NVTEDType dtype) {
  switch (dtype) {
    case kNVTEInt16:
    case kNVTEFloat16:
    case kNVTEBFloat16:
      return 2;
    case kNVTEInt32:
    case kNVTEFloat32:
      return 4;
    case kNVTEInt64:
      return 8;
    default:
      return 1;
  }
}

bool is_fp8(NVTEDType dtype) { return dtype == kNVTEFloat8E4M3 || dtype == kNVTEFloat8E5M2; }

float fp8_max(const char* op, NVTEDType dtype) {
  if (dtype == kNVTEFloat8E4M3) return 448.0f;
  if (dtype == kNVTEFloat8E5M2) return 57344.0f;
  throw_invalid(op, "fp8_dtype ", dtype_name(dtype), " (", static_cast<int>(dtype),
                ") is not an FP8 format; use Float8E4M3 or Float8E5M2");
}

size_t numel(const NVTEBuffer& buffer) {
  size_t n = 1;
  for (size_t d = 0; d < buffer.ndim; ++d) n *= buffer.shape[d];
  return n;
}

size_t last_dim(const NVTEBuffer& buffer) {
  return buffer.ndim == 0 ? 1 : buffer.shape[buffer.ndim - 1];
}

size_t leading_rows(const NVTEBuffer& buffer) {
  size_t rows = 1;
  for (size_t d = 0; d + 1 < buffer.ndim; ++d) rows *= buffer.shape[d];
  return rows;
}

const NVTEBuffer& require(const char* op, const char* name, const NVTEBuffer* buffer) {
  if (buffer == nullptr) throw_invalid(op, name, " is required but was null");
  check_well_formed(op, name, *buffer);
  return *buffer;
}

void check_well_formed(const char* op, const char* name, const NVTEBuffer& buffer) {
  if (buffer.ndim > NVTE_MAX_DIMS) {
    throw_invalid(op, name, " has ", buffer.ndim, " dimensions; at most ", NVTE_MAX_DIMS,
                  " are supported");
  }
  if (static_cast<int>(buffer.dtype) < 0 || buffer.dtype >= kNVTENumTypes) {
    throw_invalid(op, name, " has unknown dtype code ", static_cast<int>(buffer.dtype));
  }
  if (buffer.data == nullptr && numel(buffer) != 0) {
    throw_invalid(op, name, " has ", numel(buffer), " elements but a null data pointer");
  }
}

void check_dtype(const char* op, const char* name, const NVTEBuffer& buffer,
                 std::initializer_list<NVTEDType> allowed) {
  std::string names;
  for (NVTEDType dtype : allowed) {
    if (buffer.dtype == dtype) return;
    names += names.empty() ? "" : ", ";
    names += dtype_name(dtype);
  }
  throw_invalid(op, name, " has dtype ", dtype_name(buffer.dtype), "; expected one of ", names);
}

void check_fp32_scalar(const char* op, const char* name, const NVTEBuffer& buffer) {
  check_well_formed(op, name, buffer);
  check_dtype(op, name, buffer, {kNVTEFloat32});
  if (numel(buffer) != 1) {
    throw_invalid(op, name, " must hold exactly one Float32 element, got ", numel(buffer));
  }
}

void check_same_numel(const char* op, const char* name, const NVTEBuffer& buffer,
                      const char* other_name, const NVTEBuffer& other) {
  if (numel(buffer) != numel(other)) {
    throw_invalid(op, name, " has ", numel(buffer), " elements but ", other_name, " has ",
                  numel(other));
  }
}

}  // namespace transformer_engine
