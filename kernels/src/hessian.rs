//! Hessian accumulation on the device: `H ← H + weight·XᵀX` for one activation batch, one
//! [`Gemm`] call in f32.
//!
//! The caller picks `weight` for its normalization, as `sala_hessian::HessianAccumulator`
//! does: `1/tokens` per sample then `1/samples` at the end (per-sample), or `1` per batch
//! then `1/total tokens` (per-token); see [`normalization_weight`].

use cubecl::prelude::{ComputeClient, Runtime};
use sala_hessian::Normalization;

use crate::device::MatrixView;
use crate::error::KernelError;
use crate::gemm::Gemm;

/// `h ← h + weight·xᵀx`, `x [tokens, dim]`, `h [dim, dim]` (both triangles written).
pub fn accumulate_xtx<R: Runtime, G: Gemm<R>>(
    client: &ComputeClient<R>,
    gemm: &G,
    x: &MatrixView,
    weight: f32,
    h: &MatrixView,
) -> Result<(), KernelError> {
    if h.rows != x.cols || h.cols != x.cols {
        return Err(KernelError::shape(
            "accumulate_xtx",
            format!("x is {}×{}, h is {}×{}", x.rows, x.cols, h.rows, h.cols),
        ));
    }
    if !weight.is_finite() {
        return Err(KernelError::unsupported(
            "hessian batch weight",
            format!("{weight} is not finite"),
        ));
    }
    gemm.gemm(client, weight, x, true, x, false, 1.0, h)
}

/// The factor of one batch of `tokens` tokens under `normalization` (`1/tokens` per sample,
/// `1` per token); the final division by the sample or token count is the caller's.
pub fn normalization_weight(normalization: Normalization, tokens: usize) -> f32 {
    match normalization {
        Normalization::PerSample => 1.0 / tokens.max(1) as f32,
        Normalization::PerToken => 1.0,
    }
}

/// Columns (and rows) of the largest diagonal block of the symmetric Hessian products
/// (CUDA's `xtx_runs_bf16`), which halve the product down to it. Measured on an H100 at
/// 16,384 tokens (`bench_gpu`'s `hessian_*` rows, docs/results.md, "Forty-first session"):
/// halving to 1024, each level one strided-batched call, takes 4 % less time than the grid
/// of 2048 at 16384 wide and 11 % less at 4096; halving to 512 is within 1 % of it.
pub const XTX_BLOCK: usize = 1024;

/// How a symmetric product `XᵀX` `[dim, dim]` is split into GEMMs: only the blocks on and
/// below the block diagonal are multiplied, the others mirrored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XtxBlocking {
    /// Rows and columns per block of the grid (the last block of each row and column takes
    /// the rest); with `halving`, the widest diagonal block.
    pub block: usize,
    /// One strided-batched GEMM per group of equal blocks instead of one GEMM per block: per
    /// block diagonal on the grid, per level of halving. For `n` blocks per side the
    /// products are `(n + 1) / 2n` of the full product's work, so smaller blocks do less
    /// work, and batching keeps each call large.
    pub batched: bool,
    /// Halve the product recursively instead of cutting it into a grid: each split's
    /// strictly lower quarter is one rectangle (`dim/2`, `dim/4`, … wide) down to diagonal
    /// blocks of at most `block`. The same entries as the grid of `block` where `dim` is
    /// `block` times a power of two, in far fewer and larger GEMMs (15 instead of 36 at
    /// 16384 / 2048; 4 calls batched).
    pub halving: bool,
}

impl Default for XtxBlocking {
    /// Halving down to diagonal blocks of [`XTX_BLOCK`], one strided-batched GEMM per level.
    fn default() -> Self {
        Self {
            block: XTX_BLOCK,
            batched: true,
            halving: true,
        }
    }
}

/// `count` blocks of `rows × cols` of a `[dim, dim]` product, the `k`-th at row
/// `row + k·step`, column `col + k·step`: one GEMM, strided-batched when `count > 1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XtxBlocks {
    /// First row of the first block.
    pub row: usize,
    /// First column of the first block.
    pub col: usize,
    /// Rows per block.
    pub rows: usize,
    /// Columns per block.
    pub cols: usize,
    /// Blocks in the group (at least 1).
    pub count: usize,
    /// Rows and columns from one block to the next.
    pub step: usize,
}

impl XtxBlocks {
    /// `(row, col)` of each block of the group.
    pub fn origins(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.count).map(|k| (self.row + k * self.step, self.col + k * self.step))
    }
}

/// The blocks on and below the block diagonal of a `[dim, dim]` product under `blocking`, in
/// the groups that one GEMM call computes. Each entry `(r, c)` whose block row is at or below
/// its block column lies in exactly one block; the blocks strictly below the diagonal are the
/// ones to mirror. A `blocking.block` of 0 is taken as 1.
pub fn xtx_lower_blocks(dim: usize, blocking: XtxBlocking) -> Vec<XtxBlocks> {
    let block = blocking.block.max(1);
    if blocking.halving {
        return halving_blocks(dim, block, blocking.batched);
    }
    let starts: Vec<usize> = (0..dim).step_by(block).collect();
    let size = |start: usize| block.min(dim - start);
    let single = |row: usize, col: usize| XtxBlocks {
        row,
        col,
        rows: size(row),
        cols: size(col),
        count: 1,
        step: 0,
    };
    let mut blocks = Vec::new();
    for (i, &row) in starts.iter().enumerate() {
        blocks.extend(starts[..=i].iter().map(|&col| single(row, col)));
    }
    if blocking.batched {
        // Block diagonal by block diagonal, so that each one's whole blocks are consecutive
        // (the ragged last row's blocks differ in shape and stay alone).
        blocks.sort_by_key(|b| (b.row - b.col, b.col));
    }
    batch_equal_blocks(blocks, blocking.batched)
}

/// [`xtx_lower_blocks`] by recursive halving: level by level, the rectangle below the
/// diagonal of each span longer than `block` (rows: its second half, columns: its first),
/// then the diagonal blocks of the spans at most `block` long.
fn halving_blocks(dim: usize, block: usize, batched: bool) -> Vec<XtxBlocks> {
    let single = |row, col, rows, cols| XtxBlocks {
        row,
        col,
        rows,
        cols,
        count: 1,
        step: 0,
    };
    let (mut groups, mut diagonal) = (Vec::new(), Vec::new());
    // Spans `(start, len)` still to split, in order along the diagonal.
    let mut spans = if dim == 0 { vec![] } else { vec![(0, dim)] };
    while !spans.is_empty() {
        let mut level = Vec::new();
        let mut next = Vec::new();
        for (start, len) in spans {
            if len <= block {
                diagonal.push(single(start, start, len, len));
                continue;
            }
            let half = len.div_ceil(2);
            level.push(single(start + half, start, len - half, half));
            next.extend([(start, half), (start + half, len - half)]);
        }
        groups.extend(batch_equal_blocks(level, batched));
        spans = next;
    }
    groups.extend(batch_equal_blocks(diagonal, batched));
    groups
}

/// Consecutive single blocks of one shape whose origins advance by the same step along the
/// diagonal merged into one group (when `batched`; otherwise the blocks as they are).
fn batch_equal_blocks(blocks: Vec<XtxBlocks>, batched: bool) -> Vec<XtxBlocks> {
    if !batched {
        return blocks;
    }
    let mut groups: Vec<XtxBlocks> = Vec::new();
    for b in blocks {
        if let Some(g) = groups.last_mut() {
            let last = (
                g.row + (g.count - 1) * g.step,
                g.col + (g.count - 1) * g.step,
            );
            let along_diagonal = match (b.row.checked_sub(last.0), b.col.checked_sub(last.1)) {
                (Some(dr), Some(dc)) if dr == dc && dr > 0 => Some(dr),
                _ => None,
            };
            let same_shape = (g.rows, g.cols) == (b.rows, b.cols);
            match along_diagonal {
                Some(step) if same_shape && (g.count == 1 || step == g.step) => {
                    g.step = step;
                    g.count += 1;
                    continue;
                }
                _ => {}
            }
        }
        groups.push(b);
    }
    groups
}
