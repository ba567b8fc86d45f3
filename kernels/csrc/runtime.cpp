// Implementation of runtime.hpp. Every CUDA call is checked and reported with file:line and the error
// name; user mistakes are std::invalid_argument (ValueError in Python) raised before anything launches.
#include "runtime.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "launch.hpp"
#include "messages.hpp"

namespace ltxk {
namespace {

using detail::cat;
using detail::invalid;

[[noreturn]] void cuda_fail(cudaError_t err, const char* what, const char* file, int line) {
  throw std::runtime_error(cat("ltx_mgpu_kernels: ", what, " failed at ", file, ":", line, ": ",
                               cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

#define LTXK_CUDA(call)                                              \
  do {                                                               \
    const cudaError_t err_ = (call);                                 \
    if (err_ != cudaSuccess) cuda_fail(err_, #call, __FILE__, __LINE__); \
  } while (0)

// Makes `device` current for the extension's own (static) CUDA runtime, whose notion of "current device" is
// separate from torch's, so every entry point sets it explicitly. Not restored afterwards on purpose: in a
// thread where no context was current yet the "previous" device is the default 0, and since CUDA 12
// cudaSetDevice creates the primary context, so restoring it would give a rank on another GPU a context (and
// its memory) on GPU 0. (Where torch made the rank's device current first, both read the same device.)
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    int current = -1;
    LTXK_CUDA(cudaGetDevice(&current));
    if (current != device) LTXK_CUDA(cudaSetDevice(device));
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
};

int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

uint64_t timeout_to_ns(double timeout_s) {
  if (!std::isfinite(timeout_s) || timeout_s <= 0.0)
    invalid("all2all timeout must be a finite number of seconds > 0, got ", timeout_s);
  const double ns = timeout_s * 1e9;
  if (ns >= static_cast<double>(std::numeric_limits<uint64_t>::max() / 2))
    return std::numeric_limits<uint64_t>::max() / 2;
  return static_cast<uint64_t>(ns);
}

}  // namespace

// ==== runtime ===========================================================================================

Runtime::Runtime(int device, int rank, int world, int64_t capacity_bytes, int64_t itemsize, double timeout_s,
                 bool loopback)
    : device_(device), rank_(rank), world_(world), capacity_(capacity_bytes), itemsize_(itemsize),
      loopback_(loopback) {
  check_world(world);
  if (!loopback && (rank < 0 || rank >= world)) invalid("rank ", rank, " out of range for world size ", world);
  if (capacity_bytes <= 0) invalid("exchange buffer capacity must be > 0 bytes, got ", capacity_bytes);
  if (itemsize != 1 && itemsize != 2 && itemsize != 4) invalid("unsupported element size ", itemsize);
  if (device < 0) invalid("device index must be >= 0, got ", device);
  timeout_ns_ = timeout_to_ns(timeout_s);

  int count = 0;
  const cudaError_t cerr = cudaGetDeviceCount(&count);
  if (cerr != cudaSuccess || count == 0)
    throw std::runtime_error(cat("ltx_mgpu_kernels: no usable CUDA device (", cudaGetErrorName(cerr), ")"));
  if (device >= count) invalid("device index ", device, " but only ", count, " CUDA devices are visible");

  DeviceGuard guard(device_);
  LTXK_CUDA(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_));
  LTXK_CUDA(exchange_blocks_per_sm(&blocks_per_sm_));
  if (blocks_per_sm_ < 1) throw std::runtime_error("ltx_mgpu_kernels: exchange kernel cannot be resident");

  slot_bytes_ = kCtrlBytes + round_up(capacity_bytes, kAlign);
  const int slots = loopback ? world : 1;
  void* base = nullptr;
  LTXK_CUDA(cudaMalloc(&base, static_cast<size_t>(slot_bytes_) * slots));
  base_ = static_cast<uint8_t*>(base);
  void* local = nullptr;
  try {
    LTXK_CUDA(cudaMemset(base_, 0, static_cast<size_t>(slot_bytes_) * slots));
    LTXK_CUDA(cudaMalloc(&local, sizeof(LocalState)));
    local_ = static_cast<LocalState*>(local);
    LTXK_CUDA(cudaMemset(local_, 0, sizeof(LocalState)));
    void* host = nullptr;
    LTXK_CUDA(cudaHostAlloc(&host, sizeof(ErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable));
    err_host_ = static_cast<ErrorRecord*>(host);
    std::memset(err_host_, 0, sizeof(ErrorRecord));
    void* dev_alias = nullptr;
    LTXK_CUDA(cudaHostGetDevicePointer(&dev_alias, host, 0));
    err_dev_ = static_cast<ErrorRecord*>(dev_alias);
    // Zeroed signals must be globally visible before any peer can learn our handle.
    LTXK_CUDA(cudaDeviceSynchronize());
  } catch (...) {
    destroy();
    throw;
  }
  if (loopback) {
    for (int r = 0; r < world; ++r) {
      ctrl_[r] = reinterpret_cast<Ctrl*>(base_ + r * slot_bytes_);
      data_[r] = base_ + r * slot_bytes_ + kCtrlBytes;
    }
    set_loopback_blocks(std::max(world, (num_sms_ / world)));
  } else {
    ctrl_[rank] = reinterpret_cast<Ctrl*>(base_);
    data_[rank] = base_ + kCtrlBytes;
  }
}

Runtime::~Runtime() {
  try {
    destroy();
  } catch (...) {
    // Destructors must not throw; destroy() failures were already reported if called explicitly.
  }
}

std::string Runtime::ipc_handle() const {
  if (destroyed_) throw std::runtime_error("ltx_mgpu_kernels: instance was destroyed");
  if (loopback_) throw std::runtime_error("ltx_mgpu_kernels: a loopback instance has no IPC handle");
  DeviceGuard guard(device_);
  cudaIpcMemHandle_t h;
  LTXK_CUDA(cudaIpcGetMemHandle(&h, base_));
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

void Runtime::open_peers(const std::vector<std::string>& handles, int blocks_per_src) {
  if (destroyed_) throw std::runtime_error("ltx_mgpu_kernels: instance was destroyed");
  if (loopback_) throw std::runtime_error("ltx_mgpu_kernels: a loopback instance has no peers");
  if (ready_) throw std::runtime_error("ltx_mgpu_kernels: peers are already open");
  if (static_cast<int>(handles.size()) != world_)
    invalid("expected ", world_, " IPC handles, got ", handles.size());
  if (blocks_per_src < world_ || blocks_per_src > num_sms_ * blocks_per_sm_)
    invalid("blocks per rank must be in [", world_, ", ", num_sms_ * blocks_per_sm_, "], got ", blocks_per_src);
  for (const auto& h : handles)
    if (h.size() != sizeof(cudaIpcMemHandle_t))
      invalid("IPC handle of ", h.size(), " bytes, expected ", sizeof(cudaIpcMemHandle_t));
  if (handles[rank_] != ipc_handle()) invalid("handles[", rank_, "] is not this rank's own handle");
  DeviceGuard guard(device_);
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handles[r].data(), sizeof(h));
    void* ptr = nullptr;
    LTXK_CUDA(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess));
    opened_.push_back(ptr);
    ctrl_[r] = static_cast<Ctrl*>(ptr);
    data_[r] = static_cast<uint8_t*>(ptr) + kCtrlBytes;
  }
  blocks_per_src_ = blocks_per_src;
  ready_ = true;
}

void Runtime::set_loopback_blocks(int blocks_per_src) {
  if (!loopback_) throw std::runtime_error("ltx_mgpu_kernels: set_loopback_blocks is for loopback instances");
  // All W sources run in one grid whose blocks spin on each other: the whole grid must be co-resident.
  const int limit = num_sms_ * blocks_per_sm_ / world_;
  if (blocks_per_src < world_ || blocks_per_src > limit)
    invalid("loopback blocks per rank must be in [", world_, ", ", limit, "], got ", blocks_per_src);
  blocks_per_src_ = blocks_per_src;
  ready_ = true;
}

void Runtime::set_rank_tokens(const std::vector<int64_t>& counts) {
  if (static_cast<int>(counts.size()) != world_)
    invalid("set_rank_tokens expects ", world_, " counts (one per rank), got ", counts.size());
  for (int64_t c : counts)
    if (c < 0 || c >= (int64_t{1} << 31)) invalid("token counts must be in [0, 2^31), got ", c);
  counts_ = counts;
}

void Runtime::set_timeout(double timeout_s) { timeout_ns_ = timeout_to_ns(timeout_s); }

void Runtime::launch(int op, const std::vector<uintptr_t>& srcs, int64_t batch, const std::vector<int64_t>& seqs,
                     int64_t heads_in, int64_t head_dim, uintptr_t stream) {
  if (destroyed_) throw std::runtime_error("ltx_mgpu_kernels: instance was destroyed");
  if (!ready_) throw std::runtime_error("ltx_mgpu_kernels: peers are not open (handshake incomplete)");
  if (auto e = error_state()) {
    throw std::runtime_error(cat("ltx_mgpu_kernels: instance unusable: an earlier exchange timed out on rank ",
                                 std::get<0>(*e), " waiting for rank ", std::get<1>(*e)));
  }
  if (failed_launch_) throw std::runtime_error("ltx_mgpu_kernels: instance unusable after a failed launch");
  const int expected_srcs = loopback_ ? world_ : 1;
  if (static_cast<int>(srcs.size()) != expected_srcs)
    invalid("expected ", expected_srcs, " input pointers, got ", srcs.size());
  std::vector<int> ranks;
  for (int i = 0; i < expected_srcs; ++i) ranks.push_back(loopback_ ? i : rank_);
  Plan plan = make_plan(op, world_, counts_, ranks, batch, seqs, heads_in, head_dim, itemsize_, capacity_);
  Params& p = plan.params;
  for (int i = 0; i < expected_srcs; ++i) p.route[i].src = reinterpret_cast<const uint8_t*>(srcs[i]);
  for (int r = 0; r < world_; ++r) {
    p.data[r] = data_[r];
    p.ctrl[r] = ctrl_[r];
  }
  p.local = local_;
  p.err = err_dev_;
  p.blocks_per_src = blocks_per_src_;
  p.timeout_ns = timeout_ns_;
  const int vec = pick_vector_bytes(p, srcs);
  const int64_t vpc = p.chunk_bytes / vec;
  int tpr = 1;
  while (tpr * 2 <= vpc && tpr * 2 <= kThreads) tpr *= 2;
  p.threads_per_row = tpr;
  DeviceGuard guard(device_);
  const cudaError_t err = launch_exchange(p, vec, reinterpret_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) {
    failed_launch_ = true;
    cuda_fail(err, "exchange kernel launch", __FILE__, __LINE__);
  }
}

std::optional<std::tuple<int, int, int, uint32_t, uint32_t>> Runtime::error_state() const {
  const volatile ErrorRecord* e = err_host_ != nullptr ? err_host_ : &saved_err_;
  if (e->code == 0) return std::nullopt;
  return std::make_tuple(static_cast<int>(e->waiting_rank), static_cast<int>(e->missing_rank),
                         static_cast<int>(e->phase), static_cast<uint32_t>(e->seen),
                         static_cast<uint32_t>(e->expected));
}

uintptr_t Runtime::data_ptr(int rank) const {
  if (destroyed_) throw std::runtime_error("ltx_mgpu_kernels: instance was destroyed");
  if (rank < 0 || rank >= world_ || (!loopback_ && rank != rank_))
    invalid("data region of rank ", rank, " is not addressable here");
  return reinterpret_cast<uintptr_t>(data_[rank]);
}

void Runtime::destroy() {
  if (destroyed_) return;
  destroyed_ = true;
  ready_ = false;
  cudaSetDevice(device_);  // (left current, as DeviceGuard leaves it)
  // No kernel of ours may still be writing into mapped peers or reading our region.
  cudaDeviceSynchronize();
  for (void* ptr : opened_) cudaIpcCloseMemHandle(ptr);
  opened_.clear();
  if (base_ != nullptr) cudaFree(base_);
  if (local_ != nullptr) cudaFree(local_);
  if (err_host_ != nullptr) {
    // Keep error_state() answering after destroy: copy the record before the pinned page goes away.
    const volatile ErrorRecord* e = err_host_;
    saved_err_.code = e->code;
    saved_err_.waiting_rank = e->waiting_rank;
    saved_err_.missing_rank = e->missing_rank;
    saved_err_.phase = e->phase;
    saved_err_.seen = e->seen;
    saved_err_.expected = e->expected;
    cudaFreeHost(err_host_);
  }
  base_ = nullptr;
  local_ = nullptr;
  err_host_ = nullptr;
  err_dev_ = nullptr;
  for (int r = 0; r < kMaxRanks; ++r) {
    data_[r] = nullptr;
    ctrl_[r] = nullptr;
  }
}

}  // namespace ltxk
