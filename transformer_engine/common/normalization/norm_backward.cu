/* nvte_norm_backward (normalization.h): LayerNorm/RMSNorm backward in two kernels.
 *
 * 1. norm_bwd_kernel: a persistent grid (2 blocks per SM at most, 1 for blocks of 512 threads).
 *    A team (norm_common.cuh) takes one row at a time, holding x and dz in registers as raw bits
 *    and loading its next row's meanwhile: it forms xhat and dy = dz * g (kept in float32
 *    registers for 16-bit inputs, formed again for float32 ones), the row sums of dy and
 *    dy * xhat (one team reduction for both), and writes dx from them. Every thread also
 *    accumulates, in float32 registers, dz * xhat and dz for the columns it owns, over all the
 *    rows its block takes; at the end the block's teams add theirs up in shared memory (in team
 *    order) and the block writes one row of partial dgamma and one of partial dbeta into the
 *    workspace, [blocks, H] each. 16-bit rows of 257-384, 513-768, 1025-1536, 2049-3072,
 *    4097-6144 and 8193-16384 elements take the staged kernel instead (3 or 4 vectors a thread,
 *    the next row staged in shared memory, the same partial rows; norm_backward_staged.cuh)
 *    where the device's shared memory holds the staged rows. Longer rows, and float32 or
 *    odd-width rows past 8192, go through a looped kernel that reads x and dz twice and
 *    accumulates straight into its block's workspace row (each element has one owning thread,
 *    so no atomics).
 * 2. norm_bwd_finalize_kernel: adds the blocks' partial rows up column by column, in a fixed
 *    order independent of scheduling (deterministic), and writes dgamma/dbeta in gamma's dtype.
 *    After the register teams' kernel it is launched as that kernel's programmatic dependent
 *    (util/dependent_launch.cuh), its blocks scheduled while the main kernel runs.
 */
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "cast/dispatch.cuh"
#include "normalization/norm_backward_math.cuh"
#include "normalization/norm_backward_staged.cuh"
#include "normalization/norm_common.cuh"
#include "transformer_engine/normalization.h"
#include "util/dependent_launch.cuh"
#include "util/device_set.h"

namespace transformer_engine {
namespace norm_detail {
namespace {

constexpr int kBlocksPerSm = 2;
constexpr int kLoopThreads = 512;
constexpr int kFinalCols = 32;    // columns per finalize block (one 128-byte row segment)
constexpr int kFinalSlices = 16;  // threads adding up one column's partials, in fixed slices

/* Resident blocks per SM the register kernel is built and launched for: kBlocksPerSm, but one
 * for blocks of 512 threads and more (their registers would not fit twice; a second wave of
 * persistent blocks would double the time). At most kBlocksPerSm: the workspace bound. */
constexpr int bwd_blocks_per_sm(int threads) { return threads >= 512 ? 1 : kBlocksPerSm; }

/* The register teams' kernel (rows of up to 8192 elements; the file comment says how). */
template <class Cfg, typename IType, typename WType>
__global__ void __launch_bounds__(Cfg::kThreads, bwd_blocks_per_sm(Cfg::kThreads))
    norm_bwd_kernel(const BwdParams p) {
  constexpr int kTeam = Cfg::kTeam, kVecs = Cfg::kVecs, kThreads = Cfg::kThreads;
  constexpr int kTeams = Cfg::kTeams;
  __shared__ __align__(8) float scratch[kScratchFloats<kThreads>];
  int phase = 0;
  // Warp teams: each team's column partials, added up in team order at the end.
  __shared__ __align__(16) float team_parts[kTeams > 1 ? kTeams * Cfg::kMaxH : 1];
  const int team = threadIdx.x / kTeam;
  const int t = threadIdx.x % kTeam;
  const float h = static_cast<float>(p.H);
  // The finalize kernel, launched as this one's dependent, may start its blocks now: they wait
  // for this grid's end in wait_for_prerequisite_grid, so what overlaps this kernel's last rows
  // is their launch (H200, BF16 LayerNorm: 0.787 -> 0.80 of the copy at 8192 x 4096). Only
  // here: triggered at the start of the staged kernels it cost their 4-vector teams 1.5 points,
  // at the end of their row loop 15%, so those launch the finalize kernel the ordinary way.
  allow_dependent_launch();
  float dg[kVecs][kVec] = {}, db[kVecs][kVec] = {};
  const IType* x_base = static_cast<const IType*>(p.x);
  const IType* dz_base = static_cast<const IType*>(p.dz);
  // 16-bit inputs keep xhat and dy for dx (below); float32 rows would take too many registers.
  constexpr bool kKeep = sizeof(IType) == 2;
  // The team's rows: row, row + stride, ... The next row's x, dz and statistics are loaded while
  // the current one is worked on (two rows of loads in flight per team); rows wait in registers
  // as raw bits. The kernel is bound by the instructions it issues, so (16-bit inputs) xhat and
  // dy stay in registers for dx rather than being formed again with a second read of gamma
  // (on an H200: 5-12% faster at 8192 x 8192 and 16384 x 2048 BF16, the same at 8192 x 4096).
  const size_t stride = static_cast<size_t>(gridDim.x) * kTeams;
  RawVec<IType> rx[kVecs], rz[kVecs];
  float next_mu = 0.0f, next_rs = 0.0f;
  auto fetch = [&](size_t r) {
    const size_t base = r * static_cast<size_t>(p.H);
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int c = (v * kTeam + t) * kVec;
      const int n = vec_count(c, p.H);
      fetch_raw_rt(x_base + base + c, p.vec, n, rx[v]);
      fetch_raw_rt(dz_base + base + c, p.vec, n, rz[v]);
    }
    next_mu = p.mean != nullptr ? p.mean[r] : 0.0f;
    next_rs = p.rsigma[r];
  };
  size_t row = static_cast<size_t>(blockIdx.x) * kTeams + team;
  if (row < p.rows) fetch(row);
  for (; row < p.rows; row += stride) {
    const size_t base = row * static_cast<size_t>(p.H);
    RawVec<IType> cx[kVecs], cz[kVecs];
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      cx[v] = rx[v];
      cz[v] = rz[v];
    }
    const float mu = next_mu;
    const float rs = next_rs;
    if (row + stride < p.rows) fetch(row + stride);
    float s_dy = 0.0f, s_dyx = 0.0f;
    // x and dz as float32, turned into xhat and dy in place (one vector's worth at a time
    // where they are formed again for dx).
    float xhat[kKeep ? kVecs : 1][kVec], dy[kKeep ? kVecs : 1][kVec];
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int c = (v * kTeam + t) * kVec;
      const int n = vec_count(c, p.H);
      if (n == 0) continue;
      float(&xv)[kVec] = xhat[kKeep ? v : 0];
      float(&dyv)[kVec] = dy[kKeep ? v : 0];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        xv[j] = raw_elem(cx[v], j);
        dyv[j] = raw_elem(cz[v], j);
      }
      row_vector<WType>(p, c, n, mu, rs, xv, dyv, dg[v], db[v], s_dy, s_dyx);
    }
    float m_dy, m_dyx;
    row_means<kTeam, kThreads>(p, h, s_dy, s_dyx, scratch, phase, m_dy, m_dyx);
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int c = (v * kTeam + t) * kVec;
      const int n = vec_count(c, p.H);
      if (n == 0) continue;
      float dx[kVec];
      if constexpr (kKeep) {
        dx_vector(rs, m_dy, m_dyx, xhat[v], dy[v], dx);
      } else {
        dx_from_raw<IType, WType>(p, c, n, mu, rs, m_dy, m_dyx, cx[v], cz[v], dx);
      }
      store_vec(static_cast<IType*>(p.dx) + base + c, p.vec, n, dx);
    }
  }
  // The block's partial row of each sum.
  float* dst[2] = {
      p.part_dgamma + static_cast<size_t>(blockIdx.x) * p.H,
      p.part_dbeta != nullptr ? p.part_dbeta + static_cast<size_t>(blockIdx.x) * p.H : nullptr};
#pragma unroll
  for (int which = 0; which < 2; ++which) {
    if (dst[which] == nullptr) continue;
    const float(&acc)[kVecs][kVec] = which == 0 ? dg : db;
    if constexpr (kTeams == 1) {
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const int c = (v * kTeam + t) * kVec;
        const int n = vec_count(c, p.H);
        if (n > 0) store_vec(dst[which] + c, p.vec_parts, n, acc[v]);
      }
    } else {
      add_team_partials<Cfg>(acc, team, t, p.H, team_parts, dst[which]);
    }
  }
}

/* part[0..n) += add[0..n) for the looped kernel's workspace rows: every load issued before any
 * store (16-byte accesses when vec: p.vec_parts makes H, and so each partial row, a multiple of 8
 * floats, and the workspace 16-byte aligned), not one dependent read-modify-write per element
 * (which serialized the kernel on L2 round trips: 2.3x slower at 2048 x 32768 BF16 on an H200).
 * Plain loads: the kernel itself wrote these rows. */
__device__ __forceinline__ void add_partials(float* __restrict__ part, bool vec, int n,
                                             const float (&add)[kVec]) {
  if (vec && n == kVec) {
    float4* q = reinterpret_cast<float4*>(part);
    float4 a = q[0], b = q[1];
    a.x += add[0], a.y += add[1], a.z += add[2], a.w += add[3];
    b.x += add[4], b.y += add[5], b.z += add[6], b.w += add[7];
    q[0] = a;
    q[1] = b;
  } else {
    float cur[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) cur[j] = j < n ? part[j] : 0.0f;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      if (j < n) part[j] = cur[j] + add[j];
    }
  }
}

/* Rows longer than the register teams: a block per row; pass 1 reads x and dz for the row sums
 * and accumulates the column partials into the block's workspace row, pass 2 reads them again
 * for dx. */
template <typename IType, typename WType>
__global__ void __launch_bounds__(kLoopThreads) norm_bwd_looped_kernel(const BwdParams p) {
  __shared__ __align__(8) float scratch[kScratchFloats<kLoopThreads>];
  int phase = 0;
  const float h = static_cast<float>(p.H);
  float* pg = p.part_dgamma + static_cast<size_t>(blockIdx.x) * p.H;
  float* pb =
      p.part_dbeta != nullptr ? p.part_dbeta + static_cast<size_t>(blockIdx.x) * p.H : nullptr;
  // Every element of the block's rows is later touched by the thread that zeroes it here.
  const float zeros[kVec] = {};
  for (int c = threadIdx.x * kVec; c < p.H; c += kLoopThreads * kVec) {
    const int n = vec_count(c, p.H);
    store_vec(pg + c, p.vec_parts, n, zeros);
    if (pb != nullptr) store_vec(pb + c, p.vec_parts, n, zeros);
  }
  for (size_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const size_t base = row * static_cast<size_t>(p.H);
    const float mu = p.mean != nullptr ? p.mean[row] : 0.0f;
    const float rs = p.rsigma[row];
    float s_dy = 0.0f, s_dyx = 0.0f;
    float x[kVec], dz[kVec];
    for (int c = threadIdx.x * kVec; c < p.H; c += kLoopThreads * kVec) {
      const int n = vec_count(c, p.H);
      load_vec(static_cast<const IType*>(p.x) + base + c, p.vec, n, x);
      load_vec(static_cast<const IType*>(p.dz) + base + c, p.vec, n, dz);
      float dg[kVec] = {}, db[kVec] = {};
      row_vector<WType>(p, c, n, mu, rs, x, dz, dg, db, s_dy, s_dyx);
      add_partials(pg + c, p.vec_parts, n, dg);
      if (pb != nullptr) add_partials(pb + c, p.vec_parts, n, db);
    }
    float m_dy = 0.0f, m_dyx;
    if (p.mean != nullptr) {
      const float2 sums =
          team_sum2<kLoopThreads, kLoopThreads>(make_float2(s_dy, s_dyx), scratch, phase);
      m_dy = sums.x / h;
      m_dyx = sums.y / h;
    } else {
      m_dyx = team_sum<kLoopThreads, kLoopThreads>(s_dyx, scratch, phase) / h;
    }
    for (int c = threadIdx.x * kVec; c < p.H; c += kLoopThreads * kVec) {
      const int n = vec_count(c, p.H);
      load_vec(static_cast<const IType*>(p.x) + base + c, p.vec, n, x);
      load_vec(static_cast<const IType*>(p.dz) + base + c, p.vec, n, dz);
      float dg[kVec] = {}, db[kVec] = {}, unused0 = 0.0f, unused1 = 0.0f, dx[kVec];
      row_vector<WType>(p, c, n, mu, rs, x, dz, dg, db, unused0, unused1);
      dx_vector(rs, m_dy, m_dyx, x, dz, dx);
      store_vec(static_cast<IType*>(p.dx) + base + c, p.vec, n, dx);
    }
  }
}

/* out[c] = sum over blocks k of parts[k * H + c] (blockIdx.y picks dgamma or dbeta). Thread
 * (x, y) adds up blocks y, y + 16, ... of column x in order; the 16 slices are then added in
 * order: the same sum every run. */
template <typename WType>
__global__ void __launch_bounds__(kFinalCols* kFinalSlices)
    norm_bwd_finalize_kernel(const float* __restrict__ part_dgamma,
                             const float* __restrict__ part_dbeta, WType* dgamma, WType* dbeta,
                             int blocks, int H) {
  __shared__ float slices[kFinalSlices][kFinalCols + 1];
  wait_for_prerequisite_grid();  // the partial rows are the main kernel's output
  const float* parts = blockIdx.y == 0 ? part_dgamma : part_dbeta;
  WType* out = blockIdx.y == 0 ? dgamma : dbeta;
  const int c = blockIdx.x * kFinalCols + threadIdx.x;
  float sum = 0.0f;
  if (c < H) {
    // Eight loads in flight a thread (the sum's order unchanged): the kernel waits on them.
#pragma unroll 8
    for (int k = threadIdx.y; k < blocks; k += kFinalSlices) {
      sum += parts[static_cast<size_t>(k) * H + c];
    }
  }
  slices[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && c < H) {
    float total = 0.0f;
#pragma unroll
    for (int s = 0; s < kFinalSlices; ++s) total += slices[s][threadIdx.x];
    out[c] = from_float<WType>(total);
  }
}

/* Multiprocessors of `device`, asked once per device (cudaDeviceGetAttribute is allowed during
 * graph capture). */
int device_sm_count(const char* op, int device) {
  static std::mutex mutex;
  static std::vector<int> counts;
  if (device < 0) throw_invalid(op, "device index must be >= 0, got ", device);
  std::lock_guard<std::mutex> lock(mutex);
  if (static_cast<size_t>(device) >= counts.size()) counts.resize(device + 1, 0);
  if (counts[device] == 0) {
    const cudaError_t status =
        cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device);
    if (status != cudaSuccess) {
      counts[device] = 0;
      cudaGetLastError();  // not left behind for a later launch check to report
      check_cuda(op, status, "cudaDeviceGetAttribute(MultiProcessorCount)");
    }
  }
  return counts[device];
}

/* Blocks of the main kernel: one per `rows_per_block` rows, at most blocks_per_sm per SM. The
 * workspace formula bounds this for any team (rows_per_block >= 1). */
size_t backward_blocks(size_t rows, size_t rows_per_block, int sm_count,
                       int blocks_per_sm = kBlocksPerSm) {
  const size_t wanted = (rows + rows_per_block - 1) / rows_per_block;
  return std::min(wanted, static_cast<size_t>(blocks_per_sm) * sm_count);
}

/* Calls f(Config{}) with the register kernel's team for rows of H elements, or f(nullptr) when
 * H is longer than those teams hold (the looped kernel). At most 2 vectors a thread: the
 * backward keeps two rows (x and dz) plus the per-column sums in registers. From H = 257 the
 * blocks have 512 threads, one a SM (16 warps, as two blocks of 256): every block writes a
 * partial row of each column sum for the finalize kernel to add up, so half the blocks halve
 * that fixed traffic (on an H200, BF16: LayerNorm 0.77 -> 0.79 of the copy at 8192 x 4096 and
 * 0.78 -> 0.81 at 16384 x 2048; at 131072 x 256 blocks of 256 stayed 1% faster). Blocks of 128
 * had run at 0.46-0.75 where 256 gave 0.65-0.77 (H = 256-2048), and teams of one vector a
 * thread with twice the warps 0.54-0.68 where these gave 0.61-0.85. Half-warp teams to H = 256
 * (as the forward's): 0.72 -> 0.83 at 131072 x 256. */
template <typename F>
void dispatch_backward_team(int H, F&& f) {
  if (H <= 128) {
    f(TeamConfig<16, 1, 256>{});
  } else if (H <= 256) {
    f(TeamConfig<16, 2, 256>{});
  } else if (H <= 512) {
    f(TeamConfig<32, 2, 512>{});
  } else if (H <= 1024) {
    f(TeamConfig<64, 2, 512>{});
  } else if (H <= 2048) {
    f(TeamConfig<128, 2, 512>{});
  } else if (H <= 4096) {
    f(TeamConfig<256, 2, 512>{});
  } else if (H <= 8192) {
    f(TeamConfig<512, 2, 512>{});
  } else {
    f(nullptr);
  }
}

/* Calls f(Config{}) with the staged kernel's team for rows of H 16-bit elements (whole vectors;
 * norm_backward_staged.cuh), or nothing where the register teams take them. Three vectors a thread
 * where the register teams' two left a quarter or more of their vectors as padding: half warps to
 * 384 elements, warps to 768, teams of 2 and 4 warps to 1536 and 3072 (blocks of 512, one a SM), 8
 * warps to 6144 (two blocks of 256 a SM); rows of 8193-16384, one team of 512 a block, 3 vectors a
 * thread to 12288, else 4. */
template <typename F>
void dispatch_staged_backward_team(int H, F&& f) {
  if (H > 256 && H <= 384) {
    f(TeamConfig<16, 3, 512>{});
  } else if (H > 512 && H <= 768) {
    f(TeamConfig<32, 3, 512>{});
  } else if (H > 1024 && H <= 1536) {
    f(TeamConfig<64, 3, 512>{});
  } else if (H > 2048 && H <= 3072) {
    f(TeamConfig<128, 3, 512>{});
  } else if (H > 4096 && H <= 6144) {
    f(TeamConfig<256, 3, 256>{});
  } else if (H > 8192 && H <= 12288) {
    f(TeamConfig<512, 3, 512>{});
  } else if (H > 12288 && H <= 16384) {
    f(TeamConfig<512, 4, 512>{});
  }
}

template <typename IType, typename WType>
void launch_backward(CallContext& ctx, BwdParams p, WType* dgamma, WType* dbeta, int sm_count) {
  size_t blocks = 0;
  bool dependent_finalize = false;
  if (p.rows > 0) {
    bool staged = false;
    if constexpr (sizeof(IType) == 2) {
      // Where the device lets a block take the staged rows (x's and dz's vectors) beside its
      // static shared memory: 48 or 64 KiB, within Ampere's, Ada's and Hopper's limits.
      if (p.vec) {
        dispatch_staged_backward_team(p.H, [&](auto cfg) {
          using Cfg = decltype(cfg);
          constexpr int bytes = staged_backward_bytes<Cfg>();
          if (bytes > ctx.max_shared_memory_per_block() - 1024) return;
          static DeviceSet done;  // one per kernel (this lambda's instantiation)
          auto kernel = norm_bwd_staged_kernel<Cfg, IType, WType>;
          allow_dynamic_smem(ctx, kernel, bytes, done);
          blocks = backward_blocks(p.rows, Cfg::kTeams, sm_count,
                                   staged_backward_blocks_per_sm(Cfg::kThreads));
          kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, bytes, ctx.stream()>>>(p);
          ctx.check_launch("norm_bwd_staged_kernel launch");
          staged = true;
        });
      }
    }
    if (!staged) {
      dispatch_backward_team(p.H, [&](auto cfg) {
        using Cfg = decltype(cfg);
        if constexpr (std::is_same_v<Cfg, std::nullptr_t>) {
          blocks = backward_blocks(p.rows, 1, sm_count);
          norm_bwd_looped_kernel<IType, WType>
              <<<static_cast<unsigned>(blocks), kLoopThreads, 0, ctx.stream()>>>(p);
          ctx.check_launch("norm_bwd_looped_kernel launch");
        } else {
          blocks = backward_blocks(p.rows, Cfg::kTeams, sm_count, bwd_blocks_per_sm(Cfg::kThreads));
          norm_bwd_kernel<Cfg, IType, WType>
              <<<static_cast<unsigned>(blocks), Cfg::kThreads, 0, ctx.stream()>>>(p);
          ctx.check_launch("norm_bwd_kernel launch");
          dependent_finalize = true;
        }
      });
    }
  }
  const dim3 grid((p.H + kFinalCols - 1) / kFinalCols, dbeta != nullptr ? 2 : 1);
  const dim3 block(kFinalCols, kFinalSlices);
  if (dependent_finalize) {
    static DeviceSet known, capable;
    launch_as_dependent(ctx, norm_bwd_finalize_kernel<WType>, grid, block, known, capable,
                        p.part_dgamma, p.part_dbeta, dgamma, dbeta, static_cast<int>(blocks), p.H);
  } else {
    norm_bwd_finalize_kernel<WType><<<grid, block, 0, ctx.stream()>>>(
        p.part_dgamma, p.part_dbeta, dgamma, dbeta, static_cast<int>(blocks), p.H);
  }
  ctx.check_launch("norm_bwd_finalize_kernel launch");
}

}  // namespace
}  // namespace norm_detail
}  // namespace transformer_engine

extern "C" size_t nvte_norm_backward_workspace_elements(size_t rows, size_t H, int device) {
  using namespace transformer_engine::norm_detail;
  const int sm = device_sm_count("nvte_norm_backward_workspace_elements", device);
  return 2 * H * std::min(rows, static_cast<size_t>(kBlocksPerSm) * sm);
}

extern "C" void nvte_norm_backward(const NVTEBuffer* dz, const NVTEBuffer* input,
                                   const NVTEBuffer* mean, const NVTEBuffer* rsigma,
                                   const NVTEBuffer* gamma, int zero_centered_gamma, int rms,
                                   NVTEBuffer* dx, NVTEBuffer* dgamma, NVTEBuffer* dbeta,
                                   NVTEBuffer* workspace, int device, NVTEStream stream) {
  using namespace transformer_engine;
  using namespace transformer_engine::norm_detail;
  const char* op = "nvte_norm_backward";
  const NVTEBuffer& x = require(op, "input", input);
  const NormShape shape = check_norm_input(op, "input", x);
  check_matrix(op, "dz", require(op, "dz", dz), shape.rows, shape.H, x.dtype);
  check_matrix(op, "dx", require(op, "dx", dx), shape.rows, shape.H, x.dtype);
  if (rms) {
    if (mean != nullptr) throw_invalid(op, "RMSNorm has no mean; pass null");
    if (dbeta != nullptr) throw_invalid(op, "RMSNorm has no beta; pass dbeta = null");
  } else {
    check_stat(op, "mean", require(op, "mean", mean), shape.rows);
  }
  check_stat(op, "rsigma", require(op, "rsigma", rsigma), shape.rows);
  const NVTEBuffer& g = require(op, "gamma", gamma);
  check_param(op, "gamma", g, shape.H, x.dtype, kNVTENumTypes);
  check_param(op, "dgamma", require(op, "dgamma", dgamma), shape.H, x.dtype, g.dtype);
  if (dbeta != nullptr) check_param(op, "dbeta", *dbeta, shape.H, x.dtype, g.dtype);
  const NVTEBuffer& ws = require(op, "workspace", workspace);
  check_well_formed(op, "workspace", ws);
  check_dtype(op, "workspace", ws, {kNVTEFloat32});

  CallContext ctx(op, device, stream);
  const int sm_count = ctx.sm_count();
  const size_t needed = 2 * static_cast<size_t>(shape.H) *
                        std::min(shape.rows, static_cast<size_t>(kBlocksPerSm) * sm_count);
  if (numel(ws) < needed) {
    throw_invalid(op, "workspace has ", numel(ws), " elements; [", shape.rows, ", ", shape.H,
                  "] needs nvte_norm_backward_workspace_elements = ", needed);
  }
  ctx.check_on_device("dz", *dz);
  ctx.check_on_device("input", x);
  if (mean != nullptr) ctx.check_on_device("mean", *mean);
  ctx.check_on_device("rsigma", *rsigma);
  ctx.check_on_device("gamma", g);
  ctx.check_on_device("dx", *dx);
  ctx.check_on_device("dgamma", *dgamma);
  if (dbeta != nullptr) ctx.check_on_device("dbeta", *dbeta);
  ctx.check_on_device("workspace", ws);

  BwdParams p{};
  p.dz = dz->data;
  p.x = x.data;
  p.mean = rms ? nullptr : static_cast<const float*>(mean->data);
  p.rsigma = static_cast<const float*>(rsigma->data);
  p.gamma = g.data;
  p.dx = dx->data;
  // Partial rows: dgamma's at the start, dbeta's after the largest grid's dgamma rows.
  const size_t half = needed / 2;
  p.part_dgamma = static_cast<float*>(ws.data);
  p.part_dbeta = dbeta != nullptr ? static_cast<float*>(ws.data) + half : nullptr;
  p.rows = shape.rows;
  p.H = shape.H;
  p.zero_centered = zero_centered_gamma != 0;
  p.vec = shape.H % kVec == 0 && aligned_to(x.data, 16) && aligned_to(dz->data, 16) &&
          aligned_to(dx->data, 16) && aligned_to(g.data, 16);
  p.vec_parts = p.vec && aligned_to(ws.data, 16);
  dispatch_high_precision(op, x.dtype, [&](auto itype) {
    using IType = decltype(itype);
    dispatch_param<IType>(g.dtype, [&](auto wtype) {
      using WType = decltype(wtype);
      launch_backward<IType, WType>(ctx, p, static_cast<WType*>(dgamma->data),
                                    dbeta != nullptr ? static_cast<WType*>(dbeta->data) : nullptr,
                                    sm_count);
    });
  });
}
