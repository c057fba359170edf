// Rows of float32 [rows_k, dim] kernel inputs: read as their
// concatenation, in place (gradient pieces in fused_update.cc and the
// owners' replies in gather_rows.cc are never concatenated), and summed,
// scaled or not (AddRow).
#ifndef TPU_EMBEDDING_KERNELS_PIECE_ROWS_H_
#define TPU_EMBEDDING_KERNELS_PIECE_ROWS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"

namespace tensorflow {

// Points `rows` at each row of inputs [first, first + count), in order, and
// sets `dim`; fails (naming `what`) unless every input is [rows_k, dim].
inline Status PieceRows(OpKernelContext* ctx, int first, int count,
                        const std::string& what, int64_t* dim,
                        std::vector<const float*>* rows) {
  const Tensor& head = ctx->input(first);
  if (head.dims() != 2) {
    return errors::InvalidArgument(what, " must be [rows, dim], got ",
                                   head.shape().DebugString());
  }
  *dim = head.dim_size(1);
  rows->clear();
  int64_t total = 0;
  for (int p = 0; p < count; ++p) {
    const Tensor& piece = ctx->input(first + p);
    if (piece.dims() != 2 || piece.dim_size(1) != *dim) {
      return errors::InvalidArgument("every ", what, " piece must be [rows, ",
                                     *dim, "], got ",
                                     piece.shape().DebugString());
    }
    total += piece.dim_size(0);
  }
  rows->reserve(total);
  for (int p = 0; p < count; ++p) {
    const Tensor& piece = ctx->input(first + p);
    const float* data = piece.flat<float>().data();
    for (int64_t r = 0; r < piece.dim_size(0); ++r) {
      rows->push_back(data + r * *dim);
    }
  }
  return OkStatus();
}

// Sets picked[i] = rows[at[i]] for i in [0, n); fails (naming `what`)
// unless every position is in [0, rows.size()).
inline Status PickRows(const std::vector<const float*>& rows, const int32_t* at,
                       int64_t n, const std::string& what,
                       std::vector<const float*>* picked) {
  const int64_t total = rows.size();
  picked->resize(n);
  for (int64_t i = 0; i < n; ++i) {
    if (at[i] < 0 || at[i] >= total) {
      return errors::InvalidArgument(what, "[", i, "] = ", at[i],
                                     " is not in [0, ", total, ")");
    }
    (*picked)[i] = rows[at[i]];
  }
  return OkStatus();
}

// sum += row, or sum += row * *scale (one float32 product per element, as
// multiplying the rows by their scales first): the summing of ids' rows in
// the combiner (segment_sum.cc) and of gradients in the update.
inline void AddRow(const float* __restrict row, const float* scale,
                   int64_t dim, float* __restrict sum) {
  if (scale != nullptr) {
    const float factor = *scale;
    for (int64_t d = 0; d < dim; ++d) sum[d] += row[d] * factor;
  } else {
    for (int64_t d = 0; d < dim; ++d) sum[d] += row[d];
  }
}

}  // namespace tensorflow

#endif  // TPU_EMBEDDING_KERNELS_PIECE_ROWS_H_
