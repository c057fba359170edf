// RingRead (read_ring.h): a thread's io_uring, set up on its first call
// through the raw system calls (no liburing), 64 reads in flight, each
// into its slot (two pages) of a page-aligned bounce buffer: reads are
// submitted as slots free up and reaped as they complete, each run's
// bytes copied to `dest` as its read completes.
#include "read_ring.h"

// Headers older than Linux 5.6 (no IORING_OP_READ) build a RingRead that
// always answers "no ring": the pool reads.
#if __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#endif
#if defined(IORING_FEAT_RW_CUR_POS)
#define TPE_HAS_IO_URING 1
#else
#define TPE_HAS_IO_URING 0
#endif

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace tpe {
#if TPE_HAS_IO_URING
namespace {

// Reads in flight, each into its slot of the bounce buffer.
constexpr unsigned kEntries = 64;
constexpr int64_t kSlotBytes = 2 * kPage;

class Ring {
 public:
  Ring() { Open(); }
  ~Ring() { Close(); }
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  bool ready() const { return ready_; }
  // The process that set it up (a forked child's copy shares its parent's
  // rings: it closes its copy and sets up its own).
  pid_t owner() const { return owner_; }

  void Open() {
    owner_ = getpid();
    io_uring_params params;
    std::memset(&params, 0, sizeof(params));
    fd_ = static_cast<int>(syscall(__NR_io_uring_setup, kEntries, &params));
    if (fd_ < 0) return;
    // (kernels before 5.6 set up rings without IORING_OP_READ)
    if ((params.features & IORING_FEAT_RW_CUR_POS) == 0) {
      Close();
      return;
    }
    sq_bytes_ = params.sq_off.array + params.sq_entries * sizeof(unsigned);
    cq_bytes_ = params.cq_off.cqes + params.cq_entries * sizeof(io_uring_cqe);
    single_ = (params.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single_) sq_bytes_ = cq_bytes_ = std::max(sq_bytes_, cq_bytes_);
    sq_ = Map(sq_bytes_, IORING_OFF_SQ_RING);
    cq_ = single_ ? sq_ : Map(cq_bytes_, IORING_OFF_CQ_RING);
    sqes_bytes_ = params.sq_entries * sizeof(io_uring_sqe);
    sqes_ = static_cast<io_uring_sqe*>(Map(sqes_bytes_, IORING_OFF_SQES));
    void* bounce = nullptr;
    if (sq_ == nullptr || cq_ == nullptr || sqes_ == nullptr ||
        posix_memalign(&bounce, kPage, kEntries * kSlotBytes) != 0) {
      Close();
      return;
    }
    bounce_ = static_cast<char*>(bounce);
    char* sq = static_cast<char*>(sq_);
    char* cq = static_cast<char*>(cq_);
    sq_tail_ = reinterpret_cast<unsigned*>(sq + params.sq_off.tail);
    sq_mask_ = *reinterpret_cast<unsigned*>(sq + params.sq_off.ring_mask);
    sq_array_ = reinterpret_cast<unsigned*>(sq + params.sq_off.array);
    cq_head_ = reinterpret_cast<unsigned*>(cq + params.cq_off.head);
    cq_tail_ = reinterpret_cast<unsigned*>(cq + params.cq_off.tail);
    cq_mask_ = *reinterpret_cast<unsigned*>(cq + params.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(cq + params.cq_off.cqes);
    ready_ = true;
  }

  // Reads the runs `todo` (each run's pages fit a slot), a slot of the
  // bounce buffer per read in flight, refilled as reads complete.
  void Read(int direct_fd, const std::vector<int64_t>& todo,
            const int64_t* offsets, const int64_t* sizes,
            const int64_t* starts, char* dest, unsigned char* read) {
    std::vector<unsigned> free_slots;
    for (unsigned slot = 0; slot < kEntries; ++slot) free_slots.push_back(slot);
    std::vector<int64_t> run_in(kEntries, -1);  // each slot's run
    size_t submitted = 0, reaped = 0;
    unsigned unsubmitted = 0;
    while (reaped < todo.size()) {
      unsigned tail = *sq_tail_;  // (only this thread writes it)
      while (submitted < todo.size() && !free_slots.empty()) {
        const int64_t run = todo[submitted++];
        const unsigned slot = free_slots.back();
        free_slots.pop_back();
        run_in[slot] = run;
        const PageSpan pages(offsets[run], sizes[run]);
        const unsigned entry_at = tail & sq_mask_;
        io_uring_sqe* entry = &sqes_[entry_at];
        std::memset(entry, 0, sizeof(*entry));
        entry->opcode = IORING_OP_READ;
        entry->fd = direct_fd;
        entry->off = static_cast<uint64_t>(pages.first);
        entry->addr = reinterpret_cast<uint64_t>(bounce_ + slot * kSlotBytes);
        entry->len = static_cast<uint32_t>(pages.end - pages.first);
        entry->user_data = slot;
        sq_array_[entry_at] = entry_at;
        ++tail;
        ++unsubmitted;
      }
      __atomic_store_n(sq_tail_, tail, __ATOMIC_RELEASE);
      // Submits what is queued and waits for one completion. Reads in
      // flight write to the bounce buffer: this returns only once every
      // read submitted completed, whatever the system call says.
      const long entered = syscall(__NR_io_uring_enter, fd_, unsubmitted, 1,
                                   IORING_ENTER_GETEVENTS, nullptr, 0);
      if (entered > 0) unsubmitted -= static_cast<unsigned>(entered);
      const unsigned in_flight =
          kEntries - static_cast<unsigned>(free_slots.size());
      if (entered < 0 && errno != EINTR && errno != EAGAIN &&
          errno != EBUSY && in_flight == unsubmitted) {
        Close();  // (none in flight: this thread reads without a ring)
        return;
      }
      unsigned head = *cq_head_;
      const unsigned ready = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
      for (; head != ready; ++head) {
        const io_uring_cqe& done = cqes_[head & cq_mask_];
        const unsigned slot = static_cast<unsigned>(done.user_data);
        const int64_t run = run_in[slot];
        const int64_t first = PageSpan(offsets[run], sizes[run]).first;
        // Read when the bytes it needs arrived (a page past the file's
        // end is short; such a run is read another way).
        if (done.res >= offsets[run] + sizes[run] - first) {
          std::memcpy(dest + starts[run],
                      bounce_ + slot * kSlotBytes + (offsets[run] - first),
                      sizes[run]);
          read[run] = 1;
        }
        free_slots.push_back(slot);
        ++reaped;
      }
      __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
    }
  }

  void Close() {
    if (sqes_ != nullptr) munmap(sqes_, sqes_bytes_);
    if (cq_ != nullptr && !single_) munmap(cq_, cq_bytes_);
    if (sq_ != nullptr) munmap(sq_, sq_bytes_);
    if (fd_ >= 0) close(fd_);
    std::free(bounce_);
    sqes_ = nullptr;
    sq_ = cq_ = nullptr;
    bounce_ = nullptr;
    fd_ = -1;
    ready_ = false;
  }

 private:
  void* Map(size_t bytes, uint64_t offset) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_POPULATE, fd_, static_cast<off_t>(offset));
    return p == MAP_FAILED ? nullptr : p;
  }

  int fd_ = -1;
  pid_t owner_ = 0;
  bool ready_ = false, single_ = false;
  void *sq_ = nullptr, *cq_ = nullptr;
  io_uring_sqe* sqes_ = nullptr;
  size_t sq_bytes_ = 0, cq_bytes_ = 0, sqes_bytes_ = 0;
  unsigned *sq_tail_ = nullptr, *sq_array_ = nullptr;
  unsigned *cq_head_ = nullptr, *cq_tail_ = nullptr;
  unsigned sq_mask_ = 0, cq_mask_ = 0;
  io_uring_cqe* cqes_ = nullptr;
  char* bounce_ = nullptr;
};

}  // namespace

bool RingRead(int direct_fd, int64_t runs, const int64_t* offsets,
              const int64_t* sizes, const int64_t* starts, char* dest,
              unsigned char* read) {
  thread_local Ring ring;
  if (ring.owner() != getpid()) {
    ring.Close();
    ring.Open();
  }
  if (!ring.ready()) return false;
  std::vector<int64_t> todo;
  for (int64_t run = 0; run < runs; ++run) {
    const PageSpan pages(offsets[run], sizes[run]);
    if (pages.end - pages.first <= kSlotBytes) todo.push_back(run);
  }
  ring.Read(direct_fd, todo, offsets, sizes, starts, dest, read);
  return true;
}
#else
bool RingRead(int, int64_t, const int64_t*, const int64_t*, const int64_t*,
              char*, unsigned char*) {
  return false;
}
#endif

}  // namespace tpe

extern "C" int TpeReadRingReady() {
  const int64_t none = 0;
  unsigned char read = 0;
  return tpe::RingRead(-1, 0, &none, &none, &none, nullptr, &read) ? 1 : 0;
}
