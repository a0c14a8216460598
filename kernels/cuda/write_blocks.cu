// kivi_write_blocks: G-token blocks of a forward's keys and values quantized straight
// into the pool, in place (what a prefill writes on CUDA).
// Inputs: the layer's six block arrays (k_codes .. v_zeros), keys and values
// [B, H_kv, L, D] (SD, row-contiguous: the model's layout, so one head's tokens are
// rows D apart, as in a tail), first int32 [N] (block n's first token, row * L +
// position), ids int32 [N] (its pool block), params int32 [L, H_kv]. One thread block
// per (block n, kv head h), one thread per channel d, the same kivi_flush_block as the
// flush kernels: the pool ends bit-identical to the reference's gather, quantize and
// scatter (~30 graph nodes a layer, replaced by this one). Output: `done`, one int32
// nobody reads; evaluating it runs the launch. As in flush_fused.cu the writes are
// invisible to MLX's graph: the caller (KiviStore) evaluates `done` before anything
// reads these blocks and scatters nothing into the block arrays meanwhile.
  const int L = params[0];
  const int H_kv = params[1];
  const int n = blockIdx.x / H_kv, h = blockIdx.x % H_kv;
  const int d = threadIdx.x;
  const int s = first[n];
  const size_t rows = (((size_t)(s / L) * H_kv + h) * L + s % L) * D;
  kivi_flush_block<SD, D, G, BITS>(keys + rows, values + rows, ids[n] * H_kv + h, d,
                                   const_cast<uint8_t*>(k_codes), const_cast<SD*>(k_scales),
                                   const_cast<SD*>(k_zeros), const_cast<uint8_t*>(v_codes),
                                   const_cast<SD*>(v_scales), const_cast<SD*>(v_zeros));
  if (blockIdx.x == 0 && d == 0) done[0] = 0;
