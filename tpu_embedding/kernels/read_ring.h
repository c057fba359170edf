// A thread's io_uring for direct reads of a disk table's file
// (read_records.cc): many reads submitted in one system call and reaped
// without a thread switch per read. On this project's virtual disk a
// random 4 KiB direct read costs about 5 us of CPU this way, against
// 10-14 us from a pool of threads calling pread (the disk's rate the
// same), and the CPU is what a 2-core host shares with the step.
#ifndef TPU_EMBEDDING_KERNELS_READ_RING_H_
#define TPU_EMBEDDING_KERNELS_READ_RING_H_

#include <cstdint>

namespace tpe {

// Alignment of a direct read's offset, size and buffer.
constexpr int64_t kPage = 4096;

// Bytes of a thread's bounce buffer for direct reads without the ring.
constexpr int64_t kBounceBytes = 1 << 20;

// The pages holding bytes [offset, offset + size): [first, end), aligned.
struct PageSpan {
  int64_t first, end;
  PageSpan(int64_t offset, int64_t size)
      : first(offset & ~(kPage - 1)),
        end((offset + size + kPage - 1) & ~(kPage - 1)) {}
};

// Reads, through `direct_fd` (O_DIRECT), the runs `i` of `runs` whose
// pages are at most two (a record or a few): `sizes[i]` bytes at
// `offsets[i]` into `dest + starts[i]`, setting `read[i]` to 1 for each
// run read. Returns false when
// this thread has no ring (the kernel refuses io_uring: nothing read).
// Runs left unread (a failed or short read, a run too large) are the
// caller's to read another way.
bool RingRead(int direct_fd, int64_t runs, const int64_t* offsets,
              const int64_t* sizes, const int64_t* starts, char* dest,
              unsigned char* read);

}  // namespace tpe

#endif  // TPU_EMBEDDING_KERNELS_READ_RING_H_
