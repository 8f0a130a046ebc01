//! Per-channel statistics of a layer input in one pass: [`channel_sums`].
//!
//! For `x` `[rows, cols]` and a weight `w_r` per row, the three sums NVFP4's scales and
//! SmoothQuant read, per column `c`:
//!
//! - `Σ_r w_r · x[r, c]²` (`(|x|·w)·|x|` per element, in f32);
//! - `Σ_r w_r · |x[r, c]|`;
//! - `max_r |x[r, c]|`.
//!
//! One cube of units covers [`CHANNEL_UNITS`] neighbouring columns (a row's loads are
//! contiguous) over a block of rows ([`ChannelBlocks`]) and writes its three partial results;
//! the caller folds the blocks (a sum over `blocks` rows of `[blocks, cols]` f32 is small). As
//! a chain of tensor ops the same statistics take seven passes over f32 copies of the input;
//! here the input is read once, in its storage type.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::error::{flush, KernelError};
use crate::launch::{check_addressable, cube_count};

/// Units (columns) per cube.
pub const CHANNEL_UNITS: usize = 256;

/// Rows per block at least: a unit's loop is long enough to hide its loads' latency.
const MIN_BLOCK_ROWS: usize = 256;

/// Blocks at most: bounds the partial results (`3 · blocks · cols` f32, 100 MB for 16384
/// columns) whatever the row count.
const MAX_BLOCKS: usize = 512;

/// How [`channel_sums`] splits `rows` rows into blocks of rows, each one partial result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelBlocks {
    /// Blocks of rows (at least 1).
    pub blocks: usize,
    /// Rows per block (the last block takes the rest).
    pub rows_per_block: usize,
}

impl ChannelBlocks {
    /// Blocks of at least 256 rows, at most 512 of them.
    pub fn for_rows(rows: usize) -> Self {
        let rows_per_block = rows.div_ceil(MAX_BLOCKS).max(MIN_BLOCK_ROWS);
        Self {
            blocks: rows.div_ceil(rows_per_block).max(1),
            rows_per_block,
        }
    }

    /// f32 values of the partial results for `cols` columns: `[3, blocks, cols]`.
    pub fn partial_len(&self, cols: usize) -> usize {
        3 * self.blocks * cols
    }
}

/// The statistics of the module docs for `x` `[rows, cols]` (dense, row-major, `S`) with
/// per-row weights `weights` `[rows]` (f32), as partial results per block of rows of
/// [`ChannelBlocks::for_rows`]: `partials` `[3, blocks, cols]` f32 holds the weighted sums of
/// squares in `[0, b, c]`, the weighted sums of absolute values in `[1, b, c]` and the maxima of
/// absolute values in `[2, b, c]` of block `b`'s rows. The caller sums (`[0]`, `[1]`) and maxes
/// (`[2]`) over `b`. With no rows or no columns nothing is written. Queued and flushed, not
/// awaited.
pub fn channel_sums<R: Runtime, S: Float + CubeElement>(
    client: &ComputeClient<R>,
    x: &Handle,
    weights: &Handle,
    partials: &Handle,
    rows: usize,
    cols: usize,
) -> Result<(), KernelError> {
    let len = rows
        .checked_mul(cols)
        .ok_or_else(|| KernelError::shape("channel sums", format!("{rows} × {cols} overflows")))?;
    let blocks = ChannelBlocks::for_rows(rows);
    let partial_len = blocks.partial_len(cols);
    check_addressable("channel sums input", len)?;
    check_addressable("channel sums partials", partial_len)?;
    for (what, handle, bytes) in [
        ("channel sums x", x, len * size_of::<S>()),
        ("channel sums weights", weights, rows * 4),
        ("channel sums partials", partials, partial_len * 4),
    ] {
        let held = handle.size_in_used() as usize;
        if held < bytes {
            return Err(KernelError::shape(
                what,
                format!("{held} bytes where {bytes} are needed ({rows} × {cols})"),
            ));
        }
    }
    if len == 0 {
        return Ok(());
    }
    let column_blocks = cols.div_ceil(CHANNEL_UNITS);
    let units = CHANNEL_UNITS.min(client.properties().hardware.max_units_per_cube as usize);
    if units < CHANNEL_UNITS {
        return Err(KernelError::unsupported(
            "channel sums",
            format!("{units} units per cube ({CHANNEL_UNITS} needed)"),
        ));
    }
    let count = cube_count(client, column_blocks * blocks.blocks)?;
    // SAFETY: every buffer was checked against the lengths above; the kernel reads `x` and
    // `weights` only at rows below `rows` and columns below `cols`, and writes `partials`
    // only at blocks below `blocks.blocks`.
    unsafe {
        channel_sums_kernel::launch_unchecked::<S, R>(
            client,
            count,
            CubeDim::new_1d(CHANNEL_UNITS as u32),
            ArrayArg::from_raw_parts(x.clone(), len),
            ArrayArg::from_raw_parts(weights.clone(), rows),
            ArrayArg::from_raw_parts(partials.clone(), partial_len),
            rows,
            cols,
            column_blocks,
            blocks.blocks,
            blocks.rows_per_block,
        )
    };
    flush(client, "channel sums")
}

/// One unit per column of a block of rows: the three statistics of that column over those
/// rows, in registers, then written once. Cube `i` takes column block `i mod column_blocks`
/// and row block `i / column_blocks`; cubes past the last block (the grid is rounded up) stop.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn channel_sums_kernel<S: Float>(
    x: &Array<S>,
    weights: &Array<f32>,
    partials: &mut Array<f32>,
    rows: usize,
    cols: usize,
    column_blocks: usize,
    blocks: usize,
    rows_per_block: usize,
) {
    let cube = CUBE_POS;
    let col = (cube % column_blocks) * CUBE_DIM as usize + UNIT_POS as usize;
    let block = cube / column_blocks;
    if col < cols && block < blocks {
        let first = block * rows_per_block;
        let mut end = first + rows_per_block;
        if end > rows {
            end = rows;
        }
        let mut square = 0.0f32;
        let mut abs = 0.0f32;
        let mut max = 0.0f32;
        let mut r = first;
        while r < end {
            let a = f32::cast_from(x[r * cols + col]).abs();
            let weighted = a * weights[r];
            square += weighted * a;
            abs += weighted;
            max = f32::max(max, a);
            r += 1;
        }
        let at = block * cols + col;
        let plane = blocks * cols;
        partials[at] = square;
        partials[plane + at] = abs;
        partials[2 * plane + at] = max;
    }
}
