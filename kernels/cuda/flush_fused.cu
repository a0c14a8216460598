// The fused in-place flush (kivi_flush_fused), what flush_layers runs on CUDA: every
// layer of a step's flush in one launch.
// Inputs: the eight pool arrays of each of L layers (k_codes_0 .. tail_v_0, k_codes_1,
// ...; kernels.cuda_flush.fused_flush_kernel generates the prologue that points k_codes,
// ..., tail_v at layer blockIdx.y's), slots int32 [F] (the flushing slots, then -1 for
// padding: a decode step's flush has one shape, B entries, whoever flushes), ids int32
// [F * k] (their new blocks, k per slot, slot by slot; the same in every layer), params
// int32 [T, H_kv, k, F] (T = R + k*G, the tail rows). Thread blocks (s, kv head h, layer),
// one thread per channel d; block s takes slots s, s + S, ... (S = gridDim.x / H_kv) up
// to the first -1: a step's flush launches S = min(B, 4) blocks per head, not B (a
// block per padded slot made the launch 103-115 us a step against 77, B = 32, 36 layers,
// H100: idle blocks cost it), and a flush run on its own S = F. For each slot: block blk of it is its tail rows blk*G ..
// blk*G + G - 1, written at block ids[f * k + blk]; then, after a barrier (the value
// groups read other threads' channels), the tails move down by k*G rows
// (kivi_shift_tails). Output: `done`, one int32 nobody reads; evaluating it runs the
// launch.
// The pools are written through their input pointers: MLX hands a kernel its inputs as
// const pointers to the arrays' own buffers (no copy: the pool arrays are whole and
// row-contiguous, and ensure_row_contiguous is off so MLX never substitutes a copy).
// The writes are invisible to MLX's graph, so the caller owns the ordering: every
// computation that reads the pools before the flush must already be evaluated or enqueued
// (same stream, earlier graph), and one that reads them after it in the same graph must
// depend on `done` (kernels.cuda_flush: flush_layers, step_flush). All layers in one
// launch: a launch per layer would cost MLX's host time for a custom kernel (~12 us) per
// layer and run 36 small grids one after another.
  const int RG = params[0];
  const int H_kv = params[1];
  const int K = params[2];
  const int F = params[3];
  const int h = blockIdx.x % H_kv;
  const int d = threadIdx.x;
  if (blockIdx.x == 0 && blockIdx.y == 0 && d == 0) done[0] = 0;
  // f and slots[f] are the same in every thread: the barrier below is reached by all.
  for (int f = blockIdx.x / H_kv; f < F && slots[f] >= 0; f += gridDim.x / H_kv) {
    const size_t slot_rows = ((size_t)slots[f] * H_kv + h) * RG * D;
    SD* tk = const_cast<SD*>(tail_k) + slot_rows;
    SD* tv = const_cast<SD*>(tail_v) + slot_rows;
    for (int blk = 0; blk < K; ++blk) {
      kivi_flush_block<SD, D, G, BITS>(tk + (size_t)blk * G * D, tv + (size_t)blk * G * D,
                                       ids[f * K + blk] * H_kv + h, d,
                                       const_cast<uint8_t*>(k_codes), const_cast<SD*>(k_scales),
                                       const_cast<SD*>(k_zeros), const_cast<uint8_t*>(v_codes),
                                       const_cast<SD*>(v_scales), const_cast<SD*>(v_zeros));
    }
    __syncthreads();
    // 16 rows per chunk: <= k*G for every G >= 16 (see kivi_shift_tails).
    kivi_shift_tails<SD, D, 16>(tk, tv, RG, K * G, d);
  }
