// TpeVocabularyStep: one training step of a dynamic vocabulary
// (tpu_embedding/vocabularies/config.py has the rules), on its state
// variables, in one pass over the step's keys and their buckets.
//
// Outputs exactly what vocabularies/transition.py's TensorFlow ops compute
// (each occurrence's row, the rows given to new keys in order of their
// keys' first occurrence) and leaves the state exactly as they do; a key
// costs one scan of its bucket (and of its probation entries), where the
// TensorFlow ops gather, compare and sort [keys, bucket_size] matrices.
//
// The state may be one shard's (buckets.py's BucketLayout): the buckets
// [first_bucket, first_bucket + local buckets) of `num_buckets`, the rows
// of those buckets of `capacity`; keys of other buckets get row -1 and
// change nothing. Rows in and out are global; the state is local.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace {

REGISTER_OP("TpeVocabularyStep")
    .Input("keys: resource")
    .Input("last_step: resource")
    .Input("counts: resource")
    .Input("probation_keys: resource")
    .Input("probation_last_step: resource")
    .Input("probation_counts: resource")
    .Input("step: resource")
    .Input("evictions: resource")
    .Input("occurrences: int64")
    .Output("rows: int64")
    .Output("new_rows: int64")
    .Attr("num_buckets: int >= 1")
    .Attr("first_bucket: int >= 0")
    .Attr("local_buckets: int >= 0")
    .Attr("capacity: int >= 1")
    .Attr("min_count: int >= 1")
    .Attr("probation_size: int >= 0")
    .Attr("lfu: bool")
    .Attr("ttl_steps: int >= 0")  // 0: no expiry.
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(8));
      c->set_output(1, c->Vector(c->UnknownDim()));
      return OkStatus();
    });

// splitmix64's finalizer (buckets.py's mix).
inline uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Gives keys the entries of their bucket (rows, or probation entries), as
// transition.py's _allot does: per bucket, its keys in order of count
// (descending), then first occurrence, take in turn the bucket's free
// entries (not live) by entry, then the live ones not touched at this step
// (last != step), least first by `before`. Calls give(key, entry, free)
// for each key that gets one; keys beyond the entries get none.
//   keys: the keys asking (sorted here); bucket, total: per key;
//   range(b): the bucket's entries [first, end); last: per entry.
template <typename Range, typename Live, typename Before, typename Give>
void Allot(std::vector<int64_t>* keys, const std::vector<int64_t>& bucket,
           const std::vector<int64_t>& total, Range range, const int64_t* last,
           int64_t step, Live live, Before before, Give give) {
  std::sort(keys->begin(), keys->end(), [&](int64_t a, int64_t b) {
    if (bucket[a] != bucket[b]) return bucket[a] < bucket[b];
    if (total[a] != total[b]) return total[a] > total[b];
    return a < b;
  });
  std::vector<int64_t> candidates;
  for (size_t begin = 0; begin < keys->size();) {
    size_t end = begin;
    const int64_t b = bucket[(*keys)[begin]];
    while (end < keys->size() && bucket[(*keys)[end]] == b) ++end;
    const auto [lo, hi] = range(b);
    candidates.clear();
    for (int64_t e = lo; e < hi; ++e) {
      if (!live(last[e])) candidates.push_back(e);
    }
    const size_t free_entries = candidates.size();
    for (int64_t e = lo; e < hi; ++e) {
      if (live(last[e]) && last[e] != step) candidates.push_back(e);
    }
    std::sort(candidates.begin() + free_entries, candidates.end(), before);
    for (size_t i = begin; i < end && i - begin < candidates.size(); ++i) {
      give((*keys)[i], candidates[i - begin], i - begin < free_entries);
    }
    begin = end;
  }
}

class VocabularyStepOp : public OpKernel {
 public:
  explicit VocabularyStepOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_buckets", &num_buckets_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("first_bucket", &first_bucket_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("local_buckets", &local_buckets_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("capacity", &capacity_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("min_count", &min_count_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("probation_size", &probation_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("lfu", &lfu_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("ttl_steps", &ttl_));
  }

  void Compute(OpKernelContext* ctx) override {
    constexpr int kVariables = 8;
    std::vector<core::RefCountPtr<Var>> vars(kVariables);
    for (int v = 0; v < kVariables; ++v) {
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, v), &vars[v]));
    }
    std::vector<Var*> order;
    for (auto& v : vars) order.push_back(v.get());
    std::sort(order.begin(), order.end());
    std::vector<tsl::mutex_lock> locks;
    locks.reserve(order.size());
    for (Var* v : order) locks.emplace_back(*v->mu());
    for (int v = 0; v < kVariables; ++v) {
      OP_REQUIRES(ctx, vars[v]->is_initialized &&
                           vars[v]->tensor()->dtype() == DT_INT64,
                  errors::InvalidArgument("vocabulary variable ", v,
                                          " must be an initialized int64"));
    }
    // Global rows of global bucket b; this shard's buckets and rows.
    auto global_first_row = [&](int64_t b) {
      return static_cast<int64_t>(static_cast<__int128>(b) * capacity_ /
                                  num_buckets_);
    };
    const int64_t local_buckets = local_buckets_;
    const int64_t offset = global_first_row(first_bucket_);
    const int64_t rows_here = vars[0]->tensor()->NumElements();
    const int64_t entries = local_buckets * probation_;
    OP_REQUIRES(ctx,
                first_bucket_ + local_buckets <= num_buckets_ &&
                    rows_here == global_first_row(first_bucket_ + local_buckets) - offset,
                errors::InvalidArgument("vocabulary rows do not match the shard"));
    for (int v = 1; v < 3; ++v) {
      OP_REQUIRES(ctx, vars[v]->tensor()->NumElements() == rows_here,
                  errors::InvalidArgument("vocabulary rows differ in size"));
    }
    for (int v = 3; v < 6; ++v) {
      OP_REQUIRES(ctx, vars[v]->tensor()->NumElements() == entries,
                  errors::InvalidArgument("probation entries must number ",
                                          entries));
    }
    OP_REQUIRES(ctx, num_buckets_ <= capacity_,
                errors::InvalidArgument("more buckets than rows"));
    // Writable in place (copy-on-write, as TensorFlow's scatters).
    for (Var* v : order) {
      if (!v->tensor()->RefCountIsOne()) {
        Tensor copy;
        OP_REQUIRES_OK(ctx, ctx->allocate_temp(DT_INT64, v->tensor()->shape(), &copy));
        copy.flat<int64_t>() = v->tensor()->flat<int64_t>();
        *v->tensor() = copy;
      }
    }
    int64_t* keys = vars[0]->tensor()->flat<int64_t>().data();
    int64_t* last = vars[1]->tensor()->flat<int64_t>().data();
    int64_t* counts = vars[2]->tensor()->flat<int64_t>().data();
    int64_t* pkeys = vars[3]->tensor()->flat<int64_t>().data();
    int64_t* plast = vars[4]->tensor()->flat<int64_t>().data();
    int64_t* pcounts = vars[5]->tensor()->flat<int64_t>().data();
    int64_t& step_var = vars[6]->tensor()->scalar<int64_t>()();
    int64_t& evictions = vars[7]->tensor()->scalar<int64_t>()();

    const Tensor& occurrences_t = ctx->input(8);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(occurrences_t.shape()),
                errors::InvalidArgument("occurrences must be a vector"));
    const auto occurrences = occurrences_t.flat<int64_t>();
    const int64_t m = occurrences.size();
    const int64_t step = step_var + 1;
    auto live = [&](int64_t seen_at) {
      return seen_at > 0 && (ttl_ == 0 || step - seen_at <= ttl_);
    };
    // Local rows of local bucket b.
    auto first_row = [&](int64_t b) {
      return global_first_row(b + first_bucket_) - offset;
    };

    // Distinct keys in order of first occurrence, with their counts (an
    // open-addressing table of at least twice the occurrences).
    uint64_t size = 16;
    while (size < 2 * static_cast<uint64_t>(m)) size <<= 1;
    std::vector<int64_t> table(size, -1);
    std::vector<int64_t> distinct, seen, position(m);
    for (int64_t i = 0; i < m; ++i) {
      const int64_t key = occurrences(i);
      uint64_t at = Mix(static_cast<uint64_t>(key)) & (size - 1);
      while (table[at] >= 0 && distinct[table[at]] != key) {
        at = (at + 1) & (size - 1);
      }
      if (table[at] < 0) {
        table[at] = distinct.size();
        distinct.push_back(key);
        seen.push_back(0);
      }
      position[i] = table[at];
      ++seen[table[at]];
    }
    const int64_t n = distinct.size();
    std::vector<int64_t> bucket(n), row(n, rows_here), total(n), entry(n, -1);
    std::vector<char> hit(n, 0), owned(n, 0);
    for (int64_t k = 0; k < n; ++k) {
      const int64_t b =
          static_cast<int64_t>(Mix(static_cast<uint64_t>(distinct[k])) %
                               static_cast<uint64_t>(num_buckets_)) -
          first_bucket_;
      bucket[k] = b;
      if (b < 0 || b >= local_buckets) continue;  // Another shard's key.
      owned[k] = 1;
      for (int64_t r = first_row(b); r < first_row(b + 1); ++r) {
        if (live(last[r]) && keys[r] == distinct[k]) {
          hit[k] = 1;
          row[k] = r;
          break;
        }
      }
      int64_t prior = 0;
      if (!hit[k] && probation_ > 0) {
        for (int64_t e = b * probation_; e < (b + 1) * probation_; ++e) {
          if (live(plast[e]) && pkeys[e] == distinct[k]) {
            entry[k] = e;
            prior = pcounts[e];
            break;
          }
        }
      }
      total[k] = seen[k] + prior;
    }

    // Hits first: from here a row hit at this step is one whose last step
    // is this step (no row had it before), never evicted.
    for (int64_t k = 0; k < n; ++k) {
      if (hit[k]) {
        last[row[k]] = step;
        counts[row[k]] += seen[k];
      }
    }

    // Keys asking for a row: the rows of their bucket, evicting least
    // recently (LRU) or least often (LFU) seen keys.
    std::vector<int64_t> asking;
    for (int64_t k = 0; k < n; ++k) {
      if (owned[k] && !hit[k] && total[k] >= min_count_) asking.push_back(k);
    }
    std::vector<char> admitted(n, 0);
    int64_t evicted = 0;
    Allot(
        &asking, bucket, total,
        [&](int64_t b) { return std::make_pair(first_row(b), first_row(b + 1)); },
        last, step, live,
        [&](int64_t x, int64_t y) {
          if (lfu_) {
            if (counts[x] != counts[y]) return counts[x] < counts[y];
            if (last[x] != last[y]) return last[x] < last[y];
          } else {
            if (last[x] != last[y]) return last[x] < last[y];
            if (counts[x] != counts[y]) return counts[x] < counts[y];
          }
          return x < y;
        },
        [&](int64_t k, int64_t r, bool free_row) {
          row[k] = r;
          admitted[k] = 1;
          evicted += !free_row;
        });

    // The new rows (never a row hit at this step).
    std::vector<int64_t> new_rows;
    for (int64_t k = 0; k < n; ++k) {
      if (admitted[k]) {
        keys[row[k]] = distinct[k];
        last[row[k]] = step;
        counts[row[k]] = total[k];
        new_rows.push_back(row[k] + offset);
      }
    }
    if (probation_ > 0) {
      Probation(distinct, bucket, total, owned, hit, admitted, entry, step,
                live, pkeys, plast, pcounts);
    }
    evictions += evicted;
    step_var = step;

    Tensor* rows_out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, occurrences_t.shape(), &rows_out));
    auto rows_flat = rows_out->flat<int64_t>();
    for (int64_t i = 0; i < m; ++i) {
      const int64_t k = position[i];
      rows_flat(i) = !owned[k] ? -1 : row[k] == rows_here ? capacity_
                                                          : row[k] + offset;
    }
    Tensor* new_out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            1, TensorShape({static_cast<int64_t>(new_rows.size())}),
                            &new_out));
    std::copy(new_rows.begin(), new_rows.end(), new_out->flat<int64_t>().data());
  }

 private:
  template <typename Live>
  void Probation(const std::vector<int64_t>& distinct,
                 const std::vector<int64_t>& bucket,
                 const std::vector<int64_t>& total,
                 const std::vector<char>& owned,
                 const std::vector<char>& hit,
                 const std::vector<char>& admitted,
                 const std::vector<int64_t>& entry, int64_t step, Live live,
                 int64_t* pkeys, int64_t* plast, int64_t* pcounts) {
    const int64_t n = distinct.size();
    // Entries of keys on probation first: their last step becomes this
    // step (no entry had it before), which keeps joining keys off them;
    // admitted keys' entries are freed at the end.
    std::vector<int64_t> joining;
    for (int64_t k = 0; k < n; ++k) {
      if (entry[k] >= 0) {
        if (!admitted[k]) {
          pkeys[entry[k]] = distinct[k];
          pcounts[entry[k]] = total[k];
        }
        plast[entry[k]] = step;
      }
      if (owned[k] && !hit[k] && !admitted[k] && entry[k] < 0) {
        joining.push_back(k);
      }
    }
    // Decide every joining key's entry before writing anything.
    std::vector<std::pair<int64_t, int64_t>> joined;  // (key, entry)
    Allot(
        &joining, bucket, total,
        [&](int64_t b) {
          return std::make_pair(b * probation_, (b + 1) * probation_);
        },
        plast, step, live,
        [&](int64_t x, int64_t y) {
          if (plast[x] != plast[y]) return plast[x] < plast[y];
          if (pcounts[x] != pcounts[y]) return pcounts[x] < pcounts[y];
          return x < y;
        },
        [&](int64_t k, int64_t e, bool) { joined.emplace_back(k, e); });
    for (int64_t k = 0; k < n; ++k) {
      if (entry[k] >= 0 && admitted[k]) plast[entry[k]] = 0;
    }
    for (const auto& [k, e] : joined) {
      pkeys[e] = distinct[k];
      pcounts[e] = total[k];
      plast[e] = step;
    }
  }

  int64_t num_buckets_;
  int64_t first_bucket_;
  int64_t local_buckets_;
  int64_t capacity_;
  int64_t min_count_;
  int64_t probation_;
  bool lfu_;
  int64_t ttl_;
};

REGISTER_KERNEL_BUILDER(Name("TpeVocabularyStep").Device(DEVICE_CPU),
                        VocabularyStepOp);

}  // namespace
}  // namespace tensorflow
