// TpeFusedSparseApply: the backward segment sum and an optimizer's sparse
// update in one pass over a step's gradient rows.
//
// For each distinct row u (rows[u] into the variables), its gradient is the
// sum of the gradient rows i with index[i] == u, added in increasing i from
// zero (what tf.math.unsorted_segment_sum computes). Gradient row i is row
// i of the pieces' concatenation, or with `positions` row positions[i] of
// it (an id its output row's gradient), or with several positions tensors
// (an owner picking its rows out of every sender's gradients) the rows they
// pick, each out of its own group of pieces, groups in order; times
// scales[i] with `scales` (one float32 product, as multiplying the gathered
// rows by the scales; in as many parts as positions tensors); then, in
// this order and with the same float32 operations as tpu_embedding's
// TensorFlow path (optimizers/base.py):
//   g = min(max(g, clip_gradient_min), clip_gradient_max)
//   w = w - decay * w                       (decoupled weight decay)
//   sgd:      w = w - lr * g
//   adagrad:  a = a + g * g;  w = w - (lr * g) / sqrt(a)
//   w = min(max(w, clip_weight_min), clip_weight_max)
// The gradient rows are grouped by distinct row (a stable counting sort);
// each distinct row's gradient is summed in registers and applied at once,
// its table and slot rows read and written once, prefetched a few rows
// ahead; large updates are split over the CPU worker threads into
// contiguous ranges of distinct rows. Every input is checked before any
// variable is written.
//
// Variables stored in 16 bits (bfloat16 or float16: a table's RowStorage)
// are read as float32, updated with the same float32 operations, and
// written back rounded as tpu_embedding/row_storage.py rounds (to nearest,
// or stochastically with the draws of (seed, variable, step, first_row +
// row, column): row_types.h). A float16 result beyond +-65504 (or NaN)
// fails the op naming the table and changes nothing: the rows a float16
// update writes are copied first, and written back on failure.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "piece_rows.h"
#include "row_types.h"
#include "spread.h"

namespace tensorflow {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Gradient rows that make a shard of the update worth a thread, and a
// shard's cost for ParallelFor (large: one shard per thread).
constexpr int64_t kGradsPerShard = 16384;
constexpr int64_t kShardCost = int64_t{1} << 24;

inline void Prefetch(const float* row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < bytes; offset += 64) {
    __builtin_prefetch(p + offset, 1, 0);
  }
}

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

// Backs a large buffer with transparent huge pages (once per buffer): random
// rows then cost one TLB entry per 2 MiB instead of per 4 KiB. Only the
// physical backing changes; where the kernel refuses, nothing happens.
void AdviseHugePages(const void* data, size_t bytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  if (bytes < 4 * kHuge) return;
  static std::mutex mu;
  static std::unordered_set<const void*>* seen = new std::unordered_set<const void*>;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!seen->insert(data).second) return;
  }
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end <= begin) return;
  void* start = reinterpret_cast<void*>(begin);
  if (madvise(start, end - begin, MADV_HUGEPAGE) == 0) {
    madvise(start, end - begin, MADV_COLLAPSE);
  }
}

// x = min(max(x, low), high), as tf.maximum then tf.minimum.
inline void Clip(float* x, int64_t n, float low, float high) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::min(std::max(x[i], low), high);
}

// One distinct row's update from its summed gradient g (clipped in place).
// Every setting is a value and every row a restrict pointer: the loops
// vectorize without runtime alias checks.
struct RowUpdate {
  bool adagrad;
  float lr, decay;
  bool has_decay, clip_gradients;
  float clip_gmin, clip_gmax;
  bool clip_weights;
  float clip_wmin, clip_wmax;

  void Apply(float* __restrict w, float* __restrict a, float* __restrict g,
             int64_t dim) const {
    const float rate = lr, shrink = decay;
    if (clip_gradients) Clip(g, dim, clip_gmin, clip_gmax);
    if (has_decay) {
      for (int64_t d = 0; d < dim; ++d) w[d] = w[d] - shrink * w[d];
    }
    if (adagrad) {
      for (int64_t d = 0; d < dim; ++d) {
        a[d] = a[d] + g[d] * g[d];
        w[d] = w[d] - (rate * g[d]) / std::sqrt(a[d]);
      }
    } else {
      for (int64_t d = 0; d < dim; ++d) w[d] = w[d] - rate * g[d];
    }
    if (clip_weights) Clip(w, dim, clip_wmin, clip_wmax);
  }
};

// A step's gradient rows grouped by the distinct row they update.
struct Occurrences {
  const std::vector<const float*>* grad_rows;  // gradient row i
  const float* scales;                         // scales[i], or nullptr
  const int32_t* order;    // gradient rows by distinct row, each in order
  const int32_t* start;    // distinct row u's are order[start[u]:start[u+1]]
  const int64_t* row_ids;  // row_ids[u]: row in the table
};

// Distinct rows looked ahead to prefetch their table rows.
constexpr int64_t kAheadRows = 8;

// Updates the distinct rows [begin, end): each row's gradient is summed in
// registers from zero over its gradient rows in increasing i (what the
// segment sum adds, in its order), then applied to the table row, whose
// rows (and slot rows) are prefetched a few distinct rows ahead. Gradient
// rows are small (a step's activations' gradients) and stay in cache; the
// table rows are each read and written once. kDim > 0 fixes the row width
// at compile time (common widths: fully vectorized loops), 0 reads `dim`.
// Not inlined into Compute, so that its loops vectorize.
template <int kDim>
__attribute__((noinline)) void UpdateRows(const Occurrences& in,
                                          const RowUpdate& update,
                                          float* params, float* accum,
                                          int64_t given_dim, int64_t begin,
                                          int64_t end) {
  const int64_t dim = kDim > 0 ? kDim : given_dim;
  const int64_t row_bytes = dim * sizeof(float);
  std::vector<float> buffer(dim);
  float* __restrict sum = buffer.data();
  const std::vector<const float*>& grad_rows = *in.grad_rows;
  for (int64_t u = begin; u < end; ++u) {
    if (u + kAheadRows < end) {
      const int64_t ahead = in.row_ids[u + kAheadRows] * dim;
      Prefetch(params + ahead, row_bytes);
      if (accum != nullptr) Prefetch(accum + ahead, row_bytes);
    }
    std::fill(sum, sum + dim, 0.0f);
    for (int32_t k = in.start[u]; k < in.start[u + 1]; ++k) {
      const int32_t i = in.order[k];
      AddRow(grad_rows[i], in.scales == nullptr ? nullptr : in.scales + i,
             dim, sum);
    }
    // (Rows without gradients, not from a lookup's ids, add zeros, as the
    // segment sum gives them.)
    const int64_t offset = in.row_ids[u] * dim;
    update.Apply(params + offset, accum == nullptr ? nullptr : accum + offset,
                 sum, dim);
  }
}

// How 16-bit variables are written back (RowStorage).
struct Rounding {
  bool stochastic;
  int64_t seed, step, first_row;
};

// Stored row -> float32 buffer.
template <typename T>
__attribute__((always_inline)) inline void Load(const T* __restrict from,
                                                float* __restrict to,
                                                int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) to[d] = row_types::ToFloat(from[d]);
}

// bfloat16 is float32's upper half: a shift (vectorized).
template <>
__attribute__((always_inline)) inline void Load(
    const bfloat16* __restrict from, float* __restrict to, int64_t dim) {
  const uint16_t* __restrict bits = reinterpret_cast<const uint16_t*>(from);
  uint32_t* __restrict words = reinterpret_cast<uint32_t*>(to);
  for (int64_t d = 0; d < dim; ++d) words[d] = uint32_t{bits[d]} << 16;
}

// float32 buffer -> stored row `row` of variable `stream` (0: the
// parameters, 1: the accumulators), rounded, value by value.
template <typename T>
__attribute__((always_inline)) inline void StoreEach(
    const float* __restrict from, T* __restrict to, int64_t dim,
    const Rounding& rounding, int stream, int64_t row) {
  if (!rounding.stochastic) {
    for (int64_t d = 0; d < dim; ++d) to[d] = row_types::Nearest<T>(from[d]);
    return;
  }
  const uint32_t h = row_types::RowHash(rounding.seed, stream, rounding.step,
                                        rounding.first_row + row);
  for (int64_t d = 0; d < dim; ++d) {
    const uint32_t bits = row_types::Mix32(h ^ static_cast<uint32_t>(d));
    to[d] = row_types::Stochastic(from[d], bits, static_cast<const T*>(nullptr));
  }
}

// The same, specialized below for 16-bit rows (vectorized).
template <typename T>
__attribute__((always_inline)) inline void Store(
    const float* __restrict from, T* __restrict to, int64_t dim,
    const Rounding& rounding, int stream, int64_t row) {
  StoreEach(from, to, dim, rounding, stream, row);
}

template <>
__attribute__((always_inline)) inline void Load(
    const Eigen::half* __restrict from, float* __restrict to, int64_t dim) {
  row_types::HalfToFloat(from, to, dim);
}

// float16: to nearest by F16C's conversion (ties to even, as Eigen's);
// stochastically in integer operations where float16 is normal (2^-14 to
// 65504: its neighbours are the float32 with the low 13 bits cleared, the
// draw as row_types::Stochastic's), the rest one by one.
template <>
__attribute__((always_inline)) inline void Store(
    const float* __restrict from, Eigen::half* __restrict to, int64_t dim,
    const Rounding& rounding, int stream, int64_t row) {
  constexpr int64_t kMaxDim = 256;
  if (dim > kMaxDim) {  // (wide rows: value by value)
    return StoreEach(from, to, dim, rounding, stream, row);
  }
  if (!rounding.stochastic) return row_types::FloatToHalf(from, to, dim);
  const uint32_t h = row_types::RowHash(rounding.seed, stream, rounding.step,
                                        rounding.first_row + row);
  const uint32_t* __restrict words = reinterpret_cast<const uint32_t*>(from);
  uint32_t cleared[kMaxDim];
  uint32_t outside = 0;
  for (int64_t d = 0; d < dim; ++d) {
    const uint32_t bits = row_types::Mix32(h ^ static_cast<uint32_t>(d));
    cleared[d] = row_types::StochasticWord<13>(words[d], bits);
    outside += static_cast<uint32_t>(!row_types::HalfIsNormalAt(words[d]));
  }
  // (Exact: the cleared words are float16 values.)
  row_types::FloatToHalf(reinterpret_cast<const float*>(cleared), to, dim);
  if (outside == 0) return;
  for (int64_t d = 0; d < dim; ++d) {  // float16's subnormals, zeros
    if (!row_types::HalfIsNormalAt(words[d])) {
      to[d] = row_types::Stochastic(
          from[d], row_types::Mix32(h ^ static_cast<uint32_t>(d)),
          static_cast<const Eigen::half*>(nullptr));
    }
  }
}

// bfloat16 in integer operations only (vectorized): the draws as
// row_types::Stochastic takes them; to nearest as Eigen's conversion
// (ties to even; a NaN becomes Eigen's quiet NaN of its sign).
template <>
__attribute__((always_inline)) inline void Store(
    const float* __restrict from, bfloat16* __restrict to, int64_t dim,
    const Rounding& rounding, int stream, int64_t row) {
  const uint32_t* __restrict words = reinterpret_cast<const uint32_t*>(from);
  uint16_t* __restrict out = reinterpret_cast<uint16_t*>(to);
  if (!rounding.stochastic) {
    for (int64_t d = 0; d < dim; ++d) {
      const uint32_t w = words[d];
      const bool nan = (w & 0x7FFFFFFFu) > 0x7F800000u;
      const uint32_t rounded = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
      const uint32_t quiet = (w >> 31) != 0 ? 0xFFC0u : 0x7FC0u;
      out[d] = static_cast<uint16_t>(nan ? quiet : rounded);
    }
    return;
  }
  const uint32_t h = row_types::RowHash(rounding.seed, stream, rounding.step,
                                        rounding.first_row + row);
  for (int64_t d = 0; d < dim; ++d) {
    const uint32_t bits = row_types::Mix32(h ^ static_cast<uint32_t>(d));
    out[d] = static_cast<uint16_t>(row_types::StochasticWord<16>(words[d], bits) >> 16);
  }
}

// Whether any of x[0:n] lies beyond float16's range (or is NaN).
inline bool BeyondFloat16(const float* x, int64_t n) {
  bool beyond = false;
  for (int64_t i = 0; i < n; ++i) {
    beyond |= !(std::fabs(x[i]) <= row_types::kFloat16Max);
  }
  return beyond;
}

// UpdateRows for variables stored as P (parameters) and S (accumulators),
// at least one of them 16-bit: each distinct row is read into float32
// buffers, updated as UpdateRows does, and written back rounded. With
// `backup` (float16: a value beyond its range must change nothing) the
// stored rows are copied to backup[u] (parameters, then accumulators)
// before they are written, and `*beyond` is set where a float16 result
// lies beyond +-65504 (or is NaN): the caller then writes the copies back.
template <int kDim, typename P, typename S>
__attribute__((noinline)) void UpdateTypedRows(
    const Occurrences& in, const RowUpdate& update, P* params, S* accum,
    int64_t given_dim, int64_t begin, int64_t end, const Rounding& rounding,
    char* backup, std::atomic<bool>* beyond) {
  constexpr bool kHalfParams = std::is_same<P, Eigen::half>::value;
  constexpr bool kHalfAccum = std::is_same<S, Eigen::half>::value;
  const int64_t dim = kDim > 0 ? kDim : given_dim;
  const int64_t backup_bytes =
      dim * (sizeof(P) + (accum == nullptr ? 0 : sizeof(S)));
  std::vector<float> buffer(3 * dim);
  float* __restrict sum = buffer.data();
  float* __restrict w = sum + dim;
  float* __restrict a = w + dim;
  const std::vector<const float*>& grad_rows = *in.grad_rows;
  // As many bytes in flight as float32 rows: rows of 2-byte values
  // prefetched twice as many rows ahead (the update is bound by the
  // memory's latency, not its bandwidth).
  constexpr int64_t kAhead = kAheadRows * sizeof(float) / sizeof(P);
  bool outside = false;
  for (int64_t u = begin; u < end; ++u) {
    if (u + kAhead < end) {
      const int64_t ahead = in.row_ids[u + kAhead] * dim;
      Prefetch(reinterpret_cast<const float*>(params + ahead), dim * sizeof(P));
      if (accum != nullptr) {
        Prefetch(reinterpret_cast<const float*>(accum + ahead), dim * sizeof(S));
      }
    }
    std::fill(sum, sum + dim, 0.0f);
    for (int32_t k = in.start[u]; k < in.start[u + 1]; ++k) {
      const int32_t i = in.order[k];
      AddRow(grad_rows[i], in.scales == nullptr ? nullptr : in.scales + i,
             dim, sum);
    }
    const int64_t row = in.row_ids[u];
    const int64_t offset = row * dim;
    Load(params + offset, w, dim);
    if (accum != nullptr) Load(accum + offset, a, dim);
    update.Apply(w, accum == nullptr ? nullptr : a, sum, dim);
    if (backup != nullptr) {
      char* copy = backup + u * backup_bytes;
      std::memcpy(copy, params + offset, dim * sizeof(P));
      if (accum != nullptr) {
        std::memcpy(copy + dim * sizeof(P), accum + offset, dim * sizeof(S));
      }
      if (kHalfParams) outside |= BeyondFloat16(w, dim);
      if (kHalfAccum && accum != nullptr) outside |= BeyondFloat16(a, dim);
    }
    Store(w, params + offset, dim, rounding, 0, row);
    if (accum != nullptr) Store(a, accum + offset, dim, rounding, 1, row);
  }
  if (outside) beyond->store(true);
}

// Writes the rows UpdateTypedRows copied to `backup` back.
template <typename P, typename S>
void RestoreRows(const char* backup, const int64_t* row_ids, P* params,
                 S* accum, int64_t dim, int64_t num_unique) {
  const int64_t backup_bytes =
      dim * (sizeof(P) + (accum == nullptr ? 0 : sizeof(S)));
  for (int64_t u = 0; u < num_unique; ++u) {
    const char* copy = backup + u * backup_bytes;
    std::memcpy(params + row_ids[u] * dim, copy, dim * sizeof(P));
    if (accum != nullptr) {
      std::memcpy(accum + row_ids[u] * dim, copy + dim * sizeof(P),
                  dim * sizeof(S));
    }
  }
}

template <typename P, typename S>
void UpdateTypedRowsOfWidth(const Occurrences& in, const RowUpdate& update,
                            P* params, S* accum, int64_t dim, int64_t begin,
                            int64_t end, const Rounding& rounding,
                            char* backup, std::atomic<bool>* beyond) {
  switch (dim) {
    case 32:
      return UpdateTypedRows<32>(in, update, params, accum, dim, begin, end,
                                 rounding, backup, beyond);
    case 64:
      return UpdateTypedRows<64>(in, update, params, accum, dim, begin, end,
                                 rounding, backup, beyond);
    case 128:
      return UpdateTypedRows<128>(in, update, params, accum, dim, begin, end,
                                  rounding, backup, beyond);
    default:
      return UpdateTypedRows<0>(in, update, params, accum, dim, begin, end,
                                rounding, backup, beyond);
  }
}

// UpdateRows for this row width.
void UpdateRowsOfWidth(const Occurrences& in, const RowUpdate& update,
                       float* params, float* accum, int64_t dim,
                       int64_t begin, int64_t end) {
  switch (dim) {
    case 16:
      return UpdateRows<16>(in, update, params, accum, dim, begin, end);
    case 32:
      return UpdateRows<32>(in, update, params, accum, dim, begin, end);
    case 64:
      return UpdateRows<64>(in, update, params, accum, dim, begin, end);
    case 128:
      return UpdateRows<128>(in, update, params, accum, dim, begin, end);
    default:
      return UpdateRows<0>(in, update, params, accum, dim, begin, end);
  }
}

// A buffer of this thread's, kept across calls (a step's bookkeeping then
// allocates and faults in no memory), at least n long. Buffers over
// kKeptBytes are released at the end of the call (ReleaseIfLarge).
constexpr size_t kKeptBytes = size_t{16} << 20;

template <typename T>
T* Reuse(std::vector<T>* buffer, size_t n) {
  if (buffer->size() < n) buffer->resize(n);
  return buffer->data();
}

template <typename T>
void ReleaseIfLarge(std::vector<T>* buffer) {
  if (buffer->capacity() * sizeof(T) > kKeptBytes) {
    std::vector<T>().swap(*buffer);
  }
}

REGISTER_OP("TpeFusedSparseApply")
    .Input("variables: num_variables * resource")
    .Input("rows: int64")
    .Input("index: int32")
    .Input("grads: num_pieces * float")
    .Input("positions: num_positions * int32")
    .Input("scales: num_scales * float")
    .Input("lr: float")
    .Input("rounding_step: int64")
    .Attr("num_variables: int >= 1")
    .Attr("num_pieces: int >= 1")
    .Attr("num_positions: int >= 0 = 0")
    .Attr("num_scales: int >= 0 = 0")
    .Attr("rule: {'sgd', 'adagrad'}")
    .Attr("clip_gradient_min: float")
    .Attr("clip_gradient_max: float")
    .Attr("weight_decay: float")
    .Attr("decay_by_lr: bool")
    .Attr("clip_weight_min: float")
    .Attr("clip_weight_max: float")
    .Attr("spread: bool = true")
    .Attr("stochastic: bool = false")
    .Attr("seed: int = 0")
    .Attr("first_row: int = 0")
    .Attr("table: string = ''")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs);

class FusedSparseApplyOp : public OpKernel {
 public:
  explicit FusedSparseApplyOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string rule;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_variables", &num_variables_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_pieces", &num_pieces_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_positions", &num_positions_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_scales", &num_scales_));
    OP_REQUIRES(
        ctx, num_positions_ == 0 || num_pieces_ % num_positions_ == 0,
        errors::InvalidArgument("positions split ", num_pieces_,
                                " pieces into ", num_positions_,
                                " groups: not evenly"));
    OP_REQUIRES(ctx,
                num_scales_ == 0 || num_scales_ == std::max(1, num_positions_),
                errors::InvalidArgument("scales come in ", num_scales_,
                                        " parts for ", num_positions_,
                                        " positions tensors"));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rule", &rule));
    adagrad_ = rule == "adagrad";
    OP_REQUIRES(ctx, num_variables_ == (adagrad_ ? 2 : 1),
                errors::InvalidArgument("rule ", rule, " takes ",
                                        adagrad_ ? 2 : 1, " variables, got ",
                                        num_variables_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("clip_gradient_min", &clip_gmin_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("clip_gradient_max", &clip_gmax_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("weight_decay", &decay_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("decay_by_lr", &decay_by_lr_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("clip_weight_min", &clip_wmin_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("clip_weight_max", &clip_wmax_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("spread", &spread_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("stochastic", &stochastic_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("seed", &seed_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("first_row", &first_row_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table", &table_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& rows = ctx->input(num_variables_);
    const Tensor& index = ctx->input(num_variables_ + 1);
    const Tensor& lr_tensor =
        ctx->input(num_variables_ + 2 + num_pieces_ + num_positions_ +
                   num_scales_);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(rows.shape()),
                errors::InvalidArgument("rows must be a vector, got shape ",
                                        rows.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(index.shape()),
                errors::InvalidArgument("index must be a vector, got shape ",
                                        index.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(lr_tensor.shape()),
                errors::InvalidArgument("lr must be a scalar"));
    const Tensor& step_tensor = ctx->input(num_variables_ + 3 + num_pieces_ +
                                           num_positions_ + num_scales_);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(step_tensor.shape()),
                errors::InvalidArgument("rounding_step must be a scalar"));
    // The gradient rows: the concatenation of the pieces' rows, or with
    // positions, per group of pieces (one per positions tensor, e.g. one
    // per sending replica) the rows at its positions, groups in order.
    const int64_t num_grads = index.dim_size(0);
    const int first_piece = num_variables_ + 2;
    const int first_position = first_piece + num_pieces_;
    const int first_scale = first_position + num_positions_;
    int64_t dim = 0;
    std::vector<const float*> grad_rows;
    if (num_positions_ == 0) {
      OP_REQUIRES_OK(ctx, PieceRows(ctx, first_piece, num_pieces_, "grads",
                                    &dim, &grad_rows));
      OP_REQUIRES(ctx, static_cast<int64_t>(grad_rows.size()) == num_grads,
                  errors::InvalidArgument("grads have ", grad_rows.size(),
                                          " rows for ", num_grads,
                                          " index entries"));
    } else {
      const int per_group = num_pieces_ / num_positions_;
      grad_rows.reserve(num_grads);
      std::vector<const float*> group_rows, picked;
      for (int g = 0; g < num_positions_; ++g) {
        const Tensor& at = ctx->input(first_position + g);
        OP_REQUIRES(ctx, TensorShapeUtils::IsVector(at.shape()),
                    errors::InvalidArgument("positions must be vectors, got ",
                                            at.shape().DebugString()));
        int64_t group_dim = 0;
        OP_REQUIRES_OK(ctx, PieceRows(ctx, first_piece + g * per_group,
                                      per_group, "grads", &group_dim,
                                      &group_rows));
        OP_REQUIRES(ctx, g == 0 || group_dim == dim,
                    errors::InvalidArgument(
                        "every grads piece must be [rows, ", dim, "], group ",
                        g, " has width ", group_dim));
        dim = group_dim;
        if (num_scales_ > 1) {
          const Tensor& part = ctx->input(first_scale + g);
          OP_REQUIRES(ctx, part.NumElements() == at.NumElements(),
                      errors::InvalidArgument(
                          "scales[", g, "] has ", part.NumElements(),
                          " entries for ", at.NumElements(), " positions"));
        }
        OP_REQUIRES_OK(ctx, PickRows(group_rows, at.flat<int32_t>().data(),
                                     at.dim_size(0), "positions", &picked));
        grad_rows.insert(grad_rows.end(), picked.begin(), picked.end());
      }
      OP_REQUIRES(ctx, static_cast<int64_t>(grad_rows.size()) == num_grads,
                  errors::InvalidArgument(
                      "positions have ", grad_rows.size(), " entries for ",
                      num_grads, " index entries"));
    }
    // Each gradient row's scale (groups concatenated), or none.
    std::vector<float> scale_values;
    const float* scales = nullptr;
    if (num_scales_ > 0) {
      scale_values.reserve(num_grads);
      for (int g = 0; g < num_scales_; ++g) {
        const Tensor& given = ctx->input(first_scale + g);
        OP_REQUIRES(ctx, TensorShapeUtils::IsVector(given.shape()),
                    errors::InvalidArgument("scales must be vectors, got ",
                                            given.shape().DebugString()));
        const float* values = given.flat<float>().data();
        scale_values.insert(scale_values.end(), values,
                            values + given.dim_size(0));
      }
      OP_REQUIRES(ctx, static_cast<int64_t>(scale_values.size()) == num_grads,
                  errors::InvalidArgument(
                      "scales must have index's shape [", num_grads, "], got ",
                      scale_values.size(), " scales"));
      scales = scale_values.data();
    }

    std::vector<core::RefCountPtr<Var>> vars(num_variables_);
    for (int v = 0; v < num_variables_; ++v) {
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, v), &vars[v]));
    }
    // Lock in address order (as TensorFlow's training ops do).
    std::vector<Var*> order;
    for (auto& v : vars) order.push_back(v.get());
    std::sort(order.begin(), order.end());
    order.erase(std::unique(order.begin(), order.end()), order.end());
    std::vector<tsl::mutex_lock> locks;
    locks.reserve(order.size());
    for (Var* v : order) locks.emplace_back(*v->mu());

    const int64_t num_unique = rows.dim_size(0);
    int64_t num_rows = -1;
    for (int v = 0; v < num_variables_; ++v) {
      Tensor* t = vars[v]->tensor();
      const DataType type = t->dtype();
      OP_REQUIRES(ctx, vars[v]->is_initialized &&
                           (type == DT_FLOAT || type == DT_BFLOAT16 ||
                            type == DT_HALF) &&
                           t->dims() == 2 && t->dim_size(1) == dim,
                  errors::InvalidArgument(
                      "variable ", v, " must be an initialized float32, "
                      "bfloat16 or float16 [rows, ", dim, "] variable, got ",
                      DataTypeString(type), " ", t->shape().DebugString()));
      if (v == 0) num_rows = t->dim_size(0);
      OP_REQUIRES(ctx, t->dim_size(0) == num_rows,
                  errors::InvalidArgument("variables differ in rows: ",
                                          t->dim_size(0), " vs ", num_rows));
    }
    auto row_ids = rows.flat<int64_t>();
    for (int64_t u = 0; u < num_unique; ++u) {
      OP_REQUIRES(ctx, row_ids(u) >= 0 && row_ids(u) < num_rows,
                  errors::InvalidArgument("rows[", u, "] = ", row_ids(u),
                                          " is not in [0, ", num_rows, ")"));
    }
    OP_REQUIRES(ctx, num_grads <= std::numeric_limits<int32_t>::max(),
                errors::InvalidArgument("too many gradient rows: ", num_grads));
    const int32_t* positions = index.flat<int32_t>().data();
    // The gradient rows of each distinct row, in increasing i: a stable
    // counting sort by distinct row.
    thread_local std::vector<int32_t> start_buffer, grouped_buffer;
    int32_t* start = Reuse(&start_buffer, num_unique + 1);
    int32_t* grouped = Reuse(&grouped_buffer, std::max<int64_t>(num_grads, 1));
    std::fill(start, start + num_unique + 1, 0);
    for (int64_t i = 0; i < num_grads; ++i) {
      const int32_t u = positions[i];
      OP_REQUIRES(ctx, u >= 0 && u < num_unique,
                  errors::InvalidArgument("index[", i, "] = ", u,
                                          " is not in [0, ", num_unique, ")"));
      ++start[u + 1];
    }
    for (int64_t u = 0; u < num_unique; ++u) start[u + 1] += start[u];
    for (int64_t i = 0; i < num_grads; ++i) {
      grouped[start[positions[i]]++] = static_cast<int32_t>(i);
    }
    // (Each start[u] now holds start[u + 1]'s value: shift back.)
    for (int64_t u = num_unique; u > 0; --u) start[u] = start[u - 1];
    start[0] = 0;
    if (num_unique == 0) return;
    // Copy-on-write, as TensorFlow's sparse updates: never write a buffer
    // that a dense read still holds.
    for (Var* v : order) {
      if (v->copy_on_read_mode.load()) continue;
      if (!v->tensor()->RefCountIsOne()) {
        Tensor copy;
        OP_REQUIRES_OK(ctx, ctx->allocate_temp(v->tensor()->dtype(),
                                               v->tensor()->shape(), &copy));
        std::memcpy(copy.data(), v->tensor()->data(), v->tensor()->TotalBytes());
        *v->tensor() = copy;
      }
      v->copy_on_read_mode.store(true);
    }

    for (Var* v : order) {
      AdviseHugePages(v->tensor()->data(), v->tensor()->TotalBytes());
    }
    const DataType param_type = vars[0]->tensor()->dtype();
    const DataType accum_type =
        adagrad_ ? vars[1]->tensor()->dtype() : DT_FLOAT;
    void* params = vars[0]->tensor()->data();
    void* accum = adagrad_ ? vars[1]->tensor()->data() : nullptr;
    const float lr = lr_tensor.scalar<float>()();
    const float decay = decay_by_lr_ ? decay_ * lr : decay_;
    const bool has_decay = decay_ != 0.0f;

    const bool clip_gradients = clip_gmin_ > -kInf || clip_gmax_ < kInf;
    const bool clip_weights = clip_wmin_ > -kInf || clip_wmax_ < kInf;
    const RowUpdate update{adagrad_,       lr,         decay,
                           has_decay,      clip_gradients, clip_gmin_,
                           clip_gmax_,     clip_weights,   clip_wmin_,
                           clip_wmax_};
    // Distinct rows are split into contiguous shards of about equal work
    // (a row and its gradient rows), one per CPU worker thread.
    const int64_t shards =
        spread_ ? std::max<int64_t>(
                      1, std::min<int64_t>(
                             ctx->device()->tensorflow_cpu_worker_threads()->num_threads,
                             (num_grads + num_unique) / kGradsPerShard))
                : 1;
    const Occurrences occurrences{&grad_rows, scales, grouped, start,
                                  row_ids.data()};
    auto first_row_of = [&](int64_t shard) -> int64_t {
      // The first u with u + start[u] >= shard's share of the work.
      const int64_t work = (num_grads + num_unique) * shard / shards;
      int64_t low = 0, high = num_unique;
      while (low < high) {
        const int64_t mid = (low + high) / 2;
        if (mid + start[mid] < work) low = mid + 1; else high = mid;
      }
      return low;
    };
    auto for_shards = [&](auto&& update_range) {
      ForRows(ctx, spread_ && shards > 1, shards, kShardCost,
              [&](int64_t begin, int64_t end) {
                for (int64_t shard = begin; shard < end; ++shard) {
                  update_range(first_row_of(shard), first_row_of(shard + 1));
                }
              });
    };
    if (param_type == DT_FLOAT && accum_type == DT_FLOAT) {
      float* p = static_cast<float*>(params);
      float* a = static_cast<float*>(accum);
      for_shards([&](int64_t begin, int64_t end) {
        UpdateRowsOfWidth(occurrences, update, p, a, dim, begin, end);
      });
    } else {
      const Rounding rounding{stochastic_, seed_,
                              step_tensor.scalar<int64_t>()(), first_row_};
      OP_REQUIRES_OK(ctx, UpdateTyped(ctx, param_type, accum_type, params,
                                      accum, occurrences, update, dim,
                                      num_unique, rounding, for_shards));
    }
    ReleaseIfLarge(&start_buffer);
    ReleaseIfLarge(&grouped_buffer);
  }

  // The update of 16-bit variables (P, S the stored types). Where one is
  // float16, the rows are copied before they are written, and written
  // back if a result lies beyond float16's range: the op fails and
  // changes nothing (under the variables' locks: no one sees between).
  template <typename P, typename S, typename Shards>
  Status UpdateTypedAs(P* params, S* accum, const Occurrences& occurrences,
                       const RowUpdate& update, int64_t dim,
                       int64_t num_unique, const Rounding& rounding,
                       Shards& for_shards) {
    constexpr bool kHalf = std::is_same<P, Eigen::half>::value ||
                           std::is_same<S, Eigen::half>::value;
    if (!kHalf) {
      for_shards([&](int64_t begin, int64_t end) {
        UpdateTypedRowsOfWidth(occurrences, update, params, accum, dim, begin,
                               end, rounding, nullptr, nullptr);
      });
      return absl::OkStatus();
    }
    const int64_t backup_bytes =
        dim * (sizeof(P) + (accum == nullptr ? 0 : sizeof(S)));
    thread_local std::vector<char> backup_buffer;
    char* backup =
        Reuse(&backup_buffer, std::max<int64_t>(1, num_unique * backup_bytes));
    std::atomic<bool> beyond(false);
    for_shards([&](int64_t begin, int64_t end) {
      UpdateTypedRowsOfWidth(occurrences, update, params, accum, dim, begin,
                             end, rounding, backup, &beyond);
    });
    if (beyond.load()) {
      RestoreRows(backup, occurrences.row_ids, params, accum, dim, num_unique);
    }
    ReleaseIfLarge(&backup_buffer);
    if (beyond.load()) {
      return errors::InvalidArgument(
          "Table '", table_, "': a float16 parameters or slot value exceeds "
          "65504, the largest float16 (or is NaN); store it as bfloat16 or "
          "float32 (RowStorage).");
    }
    return absl::OkStatus();
  }

  template <typename Shards>
  Status UpdateTyped(OpKernelContext* ctx, DataType param_type,
                     DataType accum_type, void* params, void* accum,
                     const Occurrences& occurrences, const RowUpdate& update,
                     int64_t dim, int64_t num_unique, const Rounding& rounding,
                     Shards& for_shards) {
    auto with_accum = [&](auto* p) -> Status {
      if (accum == nullptr) {
        return UpdateTypedAs(p, static_cast<float*>(nullptr), occurrences,
                             update, dim, num_unique, rounding, for_shards);
      }
      switch (accum_type) {
        case DT_BFLOAT16:
          return UpdateTypedAs(p, static_cast<bfloat16*>(accum), occurrences,
                               update, dim, num_unique, rounding, for_shards);
        case DT_HALF:
          return UpdateTypedAs(p, static_cast<Eigen::half*>(accum),
                               occurrences, update, dim, num_unique, rounding,
                               for_shards);
        default:
          return UpdateTypedAs(p, static_cast<float*>(accum), occurrences,
                               update, dim, num_unique, rounding, for_shards);
      }
    };
    switch (param_type) {
      case DT_BFLOAT16:
        return with_accum(static_cast<bfloat16*>(params));
      case DT_HALF:
        return with_accum(static_cast<Eigen::half*>(params));
      default:
        return with_accum(static_cast<float*>(params));
    }
  }

 private:
  int num_variables_;
  int num_pieces_;
  int num_positions_;
  int num_scales_;
  bool adagrad_;
  float clip_gmin_, clip_gmax_, decay_, clip_wmin_, clip_wmax_;
  bool decay_by_lr_;
  bool spread_;
  bool stochastic_;
  int64_t seed_, first_row_;
  std::string table_;
};

REGISTER_KERNEL_BUILDER(Name("TpeFusedSparseApply").Device(DEVICE_CPU),
                        FusedSparseApplyOp);

}  // namespace
}  // namespace tensorflow
