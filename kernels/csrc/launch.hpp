// Host-visible entry points of exchange.cu (compiled by nvcc; called from the C++ runtime).
#pragma once

#include <cuda_runtime.h>

#include "exchange.cuh"

namespace ltxk {

// Launches the exchange described by `p` with `vec`-byte vectors (16, 8, 4, 2 or 1) on `stream`.
cudaError_t launch_exchange(const Params& p, int vec, cudaStream_t stream);

// Forces the kernel images to load and reports the guaranteed co-resident blocks per SM.
cudaError_t exchange_blocks_per_sm(int* blocks_per_sm);

}  // namespace ltxk
