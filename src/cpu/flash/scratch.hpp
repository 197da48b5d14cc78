// Host scratch accounting for the CPU flash and standard paths.
//
// Every host allocation a call makes goes through a ScratchLedger, so that the call can report the
// most memory it held (fa_stats.scratch_bytes_peak). The kernels allocate once, before their
// parallel region (an exception must not escape an OpenMP region), and carve per-thread tiles out
// of that block with a Slab.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <new>

#include "core/params.hpp"

namespace flashattn::cpu {

// Alignment of every scratch array: one cache line, and a multiple of the AVX-512 vector width.
constexpr int64_t kScratchAlignment = 64;

inline int64_t align_up(int64_t bytes, int64_t alignment) { return (bytes + alignment - 1) / alignment * alignment; }

inline char* align_pointer(char* p) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  return p + (align_up(int64_t(address), kScratchAlignment) - int64_t(address));
}

// Counts the live bytes of a call's allocations and their high-water mark. Thread-safe.
class ScratchLedger {
 public:
  void add(int64_t bytes) {
    const int64_t now = current_.fetch_add(bytes) + bytes;
    int64_t seen = peak_.load();
    while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
    }
  }
  void remove(int64_t bytes) { current_.fetch_sub(bytes); }
  int64_t peak_bytes() const { return peak_.load(); }

 private:
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
};

// One aligned host allocation, counted by a ledger while it lives. Throws std::bad_alloc (which the
// API layer turns into FA_ERROR_OUT_OF_MEMORY); allocate before entering a parallel region.
class ScratchBlock {
 public:
  ScratchBlock(ScratchLedger& ledger, int64_t bytes) : ledger_(ledger), bytes_(align_up(std::max<int64_t>(bytes, 0), kScratchAlignment)) {
    if (bytes_ == 0) return;
    data_ = static_cast<char*>(::operator new(size_t(bytes_), std::align_val_t(kScratchAlignment)));
    ledger_.add(bytes_);
  }
  ~ScratchBlock() {
    if (data_ == nullptr) return;
    ::operator delete(data_, std::align_val_t(kScratchAlignment));
    ledger_.remove(bytes_);
  }
  ScratchBlock(const ScratchBlock&) = delete;
  ScratchBlock& operator=(const ScratchBlock&) = delete;
  char* data() const { return data_; }
  int64_t bytes() const { return bytes_; }

 private:
  ScratchLedger& ledger_;
  int64_t bytes_;
  char* data_ = nullptr;
};

// Carves aligned arrays out of one block. Built on nullptr it only measures, so the same carving
// code first sizes a layout and then lays it out:
//   Slab measure;  carve(measure);  ScratchBlock block(ledger, measure.bytes());
//   Slab slab(block.data());  carve(slab);
class Slab {
 public:
  explicit Slab(char* base = nullptr) : base_(base) {}
  template <typename T>
  T* take(int64_t count) {
    const int64_t offset = used_;
    used_ = align_up(used_ + std::max<int64_t>(count, 0) * int64_t(sizeof(T)), kScratchAlignment);
    return base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + offset);
  }
  int64_t bytes() const { return used_; }

 private:
  char* base_;
  int64_t used_ = 0;
};

// Fills params.stats when the caller asked for it; the printf-style `kernel_format` names the path
// and its configuration, and is formatted only then (a call without stats pays no snprintf).
__attribute__((format(printf, 4, 5))) inline void report_stats(const AttentionParams& p, const ScratchLedger& ledger,
                                                               int num_splits, const char* kernel_format, ...) {
  if (p.stats == nullptr) return;
  p.stats->scratch_bytes_peak = ledger.peak_bytes();
  p.stats->num_splits = num_splits;
  va_list args;
  va_start(args, kernel_format);
  std::vsnprintf(p.stats->kernel, sizeof(p.stats->kernel), kernel_format, args);
  va_end(args);
}

}  // namespace flashattn::cpu
