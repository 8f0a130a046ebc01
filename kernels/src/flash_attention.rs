//! Causal grouped-query flash attention on the tensor cores, bf16 in and out:
//! [`flash_attention_bf16`].
//!
//! The contract is [`causal_gqa_attention`](crate::attention::causal_gqa_attention)'s (same
//! layouts, same packed varlen sequences, query head `h` reading KV head `h / group`), for bf16
//! buffers, with both products on the tensor cores through CubeCL's manual matrix-multiply
//! instructions (`mma.m16n8k16` bf16 → f32, operands moved by `ldmatrix`), whose register
//! layouts are known, so that scores, probabilities and the output never leave registers. It
//! needs a runtime that offers them ([`flash_attention_supported`]: CUDA); the portable
//! kernel stays the reference and the fallback.
//!
//! # Tiling
//!
//! A *row* is one (token, query head) pair. For KV head `kv`, the rows of one sequence are
//! numbered group-major, `f = token · group + j` for the group's query head `kv · group + j`:
//! the `group` heads that share a key lie next to each other, so one staged K/V tile serves
//! every head of the group. A cube of `planes` planes (32 units each) owns `16 · planes`
//! consecutive rows of one sequence and one KV head; plane `p` owns 16 of them, the `M` of its
//! matrix products, and keeps their `Q` fragments in registers for the whole loop.
//!
//! Per tile of [`KEYS_PER_TILE`] keys, from the sequence's first key up to the cube's last
//! token (tiles above the diagonal are never visited):
//!
//! 1. the cube stages the K and V tiles in shared memory (16-byte vector loads; keys past the
//!    sequence's end read its last key, which the mask then drops, so no value is undefined);
//! 2. each plane computes `S = Q·Kᵀ` for its 16 rows into f32 accumulators (registers);
//! 3. each row's online softmax runs on the four lanes that hold the row (the scale folded
//!    in, keys past the row's token masked to `P = 0`, maxima over the quad by shuffles),
//!    rescaling the output accumulators in place when a row's maximum rises;
//! 4. `O += P·V`, with `P`'s operand built from the score accumulators in registers (the
//!    accumulator and operand layouts of `m16n8k16` line up, as flash-attention 2 uses).
//!
//! The output is `O / l`, rounded once to bf16. `P` is rounded to bf16 before `P·V` (as
//! flash-attention does), the sum `l` is of the unrounded `P`, and `exp` is the fast hardware
//! approximation: expect differences of a few bf16 ulps against the f32 reference.

use std::cmp::Reverse;

use cubecl::ir::MatrixIdent;
use cubecl::prelude::*;
use cubecl::server::Handle;
use half::bf16;

use crate::attention::{check_inputs, AttentionShape};
use crate::device::upload_slice;
use crate::error::{flush, KernelError};
use crate::launch::{bf16_mma_supported, check_addressable, check_cube_resources, cube_count};

/// Head dimensions the kernel is compiled for (each lane holds `head_dim / 2` output values
/// in registers).
pub const FLASH_HEAD_DIMS: [usize; 2] = [64, 128];

/// Keys per staged K/V tile.
pub const KEYS_PER_TILE: usize = 64;

/// Planes per cube by default (64 rows per cube).
pub const DEFAULT_PLANES: usize = 4;

/// Units per plane the kernel is written for (CUDA's warp).
const PLANE: usize = 32;

/// Rows and columns of one cooperative matrix tile.
const TILE: usize = 16;

/// bf16 elements per 16-byte vector.
const VEC: usize = 8;

/// One 16-byte vector of bf16.
type V8 = Vector<bf16, Const<8>>;

/// Padding (bf16) of each staged K/V/Q row: a row of 128 or 256 bytes would start every row
/// of a matrix fragment in the same shared-memory banks; 16 more bytes spread them.
const ROW_PAD: usize = VEC;

/// How [`flash_attention_bf16`] tiles a problem (for benchmarks and reports).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlashTiling {
    /// Planes (of 32 units) per cube.
    pub planes: usize,
    /// Rows — (token, query head) pairs — per cube, `16 · planes`.
    pub rows_per_cube: usize,
    /// Cubes launched (work items × KV heads).
    pub cubes: usize,
    /// Bytes of shared memory per cube.
    pub shared_bytes: usize,
}

/// Bytes of shared memory of a cube: the K and V tiles (which first stage `Q`).
fn shared_bytes(head_dim: usize) -> usize {
    2 * KEYS_PER_TILE * (head_dim + ROW_PAD) * 2
}

/// Whether `client`'s runtime offers the manual `m16n8k16` bf16 → f32 matrix products and
/// the bf16 `ldmatrix` the kernel is built on, with 32-unit planes.
pub fn flash_attention_supported<R: Runtime>(client: &ComputeClient<R>) -> bool {
    bf16_mma_supported(client)
}

/// `[seq_start, seq_len, first_row]` of every cube's work item (rows numbered group-major
/// within the sequence), longest key range first so that the long items near the end of a
/// long sequence do not run alone at the end of the launch.
pub(crate) fn work_list(offsets: &[usize], group: usize, rows_per_cube: usize) -> Vec<u32> {
    let mut items = Vec::new();
    for w in offsets.windows(2) {
        let (start, len) = (w[0], w[1] - w[0]);
        let rows = len * group;
        let mut f0 = 0;
        while f0 < rows {
            let last_token = ((f0 + rows_per_cube).min(rows) - 1) / group;
            items.push(([start, len, f0], last_token));
            f0 += rows_per_cube;
        }
    }
    items.sort_by_key(|&(_, last)| Reverse(last));
    // The offsets were checked to fit 32-bit indexing (and `len · group` with them).
    items
        .iter()
        .flat_map(|(item, _)| item.iter().map(|&x| x as u32))
        .collect()
}

/// The tiling of a problem with `planes` planes per cube, or why the kernel cannot run it.
pub fn flash_tiling(
    shape: &AttentionShape,
    offsets: &[usize],
    planes: usize,
) -> Result<FlashTiling, KernelError> {
    crate::attention::attention_tiling(shape)?;
    let tokens = crate::attention::check_offsets(offsets)?;
    if !FLASH_HEAD_DIMS.contains(&shape.head_dim) {
        return Err(KernelError::unsupported(
            "flash attention head_dim",
            format!("{} (supported: {FLASH_HEAD_DIMS:?})", shape.head_dim),
        ));
    }
    if !(1..=8).contains(&planes) || planes & (planes - 1) != 0 {
        return Err(KernelError::unsupported(
            "flash attention planes",
            format!("{planes} (1, 2, 4 or 8)"),
        ));
    }
    let rows_per_cube = TILE * planes;
    check_addressable("flash attention rows", tokens.saturating_mul(shape.heads))?;
    let items: usize = offsets
        .windows(2)
        .map(|w| ((w[1] - w[0]) * shape.group()).div_ceil(rows_per_cube))
        .sum();
    Ok(FlashTiling {
        planes,
        rows_per_cube,
        cubes: items * shape.kv_heads,
        shared_bytes: shared_bytes(shape.head_dim),
    })
}

/// `out[t, h, :] = Σ_j softmax_j(scale · q[t, h, :]·k[j, h/group, :]) · v[j, h/group, :]` over
/// the keys `j` of `t`'s sequence at rows `≤ t`, on the tensor cores, with
/// [`DEFAULT_PLANES`] planes per cube. Buffers and checks as
/// [`causal_gqa_attention`](crate::attention::causal_gqa_attention) with bf16 elements;
/// [`KernelError::Unsupported`] where the runtime lacks the cooperative matrices
/// ([`flash_attention_supported`]), for head dimensions outside [`FLASH_HEAD_DIMS`] or when the
/// device lacks the cube's shared memory. Queued and flushed, not awaited.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_bf16<R: Runtime>(
    client: &ComputeClient<R>,
    shape: &AttentionShape,
    offsets: &[usize],
    q: &Handle,
    k: &Handle,
    v: &Handle,
    out: &Handle,
) -> Result<FlashTiling, KernelError> {
    flash_attention_bf16_with(client, shape, offsets, DEFAULT_PLANES, [q, k, v, out])
}

/// [`flash_attention_bf16`] with `planes` planes per cube (1, 2, 4 or 8: 16 rows each), for
/// benchmarks comparing tilings. Buffers `[q, k, v, out]`.
pub fn flash_attention_bf16_with<R: Runtime>(
    client: &ComputeClient<R>,
    shape: &AttentionShape,
    offsets: &[usize],
    planes: usize,
    [q, k, v, out]: [&Handle; 4],
) -> Result<FlashTiling, KernelError> {
    if !flash_attention_supported(client) {
        return Err(KernelError::unsupported(
            "flash attention device",
            "no manual m16n8k16 bf16 matrix products with ldmatrix and 32-unit planes on this runtime",
        ));
    }
    check_inputs(shape, offsets, size_of::<bf16>(), [q, k, v, out])?;
    let tiling = flash_tiling(shape, offsets, planes)?;
    let units = PLANE * planes;
    check_cube_resources(client, "flash attention device", units, tiling.shared_bytes)?;
    let (d, group) = (shape.head_dim, shape.group());
    let work = work_list(offsets, group, tiling.rows_per_cube);
    let items = work.len() / 3;
    let count = cube_count(client, tiling.cubes)?;
    let work = upload_slice(client, &work);
    // SAFETY: the work list holds exactly `3 · items` u32 values.
    let work = unsafe { ArrayArg::from_raw_parts(work, 3 * items) };
    // SAFETY: every index the kernel forms stays inside its buffer: `check_inputs` checked the
    // buffers against the shape and the offsets, the work list was built from those offsets
    // (rows past a sequence are clamped to its last token and never stored, keys past it read
    // its last key), and the shared-memory indices are bounded by the comptime tiling.
    unsafe {
        flash_kernel::launch_unchecked::<R>(
            client,
            count,
            CubeDim::new_1d(units as u32),
            vector_arg::<R>(q),
            vector_arg::<R>(k),
            vector_arg::<R>(v),
            pair_arg::<R>(out),
            work,
            FlashArgsLaunch::new(shape.heads, shape.kv_heads, group, items, shape.scale),
            d,
            planes,
        )
    };
    flush(client, "flash attention")?;
    Ok(tiling)
}

/// A whole bf16 buffer as an array of 16-byte vectors (its length is a multiple of 8
/// elements: a whole number of rows of a supported head dimension).
fn vector_arg<R: Runtime>(handle: &Handle) -> ArrayArg<R> {
    let len = handle.size_in_used() as usize / (VEC * size_of::<bf16>());
    // SAFETY: the length is the buffer's own length in vectors, every index inside it.
    unsafe { ArrayArg::from_raw_parts(handle.clone(), len) }
}

/// A whole bf16 buffer as an array of bf16 pairs (its length is even: whole rows).
fn pair_arg<R: Runtime>(handle: &Handle) -> ArrayArg<R> {
    let len = handle.size_in_used() as usize / (2 * size_of::<bf16>());
    // SAFETY: the length is the buffer's own length in pairs, every index inside it.
    unsafe { ArrayArg::from_raw_parts(handle.clone(), len) }
}

/// The runtime scalars of the kernel.
#[derive(CubeLaunch, CubeType)]
struct FlashArgs {
    heads: usize,
    kv_heads: usize,
    /// Query heads per KV head.
    group: usize,
    /// Work items (cubes with work are `items · kv_heads`).
    items: usize,
    scale: f32,
}

/// One bf16 register pair of a matrix fragment (what `mma` and `ldmatrix` move per register).
type Bf2 = Vector<bf16, Const<2>>;

/// Two f32 accumulator elements of one fragment row.
type F2 = Vector<f32, Const<2>>;

/// Rows, columns and depth of the `mma.m16n8k16` instruction the kernel is built on.
const MMA_M: usize = 16;
const MMA_N: usize = 8;
const MMA_K: usize = 16;

/// One cube per (work item, KV head); see the module documentation for the steps.
///
/// `d` is the head dimension, `planes` the planes per cube. Fragments follow PTX's
/// `m16n8k16` layout: lane `l` of a plane, `g = l / 4`, `t = l % 4`, holds of each 16×8
/// accumulator the elements at rows `g` and `g + 8`, columns `2t` and `2t + 1`; the four
/// lanes of a quad hold a whole row. Every unit reaches every barrier: loop bounds are uniform
/// over the cube, and planes whose rows are all masked still take part in the products.
#[cube(
    launch_unchecked,
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
#[allow(clippy::too_many_arguments)]
fn flash_kernel(
    q: &Array<V8>,
    k: &Array<V8>,
    v: &Array<V8>,
    out: &mut Array<Bf2>,
    work: &Array<u32>,
    args: &FlashArgs,
    #[comptime] d: usize,
    #[comptime] planes: usize,
) {
    let cube = CUBE_POS;
    if cube < args.items * args.kv_heads {
        let units = comptime!(PLANE * planes);
        let rows_per_cube = comptime!(TILE * planes);
        let dv = comptime!(d / VEC);
        // Staged rows are padded: `ldv` vectors apart.
        let ldv = comptime!((d + ROW_PAD) / VEC);
        let v_base = comptime!(KEYS_PER_TILE * (d + ROW_PAD) / VEC);
        let def = cmma::MmaDefinition::<bf16, bf16, f32>::new(MMA_M, MMA_N, MMA_K);

        let item = cube / args.kv_heads;
        let kv_head = cube % args.kv_heads;
        let seq_start = work[3 * item] as usize;
        let seq_len = work[3 * item + 1] as usize;
        let f0 = work[3 * item + 2] as usize;
        let g = args.group;
        let seq_rows = seq_len * g;
        let u = UNIT_POS as usize;
        let plane = u / PLANE;
        let lane = u % PLANE;
        let quad_row = lane / 4;
        let quad_col = lane % 4;
        // ldmatrix: lane `l` gives the address of row `l % 8` of matrix `l / 8`. Its offsets
        // (vectors) within a K tile (matrices: keys +0/+8 by `l / 16`, d +0/+8 by `l / 8 % 2`)
        // and a V tile (keys +0/+8 by `l / 8 % 2`, d +0/+8 by `l / 16`).
        let ld_matrix = lane / 8;
        let ld_row = lane % 8;
        let k_lane = ((ld_matrix / 2) * 8 + ld_row) * ldv + ld_matrix % 2;
        let v_lane = v_base + ((ld_matrix % 2) * 8 + ld_row) * ldv + ld_matrix / 2;

        // K then V tile (KEYS_PER_TILE rows of d each, `ldv` vectors apart); Q is staged here
        // first.
        let mut kv_s = SharedMemory::<V8>::new_aligned(comptime!(2 * v_base), 128usize);

        // Q of the cube's rows (rows past the sequence read its last token: never stored).
        #[unroll]
        for i in 0..comptime!(TILE * planes * d / VEC / (PLANE * planes)) {
            let e = u + i * units;
            let row = e / dv;
            let c = e % dv;
            let mut f = f0 + row;
            if f >= seq_rows {
                f = seq_rows - 1;
            }
            let tok = seq_start + f / g;
            let head = kv_head * g + f % g;
            kv_s[row * ldv + c] = q[(tok * args.heads + head) * dv + c];
        }
        sync_cube();
        // The plane's 16 rows as A fragments, one per 16 columns of d, kept in registers.
        let mut q_frags = Sequence::<Array<Bf2>>::new();
        #[unroll]
        for c in 0..comptime!(d / MMA_K) {
            let row = plane * TILE + lane % 16;
            let at = row * ldv + 2 * c + lane / 16;
            q_frags.push(def.load_matrix::<V8, Const<2>>(
                &kv_s.slice(at, at + 1),
                MatrixIdent::A,
                4usize,
                false,
            ));
        }
        sync_cube();

        // This lane's two rows (fragment rows `quad_row` and `quad_row + 8`): their tokens
        // (rows past the sequence take its last one, so that their unused softmax always sees
        // a key) and online-softmax state.
        let f_a = f0 + plane * TILE + quad_row;
        let f_b = f_a + 8;
        let valid_a = f_a < seq_rows;
        let valid_b = f_b < seq_rows;
        let tok_a = if valid_a { f_a / g } else { seq_len - 1 };
        let tok_b = if valid_b { f_b / g } else { seq_len - 1 };
        // [m_a, m_b, l_a, l_b]: the rows' running maxima (scaled scores) and the partial sums
        // of `P` over this lane's columns (the quad's four are added at the end).
        let mut state = Array::<f32>::new(4usize);
        state[0] = f32::min_value();
        state[1] = f32::min_value();
        state[2] = 0.0f32;
        state[3] = 0.0f32;
        let first_token = f0 / g;
        let mut o_frags = Sequence::<Array<F2>>::new();
        #[unroll]
        for _n in 0..comptime!(d / MMA_N) {
            o_frags.push(zero_accumulator());
        }

        let mut last_row = f0 + rows_per_cube;
        if last_row > seq_rows {
            last_row = seq_rows;
        }
        let last_token = (last_row - 1) / g;
        let kv_stride = args.kv_heads * dv;
        let mut k0 = 0usize;
        while k0 <= last_token {
            // Stage K and V (the previous tile's readers finished at the loop's last barrier).
            #[unroll]
            for i in 0..comptime!(KEYS_PER_TILE * d / VEC / (PLANE * planes)) {
                let e = u + i * units;
                let j = e / dv;
                let c = e % dv;
                let mut key = k0 + j;
                if key >= seq_len {
                    key = seq_len - 1;
                }
                let src = (seq_start + key) * kv_stride + kv_head * dv + c;
                kv_s[j * ldv + c] = k[src];
                kv_s[v_base + j * ldv + c] = v[src];
            }
            sync_cube();

            // S = Q·Kᵀ: one accumulator per 8 keys. A K row is a column of Kᵀ, so ldmatrix
            // without transposition gives the B fragments: matrices (keys 0–7, d 0–7),
            // (keys 0–7, d 8–15), (keys 8–15, d 0–7), (keys 8–15, d 8–15) of each 16 × 16.
            let mut s_frags = Sequence::<Array<F2>>::new();
            #[unroll]
            for _j in 0..comptime!(KEYS_PER_TILE / MMA_N) {
                s_frags.push(zero_accumulator());
            }
            #[unroll]
            for c in 0..comptime!(d / MMA_K) {
                #[unroll]
                for jj in 0..comptime!(KEYS_PER_TILE / 16) {
                    let at = k_lane + comptime!(16 * jj * ((d + ROW_PAD) / VEC) + 2 * c);
                    let b = def.load_matrix::<V8, Const<2>>(
                        &kv_s.slice(at, at + 1),
                        MatrixIdent::B,
                        4usize,
                        false,
                    );
                    let (b_lo, b_hi) = split_pairs(&b);
                    def.execute_inplace(q_frags.index(c), &b_lo, s_frags.index_mut(2 * jj));
                    def.execute_inplace(q_frags.index(c), &b_hi, s_frags.index_mut(2 * jj + 1));
                }
            }

            // Online softmax; tiles wholly below the diagonal of the cube's rows (all but the
            // last one or two) need no mask.
            if k0 + KEYS_PER_TILE <= first_token + 1 {
                online_softmax(
                    &mut s_frags,
                    &mut o_frags,
                    &mut state,
                    k0,
                    quad_col,
                    tok_a,
                    tok_b,
                    args.scale,
                    false,
                    d,
                );
            } else {
                online_softmax(
                    &mut s_frags,
                    &mut o_frags,
                    &mut state,
                    k0,
                    quad_col,
                    tok_a,
                    tok_b,
                    args.scale,
                    true,
                    d,
                );
            }

            // O += P·V. P's A fragment for keys 16kk..16kk+15 is the accumulators of keys
            // 16kk.. and 16kk+8.. side by side (PTX's layouts line up), rounded to bf16. V's B
            // fragments come from ldmatrix with transposition: matrices (keys 0–7, d 0–7),
            // (keys 8–15, d 0–7), (keys 0–7, d 8–15), (keys 8–15, d 8–15).
            #[unroll]
            for kk in 0..comptime!(KEYS_PER_TILE / MMA_K) {
                let p = p_fragment(s_frags.index(2 * kk), s_frags.index(2 * kk + 1));
                #[unroll]
                for n2 in 0..comptime!(d / 16) {
                    let at = v_lane + comptime!(16 * kk * ((d + ROW_PAD) / VEC) + 2 * n2);
                    let b = def.load_matrix::<V8, Const<2>>(
                        &kv_s.slice(at, at + 1),
                        MatrixIdent::B,
                        4usize,
                        true,
                    );
                    let (b_lo, b_hi) = split_pairs(&b);
                    def.execute_inplace(&p, &b_lo, o_frags.index_mut(2 * n2));
                    def.execute_inplace(&p, &b_hi, o_frags.index_mut(2 * n2 + 1));
                }
            }
            // Everyone is done with this tile's K and V before the next overwrites them.
            sync_cube();
            k0 += KEYS_PER_TILE;
        }

        // O / l, rounded once to bf16; each lane writes its column pairs of its two rows.
        let l_a = quad_sum(state[2]);
        let l_b = quad_sum(state[3]);
        let inv_a = F2::empty().fill(1.0f32 / l_a);
        let inv_b = F2::empty().fill(1.0f32 / l_b);
        let half_d = comptime!(d / 2);
        let base_a = ((seq_start + tok_a) * args.heads + kv_head * g + f_a % g) * half_d;
        let base_b = ((seq_start + tok_b) * args.heads + kv_head * g + f_b % g) * half_d;
        #[unroll]
        for n in 0..comptime!(d / MMA_N) {
            let o = o_frags.index(n);
            let col = n * comptime!(MMA_N / 2) + quad_col;
            if valid_a {
                out[base_a + col] = Bf2::cast_from(o[0] * inv_a);
            }
            if valid_b {
                out[base_b + col] = Bf2::cast_from(o[1] * inv_b);
            }
        }
    }
}

/// One tile's online softmax for a lane's two rows (`a`: fragment row `quad_row`, `b`: 8 rows
/// below), over its 16 keys of the tile; a row's maximum is its quad's (the four lanes that
/// hold the row). Turns the score accumulators into `P` in place, updates
/// `state = [m_a, m_b, l_a, l_b]` and rescales the output accumulators where a maximum rose.
/// With `masked`, keys past a row's token get `P = 0`; without, every key is visible.
#[cube]
#[allow(clippy::too_many_arguments)]
fn online_softmax(
    s_frags: &mut Sequence<Array<F2>>,
    o_frags: &mut Sequence<Array<F2>>,
    state: &mut Array<f32>,
    k0: usize,
    quad_col: usize,
    tok_a: usize,
    tok_b: usize,
    scale: f32,
    #[comptime] masked: bool,
    #[comptime] d: usize,
) {
    // The maximum of the raw scores (the scale is positive), scaled once.
    let mut raw_a = f32::min_value();
    let mut raw_b = f32::min_value();
    #[unroll]
    for j in 0..comptime!(KEYS_PER_TILE / MMA_N) {
        let s = s_frags.index(j);
        #[unroll]
        for e in 0..2usize {
            if masked {
                let key = k0 + j * MMA_N + 2 * quad_col + e;
                if key <= tok_a {
                    raw_a = f32::max(raw_a, s[0][e]);
                }
                if key <= tok_b {
                    raw_b = f32::max(raw_b, s[1][e]);
                }
            } else {
                raw_a = f32::max(raw_a, s[0][e]);
                raw_b = f32::max(raw_b, s[1][e]);
            }
        }
    }
    let m_a = f32::max(quad_max(raw_a) * scale, state[0]);
    let m_b = f32::max(quad_max(raw_b) * scale, state[1]);
    // The first tile starts every row (its key 0 is visible to all): O and l are 0.
    let mut alpha_a = 0.0f32;
    let mut alpha_b = 0.0f32;
    if k0 != 0 {
        alpha_a = (state[0] - m_a).exp();
        alpha_b = (state[1] - m_b).exp();
    }
    let mut sum_a = 0.0f32;
    let mut sum_b = 0.0f32;
    #[unroll]
    for j in 0..comptime!(KEYS_PER_TILE / MMA_N) {
        let s = s_frags.index_mut(j);
        let mut p_a = F2::empty();
        let mut p_b = F2::empty();
        #[unroll]
        for e in 0..2usize {
            p_a[e] = (s[0][e] * scale - m_a).exp();
            p_b[e] = (s[1][e] * scale - m_b).exp();
            if masked {
                let key = k0 + j * MMA_N + 2 * quad_col + e;
                if key > tok_a {
                    p_a[e] = 0.0f32;
                }
                if key > tok_b {
                    p_b[e] = 0.0f32;
                }
            }
            sum_a += p_a[e];
            sum_b += p_b[e];
        }
        s[0] = p_a;
        s[1] = p_b;
    }
    state[0] = m_a;
    state[1] = m_b;
    state[2] = state[2] * alpha_a + sum_a;
    state[3] = state[3] * alpha_b + sum_b;
    if plane_any(alpha_a != 1.0f32 || alpha_b != 1.0f32) {
        let scale_a = F2::empty().fill(alpha_a);
        let scale_b = F2::empty().fill(alpha_b);
        #[unroll]
        for n in 0..comptime!(d / MMA_N) {
            let o = o_frags.index_mut(n);
            o[0] = o[0] * scale_a;
            o[1] = o[1] * scale_b;
        }
    }
}

/// A 16×8 f32 accumulator of zeros (two register pairs per lane).
#[cube]
fn zero_accumulator() -> Array<F2> {
    let mut acc = Array::<F2>::new(2usize);
    acc[0] = F2::empty().fill(0.0f32);
    acc[1] = F2::empty().fill(0.0f32);
    acc
}

/// The two B fragments in the four registers of an `ldmatrix.x4`.
#[cube]
fn split_pairs(regs: &Array<Bf2>) -> (Array<Bf2>, Array<Bf2>) {
    let mut lo = Array::<Bf2>::new(2usize);
    let mut hi = Array::<Bf2>::new(2usize);
    lo[0] = regs[0];
    lo[1] = regs[1];
    hi[0] = regs[2];
    hi[1] = regs[3];
    (lo, hi)
}

/// The A fragment (16×16, bf16) of two neighbouring 16×8 accumulators.
#[cube]
fn p_fragment(left: &Array<F2>, right: &Array<F2>) -> Array<Bf2> {
    let mut a = Array::<Bf2>::new(4usize);
    a[0] = Bf2::cast_from(left[0]);
    a[1] = Bf2::cast_from(left[1]);
    a[2] = Bf2::cast_from(right[0]);
    a[3] = Bf2::cast_from(right[1]);
    a
}

/// The maximum over the four lanes of a quad (the lanes holding one fragment row).
#[cube]
fn quad_max(x: f32) -> f32 {
    let mut m = x;
    let other = plane_shuffle_xor(m, 1u32);
    if other > m {
        m = other;
    }
    let other = plane_shuffle_xor(m, 2u32);
    if other > m {
        m = other;
    }
    m
}

/// The sum over the four lanes of a quad.
#[cube]
fn quad_sum(x: f32) -> f32 {
    let s = x + plane_shuffle_xor(x, 1u32);
    s + plane_shuffle_xor(s, 2u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_items_cover_every_row_once_longest_first() {
        // Two sequences of 5 and 3 tokens, a group of 4 heads: 20 and 12 rows in cubes of 16.
        let work = work_list(&[0, 5, 8], 4, 16);
        let items: Vec<[u32; 3]> = work.chunks(3).map(|c| [c[0], c[1], c[2]]).collect();
        assert_eq!(items.len(), 3);
        let mut covered: Vec<(u32, u32)> = items
            .iter()
            .flat_map(|&[start, len, f0]| (f0..(f0 + 16).min(len * 4)).map(move |f| (start, f)))
            .collect();
        covered.sort_unstable();
        let expected: Vec<(u32, u32)> = (0..20)
            .map(|f| (0, f))
            .chain((0..12).map(|f| (5, f)))
            .collect();
        assert_eq!(covered, expected);
        // The item ending at the last token of the 5-token sequence comes first.
        assert_eq!(items[0], [0, 5, 16]);
    }

    #[test]
    fn tiling_refuses_unsupported_shapes_and_plane_counts() {
        let shape = AttentionShape {
            heads: 32,
            kv_heads: 2,
            head_dim: 128,
            scale: 0.088,
        };
        let t = flash_tiling(&shape, &[0, 1024, 2048], 4).unwrap();
        assert_eq!(t.rows_per_cube, 64);
        assert_eq!(t.cubes, 2 * (1024 * 16 / 64) * 2);
        assert!(t.shared_bytes <= 100 * 1024, "{}", t.shared_bytes);
        assert!(flash_tiling(&shape, &[0, 16], 3).is_err());
        let odd = AttentionShape {
            head_dim: 32,
            ..shape
        };
        assert!(flash_tiling(&odd, &[0, 16], 4).is_err());
    }
}
