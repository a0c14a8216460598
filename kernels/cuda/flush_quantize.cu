// The gather flush's quantize kernel (kivi_flush_quantize): bit-exact to kernels.kivi_quant.
// Inputs: rows_k, rows_v [F, H_kv, R + G, D] (the flushing slots' tails, SD);
// params int32 [R + G]. One thread block per (f, h), one thread per channel d: the
// key group of channel d and the value group d (token d / NG, channel group d % NG).
// Outputs: k_codes [F, H_kv, D, G/P], k_scales/k_zeros [F, H_kv, D],
//          v_codes [F, H_kv, G, D/P], v_scales/v_zeros [F, H_kv, D/G, G].
  const int fh = blockIdx.x;
  const int d = threadIdx.x;
  const int RG = params[0];
  kivi_flush_block<SD, D, G, BITS>(rows_k + (size_t)fh * RG * D, rows_v + (size_t)fh * RG * D, fh, d,
                                   k_codes, k_scales, k_zeros, v_codes, v_scales, v_zeros);
