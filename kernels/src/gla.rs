//! Chunked Simple GLA (gated linear attention with one constant decay per head) on the tensor
//! cores, bf16 in and out, f32 precision inside: [`simple_gla_bf16`].
//!
//! For head `h` with log-decay `g_h ≤ 0` (`γ = e^{g_h}`) the state is
//! `S_t = γ S_{t−1} + k_tᵀ v_t` (`[d, d]`, zero before each sequence) and the output
//! `o_t = scale · q_t S_t`, the current token included. Over chunks of [`GLA_CHUNK`] tokens,
//! with `S` the state entering the chunk and `i`, `j` positions inside it:
//!
//! - `o_i = scale · (γ^{i+1} q_i S + Σ_{j ≤ i} γ^{i−j} (q_i·k_j) v_j)`;
//! - the state leaving it is `γ^C S + Σ_j γ^{C−1−j} k_jᵀ v_j`.
//!
//! # Tiling
//!
//! One cube per (segment, head, block of [`GLA_VALUE_BLOCK`] value columns) walks the
//! segment's chunks in order, keeping its `[d, 64]` slice of the state in shared memory in
//! f32. A sequence longer than [`GLA_SEGMENT`] tokens is cut into segments of that many (the
//! last one shorter), so that one long sequence still fills the device: a first launch walks
//! every segment but the last of its sequence with the state update alone and writes the
//! state it leaves, starting from zero; the second computes the outputs, each segment
//! starting from the state that enters it, `Σ_{r<s} γ^{L·(s−1−r)} S_r` over the earlier
//! segments' local states `S_r` (`L` = [`GLA_SEGMENT`]), summed in f32 by the cube that needs
//! it. A sequence of at most [`GLA_SEGMENT`] tokens is one segment and needs no first launch. Per chunk, 8 planes: stage `q`, `k`, the value block and the decayed values
//! `γ^{C−1−j} v_j`; the scores `q·kᵀ` (exact products of bf16, f32 sums); the masked,
//! decayed, scaled scores `P`; `P·v` and `q·S`; the state update `γ^C S + kᵀ(γ^{C−1−j} v)`;
//! the output `P·v + scale·γ^{i+1} q·S`, rounded once to bf16.
//!
//! # Precision
//!
//! Every product runs on bf16 cooperative matrices (16×16×16 → f32). Operands that are f32
//! (`P`, the state, the decayed values) are split into `hi + lo`, both bf16
//! (`hi = bf16(x)`, `lo = bf16(x − hi)`, 16 significant bits), and multiplied as two products;
//! `q`, `k`, `v` are bf16 already, so those products are exact. The result agrees with an
//! f32 evaluation to about 2⁻¹⁶ relative before the final rounding to bf16, which dominates.

use std::cmp::Reverse;

use cubecl::prelude::*;
use cubecl::server::Handle;
use half::bf16;

use crate::attention::{check_offsets, typed_arg};
use crate::device::upload_slice;
use crate::error::{flush, KernelError};
use crate::launch::{bf16_cmma_supported, check_addressable, check_cube_resources, cube_count};

/// Head dimensions the kernel is compiled for.
pub const GLA_HEAD_DIMS: [usize; 2] = [64, 128];

/// Tokens per chunk.
pub const GLA_CHUNK: usize = 64;

/// Value columns (of one head) per cube.
pub const GLA_VALUE_BLOCK: usize = 64;

/// Tokens per segment of a long sequence (a multiple of [`GLA_CHUNK`]): at most 64 chunks
/// walked in order by one cube. A 131,072-token sequence with 32 heads of 128 is then 2048
/// cubes instead of 64, on a device of 132 multiprocessors that each hold one.
pub const GLA_SEGMENT: usize = 4096;

/// Planes per cube.
const PLANES: usize = 8;

/// Units per plane the kernel is written for (CUDA's warp).
const PLANE: usize = 32;

/// Units per cube.
const UNITS: usize = PLANES * PLANE;

/// Rows and columns of one cooperative matrix tile.
const TILE: usize = 16;

/// bf16 elements per 16-byte vector.
const VEC: usize = 8;

/// One 16-byte vector of bf16.
type V8 = Vector<bf16, Const<8>>;

/// Padding (bf16) of each staged row, so that the rows of a matrix fragment start in
/// different shared-memory banks.
const PAD: usize = VEC;

/// Row stride (bf16) of the 64-wide bf16 tiles (`P`, values, state halves).
const LDB: usize = GLA_CHUNK + PAD;

/// Row stride (f32) of the 64-wide f32 tiles (scores, products, state): a multiple of 4 (the
/// store's rule) that is not a multiple of 32.
const LDF: usize = GLA_CHUNK + 4;

/// The problem's head configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GlaShape {
    /// Heads (q, k, v and out all have as many).
    pub heads: usize,
    /// Elements per head (keys and values alike), one of [`GLA_HEAD_DIMS`].
    pub head_dim: usize,
    /// Factor of the output, `scale · q S` (the model passes `1/√head_dim`); finite.
    pub scale: f32,
}

/// How [`simple_gla_bf16`] tiles a problem (for benchmarks and reports).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GlaTiling {
    /// Cubes of the output launch (segments × heads × value blocks).
    pub cubes: usize,
    /// Cubes of the launch that computes the long sequences' segment states (segments
    /// followed by another of their sequence × heads × value blocks; 0 when no sequence is
    /// longer than a segment).
    pub state_cubes: usize,
    /// Bytes of shared memory per cube.
    pub shared_bytes: usize,
}

/// Bytes of shared memory of a cube: `q` and `k` chunks, the value block and its decayed
/// halves, `P`'s halves, the f32 state and its halves, the scores and the `q·S` scratch.
fn shared_bytes(head_dim: usize) -> usize {
    let bf16s = 2 * GLA_CHUNK * (head_dim + PAD) + 5 * GLA_CHUNK * LDB + 2 * head_dim * LDB;
    let f32s = head_dim * LDF + 2 * GLA_CHUNK * LDF;
    2 * bf16s + 4 * f32s
}

/// Whether `client`'s runtime offers what the kernel is built on (bf16 cooperative matrices
/// 16×16×16 → f32 with 32-unit planes).
pub fn simple_gla_supported<R: Runtime>(client: &ComputeClient<R>) -> bool {
    bf16_cmma_supported(client)
}

/// The tiling of a problem with [`GLA_SEGMENT`]-token segments, or why the kernel cannot run
/// it.
pub fn gla_tiling(shape: &GlaShape, offsets: &[usize]) -> Result<GlaTiling, KernelError> {
    segmented_tiling(shape, offsets, GLA_SEGMENT).map(|(tiling, _)| tiling)
}

/// The tiling with `segment`-token segments and the segments themselves.
fn segmented_tiling(
    shape: &GlaShape,
    offsets: &[usize],
    segment: usize,
) -> Result<(GlaTiling, Segments), KernelError> {
    if segment == 0 || segment % GLA_CHUNK != 0 {
        return Err(KernelError::unsupported(
            "gla segment",
            format!("{segment} tokens (a positive multiple of {GLA_CHUNK})"),
        ));
    }
    if shape.heads == 0 {
        return Err(KernelError::shape("gla heads", "0 heads"));
    }
    if !GLA_HEAD_DIMS.contains(&shape.head_dim) {
        return Err(KernelError::unsupported(
            "gla head_dim",
            format!("{} (supported: {GLA_HEAD_DIMS:?})", shape.head_dim),
        ));
    }
    if !shape.scale.is_finite() {
        return Err(KernelError::unsupported(
            "gla scale",
            format!("{} is not finite", shape.scale),
        ));
    }
    let tokens = check_offsets(offsets)?;
    check_addressable(
        "gla elements",
        tokens
            .saturating_mul(shape.heads)
            .saturating_mul(shape.head_dim),
    )?;
    let segments = Segments::of(offsets, segment);
    let per_item = shape.heads * (shape.head_dim / GLA_VALUE_BLOCK);
    let tiling = GlaTiling {
        cubes: segments.outputs.len() / WORK_ITEM * per_item,
        state_cubes: segments.states.len() / WORK_ITEM * per_item,
        shared_bytes: shared_bytes(shape.head_dim),
    };
    Ok((tiling, segments))
}

/// `γ_h^n` for `n = 0..=GLA_CHUNK` of every head, `[heads, GLA_CHUNK + 1]`, each computed as
/// `exp(g_h · n)` in f64 and stored as f32; errors unless every log-decay is finite and `≤ 0`.
fn decay_powers(log_decays: &[f64]) -> Result<Vec<f32>, KernelError> {
    if let Some(h) = log_decays.iter().position(|g| !g.is_finite() || *g > 0.0) {
        return Err(KernelError::unsupported(
            "gla log-decay",
            format!(
                "head {h} has log-decay {} (must be finite and ≤ 0)",
                log_decays[h]
            ),
        ));
    }
    Ok(log_decays
        .iter()
        .flat_map(|&g| (0..=GLA_CHUNK).map(move |n| (g * n as f64).exp() as f32))
        .collect())
}

/// `u32`s per work item: `[start, len, first_state, index]`, the segment's first token and
/// length, the state slot of its sequence's first segment and its index in the sequence.
const WORK_ITEM: usize = 4;

/// The work lists of the two launches.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Segments {
    /// Every segment, longest first (the longest cubes start first and do not run alone at the
    /// end of the launch).
    pub(crate) outputs: Vec<u32>,
    /// The segments whose state a later segment of their sequence reads.
    pub(crate) states: Vec<u32>,
    /// State slots (one per item of `states`).
    pub(crate) slots: usize,
}

impl Segments {
    /// The segments of `offsets`' sequences, `segment` tokens each (the last of a sequence
    /// shorter); the offsets were checked to fit 32-bit indexing.
    fn of(offsets: &[usize], segment: usize) -> Self {
        let mut outputs = Vec::new();
        let mut states = Vec::new();
        let mut slots = 0;
        for w in offsets.windows(2) {
            let (start, len) = (w[0], w[1] - w[0]);
            let count = len.div_ceil(segment);
            let first_state = slots;
            for index in 0..count {
                let seg_start = start + index * segment;
                let seg_len = segment.min(len - index * segment);
                let item = [seg_start, seg_len, first_state, index].map(|x| x as u32);
                outputs.push(item);
                if index + 1 < count {
                    states.push(item);
                    slots += 1;
                }
            }
        }
        outputs.sort_by_key(|item| Reverse(item[1]));
        Self {
            outputs: outputs.concat(),
            states: states.concat(),
            slots,
        }
    }
}

/// Simple GLA over the sequences of `offsets` lying back to back (the state restarts with each
/// one): `out[t, h, :] = scale · q[t, h, :] S_t` with `S_t = γ_h S_{t−1} + k[t, h, :]ᵀ v[t, h, :]`
/// and `γ_h = e^{log_decays[h]}`.
///
/// - `q`, `k`, `v`, `out`: `[tokens, heads, head_dim]`, dense bf16 buffers (`out` must not
///   alias an input);
/// - `offsets`: the sequence boundaries, `[0, …, tokens]`, strictly increasing;
/// - `log_decays`: one per head, finite and `≤ 0`.
///
/// Computed in f32 precision on the tensor cores (module docs), rounded once to bf16.
/// [`KernelError::Unsupported`] where the runtime lacks bf16 cooperative matrices
/// ([`simple_gla_supported`]), for head dims outside [`GLA_HEAD_DIMS`], or when the device
/// lacks the cube's shared memory; [`KernelError::Shape`] for offsets, decays and buffer
/// sizes. Queued and flushed, not awaited.
pub fn simple_gla_bf16<R: Runtime>(
    client: &ComputeClient<R>,
    shape: &GlaShape,
    offsets: &[usize],
    log_decays: &[f64],
    buffers: [&Handle; 4],
) -> Result<GlaTiling, KernelError> {
    simple_gla_bf16_in_segments(client, shape, offsets, log_decays, GLA_SEGMENT, buffers)
}

/// [`simple_gla_bf16`] with sequences cut into segments of `segment` tokens (a positive
/// multiple of [`GLA_CHUNK`]) instead of [`GLA_SEGMENT`]: the same function, summed in
/// another order (for tests of the segments' states at small sizes).
pub fn simple_gla_bf16_in_segments<R: Runtime>(
    client: &ComputeClient<R>,
    shape: &GlaShape,
    offsets: &[usize],
    log_decays: &[f64],
    segment: usize,
    [q, k, v, out]: [&Handle; 4],
) -> Result<GlaTiling, KernelError> {
    if !simple_gla_supported(client) {
        return Err(KernelError::unsupported(
            "gla device",
            "no 16×16×16 bf16 cooperative matrices with 32-unit planes on this runtime",
        ));
    }
    let plan = GlaPlan::new(shape, offsets, log_decays, segment, [q, k, v, out])?;
    let (tiling, segments) = (plan.tiling, &plan.segments);
    check_cube_resources(client, "gla device", UNITS, tiling.shared_bytes)?;
    let (d, len) = (shape.head_dim, plan.len);
    // Each state slot is written whole by the first launch before the second reads it.
    let states = client.empty(plan.state_values * size_of::<f32>());
    let tables = [
        upload_slice(client, &plan.powers),
        upload_slice(client, &plan.segment_decays),
    ];
    let table_lens = [plan.powers.len(), plan.segment_decays.len()];
    let launches = [
        (&segments.states, tiling.state_cubes, false),
        (&segments.outputs, tiling.cubes, true),
    ];
    for (work, cubes, outputs) in launches {
        if cubes == 0 {
            continue;
        }
        let count = cube_count(client, cubes)?;
        let work_len = work.len();
        let work = upload_slice(client, work);
        gla_kernel::launch::<R>(
            client,
            count,
            CubeDim::new_1d(UNITS as u32),
            vector_arg::<R>(q, len),
            vector_arg::<R>(k, len),
            typed_arg::<R, bf16>(v),
            typed_arg::<R, bf16>(out),
            typed_arg::<R, f32>(&states),
            // SAFETY: the tables hold exactly these many values.
            unsafe { ArrayArg::from_raw_parts(tables[0].clone(), table_lens[0]) },
            unsafe { ArrayArg::from_raw_parts(tables[1].clone(), table_lens[1]) },
            unsafe { ArrayArg::from_raw_parts(work, work_len) },
            GlaArgsLaunch::new(shape.heads, cubes, shape.scale),
            d,
            outputs,
        );
    }
    flush(client, "gla")?;
    Ok(tiling)
}

/// What a launch of either implementation needs, checked: the tiling, the work lists and the
/// decay tables.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct GlaPlan {
    pub(crate) tiling: GlaTiling,
    pub(crate) segments: Segments,
    /// `γ_h^n` for `n = 0..=GLA_CHUNK`, `[heads, GLA_CHUNK + 1]`.
    pub(crate) powers: Vec<f32>,
    /// `γ_h^L` per head (`L` the segment length), from f64 like the powers.
    pub(crate) segment_decays: Vec<f32>,
    /// bf16 elements of each of `q`, `k`, `v` and `out`: `[tokens, heads, head_dim]`.
    pub(crate) len: usize,
    /// f32 values of the segment states, `[slots, heads, d, d]` (at least one).
    pub(crate) state_values: usize,
}

impl GlaPlan {
    /// Checks a problem with `segment`-token segments against its buffers (`q`, `k`, `v`,
    /// `out`) and tabulates its decays.
    pub(crate) fn new(
        shape: &GlaShape,
        offsets: &[usize],
        log_decays: &[f64],
        segment: usize,
        buffers: [&Handle; 4],
    ) -> Result<Self, KernelError> {
        let (tiling, segments) = segmented_tiling(shape, offsets, segment)?;
        if log_decays.len() != shape.heads {
            return Err(KernelError::shape(
                "gla log-decays",
                format!("{} values for {} heads", log_decays.len(), shape.heads),
            ));
        }
        let powers = decay_powers(log_decays)?;
        let tokens = offsets[offsets.len() - 1];
        let len = tokens * shape.heads * shape.head_dim;
        for (buffer, what) in buffers
            .into_iter()
            .zip(["gla q", "gla k", "gla v", "gla out"])
        {
            let bytes = buffer.size_in_used() as usize;
            if bytes < len * size_of::<bf16>() {
                return Err(KernelError::shape(
                    what,
                    format!(
                        "{bytes} bytes for [{tokens}, {}, {}] bf16",
                        shape.heads, shape.head_dim
                    ),
                ));
            }
        }
        let d = shape.head_dim;
        let state_values = (segments.slots * shape.heads * d * d).max(1);
        check_addressable("gla segment states", state_values)?;
        let segment_decays = log_decays
            .iter()
            .map(|&g| (g * segment as f64).exp() as f32)
            .collect();
        Ok(Self {
            tiling,
            segments,
            powers,
            segment_decays,
            len,
            state_values,
        })
    }
}

/// The first `len` bf16 of a buffer (checked to hold them) as 16-byte vectors (`len` is a
/// multiple of 8: whole rows of a supported head dimension).
fn vector_arg<R: Runtime>(handle: &Handle, len: usize) -> ArrayArg<R> {
    // SAFETY: the buffer holds at least `len` bf16 (checked by the caller).
    unsafe { ArrayArg::from_raw_parts(handle.clone(), len / VEC) }
}

/// The runtime scalars of the kernel.
#[derive(CubeLaunch, CubeType)]
struct GlaArgs {
    heads: usize,
    /// Cubes with work (the grid may have a few more).
    cubes: usize,
    scale: f32,
}

/// `x` rounded to bf16 (`hi`) and the rest rounded to bf16 (`lo`), written at `at`.
#[cube]
fn split(x: f32, hi: &mut SharedMemory<bf16>, lo: &mut SharedMemory<bf16>, at: usize) {
    let h = bf16::cast_from(x);
    hi[at] = h;
    lo[at] = bf16::cast_from(x - f32::cast_from(h));
}

/// A zeroed 16×16 f32 accumulator.
#[cube]
fn zero_acc() -> cmma::Matrix<f32> {
    cmma::Matrix::<f32>::from_value(
        cmma::MatrixIdent::Accumulator,
        TILE,
        TILE,
        TILE,
        cmma::MatrixLayout::Undefined,
        0.0f32,
    )
}

/// An unloaded 16×16 bf16 operand.
#[cube]
fn operand(
    #[comptime] ident: cmma::MatrixIdent,
    #[comptime] layout: cmma::MatrixLayout,
) -> cmma::Matrix<bf16> {
    unsafe { cmma::Matrix::<bf16>::uninitialized(ident, TILE, TILE, TILE, layout) }
}

/// One cube per (segment, head, value block); see the module documentation for the steps.
/// With `outputs` it computes the segment's outputs from the state entering it; without, only
/// the state it leaves (from zero), into its slot of `states` (`[slots, heads, d, d]`).
///
/// Plane `p` computes the scores, `P·v` and `q·S` of chunk rows `16·(p % 4)..` and of two of
/// the four 16-column fragments (`2·(p / 4)`, `+1`), and the state update of state rows
/// `16·(p % (d/16))..` for its `d / 32` column fragments. Every unit reaches every barrier:
/// the chunk loop's bound is uniform over the cube.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn gla_kernel(
    q: &Array<V8>,
    k: &Array<V8>,
    v: &Array<bf16>,
    out: &mut Array<bf16>,
    states: &mut Array<f32>,
    powers: &Array<f32>,
    segment_decays: &Array<f32>,
    work: &Array<u32>,
    args: &GlaArgs,
    #[comptime] d: usize,
    #[comptime] outputs: bool,
) {
    let cube = CUBE_POS;
    if cube < args.cubes {
        let blocks = comptime!(d / GLA_VALUE_BLOCK);
        let c_len = comptime!(GLA_CHUNK);
        let ld = comptime!(d + PAD);
        let ldv = comptime!((d + PAD) / VEC);
        let dv = comptime!(d / VEC);
        let strips = comptime!(d / TILE);
        let frags_u = comptime!(d / 32);

        let block = cube % blocks;
        let head = (cube / blocks) % args.heads;
        let item = cube / (blocks * args.heads);
        let seq_start = work[WORK_ITEM * item] as usize;
        let seq_len = work[WORK_ITEM * item + 1] as usize;
        let first_state = work[WORK_ITEM * item + 2] as usize;
        let index = work[WORK_ITEM * item + 3] as usize;
        let u = UNIT_POS as usize;
        let plane = u / PLANE;
        let pw = head * (c_len + 1);
        let col0 = block * GLA_VALUE_BLOCK;

        let mut q_s =
            SharedMemory::<V8>::new_aligned(comptime!(GLA_CHUNK * (d + PAD) / VEC), 128usize);
        let mut k_s =
            SharedMemory::<V8>::new_aligned(comptime!(GLA_CHUNK * (d + PAD) / VEC), 128usize);
        let mut v_s = SharedMemory::<bf16>::new_aligned(comptime!(GLA_CHUNK * LDB), 128usize);
        let mut vd_hi = SharedMemory::<bf16>::new_aligned(comptime!(GLA_CHUNK * LDB), 128usize);
        let mut vd_lo = SharedMemory::<bf16>::new_aligned(comptime!(GLA_CHUNK * LDB), 128usize);
        let mut p_hi = SharedMemory::<bf16>::new_aligned(comptime!(GLA_CHUNK * LDB), 128usize);
        let mut p_lo = SharedMemory::<bf16>::new_aligned(comptime!(GLA_CHUNK * LDB), 128usize);
        let mut st = SharedMemory::<f32>::new_aligned(comptime!(d * LDF), 128usize);
        let mut st_hi = SharedMemory::<bf16>::new_aligned(comptime!(d * LDB), 128usize);
        let mut st_lo = SharedMemory::<bf16>::new_aligned(comptime!(d * LDB), 128usize);
        let mut sc = SharedMemory::<f32>::new_aligned(comptime!(GLA_CHUNK * LDF), 128usize);
        let mut qs = SharedMemory::<f32>::new_aligned(comptime!(GLA_CHUNK * LDF), 128usize);

        // The state entering the segment: zero, or for the outputs of a sequence's later
        // segment `Σ_{r<index} γ^{L·(index−1−r)} S_r`, by Horner's rule over the slots (each
        // unit sums its own elements, so no barrier).
        #[unroll]
        for i in 0..comptime!(d * GLA_VALUE_BLOCK / UNITS) {
            let e = u + i * UNITS;
            st[(e / GLA_VALUE_BLOCK) * LDF + e % GLA_VALUE_BLOCK] = 0.0f32;
        }
        if outputs {
            let gamma_segment = segment_decays[head];
            let mut r = 0usize;
            while r < index {
                let slot = ((first_state + r) * args.heads + head) * comptime!(d * d);
                #[unroll]
                for i in 0..comptime!(d * GLA_VALUE_BLOCK / UNITS) {
                    let e = u + i * UNITS;
                    let row = e / GLA_VALUE_BLOCK;
                    let c = e % GLA_VALUE_BLOCK;
                    let at = row * LDF + c;
                    st[at] = st[at] * gamma_segment + states[slot + row * d + col0 + c];
                }
                r += 1;
            }
            #[unroll]
            for i in 0..comptime!(d * GLA_VALUE_BLOCK / UNITS) {
                let e = u + i * UNITS;
                let r = e / GLA_VALUE_BLOCK;
                let c = e % GLA_VALUE_BLOCK;
                split(st[r * LDF + c], &mut st_hi, &mut st_lo, r * LDB + c);
            }
        }

        let strip = plane % 4;
        let half = plane / 4;
        let u_strip = plane % strips;
        let u_col = (plane / strips) * frags_u;
        let gamma_chunk = powers[pw + c_len];
        // Written out: the kernel language has no `div_ceil`.
        #[allow(clippy::manual_div_ceil)]
        let chunks = (seq_len + c_len - 1) / c_len;
        let mut chunk = 0usize;
        while chunk < chunks {
            let t0 = chunk * c_len;
            // A. Stage q and k of the chunk and the value block with its decayed halves (rows
            // past the sequence repeat its last token: the causal mask drops them, and the
            // state they touch is never read). The previous chunk's readers of these tiles
            // finished before its last barrier.
            #[unroll]
            for i in 0..comptime!(GLA_CHUNK * d / VEC / UNITS) {
                let e = u + i * UNITS;
                let j = e / dv;
                let c = e % dv;
                let mut t = t0 + j;
                if t >= seq_len {
                    t = seq_len - 1;
                }
                let src = ((seq_start + t) * args.heads + head) * dv + c;
                if outputs {
                    q_s[j * ldv + c] = q[src];
                }
                k_s[j * ldv + c] = k[src];
            }
            #[unroll]
            for i in 0..comptime!(GLA_CHUNK * GLA_VALUE_BLOCK / UNITS) {
                let e = u + i * UNITS;
                let j = e / GLA_VALUE_BLOCK;
                let c = e % GLA_VALUE_BLOCK;
                let mut t = t0 + j;
                if t >= seq_len {
                    t = seq_len - 1;
                }
                let x = v[((seq_start + t) * args.heads + head) * d + col0 + c];
                if outputs {
                    v_s[j * LDB + c] = x;
                }
                split(
                    f32::cast_from(x) * powers[pw + c_len - 1 - j],
                    &mut vd_hi,
                    &mut vd_lo,
                    j * LDB + c,
                );
            }
            sync_cube();

            // B. Scores q·kᵀ of the plane's rows and two column fragments.
            let mut q_frags = Sequence::<cmma::Matrix<bf16>>::new();
            if outputs {
                #[unroll]
                for kk in 0..comptime!(d / TILE) {
                    let a = operand(cmma::MatrixIdent::A, cmma::MatrixLayout::RowMajor);
                    cmma::load(
                        &a,
                        &q_s.slice((strip * TILE * ld + kk * TILE) / VEC, q_s.len()),
                        ld as u32,
                    );
                    q_frags.push(a);
                }
                #[unroll]
                for n in 0..2usize {
                    let col = (2 * half + n) * TILE;
                    let acc = zero_acc();
                    #[unroll]
                    for kk in 0..comptime!(d / TILE) {
                        let b = operand(cmma::MatrixIdent::B, cmma::MatrixLayout::ColMajor);
                        cmma::load(
                            &b,
                            &k_s.slice((col * ld + kk * TILE) / VEC, k_s.len()),
                            ld as u32,
                        );
                        cmma::execute::<bf16, bf16, f32, f32>(q_frags.index(kk), &b, &acc, &acc);
                    }
                    cmma::store(
                        &mut sc.slice_mut(strip * TILE * LDF + col, sc.len()),
                        &acc,
                        LDF as u32,
                        cmma::MatrixLayout::RowMajor,
                    );
                }
            }
            sync_cube();

            // C. P = scale · γ^{i−j} · (q_i·k_j) for j ≤ i, split; the state decays by γ^C.
            if outputs {
                #[unroll]
                for i in 0..comptime!(GLA_CHUNK * GLA_CHUNK / UNITS) {
                    let e = u + i * UNITS;
                    let r = e / c_len;
                    let c = e % c_len;
                    let mut p = 0.0f32;
                    if c <= r {
                        p = sc[r * LDF + c] * args.scale * powers[pw + r - c];
                    }
                    split(p, &mut p_hi, &mut p_lo, r * LDB + c);
                }
            }
            #[unroll]
            for i in 0..comptime!(d * GLA_VALUE_BLOCK / UNITS) {
                let e = u + i * UNITS;
                let at = (e / GLA_VALUE_BLOCK) * LDF + e % GLA_VALUE_BLOCK;
                st[at] = st[at] * gamma_chunk;
            }
            sync_cube();

            // D. P·v into the scores' scratch, q·S (the entering state) into its own.
            if outputs {
                #[unroll]
                for n in 0..2usize {
                    let col = (2 * half + n) * TILE;
                    let pv = zero_acc();
                    #[unroll]
                    for kk in 0..comptime!(GLA_CHUNK / TILE) {
                        let b = operand(cmma::MatrixIdent::B, cmma::MatrixLayout::RowMajor);
                        cmma::load(&b, &v_s.slice(kk * TILE * LDB + col, v_s.len()), LDB as u32);
                        let a = operand(cmma::MatrixIdent::A, cmma::MatrixLayout::RowMajor);
                        cmma::load(
                            &a,
                            &p_hi.slice(strip * TILE * LDB + kk * TILE, p_hi.len()),
                            LDB as u32,
                        );
                        cmma::execute::<bf16, bf16, f32, f32>(&a, &b, &pv, &pv);
                        cmma::load(
                            &a,
                            &p_lo.slice(strip * TILE * LDB + kk * TILE, p_lo.len()),
                            LDB as u32,
                        );
                        cmma::execute::<bf16, bf16, f32, f32>(&a, &b, &pv, &pv);
                    }
                    cmma::store(
                        &mut sc.slice_mut(strip * TILE * LDF + col, sc.len()),
                        &pv,
                        LDF as u32,
                        cmma::MatrixLayout::RowMajor,
                    );
                    let acc = zero_acc();
                    #[unroll]
                    for kk in 0..comptime!(d / TILE) {
                        let b = operand(cmma::MatrixIdent::B, cmma::MatrixLayout::RowMajor);
                        cmma::load(
                            &b,
                            &st_hi.slice(kk * TILE * LDB + col, st_hi.len()),
                            LDB as u32,
                        );
                        cmma::execute::<bf16, bf16, f32, f32>(q_frags.index(kk), &b, &acc, &acc);
                        cmma::load(
                            &b,
                            &st_lo.slice(kk * TILE * LDB + col, st_lo.len()),
                            LDB as u32,
                        );
                        cmma::execute::<bf16, bf16, f32, f32>(q_frags.index(kk), &b, &acc, &acc);
                    }
                    cmma::store(
                        &mut qs.slice_mut(strip * TILE * LDF + col, qs.len()),
                        &acc,
                        LDF as u32,
                        cmma::MatrixLayout::RowMajor,
                    );
                }
            }
            // The state update γ^C S + kᵀ(γ^{C−1−j} v) of the plane's state fragments (no
            // other plane reads the f32 state in this step).
            #[unroll]
            for n in 0..frags_u {
                let at = u_strip * TILE * LDF + (u_col + n) * TILE;
                let acc = zero_acc();
                cmma::load_with_layout(
                    &acc,
                    &st.slice(at, st.len()),
                    LDF as u32,
                    cmma::MatrixLayout::RowMajor,
                );
                #[unroll]
                for kk in 0..comptime!(GLA_CHUNK / TILE) {
                    let a = operand(cmma::MatrixIdent::A, cmma::MatrixLayout::ColMajor);
                    cmma::load(
                        &a,
                        &k_s.slice((kk * TILE * ld + u_strip * TILE) / VEC, k_s.len()),
                        ld as u32,
                    );
                    let b = operand(cmma::MatrixIdent::B, cmma::MatrixLayout::RowMajor);
                    let col = (u_col + n) * TILE;
                    cmma::load(
                        &b,
                        &vd_hi.slice(kk * TILE * LDB + col, vd_hi.len()),
                        LDB as u32,
                    );
                    cmma::execute::<bf16, bf16, f32, f32>(&a, &b, &acc, &acc);
                    cmma::load(
                        &b,
                        &vd_lo.slice(kk * TILE * LDB + col, vd_lo.len()),
                        LDB as u32,
                    );
                    cmma::execute::<bf16, bf16, f32, f32>(&a, &b, &acc, &acc);
                }
                cmma::store(
                    &mut st.slice_mut(at, st.len()),
                    &acc,
                    LDF as u32,
                    cmma::MatrixLayout::RowMajor,
                );
            }
            sync_cube();

            // E. The output of the chunk's rows inside the sequence, and the new state's halves
            // for the next chunk's q·S (its staging touches neither).
            if outputs {
                #[unroll]
                for i in 0..comptime!(GLA_CHUNK * GLA_VALUE_BLOCK / UNITS) {
                    let e = u + i * UNITS;
                    let r = e / GLA_VALUE_BLOCK;
                    let c = e % GLA_VALUE_BLOCK;
                    if t0 + r < seq_len {
                        let o =
                            sc[r * LDF + c] + qs[r * LDF + c] * (args.scale * powers[pw + r + 1]);
                        out[((seq_start + t0 + r) * args.heads + head) * d + col0 + c] =
                            bf16::cast_from(o);
                    }
                }
                #[unroll]
                for i in 0..comptime!(d * GLA_VALUE_BLOCK / UNITS) {
                    let e = u + i * UNITS;
                    let r = e / GLA_VALUE_BLOCK;
                    let c = e % GLA_VALUE_BLOCK;
                    split(st[r * LDF + c], &mut st_hi, &mut st_lo, r * LDB + c);
                }
            }
            chunk += 1;
        }
        if !outputs {
            // The state the segment leaves (complete since the last chunk's barrier).
            let slot = ((first_state + index) * args.heads + head) * comptime!(d * d);
            #[unroll]
            for i in 0..comptime!(d * GLA_VALUE_BLOCK / UNITS) {
                let e = u + i * UNITS;
                let r = e / GLA_VALUE_BLOCK;
                let c = e % GLA_VALUE_BLOCK;
                states[slot + r * d + col0 + c] = st[r * LDF + c];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_items_are_every_sequence_longest_first() {
        let s = Segments::of(&[0, 5, 105, 108], GLA_SEGMENT);
        assert_eq!(s.outputs, vec![5, 100, 0, 0, 0, 5, 0, 0, 105, 3, 0, 0]);
        assert!(s.states.is_empty());
        assert_eq!(s.slots, 0);
    }

    #[test]
    fn long_sequences_are_cut_into_segments_with_state_slots() {
        // 300 tokens in segments of 128: 128, 128, 44 (slots 0 and 1); then 128 tokens, one
        // segment; then 129: 128 and 1 (slot 2).
        let s = Segments::of(&[0, 300, 428, 557], 128);
        assert_eq!(s.slots, 3);
        assert_eq!(s.states, vec![0, 128, 0, 0, 128, 128, 0, 1, 428, 128, 2, 0]);
        assert_eq!(
            s.outputs,
            vec![
                0, 128, 0, 0, 128, 128, 0, 1, 300, 128, 2, 0, 428, 128, 2, 0, 256, 44, 0, 2, 556,
                1, 2, 1,
            ]
        );
        let shape = GlaShape {
            heads: 32,
            head_dim: 128,
            scale: 0.088,
        };
        let t = gla_tiling(&shape, &[0, 131_072]).unwrap();
        assert_eq!((t.cubes, t.state_cubes), (32 * 64, 31 * 64));
        assert!(segmented_tiling(&shape, &[0, 16], 100).is_err());
        assert!(segmented_tiling(&shape, &[0, 16], 0).is_err());
    }

    #[test]
    fn tiling_counts_cubes_and_refuses_what_it_cannot_run() {
        let shape = GlaShape {
            heads: 32,
            head_dim: 128,
            scale: 0.088,
        };
        let t = gla_tiling(&shape, &[0, 1024, 2048]).unwrap();
        assert_eq!(t.cubes, 2 * 32 * 2);
        assert!(t.shared_bytes <= 200 * 1024, "{}", t.shared_bytes);
        let odd = GlaShape {
            head_dim: 96,
            ..shape
        };
        assert!(gla_tiling(&odd, &[0, 16]).is_err());
        assert!(gla_tiling(&shape, &[0, 16, 16]).is_err());
        let nan = GlaShape {
            scale: f32::NAN,
            ..shape
        };
        assert!(gla_tiling(&nan, &[0, 16]).is_err());
    }

    #[test]
    fn decay_powers_are_exact_powers_and_refuse_growth() {
        let p = decay_powers(&[-0.5, 0.0]).unwrap();
        assert_eq!(p.len(), 2 * (GLA_CHUNK + 1));
        assert_eq!(p[0], 1.0);
        assert_eq!(p[3], (-1.5f64).exp() as f32);
        assert!(p[GLA_CHUNK + 1..].iter().all(|&x| x == 1.0));
        assert!(decay_powers(&[0.1]).is_err());
        assert!(decay_powers(&[f64::NEG_INFINITY]).is_err());
    }
}
