// A second stream for the two independent halves of one call: a paged varlen forward's routed short sequences (the
// memory-bound decode kernels, src/cuda/decode/kvcache.cpp) beside its forward kernel over the longer ones
// (src/cuda/backend.cpp). The call forks after its allocations on the caller's stream and joins before its frees:
//   caller's stream:  [allocations] -- record `fork` -----------------[the forward kernel]-- wait `join` -- [frees]
//   side stream:                        wait `fork` -- [decode half] -- record `join`
// so everything before the call on the caller's stream precedes both halves, and everything after follows both (as if
// the call had run on the caller's stream alone). One side stream per device, at the device's greatest priority: where
// CTAs of both halves wait for room, the block scheduler places the decode half's first, and the forward's fill the
// SMs' room beside them (the decode CTAs stream K/V while the forward's compute). Affects speed only.
//
// Thread safety: a fork holds its device's side stream (a mutex) until it joins, so calls from several threads take
// turns on it. CUDA graph capture: the fork and the join are events, so a capture of the caller's stream takes the side
// stream's work into the same graph (a fork and a join node); the side stream stays in that capture until it ends, so a
// call whose stream is not in that same capture does not fork (its halves then run one after the other on its own
// stream). A side stream is created outside a capture only (on the first call that may fork), never destroyed.
// Host code.
#pragma once

#include <cuda_runtime.h>

#include <mutex>

#include "core/status.hpp"

namespace flashattn::cuda {

class StreamFork {
 public:
  StreamFork() = default;
  StreamFork(const StreamFork&) = delete;
  StreamFork& operator=(const StreamFork&) = delete;
  ~StreamFork();  // joins if still forked (an error path): the caller's stream never runs ahead of the side stream

  // Forks `origin` on `device` (the current device): after it, work on stream() runs after everything enqueued on
  // `origin` so far. forked() is false, and nothing was enqueued, where this call may not fork (see above); the work
  // then goes on `origin` itself.
  Status fork(int device, cudaStream_t origin);
  bool forked() const { return lock_.owns_lock(); }
  // Where the side half goes: the side stream when forked, else the origin.
  cudaStream_t stream() const { return forked() ? side_ : origin_; }
  // The origin waits for everything enqueued on the side stream; releases the side stream. No-op when not forked.
  Status join();

 private:
  std::unique_lock<std::mutex> lock_;
  cudaStream_t origin_ = nullptr, side_ = nullptr;
  cudaEvent_t join_event_ = nullptr;
};

// Tests only: whether calls may fork at all (default true); false runs both halves on the caller's stream, one after
// the other, as before the fork existed. A process-wide switch.
void set_stream_fork_for_tests(bool enabled);

}  // namespace flashattn::cuda
