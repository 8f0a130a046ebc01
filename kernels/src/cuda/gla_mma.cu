// Chunked Simple GLA (one constant decay per head) on `mma.sync` with every fragment in
// registers: the contract and the two launches of `simple_gla_bf16` in `gla.rs` (the
// CubeCL kernel), the same work lists, state slots and decay tables.
//
// Compiled at run time by NVRTC for the device's architecture (compute capability 8.0 or
// newer, see `gla_mma.rs`); no headers: bf16 values travel as raw 16-bit patterns.
//
// For head h (γ = e^{g_h}) and a chunk of CHUNK tokens entering with state S ([D, D], f32):
//   o_i = scale · (γ^{i+1} q_i S + Σ_{j ≤ i} γ^{i−j} (q_i·k_j) v_j)
//   S'  = γ^C S + Σ_j γ^{C−1−j} k_jᵀ v_j
//
// Tiling. A block of 4 warps owns one (segment, head, block of VBLOCK = 64 value columns), as
// the CubeCL kernel's cube does, and walks the segment's chunks in order. Warp w owns
//   - chunk rows 16w..16w+15 of the outputs: the scores q·kᵀ (16 × 64), P (masked, decayed,
//     scaled; never leaves registers: the accumulator layout of the scores is the operand
//     layout of P·v), and the output accumulator o (16 × 64);
//   - state rows w·D/4 .. (w+1)·D/4 − 1 (all 64 value columns) as f32 accumulators that stay
//     in registers for the whole segment.
// Per chunk: stage q, k and the value block (`cp.async`, rows past the sequence zero-filled);
// barrier; the outputs (o = scale·γ^{i+1}·(q·S) + P·v, S read from shared memory as bf16
// halves); the state update (kᵀ from shared memory, the decayed values split in registers);
// barrier; each warp publishes its state rows as bf16 halves for the next chunk's q·S.
//
// Precision. Every product runs on bf16 tensor cores with f32 accumulation. The f32 operands
// (P, the state, the decayed values) are split into hi = bf16(x) and lo = bf16(x − hi) and
// multiplied as two products, so the result agrees with an f32 evaluation to about 2⁻¹⁶
// before its one rounding to bf16, as the CubeCL kernel's does.

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;

#define CHUNK 64
#define VBLOCK 64
#define WARPS 4
#define THREADS (WARPS * 32)
#define WORK_ITEM 4
// Padded row strides (bf16): 16-byte multiples whose rows start 4 banks apart, so the eight
// row addresses of one `ldmatrix` hit different banks.
#define LDV (VBLOCK + 8)

__device__ __forceinline__ u32 shared_address(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

/// 16 bytes from global memory into shared memory, or zeros when `bytes` is 0.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

__device__ __forceinline__ void ldmatrix_x4(u32 address, u32* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 address, u32* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

/// c += a·b for one 16×8×16 tile: `a` four registers (row-major 16×16), `b` two (16×8).
__device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// Two f32 rounded to nearest bf16 and packed, `lo` in the low half.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ float low_f32(u32 pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float high_f32(u32 pair) { return __uint_as_float(pair & 0xffff0000u); }

/// `x0`, `x1` as bf16 halves: `hi` = bf16(x), `lo` = bf16(x − hi), each a packed pair.
__device__ __forceinline__ void split2(float x0, float x1, u32& hi, u32& lo) {
  hi = pack_bf16(x0, x1);
  lo = pack_bf16(x0 - low_f32(hi), x1 - high_f32(hi));
}

/// Bytes of dynamic shared memory for head dimension D (see `gla_mma.rs`).
template <int D>
struct Layout {
  static constexpr int LDQ = D + 8;
  static constexpr int Q = 0;
  static constexpr int K = Q + CHUNK * LDQ;
  static constexpr int V = K + CHUNK * LDQ;
  static constexpr int S_HI = V + CHUNK * LDV;
  static constexpr int S_LO = S_HI + D * LDV;
  static constexpr int BF16S = S_LO + D * LDV;
};

/// Writes a warp's state rows (`st`, the layout of `gla_block`) as bf16 halves into `s_hi`
/// and `s_lo` (`[D][LDV]`), where the next chunk's q·S reads them after a barrier.
template <int D>
__device__ __forceinline__ void publish(const float (&st)[D / 64][8][4], bf16_t* s_hi,
                                        bf16_t* s_lo, int state_row0, int g, int t) {
#pragma unroll
  for (int m = 0; m < D / 64; ++m)
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = state_row0 + 16 * m + g + 8 * half;
        const int col = 8 * n + 2 * t;
        u32 hi, lo;
        split2(st[m][n][2 * half], st[m][n][2 * half + 1], hi, lo);
        *reinterpret_cast<u32*>(s_hi + row * LDV + col) = hi;
        *reinterpret_cast<u32*>(s_lo + row * LDV + col) = lo;
      }
}

template <int D, bool OUTPUTS>
__device__ __forceinline__ void gla_block(const bf16_t* __restrict__ q,
                                          const bf16_t* __restrict__ k,
                                          const bf16_t* __restrict__ v, bf16_t* __restrict__ out,
                                          float* __restrict__ states,
                                          const float* __restrict__ powers,
                                          const float* __restrict__ segment_decays,
                                          const u32* __restrict__ work, u32 heads, u32 cubes,
                                          float scale) {
  typedef Layout<D> L;
  constexpr int LDQ = L::LDQ;
  constexpr int D_STEPS = D / 16;      // reduction steps over a head's D
  constexpr int STATE_TILES = D / 64;  // 16-row tiles of the state per warp
  constexpr int BLOCKS = D / VBLOCK;

  extern __shared__ __align__(16) unsigned char smem[];
  bf16_t* qs = reinterpret_cast<bf16_t*>(smem) + L::Q;
  bf16_t* ks = reinterpret_cast<bf16_t*>(smem) + L::K;
  bf16_t* vs = reinterpret_cast<bf16_t*>(smem) + L::V;
  bf16_t* s_hi = reinterpret_cast<bf16_t*>(smem) + L::S_HI;
  bf16_t* s_lo = reinterpret_cast<bf16_t*>(smem) + L::S_LO;
  float* pw = reinterpret_cast<float*>(reinterpret_cast<bf16_t*>(smem) + L::BF16S);

  const u32 cube = blockIdx.x;
  if (cube >= cubes) return;  // uniform over the block
  const u32 block = cube % BLOCKS;
  const u32 head = (cube / BLOCKS) % heads;
  const u32 item = cube / (BLOCKS * heads);
  const u32 seq_start = work[WORK_ITEM * item];
  const u32 seq_len = work[WORK_ITEM * item + 1];
  const u32 first_state = work[WORK_ITEM * item + 2];
  const u32 index = work[WORK_ITEM * item + 3];
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;  // accumulator row (and row + 8)
  const int t = lane & 3;   // accumulator columns 2t, 2t + 1
  const u32 col0 = block * VBLOCK;
  const int state_row0 = warp * (D / 4);

  for (int i = tid; i <= CHUNK; i += THREADS) pw[i] = powers[head * (CHUNK + 1) + i];

  // The state rows this warp owns: tile m, column tile n, element e at row
  // state_row0 + 16m + g + 8(e / 2), column 8n + 2t + e % 2.
  float st[STATE_TILES][8][4];
#pragma unroll
  for (int m = 0; m < STATE_TILES; ++m)
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[m][n][e] = 0.0f;
  if (OUTPUTS && index > 0) {
    // The state entering a later segment: Σ_{r<index} γ^{L(index−1−r)} S_r by Horner's rule.
    const float gamma_segment = segment_decays[head];
    for (u32 r = 0; r < index; ++r) {
      const u64 slot = (static_cast<u64>(first_state + r) * heads + head) * (D * D);
#pragma unroll
      for (int m = 0; m < STATE_TILES; ++m)
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = state_row0 + 16 * m + g + 8 * (e >> 1);
            const int col = col0 + 8 * n + 2 * t + (e & 1);
            st[m][n][e] = st[m][n][e] * gamma_segment + states[slot + row * D + col];
          }
    }
  }

  if (OUTPUTS) publish<D>(st, s_hi, s_lo, state_row0, g, t);
  __syncthreads();
  const float gamma_chunk = pw[CHUNK];

  // ldmatrix row addresses (see the fragment layouts of mma.m16n8k16):
  //   A row-major in memory [m][k]: row lane % 16, column 8 · (lane / 16);
  //   B from [n][k] (k contiguous), two n-tiles: row (lane & 7) + 8 · (lane / 16),
  //     column 8 · ((lane / 8) & 1);
  //   B from [k][n] (transposed load), two n-tiles: row (lane & 7) + 8 · ((lane / 8) & 1),
  //     column 8 · (lane / 16);
  //   A from [k][m] (transposed load): row (lane & 7) + 8 · (lane / 16), column
  //     8 · ((lane / 8) & 1).
  const int a_row = lane & 15, a_col = (lane >> 4) << 3;
  const int nk_row = (lane & 7) + ((lane >> 4) << 3), nk_col = ((lane >> 3) & 1) << 3;
  const int kn_row = (lane & 7) + (((lane >> 3) & 1) << 3), kn_col = (lane >> 4) << 3;

  const u32 chunks = (seq_len + CHUNK - 1) / CHUNK;
  const u64 token_stride = static_cast<u64>(heads) * D;
  for (u32 c = 0; c < chunks; ++c) {
    const u32 t0 = c * CHUNK;
    // Stage the chunk's q and k rows of this head and its value block.
    constexpr int ROW_VECTORS = D / 8;
#pragma unroll
    for (int i = 0; i < CHUNK * ROW_VECTORS / THREADS; ++i) {
      const int e = tid + i * THREADS;
      const int j = e / ROW_VECTORS, x = e % ROW_VECTORS;
      const bool inside = t0 + j < seq_len;
      const u64 src = (seq_start + (inside ? t0 + j : 0)) * token_stride + head * D + x * 8;
      const u32 bytes = inside ? 16 : 0;
      if (OUTPUTS) cp_async16(shared_address(qs + j * LDQ + x * 8), q + src, bytes);
      cp_async16(shared_address(ks + j * LDQ + x * 8), k + src, bytes);
    }
#pragma unroll
    for (int i = 0; i < CHUNK * (VBLOCK / 8) / THREADS; ++i) {
      const int e = tid + i * THREADS;
      const int j = e / (VBLOCK / 8), x = e % (VBLOCK / 8);
      const bool inside = t0 + j < seq_len;
      const u64 src =
          (seq_start + (inside ? t0 + j : 0)) * token_stride + head * D + col0 + x * 8;
      cp_async16(shared_address(vs + j * LDV + x * 8), v + src, inside ? 16 : 0);
    }
    cp_async_wait_all();
    __syncthreads();

    if (OUTPUTS) {
      const int r0 = 16 * warp + g;  // the rows of this lane's accumulator elements
      u32 qa[D_STEPS][4];
#pragma unroll
      for (int s = 0; s < D_STEPS; ++s)
        ldmatrix_x4(shared_address(qs + (16 * warp + a_row) * LDQ + 16 * s + a_col), qa[s]);
      // Scores q·kᵀ, then P in place.
      float p[8][4];
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) p[n][e] = 0.0f;
#pragma unroll
      for (int s = 0; s < D_STEPS; ++s)
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          u32 b[4];
          ldmatrix_x4(shared_address(ks + (16 * np + nk_row) * LDQ + 16 * s + nk_col), b);
          mma(p[2 * np], qa[s], b[0], b[1]);
          mma(p[2 * np + 1], qa[s], b[2], b[3]);
        }
      u32 pa_hi[4][4], pa_lo[4][4];
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = r0 + 8 * half;
          float x[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = 8 * n + 2 * t + e;
            x[e] = j <= i ? p[n][2 * half + e] * scale * pw[i - j] : 0.0f;
          }
          // Accumulator tiles 2kk and 2kk + 1 are the k-halves of P's operand kk.
          const int kk = n >> 1, reg = half + 2 * (n & 1);
          split2(x[0], x[1], pa_hi[kk][reg], pa_lo[kk][reg]);
        }
      // o = q·S (the entering state, both halves), each row times scale·γ^{i+1}, then + P·v.
      float o[8][4];
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[n][e] = 0.0f;
#pragma unroll
      for (int s = 0; s < D_STEPS; ++s)
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          u32 b[4];
          ldmatrix_x4_trans(shared_address(s_hi + (16 * s + kn_row) * LDV + 16 * np + kn_col), b);
          mma(o[2 * np], qa[s], b[0], b[1]);
          mma(o[2 * np + 1], qa[s], b[2], b[3]);
          ldmatrix_x4_trans(shared_address(s_lo + (16 * s + kn_row) * LDV + 16 * np + kn_col), b);
          mma(o[2 * np], qa[s], b[0], b[1]);
          mma(o[2 * np + 1], qa[s], b[2], b[3]);
        }
      const float f0 = scale * pw[r0 + 1], f1 = scale * pw[r0 + 9];
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        o[n][0] *= f0;
        o[n][1] *= f0;
        o[n][2] *= f1;
        o[n][3] *= f1;
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          u32 b[4];
          ldmatrix_x4_trans(shared_address(vs + (16 * kk + kn_row) * LDV + 16 * np + kn_col), b);
          mma(o[2 * np], pa_hi[kk], b[0], b[1]);
          mma(o[2 * np + 1], pa_hi[kk], b[2], b[3]);
          mma(o[2 * np], pa_lo[kk], b[0], b[1]);
          mma(o[2 * np + 1], pa_lo[kk], b[2], b[3]);
        }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const u32 i = r0 + 8 * half;
        if (t0 + i < seq_len) {
          bf16_t* row = out + (seq_start + t0 + i) * token_stride + head * D + col0 + 2 * t;
#pragma unroll
          for (int n = 0; n < 8; ++n)
            *reinterpret_cast<u32*>(row + 8 * n) = pack_bf16(o[n][2 * half], o[n][2 * half + 1]);
        }
      }
    }

    // The state update γ^C S + kᵀ(γ^{C−1−j} v_j) of this warp's rows.
#pragma unroll
    for (int m = 0; m < STATE_TILES; ++m)
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[m][n][e] *= gamma_chunk;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      u32 ka[STATE_TILES][4];
#pragma unroll
      for (int m = 0; m < STATE_TILES; ++m)
        ldmatrix_x4_trans(
            shared_address(ks + (16 * kk + nk_row) * LDQ + state_row0 + 16 * m + nk_col), ka[m]);
      // The tokens of this lane's operand elements: 16kk + 2t (+1), and 8 more.
      const int j0 = 16 * kk + 2 * t;
      const float d00 = pw[CHUNK - 1 - j0], d01 = pw[CHUNK - 2 - j0];
      const float d10 = pw[CHUNK - 9 - j0], d11 = pw[CHUNK - 10 - j0];
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        u32 b[4];
        ldmatrix_x4_trans(shared_address(vs + (16 * kk + kn_row) * LDV + 16 * np + kn_col), b);
        u32 hi[4], lo[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float f_lo = (r & 1) ? d10 : d00, f_hi = (r & 1) ? d11 : d01;
          split2(low_f32(b[r]) * f_lo, high_f32(b[r]) * f_hi, hi[r], lo[r]);
        }
#pragma unroll
        for (int m = 0; m < STATE_TILES; ++m) {
          mma(st[m][2 * np], ka[m], hi[0], hi[1]);
          mma(st[m][2 * np], ka[m], lo[0], lo[1]);
          mma(st[m][2 * np + 1], ka[m], hi[2], hi[3]);
          mma(st[m][2 * np + 1], ka[m], lo[2], lo[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with this chunk's tiles and the old state halves
    if (OUTPUTS) publish<D>(st, s_hi, s_lo, state_row0, g, t);
  }

  if (!OUTPUTS) {
    // The state the segment leaves, into its slot.
    const u64 slot = (static_cast<u64>(first_state + index) * heads + head) * (D * D);
#pragma unroll
    for (int m = 0; m < STATE_TILES; ++m)
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = state_row0 + 16 * m + g + 8 * half;
          const int col = col0 + 8 * n + 2 * t;
          float2 pair = make_float2(st[m][n][2 * half], st[m][n][2 * half + 1]);
          *reinterpret_cast<float2*>(states + slot + row * D + col) = pair;
        }
  }
}

#define GLA_ENTRY(NAME, D, OUTPUTS)                                                           \
  extern "C" __global__ void __launch_bounds__(THREADS, 2)                                   \
      NAME(const bf16_t* q, const bf16_t* k, const bf16_t* v, bf16_t* out, float* states,     \
           const float* powers, const float* segment_decays, const u32* work, u32 heads,      \
           u32 cubes, float scale) {                                                          \
    gla_block<D, OUTPUTS>(q, k, v, out, states, powers, segment_decays, work, heads, cubes,  \
                          scale);                                                             \
  }

GLA_ENTRY(sala_gla_states_d64, 64, false)
GLA_ENTRY(sala_gla_outputs_d64, 64, true)
GLA_ENTRY(sala_gla_states_d128, 128, false)
GLA_ENTRY(sala_gla_outputs_d128, 128, true)
