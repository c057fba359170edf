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

// The float32 word w rounded stochastically onto the grid of words whose
// low kDropped bits are clear (bfloat16: 16; normal float16: 13), with
// the draw `bits`: hi (the neighbour above x) when the draw's top kDropped
// bits are below the dropped bits (x > 0: a carry of their sum with the
// complement of the draw), or below 2^kDropped minus them (x < 0: no
// carry adding the draw); the draw u = (bits >> 8) * 2^-24 < p of
// row_storage.py, in integer operations.
template <int kDropped>
inline uint32_t StochasticWord(uint32_t w, uint32_t bits) {
  constexpr uint32_t kLowBits = (uint32_t{1} << kDropped) - 1;
  const uint32_t draw = bits >> (32 - kDropped);
  const uint32_t add = (w >> 31) == 0 ? kLowBits - draw : draw;
  return (w + add) & ~kLowBits;
}

// Whether float16 is normal at the float32 word w's magnitude (2^-14 to
// 65504): its neighbours there are w with the low 13 bits clear.
inline bool HalfIsNormalAt(uint32_t w) {
  constexpr uint32_t kLow = 0x38800000u, kSpan = 0x477FE000u - kLow;
  return (w & 0x7FFFFFFFu) - kLow <= kSpan;
}

// float32 -> bfloat16 with the draw `bits` (row_storage._stochastic_bfloat16).
inline Eigen::bfloat16 Stochastic(float x, uint32_t bits,
                                  const Eigen::bfloat16*) {
  return Eigen::bfloat16(FromBits(StochasticWord<16>(Bits(x), bits)));  // exact
}

// float32 -> float16 with the draw `bits`: the neighbour above x with
// probability (x - lo) / (hi - lo) (row_storage._stochastic_float16);
// where float16 is normal, StochasticWord<13>.
inline Eigen::half Stochastic(float x, uint32_t bits, const Eigen::half*) {
  const uint32_t w = Bits(x);
  if (HalfIsNormalAt(w)) {
    return Eigen::half(FromBits(StochasticWord<13>(w, bits)));  // exact
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

// n float32 values -> float16, to nearest (ties to even, as Eigen's
// conversion), 8 at a time with F16C.
inline void FloatToHalf(const float* __restrict from,
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
