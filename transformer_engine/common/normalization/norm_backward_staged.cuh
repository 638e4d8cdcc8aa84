/* The LayerNorm/RMSNorm backward of 16-bit rows whose register teams (norm_backward.cu) would
 * leave a quarter or more of their vectors as padding, or have no registers for: teams of threads
 * holding 3 vectors of the row each (4 past 12288 elements), the next row staged in shared memory.
 * norm_backward.cu's dispatch_staged_backward_team picks it where the device lets a block take
 * the staged rows (48 KiB for 3 vectors a thread, 64 KiB for 4): rows of 8193-16384 elements as
 * one team of 512 threads a block, one block a SM; 4097-6144 as one team of 256, two blocks a SM;
 * 257-384, 513-768, 1025-1536 and 2049-3072 as blocks of 512 threads, one a SM, split into teams
 * of half a warp, a warp, 2 warps and 4 warps (their partials added up in team order at the end,
 * through the staging buffer). On an H200, BF16 LayerNorm / RMSNorm, fractions of the copy
 * bandwidth: 8192 x 5120 0.69 -> 0.77 / 0.72 -> 0.81, 65536 x 640 0.59 -> 0.80 / 0.61 -> 0.82,
 * 65536 x 1280 0.70 -> 0.84 / 0.73 -> 0.86, 16384 x 2560 0.67 -> 0.76 / 0.71 -> 0.79.
 *
 * The register teams of shorter rows keep their next row's loads in flight in registers and
 * their column partials (dz * xhat and dz over the block's rows) in registers too. Here the
 * partials (2 x 8 floats a vector) and the current row's raw words fill the registers, so the
 * next row's x and dz are staged in shared memory with cp.async instead: once the first pass has
 * converted every staged word of the row (its sums), the thread refills its own slots with the
 * next row, whose loads are then in flight through the row's team reduction and dx. Every thread
 * reads back only the slots it staged itself, so no barrier guards the buffer. dx forms xhat and
 * dy again from the raw words (the same bits as the first pass).
 *
 * What it replaced (on an H200, BF16, fractions of the copy bandwidth in
 * docs/performance_norms.md):
 * partials in shared memory, read-modify-written every row (ncu: a third of the warps' stalls
 * waiting on shared memory), with 3 vectors two blocks a SM each loading its row when it reached
 * it, with 4 the next row prefetched in registers. Measured and not kept: two staged buffers read
 * by both passes (no raw words in registers), and xhat and dy kept in registers with the partials
 * in shared memory (both 8-15% slower); teams of 640-768 threads (spills). */
#ifndef TRANSFORMER_ENGINE_COMMON_NORMALIZATION_NORM_BACKWARD_STAGED_CUH_
#define TRANSFORMER_ENGINE_COMMON_NORMALIZATION_NORM_BACKWARD_STAGED_CUH_

#include "normalization/norm_backward_math.cuh"
#include "util/cp_async.cuh"

namespace transformer_engine {
namespace norm_detail {

/* Dynamic shared memory of the staged kernel: x's and dz's vectors of every thread, 16 bytes
 * each. */
template <class Cfg>
constexpr int staged_backward_bytes() {
  return 2 * Cfg::kVecs * Cfg::kThreads * 16;
}

/* Resident blocks a SM: one of 512 threads, two of 256 (rows of 4097-6144 elements), 128
 * registers a thread either way; at most the workspace's two partial rows a SM. */
constexpr int staged_backward_blocks_per_sm(int threads) { return threads >= 512 ? 1 : 2; }

/* p.vec (whole 16-byte vectors), 16-bit IType. Team k of block b takes rows b * kTeams + k, then
 * every gridDim.x * kTeams-th row after it (one team a block for the rows past 4096 elements;
 * teams of half a warp to 4 warps for the narrower ones). */
template <class Cfg, typename IType, typename WType>
__global__ void __launch_bounds__(Cfg::kThreads, staged_backward_blocks_per_sm(Cfg::kThreads))
    norm_bwd_staged_kernel(const BwdParams p) {
  constexpr int kVecs = Cfg::kVecs, kThreads = Cfg::kThreads, kTeam = Cfg::kTeam;
  constexpr int kTeams = Cfg::kTeams;
  static_assert(sizeof(IType) == 2, "16-bit rows");
  __shared__ __align__(8) float scratch[kScratchFloats<kThreads>];
  extern __shared__ uint4 stage[];  // [x, dz][kVecs][kThreads]
  int phase = 0;
  const int team = kTeams == 1 ? 0 : threadIdx.x / kTeam;
  const int t = kTeams == 1 ? threadIdx.x : threadIdx.x % kTeam;
  const int slot = threadIdx.x;  // the thread's own slot of each staged vector
  const float h = static_cast<float>(p.H);
  const IType* x_base = static_cast<const IType*>(p.x);
  const IType* dz_base = static_cast<const IType*>(p.dz);
  float next_mu = 0.0f, next_rs = 0.0f;
  auto stage_row = [&](size_t r) {
    const size_t base = r * static_cast<size_t>(p.H);
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int c = (v * kTeam + t) * kVec;
      if (c < p.H) {
        cp_async_16(stage + v * kThreads + slot, x_base + base + c, 16);
        cp_async_16(stage + (kVecs + v) * kThreads + slot, dz_base + base + c, 16);
      }
    }
    cp_async_commit();
    next_mu = p.mean != nullptr ? p.mean[r] : 0.0f;
    next_rs = p.rsigma[r];
  };
  float dg[kVecs][kVec] = {}, db[kVecs][kVec] = {};
  const size_t stride = static_cast<size_t>(gridDim.x) * kTeams;
  size_t row = static_cast<size_t>(blockIdx.x) * kTeams + team;
  if (row < p.rows) stage_row(row);
  for (; row < p.rows; row += stride) {
    const size_t base = row * static_cast<size_t>(p.H);
    const float mu = next_mu, rs = next_rs;
    cp_async_wait<0>();
    // Every slot is read back; those past the row's end were never staged and their words are
    // never used (both passes skip those vectors).
    RawVec<IType> rx[kVecs], rz[kVecs];
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      put_chunk(rx[v], 0, stage[v * kThreads + slot]);
      put_chunk(rz[v], 0, stage[(kVecs + v) * kThreads + slot]);
    }
    float s_dy = 0.0f, s_dyx = 0.0f;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int c = (v * kTeam + t) * kVec;
      if (c >= p.H) continue;
      float x[kVec], dz[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        x[j] = raw_elem(rx[v], j);
        dz[j] = raw_elem(rz[v], j);
      }
      row_vector<WType>(p, c, kVec, mu, rs, x, dz, dg[v], db[v], s_dy, s_dyx);
    }
    // The staged words were consumed above (the first pass used every one): the buffer takes
    // the next row, whose loads are in flight through the row's sums and dx.
    if (row + stride < p.rows) stage_row(row + stride);
    float m_dy, m_dyx;
    row_means<kTeam, kThreads>(p, h, s_dy, s_dyx, scratch, phase, m_dy, m_dyx);
    // xhat and dy formed again from the raw words: the registers that would keep them hold the
    // partials.
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int c = (v * kTeam + t) * kVec;
      if (c >= p.H) continue;
      float dx[kVec];
      dx_from_raw<IType, WType>(p, c, kVec, mu, rs, m_dy, m_dyx, rx[v], rz[v], dx);
      store_vec(static_cast<IType*>(p.dx) + base + c, true, kVec, dx);
    }
  }
  // The block's partial row of each sum.
  float* dgamma_row = p.part_dgamma + static_cast<size_t>(blockIdx.x) * p.H;
  float* dbeta_row =
      p.part_dbeta != nullptr ? p.part_dbeta + static_cast<size_t>(blockIdx.x) * p.H : nullptr;
  if constexpr (kTeams == 1) {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int c = (v * kTeam + t) * kVec;
      if (c >= p.H) continue;
      store_vec(dgamma_row + c, p.vec_parts, kVec, dg[v]);
      if (dbeta_row != nullptr) store_vec(dbeta_row + c, p.vec_parts, kVec, db[v]);
    }
  } else {
    static_assert(kTeams * Cfg::kMaxH * 4 == staged_backward_bytes<Cfg>(),
                  "the teams' partial rows fill the staging buffer");
    add_team_partials<Cfg>(dg, team, t, p.H, reinterpret_cast<float*>(stage), dgamma_row);
    if (dbeta_row != nullptr) {
      add_team_partials<Cfg>(db, team, t, p.H, reinterpret_cast<float*>(stage), dbeta_row);
    }
  }
}

}  // namespace norm_detail
}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_NORMALIZATION_NORM_BACKWARD_STAGED_CUH_
