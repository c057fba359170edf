// TpeUnique: the distinct int64 ids of a vector, in order of first
// occurrence, and each id's position among them (int32): the outputs of
// tf.unique(ids, out_idx=tf.int32), from an open-addressing hash table
// sized for the input (Fibonacci hashing, linear probing) instead of a
// general-purpose map: one pass, a few nanoseconds per id.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace {

REGISTER_OP("TpeUnique")
    .Input("ids: int64")
    .Output("unique: int64")
    .Output("index: int32")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &ids));
      c->set_output(0, c->Vector(shape_inference::InferenceContext::kUnknownDim));
      c->set_output(1, ids);
      return absl::OkStatus();
    });

class UniqueOp : public OpKernel {
 public:
  explicit UniqueOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& input = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(input.shape()),
                errors::InvalidArgument("ids must be a vector, got shape ",
                                        input.shape().DebugString()));
    const int64_t n = input.dim_size(0);
    OP_REQUIRES(ctx, n <= std::numeric_limits<int32_t>::max(),
                errors::InvalidArgument("too many ids for int32 positions: ", n));
    const int64_t* ids = input.flat<int64_t>().data();
    Tensor* index = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &index));
    int32_t* position = index->flat<int32_t>().data();

    // Slots hold positions in `distinct` (-1: empty); at most half full.
    int bits = 4;
    while ((int64_t{1} << bits) < 2 * n) ++bits;
    const uint64_t mask = (uint64_t{1} << bits) - 1;
    const int shift = 64 - bits;
    std::vector<int32_t> slots(size_t{1} << bits, -1);
    std::vector<int64_t> distinct;
    distinct.reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t id = ids[i];
      uint64_t h = (static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull) >> shift;
      while (true) {
        const int32_t s = slots[h];
        if (s < 0) {
          slots[h] = static_cast<int32_t>(distinct.size());
          position[i] = slots[h];
          distinct.push_back(id);
          break;
        }
        if (distinct[s] == id) {
          position[i] = s;
          break;
        }
        h = (h + 1) & mask;
      }
    }
    Tensor* unique = nullptr;
    const int64_t count = static_cast<int64_t>(distinct.size());
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({count}), &unique));
    std::copy(distinct.begin(), distinct.end(), unique->flat<int64_t>().data());
  }
};

REGISTER_KERNEL_BUILDER(Name("TpeUnique").Device(DEVICE_CPU), UniqueOp);

}  // namespace
}  // namespace tensorflow
