// Rows stored as float32, bfloat16 or float16 (tpu_embedding.RowStorage):
// read as float32 (exact), written back rounded to nearest (even) or
// stochastically, exactly as tpu_embedding/row_storage.py rounds with
// TensorFlow ops (same draws, same float32 operations).
#ifndef TPU_EMBEDDING_KERNELS_ROW_TYPES_H_
#define TPU_EMBEDDING_KERNELS_ROW_TYPES_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "tensorflow/core/framework/numeric_types.h"

namespace tensorflow {
namespace row_types {

// The largest finite float16.
constexpr float kFloat16Max = 65504.0f;

inline uint32_t Bits(float x) {
  uint32_t w;
  std::memcpy(&w, &x, sizeof(w));
  return w;
}

inline float FromBits(uint32_t w) {
  float x;
  std::memcpy(&x, &w, sizeof(x));
  return x;
}

// A 32-bit integer finaliser (row_storage._mix32).
inline uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// The hash of (seed, stream, step, row) a row's columns draw from
// (row_storage.random_bits): bits of column c = Mix32(RowHash ^ c).
inline uint32_t RowHash(int64_t seed, int64_t stream, int64_t step,
                        int64_t row) {
  uint32_t h = Mix32(static_cast<uint32_t>(seed) ^
                     Mix32(static_cast<uint32_t>(stream)));
  h = Mix32(h ^ static_cast<uint32_t>(step));
  h = Mix32(h ^ static_cast<uint32_t>(row));
  return Mix32(h ^ static_cast<uint32_t>(static_cast<uint64_t>(row) >> 32));
}

// Stored value -> float32.
inline float ToFloat(float x) { return x; }
inline float ToFloat(Eigen::bfloat16 x) { return static_cast<float>(x); }
inline float ToFloat(Eigen::half x) { return static_cast<float>(x); }

// float32 -> stored value, to nearest (ties to even), as tf.cast.
template <typename T>
inline T Nearest(float x) {
  return static_cast<T>(x);
}

// float32 -> bfloat16 with the draw `bits`: hi (the neighbour above x)
// when (bits >> 16) < low 16 bits of x for x > 0, or < 2^16 - low for
// x < 0 (row_storage._stochastic_bfloat16).
inline Eigen::bfloat16 Stochastic(float x, uint32_t bits,
                                  const Eigen::bfloat16*) {
  uint32_t w = Bits(x);
  const uint32_t draw = bits >> 16;
  w += (w >> 31) == 0 ? 0xFFFFu - draw : draw;
  w &= 0xFFFF0000u;
  return Eigen::bfloat16(FromBits(w));  // exact
}

// float32 -> float16 with the draw `bits`: the neighbour above x with
// probability (x - lo) / (hi - lo) (row_storage._stochastic_float16).
// Where float16 is normal (2^-14 <= |x| <= 65504) its neighbours are x's
// float32 bits with the low 13 cleared: hi is taken when (bits >> 19) <
// those 13 bits (x > 0: a carry of their sum with 0x1FFF - (bits >> 19)),
// or when (bits >> 19) < 2^13 - them (x < 0: no carry adding bits >> 19),
// the same draw as u = (bits >> 8) * 2^-24 < p, in integer operations.
inline Eigen::half Stochastic(float x, uint32_t bits, const Eigen::half*) {
  const uint32_t w = Bits(x);
  const uint32_t magnitude = w & 0x7FFFFFFFu;
  if (magnitude >= 0x38800000u && magnitude <= 0x477FE000u) {
    const uint32_t draw = bits >> 19;
    const uint32_t add = (w >> 31) == 0 ? 0x1FFFu - draw : draw;
    return Eigen::half(FromBits((w + add) & 0xFFFFE000u));  // exact
  }
  const Eigen::half nearest(x);
  const float near = static_cast<float>(nearest);
  if (near == x) return nearest;
  const uint16_t half_magnitude =
      Eigen::numext::bit_cast<uint16_t>(nearest) & 0x7FFF;
  const bool outward = std::fabs(x) > std::fabs(near);
  const uint16_t other_magnitude =
      outward ? half_magnitude + 1 : half_magnitude - 1;
  const uint16_t sign = static_cast<uint16_t>((w >> 16) & 0x8000);
  const float other = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(
      static_cast<uint16_t>(other_magnitude | sign)));
  const float lo = std::min(near, other), hi = std::max(near, other);
  const float p = (x - lo) / (hi - lo);
  const float u = static_cast<float>(bits >> 8) * 0x1p-24f;
  return Eigen::half(u < p ? hi : lo);  // exact
}

inline float Stochastic(float x, uint32_t, const float*) { return x; }

// n float16 values -> float32 (exact), 8 at a time with F16C where the
// library's level has it.
inline void HalfToFloat(const Eigen::half* __restrict from,
                        float* __restrict to, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i));
    _mm256_storeu_ps(to + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) to[i] = static_cast<float>(from[i]);
}

// n float32 values that float16 holds exactly -> float16 (any rounding
// mode gives the same), 8 at a time with F16C.
inline void ExactFloatToHalf(const float* __restrict from,
                             Eigen::half* __restrict to, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(from + i),
                                      _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(to + i), h);
  }
#endif
  for (; i < n; ++i) to[i] = Eigen::half(from[i]);
}

}  // namespace row_types
}  // namespace tensorflow

#endif  // TPU_EMBEDDING_KERNELS_ROW_TYPES_H_
