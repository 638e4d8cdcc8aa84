/* cuBLASLt, loaded at run time. The library is not linked and its headers are not needed to
 * build: the wheel must build where only nvcc is installed (CI has no cuBLAS headers) and must
 * use the cuBLASLt that PyTorch already loaded, whatever CUDA version that torch was built for.
 * So the few entry points and constants the block-scaled GEMM uses are declared here, with the
 * values of cuBLASLt's public header (cublasLt.h of CUDA 12.9 / 13.x; the scale modes exist from
 * 12.9 on), and the functions are found with dlopen/dlsym on first use. */
#ifndef TRANSFORMER_ENGINE_COMMON_GEMM_CUBLASLT_LOADER_H_
#define TRANSFORMER_ENGINE_COMMON_GEMM_CUBLASLT_LOADER_H_

#include <cuda_runtime_api.h>
#include <library_types.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace transformer_engine {
namespace cublaslt {

using Status = int;  // cublasStatus_t; 0 is CUBLAS_STATUS_SUCCESS
using Handle = struct HandleOpaque*;
using MatmulDesc = struct MatmulDescOpaque*;
using MatrixLayout = struct MatrixLayoutOpaque*;
using Preference = struct PreferenceOpaque*;

struct Algo {  // cublasLtMatmulAlgo_t: semi-opaque, copied by value
  uint64_t data[8];
};

struct HeuristicResult {  // cublasLtMatmulHeuristicResult_t
  Algo algo;
  size_t workspace_size;
  Status state;
  float waves_count;
  int reserved[4];
};

// cublasComputeType_t, cublasOperation_t
constexpr int kCompute32F = 68;
constexpr int kOpN = 0;
constexpr int kOpT = 1;
// cublasLtMatmulDescAttributes_t
constexpr int kDescTransA = 3;
constexpr int kDescTransB = 4;
constexpr int kDescEpilogue = 7;
constexpr int kDescBiasPointer = 8;
constexpr int kDescAScalePointer = 17;
constexpr int kDescBScalePointer = 18;
constexpr int kDescFastAccum = 25;
constexpr int kDescBiasDataType = 26;
constexpr int kDescAScaleMode = 31;
constexpr int kDescBScaleMode = 32;
// cublasLtEpilogue_t
constexpr int kEpilogueDefault = 1;
constexpr int kEpilogueBias = 4;
// cublasLtMatmulMatrixScale_t
constexpr int kScaleVec128 = 4;
constexpr int kScaleBlock128x128 = 5;
// cublasLtMatmulPreferenceAttributes_t
constexpr int kPrefMaxWorkspaceBytes = 1;
constexpr int kPrefMinAlignmentABytes = 5;  // B, C and D follow: 6, 7, 8

/* The entry points, resolved once. */
struct Api {
  Status (*create)(Handle*);
  size_t (*get_version)();
  const char* (*get_status_string)(Status);
  Status (*desc_create)(MatmulDesc*, int compute_type, cudaDataType_t scale_type);
  Status (*desc_destroy)(MatmulDesc);
  Status (*desc_set)(MatmulDesc, int attribute, const void* value, size_t bytes);
  Status (*layout_create)(MatrixLayout*, cudaDataType_t type, uint64_t rows, uint64_t cols,
                          int64_t ld);
  Status (*layout_destroy)(MatrixLayout);
  Status (*preference_create)(Preference*);
  Status (*preference_destroy)(Preference);
  Status (*preference_set)(Preference, int attribute, const void* value, size_t bytes);
  Status (*heuristic)(Handle, MatmulDesc, MatrixLayout a, MatrixLayout b, MatrixLayout c,
                      MatrixLayout d, Preference, int requested, HeuristicResult* results,
                      int* returned);
  Status (*matmul)(Handle, MatmulDesc, const void* alpha, const void* a, MatrixLayout a_layout,
                   const void* b, MatrixLayout b_layout, const void* beta, const void* c,
                   MatrixLayout c_layout, void* d, MatrixLayout d_layout, const Algo* algo,
                   void* workspace, size_t workspace_bytes, cudaStream_t stream);
};

/* The loaded API, or nullptr with `why` set (first call: dlopen of the libcublasLt that is
 * already in the process, else the loader's search path, CUDA 13's soname before 12's). */
const Api* api(std::string* why);

/* cuBLASLt's version (major * 10000 + minor * 100 + patch), 0 when it is not loaded. */
size_t version();

/* The process's handle (cuBLASLt handles are not tied to a device), created on first use. */
Handle handle(const char* op);

/* Throws std::runtime_error naming `op` and `what` unless `status` is success. */
void check(const char* op, Status status, const char* what);

}  // namespace cublaslt
}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_GEMM_CUBLASLT_LOADER_H_
