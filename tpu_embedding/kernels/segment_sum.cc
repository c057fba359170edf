// TpeSegmentSum: the combiner's sum of id rows into output rows, what
//   tf.math.unsorted_segment_sum(rows * scales[:, None], segments, num)
// returns (rows alone without scales): output row s is the sum, from zero
// and in increasing i, of rows[i] * scales[i] over the i with
// segments[i] == s (each product rounded to float32, then added, as
// TensorFlow's two ops compute it). Output rows are spread over the CPU
// worker threads (a counting sort groups each row's ids, in order), where
// TensorFlow's op runs on one thread.
#include <algorithm>
#include <cstring>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "piece_rows.h"
#include "spread.h"

namespace tensorflow {
namespace {

REGISTER_OP("TpeSegmentSum")
    .Input("rows: float")
    .Input("segments: int64")
    .Input("scales: num_scales * float")
    .Input("num_segments: int64")
    .Output("sums: float")
    .Attr("num_scales: int >= 0")
    .Attr("spread: bool = true")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle rows;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &rows));
      shape_inference::DimensionHandle num;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(c->num_inputs() - 1, &num));
      c->set_output(0, c->Matrix(num, c->Dim(rows, 1)));
      return OkStatus();
    });

class SegmentSumOp : public OpKernel {
 public:
  explicit SegmentSumOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_scales", &num_scales_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("spread", &spread_));
    OP_REQUIRES(ctx, num_scales_ <= 1,
                errors::InvalidArgument("at most one scales tensor"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& rows = ctx->input(0);
    const Tensor& segments = ctx->input(1);
    const Tensor& num_tensor = ctx->input(2 + num_scales_);
    OP_REQUIRES(ctx, rows.dims() == 2,
                errors::InvalidArgument("rows must be [n, dim], got ",
                                        rows.shape().DebugString()));
    const int64_t n = rows.dim_size(0);
    const int64_t dim = rows.dim_size(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(segments.shape()) &&
                         segments.dim_size(0) == n,
                errors::InvalidArgument("segments must be [", n, "], got ",
                                        segments.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(num_tensor.shape()),
                errors::InvalidArgument("num_segments must be a scalar"));
    const float* scales = nullptr;
    if (num_scales_ == 1) {
      const Tensor& s = ctx->input(2);
      OP_REQUIRES(ctx, TensorShapeUtils::IsVector(s.shape()) && s.dim_size(0) == n,
                  errors::InvalidArgument("scales must be [", n, "], got ",
                                          s.shape().DebugString()));
      scales = s.flat<float>().data();
    }
    const int64_t num = num_tensor.scalar<int64_t>()();
    OP_REQUIRES(ctx, num >= 0,
                errors::InvalidArgument("num_segments = ", num, " < 0"));
    const int64_t* seg = segments.flat<int64_t>().data();
    // The ids of each output row, in increasing i (a counting sort).
    std::vector<int64_t> start(num + 1, 0);
    for (int64_t i = 0; i < n; ++i) {
      OP_REQUIRES(ctx, seg[i] >= 0 && seg[i] < num,
                  errors::InvalidArgument("segments[", i, "] = ", seg[i],
                                          " is not in [0, ", num, ")"));
      ++start[seg[i] + 1];
    }
    for (int64_t s = 0; s < num; ++s) start[s + 1] += start[s];
    std::vector<int64_t> order(n);
    {
      std::vector<int64_t> next(start.begin(), start.end() - 1);
      for (int64_t i = 0; i < n; ++i) order[next[seg[i]]++] = i;
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({num, dim}), &out));
    if (num == 0 || dim == 0) return;
    const float* src = rows.flat<float>().data();
    float* sums = out->flat<float>().data();
    auto work = [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) {
        float* o = sums + s * dim;
        std::fill(o, o + dim, 0.0f);
        for (int64_t k = start[s]; k < start[s + 1]; ++k) {
          const int64_t i = order[k];
          AddRow(src + i * dim, scales == nullptr ? nullptr : scales + i, dim, o);
        }
      }
    };
    const int64_t per_row = std::max<int64_t>(1, n / num);
    ForRows(ctx, spread_, num, std::max<int64_t>(1, 2 * dim * per_row), work);
  }

 private:
  int num_scales_;
  bool spread_;
};

REGISTER_KERNEL_BUILDER(Name("TpeSegmentSum").Device(DEVICE_CPU), SegmentSumOp);

}  // namespace
}  // namespace tensorflow
