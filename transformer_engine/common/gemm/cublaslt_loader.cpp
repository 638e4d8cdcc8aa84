#include "gemm/cublaslt_loader.h"

#include <dlfcn.h>

#include <mutex>
#include <vector>

#include "util/errors.h"

namespace transformer_engine {
namespace cublaslt {

namespace {

// CUDA 13's soname first: this library is built with CUDA 13 (12.8 at least), and torch's CUDA
// 13 builds load libcublasLt.so.13. A CUDA 12 torch brings .so.12 (12.9+ has the scale modes).
constexpr const char* kSonames[] = {"libcublasLt.so.13", "libcublasLt.so.12"};

struct Loaded {
  Api api{};
  bool ok = false;
  std::string why;
  size_t version = 0;
};

template <typename F>
bool resolve(void* library, const char* name, F* slot, std::string* why) {
  *slot = reinterpret_cast<F>(dlsym(library, name));
  if (*slot == nullptr) {
    *why = concat("libcublasLt has no ", name, " (too old a cuBLASLt)");
    return false;
  }
  return true;
}

Loaded load() {
  Loaded out;
  void* library = nullptr;
  // The copy torch (or anything else) already loaded, so that one cuBLASLt serves the process.
  for (const char* name : kSonames) {
    library = dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (library != nullptr) break;
  }
  for (size_t i = 0; library == nullptr && i < sizeof(kSonames) / sizeof(kSonames[0]); ++i) {
    library = dlopen(kSonames[i], RTLD_NOW | RTLD_LOCAL);
  }
  if (library == nullptr) {
    out.why = "libcublasLt.so.13 / .so.12 could not be loaded (PyTorch's CUDA build brings one)";
    return out;
  }
  Api& a = out.api;
  if (!resolve(library, "cublasLtCreate", &a.create, &out.why) ||
      !resolve(library, "cublasLtGetVersion", &a.get_version, &out.why) ||
      !resolve(library, "cublasLtGetStatusString", &a.get_status_string, &out.why) ||
      !resolve(library, "cublasLtMatmulDescCreate", &a.desc_create, &out.why) ||
      !resolve(library, "cublasLtMatmulDescDestroy", &a.desc_destroy, &out.why) ||
      !resolve(library, "cublasLtMatmulDescSetAttribute", &a.desc_set, &out.why) ||
      !resolve(library, "cublasLtMatrixLayoutCreate", &a.layout_create, &out.why) ||
      !resolve(library, "cublasLtMatrixLayoutDestroy", &a.layout_destroy, &out.why) ||
      !resolve(library, "cublasLtMatmulPreferenceCreate", &a.preference_create, &out.why) ||
      !resolve(library, "cublasLtMatmulPreferenceDestroy", &a.preference_destroy, &out.why) ||
      !resolve(library, "cublasLtMatmulPreferenceSetAttribute", &a.preference_set, &out.why) ||
      !resolve(library, "cublasLtMatmulAlgoGetHeuristic", &a.heuristic, &out.why) ||
      !resolve(library, "cublasLtMatmul", &a.matmul, &out.why)) {
    return out;
  }
  out.version = a.get_version();
  if (out.version < 120900) {
    out.why = concat("cuBLASLt ", static_cast<uint64_t>(out.version),
                     " has no block-scaled FP8 GEMM (12.9 or later has)");
    return out;
  }
  out.ok = true;
  return out;
}

const Loaded& loaded() {
  static const Loaded instance = load();  // thread-safe initialization, once per process
  return instance;
}

}  // namespace

const Api* api(std::string* why) {
  const Loaded& l = loaded();
  if (!l.ok && why != nullptr) *why = l.why;
  return l.ok ? &l.api : nullptr;
}

size_t version() { return loaded().ok ? loaded().version : 0; }

void check(const char* op, Status status, const char* what) {
  if (status != 0) {
    const Api* a = api(nullptr);
    const char* text = a != nullptr ? a->get_status_string(status) : "cuBLASLt not loaded";
    throw_runtime(op, what, " failed: cuBLASLt status ", status, " (", text, ")");
  }
}

Handle handle(const char* op) {
  // One handle per device, created with that device current (the caller's CallContext), as
  // PyTorch keeps its own: the handle holds per-device state such as its heuristics cache.
  static std::mutex mutex;
  static std::vector<Handle> handles;
  int device = -1;
  check_cuda(op, cudaGetDevice(&device), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mutex);
  if (static_cast<size_t>(device) >= handles.size()) handles.resize(device + 1, nullptr);
  if (handles[device] == nullptr) {
    std::string why;
    const Api* a = api(&why);
    if (a == nullptr) throw_runtime(op, why);
    check(op, a->create(&handles[device]), "cublasLtCreate");
  }
  return handles[device];
}

}  // namespace cublaslt
}  // namespace transformer_engine
