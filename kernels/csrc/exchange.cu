// The head-exchange kernel: one launch moves this rank's chunks into every peer's data region, with an
// entry handshake and an exit barrier (see exchange.cuh for layout and protocol).
//
// Block b of source s targets rank b % world (SM i -> rank i % world); its index among the blocks that
// target the same rank is b / world. Inside a block, `threads_per_row` threads cover one row's chunk with
// VEC-byte vectors and kThreads / threads_per_row rows are in flight at once, kUnroll times over.
#include <cuda_runtime.h>

#include <cstdint>

#include "exchange.cuh"
#include "launch.hpp"

namespace ltxk {
namespace {

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_relaxed_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void red_add_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int32_t ld_volatile(const int32_t* p) {
  return *reinterpret_cast<const volatile int32_t*>(p);
}

// ---- vector loads (read-only, no L1 allocation) and stores (no L1 allocation) -------------------------
template <int VEC>
struct Vec;
template <>
struct Vec<16> {
  using T = int4;
  static __device__ __forceinline__ T load(const uint8_t* p) {
    T v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
  }
  static __device__ __forceinline__ void store(uint8_t* p, const T& v) {
    asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w)
                 : "memory");
  }
};
template <typename U>
struct ScalarVec {
  using T = U;
  static __device__ __forceinline__ T load(const uint8_t* p) { return __ldg(reinterpret_cast<const U*>(p)); }
  static __device__ __forceinline__ void store(uint8_t* p, const T& v) { *reinterpret_cast<U*>(p) = v; }
};
template <>
struct Vec<8> : ScalarVec<unsigned long long> {};
template <>
struct Vec<4> : ScalarVec<unsigned int> {};
template <>
struct Vec<2> : ScalarVec<unsigned short> {};
template <>
struct Vec<1> : ScalarVec<unsigned char> {};

// Spin until *counter reaches `target` (wrap-safe), the instance aborts, or the deadline passes.
// Returns true when reached. On timeout, the first waiter of the process records who was missing.
__device__ bool wait_reach(const Params& p, const uint32_t* counter, uint32_t target, uint64_t deadline,
                           int me, int peer, int phase) {
  while (true) {
    const uint32_t seen = ld_acquire_sys(counter);
    if (static_cast<int32_t>(seen - target) >= 0) return true;
    if (ld_volatile(&p.local->abort) != 0) return false;
    if (global_ns() > deadline) {
      if (atomicCAS(&p.local->claim, 0, 1) == 0) {
        volatile ErrorRecord* e = p.err;
        e->waiting_rank = me;
        e->missing_rank = peer;
        e->phase = phase;
        e->seen = seen;
        e->expected = target;
        __threadfence_system();
        e->code = 1;
        __threadfence_system();
      }
      atomicExch(&p.local->abort, 1);
      return false;
    }
    __nanosleep(64);
  }
}

template <int VEC>
__global__ void __launch_bounds__(kThreads, 2) exchange_kernel(const __grid_constant__ Params p) {
  using V = Vec<VEC>;
  const Route& r = p.route[blockIdx.y];
  const int me = r.rank;
  const int w = p.world;
  const int t = static_cast<int>(blockIdx.x) % w;
  const int j = static_cast<int>(blockIdx.x) / w;
  const int nb_t = (p.blocks_per_src - t + w - 1) / w;  // blocks of each source that target t
  Ctrl* my = p.ctrl[me];

  __shared__ int s_ok;
  __shared__ uint32_t s_epoch;
  __shared__ uint64_t s_deadline;
  uint32_t epoch = 0;
  uint64_t deadline = 0;
  bool alive = true;
  if (threadIdx.x == 0) {
    deadline = global_ns() + p.timeout_ns;
    epoch = *reinterpret_cast<volatile uint32_t*>(&my->epoch);
    alive = ld_volatile(&p.local->abort) == 0;
    // Entry, part 1: the first block for each target announces "me entered exchange epoch+1" to it.
    // Relaxed is enough: what the target must not overwrite was read by kernels that completed before.
    if (alive && j == 0) st_relaxed_sys(&p.ctrl[t]->entry[me], epoch + 1);
  }

  // This block's share: rows base, base + stride, ... of target t's B * n rows; tpr threads per row.
  const uint32_t n = static_cast<uint32_t>(r.n_rows[t]);
  const uint32_t rows_total = static_cast<uint32_t>(p.batch) * n;
  const uint32_t tpr = static_cast<uint32_t>(p.threads_per_row);
  const uint32_t rpi = kThreads / tpr;  // rows in flight per block per step
  const uint32_t sub = threadIdx.x & (tpr - 1);
  const uint32_t rsub = threadIdx.x / tpr;
  const uint32_t vpc = static_cast<uint32_t>(p.chunk_bytes / VEC);
  const uint32_t stride = static_cast<uint32_t>(nb_t) * rpi;
  const uint32_t base0 = static_cast<uint32_t>(j) * rpi + rsub;
  const uint8_t* src = r.src;
  uint8_t* dst = p.data[t];
  const int64_t src_row0 = r.src_row0[t];
  const int64_t src_col0 = r.src_col0[t];
  const int64_t dst_rows = r.dst_rows[t];
  const bool single_batch = p.batch == 1;
  const uint8_t* sp[kUnroll];
  uint8_t* dp[kUnroll];
  bool valid[kUnroll];
  auto locate = [&](uint32_t base) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t row = base + static_cast<uint32_t>(u) * stride;
      valid[u] = row < rows_total;
      const uint32_t b = (single_batch || !valid[u]) ? 0 : row / n;  // no division in the common B == 1
      const uint32_t i = row - b * n;
      sp[u] = src + (static_cast<int64_t>(b) * r.src_rows + src_row0 + i) * p.src_stride + src_col0;
      dp[u] = dst + (static_cast<int64_t>(b) * dst_rows + r.dst_row0 + i) * p.dst_stride + r.dst_col0;
    }
  };

  // Prefetch the first group: reading our own input is always safe, only the stores to the target need
  // its entry. The loads stay in flight while thread 0 waits for the handshake below.
  typename V::T v[kUnroll];
  locate(base0);
  if (sub < vpc) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (valid[u]) v[u] = V::load(sp[u] + static_cast<int64_t>(sub) * VEC);
  }

  // Entry, part 2: wait until the target announced the same exchange in our Ctrl before writing to it.
  if (threadIdx.x == 0) {
    const bool ok = alive && wait_reach(p, &my->entry[t], epoch + 1, deadline, me, t, kPhaseEntry);
    s_ok = ok ? 1 : 0;
    s_epoch = epoch;
    s_deadline = deadline;
  }
  __syncthreads();
  const bool ok = s_ok != 0;

  if (ok) {
    bool prefetched = true;  // v[] holds (base0, sub)
    for (uint32_t base = base0; base < rows_total; base += stride * kUnroll) {
      if (base != base0) locate(base);
      for (uint32_t k = sub; k < vpc; k += tpr) {
        if (!prefetched) {
#pragma unroll
          for (int u = 0; u < kUnroll; ++u)
            if (valid[u]) v[u] = V::load(sp[u] + static_cast<int64_t>(k) * VEC);
        }
        prefetched = false;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (valid[u]) V::store(dp[u] + static_cast<int64_t>(k) * VEC, v[u]);
      }
    }
    // After this: every store of this block to target t is issued; publish them with one release.
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();
      red_add_release_sys(&p.ctrl[t]->arrive[me], 1u);
    }
  }

  // Exit barrier: block 0 of each source waits for all blocks of all sources that target `me`.
  if (blockIdx.x == 0 && ok && threadIdx.x < static_cast<unsigned>(w)) {
    const uint32_t n_me = static_cast<uint32_t>((p.blocks_per_src - me + w - 1) / w);
    const uint32_t expected = my->arrive_base[threadIdx.x] + n_me;
    if (wait_reach(p, &my->arrive[threadIdx.x], expected, s_deadline, me, static_cast<int>(threadIdx.x),
                   kPhaseExit))
      my->arrive_base[threadIdx.x] = expected;  // read by the next launch only (kernel boundary orders it)
  }

  // Epoch bookkeeping: the last block of this source to finish advances the epoch for the next launch.
  // Every block read the epoch before incrementing `done`, so nobody of this launch sees the new value.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t old = atomicAdd(&my->done, 1u);
    if (old == static_cast<uint32_t>(p.blocks_per_src) - 1u) {
      __threadfence();
      my->done = 0;
      my->epoch = s_epoch + 1u;
      __threadfence();
    }
  }
}

template <int VEC>
cudaError_t launch_vec(const Params& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.blocks_per_src), static_cast<unsigned>(p.num_src));
  exchange_kernel<VEC><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_exchange(const Params& p, int vec, cudaStream_t stream) {
  switch (vec) {
    case 16: return launch_vec<16>(p, stream);
    case 8: return launch_vec<8>(p, stream);
    case 4: return launch_vec<4>(p, stream);
    case 2: return launch_vec<2>(p, stream);
    case 1: return launch_vec<1>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t exchange_blocks_per_sm(int* blocks_per_sm) {
  // Loads every instantiation now (not lazily at first launch, which could fall inside graph capture)
  // and returns the smallest occupancy among them.
  const void* fns[] = {reinterpret_cast<const void*>(exchange_kernel<16>),
                       reinterpret_cast<const void*>(exchange_kernel<8>),
                       reinterpret_cast<const void*>(exchange_kernel<4>),
                       reinterpret_cast<const void*>(exchange_kernel<2>),
                       reinterpret_cast<const void*>(exchange_kernel<1>)};
  int best = 1 << 30;
  for (const void* fn : fns) {
    cudaFuncAttributes attr;
    cudaError_t err = cudaFuncGetAttributes(&attr, fn);
    if (err != cudaSuccess) return err;
    int n = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, kThreads, 0);
    if (err != cudaSuccess) return err;
    best = n < best ? n : best;
  }
  *blocks_per_sm = best;
  return cudaSuccess;
}

}  // namespace ltxk
