// TpeSplitByOwner: splits a replica's ids by the replica owning each id's
// row, in one pass.
//
// A row-sharded table is cut into contiguous blocks, one per replica, in
// replica order: replica r owns ids in [starts[r], starts[r + 1]). The
// elements split are the ids, or with `index` the occurrences ids[index[k]]
// (k in index order). For every owner r (0 <= r < num_parts) the outputs
// hold, in element order,
//   ids_out[r]     the owned elements' ids as rows of r's block
//                  (id - starts[r]),
//   positions[r]   the owned elements' positions (when num_positions > 0),
// and, when num_slots is 1, slots[e]: the position of element e in the
// concatenation of ids_out. The TensorFlow path (split_by_owner.py) gives
// the same outputs with tf.dynamic_partition.
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace {

REGISTER_OP("TpeSplitByOwner")
    .Input("ids: int64")
    .Input("index: num_index * int32")
    .Output("ids_out: num_parts * int64")
    .Output("positions: num_positions * int32")
    .Output("slots: num_slots * int32")
    .Attr("block_starts: list(int)")
    .Attr("num_parts: int >= 1")
    .Attr("num_index: int >= 0")
    .Attr("num_positions: int >= 0")
    .Attr("num_slots: int >= 0")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int num_parts, num_positions, num_slots, num_index;
      TF_RETURN_IF_ERROR(c->GetAttr("num_parts", &num_parts));
      TF_RETURN_IF_ERROR(c->GetAttr("num_positions", &num_positions));
      TF_RETURN_IF_ERROR(c->GetAttr("num_slots", &num_slots));
      TF_RETURN_IF_ERROR(c->GetAttr("num_index", &num_index));
      int out = 0;
      for (int r = 0; r < num_parts + num_positions; ++r) {
        c->set_output(out++, c->Vector(c->UnknownDim()));
      }
      if (num_slots > 0) {
        shape_inference::ShapeHandle elements;
        TF_RETURN_IF_ERROR(c->WithRank(c->input(num_index > 0 ? 1 : 0), 1, &elements));
        c->set_output(out++, elements);
      }
      return OkStatus();
    });

class SplitByOwnerOp : public OpKernel {
 public:
  explicit SplitByOwnerOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("block_starts", &starts_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_parts", &num_parts_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_index", &num_index_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_positions", &num_positions_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_slots", &num_slots_));
    OP_REQUIRES(ctx, static_cast<int>(starts_.size()) == num_parts_,
                errors::InvalidArgument("block_starts has ", starts_.size(),
                                        " entries for ", num_parts_, " parts"));
    OP_REQUIRES(ctx, num_index_ <= 1 && num_slots_ <= 1,
                errors::InvalidArgument("num_index and num_slots must be 0 or 1"));
    OP_REQUIRES(ctx, num_positions_ == 0 || num_positions_ == num_parts_,
                errors::InvalidArgument("num_positions must be 0 or num_parts"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids_tensor = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(ids_tensor.shape()),
                errors::InvalidArgument("ids must be a vector, got shape ",
                                        ids_tensor.shape().DebugString()));
    const int64_t num_ids = ids_tensor.dim_size(0);
    const int64_t* ids = ids_tensor.flat<int64_t>().data();
    int64_t n = num_ids;
    const int32_t* index = nullptr;
    if (num_index_ == 1) {
      const Tensor& index_tensor = ctx->input(1);
      OP_REQUIRES(ctx, TensorShapeUtils::IsVector(index_tensor.shape()),
                  errors::InvalidArgument("index must be a vector, got shape ",
                                          index_tensor.shape().DebugString()));
      n = index_tensor.dim_size(0);
      index = index_tensor.flat<int32_t>().data();
      for (int64_t k = 0; k < n; ++k) {
        OP_REQUIRES(ctx, index[k] >= 0 && index[k] < num_ids,
                    errors::InvalidArgument("index[", k, "] = ", index[k],
                                            " is not in [0, ", num_ids, ")"));
      }
    }
    auto id_of = [&](int64_t e) { return index == nullptr ? ids[e] : ids[index[e]]; };
    // The owner of each element: the last block starting at or before its
    // id (an empty block starts where the next one does and is never chosen).
    std::vector<int32_t> owner(n);
    std::vector<int64_t> counts(num_parts_, 0);
    for (int64_t e = 0; e < n; ++e) {
      const int64_t id = id_of(e);
      int32_t r = 0;
      while (r + 1 < num_parts_ && starts_[r + 1] <= id) ++r;
      owner[e] = r;
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
    int32_t* slots = nullptr;
    if (num_slots_ == 1) {
      Tensor* t;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(out++, TensorShape({n}), &t));
      slots = t->flat<int32_t>().data();
    }
    std::vector<int64_t> next(num_parts_, 0), first(num_parts_, 0);
    for (int r = 1; r < num_parts_; ++r) first[r] = first[r - 1] + counts[r - 1];
    for (int64_t e = 0; e < n; ++e) {
      const int32_t r = owner[e];
      const int64_t at = next[r]++;
      id_parts[r][at] = id_of(e) - starts_[r];
      if (num_positions_ > 0) position_parts[r][at] = static_cast<int32_t>(e);
      if (slots != nullptr) slots[e] = static_cast<int32_t>(first[r] + at);
    }
  }

 private:
  std::vector<int64_t> starts_;
  int num_parts_, num_index_, num_positions_, num_slots_;
};

REGISTER_KERNEL_BUILDER(Name("TpeSplitByOwner").Device(DEVICE_CPU), SplitByOwnerOp);

}  // namespace
}  // namespace tensorflow
