// TpeReadRecords: reads runs of a disk-tiered table's file into one buffer
// with many reads in flight (tables/row_files.py). Called through ctypes,
// which releases Python's GIL for the call: the reads wait on the disk
// with none of Python's per-call work between them. A fixed pool of
// threads, started on the first call, serves every call; the calling
// thread reads too.
//
// TpeReadRecordsDirect reads the same bytes through a second descriptor of
// the file opened with O_DIRECT: each run's 4 KiB-aligned pages straight
// from the disk into a bounce buffer, then its bytes to `dest`. The disk
// does the same reads (a record is less than a page), and the page cache
// neither fills nor must be emptied again (the kernel writes dirty pages
// of the range out first, so a direct read sees every finished write).
// With `use_ring`, the calling thread's io_uring reads them (read_ring.h:
// less CPU a read, no thread switch per read); the pool reads what it
// leaves, and every run where the kernel has no io_uring. A run the direct
// descriptor refuses (EINVAL: a device with larger blocks) or cuts short
// is read through `fd`.
//
// Return 0, or the errno of the first read that failed (EIO for a read
// past the end of the file).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "read_ring.h"

namespace {

// Threads reading beside the caller: reads in flight, with the caller's.
constexpr int kReaders = 31;

using tpe::kPage;

struct Job {
  int fd;
  int direct_fd;  // -1: none
  int64_t runs;
  const int64_t* offsets;  // in the file
  const int64_t* sizes;    // bytes
  const int64_t* starts;   // in dest
  char* dest;
  std::atomic<int64_t> next{0};
  // Guarded by mu.
  int64_t finished = 0;
  int active = 0;
  int error = 0;
  std::mutex mu;
  std::condition_variable done;
};

// The readers' queue of calls. Never destroyed: the detached readers wait
// on it until the process ends (a destructor at exit would wait for them).
struct Queue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Job*> jobs;  // guarded by mu
};

Queue& Shared() {
  static Queue* queue = new Queue;
  return *queue;
}

std::once_flag started;

int ReadRun(const Job& job, int64_t i) {
  int64_t done = 0;
  while (done < job.sizes[i]) {
    ssize_t n = pread(job.fd, job.dest + job.starts[i] + done,
                      job.sizes[i] - done, job.offsets[i] + done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return EIO;
    done += n;
  }
  return 0;
}

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};

// The calling thread's bounce buffer (page aligned, kBounceBytes).
char* Bounce() {
  thread_local std::unique_ptr<char, FreeDeleter> buffer;
  if (buffer == nullptr) {
    void* p = nullptr;
    if (posix_memalign(&p, kPage, tpe::kBounceBytes) != 0) return nullptr;
    buffer.reset(static_cast<char*>(p));
  }
  return buffer.get();
}

// Reads run `i` through the direct descriptor, a bounce buffer's pages at
// a time; false where it cannot (the run is then read through `fd`).
bool ReadRunDirect(const Job& job, int64_t i) {
  char* bounce = Bounce();
  if (bounce == nullptr) return false;
  const int64_t end = job.offsets[i] + job.sizes[i];
  for (int64_t at = job.offsets[i]; at < end;) {
    const int64_t first = tpe::PageSpan(at, 0).first;
    const int64_t last = std::min(end, first + tpe::kBounceBytes);
    const int64_t pages = tpe::PageSpan(first, last - first).end - first;
    int64_t done = 0;
    while (first + done < last) {
      ssize_t n =
          pread(job.direct_fd, bounce + done, pages - done, first + done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0 || n % kPage != 0) return false;  // (the end, or EINVAL)
      done += n;
    }
    std::memcpy(job.dest + job.starts[i] + (at - job.offsets[i]),
                bounce + (at - first), last - at);
    at = last;
  }
  return true;
}

// Reads runs of `job` until none is left; `job->active` counted this
// thread in before.
void Work(Job* job) {
  int64_t mine = 0;
  int error = 0;
  for (;;) {
    int64_t i = job->next.fetch_add(1);
    if (i >= job->runs) break;
    int e = 0;
    if (job->direct_fd < 0 || !ReadRunDirect(*job, i)) e = ReadRun(*job, i);
    if (e != 0 && error == 0) error = e;
    ++mine;
  }
  std::lock_guard<std::mutex> lock(job->mu);
  job->finished += mine;
  if (error != 0 && job->error == 0) job->error = error;
  if (--job->active == 0 && job->finished == job->runs) job->done.notify_all();
}

void Reader() {
  Queue& queue = Shared();
  for (;;) {
    Job* job;
    {
      std::unique_lock<std::mutex> lock(queue.mu);
      queue.cv.wait(lock, [&] { return !queue.jobs.empty(); });
      job = queue.jobs.front();
      if (job->next.load() >= job->runs) {
        queue.jobs.pop_front();  // (its caller waits for its last reads)
        continue;
      }
      std::lock_guard<std::mutex> job_lock(job->mu);
      ++job->active;  // (while queued: its caller has not left)
    }
    Work(job);
  }
}

// Reads the runs with the pool (and the calling thread).
int ReadWithPool(int fd, int direct_fd, int64_t runs, const int64_t* offsets,
                 const int64_t* sizes, const int64_t* starts, char* dest) {
  if (runs <= 0) return 0;
  Queue& queue = Shared();
  std::call_once(started, [] {
    for (int i = 0; i < kReaders; ++i) std::thread(Reader).detach();
  });
  Job job;
  job.fd = fd;
  job.direct_fd = direct_fd;
  job.runs = runs;
  job.offsets = offsets;
  job.sizes = sizes;
  job.starts = starts;
  job.dest = dest;
  job.active = 1;  // this thread
  if (runs > 1) {
    {
      std::lock_guard<std::mutex> lock(queue.mu);
      queue.jobs.push_back(&job);
    }
    if (runs - 1 >= kReaders) {
      queue.cv.notify_all();
    } else {
      for (int64_t i = 1; i < runs; ++i) queue.cv.notify_one();
    }
  }
  Work(&job);
  {
    std::lock_guard<std::mutex> lock(queue.mu);
    auto at = std::find(queue.jobs.begin(), queue.jobs.end(), &job);
    if (at != queue.jobs.end()) queue.jobs.erase(at);
  }
  std::unique_lock<std::mutex> lock(job.mu);
  job.done.wait(lock,
                [&] { return job.active == 0 && job.finished == job.runs; });
  return job.error;
}

}  // namespace

extern "C" int TpeReadRecordsDirect(int fd, int direct_fd, int use_ring,
                                    int64_t runs, const int64_t* offsets,
                                    const int64_t* sizes,
                                    const int64_t* starts, char* dest) {
  if (runs <= 0) return 0;
  if (direct_fd < 0 || !use_ring) {
    return ReadWithPool(fd, direct_fd, runs, offsets, sizes, starts, dest);
  }
  std::vector<unsigned char> read(runs, 0);
  if (!tpe::RingRead(direct_fd, runs, offsets, sizes, starts, dest,
                     read.data())) {
    return ReadWithPool(fd, direct_fd, runs, offsets, sizes, starts, dest);
  }
  std::vector<int64_t> left_offsets, left_sizes, left_starts;
  for (int64_t i = 0; i < runs; ++i) {
    if (read[i]) continue;
    left_offsets.push_back(offsets[i]);
    left_sizes.push_back(sizes[i]);
    left_starts.push_back(starts[i]);
  }
  return ReadWithPool(fd, direct_fd, static_cast<int64_t>(left_offsets.size()),
                      left_offsets.data(), left_sizes.data(),
                      left_starts.data(), dest);
}

extern "C" int TpeReadRecords(int fd, int64_t runs, const int64_t* offsets,
                              const int64_t* sizes, const int64_t* starts,
                              char* dest) {
  return ReadWithPool(fd, -1, runs, offsets, sizes, starts, dest);
}
