// A second stream for the two independent halves of one call: a paged varlen forward's routed short sequences (the
// memory-bound decode kernels, src/cuda/decode/kvcache.cpp) beside its forward kernel over the longer ones
// (src/cuda/backend.cpp). The call forks after its allocations on the caller's stream and joins before its frees:
//   caller's stream:  [allocations] -- record `fork` -----------------[the forward kernel]-- wait `join` -- [frees]
//   side stream:                        wait `fork` -- [decode half] -- record `join`
// so everything before the call on the caller's stream precedes both halves, and everything after follows both (as if
// the call had run on the caller's stream alone). One side stream per device, at the device's greatest priority: where
// CTAs of both halves wait for room, the block scheduler places the decode half's first, and the forward's fill the
// SMs' room beside them (the decode CTAs stream K/V while the forward's compute). Affects speed only. On by default
// (kStreamForkByDefault below).
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

// On by default since its first GPU run (H100 80GB HBM3, 2026-12-07 04:51-04:55 UTC, flashattn step --fork, the fork on
// and off alternating in one process, with the routed call over the forward's own rows;
// bench/results/2026-12-07-0451-h100-step-in-place-rows-fork.txt): the mixed step per pipelined step, fork off -> on,
// 16 decodes at 8k + a chunk of 128 285.8 -> 229.1 us, 8 at 1k + a chunk of 128 68.9 -> 57.5, 64 at 4k + 2 chunks of
// 512 436.6 -> 425.6, 4 at 16k + 2 chunks of 64 251.8 -> 247.3, 256 at 4k + 4 chunks of 256 1586.9 -> 1558.1
// (synchronised steps 0.76-0.98x). Its tests passed there (CudaForward.VarlenPagedShortSequencesBesideTheForward,
// ...InACudaGraph forked, ...InPlaceMatchTheCopies forked).
constexpr bool kStreamForkByDefault = true;

// The user's switch: the environment variable FLASHATTN_STREAM_FORK, read once per process. "0": every call keeps both
// halves on the caller's stream, one after the other (no side stream is made); "1" or unset: kStreamForkByDefault.
// Another value: the calls that would fork fail with FA_ERROR_INVALID_ARGUMENT naming it (stream_fork_setting), before
// they allocate or launch anything.
constexpr const char* kStreamForkVariable = "FLASHATTN_STREAM_FORK";
// A value of it (null: unset) into *enabled; false for a value that is neither "0" nor "1" (*enabled untouched).
bool parse_stream_fork_setting(const char* value, bool* enabled);
// OK, or the error for a bad value of the variable (none once set_stream_fork_enabled has been called).
Status stream_fork_setting();

// Tests and measurements: whether calls may fork at all, overriding the environment (default: its setting); false
// runs both halves on the caller's stream, one after the other. A process-wide switch.
void set_stream_fork_enabled(bool enabled);
// Drops that override: the environment's setting (and its error for a bad value) applies again.
void clear_stream_fork_override();
bool stream_fork_enabled();
// Tests: how many forks the process has made (that a test's call did fork).
int64_t stream_forks_made();

}  // namespace flashattn::cuda
