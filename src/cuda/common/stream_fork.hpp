// A second stream for the two independent halves of one call: a paged varlen forward's routed short sequences (the
// memory-bound decode kernels, src/cuda/decode/kvcache.cpp) beside its forward kernel over the longer ones
// (src/cuda/backend.cpp). The call forks after its allocations on the caller's stream and joins before its frees:
//   caller's stream:  [allocations] -- record `fork` -----------------[the forward kernel]-- wait `join` -- [frees]
//   side stream:                        wait `fork` -- [decode half] -- record `join`
// so everything before the call on the caller's stream precedes both halves, and everything after follows both (as if
// the call had run on the caller's stream alone). One side stream per device, at the device's greatest priority: where
// CTAs of both halves wait for room, the block scheduler places the decode half's first, and the forward's fill the
// SMs' room beside them (the decode CTAs stream K/V while the forward's compute). Affects speed only. Off by default
// for now (kStreamForkByDefault below).
//
// Thread safety: a fork holds its device's side stream (a mutex) until it joins, so calls from several threads take
// turns on it. CUDA graph capture: the fork and the join are events, so a capture of the caller's stream takes the side
// stream's work into the same graph (a fork and a join node); the side stream stays in that capture until it ends, so a
// call whose stream is not in that same capture does not fork (its halves then run one after the other on its own
// stream). A side stream is created outside a capture only (on the first call that may fork), never destroyed.
// Host code.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
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

// Off by default until it has run on a GPU: built in session 58 (2026-12-07), when no GPU machine could be had after the
// first run. What that run measured with `flashattn step`'s concurrent mode (the same fork, in the tool: the decode
// call on a second stream beside the prefills' forward; H100 80GB HBM3, 01:04 UTC,
// bench/results/2026-12-07-0104-h100-step-routed-plan-concurrent.txt): 16 decodes over 8k beside a chunk of 128 over
// 8k 277-280 -> 224-233 us per synchronised step, but 278-280 -> 271-276 pipelined (steps queued back to back, where
// both halves become ready together and which one's CTAs go first is left to the scheduler: hence the side stream's
// priority above); 64 decodes over 4k beside 2 chunks of 512 419-422 -> 406-413 (pipelined 411-412 -> 398-400).
// To do: the GPU tests (CudaForward.VarlenPagedShortSequencesBesideTheForward, ...InACudaGraph) and `flashattn step`
// with it on, then on by default.
constexpr bool kStreamForkByDefault = false;

// Tests and measurements: whether calls may fork at all (default kStreamForkByDefault); false runs both halves on the
// caller's stream, one after the other. A process-wide switch.
void set_stream_fork_enabled(bool enabled);
bool stream_fork_enabled();
// Tests: how many forks the process has made (that a test's call did fork).
int64_t stream_forks_made();

}  // namespace flashattn::cuda
