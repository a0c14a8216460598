// An MLP's SwiGLU and its down projection for one row, in one launch (kivi_swiglu_down):
// out = W v with v = silu(g) * u, g and u the gate and up halves of the fused gate/up
// projection's output. At one sequence a decode step runs them as two launches (MLX's
// compiled SwiGLU, then its gemv_single); one launch is one op fewer per layer, whose
// cost at that batch is mostly MLX's host work per op (~10 us).
// Inputs: gu T [2F] (the gate's F columns, then the up's), w T [N, F] row-major.
// Output: out T [N]. T is fp16 or bf16. LOADS_AHEAD: W's chunks a lane keeps in flight.
// Grid: blocks of ROWS warps, one output row per warp, about one block per SM (the grid is
// one wave: no SM gets a second block to finish after the others). Each lane first issues
// its loads of W's first AHEAD chunks, then the block makes v in shared memory (every block
// makes all of it, 8 values a thread at a time, two passes' loads issued together: a
// pass per load's latency was most of the kernel's time) while they are in
// flight; the row's loop keeps AHEAD chunks loading ahead of the ones it adds.
// Bit-exact with MLX, so tokens do not change: v is rounded as the compiled SwiGLU rounds
// it (MLX's own Sigmoid and Multiply functors on T, from its JIT headers: x * sigmoid(x),
// then * u); the dot product is MLX 0.32's gemv_single: lane l sums w * v in float, one
// fma at a time, over columns NPT l + 32 NPT i + j in that order (NPT: MLX's n_per_thread
// for F), then the warp adds its lanes as cg::reduce does (butterfly, xor 16 .. 1) and the
// sum is rounded to T once.
  constexpr int BLOCK = 32 * ROWS;
  constexpr int STRIDE = 32 * NPT;  // the columns a warp covers per step
  constexpr int STEPS = (F + STRIDE - 1) / STRIDE;
  constexpr int AHEAD = STEPS < LOADS_AHEAD ? STEPS : LOADS_AHEAD;
  constexpr int VECS = F / 8;  // 16-byte vectors of the gate (and of the up)
  constexpr int GROUP = 2;     // passes whose loads are issued together
  static_assert(ROWS >= 1 && BLOCK <= 1024 && F % 8 == 0 && F % NPT == 0, "swiglu_down: plan");
  struct alignas(NPT * sizeof(T)) Chunk { T x[NPT]; };
  __shared__ __align__(16) T v[F];
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * ROWS + (threadIdx.x >> 5);
  const T* wr = w + size_t(row < N ? row : N - 1) * F;  // a warp past N loads a real row, unused
  Chunk next[AHEAD];
#pragma unroll
  for (int u = 0; u < AHEAD; ++u) {
    const int col = NPT * lane + STRIDE * u;
    if (col < F) next[u] = *reinterpret_cast<const Chunk*>(wr + col);
  }
  for (int first = threadIdx.x; first < VECS; first += GROUP * BLOCK) {
    uint4 g8[GROUP], u8[GROUP];
#pragma unroll
    for (int p = 0; p < GROUP; ++p) {
      const int c = first + p * BLOCK;
      if (c < VECS) {
        g8[p] = kivi_ld16(gu + 8 * c);
        u8[p] = kivi_ld16(gu + F + 8 * c);
      }
    }
#pragma unroll
    for (int p = 0; p < GROUP; ++p) {
      const int c = first + p * BLOCK;
      if (c < VECS) {
        const T* g = reinterpret_cast<const T*>(&g8[p]);
        const T* u = reinterpret_cast<const T*>(&u8[p]);
        uint4 packed;
        T* out8 = reinterpret_cast<T*>(&packed);
#pragma unroll
        for (int j = 0; j < 8; ++j) out8[j] = Multiply{}(Multiply{}(g[j], Sigmoid{}(g[j])), u[j]);
        *reinterpret_cast<uint4*>(v + 8 * c) = packed;
      }
    }
  }
  __syncthreads();
  if (row >= N) return;
  float sum = 0.0f;
  for (int s = 0; s < STEPS; s += AHEAD) {
#pragma unroll
    for (int u = 0; u < AHEAD; ++u) {  // slot u: add step s + u, then load step s + AHEAD + u into it
      const int col = NPT * lane + STRIDE * (s + u);
      if (col < F) {
        const Chunk b = *reinterpret_cast<const Chunk*>(v + col);
#pragma unroll
        for (int j = 0; j < NPT; ++j) sum = fmaf(static_cast<float>(next[u].x[j]), static_cast<float>(b.x[j]), sum);
      }
      const int ahead = col + STRIDE * AHEAD;
      if (ahead < F) next[u] = *reinterpret_cast<const Chunk*>(wr + ahead);
    }
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) sum = sum + __shfl_xor_sync(KIVI_FULL, sum, m);
  if (lane == 0) out[row] = static_cast<T>(sum);
