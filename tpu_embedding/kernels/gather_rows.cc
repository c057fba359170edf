// TpeGatherRows: rows of a float32 [rows, dim] resource variable at int64
// ids, into a new [n, dim] tensor: what tf.gather(variable, ids) returns;
// of a bfloat16 or float16 variable (a table's RowStorage), the rows as
// float32 (exact): tf.cast(tf.gather(variable, ids), tf.float32).
// TpeGatherPieces: rows of the concatenation of float32 [rows_k, dim]
// tensors at int32 positions, read where they are: what
// tf.gather(tf.concat(pieces, 0), index) returns, without the concat.
// The ids are spread over the CPU worker threads and each thread asks for
// the rows a few ids ahead (software prefetch), so many random rows are in
// flight at once instead of one miss at a time.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

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

// Rows prefetched this many ids ahead.
constexpr int64_t kAhead = 8;

REGISTER_OP("TpeGatherRows")
    .Input("variable: resource")
    .Input("ids: int64")
    .Output("rows: float")
    .Attr("spread: bool = true")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &ids));
      auto* handle = c->input_handle_shapes_and_types(0);
      shape_inference::DimensionHandle dim = c->UnknownDim();
      if (handle != nullptr && !handle->empty() &&
          c->RankKnown((*handle)[0].shape) && c->Rank((*handle)[0].shape) == 2) {
        dim = c->Dim((*handle)[0].shape, 1);
      }
      c->set_output(0, c->Matrix(c->Dim(ids, 0), dim));
      return absl::OkStatus();
    });

// out[i] = *rows[i] for i in [0, n), rows of `dim` floats, over the CPU
// worker threads with software prefetch.
void CopyRows(OpKernelContext* ctx, bool spread,
              const std::vector<const float*>& rows, int64_t dim, float* out) {
  const int64_t n = rows.size();
  const int64_t row_bytes = dim * sizeof(float);
  auto work = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (i + kAhead < end) {
        const char* ahead = reinterpret_cast<const char*>(rows[i + kAhead]);
        for (int64_t b = 0; b < row_bytes; b += 64) {
          __builtin_prefetch(ahead + b, 0, 0);
        }
      }
      std::memcpy(out + i * dim, rows[i], row_bytes);
    }
  };
  ForRows(ctx, spread, n, std::max<int64_t>(1, 4 * dim), work);
}

// out[i] = float32(table[id[i]]) for 16-bit rows, as CopyRows.
template <typename T>
void ConvertRows(OpKernelContext* ctx, bool spread, const T* table,
                 const int64_t* id, int64_t n, int64_t dim, float* out) {
  const int64_t row_bytes = dim * sizeof(T);
  // As many bytes in flight as float32 rows (twice the rows ahead).
  constexpr int64_t kAheadIds = kAhead * sizeof(float) / sizeof(T);
  auto work = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (i + kAheadIds < end) {
        const char* ahead = reinterpret_cast<const char*>(table + id[i + kAheadIds] * dim);
        for (int64_t b = 0; b < row_bytes; b += 64) {
          __builtin_prefetch(ahead + b, 0, 0);
        }
      }
      const T* row = table + id[i] * dim;
      float* to = out + i * dim;
      if constexpr (std::is_same<T, bfloat16>::value) {
        // float32's upper half: a shift (vectorized).
        const uint16_t* __restrict bits = reinterpret_cast<const uint16_t*>(row);
        uint32_t* __restrict words = reinterpret_cast<uint32_t*>(to);
        for (int64_t d = 0; d < dim; ++d) words[d] = uint32_t{bits[d]} << 16;
      } else {
        row_types::HalfToFloat(row, to, dim);
      }
    }
  };
  ForRows(ctx, spread, n, std::max<int64_t>(1, 4 * dim), work);
}

class GatherRowsOp : public OpKernel {
 public:
  explicit GatherRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("spread", &spread_));
  }

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<Var> var;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &var));
    const Tensor& ids = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(ids.shape()),
                errors::InvalidArgument("ids must be a vector, got shape ",
                                        ids.shape().DebugString()));
    tf_shared_lock lock(*var->mu());
    const Tensor& params = *var->tensor();
    const DataType type = params.dtype();
    OP_REQUIRES(ctx, var->is_initialized && params.dims() == 2 &&
                         (type == DT_FLOAT || type == DT_BFLOAT16 ||
                          type == DT_HALF),
                errors::InvalidArgument(
                    "the variable must be an initialized float32, bfloat16 "
                    "or float16 [rows, dim] variable, got ",
                    DataTypeString(type), " ", params.shape().DebugString()));
    const int64_t num_rows = params.dim_size(0);
    const int64_t dim = params.dim_size(1);
    const int64_t n = ids.dim_size(0);
    const int64_t* id = ids.flat<int64_t>().data();
    for (int64_t i = 0; i < n; ++i) {
      OP_REQUIRES(ctx, id[i] >= 0 && id[i] < num_rows,
                  errors::InvalidArgument("ids[", i, "] = ", id[i],
                                          " is not in [0, ", num_rows, ")"));
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim}), &out));
    if (n == 0 || dim == 0) return;
    float* to = out->flat<float>().data();
    if (type == DT_BFLOAT16) {
      return ConvertRows(ctx, spread_, params.flat<bfloat16>().data(), id, n,
                         dim, to);
    }
    if (type == DT_HALF) {
      return ConvertRows(ctx, spread_, params.flat<Eigen::half>().data(), id,
                         n, dim, to);
    }
    const float* table = params.flat<float>().data();
    std::vector<const float*> rows(n);
    for (int64_t i = 0; i < n; ++i) rows[i] = table + id[i] * dim;
    CopyRows(ctx, spread_, rows, dim, out->flat<float>().data());
  }

 private:
  bool spread_;
};

REGISTER_KERNEL_BUILDER(Name("TpeGatherRows").Device(DEVICE_CPU), GatherRowsOp);

// Row i of the output is row index[i] of the pieces' concatenation.
REGISTER_OP("TpeGatherPieces")
    .Input("pieces: num_pieces * float")
    .Input("index: int32")
    .Output("rows: float")
    .Attr("num_pieces: int >= 1")
    .Attr("spread: bool = true")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle index, piece;
      int num_pieces = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("num_pieces", &num_pieces));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(num_pieces), 1, &index));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &piece));
      c->set_output(0, c->Matrix(c->Dim(index, 0), c->Dim(piece, 1)));
      return absl::OkStatus();
    });

class GatherPiecesOp : public OpKernel {
 public:
  explicit GatherPiecesOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_pieces", &num_pieces_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("spread", &spread_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& index = ctx->input(num_pieces_);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(index.shape()),
                errors::InvalidArgument("index must be a vector, got shape ",
                                        index.shape().DebugString()));
    int64_t dim = 0;
    std::vector<const float*> all_rows;
    OP_REQUIRES_OK(ctx, PieceRows(ctx, 0, num_pieces_, "pieces", &dim, &all_rows));
    const int64_t n = index.dim_size(0);
    const int32_t* at = index.flat<int32_t>().data();
    std::vector<const float*> rows;
    OP_REQUIRES_OK(ctx, PickRows(all_rows, at, n, "index", &rows));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim}), &out));
    if (n == 0 || dim == 0) return;
    CopyRows(ctx, spread_, rows, dim, out->flat<float>().data());
  }

 private:
  int num_pieces_;
  bool spread_;
};

REGISTER_KERNEL_BUILDER(Name("TpeGatherPieces").Device(DEVICE_CPU),
                        GatherPiecesOp);

}  // namespace
}  // namespace tensorflow
