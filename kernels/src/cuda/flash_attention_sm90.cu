// Causal grouped-query flash attention for Hopper (sm_90a): both products on the warpgroup
// tensor-core instructions (`wgmma.mma_async`), FlashAttention-3's warp-specialized ping-pong
// schedule, K/V tiles staged three deep by the tensor memory accelerator (TMA), persistent
// blocks that take their work from a counter.
//
// Compiled at run time by NVRTC for `sm_90a` (see `hopper_attention.rs`); no headers: bf16
// values travel as raw 16-bit patterns and are converted by PTX.
//
// Contract (that of `causal_gqa_attention` in `attention.rs`, bf16, head_dim 128):
//   q, out [tokens, heads, 128]; k, v [tokens, kv_heads, 128], row-major, sequences back to
//   back, given as tensor maps (`hopper_attention.rs` encodes them: 3-D, dims 128, kv_heads,
//   tokens, boxes of 64 × 1 × KEYS, 128-byte swizzle, zeros past the end); query head h reads
//   KV head h / group (group = heads / kv_heads);
//   out[t, h] = softmax_j(scale · q[t, h]·k[j, h/group]) · v[j, h/group] over the keys j <= t
//   of t's sequence.
//   With a `gate` [tokens, heads, 128] (else a null pointer), the output is gated as the
//   model's sigmoid output gate: out = bf16(bf16(o) · bf16(σ(gate))), σ(g) = exp(−ln(1 + e^−g))
//   in f32, the two roundings and the formula those of `gates::sigmoid_gate`.
//
// Tiling. A *row* is one (token, query head) pair; for KV head kv the rows of one sequence are
// numbered group-major, f = token · group + j for query head kv · group + j, so one staged K/V
// tile serves the whole group. A *unit* is ROWS = 128 consecutive rows of one sequence and one
// KV head (unit u: work item u / kv_heads, [sequence start, sequence length, first row], and
// KV head u % kv_heads; the items come longest first). Tiles of KEYS = 128 keys run from the
// sequence's first key to the unit's last token (tiles above the diagonal are never read).
//
// The kernel is persistent: the grid is at most one block per multiprocessor. Block b takes
// unit b first, then the next unit of a counter in global memory (`fetch_unit`; the launch's
// last fetch sets it back to zero), so units still start longest first and a block that
// finishes early takes more, as the hardware's block scheduler would. The producer stages the
// next unit's Q and first K tile while the consumers finish the unit before (its last product
// and its output), so neither a block's launch nor its pipeline's filling is paid per unit.
// The K and V rings run on across units; Q has an empty barrier of its own, released once
// both consumers' last scores of a unit have read it, and the unit's index reaches the
// consumers through a shared-memory slot and a barrier of its own.
//
// Schedule: 384 threads, three warpgroups.
//   - Warpgroup 2 is the producer (`setmaxnreg.dec` to 40 registers). Its 128 threads copy a
//     unit's Q (`cp.async`, Q's full barrier); then its thread 0 alone stages K(0), then
//     K(t + 1) before V(t), each into the next stage of its own ring once both consumers
//     released that stage (`mbarrier` empty, 256 arrivals), as two TMA copies that complete
//     the stage's full barrier (transaction bytes) when they land. K and V have rings and
//     barriers of their own because K(t) is read one turn before V(t); each stage is refilled
//     as soon as its own reader is done, two turns ahead of its use.
//     (With `cp.async` from 128 threads, ncu showed the consumers waiting for K and V in every
//     turn: those copies could not keep enough bytes in flight.)
//   - Warpgroups 0 and 1 are the consumers (`setmaxnreg.inc` to 232), 64 rows each (the M of
//     their products). Turn t issues S(t) = Q·K(t)ᵀ and O += P(t-1)·V(t-1) as two `wgmma`
//     groups (S and O f32 in registers, Q, K, V from shared memory, P from registers). Once
//     S(t) is done, its online softmax runs while P(t-1)·V(t-1) may still be on the tensor
//     cores: base 2, the scale folded into one FMA, keys past a row's token masked, a row's
//     four lanes combining maxima by shuffles (sums once at the end). Once that product is
//     done too, P(t) is rounded into the registers the next turn's product reads: the
//     accumulator layout of S lines up with the register operand layout of P·V, so P never
//     leaves registers. O is brought to P(t)'s maxima in turn t + 1, between the issue of
//     S(t + 1) and that of P(t)·V(t), while S(t + 1) runs (FlashAttention-3's order), and only
//     when a row of the warp moved its maximum: a row keeps it until a tile's exceeds it by
//     more than 2^RESCALE_THRESHOLD (FlashAttention-4's lazy rescaling). The two consumers
//     also take turns on the tensor cores through two named barriers (ids 1 and 2:
//     `bar.sync` on one's own, `bar.arrive` on the other's), so one's softmax runs while the
//     other's products do.
//     No block-wide barrier after the start.
//   - ptxas serializes the products if anything but them writes a register they use before
//     the last of them is done: S is a fresh array each turn, the softmax works on it only
//     after its own group is done, and P is written only after both are.
//
// Shared memory holds every tile in the 128-byte swizzled layout the tensor cores read: a
// tile of R rows × 128 bf16 is two halves (columns 0..63, 64..127) of R rows × 128 bytes,
// the 16-byte chunk c of row r stored at chunk c ^ (r % 8) of that row.
//
// Compiler report (NVRTC 13 with `--ptxas-options=-v`, `bench/flash_sm90.py --ptxas-info`):
// 168 registers at entry, 12 bytes of spill stores (ncu counts one store per thread, at the
// start), no serialized `wgmma` (warning C7513).

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;

#define HEAD_DIM 128
#define ROWS 128
#define KEYS 128
#define THREADS 384
#define TILE_BYTES (128 * HEAD_DIM * 2)
#define STAGES 3
// Q, three K and three V stages, the mbarriers, and slack to align the tiles to the
// 1024-byte swizzle atom.
#define BARRIER_BYTES 128
#define SMEM_BYTES ((1 + 2 * STAGES) * TILE_BYTES + BARRIER_BYTES + 1024)
#define NEG_INF __int_as_float(0xff800000)
// How far (base 2, scaled) a tile's maximum may exceed a row's kept one before the row's
// maximum moves and its output is rescaled (see `softmax_tile`).
#ifndef RESCALE_THRESHOLD
#define RESCALE_THRESHOLD 8.0f
#endif

__device__ __forceinline__ u32 shared_address(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

/// Byte offset of 16-byte chunk `chunk` (0..15) of row `row` in a swizzled tile of `rows` rows.
__device__ __forceinline__ u32 swizzled(u32 rows, u32 row, u32 chunk) {
  return (chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
/// Makes this thread's shared-memory writes visible to the tensor cores (the async proxy).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/// A shared-memory matrix descriptor with the 128-byte swizzle: start address, leading and
/// stride byte offsets (bytes, multiples of 16).
__device__ __forceinline__ u64 descriptor(u32 address, u32 leading, u32 stride) {
  return static_cast<u64>((address & 0x3FFFF) >> 4) | (static_cast<u64>(leading >> 4) << 16) |
         (static_cast<u64>(stride >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait_all() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

/// The f32 values of the two bf16 of a pair, the low half first.
__device__ __forceinline__ float2 unpack_bf16(u32 pair) {
  return make_float2(__uint_as_float(pair << 16), __uint_as_float(pair & 0xffff0000u));
}

/// `σ(g)` as the model's graph computes it, `exp(−ln(1 + exp(−g)))`, in f32.
__device__ __forceinline__ float sigmoid(float g) { return __expf(-__logf(1.0f + __expf(-g))); }

/// Two f32 rounded to a bf16 pair, `lo` in the low half.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// The two warpgroup matrix products the kernel is built on, m64n128k16 bf16 -> f32. Each thread
// of the warpgroup holds 64 accumulators `d`: for n-chunk i (columns 8i..8i+7) d[4i], d[4i+1]
// are row `lane/4` and d[4i+2], d[4i+3] row `lane/4 + 8` of its warp's 16 rows, at columns
// 8i + 2(lane%4) and the next. The operand lists name all 64 accumulators.

/// `d (+)= A·B` for a 64×128 f32 tile, A (64×16) and B (16×128, K-major) bf16 in shared
/// memory (descriptors); `accumulate == 0` overwrites `d`.
__device__ __forceinline__ void wgmma_ss(float (&d)[64], u64 desc_a, u64 desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

/// `d += A·B` for a 64×128 f32 tile, A (64×16) bf16 from registers (four bf16 pairs per
/// thread, per warp the `mma.m16n8k16` A layout), B (16×128) bf16 in shared memory, N-major.
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const u32 (&a)[4], u64 desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

/// Keeps the compiler from moving reads or writes of `d` across the asynchronous products.
__device__ __forceinline__ void fence_operands(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}


__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar)
               : "memory");
}
/// Waits until phase `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  u32 done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}
/// Arrives on the barrier (asynchronously) once every `cp.async` this thread has issued so
/// far has landed; the barrier's expected count includes this arrival (`.noinc`).
__device__ __forceinline__ void cp_async_arrive(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
/// The two consumer warpgroups' turn-taking barriers (ids 1 and 2, 256 threads).
__device__ __forceinline__ void turn_wait(u32 id) {
  asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory");
}
__device__ __forceinline__ void turn_pass(u32 id) {
  asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory");
}

/// A CUDA tensor map (`CUtensorMap`, 128 opaque bytes) passed by value as a `__grid_constant__`
/// parameter: the tensor copies read it where it lies in parameter space.
struct __align__(64) TensorMap {
  u64 opaque[16];
};

/// Arrives on the barrier and adds `bytes` to the transaction count its phase waits for.
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
  asm volatile(
      "{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(bar),
      "r"(bytes)
      : "memory");
}

/// Copies the box at coordinates (`c0`, `c1`, `c2`) of the tensor `map` describes into shared
/// memory at `dst` (the tensor engine, in the swizzled layout the map names); the barrier's
/// transaction count falls by the box's bytes once they have landed.
__device__ __forceinline__ void tma_load_3d(u32 dst, const TensorMap& map, int c0, int c1, int c2,
                                            u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, "
      "{%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<u64>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

/// Stages keys `first ..first + KEYS` of KV head `kv` (K or V; `map` describes the [tokens,
/// kv_heads, 128] tensor in boxes of 64 dims × 1 head × KEYS keys with the 128-byte swizzle)
/// into the tile at `dst`: its two 64-column halves, KEYS·128 bytes apart, one tensor-engine
/// copy each, which complete the `full` barrier's phase once both have landed. Keys past the
/// tensor read as zeros; keys past the sequence (the next sequence's) are masked by the softmax
/// to a probability of exactly 0, which clears finite values only: K and V must be finite.
__device__ __forceinline__ void stage_tile(const TensorMap& map, u32 dst, u32 first, u32 kv,
                                           u32 full) {
  mbar_expect(full, TILE_BYTES);
  tma_load_3d(dst, map, 0, kv, first, full);
  tma_load_3d(dst + KEYS * 128, map, 64, kv, first, full);
}

/// The producer warpgroup's own barrier (id 3, 128 threads).
__device__ __forceinline__ void producer_sync() {
  asm volatile("bar.sync 3, 128;\n" ::: "memory");
}

/// A ring position: the stage a tile goes to and the parity of that stage's current phase.
struct Ring {
  u32 stage = 0, phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1;
    }
  }
};

/// The online softmax of one tile's scores `s`, in place (base 2, keys past a row's token
/// masked): the rows' maxima and sums updated, `alpha0`, `alpha1` the factors that bring the
/// output accumulators to the new maxima ([`rescale`]), and whether any row of the warp moved
/// its maximum (when none did, both factors are exactly 1 for every lane of the warp).
///
/// A row keeps its maximum unless the tile's exceeds it by more than `RESCALE_THRESHOLD`
/// (base 2, after scaling): the tile's probabilities are then relative to the kept maximum,
/// at most 2^RESCALE_THRESHOLD, which the f32 sums and the bf16 P hold exactly as well
/// (FlashAttention-4's lazy rescaling). The result is the same function, and most turns of a
/// long row need no rescaling at all.
__device__ __forceinline__ bool softmax_tile(float (&s)[64], float& alpha0, float& alpha1,
                                             float& max0, float& max1, float& sum0, float& sum1,
                                             u32 tile, u32 first_token, u32 token0, u32 token1,
                                             u32 column, float scale_log2) {
  if (tile * KEYS + KEYS - 1 > first_token) {
#pragma unroll
    for (u32 i = 0; i < 16; ++i) {
#pragma unroll
      for (u32 e = 0; e < 2; ++e) {
        const u32 key = tile * KEYS + 8 * i + column + e;
        if (key > token0) s[4 * i + e] = NEG_INF;
        if (key > token1) s[4 * i + 2 + e] = NEG_INF;
      }
    }
  }
  float new0 = NEG_INF, new1 = NEG_INF;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    new0 = fmaxf(new0, fmaxf(s[4 * i], s[4 * i + 1]));
    new1 = fmaxf(new1, fmaxf(s[4 * i + 2], s[4 * i + 3]));
  }
  new0 = fmaxf(new0, __shfl_xor_sync(0xffffffffu, new0, 1));
  new0 = fmaxf(new0, __shfl_xor_sync(0xffffffffu, new0, 2));
  new1 = fmaxf(new1, __shfl_xor_sync(0xffffffffu, new1, 1));
  new1 = fmaxf(new1, __shfl_xor_sync(0xffffffffu, new1, 2));
  // Every visited tile holds at least one key <= each row's token: the maxima are finite. The
  // first tile always moves them (from -inf).
  const bool move0 = (new0 - max0) * scale_log2 > RESCALE_THRESHOLD;
  const bool move1 = (new1 - max1) * scale_log2 > RESCALE_THRESHOLD;
  new0 = move0 ? new0 : max0;
  new1 = move1 ? new1 : max1;
  alpha0 = exp2f((max0 - new0) * scale_log2);
  alpha1 = exp2f((max1 - new1) * scale_log2);
  max0 = new0;
  max1 = new1;
  const float bias0 = new0 * scale_log2, bias1 = new1 * scale_log2;
  float part0 = 0.0f, part1 = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    s[4 * i] = exp2f(fmaf(s[4 * i], scale_log2, -bias0));
    s[4 * i + 1] = exp2f(fmaf(s[4 * i + 1], scale_log2, -bias0));
    s[4 * i + 2] = exp2f(fmaf(s[4 * i + 2], scale_log2, -bias1));
    s[4 * i + 3] = exp2f(fmaf(s[4 * i + 3], scale_log2, -bias1));
    part0 += s[4 * i] + s[4 * i + 1];
    part1 += s[4 * i + 2] + s[4 * i + 3];
  }
  sum0 = sum0 * alpha0 + part0;
  sum1 = sum1 * alpha1 + part1;
  return __any_sync(0xffffffffu, move0 || move1);
}

/// P's register operands from the softmax's `s`: for keys 16j.., the accumulators of column
/// chunks 2j and 2j + 1, rounded to bf16 pairs.
__device__ __forceinline__ void pack_p(const float (&s)[64], u32 (&p)[8][4]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    p[j][0] = pack_bf16(s[8 * j], s[8 * j + 1]);
    p[j][1] = pack_bf16(s[8 * j + 2], s[8 * j + 3]);
    p[j][2] = pack_bf16(s[8 * j + 4], s[8 * j + 5]);
    p[j][3] = pack_bf16(s[8 * j + 6], s[8 * j + 7]);
  }
}

/// The output accumulators brought to the rows' new maxima.
__device__ __forceinline__ void rescale(float (&o)[64], float alpha0, float alpha1) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    o[4 * i] *= alpha0;
    o[4 * i + 1] *= alpha0;
    o[4 * i + 2] *= alpha1;
    o[4 * i + 3] *= alpha1;
  }
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/// S = Q·Kᵀ for a warpgroup's 64 rows (`q_rows`: their Q tile) against the K tile at `sk`:
/// the head dimension 16 at a time, 4 steps per 64-column half.
__device__ __forceinline__ void scores(float (&s)[64], u32 q_rows, u32 sk) {
#pragma unroll
  for (u32 step = 0; step < 8; ++step) {
    const u32 half = step >> 2, within = (step & 3) * 32;
    wgmma_ss(s, descriptor(q_rows + half * ROWS * 128 + within, 16, 1024),
             descriptor(sk + half * KEYS * 128 + within, 16, 1024), step > 0);
  }
}

/// O += P·V over a tile's keys, 16 at a time. V is N-major: the two 64-column halves lie
/// KEYS·128 bytes apart (leading offset), groups of 8 keys 1024 bytes apart (stride offset).
__device__ __forceinline__ void values(float (&o)[64], const u32 (&p)[8][4], u32 sv) {
#pragma unroll
  for (u32 j = 0; j < 8; ++j) wgmma_rs(o, p[j], descriptor(sv + j * 16 * 128, KEYS * 128, 1024));
}

/// A unit of work: ROWS rows of one sequence for one KV head.
struct Unit {
  u32 seq_start, seq_len, f0, kv, rows, first_token, tiles;
};

__device__ __forceinline__ Unit unit_at(const u32* __restrict__ work, u32 unit, u32 kv_heads,
                                        u32 group) {
  Unit w;
  const u32 item = unit / kv_heads;
  w.kv = unit % kv_heads;
  w.seq_start = work[3 * item];
  w.seq_len = work[3 * item + 1];
  w.f0 = work[3 * item + 2];
  w.rows = w.seq_len * group;
  w.first_token = w.f0 / group;
  const u32 last_token = (min(w.f0 + ROWS, w.rows) - 1) / group;
  w.tiles = last_token / KEYS + 1;
  return w;
}

/// The next unit for a block of `blocks`: units are handed out in order (longest first) by an
/// atomic counter, `blocks` plus the fetches so far (block b starts with unit b). Every block
/// fetches until it is handed a unit past the last, one each: the fetch that returns the last
/// of those (`units - 1` fetches before it) is the launch's last, and sets the counter back to
/// zero for the next launch.
__device__ __forceinline__ u32 fetch_unit(u32* next, u32 units, u32 blocks) {
  const u32 fetched = atomicAdd(next, 1u);
  if (fetched == units - 1) atomicExch(next, 0u);
  return blocks + fetched;
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    sala_flash_attention_sm90(const bf16_t* __restrict__ q, const __grid_constant__ TensorMap k_map,
                              const __grid_constant__ TensorMap v_map, bf16_t* __restrict__ out,
                              const bf16_t* __restrict__ gate, const u32* __restrict__ work,
                              u32* next_unit, u32 items, u32 heads, u32 kv_heads,
                              float scale_log2) {
  extern __shared__ unsigned char smem[];
  const u32 base = (shared_address(smem) + 1023u) & ~1023u;
  // Q, K stages, V stages, then the barriers: full (the tile has landed) and empty (the
  // consumers' 256 threads are done reading) for each K and V stage; Q's full (the producer's
  // 128 threads' copies have landed) and empty; the unit barrier (the unit's index is in its
  // slot); and the two slots.
  const u32 sq = base, sk0 = base + TILE_BYTES, sv0 = base + (1 + STAGES) * TILE_BYTES;
  const u32 bars = base + (1 + 2 * STAGES) * TILE_BYTES;
  // K and V have barriers of their own: K(t) is read in turn t and V(t) in turn t + 1, so each
  // stage is refilled as soon as its own reader is done.
  const u32 full_k = bars, full_v = bars + 8 * STAGES, empty_k = bars + 16 * STAGES,
            empty_v = bars + 24 * STAGES, full_q = bars + 32 * STAGES,
            empty_q = full_q + 8, unit_ready = full_q + 16;
  volatile u32* slots = reinterpret_cast<volatile u32*>(
      smem + (unit_ready + 8 - shared_address(smem)));

  const u32 units = items * kv_heads, group = heads / kv_heads;
  if (blockIdx.x >= units) return;

  if (threadIdx.x == 0) {
    for (u32 s = 0; s < STAGES; ++s) {
      mbar_init(full_k + 8 * s, 1);
      mbar_init(full_v + 8 * s, 1);
      mbar_init(empty_k + 8 * s, 256);
      mbar_init(empty_v + 8 * s, 256);
    }
    mbar_init(full_q, 128);
    mbar_init(empty_q, 256);
    mbar_init(unit_ready, 1);
    // The barriers' initialization, visible to the tensor engine's completions.
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const u32 warpgroup = threadIdx.x >> 7;
  if (warpgroup == 2) {
    // Producer. Per unit: thread 0 publishes the unit's index (slot and unit barrier) and
    // fetches the next one (its latency hidden behind this unit); all 128 threads copy Q
    // (`cp.async`) once both consumers' last scores of the unit before have read it; then
    // thread 0 alone stages K(0), then K(t + 1) before V(t) (the order the consumers read
    // them in), each into the next stage of its ring once both consumers released it, as two
    // tensor-engine copies that complete the stage's full barrier when they land. The other
    // threads wait at the warpgroup's barrier meanwhile instead of spinning.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    const u32 t = threadIdx.x - 256;
    Ring ring_k, ring_v;
    // Thread 0's: this round's unit and the next.
    u32 unit = blockIdx.x, next = units;
    for (u32 round = 0;; ++round) {
      if (t == 0) {
        if (round > 0) mbar_wait(empty_q, (round - 1) & 1);
        slots[round & 1] = unit;
        mbar_arrive(unit_ready);
        if (unit < units) next = fetch_unit(next_unit, units, gridDim.x);
      }
      producer_sync();
      const u32 current = slots[round & 1];
      if (current >= units) break;
      const Unit w = unit_at(work, current, kv_heads, group);
      for (u32 i = t; i < ROWS * 16; i += 128) {
        const u32 r = i >> 4, chunk = i & 15;
        const u32 f = min(w.f0 + r, w.rows - 1);
        const u64 at = (static_cast<u64>(w.seq_start + f / group) * heads + w.kv * group +
                        f % group) * HEAD_DIM + chunk * 8;
        cp_async16(sq + swizzled(ROWS, r, chunk), q + at);
      }
      cp_async_arrive(full_q);
      if (t == 0) {
        const u32 first = w.seq_start;
        for (u32 tile = 0; tile < w.tiles; ++tile) {
          for (u32 n = tile == 0 ? 0 : tile + 1; n <= tile + 1 && n < w.tiles; ++n) {
            mbar_wait(empty_k + 8 * ring_k.stage, ring_k.phase ^ 1);
            stage_tile(k_map, sk0 + ring_k.stage * TILE_BYTES, first + n * KEYS, w.kv,
                       full_k + 8 * ring_k.stage);
            ring_k.advance();
          }
          mbar_wait(empty_v + 8 * ring_v.stage, ring_v.phase ^ 1);
          stage_tile(v_map, sv0 + ring_v.stage * TILE_BYTES, first + tile * KEYS, w.kv,
                     full_v + 8 * ring_v.stage);
          ring_v.advance();
        }
      }
      if (t == 0) unit = next;
      producer_sync();
    }
    // Not leave with copies in flight.
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  // Consumers: see the schedule at the top. The two warpgroups take turns on the tensor
  // cores (ping-pong), and each one's softmax overlaps its own P·V product.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const u32 mine = 1 + warpgroup, other = 2 - warpgroup;
  if (warpgroup == 1) turn_pass(other);  // warpgroup 0 goes first

  const u32 lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  const u32 row_in_block = warpgroup * 64 + warp * 16 + (lane >> 2);
  const u32 column = 2 * (lane & 3);
  const u32 q_rows = sq + warpgroup * 64 * 128;
  Ring ring_k, ring_v;

  for (u32 round = 0;; ++round) {
    mbar_wait(unit_ready, round & 1);
    const u32 unit = slots[round & 1];
    if (unit >= units) {
      // Warpgroup 1 passed the turn after its last product; nobody else takes it.
      if (warpgroup == 0) turn_wait(mine);
      break;
    }
    const Unit w = unit_at(work, unit, kv_heads, group);
    const u32 row0 = w.f0 + row_in_block;
    const u32 token0 = min(row0, w.rows - 1) / group;
    const u32 token1 = min(row0 + 8, w.rows - 1) / group;

    float o[64], alpha0, alpha1;
    u32 p[8][4];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    float max0 = NEG_INF, max1 = NEG_INF, sum0 = 0.0f, sum1 = 0.0f;

    // Whether O must be brought to the maxima of the last softmax before its P·V is added:
    // done while the next scores are on the tensor cores (FlashAttention-3's order), and
    // skipped when no row of the warp moved its maximum.
    bool pending_rescale = false;

    // Turn 0: S(0) only. Q was written by `cp.async` (the generic proxy): fenced before the
    // tensor cores read it.
    mbar_wait(full_q, round & 1);
    fence_proxy_async();
    {
      float s[64];
      mbar_wait(full_k + 8 * ring_k.stage, ring_k.phase);
      turn_wait(mine);
      wgmma_fence();
      scores(s, q_rows, sk0 + ring_k.stage * TILE_BYTES);
      wgmma_commit();
      turn_pass(other);
      wgmma_wait_all();
      fence_operands(s);
      mbar_arrive(empty_k + 8 * ring_k.stage);
      if (w.tiles == 1) mbar_arrive(empty_q);
      ring_k.advance();
      // O is still zero: nothing to rescale.
      softmax_tile(s, alpha0, alpha1, max0, max1, sum0, sum1, 0, w.first_token, token0, token1,
                   column, scale_log2);
      pack_p(s, p);
    }
    for (u32 turn = 1; turn < w.tiles; ++turn) {
      const u32 stage_k = ring_k.stage, stage_v = ring_v.stage;
      mbar_wait(full_k + 8 * stage_k, ring_k.phase);
      mbar_wait(full_v + 8 * stage_v, ring_v.phase);
      // S is fresh each turn: no register the products read is written by anything else
      // while they run (ptxas would serialize them).
      float s[64];
      turn_wait(mine);
      wgmma_fence();
      scores(s, q_rows, sk0 + stage_k * TILE_BYTES);
      wgmma_commit();
      // O (which S(t) does not touch) to P(t-1)'s maxima, while S(t) runs.
      if (pending_rescale) rescale(o, alpha0, alpha1);
      wgmma_fence();
      values(o, p, sv0 + stage_v * TILE_BYTES);
      wgmma_commit();
      turn_pass(other);
      // S(t) is done while O += P(t-1)·V(t-1) may still run: the softmax overlaps it.
      wgmma_wait<1>();
      fence_operands(s);
      mbar_arrive(empty_k + 8 * stage_k);
      if (turn + 1 == w.tiles) mbar_arrive(empty_q);
      ring_k.advance();
      pending_rescale = softmax_tile(s, alpha0, alpha1, max0, max1, sum0, sum1, turn,
                                     w.first_token, token0, token1, column, scale_log2);
      wgmma_wait<0>();
      fence_operands(o);
      mbar_arrive(empty_v + 8 * stage_v);
      ring_v.advance();
      pack_p(s, p);
    }
    // The gate's values for this thread's outputs, loaded before the last product so that
    // their latency overlaps it (S's registers are free by now); rows past the sequence read
    // its last row and are never stored.
    u32 gate_pairs[2][16];
    if (gate != nullptr) {
#pragma unroll
      for (u32 half = 0; half < 2; ++half) {
        const u32 f = min(row0 + 8 * half, w.rows - 1);
        const u64 row =
            static_cast<u64>(w.seq_start + f / group) * heads + w.kv * group + f % group;
        const bf16_t* src = gate + row * HEAD_DIM;
#pragma unroll
        for (u32 i = 0; i < 16; ++i)
          gate_pairs[half][i] = *reinterpret_cast<const u32*>(src + 8 * i + column);
      }
    }
    // Last turn: O += P·V of the last tile. Warpgroup 1's pass is taken by warpgroup 0's next
    // unit, or by its exit.
    const u32 stage_v = ring_v.stage;
    mbar_wait(full_v + 8 * stage_v, ring_v.phase);
    turn_wait(mine);
    if (pending_rescale) rescale(o, alpha0, alpha1);
    wgmma_fence();
    values(o, p, sv0 + stage_v * TILE_BYTES);
    wgmma_commit();
    turn_pass(other);
    wgmma_wait_all();
    fence_operands(o);
    mbar_arrive(empty_v + 8 * stage_v);
    ring_v.advance();

    sum0 += __shfl_xor_sync(0xffffffffu, sum0, 1);
    sum0 += __shfl_xor_sync(0xffffffffu, sum0, 2);
    sum1 += __shfl_xor_sync(0xffffffffu, sum1, 1);
    sum1 += __shfl_xor_sync(0xffffffffu, sum1, 2);
    const float inv0 = 1.0f / sum0, inv1 = 1.0f / sum1;
#pragma unroll
    for (u32 half = 0; half < 2; ++half) {
      const u32 f = row0 + 8 * half;
      if (f >= w.rows) continue;
      const float inv = half ? inv1 : inv0;
      const u64 at =
          (static_cast<u64>(w.seq_start + f / group) * heads + w.kv * group + f % group) *
          HEAD_DIM;
#pragma unroll
      for (u32 i = 0; i < 16; ++i) {
        u32 pair = pack_bf16(o[4 * i + 2 * half] * inv, o[4 * i + 2 * half + 1] * inv);
        if (gate != nullptr) {
          const float2 a = unpack_bf16(pair);
          const float2 g = unpack_bf16(gate_pairs[half][i]);
          const float2 s = unpack_bf16(pack_bf16(sigmoid(g.x), sigmoid(g.y)));
          pair = pack_bf16(a.x * s.x, a.y * s.y);
        }
        *reinterpret_cast<u32*>(out + at + 8 * i + column) = pair;
      }
    }
  }
}
