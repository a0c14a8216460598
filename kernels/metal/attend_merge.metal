// Merge: one thread per output channel, looping over the splits.
  const int bh = int(threadgroup_position_in_grid.x);
  const int d = int(thread_position_in_threadgroup.x);
  const int nsu = params[2] + 1;
  const size_t first = size_t(bh / REP) * nsu * REP + (bh % REP);
  float mx = KIVI_NEG_INF;
  for (int i = 0; i < nsu; ++i) mx = metal::fmax(mx, part_ml[(first + size_t(i) * REP) * 2]);
  float lsum = 0.0f, a = 0.0f;
  if (mx != KIVI_NEG_INF) {
    for (int i = 0; i < nsu; ++i) {
      const size_t k = first + size_t(i) * REP;
      const float mi = part_ml[k * 2];
      if (mi != KIVI_NEG_INF) {
        const float w = metal::exp2(mi - mx);
        lsum = metal::fma(w, part_ml[k * 2 + 1], lsum);
        a = metal::fma(w, part_acc[k * D + d], a);
      }
    }
  }
  out[size_t(bh) * D + d] = kivi_from_f<T>(mx == KIVI_NEG_INF ? 0.0f : a / lsum);
