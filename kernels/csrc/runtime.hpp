// Host runtime of one exchange instance: owns the IPC-shareable allocation, the peer mappings, the
// host-mapped error record, and turns (op, shapes, token counts) into one kernel launch.
//
// It knows nothing about torch: callers pass raw device pointers and the cudaStream_t as integers, so the
// extension builds and imports where torch is a CPU build. The Python wrapper (ltx_mgpu_kernels) does the
// process-group handshake and tensor validation; this class re-checks everything it relies on.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "exchange.cuh"

namespace ltxk {

// Throws std::invalid_argument unless 1 <= world <= kMaxRanks.
void check_world(int world);

// Everything one launch needs besides device pointers; computed on the host, testable without a GPU.
struct Plan {
  Params params{};           // routes, strides, chunk size (pointers filled by the runtime)
  int64_t out_bytes_max = 0;  // largest output any target receives (capacity check)
};

// Pure host computation of an exchange's routes. `src_ranks` are the ranks whose inputs this launch
// moves (one for a real rank, all of them in loopback mode). `seqs` (one per source) and `heads_in` are
// the inputs' dims 1 and 2. Throws std::invalid_argument with a user-facing message on any inconsistency.
Plan make_plan(int op, int world, const std::vector<int64_t>& counts, const std::vector<int>& src_ranks,
               int64_t batch, const std::vector<int64_t>& seqs, int64_t heads_in, int64_t head_dim, int64_t itemsize,
               int64_t capacity_bytes);

// Largest vector width (16, 8, 4, 2, 1) that divides every byte offset the launch uses.
int pick_vector_bytes(const Params& p, const std::vector<uintptr_t>& srcs);

class Runtime {
 public:
  // loopback=false: this process is rank `rank` of `world`; the allocation is exported for IPC and the
  //   peers' allocations are mapped by open_peers().
  // loopback=true: this process owns all `world` ranks' regions on one device (measurement mode).
  Runtime(int device, int rank, int world, int64_t capacity_bytes, int64_t itemsize, double timeout_s,
          bool loopback);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  std::string ipc_handle() const;  // 64 opaque bytes (CUDA_IPC_HANDLE_SIZE)
  // Maps every peer's handle (handles[rank] must be our own) and fixes the grid (identical on all ranks).
  void open_peers(const std::vector<std::string>& handles, int blocks_per_src);
  void set_loopback_blocks(int blocks_per_src);
  void set_rank_tokens(const std::vector<int64_t>& counts);
  void set_timeout(double timeout_s);
  // Enqueues one exchange on `stream`. srcs: one pointer (real rank) or `world` pointers (loopback).
  void launch(int op, const std::vector<uintptr_t>& srcs, int64_t batch, const std::vector<int64_t>& seqs,
              int64_t heads_in,
              int64_t head_dim, uintptr_t stream);
  // (waiting_rank, missing_rank, phase, seen, expected) once a barrier timed out; never clears.
  std::optional<std::tuple<int, int, int, uint32_t, uint32_t>> error_state() const;
  void destroy();  // idempotent; synchronises the device first

  uintptr_t data_ptr(int rank) const;
  int device() const { return device_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  int num_sms() const { return num_sms_; }
  int blocks_per_sm() const { return blocks_per_sm_; }
  int blocks_per_src() const { return blocks_per_src_; }
  int64_t capacity_bytes() const { return capacity_; }
  bool destroyed() const { return destroyed_; }
  bool ready() const { return ready_; }
  const std::vector<int64_t>& counts() const { return counts_; }

 private:
  int device_;
  int rank_;
  int world_;
  int64_t capacity_;
  int64_t itemsize_;
  bool loopback_;
  uint64_t timeout_ns_ = 0;
  int num_sms_ = 0;
  int blocks_per_sm_ = 0;
  int blocks_per_src_ = 0;
  int64_t slot_bytes_ = 0;
  uint8_t* base_ = nullptr;               // our allocation (one slot, or `world` slots in loopback)
  LocalState* local_ = nullptr;
  ErrorRecord* err_host_ = nullptr;
  ErrorRecord* err_dev_ = nullptr;
  std::vector<void*> opened_;             // peer mappings to close
  uint8_t* data_[kMaxRanks] = {};
  Ctrl* ctrl_[kMaxRanks] = {};
  std::vector<int64_t> counts_;
  bool ready_ = false;
  bool destroyed_ = false;
  bool failed_launch_ = false;
  ErrorRecord saved_err_{};  // the error record, kept after destroy() frees the pinned page
};

}  // namespace ltxk
