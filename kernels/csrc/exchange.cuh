// ltx-mgpu kernels: the head-exchange kernel's parameter block and shared-memory layout.
//
// Every rank owns ONE allocation (cudaMalloc, exported with cudaIpcGetMemHandle) laid out as
//
//   offset 0            kCtrlBytes                                   kCtrlBytes + capacity
//   +-------------------+--------------------------------------------+
//   | Ctrl (signals)    | data region: the rank's exchange OUTPUT    |
//   +-------------------+--------------------------------------------+
//
// Ctrl is written by peers (entry[], arrive[]) and by the owner (epoch, done). The data region is written
// only by the exchange kernels of every rank (including the owner) and read only by the owner's stream
// work that follows the exchange (copy-out or a zero-copy view).
//
// Output layouts inside the data region (B = batch, T = total tokens, c[r] = tokens of rank r,
// H = heads, hh = H / world, D = head dim; row-major, one "chunk" = hh*D elements):
//   send_recv_heads : (B, T,    hh, D)  rank s writes its tokens at rows [off[s], off[s] + c[s])
//   gather_heads    : (B, c[r], H,  D)  rank s writes head slot s (columns [s*hh, (s+1)*hh))
//   all_gather_heads: (B, S,    H,  D)  rank s writes head slot s for all S rows
// All three are the same copy with different per-target row/column offsets (see Route).
//
// Synchronisation (docs/kernels.md has the full argument):
//   entry handshake: at kernel start every rank publishes "I entered exchange n" into each peer's
//     entry[me]; a block writes into peer t only after it has seen entry[t] >= n in its OWN Ctrl. Since a
//     rank's exchange n starts only after all its earlier stream work (the copy-out / consumers of
//     exchange n-1), nobody overwrites data a slow rank is still reading (no write-after-read race).
//   exit barrier: every block adds 1 to the target's arrive[me] after its stores (release, system
//     scope); block 0 of each source waits until arrive[s] has grown by the number of blocks s aims at
//     this rank (arrive_base[s] remembers the last value consumed). When the kernel completes, the rank's
//     data region holds the complete output. No early arrivals of the next exchange can be miscounted:
//     they need this rank's next entry, which comes only after this kernel ends.
//   Counters are monotonic (wrap-safe 32-bit compares) and epoch lives in device memory, so the kernel
//   is correct under CUDA-graph replay (no host-side sequence number is baked into the launch).
//   Timeouts use %globaltimer (wall-clock ns). A timeout never traps: it records the missing rank in
//   host-mapped memory, raises the instance's abort flag and lets every block return.
#pragma once

#include <cstdint>

namespace ltxk {

constexpr int kMaxRanks = 8;           // peers addressable by one instance (8-GPU NVLink islands)
constexpr int kThreads = 512;          // threads per block
constexpr int kUnroll = 4;             // independent 16-byte loads in flight per thread
constexpr int64_t kCtrlBytes = 4096;   // control region at the front of every rank's allocation
constexpr int64_t kAlign = 256;        // data regions and slots are 256-byte aligned

enum Op : int { kSendRecvHeads = 0, kGatherHeads = 1, kAllGatherHeads = 2 };
enum Phase : int { kPhaseEntry = 1, kPhaseExit = 2 };

// Written by peers and the owner; lives at the front of each rank's IPC allocation. Zeroed once.
struct Ctrl {
  uint32_t entry[kMaxRanks];   // entry[s]: number of the exchange rank s has entered (written by s)
  uint32_t arrive[kMaxRanks];  // arrive[s]: monotonic count of s's blocks that finished writing here
  uint32_t arrive_base[kMaxRanks];  // arrive[s] value already consumed by earlier exchanges (owner only),
                                    // so the grid size may change between launches (loopback sweeps)
  uint32_t epoch;              // exchanges this rank completed on this instance (owner only)
  uint32_t done;               // blocks of the running launch that finished (owner only; self-resetting)
};

// Per-process state of one instance (plain device memory, never shared).
struct LocalState {
  int32_t abort;  // 1 once any wait of this instance timed out: every later wait/launch gives up at once
  int32_t claim;  // first timeout claims the right to write the ErrorRecord
};

// Host-mapped (cudaHostAllocMapped): the host reads it without synchronising the device.
struct ErrorRecord {
  int32_t code;          // 0 = healthy, 1 = barrier timeout
  int32_t waiting_rank;  // the rank whose wait timed out
  int32_t missing_rank;  // the peer it waited for
  int32_t phase;         // kPhaseEntry or kPhaseExit
  uint32_t seen;         // counter value observed
  uint32_t expected;     // counter value waited for
};

// What one source rank sends in one exchange. Row = one token of one batch element.
struct Route {
  const uint8_t* src;             // the source tensor (B, src_rows, ., .), contiguous
  int32_t rank;                   // the source rank's id
  int32_t pad_;
  int64_t src_rows;               // rows per batch element in the source
  int64_t dst_row0;               // first destination row written by this source (all targets)
  int64_t dst_col0;               // byte offset inside a destination row (all targets)
  int32_t n_rows[kMaxRanks];      // rows sent to each target (per batch element)
  int32_t src_row0[kMaxRanks];    // first source row sent to each target
  int64_t src_col0[kMaxRanks];    // byte offset inside a source row for each target
  int64_t dst_rows[kMaxRanks];    // rows per batch element of each target's output
};

// The whole launch, passed by value (__grid_constant__): no device-side tables, no host sync per call.
struct Params {
  uint8_t* data[kMaxRanks];       // each rank's data region as addressable from this process
  Ctrl* ctrl[kMaxRanks];          // each rank's control region as addressable from this process
  LocalState* local;
  ErrorRecord* err;               // device alias of the host-mapped error record
  int32_t world;
  int32_t num_src;                // 1 for a real rank; W in loopback mode (blockIdx.y = source)
  int32_t blocks_per_src;         // grid.x; block b targets rank b % world (identical on every rank)
  int32_t batch;
  int32_t threads_per_row;        // power of two <= min(vectors per chunk, kThreads)
  int32_t pad_;
  int64_t chunk_bytes;            // bytes each source sends per row to one target (hh*D*itemsize)
  int64_t src_stride;             // bytes per source row
  int64_t dst_stride;             // bytes per destination row
  uint64_t timeout_ns;
  Route route[kMaxRanks];         // route[blockIdx.y]
};

}  // namespace ltxk
