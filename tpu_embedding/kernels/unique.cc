// TpeUnique: the distinct int64 ids of a vector, in order of first
// occurrence, and each id's position among them (int32): the outputs of
// tf.unique(ids, out_idx=tf.int32). The vector is the concatenation of the
// `ids` parts, each plus its `offsets` entry (none: 0), read in place. From an open-addressing hash table
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
    .Input("ids: num_parts * int64")
    .Output("unique: int64")
    .Output("index: int32")
    .Attr("num_parts: int >= 1")
    .Attr("offsets: list(int) = []")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::DimensionHandle total = c->MakeDim(0);
      for (int p = 0; p < c->num_inputs(); ++p) {
        shape_inference::ShapeHandle part;
        TF_RETURN_IF_ERROR(c->WithRank(c->input(p), 1, &part));
        TF_RETURN_IF_ERROR(c->Add(total, c->Dim(part, 0), &total));
      }
      c->set_output(0, c->Vector(shape_inference::InferenceContext::kUnknownDim));
      c->set_output(1, c->Vector(total));
      return absl::OkStatus();
    });

class UniqueOp : public OpKernel {
 public:
  explicit UniqueOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_parts", &num_parts_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("offsets", &offsets_));
    OP_REQUIRES(ctx, offsets_.empty() || static_cast<int>(offsets_.size()) == num_parts_,
                errors::InvalidArgument("offsets has ", offsets_.size(),
                                        " entries for ", num_parts_, " parts"));
  }

  void Compute(OpKernelContext* ctx) override {
    int64_t n = 0;
    for (int p = 0; p < num_parts_; ++p) {
      const Tensor& part = ctx->input(p);
      OP_REQUIRES(ctx, TensorShapeUtils::IsVector(part.shape()),
                  errors::InvalidArgument("ids must be a vector, got shape ",
                                          part.shape().DebugString()));
      n += part.dim_size(0);
    }
    OP_REQUIRES(ctx, n <= std::numeric_limits<int32_t>::max(),
                errors::InvalidArgument("too many ids for int32 positions: ", n));
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
    // Finds or inserts one id; returns its position among the distinct.
    auto find = [&](int64_t id) -> int32_t {
      uint64_t h = (static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull) >> shift;
      while (true) {
        const int32_t s = slots[h];
        if (s < 0) {
          slots[h] = static_cast<int32_t>(distinct.size());
          distinct.push_back(id);
          return slots[h];
        }
        if (distinct[s] == id) return s;
        h = (h + 1) & mask;
      }
    };
    int64_t i = 0;
    for (int p = 0; p < num_parts_; ++p) {
      const Tensor& part = ctx->input(p);
      const int64_t* ids = part.flat<int64_t>().data();
      const int64_t offset = offsets_.empty() ? 0 : offsets_[p];
      for (int64_t j = 0; j < part.dim_size(0); ++j) {
        position[i++] = find(ids[j] + offset);
      }
    }
    Tensor* unique = nullptr;
    const int64_t count = static_cast<int64_t>(distinct.size());
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({count}), &unique));
    std::copy(distinct.begin(), distinct.end(), unique->flat<int64_t>().data());
  }

 private:
  int num_parts_;
  std::vector<int64_t> offsets_;
};

REGISTER_KERNEL_BUILDER(Name("TpeUnique").Device(DEVICE_CPU), UniqueOp);

}  // namespace
}  // namespace tensorflow
