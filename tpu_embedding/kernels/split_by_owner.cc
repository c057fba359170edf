// TpeSplitByOwner: splits a replica's ids (and rows that go with them) by
// the replica owning each id's row, in one pass.
//
// A row-sharded table is cut into contiguous blocks, one per replica, in
// replica order: replica r owns ids in [starts[r], starts[r + 1]). For
// every owner r (0 <= r < num_parts) the outputs hold, in input order,
//   ids_out[r]       the ids owned by r,
//   positions[r]     their positions in ``ids`` (when with_positions),
//   values_out[k*num_parts + r]  the rows of values[k] at those positions,
// exactly what tf.dynamic_partition gives with the owners as partitions
// (the TensorFlow path in exchanges.py).
#include <cstring>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace {

REGISTER_OP("TpeSplitByOwner")
    .Input("ids: int64")
    .Input("values: num_values * float")
    .Output("ids_out: num_parts * int64")
    .Output("positions: num_positions * int32")
    .Output("values_out: num_value_parts * float")
    .Attr("block_starts: list(int)")
    .Attr("num_parts: int >= 1")
    .Attr("num_positions: int >= 0")
    .Attr("num_values: int >= 0")
    .Attr("num_value_parts: int >= 0")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int num_parts, num_positions, num_values;
      TF_RETURN_IF_ERROR(c->GetAttr("num_parts", &num_parts));
      TF_RETURN_IF_ERROR(c->GetAttr("num_positions", &num_positions));
      TF_RETURN_IF_ERROR(c->GetAttr("num_values", &num_values));
      int out = 0;
      for (int r = 0; r < num_parts; ++r) c->set_output(out++, c->Vector(c->UnknownDim()));
      for (int r = 0; r < num_positions; ++r) c->set_output(out++, c->Vector(c->UnknownDim()));
      for (int k = 0; k < num_values; ++k) {
        shape_inference::ShapeHandle rows;
        TF_RETURN_IF_ERROR(c->WithRank(c->input(1 + k), 2, &rows));
        for (int r = 0; r < num_parts; ++r) {
          c->set_output(out++, c->Matrix(c->UnknownDim(), c->Dim(rows, 1)));
        }
      }
      return OkStatus();
    });

class SplitByOwnerOp : public OpKernel {
 public:
  explicit SplitByOwnerOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("block_starts", &starts_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_parts", &num_parts_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_positions", &num_positions_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_values", &num_values_));
    int num_value_parts;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_value_parts", &num_value_parts));
    OP_REQUIRES(ctx, static_cast<int>(starts_.size()) == num_parts_,
                errors::InvalidArgument("block_starts has ", starts_.size(),
                                        " entries for ", num_parts_, " parts"));
    OP_REQUIRES(ctx, num_positions_ == 0 || num_positions_ == num_parts_,
                errors::InvalidArgument("num_positions must be 0 or num_parts"));
    OP_REQUIRES(ctx, num_value_parts == num_values_ * num_parts_,
                errors::InvalidArgument("num_value_parts must be num_values * num_parts"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids_tensor = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(ids_tensor.shape()),
                errors::InvalidArgument("ids must be a vector, got shape ",
                                        ids_tensor.shape().DebugString()));
    const int64_t n = ids_tensor.dim_size(0);
    const int64_t* ids = ids_tensor.flat<int64_t>().data();
    for (int k = 0; k < num_values_; ++k) {
      const Tensor& v = ctx->input(1 + k);
      OP_REQUIRES(ctx, v.dims() == 2 && v.dim_size(0) == n,
                  errors::InvalidArgument("values[", k, "] must be [", n,
                                          ", dim], got ", v.shape().DebugString()));
    }
    // The owner of each id: the last block starting at or before it (an
    // empty block starts where the next one does and is never chosen).
    std::vector<int32_t> owner(n);
    std::vector<int64_t> counts(num_parts_, 0);
    for (int64_t i = 0; i < n; ++i) {
      int32_t r = 0;
      while (r + 1 < num_parts_ && starts_[r + 1] <= ids[i]) ++r;
      owner[i] = r;
      ++counts[r];
    }
    int out = 0;
    std::vector<int64_t*> id_parts(num_parts_);
    for (int r = 0; r < num_parts_; ++r) {
      Tensor* t;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(out++, TensorShape({counts[r]}), &t));
      id_parts[r] = t->flat<int64_t>().data();
    }
    std::vector<int32_t*> position_parts(num_positions_);
    for (int r = 0; r < num_positions_; ++r) {
      Tensor* t;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(out++, TensorShape({counts[r]}), &t));
      position_parts[r] = t->flat<int32_t>().data();
    }
    std::vector<int64_t> next(num_parts_);
    for (int64_t i = 0; i < n; ++i) {
      const int32_t r = owner[i];
      const int64_t at = next[r]++;
      id_parts[r][at] = ids[i];
      if (num_positions_ > 0) position_parts[r][at] = static_cast<int32_t>(i);
    }
    for (int k = 0; k < num_values_; ++k) {
      const Tensor& v = ctx->input(1 + k);
      const int64_t dim = v.dim_size(1);
      const float* src = v.flat<float>().data();
      std::vector<float*> parts(num_parts_);
      for (int r = 0; r < num_parts_; ++r) {
        Tensor* t;
        OP_REQUIRES_OK(ctx, ctx->allocate_output(out++, TensorShape({counts[r], dim}), &t));
        parts[r] = t->flat<float>().data();
      }
      std::fill(next.begin(), next.end(), 0);
      const size_t row_bytes = dim * sizeof(float);
      for (int64_t i = 0; i < n; ++i) {
        const int32_t r = owner[i];
        std::memcpy(parts[r] + (next[r]++) * dim, src + i * dim, row_bytes);
      }
    }
  }

 private:
  std::vector<int64_t> starts_;
  int num_parts_, num_positions_, num_values_;
};

REGISTER_KERNEL_BUILDER(Name("TpeSplitByOwner").Device(DEVICE_CPU), SplitByOwnerOp);

}  // namespace
}  // namespace tensorflow
