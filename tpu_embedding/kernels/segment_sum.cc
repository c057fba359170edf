// TpeSegmentSum: the combiner's sum of id rows into output rows, what
//   tf.math.unsorted_segment_sum(rows * scales[:, None], segments, num)
// returns (rows alone without scales), for rows the concatenation of the
// pieces, or with `positions` the rows at those positions in it (each id's
// row read where its distinct row is: the [n, dim] rows of the id
// occurrences are never written). Output row s is the sum, from zero and in
// increasing i, of rows[i] * scales[i] over the i with segments[i] == s
// (each product rounded to float32, then added, as TensorFlow's ops compute
// it). Output rows are spread over the CPU worker threads (a counting sort
// groups each row's ids, in order), where TensorFlow's op runs on one
// thread.
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

// Ids looked ahead to prefetch their rows.
constexpr int64_t kAhead = 8;

REGISTER_OP("TpeSegmentSum")
    .Input("rows: num_pieces * float")
    .Input("positions: num_positions * int32")
    .Input("segments: int64")
    .Input("scales: num_scales * float")
    .Input("num_segments: int64")
    .Output("sums: float")
    .Attr("num_pieces: int >= 1")
    .Attr("num_positions: int >= 0 = 0")
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
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_pieces", &num_pieces_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_positions", &num_positions_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_scales", &num_scales_));
    OP_REQUIRES(ctx, num_positions_ <= 1,
                errors::InvalidArgument("at most one positions tensor"));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("spread", &spread_));
    OP_REQUIRES(ctx, num_scales_ <= 1,
                errors::InvalidArgument("at most one scales tensor"));
  }

  void Compute(OpKernelContext* ctx) override {
    const int first_segment = num_pieces_ + num_positions_;
    const Tensor& segments = ctx->input(first_segment);
    const Tensor& num_tensor = ctx->input(first_segment + 1 + num_scales_);
    int64_t dim = 0;
    std::vector<const float*> rows;
    OP_REQUIRES_OK(ctx, PieceRows(ctx, 0, num_pieces_, "rows", &dim, &rows));
    if (num_positions_ == 1) {
      const Tensor& at = ctx->input(num_pieces_);
      OP_REQUIRES(ctx, TensorShapeUtils::IsVector(at.shape()),
                  errors::InvalidArgument("positions must be a vector, got ",
                                          at.shape().DebugString()));
      std::vector<const float*> picked;
      OP_REQUIRES_OK(ctx, PickRows(rows, at.flat<int32_t>().data(),
                                   at.dim_size(0), "positions", &picked));
      rows.swap(picked);
    }
    const int64_t n = rows.size();
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(segments.shape()) &&
                         segments.dim_size(0) == n,
                errors::InvalidArgument("segments must be [", n, "], got ",
                                        segments.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(num_tensor.shape()),
                errors::InvalidArgument("num_segments must be a scalar"));
    const float* scales = nullptr;
    if (num_scales_ == 1) {
      const Tensor& s = ctx->input(first_segment + 1);
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
    float* sums = out->flat<float>().data();
    const int64_t row_bytes = dim * sizeof(float);
    auto work = [&](int64_t begin, int64_t end) {
      const int64_t stop = start[end];
      for (int64_t s = begin; s < end; ++s) {
        float* o = sums + s * dim;
        std::fill(o, o + dim, 0.0f);
        for (int64_t k = start[s]; k < start[s + 1]; ++k) {
          if (k + kAhead < stop) {  // A later id's row (not in order).
            const char* ahead = reinterpret_cast<const char*>(rows[order[k + kAhead]]);
            for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead + b, 0, 3);
          }
          const int64_t i = order[k];
          AddRow(rows[i], scales == nullptr ? nullptr : scales + i, dim, o);
        }
      }
    };
    const int64_t per_row = std::max<int64_t>(1, n / num);
    ForRows(ctx, spread_, num, std::max<int64_t>(1, 2 * dim * per_row), work);
  }

 private:
  int num_pieces_;
  int num_positions_;
  int num_scales_;
  bool spread_;
};

REGISTER_KERNEL_BUILDER(Name("TpeSegmentSum").Device(DEVICE_CPU), SegmentSumOp);

}  // namespace
}  // namespace tensorflow
