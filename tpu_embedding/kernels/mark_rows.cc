// TpeMarkRows: sets an int8 flag variable to 1 at each of `rows` (any order,
// repeats allowed): what ResourceScatterUpdate(flags, rows, ones) writes, for
// the changed-row flags every table update sets (tables/changed_rows.py).
// TensorFlow's scatter copies each flag through Eigen's general row
// assignment; here it is one byte store per row. Every row is checked
// before any flag is written (the scatter's message for a row out of
// range), and a buffer that a read still holds is copied first, as
// TensorFlow's sparse updates do.
#include <cstdint>
#include <cstring>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace {

// Rows looked ahead to prefetch their flags.
constexpr int64_t kAhead = 16;

REGISTER_OP("TpeMarkRows")
    .Input("flags: resource")
    .Input("rows: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs);

class MarkRowsOp : public OpKernel {
 public:
  explicit MarkRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& rows = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(rows.shape()),
                errors::InvalidArgument("rows must be a vector, got shape ",
                                        rows.shape().DebugString()));
    core::RefCountPtr<Var> var;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &var));
    tsl::mutex_lock lock(*var->mu());
    Tensor* flags = var->tensor();
    OP_REQUIRES(ctx, var->is_initialized && flags->dtype() == DT_INT8 &&
                         flags->dims() == 1,
                errors::InvalidArgument(
                    "flags must be an initialized int8 vector variable, got ",
                    flags->shape().DebugString()));
    const int64_t size = flags->dim_size(0);
    const int64_t n = rows.dim_size(0);
    const int64_t* ids = rows.flat<int64_t>().data();
    for (int64_t i = 0; i < n; ++i) {
      OP_REQUIRES(ctx, ids[i] >= 0 && ids[i] < size,
                  errors::InvalidArgument("indices[", i, "] = ", ids[i],
                                          " is not in [0, ", size, ")"));
    }
    if (n == 0) return;
    if (!var->copy_on_read_mode.load()) {
      if (!flags->RefCountIsOne()) {
        Tensor copy;
        OP_REQUIRES_OK(ctx, ctx->allocate_temp(DT_INT8, flags->shape(), &copy));
        std::memcpy(copy.flat<int8_t>().data(), flags->flat<int8_t>().data(),
                    flags->TotalBytes());
        *flags = copy;
      }
      var->copy_on_read_mode.store(true);
    }
    // The flags of a large table are rarely in cache: fetch them ahead.
    int8_t* data = flags->flat<int8_t>().data();
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n) __builtin_prefetch(data + ids[i + kAhead], 1, 0);
      data[ids[i]] = 1;
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("TpeMarkRows").Device(DEVICE_CPU), MarkRowsOp);

}  // namespace
}  // namespace tensorflow
