/* Transposing FP8 bytes in registers: the cast+transpose and norm kernels read their staged
 * tile from shared memory a 32-bit word (4 bytes of a row) at a time and turn 4 such words of 4
 * consecutive rows into 4 words of 4 consecutive rows of one column each, which they store. */
#ifndef TRANSFORMER_ENGINE_COMMON_UTIL_BYTE_TRANSPOSE_CUH_
#define TRANSFORMER_ENGINE_COMMON_UTIL_BYTE_TRANSPOSE_CUH_

#include <cstdint>

namespace transformer_engine {

/* Four 32-bit words (4 bytes of 4 rows) to four columns of 4 row bytes: col[k] holds byte k of
 * a, b, c, d (in that order, low byte first). */
__device__ __forceinline__ void transpose_4x4(const uint32_t a, const uint32_t b, const uint32_t c,
                                              const uint32_t d, uint32_t (&col)[4]) {
  const uint32_t ab_lo = __byte_perm(a, b, 0x5140);  // a0 b0 a1 b1
  const uint32_t ab_hi = __byte_perm(a, b, 0x7362);  // a2 b2 a3 b3
  const uint32_t cd_lo = __byte_perm(c, d, 0x5140);
  const uint32_t cd_hi = __byte_perm(c, d, 0x7362);
  col[0] = __byte_perm(ab_lo, cd_lo, 0x5410);  // a0 b0 c0 d0
  col[1] = __byte_perm(ab_lo, cd_lo, 0x7632);  // a1 b1 c1 d1
  col[2] = __byte_perm(ab_hi, cd_hi, 0x5410);
  col[3] = __byte_perm(ab_hi, cd_hi, 0x7632);
}

}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_UTIL_BYTE_TRANSPOSE_CUH_
