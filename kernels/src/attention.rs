//! Causal grouped-query attention over packed variable-length sequences, flash-attention
//! style: an online softmax over key tiles staged in shared memory, never a `T×T` buffer.
//!
//! Layout (all dense row-major, element type `F`, one buffer each, offset 0):
//! `q [tokens, heads, head_dim]`, `k`, `v [tokens, kv_heads, head_dim]`,
//! `out [tokens, heads, head_dim]`. The sequences lie back to back: sequence `s` is rows
//! `offsets[s]..offsets[s+1]`. Query head `h` reads KV head `h / (heads / kv_heads)` (HF
//! `repeat_kv`, done by indexing). The query at row `t` of a sequence attends to the keys of
//! the same sequence at rows `≤ t`.
//!
//! # Tiling
//!
//! One cube of [`UNITS`] units per (query tile, KV head, chunk of that KV head's query heads).
//! A cube owns [`ROWS`] *query rows*, a row being one (token, query head) pair: the
//! `heads_per_cube` query heads of its chunk (all heads of the group when the group has at most
//! [`ROWS`] heads: 16 for MiniCPM-SALA) for `ROWS / heads_per_cube` consecutive tokens. So every
//! K/V tile loaded into shared memory serves `ROWS` query rows, whatever the group size: with a
//! group of 16 the cube covers 2 tokens × 16 heads, without GQA 32 tokens × 1 head.
//!
//! Per key tile of `keys_per_tile` keys (16 at head_dim 128, 32 below: the largest that keeps
//! the cube under 32 KB of shared memory, the wgpu/lavapipe limit):
//!
//! 1. the K tile is staged in shared memory (cooperative, coalesced: consecutive units read
//!    consecutive elements of a key row);
//! 2. `S = Q·Kᵀ` for the cube's rows × the tile's keys, `Q` staged once per cube in shared
//!    memory, pre-scaled and in f32;
//! 3. the V tile replaces the K tile while one unit per row runs the online softmax over its
//!    row of `S` (running max and sum, `P = exp(S − max)` in place, the rescaling factor of the
//!    accumulator published in shared memory);
//! 4. `O ← α·O + P·V`, each unit holding a register tile of `O` (its rows × every 32nd column).
//!
//! The key loop of a cube runs from its sequence's start up to its own last row: tiles above
//! the diagonal are never visited, and the causal mask is only a shorter loop bound in the
//! softmax of the rows that cross the diagonal (masked keys get `P = 0`). Everything is f32 FMA
//! arithmetic (no tensor-core instructions, so that the kernel runs on lavapipe); shared arrays
//! are padded by one element per row so that the units of a plane reading down a column of
//! `Q`, `K` or `S` hit different banks.
//!
//! A query row's arithmetic depends only on its own sequence (tiles start at the sequence
//! start), so a packed call gives bit for bit the same output as one call per sequence.

use std::cmp::Reverse;

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::device::upload_slice;
use crate::error::{flush, KernelError};
use crate::launch::{check_addressable, cube_count};

/// Head dimensions the kernel is compiled for (a comptime parameter: register tiles and shared
/// arrays are sized from it).
pub const SUPPORTED_HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];

/// Units per cube (four planes of 32 on CUDA; within every backend's minimum of 256).
pub const UNITS: usize = 128;

/// Query rows — (token, query head) pairs — per cube.
pub const ROWS: usize = 32;

/// Units along the head dimension in the `P·V` step (a plane reads 32 consecutive elements of
/// a V row: conflict-free, and `P` values are broadcasts).
const LANES: usize = 32;

/// Bytes of shared memory a cube may use (the wgpu default limit, also lavapipe's).
const SHARED_BUDGET: usize = 32 * 1024;

/// The attention problem's head configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionShape {
    /// Query heads (`out` has as many).
    pub heads: usize,
    /// Key/value heads; `heads` must be a multiple of it (query head `h` reads KV head
    /// `h / (heads / kv_heads)`).
    pub kv_heads: usize,
    /// Elements per head, one of [`SUPPORTED_HEAD_DIMS`].
    pub head_dim: usize,
    /// Factor of the scores `scale · q·k` (the model passes `1/sqrt(head_dim)`); finite.
    pub scale: f32,
}

impl AttentionShape {
    /// Query heads per KV head (`heads / kv_heads`).
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }
}

/// How [`causal_gqa_attention`] tiles a problem (for benchmarks and reports).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionTiling {
    /// Query heads of one KV group per cube: the largest divisor of the group `≤ ROWS`.
    pub heads_per_cube: usize,
    /// Consecutive tokens per cube, `ROWS / heads_per_cube` (rounded down).
    pub tokens_per_cube: usize,
    /// Keys per shared-memory tile.
    pub keys_per_tile: usize,
    /// Units per cube ([`UNITS`]).
    pub units: usize,
    /// Bytes of shared memory per cube.
    pub shared_bytes: usize,
}

/// The tiling [`causal_gqa_attention`] uses for `shape`, or why it cannot run it (head_dim
/// not supported, heads not a multiple of kv_heads).
pub fn attention_tiling(shape: &AttentionShape) -> Result<AttentionTiling, KernelError> {
    if shape.heads == 0 || shape.kv_heads == 0 || shape.heads % shape.kv_heads != 0 {
        return Err(KernelError::shape(
            "attention heads",
            format!(
                "{} query heads are not a positive multiple of {} kv heads",
                shape.heads, shape.kv_heads
            ),
        ));
    }
    let d = shape.head_dim;
    if !SUPPORTED_HEAD_DIMS.contains(&d) {
        return Err(KernelError::unsupported(
            "attention head_dim",
            format!("{d} (supported: {SUPPORTED_HEAD_DIMS:?})"),
        ));
    }
    let group = shape.group();
    let heads_per_cube = (1..=group.min(ROWS))
        .rev()
        .find(|c| group % c == 0)
        .unwrap_or(1);
    let keys_per_tile = keys_per_tile(d);
    Ok(AttentionTiling {
        heads_per_cube,
        tokens_per_cube: ROWS / heads_per_cube,
        keys_per_tile,
        units: UNITS,
        shared_bytes: shared_floats(d, keys_per_tile) * size_of::<f32>(),
    })
}

/// Keys per tile: 32, or 16 at head_dim 128 where a 32-key tile would take the cube past
/// 32 KB of shared memory (`Q` alone is `ROWS × 129` floats, 16.5 KB).
fn keys_per_tile(head_dim: usize) -> usize {
    if head_dim > 64 {
        16
    } else {
        32
    }
}

/// f32 elements of shared memory per cube: `Q` (`ROWS × (d+1)`), the K-then-V tile
/// (`keys × (d+1)`), `S`/`P` (`ROWS × (keys+1)`), the rescaling factors and the final sums.
fn shared_floats(head_dim: usize, keys: usize) -> usize {
    ROWS * (head_dim + 1) + keys * (head_dim + 1) + ROWS * (keys + 1) + 2 * ROWS
}

/// `out[t, h, :] = Σ_j softmax_j(scale · q[t, h, :]·k[j, h/group, :]) · v[j, h/group, :]` over
/// the keys `j` of `t`'s sequence at rows `≤ t`, computed in f32 and stored as `F`.
///
/// - `offsets`: the sequence boundaries in rows (tokens), `[0, …, tokens]`, strictly
///   increasing (no empty sequence), at least one sequence;
/// - `q`, `out`: `[tokens, heads, head_dim]`; `k`, `v`: `[tokens, kv_heads, head_dim]`; whole
///   dense buffers of `F` (at least that many bytes; `out` must not alias an input).
///
/// Every input is checked here ([`KernelError::Shape`] for offsets, heads and buffer sizes,
/// [`KernelError::Unsupported`] for head_dim, a non-finite scale, 32-bit index overflow or a
/// device without the cube's shared memory). The work is queued and flushed, not awaited.
pub fn causal_gqa_attention<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    shape: &AttentionShape,
    offsets: &[usize],
    q: &Handle,
    k: &Handle,
    v: &Handle,
    out: &Handle,
) -> Result<(), KernelError> {
    let (tiling, _tokens) = check_inputs(shape, offsets, size_of::<F>(), [q, k, v, out])?;
    let (heads, kv_heads, d) = (shape.heads, shape.kv_heads, shape.head_dim);
    let hardware = &client.properties().hardware;
    if (hardware.max_units_per_cube as usize) < UNITS
        || hardware.max_shared_memory_size < tiling.shared_bytes
    {
        return Err(KernelError::unsupported(
            "attention device",
            format!(
                "the kernel needs {UNITS} units and {} bytes of shared memory per cube; the \
                 device allows {} and {}",
                tiling.shared_bytes, hardware.max_units_per_cube, hardware.max_shared_memory_size
            ),
        ));
    }
    debug_assert!(tiling.shared_bytes <= SHARED_BUDGET);

    let work = work_list(offsets, tiling.tokens_per_cube);
    let items = work.len() / 3;
    let chunks = shape.group() / tiling.heads_per_cube;
    let cubes = items * kv_heads * chunks;
    check_addressable("attention cubes", cubes.saturating_mul(UNITS))?;
    let count = cube_count(client, cubes)?;
    let work = upload_slice(client, &work);
    attention_kernel::launch::<F, R>(
        client,
        count,
        CubeDim::new_1d(UNITS as u32),
        typed_arg::<R, F>(q),
        typed_arg::<R, F>(k),
        typed_arg::<R, F>(v),
        typed_arg::<R, F>(out),
        // SAFETY: the work list holds exactly `3 · items` u32 values.
        unsafe { ArrayArg::from_raw_parts(work, 3 * items) },
        AttentionArgsLaunch::new(
            heads,
            kv_heads,
            shape.group(),
            tiling.heads_per_cube,
            tiling.tokens_per_cube,
            chunks,
            cubes,
            shape.scale,
        ),
        d,
        tiling.keys_per_tile,
        LANES.min(d),
    );
    flush(client, "attention")
}

/// The checks of [`causal_gqa_attention`] that do not depend on the kernel's device limits:
/// the head configuration ([`attention_tiling`]), a finite scale, the offsets, 32-bit
/// addressing of `q`/`k`, and the sizes of the buffers `[q, k, v, out]` for elements of
/// `elem` bytes. Returns the tiling and the token count. Shared with the cuBLAS route
/// (`cuda::blocked_causal_attention_bf16`), which has the same contract.
pub(crate) fn check_inputs(
    shape: &AttentionShape,
    offsets: &[usize],
    elem: usize,
    [q, k, v, out]: [&Handle; 4],
) -> Result<(AttentionTiling, usize), KernelError> {
    let tiling = attention_tiling(shape)?;
    if !shape.scale.is_finite() {
        return Err(KernelError::unsupported(
            "attention scale",
            format!("{} is not finite", shape.scale),
        ));
    }
    let tokens = check_offsets(offsets)?;
    let (heads, kv_heads, d) = (shape.heads, shape.kv_heads, shape.head_dim);
    let q_len = tokens.saturating_mul(heads).saturating_mul(d);
    let kv_len = tokens.saturating_mul(kv_heads).saturating_mul(d);
    check_addressable("attention queries", q_len)?;
    check_addressable("attention keys", kv_len)?;
    for (handle, len, what) in [
        (q, q_len, "attention q"),
        (k, kv_len, "attention k"),
        (v, kv_len, "attention v"),
        (out, q_len, "attention out"),
    ] {
        let bytes = handle.size_in_used() as usize;
        if bytes < len * elem {
            return Err(KernelError::shape(
                what,
                format!(
                    "a buffer of {bytes} bytes for {len} elements of {elem} bytes \
                     ({tokens} tokens)"
                ),
            ));
        }
    }
    Ok((tiling, tokens))
}

/// Checks the sequence boundaries; returns the token count (the last offset).
pub(crate) fn check_offsets(offsets: &[usize]) -> Result<usize, KernelError> {
    if offsets.len() < 2 {
        return Err(KernelError::shape(
            "attention offsets",
            format!("{offsets:?} holds no sequence (need [0, …, tokens])"),
        ));
    }
    if offsets[0] != 0 {
        return Err(KernelError::shape(
            "attention offsets",
            format!("the first offset is {}, not 0", offsets[0]),
        ));
    }
    if let Some(s) = offsets.windows(2).position(|w| w[1] <= w[0]) {
        return Err(KernelError::shape(
            "attention offsets",
            format!(
                "sequence {s} is {}..{}: offsets must be strictly increasing (no empty sequence)",
                offsets[s],
                offsets[s + 1]
            ),
        ));
    }
    Ok(offsets[offsets.len() - 1])
}

/// `[seq_start, tile_start, tile_end]` (token rows) of every query tile, longest key range
/// first: the cubes with the most work start first, so that the long tiles near the end of a
/// long sequence do not run alone at the end of the launch.
fn work_list(offsets: &[usize], tokens_per_cube: usize) -> Vec<u32> {
    let mut tiles = Vec::new();
    for w in offsets.windows(2) {
        let (start, end) = (w[0], w[1]);
        let mut t0 = start;
        while t0 < end {
            let t1 = (t0 + tokens_per_cube).min(end);
            tiles.push([start, t0, t1]);
            t0 = t1;
        }
    }
    tiles.sort_by_key(|&[start, _, end]| Reverse(end - start));
    // Offsets were checked to fit 32-bit indexing.
    tiles.iter().flatten().map(|&x| x as u32).collect()
}

/// A whole buffer of `F` as a kernel array argument.
pub(crate) fn typed_arg<R: Runtime, F: CubeElement>(handle: &Handle) -> ArrayArg<R> {
    let len = handle.size_in_used() as usize / size_of::<F>();
    // SAFETY: the length is the buffer's own length in elements of `F`, so every in-bounds
    // index is inside the allocation (and the launch is bounds-checked as well).
    unsafe { ArrayArg::from_raw_parts(handle.clone(), len) }
}

/// The runtime scalars of the kernel.
#[derive(CubeLaunch, CubeType)]
struct AttentionArgs {
    heads: usize,
    kv_heads: usize,
    /// Query heads per KV head.
    group: usize,
    heads_per_cube: usize,
    tokens_per_cube: usize,
    /// Chunks of `heads_per_cube` heads per group.
    chunks: usize,
    /// Cubes with work (`items · kv_heads · chunks`; the grid may have a few more).
    cubes: usize,
    scale: f32,
}

/// One cube per (work item, KV head, head chunk); see the module documentation for the steps.
///
/// `d` is the head dimension, `keys` the keys per tile, `lanes` the units along the head
/// dimension in the `P·V` step (`min(d, 32)`). Unit roles:
/// - `S` step: unit `u` computes key `u % keys` for rows `u / keys + i·(UNITS / keys)`;
/// - softmax: unit `u < ROWS` owns row `u` (its running max and sum live in its registers);
/// - `P·V` step and store: unit `u` owns rows `u / lanes + i·(UNITS / lanes)` × columns
///   `u % lanes + c·lanes`.
///
/// Every unit reaches every barrier: the loop bounds are uniform over the cube.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn attention_kernel<F: Float>(
    q: &Array<F>,
    k: &Array<F>,
    v: &Array<F>,
    out: &mut Array<F>,
    work: &Array<u32>,
    args: &AttentionArgs,
    #[comptime] d: usize,
    #[comptime] keys: usize,
    #[comptime] lanes: usize,
) {
    let cube = CUBE_POS;
    if cube < args.cubes {
        let stride = comptime!(d + 1);
        let p_stride = comptime!(keys + 1);
        let per_item = args.kv_heads * args.chunks;
        let item = cube / per_item;
        let sub = cube % per_item;
        let kv_head = sub / args.chunks;
        let h0 = kv_head * args.group + (sub % args.chunks) * args.heads_per_cube;
        let seq_start = work[3 * item] as usize;
        let t0 = work[3 * item + 1] as usize;
        let t_end = work[3 * item + 2] as usize;
        let gc = args.heads_per_cube;
        let used_rows = args.tokens_per_cube * gc;
        let u = UNIT_POS as usize;

        let mut q_s = SharedMemory::<f32>::new(comptime!(ROWS * (d + 1)));
        let mut kv_s = SharedMemory::<f32>::new(comptime!(keys * (d + 1)));
        let mut p_s = SharedMemory::<f32>::new(comptime!(ROWS * (keys + 1)));
        let mut alpha_s = SharedMemory::<f32>::new(ROWS);
        let mut l_s = SharedMemory::<f32>::new(ROWS);

        // Q, scaled, once per cube (rows past the tile are zero and never stored).
        #[unroll]
        for i in 0..comptime!(ROWS * d / UNITS) {
            let e = u + i * UNITS;
            let r = e / d;
            let c = e % d;
            let tok = t0 + r / gc;
            let mut x = 0.0f32;
            if r < used_rows && tok < t_end {
                x = f32::cast_from(q[(tok * args.heads + h0 + r % gc) * d + c]) * args.scale;
            }
            q_s[r * stride + c] = x;
        }

        // Softmax state of row `u` (units `u < ROWS`): the token of a padding row is the
        // tile's last, so that its (unused) softmax sees at least one key.
        let mut t_row = t_end - 1;
        if u < used_rows {
            let tok = t0 + u / gc;
            if tok < t_end {
                t_row = tok;
            }
        }
        // `f32::MIN`, below any score: the first tile's factor `exp(m_run − max)` is 0 (WGSL
        // has no infinity literal). Every row sees its sequence's first key in the first tile.
        let mut m_run = f32::min_value();
        let mut l_run = 0.0f32;

        let s_rows = comptime!(UNITS / keys);
        let s_per_unit = comptime!(ROWS / (UNITS / keys));
        let s_key = u % keys;
        let s_row0 = u / keys;

        let o_rows = comptime!(UNITS / lanes);
        let o_per_unit = comptime!(ROWS / (UNITS / lanes));
        let o_cols = comptime!(d / lanes);
        let o_col0 = u % lanes;
        let o_row0 = u / lanes;
        let mut acc = Array::<f32>::new(comptime!(ROWS / (UNITS / lanes) * (d / lanes)));
        #[unroll]
        for i in 0..comptime!(ROWS / (UNITS / lanes) * (d / lanes)) {
            acc[i] = 0.0f32;
        }
        let mut scores = Array::<f32>::new(comptime!(ROWS / (UNITS / keys)));
        let mut v_row = Array::<f32>::new(comptime!(d / lanes));
        let kv_row_stride = args.kv_heads * d;
        let kv_col0 = kv_head * d;

        let mut k0 = seq_start;
        while k0 < t_end {
            // The previous tile's P·V has finished reading `kv_s` (and `q_s` is complete).
            sync_cube();
            #[unroll]
            for i in 0..comptime!(keys * d / UNITS) {
                let e = u + i * UNITS;
                let j = e / d;
                let c = e % d;
                let key = k0 + j;
                let mut x = 0.0f32;
                if key < t_end {
                    x = f32::cast_from(k[key * kv_row_stride + kv_col0 + c]);
                }
                kv_s[j * stride + c] = x;
            }
            sync_cube();

            // S = Q·Kᵀ (scaled through Q).
            #[unroll]
            for i in 0..s_per_unit {
                scores[i] = 0.0f32;
            }
            for c in 0..d {
                let kx = kv_s[s_key * stride + c];
                #[unroll]
                for i in 0..s_per_unit {
                    scores[i] += q_s[(s_row0 + i * s_rows) * stride + c] * kx;
                }
            }
            #[unroll]
            for i in 0..s_per_unit {
                p_s[(s_row0 + i * s_rows) * p_stride + s_key] = scores[i];
            }
            sync_cube();

            // V replaces K while the row owners run the online softmax.
            #[unroll]
            for i in 0..comptime!(keys * d / UNITS) {
                let e = u + i * UNITS;
                let j = e / d;
                let c = e % d;
                let key = k0 + j;
                let mut x = 0.0f32;
                if key < t_end {
                    x = f32::cast_from(v[key * kv_row_stride + kv_col0 + c]);
                }
                kv_s[j * stride + c] = x;
            }
            if u < ROWS {
                // The causal mask: keys `k0 + j > t_row` (including every key past the
                // sequence's end) get P = 0; only tiles crossing the diagonal have any.
                let mut valid = 0usize;
                if t_row >= k0 {
                    valid = t_row - k0 + 1;
                }
                let mut m_new = m_run;
                for j in 0..keys {
                    let s = p_s[u * p_stride + j];
                    if j < valid && s > m_new {
                        m_new = s;
                    }
                }
                let alpha = (m_run - m_new).exp();
                let mut sum = 0.0f32;
                for j in 0..keys {
                    let mut p = 0.0f32;
                    if j < valid {
                        p = (p_s[u * p_stride + j] - m_new).exp();
                    }
                    p_s[u * p_stride + j] = p;
                    sum += p;
                }
                l_run = l_run * alpha + sum;
                m_run = m_new;
                alpha_s[u] = alpha;
            }
            sync_cube();

            // O ← α·O + P·V.
            #[unroll]
            for i in 0..o_per_unit {
                let alpha = alpha_s[o_row0 + i * o_rows];
                #[unroll]
                for c in 0..o_cols {
                    acc[i * o_cols + c] *= alpha;
                }
            }
            for j in 0..keys {
                #[unroll]
                for c in 0..o_cols {
                    v_row[c] = kv_s[j * stride + o_col0 + c * lanes];
                }
                #[unroll]
                for i in 0..o_per_unit {
                    let p = p_s[(o_row0 + i * o_rows) * p_stride + j];
                    #[unroll]
                    for c in 0..o_cols {
                        acc[i * o_cols + c] += p * v_row[c];
                    }
                }
            }
            k0 += keys;
        }

        if u < ROWS {
            l_s[u] = l_run;
        }
        sync_cube();
        #[unroll]
        for i in 0..o_per_unit {
            let r = o_row0 + i * o_rows;
            let tok = t0 + r / gc;
            if r < used_rows && tok < t_end {
                let inv = 1.0f32 / l_s[r];
                let base = (tok * args.heads + h0 + r % gc) * d + o_col0;
                #[unroll]
                for c in 0..o_cols {
                    out[base + c * lanes] = F::cast_from(acc[i * o_cols + c] * inv);
                }
            }
        }
    }
}
