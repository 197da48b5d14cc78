// The side streams of StreamFork (stream_fork.hpp), one per device, created on first use and kept for the process.
#include "cuda/common/stream_fork.hpp"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda/common/check.hpp"

namespace flashattn::cuda {
namespace {

constexpr int kMaxDevices = 64;  // devices beyond it never fork

struct SideStream {
  std::mutex mutex;  // held from a fork to its join
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;  // reused by every fork: each wait is enqueued right after its record
};

SideStream& side_of(int device) {
  static SideStream sides[kMaxDevices];  // (never destroyed: the CUDA context may be gone at exit)
  return sides[device];
}

std::atomic<int> g_fork_override{-1};  // set_stream_fork_enabled: 0 or 1; -1: the environment's setting
std::atomic<int64_t> g_forks_made{0};

// FLASHATTN_STREAM_FORK as read at first use.
struct EnvironmentSetting {
  bool valid = true;
  bool enabled = kStreamForkByDefault;
  std::string value;  // as given (for the message)
};
const EnvironmentSetting& environment_setting() {
  static const EnvironmentSetting setting = [] {
    EnvironmentSetting s;
    const char* value = std::getenv(kStreamForkVariable);
    if (value != nullptr) s.value = value;
    s.valid = parse_stream_fork_setting(value, &s.enabled);
    return s;
  }();
  return setting;
}

struct Capture {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
};
cudaError_t capture_of(cudaStream_t stream, Capture* c) { return cudaStreamGetCaptureInfo(stream, &c->status, &c->id); }

}  // namespace

bool parse_stream_fork_setting(const char* value, bool* enabled) {
  if (value == nullptr) {
    *enabled = kStreamForkByDefault;
    return true;
  }
  if (std::strcmp(value, "0") != 0 && std::strcmp(value, "1") != 0) return false;
  *enabled = value[0] == '1';
  return true;
}

Status stream_fork_setting() {
  if (g_fork_override.load(std::memory_order_relaxed) >= 0) return Status();
  const EnvironmentSetting& s = environment_setting();
  if (s.valid) return Status();
  return error(FA_ERROR_INVALID_ARGUMENT,
               "%s: must be 0 (the paged varlen forward's decode half on the caller's stream) or 1 (beside the forward "
               "kernel on a side stream, the default), got '%s'",
               kStreamForkVariable, s.value.c_str());
}

void set_stream_fork_enabled(bool enabled) { g_fork_override.store(enabled ? 1 : 0, std::memory_order_relaxed); }
void clear_stream_fork_override() { g_fork_override.store(-1, std::memory_order_relaxed); }
bool stream_fork_enabled() {
  const int override_value = g_fork_override.load(std::memory_order_relaxed);
  if (override_value >= 0) return override_value == 1;
  const EnvironmentSetting& s = environment_setting();
  return s.valid && s.enabled;
}
int64_t stream_forks_made() { return g_forks_made.load(std::memory_order_relaxed); }

Status StreamFork::fork(int device, cudaStream_t origin) {
  origin_ = origin;
  if (forked() || device < 0 || device >= kMaxDevices || !stream_fork_enabled()) return Status();
  SideStream& side = side_of(device);
  std::unique_lock<std::mutex> lock(side.mutex);
  Capture origin_capture;
  FA_CUDA_RETURN_IF_ERROR(capture_of(origin, &origin_capture));
  if (origin_capture.status == cudaStreamCaptureStatusInvalidated) return Status();  // the capture fails anyway
  if (side.stream == nullptr) {
    if (origin_capture.status != cudaStreamCaptureStatusNone) return Status();  // create outside captures only
    int least = 0, greatest = 0;
    FA_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    cudaStream_t stream = nullptr;
    cudaEvent_t fork_event = nullptr, join_event = nullptr;
    cudaError_t made = cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest);
    if (made == cudaSuccess) made = cudaEventCreateWithFlags(&fork_event, cudaEventDisableTiming);
    if (made == cudaSuccess) made = cudaEventCreateWithFlags(&join_event, cudaEventDisableTiming);
    if (made != cudaSuccess) {
      if (join_event != nullptr) cudaEventDestroy(join_event);
      if (fork_event != nullptr) cudaEventDestroy(fork_event);
      if (stream != nullptr) cudaStreamDestroy(stream);
      FA_CUDA_RETURN_IF_ERROR(made);
    }
    side.stream = stream;
    side.fork = fork_event;
    side.join = join_event;
  }
  // A side stream that joined a capture stays in it until that capture ends: then fork only from the same capture.
  // An uncaptured side stream forks from anywhere (from a capturing origin it joins that capture at the fork).
  Capture side_capture;
  FA_CUDA_RETURN_IF_ERROR(capture_of(side.stream, &side_capture));
  const bool side_captured = side_capture.status != cudaStreamCaptureStatusNone;
  const bool origin_captured = origin_capture.status != cudaStreamCaptureStatusNone;
  if (side_captured && (!origin_captured || side_capture.id != origin_capture.id)) return Status();
  FA_CUDA_RETURN_IF_ERROR(cudaEventRecord(side.fork, origin));
  FA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side.stream, side.fork, 0));
  side_ = side.stream;
  join_event_ = side.join;
  lock_ = std::move(lock);
  g_forks_made.fetch_add(1, std::memory_order_relaxed);
  return Status();
}

Status StreamFork::join() {
  if (!forked()) return Status();
  const cudaError_t recorded = cudaEventRecord(join_event_, side_);
  const cudaError_t waited = recorded == cudaSuccess ? cudaStreamWaitEvent(origin_, join_event_, 0) : recorded;
  lock_.unlock();
  FA_CUDA_RETURN_IF_ERROR(waited);
  return Status();
}

StreamFork::~StreamFork() {
  if (forked()) (void)join();
}

}  // namespace flashattn::cuda
