/* What the LayerNorm/RMSNorm backward kernels share (norm_backward.cu,
 * norm_backward_staged.cuh): their parameters, the per-row arithmetic of one vector, and the sum
 * of several teams' column partials. */
#ifndef TRANSFORMER_ENGINE_COMMON_NORMALIZATION_NORM_BACKWARD_MATH_CUH_
#define TRANSFORMER_ENGINE_COMMON_NORMALIZATION_NORM_BACKWARD_MATH_CUH_

#include "normalization/norm_common.cuh"

namespace transformer_engine {
namespace norm_detail {

struct BwdParams {
  const void* dz;
  const void* x;
  const float* mean;  // null for RMSNorm
  const float* rsigma;
  const void* gamma;
  void* dx;
  float* part_dgamma;  // [blocks, H]
  float* part_dbeta;   // [blocks, H], or null
  size_t rows;
  int H;
  bool zero_centered;
  bool vec;
  // vec, and the workspace 16-byte aligned: the partial rows are read and written 16 bytes at a
  // time. Consecutive threads own consecutive runs of 8 columns, so 4-byte stores would touch
  // eight 32-byte sectors per warp instruction: on an H200 they cost the kernel 6-9 us per sum at
  // H = 4096 (every block writes its rows at the end), a fifth of LayerNorm's backward at
  // 8192 x 4096.
  bool vec_parts;
};

/* The per-row arithmetic of one vector: x becomes xhat and dz becomes dy; the column partials
 * and the row sums take their share. Padding (dz = 0) adds nothing anywhere. */
template <typename WType>
__device__ __forceinline__ void row_vector(const BwdParams& p, int c, int n, float mu, float rs,
                                           float (&x)[kVec], float (&dz)[kVec], float (&dg)[kVec],
                                           float (&db)[kVec], float& s_dy, float& s_dyx) {
  float g[kVec];
  load_vec(static_cast<const WType*>(p.gamma) + c, p.vec, n, g);
  make_effective_gamma(g, p.zero_centered);
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const float xhat = (x[j] - mu) * rs;
    dg[j] += dz[j] * xhat;
    db[j] += dz[j];
    const float dy = dz[j] * g[j];
    s_dy += dy;
    s_dyx += dy * xhat;
    x[j] = xhat;
    dz[j] = dy;
  }
}

__device__ __forceinline__ void dx_vector(float rs, float m_dy, float m_dyx,
                                          const float (&xhat)[kVec], const float (&dy)[kVec],
                                          float (&dx)[kVec]) {
#pragma unroll
  for (int j = 0; j < kVec; ++j) dx[j] = rs * (dy[j] - m_dy - xhat[j] * m_dyx);
}

/* The row's means of dy and dy * xhat over the team (every thread gets the same bits): RMSNorm
 * has no mean(dy) term; LayerNorm's two sums share one team reduction (one barrier). Every
 * thread of the team calls it (team_sum's contract). */
template <int kTeam, int kThreads>
__device__ __forceinline__ void row_means(const BwdParams& p, float h, float s_dy, float s_dyx,
                                          float* scratch, int& phase, float& m_dy, float& m_dyx) {
  if (p.mean != nullptr) {
    const float2 sums = team_sum2<kTeam, kThreads>(make_float2(s_dy, s_dyx), scratch, phase);
    m_dy = sums.x / h;
    m_dyx = sums.y / h;
  } else {
    m_dy = 0.0f;
    m_dyx = team_sum<kTeam, kThreads>(s_dyx, scratch, phase) / h;
  }
}

/* dx of one vector, forming xhat and dy again from its raw words (the same bits as the row's
 * first pass) where registers do not keep them. */
template <typename IType, typename WType>
__device__ __forceinline__ void dx_from_raw(const BwdParams& p, int c, int n, float mu, float rs,
                                            float m_dy, float m_dyx, const RawVec<IType>& rx,
                                            const RawVec<IType>& rz, float (&dx)[kVec]) {
  float x[kVec], dz[kVec], unused_g[kVec] = {}, unused_b[kVec] = {};
  float unused0 = 0.0f, unused1 = 0.0f;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    x[j] = raw_elem(rx, j);
    dz[j] = raw_elem(rz, j);
  }
  row_vector<WType>(p, c, n, mu, rs, x, dz, unused_g, unused_b, unused0, unused1);
  dx_vector(rs, m_dy, m_dyx, x, dz, dx);
}

/* Several teams a block: the block's partial row, out[c] = the teams' partials of column c added
 * in team order (the same sum every run), through `parts`: kTeams rows of kMaxH floats in shared
 * memory, 16-byte aligned (the register kernel's own array; the staged kernel's staging buffer,
 * whose 2 * kVecs * kThreads 16-byte slots are exactly that). Every thread of the block calls it
 * once its team left the row loop (no cp.async pending then); the barrier it starts with also
 * orders a second call after the first one's reads. */
template <class Cfg>
__device__ __forceinline__ void add_team_partials(const float (&acc)[Cfg::kVecs][kVec], int team,
                                                  int t, int H, float* parts, float* out) {
  __syncthreads();  // every team done with its rows (staged or not), or with the last call's reads
#pragma unroll
  for (int v = 0; v < Cfg::kVecs; ++v) {
    const int c = (v * Cfg::kTeam + t) * kVec;
    float4* q = reinterpret_cast<float4*>(parts + team * Cfg::kMaxH + c);
    q[0] = make_float4(acc[v][0], acc[v][1], acc[v][2], acc[v][3]);
    q[1] = make_float4(acc[v][4], acc[v][5], acc[v][6], acc[v][7]);
  }
  __syncthreads();
  for (int c = threadIdx.x; c < H; c += Cfg::kThreads) {
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < Cfg::kTeams; ++k) total += parts[k * Cfg::kMaxH + c];
    out[c] = total;
  }
}

}  // namespace norm_detail
}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_NORMALIZATION_NORM_BACKWARD_MATH_CUH_
