// TpeGatherRows: rows of a float32 [rows, dim] resource variable at int64
// ids, into a new [n, dim] tensor: what tf.gather(variable, ids) returns.
// The ids are spread over the CPU worker threads and each thread asks for
// the rows a few ids ahead (software prefetch), so many random rows are in
// flight at once instead of one miss at a time.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace {

// Rows prefetched this many ids ahead.
constexpr int64_t kAhead = 8;

REGISTER_OP("TpeGatherRows")
    .Input("variable: resource")
    .Input("ids: int64")
    .Output("rows: float")
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

class GatherRowsOp : public OpKernel {
 public:
  explicit GatherRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<Var> var;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &var));
    const Tensor& ids = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(ids.shape()),
                errors::InvalidArgument("ids must be a vector, got shape ",
                                        ids.shape().DebugString()));
    tf_shared_lock lock(*var->mu());
    const Tensor& params = *var->tensor();
    OP_REQUIRES(ctx, var->is_initialized && params.dtype() == DT_FLOAT &&
                         params.dims() == 2,
                errors::InvalidArgument(
                    "the variable must be an initialized float32 [rows, dim] "
                    "variable, got ", params.shape().DebugString()));
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
    const float* table = params.flat<float>().data();
    float* rows = out->flat<float>().data();
    const int64_t row_bytes = dim * sizeof(float);
    auto work = [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        if (i + kAhead < end) {
          const char* ahead =
              reinterpret_cast<const char*>(table + id[i + kAhead] * dim);
          for (int64_t b = 0; b < row_bytes; b += 64) {
            __builtin_prefetch(ahead + b, 0, 0);
          }
        }
        std::memcpy(rows + i * dim, table + id[i] * dim, row_bytes);
      }
    };
    auto* threads = ctx->device()->tensorflow_cpu_worker_threads();
    threads->workers->ParallelFor(n, std::max<int64_t>(1, 4 * dim), work);
  }
};

REGISTER_KERNEL_BUILDER(Name("TpeGatherRows").Device(DEVICE_CPU), GatherRowsOp);

}  // namespace
}  // namespace tensorflow
