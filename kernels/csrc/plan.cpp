// make_plan / pick_vector_bytes: the pure host computation of one exchange's routes (runtime.hpp).
// No CUDA calls here, so CPU tests replay it exactly (tests/test_kernels_host.py).
#include <algorithm>
#include <vector>

#include "messages.hpp"
#include "runtime.hpp"

namespace ltxk {

using detail::invalid;

// ==== planning (pure host code) =========================================================================

void check_world(int world) {
  if (world < 1 || world > kMaxRanks)
    invalid("the ipc all2all supports 1..", kMaxRanks, " ranks per instance, got world size ", world,
            "; use the dist backend for larger groups");
}

Plan make_plan(int op, int world, const std::vector<int64_t>& counts, const std::vector<int>& src_ranks,
               int64_t batch, const std::vector<int64_t>& seqs, int64_t heads_in, int64_t head_dim, int64_t itemsize,
               int64_t capacity_bytes) {
  check_world(world);
  if (op != kSendRecvHeads && op != kGatherHeads && op != kAllGatherHeads) invalid("unknown op ", op);
  if (src_ranks.empty() || static_cast<int>(src_ranks.size()) > world)
    invalid("expected 1..", world, " source ranks, got ", src_ranks.size());
  if (seqs.size() != src_ranks.size()) invalid("expected one sequence length per source rank");
  for (int64_t seq : seqs)
    if (batch < 0 || seq < 0 || heads_in < 1 || head_dim < 1)
      invalid("invalid input shape (B=", batch, ", S=", seq, ", H=", heads_in, ", D=", head_dim, ")");
  if (itemsize != 1 && itemsize != 2 && itemsize != 4) invalid("unsupported element size ", itemsize);
  const bool needs_counts = op != kAllGatherHeads;
  if (needs_counts && static_cast<int>(counts.size()) != world)
    invalid("token counts are not set for this world size (", world,
            "): call set_rank_tokens(counts) with one count per rank before exchanging");
  int64_t total = 0;
  std::vector<int64_t> offsets(world, 0);
  if (needs_counts) {
    for (int r = 0; r < world; ++r) {
      offsets[r] = total;
      total += counts[r];
    }
  }

  int64_t heads = 0;  // full head count H
  int64_t hh = 0;     // heads per rank
  if (op == kSendRecvHeads) {
    heads = heads_in;
    if (heads % world != 0)
      invalid("send_recv_heads: heads (", heads, ") must be divisible by world size (", world, ")");
    hh = heads / world;
  } else {
    hh = heads_in;
    heads = hh * world;
  }
  const int64_t chunk = hh * head_dim * itemsize;
  const int64_t row_full = heads * head_dim * itemsize;

  Plan plan;
  Params& p = plan.params;
  p.world = world;
  p.num_src = static_cast<int32_t>(src_ranks.size());
  p.batch = static_cast<int32_t>(batch);
  p.chunk_bytes = chunk;

  int64_t max_rows_out = 0;  // rows per batch element of the largest target output
  for (int i = 0; i < p.num_src; ++i) {
    const int s = src_ranks[i];
    if (s < 0 || s >= world) invalid("source rank ", s, " out of range for world size ", world);
    Route& r = p.route[i];
    r.rank = s;
    const int64_t seq = seqs[i];
    if (op == kSendRecvHeads) {
      if (seq != counts[s])
        invalid("send_recv_heads: rank ", s, " input has ", seq, " tokens but set_rank_tokens gave it ",
                counts[s]);
      r.src_rows = seq;
      r.dst_row0 = offsets[s];
      r.dst_col0 = 0;
      for (int t = 0; t < world; ++t) {
        r.n_rows[t] = static_cast<int32_t>(seq);
        r.src_row0[t] = 0;
        r.src_col0[t] = t * chunk;
        r.dst_rows[t] = total;
      }
      max_rows_out = total;
    } else if (op == kGatherHeads) {
      if (seq != total)
        invalid("gather_heads: input has ", seq, " tokens but the ranks' token counts add up to ", total);
      r.src_rows = seq;
      r.dst_row0 = 0;
      r.dst_col0 = s * chunk;
      for (int t = 0; t < world; ++t) {
        r.n_rows[t] = static_cast<int32_t>(counts[t]);
        r.src_row0[t] = static_cast<int32_t>(offsets[t]);
        r.src_col0[t] = 0;
        r.dst_rows[t] = counts[t];
        max_rows_out = std::max(max_rows_out, counts[t]);
      }
    } else {
      if (seq != seqs[0]) invalid("all_gather_heads: every rank must send the same number of tokens");
      r.src_rows = seq;
      r.dst_row0 = 0;
      r.dst_col0 = s * chunk;
      for (int t = 0; t < world; ++t) {
        r.n_rows[t] = static_cast<int32_t>(seq);
        r.src_row0[t] = 0;
        r.src_col0[t] = 0;
        r.dst_rows[t] = seq;
      }
      max_rows_out = seq;
    }
  }
  if (op == kSendRecvHeads) {
    p.src_stride = row_full;
    p.dst_stride = chunk;
  } else {
    p.src_stride = chunk;
    p.dst_stride = row_full;
  }
  const int64_t out_row_bytes = op == kSendRecvHeads ? chunk : row_full;
  plan.out_bytes_max = batch * max_rows_out * out_row_bytes;
  if (plan.out_bytes_max > capacity_bytes) {
    const char* names[] = {"send_recv_heads", "gather_heads", "all_gather_heads"};
    invalid(names[op], ": the output needs ", plan.out_bytes_max, " bytes (B=", batch, ", ", max_rows_out,
            " tokens x ", out_row_bytes, " bytes) but the exchange buffer holds ", capacity_bytes,
            " bytes; raise max_tokens_per_rank/max_batch or send fewer tokens");
  }
  int64_t max_seq = 0;
  for (int64_t seq : seqs) max_seq = std::max(max_seq, seq);
  if (batch * std::max<int64_t>(max_rows_out, max_seq) >= (int64_t{1} << 31))
    invalid("batch x tokens must stay below 2^31 rows");
  return plan;
}

int pick_vector_bytes(const Params& p, const std::vector<uintptr_t>& srcs) {
  auto ok = [&](int64_t v) {
    if (p.chunk_bytes % v || p.src_stride % v || p.dst_stride % v) return false;
    for (uintptr_t s : srcs)
      if (s % static_cast<uintptr_t>(v)) return false;
    return true;
  };
  for (int v : {16, 8, 4, 2}) if (ok(v)) return v;
  return 1;
}

}  // namespace ltxk
