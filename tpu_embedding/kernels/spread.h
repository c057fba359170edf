// Rows of a kernel spread over the CPU worker threads, or not.
//
// A training step with one replica per core already runs one op on every
// core (each replica's ops on an inter-op thread): there a kernel that also
// spreads its rows over the worker threads only queues behind the other
// replicas' work. The Python side passes `spread` (kernels/ops.py:
// KernelOps.spread, decided by select_ops).
#ifndef TPU_EMBEDDING_KERNELS_SPREAD_H_
#define TPU_EMBEDDING_KERNELS_SPREAD_H_

#include <cstdint>

#include "tensorflow/core/framework/op_kernel.h"

namespace tensorflow {

// Runs work(begin, end) over [0, n): on the worker threads (`cost` per row,
// as ParallelFor takes it) when `spread`, else at once on this thread.
template <typename Work>
inline void ForRows(OpKernelContext* ctx, bool spread, int64_t n, int64_t cost,
                    const Work& work) {
  if (!spread) {
    work(0, n);
    return;
  }
  auto* threads = ctx->device()->tensorflow_cpu_worker_threads();
  threads->workers->ParallelFor(n, cost, work);
}

}  // namespace tensorflow

#endif  // TPU_EMBEDDING_KERNELS_SPREAD_H_
