//! Causal grouped-query flash attention on the tensor cores, bf16 in and out:
//! [`flash_attention_bf16`].
//!
//! The contract is [`causal_gqa_attention`](crate::attention::causal_gqa_attention)'s (same
//! layouts, same packed varlen sequences, query head `h` reading KV head `h / group`), for bf16
//! buffers, with both products on the tensor cores through CubeCL's cooperative matrices
//! (`cmma`, 16×16×16 bf16 → f32; WMMA on CUDA). It needs a runtime that offers that shape
//! ([`flash_attention_supported`]): the portable kernel stays the reference and the fallback.
//!
//! # Tiling
//!
//! A *row* is one (token, query head) pair. For KV head `kv`, the rows of one sequence are
//! numbered group-major, `f = token · group + j` for the group's query head `kv · group + j`:
//! the `group` heads that share a key lie next to each other, so one staged K/V tile serves
//! every head of the group. A cube of `planes` planes (32 units each) owns `16 · planes`
//! consecutive rows of one sequence and one KV head; plane `p` owns 16 of them, the `M` of its
//! 16×16 matrix tiles.
//!
//! Per tile of [`KEYS_PER_TILE`] keys, from the sequence's first key up to the cube's last
//! token (tiles above the diagonal are never visited):
//!
//! 1. the cube stages the K and V tiles in shared memory (16-byte vector loads; keys past the
//!    sequence's end read its last key, which the mask then drops, so no value is undefined);
//! 2. each plane computes `S = Q·Kᵀ` for its 16 rows (its `Q` fragments stay in registers
//!    for the whole loop) and stores it, f32, in its scratch;
//! 3. each row's online softmax (two lanes per row, the scale folded in, keys past the row's
//!    token masked to `P = 0`) writes `P` as bf16 and updates the row's running sum;
//! 4. `O += P·V` straight into the plane's accumulators.
//!
//! The rescaling `O ← α·O` of the online softmax is lazy: a row keeps its reference maximum
//! until a tile's maximum exceeds it by more than [`LAZY_RESCALE`] (so `P ≤ e⁸`); only then
//! does its plane store the accumulators to shared memory, rescale those rows and load them
//! back (the cooperative matrices hide which lane holds which element). Scores seldom climb
//! that far after the first tiles, so the accumulators stay in registers.
//!
//! The output is `O / l`, rounded once to bf16. `P` is rounded to bf16 before `P·V` (as
//! flash-attention does), the sum `l` is of the unrounded `P`: expect differences of a few
//! bf16 ulps against the f32 reference.

use std::cmp::Reverse;

use cubecl::prelude::*;
use cubecl::server::Handle;
use half::bf16;

use crate::attention::{check_inputs, typed_arg, AttentionShape};
use crate::device::upload_slice;
use crate::error::{flush, KernelError};
use crate::launch::{bf16_cmma_supported, check_addressable, check_cube_resources, cube_count};

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

/// Row stride (f32) of a plane's score scratch: a multiple of 4 (the store's rule) that is not
/// a multiple of 32, so that lanes reading different rows spread over the banks.
const S_STRIDE: usize = KEYS_PER_TILE + 4;

/// How far (natural log) a row's score maximum may rise above the reference maximum its
/// `P = exp(s − m)` uses before the reference moves and the row's output is rescaled: `P`
/// stays below `e⁸ ≈ 3000` (exact enough in bf16 and f32), and after the first tiles the
/// rescaling through shared memory almost never runs (FlashAttention-4's lazy rescaling).
pub const LAZY_RESCALE: f32 = 8.0;

/// Row stride (bf16) of a plane's `P` tile (a multiple of 8, the load's rule).
const P_STRIDE: usize = KEYS_PER_TILE + 8;

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

/// Row stride (f32) of a plane's output scratch.
fn o_stride(head_dim: usize) -> usize {
    head_dim + 4
}

/// f32 elements of one plane's scratch: the score tile and, later in the same step, the `P·V`
/// tile (16 rows each).
fn plane_scratch(head_dim: usize) -> usize {
    TILE * S_STRIDE.max(o_stride(head_dim))
}

/// Bytes of shared memory of a cube: the K and V tiles (which first stage `Q`), each plane's
/// f32 scratch and bf16 `P` tile.
fn shared_bytes(head_dim: usize, planes: usize) -> usize {
    2 * KEYS_PER_TILE * (head_dim + ROW_PAD) * 2
        + planes * (plane_scratch(head_dim) * 4 + TILE * P_STRIDE * 2)
}

/// Whether `client`'s runtime offers the 16×16×16 bf16 → f32 cooperative matrices the kernel
/// is built on, with 32-unit planes.
pub fn flash_attention_supported<R: Runtime>(client: &ComputeClient<R>) -> bool {
    bf16_cmma_supported(client)
}

/// `[seq_start, seq_len, first_row]` of every cube's work item (rows numbered group-major
/// within the sequence), longest key range first so that the long items near the end of a
/// long sequence do not run alone at the end of the launch.
fn work_list(offsets: &[usize], group: usize, rows_per_cube: usize) -> Vec<u32> {
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
        shared_bytes: shared_bytes(shape.head_dim, planes),
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
            "no 16×16×16 bf16 cooperative matrices with 32-unit planes on this runtime",
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
    flash_kernel::launch::<R>(
        client,
        count,
        CubeDim::new_1d(units as u32),
        vector_arg::<R>(q),
        vector_arg::<R>(k),
        vector_arg::<R>(v),
        typed_arg::<R, bf16>(out),
        // SAFETY: the work list holds exactly `3 · items` u32 values.
        unsafe { ArrayArg::from_raw_parts(work, 3 * items) },
        FlashArgsLaunch::new(shape.heads, shape.kv_heads, group, items, shape.scale),
        d,
        planes,
    );
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

/// One cube per (work item, KV head); see the module documentation for the steps.
///
/// `d` is the head dimension, `planes` the planes per cube. Lane `l` of plane `p` owns row
/// `r = l % 16` of the plane's 16 and the half `h = l / 16` of its keys (`h + 2i`) in the
/// softmax and of its output columns (`h + 2c`): interleaved, so that the two lanes of a row
/// hit neighbouring banks. Every unit reaches every barrier: loop bounds are uniform over the
/// cube, and planes whose rows are all masked still take part in the matrix products.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn flash_kernel(
    q: &Array<V8>,
    k: &Array<V8>,
    v: &Array<V8>,
    out: &mut Array<bf16>,
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
        // Staged rows are padded: `ld` bf16 (`ldv` vectors) apart.
        let ld = comptime!(d + ROW_PAD);
        let ldv = comptime!((d + ROW_PAD) / VEC);
        let o_str = comptime!(d + 4);
        let scratch_len = comptime!(TILE * if d + 4 > S_STRIDE { d + 4 } else { S_STRIDE });
        let half_d = comptime!(d / 2);

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
        let r = lane % TILE;
        let h = lane / TILE;

        // K then V tile (KEYS_PER_TILE rows of d each, `ld` apart); Q is staged here first.
        let mut kv_s = SharedMemory::<V8>::new_aligned(
            comptime!(2 * KEYS_PER_TILE * (d + ROW_PAD) / VEC),
            128usize,
        );
        let mut scratch =
            SharedMemory::<f32>::new_aligned(comptime!(planes * scratch_len), 128usize);
        let mut p_s =
            SharedMemory::<bf16>::new_aligned(comptime!(planes * TILE * P_STRIDE), 128usize);
        let scratch_base = plane * scratch_len;
        let p_base = plane * comptime!(TILE * P_STRIDE);

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
        let mut q_frags = Sequence::<cmma::Matrix<bf16>>::new();
        #[unroll]
        for c in 0..comptime!(d / TILE) {
            let m = unsafe {
                cmma::Matrix::<bf16>::uninitialized(
                    cmma::MatrixIdent::A,
                    TILE,
                    TILE,
                    TILE,
                    cmma::MatrixLayout::RowMajor,
                )
            };
            cmma::load(
                &m,
                &kv_s.slice((plane * TILE * ld + c * TILE) / VEC, kv_s.len()),
                ld as u32,
            );
            q_frags.push(m);
        }
        sync_cube();

        // This lane's row: its token (rows past the sequence take its last one, so that their
        // unused softmax always sees a key) and its online-softmax state.
        let mut f_row = f0 + plane * TILE + r;
        let row_valid = f_row < seq_rows;
        if !row_valid {
            f_row = seq_rows - 1;
        }
        let tok_row = f_row / g;
        // The row's reference maximum (raised lazily, see the module docs) and running sum;
        // the output accumulates in the plane's cooperative matrices.
        let mut m_run = f32::min_value();
        let mut l_run = 0.0f32;
        let mut o_frags = Sequence::<cmma::Matrix<f32>>::new();
        #[unroll]
        for _n in 0..comptime!(d / TILE) {
            o_frags.push(cmma::Matrix::<f32>::from_value(
                cmma::MatrixIdent::Accumulator,
                TILE,
                TILE,
                TILE,
                cmma::MatrixLayout::Undefined,
                0.0f32,
            ));
        }

        let mut last_row = f0 + rows_per_cube;
        if last_row > seq_rows {
            last_row = seq_rows;
        }
        let last_token = (last_row - 1) / g;
        let kv_stride = args.kv_heads * dv;
        let o_row = scratch_base + r * o_str + h;
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
                kv_s[comptime!(KEYS_PER_TILE * (d + ROW_PAD) / VEC) + j * ldv + c] = v[src];
            }
            sync_cube();

            // S = Q·Kᵀ for the plane's 16 rows, into its scratch.
            #[unroll]
            for n in 0..comptime!(KEYS_PER_TILE / TILE) {
                let acc = cmma::Matrix::<f32>::from_value(
                    cmma::MatrixIdent::Accumulator,
                    TILE,
                    TILE,
                    TILE,
                    cmma::MatrixLayout::Undefined,
                    0.0f32,
                );
                #[unroll]
                for c in 0..comptime!(d / TILE) {
                    let b = unsafe {
                        cmma::Matrix::<bf16>::uninitialized(
                            cmma::MatrixIdent::B,
                            TILE,
                            TILE,
                            TILE,
                            cmma::MatrixLayout::ColMajor,
                        )
                    };
                    cmma::load(
                        &b,
                        &kv_s.slice((n * TILE * ld + c * TILE) / VEC, kv_s.len()),
                        ld as u32,
                    );
                    cmma::execute::<bf16, bf16, f32, f32>(q_frags.index(c), &b, &acc, &acc);
                }
                cmma::store(
                    &mut scratch.slice_mut(scratch_base + n * TILE, scratch.len()),
                    &acc,
                    S_STRIDE as u32,
                    cmma::MatrixLayout::RowMajor,
                );
            }
            sync_plane();

            // Online softmax of row r over keys h + 2i of the tile (two lanes per row). The
            // reference maximum moves only at the first tile or when the tile's maximum
            // exceeds it by more than LAZY_RESCALE, so that `P ≤ e^LAZY_RESCALE` and the
            // output seldom needs rescaling.
            let s_row = scratch_base + r * S_STRIDE + h;
            let p_row = p_base + r * P_STRIDE + h;
            let mut m_tile = f32::min_value();
            #[unroll]
            for i in 0..comptime!(KEYS_PER_TILE / 2) {
                let s = scratch[s_row + 2 * i] * args.scale;
                if k0 + h + 2 * i <= tok_row && s > m_tile {
                    m_tile = s;
                }
            }
            let other = plane_shuffle_xor(m_tile, TILE as u32);
            if other > m_tile {
                m_tile = other;
            }
            let mut alpha = 1.0f32;
            if k0 == 0 {
                // Every row sees its sequence's first key here: O and l are still 0.
                m_run = m_tile;
            } else if m_tile > m_run + LAZY_RESCALE {
                alpha = (m_run - m_tile).exp();
                m_run = m_tile;
            }
            let mut sum = 0.0f32;
            #[unroll]
            for i in 0..comptime!(KEYS_PER_TILE / 2) {
                let mut p = 0.0f32;
                if k0 + h + 2 * i <= tok_row {
                    p = (scratch[s_row + 2 * i] * args.scale - m_run).exp();
                }
                p_s[p_row + 2 * i] = bf16::cast_from(p);
                sum += p;
            }
            sum += plane_shuffle_xor(sum, TILE as u32);
            l_run = l_run * alpha + sum;
            sync_plane();

            // Rows whose maximum moved rescale their output, through the scratch (the
            // cooperative matrices hide which lane holds which element).
            if plane_any(alpha != 1.0f32) {
                #[unroll]
                for n in 0..comptime!(d / TILE) {
                    cmma::store(
                        &mut scratch.slice_mut(scratch_base + n * TILE, scratch.len()),
                        o_frags.index(n),
                        o_str as u32,
                        cmma::MatrixLayout::RowMajor,
                    );
                }
                sync_plane();
                #[unroll]
                for c in 0..half_d {
                    scratch[o_row + 2 * c] = scratch[o_row + 2 * c] * alpha;
                }
                sync_plane();
                #[unroll]
                for n in 0..comptime!(d / TILE) {
                    cmma::load_with_layout(
                        o_frags.index(n),
                        &scratch.slice(scratch_base + n * TILE, scratch.len()),
                        o_str as u32,
                        cmma::MatrixLayout::RowMajor,
                    );
                }
            }

            // O += P·V.
            let mut p_frags = Sequence::<cmma::Matrix<bf16>>::new();
            #[unroll]
            for kk in 0..comptime!(KEYS_PER_TILE / TILE) {
                let a = unsafe {
                    cmma::Matrix::<bf16>::uninitialized(
                        cmma::MatrixIdent::A,
                        TILE,
                        TILE,
                        TILE,
                        cmma::MatrixLayout::RowMajor,
                    )
                };
                cmma::load(
                    &a,
                    &p_s.slice(p_base + kk * TILE, p_s.len()),
                    P_STRIDE as u32,
                );
                p_frags.push(a);
            }
            #[unroll]
            for n in 0..comptime!(d / TILE) {
                #[unroll]
                for kk in 0..comptime!(KEYS_PER_TILE / TILE) {
                    let b = unsafe {
                        cmma::Matrix::<bf16>::uninitialized(
                            cmma::MatrixIdent::B,
                            TILE,
                            TILE,
                            TILE,
                            cmma::MatrixLayout::RowMajor,
                        )
                    };
                    cmma::load(
                        &b,
                        &kv_s.slice(
                            (comptime!(KEYS_PER_TILE * (d + ROW_PAD)) + kk * TILE * ld + n * TILE)
                                / VEC,
                            kv_s.len(),
                        ),
                        ld as u32,
                    );
                    cmma::execute::<bf16, bf16, f32, f32>(
                        p_frags.index(kk),
                        &b,
                        o_frags.index(n),
                        o_frags.index(n),
                    );
                }
            }
            // Everyone is done with this tile's K, V, P and scratch before the next overwrites.
            sync_cube();
            k0 += KEYS_PER_TILE;
        }

        // O / l, through the scratch.
        #[unroll]
        for n in 0..comptime!(d / TILE) {
            cmma::store(
                &mut scratch.slice_mut(scratch_base + n * TILE, scratch.len()),
                o_frags.index(n),
                o_str as u32,
                cmma::MatrixLayout::RowMajor,
            );
        }
        sync_plane();
        if row_valid {
            let inv = 1.0f32 / l_run;
            let tok = seq_start + f_row / g;
            let head = kv_head * g + f_row % g;
            let base = (tok * args.heads + head) * d + h;
            #[unroll]
            for c in 0..half_d {
                out[base + 2 * c] = bf16::cast_from(scratch[o_row + 2 * c] * inv);
            }
        }
    }
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
