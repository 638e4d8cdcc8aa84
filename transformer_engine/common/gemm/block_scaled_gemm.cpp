/* nvte_block_scaled_gemm: Float8BlockScaling's GEMM on cuBLASLt (gemm.h).
 *
 * cuBLASLt is column-major, so the row-major product out[M, N] = x[M, K] @ y[N, K]^T is asked as
 * D (N x M, ld N) = op(A) * op(B) with A = y stored K x N (ld K, transposed: TN) and B = x
 * stored K x M (ld K). The scale layouts of block_cast.h are the ones cuBLASLt reads for
 * VEC128_32F (1x128) and BLK128x128_32F scales of such operands, so they are passed as they are.
 *
 * Per call: descriptors are created and destroyed (host-only, a few microseconds, and thread-safe
 * without locking); the algorithm cuBLASLt's heuristic picks is cached per problem, so the
 * heuristic runs once per shape (before any CUDA-graph capture of that shape, in its warm-up). */
#include <cstdint>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "gemm/cublaslt_loader.h"
#include "transformer_engine/gemm.h"
#include "util/buffer.h"
#include "util/device.h"
#include "util/errors.h"

namespace transformer_engine {
namespace {

namespace lt = cublaslt;

constexpr size_t kBlock = 128;

cudaDataType_t cuda_type(NVTEDType dtype) {
  switch (dtype) {
    case kNVTEFloat8E4M3:
      return CUDA_R_8F_E4M3;
    case kNVTEFloat8E5M2:
      return CUDA_R_8F_E5M2;
    case kNVTEBFloat16:
      return CUDA_R_16BF;
    case kNVTEFloat16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

/* An FP8 operand [rows, K] and its scale-inverses in the layout of block_cast.h. */
void check_operand(const char* op, const char* name, const char* scale_name, const NVTEBuffer& v,
                   const NVTEBuffer& s, bool two_d) {
  check_dtype(op, name, v, {kNVTEFloat8E4M3, kNVTEFloat8E5M2});
  if (v.ndim != 2) throw_invalid(op, name, " must be 2-D [rows, K], got ", v.ndim, " dimensions");
  check_dtype(op, scale_name, s, {kNVTEFloat32});
  const size_t rows = v.shape[0], kb = v.shape[1] / kBlock;
  const size_t want0 = two_d ? ceil_div(rows, kBlock) : kb;
  const size_t want1 = two_d ? round_up(kb, 4) : round_up(rows, 4);
  if (s.ndim != 2 || s.shape[0] != want0 || s.shape[1] != want1) {
    throw_invalid(op, scale_name, " must be [", want0, ", ", want1, "] for ",
                  two_d ? "128x128" : "1x128", " scales of a [", rows, ", ", v.shape[1],
                  "] operand, got ",
                  s.ndim == 2 ? concat("[", s.shape[0], ", ", s.shape[1], "]")
                              : concat(s.ndim, " dimensions"));
  }
  if (!aligned_to(v.data, 16) || !aligned_to(s.data, 16)) {
    throw_invalid(op, name, " and ", scale_name,
                  " must be 16-byte aligned (cuBLASLt reads them so)");
  }
}

/* The alignment cuBLASLt may assume of a pointer: the largest power of two up to 256 (its
 * default assumption) that divides it. */
uint32_t alignment(const void* pointer) {
  uint32_t bytes = 256;
  while (bytes > 1 && !aligned_to(pointer, bytes)) bytes /= 2;
  return bytes;
}

/* What selects an algorithm: the heuristic's answer depends on nothing else. The operands'
 * alignments are part of it: an algorithm picked for 256-byte-aligned buffers may refuse
 * less-aligned ones (views that start inside an allocation). */
struct PlanKey {
  int device;
  size_t m, n, k;
  int x_type, y_type, out_type, bias_type, x_2d, y_2d;
  size_t workspace;
  uint32_t align_a, align_b, align_d;
  bool operator==(const PlanKey& o) const {
    return std::tie(device, m, n, k, x_type, y_type, out_type, bias_type, x_2d, y_2d, workspace,
                    align_a, align_b, align_d) ==
           std::tie(o.device, o.m, o.n, o.k, o.x_type, o.y_type, o.out_type, o.bias_type, o.x_2d,
                    o.y_2d, o.workspace, o.align_a, o.align_b, o.align_d);
  }
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& p) const {
    size_t h = 1469598103934665603ull;
    for (size_t v :
         {static_cast<size_t>(p.device), p.m, p.n, p.k, static_cast<size_t>(p.x_type),
          static_cast<size_t>(p.y_type), static_cast<size_t>(p.out_type),
          static_cast<size_t>(p.bias_type + 1), static_cast<size_t>(p.x_2d * 2 + p.y_2d),
          p.workspace, static_cast<size_t>(p.align_a) << 18 | p.align_b << 9 | p.align_d}) {
      h = (h ^ v) * 1099511628211ull;
    }
    return h;
  }
};

struct Plan {
  bool found = false;  // false: this cuBLASLt has no kernel for the problem here
  lt::Algo algo{};
};

/* Descriptors of one call, destroyed on every path. */
struct Descriptors {
  explicit Descriptors(const lt::Api& api) : a(api) {}
  ~Descriptors() {
    if (pref) a.preference_destroy(pref);
    for (lt::MatrixLayout l : {la, lb, ld}) {
      if (l) a.layout_destroy(l);
    }
    if (desc) a.desc_destroy(desc);
  }
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;
  const lt::Api& a;
  lt::MatmulDesc desc = nullptr;
  lt::MatrixLayout la = nullptr, lb = nullptr, ld = nullptr;
  lt::Preference pref = nullptr;
};

template <typename T>
void set_attribute(const char* op, const lt::Api& a, lt::MatmulDesc desc, int attribute,
                   const T& value) {
  lt::check(op, a.desc_set(desc, attribute, &value, sizeof(value)),
            "cublasLtMatmulDescSetAttribute");
}

Plan find_plan(const char* op, const lt::Api& a, lt::Handle handle, const PlanKey& key,
               Descriptors& d) {
  static std::mutex mutex;
  static std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;  // copied out: clear() may run
  std::lock_guard<std::mutex> lock(mutex);
  auto it = plans.find(key);
  if (it != plans.end()) return it->second;
  if (plans.size() >= 4096) plans.clear();  // a bound for processes that see endless shapes
  lt::check(op, a.preference_create(&d.pref), "cublasLtMatmulPreferenceCreate");
  const uint64_t workspace = key.workspace;
  lt::check(op, a.preference_set(d.pref, lt::kPrefMaxWorkspaceBytes, &workspace, sizeof(workspace)),
            "cublasLtMatmulPreferenceSetAttribute");
  const uint32_t aligns[4] = {key.align_a, key.align_b, key.align_d, key.align_d};  // A, B, C=D, D
  for (int i = 0; i < 4; ++i) {
    lt::check(
        op, a.preference_set(d.pref, lt::kPrefMinAlignmentABytes + i, &aligns[i], sizeof(uint32_t)),
        "cublasLtMatmulPreferenceSetAttribute");
  }
  lt::HeuristicResult result{};
  int returned = 0;
  const lt::Status status =
      a.heuristic(handle, d.desc, d.la, d.lb, d.ld, d.ld, d.pref, 1, &result, &returned);
  Plan plan;
  // "Not supported" statuses (no kernel for these types, modes or alignments) leave the caller
  // another path; other failures are errors.
  constexpr lt::Status kNotSupported = 15, kInvalidValue = 7;
  if (status == 0 && returned > 0 && result.state == 0) {
    plan.found = true;
    plan.algo = result.algo;
  } else if (status != 0 && status != kNotSupported && status != kInvalidValue) {
    lt::check(op, status, "cublasLtMatmulAlgoGetHeuristic");
  }
  return plans.emplace(key, plan).first->second;
}

}  // namespace
}  // namespace transformer_engine

extern "C" size_t nvte_cublaslt_version(void) {
  try {
    return transformer_engine::cublaslt::version();
  } catch (...) {
    return 0;
  }
}

extern "C" int nvte_block_scaled_gemm(const NVTEBuffer* x, const NVTEBuffer* x_scale_inv,
                                      int x_block_2d, const NVTEBuffer* y,
                                      const NVTEBuffer* y_scale_inv, int y_block_2d,
                                      const NVTEBuffer* bias, NVTEBuffer* out,
                                      NVTEBuffer* workspace, int device, NVTEStream stream) {
  using namespace transformer_engine;
  namespace lt = cublaslt;
  const char* op = "nvte_block_scaled_gemm";
  const NVTEBuffer& xv = require(op, "x", x);
  const NVTEBuffer& yv = require(op, "y", y);
  const NVTEBuffer& xs = require(op, "x_scale_inv", x_scale_inv);
  const NVTEBuffer& ys = require(op, "y_scale_inv", y_scale_inv);
  const NVTEBuffer& o = require(op, "out", out);
  const bool x2d = x_block_2d != 0, y2d = y_block_2d != 0;
  if (x2d && y2d) {
    throw_invalid(op,
                  "both operands have 128x128 blocks; at most one may (cast the other with "
                  "1x128 tiles)");
  }
  check_operand(op, "x", "x_scale_inv", xv, xs, x2d);
  check_operand(op, "y", "y_scale_inv", yv, ys, y2d);
  const size_t M = xv.shape[0], N = yv.shape[0], K = xv.shape[1];
  if (yv.shape[1] != K) {
    throw_invalid(op, "x is [", M, ", ", K, "] but y is [", N, ", ", yv.shape[1],
                  "]: the inner (K) extents differ");
  }
  if (M == 0 || N == 0 || K == 0 || K % kBlock != 0) {
    throw_invalid(op, "M=", M, ", N=", N, ", K=", K,
                  ": M and N must be positive and K a positive multiple of 128");
  }
  check_dtype(op, "out", o, {kNVTEBFloat16, kNVTEFloat16, kNVTEFloat32});
  if (o.ndim != 2 || o.shape[0] != M || o.shape[1] != N) {
    throw_invalid(op, "out must be [", M, ", ", N, "], got ", o.ndim, " dimensions");
  }
  if (N % 16 != 0 || !aligned_to(o.data, 16)) {
    throw_invalid(op, "N=", N, ": out's rows must be 16-element multiples and 16-byte aligned");
  }
  int bias_type = -1;
  if (bias != nullptr) {
    const NVTEBuffer& b = require(op, "bias", bias);
    check_dtype(op, "bias", b, {kNVTEBFloat16, kNVTEFloat16});
    if (b.dtype != o.dtype || numel(b) != N || !aligned_to(b.data, 16)) {
      throw_invalid(op, "bias must hold N=", N, " 16-byte-aligned elements of out's dtype ",
                    dtype_name(o.dtype), ", got ", numel(b), " of ", dtype_name(b.dtype));
    }
    bias_type = static_cast<int>(cuda_type(b.dtype));
  }
  size_t workspace_bytes = 0;
  void* workspace_data = nullptr;
  if (workspace != nullptr) {
    const NVTEBuffer& w = require(op, "workspace", workspace);
    check_dtype(op, "workspace", w, {kNVTEByte});
    workspace_bytes = numel(w);
    workspace_data = w.data;
    if (!aligned_to(workspace_data, 256)) throw_invalid(op, "workspace must be 256-byte aligned");
  }
  std::string why;
  const lt::Api* api = lt::api(&why);
  if (api == nullptr) throw_runtime(op, why);

  CallContext ctx(op, device, stream);
  ctx.check_on_device("x", xv);
  ctx.check_on_device("y", yv);
  ctx.check_on_device("x_scale_inv", xs);
  ctx.check_on_device("y_scale_inv", ys);
  ctx.check_on_device("out", o);
  if (bias != nullptr) ctx.check_on_device("bias", *bias);
  if (workspace != nullptr) ctx.check_on_device("workspace", *workspace);

  const lt::Api& a = *api;
  const lt::Handle handle = lt::handle(op);
  Descriptors d(a);
  lt::check(op, a.desc_create(&d.desc, lt::kCompute32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  set_attribute(op, a, d.desc, lt::kDescTransA, static_cast<int32_t>(lt::kOpT));
  set_attribute(op, a, d.desc, lt::kDescTransB, static_cast<int32_t>(lt::kOpN));
  set_attribute(op, a, d.desc, lt::kDescAScaleMode,
                static_cast<int32_t>(y2d ? lt::kScaleBlock128x128 : lt::kScaleVec128));
  set_attribute(op, a, d.desc, lt::kDescBScaleMode,
                static_cast<int32_t>(x2d ? lt::kScaleBlock128x128 : lt::kScaleVec128));
  set_attribute(op, a, d.desc, lt::kDescAScalePointer, static_cast<const void*>(ys.data));
  set_attribute(op, a, d.desc, lt::kDescBScalePointer, static_cast<const void*>(xs.data));
  set_attribute(op, a, d.desc, lt::kDescEpilogue,
                static_cast<int32_t>(bias != nullptr ? lt::kEpilogueBias : lt::kEpilogueDefault));
  if (bias != nullptr) {
    set_attribute(op, a, d.desc, lt::kDescBiasPointer, static_cast<const void*>(bias->data));
    set_attribute(op, a, d.desc, lt::kDescBiasDataType, static_cast<int32_t>(bias_type));
  }
  lt::check(op, a.layout_create(&d.la, cuda_type(yv.dtype), K, N, K), "cublasLtMatrixLayoutCreate");
  lt::check(op, a.layout_create(&d.lb, cuda_type(xv.dtype), K, M, K), "cublasLtMatrixLayoutCreate");
  lt::check(op, a.layout_create(&d.ld, cuda_type(o.dtype), N, M, N), "cublasLtMatrixLayoutCreate");

  // cuBLASLt's (m, n, k) = (N, M, K); A is y, B is x, D is out (the file comment)
  const PlanKey key{device,
                    N,
                    M,
                    K,
                    static_cast<int>(yv.dtype),
                    static_cast<int>(xv.dtype),
                    static_cast<int>(o.dtype),
                    bias_type,
                    x2d,
                    y2d,
                    workspace_bytes,
                    alignment(yv.data),
                    alignment(xv.data),
                    alignment(o.data)};
  const Plan plan = find_plan(op, a, handle, key, d);
  if (!plan.found) return 0;
  const float alpha = 1.0f, beta = 0.0f;
  lt::check(op,
            a.matmul(handle, d.desc, &alpha, yv.data, d.la, xv.data, d.lb, &beta, o.data, d.ld,
                     o.data, d.ld, &plan.algo, workspace_data, workspace_bytes, ctx.stream()),
            "cublasLtMatmul");
  return 1;
}
