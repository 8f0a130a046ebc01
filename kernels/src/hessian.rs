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

/// Columns (and rows) per block of the symmetric Hessian products (CUDA's `xtx_runs_bf16`):
/// blocks of 2048 keep every GEMM large enough for cuBLAS's best kernels
/// (`2048 × 2048 × tokens`).
pub const XTX_BLOCK: usize = 2048;

/// How a symmetric product `XᵀX` `[dim, dim]` is split into GEMMs: only the blocks on and
/// below the block diagonal are multiplied, the others mirrored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XtxBlocking {
    /// Rows and columns per block (the last block of each row and column takes the rest).
    pub block: usize,
    /// One strided-batched GEMM per block diagonal for the whole blocks, instead of one GEMM
    /// per block. For `n` blocks per side the products are `(n + 1) / 2n` of the full
    /// product's work, so smaller blocks do less work, and batching keeps each call large.
    pub batched: bool,
}

impl Default for XtxBlocking {
    /// [`XTX_BLOCK`], one GEMM per block.
    fn default() -> Self {
        Self {
            block: XTX_BLOCK,
            batched: false,
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
    let mut groups = Vec::new();
    if blocking.batched {
        // The whole blocks, one group per block diagonal; the ragged last row of blocks alone.
        let whole = dim / block;
        for d in 0..whole {
            groups.push(XtxBlocks {
                row: d * block,
                col: 0,
                rows: block,
                cols: block,
                count: whole - d,
                step: block,
            });
        }
        if whole < starts.len() {
            let row = whole * block;
            groups.extend(starts.iter().map(|&col| single(row, col)));
        }
    } else {
        for (i, &row) in starts.iter().enumerate() {
            groups.extend(starts[..=i].iter().map(|&col| single(row, col)));
        }
    }
    groups
}
